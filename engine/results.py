"""What running a block produces: live output chunks, then exactly one ``BlockResult``."""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["BlockResult", "OutputChunk", "Status", "describe_exit"]

Status = Literal["ok", "error", "timeout", "cancelled", "died", "killed"]


@dataclass(frozen=True)
class OutputChunk:
    """Output of a running block, as it arrives.  ``stream`` is "stdout" or "stderr"."""

    block_id: str
    stream: str
    data: bytes


@dataclass
class BlockResult:
    """How a block ended.

    ``status``: ok (finished), error (raised; ``error`` holds the user's traceback),
    timeout (hit its deadline), cancelled (stopped on request), died (the worker crashed),
    killed (the worker was killed because of another block).  A timeout or a cancel is an
    interrupt first: a ``TimeoutError`` (for a cancel, a ``KeyboardInterrupt``) raised where the
    code waits; when the code stops, ``error`` holds its traceback, ``worker_killed`` is false,
    the namespace is kept and ``message`` says what was raised.  Only code the interrupt cannot
    stop is killed, and ``message`` says which it was.  A ``SystemExit`` is ok (status
    0) or error, with ``exit_code`` set (``exited``).  ``message`` says in words what
    happened whenever the status is not ok; ``lost_vars`` names the variables a worker
    kill took with it; ``over_memory``: the worker died because the kernel killed it for its
    memory limit (status died).
    """

    id: str
    status: Status
    output: str
    output_bytes: int
    truncated: bool
    output_file: str | None
    duration_s: float
    error: str = ""
    message: str = ""
    signal: int | None = None
    exit_code: int | None = None
    worker_killed: bool = False
    lost_vars: list[str] = field(default_factory=list)
    over_memory: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def exited(self) -> bool:
        """The code raised ``SystemExit`` (``exit_code`` is its status); the worker lives on."""
        return self.exit_code is not None and self.status in ("ok", "error")

    def refused_write(self) -> bool:
        """Whether the code ended on a write the file system refused (EROFS, EACCES): the
        sandbox's rule, most likely, which the caller then states."""
        if self.status != "error":
            return False
        tail = (self.error or self.output[-4096:]).rstrip().rsplit("\n", 1)[-1]
        return "[Errno 30] Read-only file system" in tail or "[Errno 13] Permission denied" in tail

    def text(self) -> str:
        """Output, traceback and a ``[what happened]`` suffix, concatenated as the seed does
        (``output + "[timed out]"``), for a model or a log."""
        return self.output + self.error + (f"[{self.message}]" if self.message else "")


def writable_note(workspace: str | Path) -> str:
    """The one line said after code that ended on a refused write (``BlockResult.refused_write``),
    by ``exec`` to its user and by the MCP server to its client's model: where it may write."""
    return f"in this sandbox code writes only to the workspace ({workspace}) and $TMPDIR; the rest is read-only"


def describe_exit(returncode: int | None, *, via_namespace: bool) -> tuple[str, int | None]:
    """Words for a worker's end, and the signal that ended it (if any).

    bubblewrap reports a child killed by signal N as exit status 128+N.
    """
    if returncode is None:
        return "worker died", None
    sig = -returncode if returncode < 0 else (returncode - 128 if via_namespace and returncode > 128 else None)
    if sig:
        try:
            name = _signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"worker died: signal {sig} ({name})", sig
    return f"worker died: exit code {returncode}", None
