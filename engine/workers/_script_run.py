"""A block run as ``python FILE ARGS`` runs a script: what ``agentloop exec`` asks of a worker.

The worker side is ``worker.script_run``.  Here: what the coordinator says (``ScriptRun``), and the
forwarding of a file descriptor (``exec``'s own stdin) to the code's ``sys.stdin``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.contract import wire

__all__ = ["STDIN_CAP", "ScriptRun", "forward_stdin"]

log = logging.getLogger("agentloop")

#: Bytes of stdin forwarded at most; the code sees an end of file there (and a warning says
#: so).  The worker holds what it was sent until the code reads it, so this bounds its memory.
STDIN_CAP = 16 * 1024 * 1024
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ScriptRun:
    """How to run a block as a script.  ``path``: the file's absolute path (``__file__``, the
    name in tracebacks and warnings), None for code read from stdin (named ``<stdin>``);
    ``argv``: ``sys.argv``, the file as given first; ``stdin``: a file descriptor whose bytes
    reach the code's ``sys.stdin`` as they arrive (None: the code reads an end of file).

    A script run sets the worker process's ``sys.argv``, ``sys.stdin`` and ``sys.path[0]``,
    and runs its ``atexit`` handlers at the end: give it a worker of its own."""

    path: str | None
    argv: list[str] = field(default_factory=list)
    stdin: int | None = None

    def spec(self) -> wire.ScriptSpec:
        return wire.ScriptSpec(self.path, tuple(self.argv), self.stdin is not None)


def forward_stdin(fd: int, send: Callable[[wire.Message], None], block_id: str, done: Callable[[], bool]) -> None:
    """Read ``fd`` in a daemon thread and send its bytes to the block as ``stdin`` messages, in
    chunks of up to 64 KiB, until its end, ``STDIN_CAP``, or the block's end (``done``).

    A thread, not the event loop: a terminal or a pipe nobody closes may never answer, and
    the command must end when the code does, not when its stdin does.  Reads are coalesced
    while more is waiting, so a fast producer makes few large messages."""
    loop = asyncio.get_running_loop()

    def post(data: bytes, eof: bool) -> None:
        loop.call_soon_threadsafe(send, wire.Stdin(block_id, data, eof))

    def pump() -> None:
        total = 0
        try:
            while not done():
                data = os.read(fd, _CHUNK)
                while data and len(data) < _CHUNK and select.select([fd], [], [], 0)[0]:
                    more = os.read(fd, _CHUNK - len(data))
                    if not more:
                        break
                    data += more
                if not data:
                    break
                if total + len(data) > STDIN_CAP:
                    post(data[:STDIN_CAP - total], True)
                    log.warning("stdin beyond %d MiB is not forwarded: the code reads an end of file there",
                                STDIN_CAP // 2**20)
                    return
                total += len(data)
                post(data, False)
        except OSError as exc:
            log.warning("stdin could not be read: %s", exc)
        except RuntimeError:  # the event loop closed: the command is ending
            return
        try:
            post(b"", True)
        except RuntimeError:
            pass

    threading.Thread(target=pump, name="agentloop-stdin", daemon=True).start()
