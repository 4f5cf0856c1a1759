"""What running a block produces: live output chunks, its output bounded, then exactly one ``BlockResult``.

A block may print a gigabyte; the coordinator keeps ``head_bytes + tail_bytes`` of it in
memory with an exact count of what lies between, and streams the whole of it to a file
(``OutputSink``).  The file is created only once the output outgrows the head, so small blocks
leave no files behind.  What the files may hold is capped three times: each file at
``file_cap`` bytes, all the files of a run together (``OutputBudget``, ``OUTPUT_CAP``), and all
the runs of a batch together (a budget the runs' budgets draw from, ``BATCH_OUTPUT_CAP``).  A
file that was cut ends with a line saying so, and the text the model reads says the file holds
only a part (or that nothing was kept) and which cap did it.
"""

from __future__ import annotations

import os
import signal as _signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["BATCH_OUTPUT_CAP", "DISPLAY_WORDS", "FILE_CAP", "HEAD_BYTES", "OUTPUT_CAP", "BlockResult", "OutputBudget", "OutputChunk",
           "OutputSink", "Shown", "Status", "TAIL_BYTES", "describe_exit", "displays_words", "writable_note"]

Status = Literal["ok", "error", "timeout", "cancelled", "died", "killed"]


@dataclass(frozen=True)
class OutputChunk:
    """Output of a running block, as it arrives.  ``stream`` is "stdout" or "stderr"."""

    block_id: str
    stream: str
    data: bytes


@dataclass(frozen=True)
class Shown:
    """One display of a block (``display(obj)``, a matplotlib figure, ``Image.show()``), as the
    coordinator keeps it: each representation a reader looks at (a PNG, an SVG, HTML) in a file
    of the run, ``files`` mapping its MIME type to the path, and the text a reader of text gets
    (the bundle's Markdown, else its plain text).  ``width`` and ``height`` are the PNG's, read
    from its header; ``note`` says what was not kept and why (the run's output cap)."""

    index: int
    files: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    text: str = ""
    text_type: str = ""
    width: int | None = None
    height: int | None = None
    note: str = ""

    @property
    def png(self) -> str | None:
        """The PNG's file, if the display is one and it was kept."""
        return self.files.get("image/png")

    def line(self) -> str:
        """The display in one line for a reader of text: ``[image 640×480 PNG: PATH]``, or the
        kind, size and file of what it holds; "" for a display that is text alone."""
        for mime, words in (("image/png", "PNG"), ("image/svg+xml", "SVG"), ("text/html", "HTML")):
            if mime not in self.sizes:
                continue
            where = self.files.get(mime) or f"not kept: {self.note}"
            if mime == "image/png":
                return f"[image {self.width}×{self.height} PNG: {where}]"
            if mime == "text/html" and self.text:
                return ""  # its text says it (a table's plain text, say)
            return f"[{'image ' if mime != 'text/html' else ''}{words}, {_bytes(self.sizes[mime])}: {where}]"
        return ""

    def words(self) -> str:
        """What a reader of text is given for the display: its line, or its text."""
        line = self.line()
        if line:
            return line + "\n"
        return self.text if self.text.endswith("\n") or not self.text else self.text + "\n"


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
    #: What the block displayed, in order (``Shown``): images and rich representations.
    displays: list[Shown] = field(default_factory=list)

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
        """Output, what it displayed (``displays_words``), traceback and a ``[what happened]``
        suffix, concatenated as the seed does (``output + "[timed out]"``), for a model or a log."""
        shown = displays_words(self.displays)
        if shown and self.output and not self.output.endswith("\n"):
            shown = "\n" + shown
        return self.output + shown + self.error + (f"[{self.message}]" if self.message else "")


#: Characters of what a block displayed that its result's text holds, at most.
DISPLAY_WORDS = 16_000


def displays_words(displays: list[Shown], limit: int = DISPLAY_WORDS) -> str:
    """What a reader of text is given for ``displays``: each one's line (an image's size and
    file) or its text, within ``limit`` characters (the rest counted)."""
    out: list[str] = []
    used = 0
    for position, shown in enumerate(displays):
        words = shown.words()
        if used + len(words) > limit:
            out.append(f"[... {len(displays) - position} more displays not shown as text]\n")
            break
        out.append(words)
        used += len(words)
    return "".join(out)


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


# ---------------------------------------------------------------- output, bounded

MiB = 1024 * 1024
HEAD_BYTES = 64 * 1024
TAIL_BYTES = 64 * 1024
FILE_CAP = 256 * MiB
#: What the output files of one run may hold in all, by default.
OUTPUT_CAP = 1024 * MiB
#: What the output files of a batch's runs (on one machine) may hold in all, by default.
BATCH_OUTPUT_CAP = 4096 * MiB


class OutputBudget:
    """Bytes the output files of a run (or of several, sharing it) may still take.

    ``parent``: a budget shared with other runs that every grant is also taken from (a
    batch's).  Used from one event loop; nothing is given back (a file that is removed
    later still counted: what is kept is what counts, and a kept run keeps its files)."""

    def __init__(self, limit: int, *, parent: OutputBudget | None = None, owner: str = "the run's") -> None:
        self.limit = limit
        self.left = limit
        self.parent = parent
        self.owner = owner

    def take(self, wanted: int) -> tuple[int, OutputBudget | None]:
        """How many of ``wanted`` bytes may be written, taken from this budget and its
        parents, and the budget that cut it short (None when all were granted)."""
        granted, short = min(wanted, self.left), None
        if granted < wanted:
            short = self
        if self.parent is not None:
            granted, parent_short = self.parent.take(granted)
            short = parent_short or short
        self.left -= granted
        return granted, short

    @property
    def spent(self) -> bool:
        return self.left <= 0 or (self.parent is not None and self.parent.spent)

    def exhausted(self) -> OutputBudget:
        """The budget (this one or a parent) that has nothing left."""
        return self.parent.exhausted() if self.parent is not None and self.parent.spent else self

    def why(self) -> str:
        return f"{self.owner} output files reached their cap of {_size(self.limit)}"


def _bytes(n: int) -> str:
    return f"{max(1, round(n / 1024))} KiB" if n < MiB else f"{n / MiB:.1f} MiB"


def _size(n: int) -> str:
    return f"{n / (1024 * MiB):g} GiB" if n >= 1024 * MiB and n % (64 * MiB) == 0 else f"{n / MiB:.0f} MiB"


class OutputSink:
    """Collects one block's output; memory use is bounded whatever the block prints."""

    def __init__(self, path: Path | Callable[[], Path] | None, *, head_bytes: int = HEAD_BYTES,
                 tail_bytes: int = TAIL_BYTES, file_cap: int = FILE_CAP,
                 budget: OutputBudget | None = None) -> None:
        self.path = path
        self.head_bytes = head_bytes
        self.tail_bytes = tail_bytes
        self.file_cap = file_cap
        self.budget = budget
        self.total = 0
        self._head = bytearray()
        self._tail = bytearray()
        self._fh = None  # binary file object, once the output outgrows the head
        self._written = 0
        self._file_used = False
        self.cut_by = ""  # why the file holds less than the whole output (or none was made)

    def add(self, data: bytes) -> None:
        if (self.path is not None and not self._file_used
                and self.total + len(data) > self.head_bytes):
            self._open_file()  # from here on, everything goes to the file as well
        self.total += len(data)
        room = self.head_bytes - len(self._head)
        if room > 0:
            self._head += data[:room]
            data_rest = data[room:]
        else:
            data_rest = data
        if len(data_rest) >= self.tail_bytes:  # a big chunk replaces the tail: never grow by it
            self._tail = bytearray(data_rest[-self.tail_bytes:])
        elif data_rest:
            self._tail += data_rest
            if len(self._tail) > 2 * self.tail_bytes:  # amortised trim
                del self._tail[: len(self._tail) - self.tail_bytes]
        if self._fh is not None:
            self._write(data)

    def _open_file(self) -> None:
        self._file_used = True
        if self.budget is not None and self.budget.spent:  # not even an empty file
            self.cut_by = self.budget.exhausted().why()
            self.path = None
            return
        if callable(self.path):  # named only when needed: most blocks never need a file
            self.path = self.path()
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        self._fh = os.fdopen(fd, "wb")
        self._write(bytes(self._head))

    def _write(self, data: bytes) -> None:
        room = max(0, self.file_cap - self._written)
        n = min(len(data), room)
        if n < len(data) and not self.cut_by:
            self.cut_by = f"the file's cap of {_size(self.file_cap)}"
        if self.budget is not None and n:
            n, short = self.budget.take(n)
            if short is not None and not self.cut_by:
                self.cut_by = short.why()
        if n:
            self._fh.write(data if n == len(data) else data[:n])
            self._written += n

    def close(self) -> None:
        if self._fh is not None:
            if self.total > self._written:
                note = (f"\n[agentloop: output cut here: {self.cut_by}; "
                        f"{self.total - self._written} more bytes were not kept]\n")
                self._fh.write(note.encode())
            self._fh.close()
            self._fh = None

    @property
    def truncated(self) -> bool:
        return self.total > self.head_bytes + self.tail_bytes

    @property
    def file(self) -> Path | None:
        return self.path if self._file_used else None

    @property
    def file_complete(self) -> bool:
        """Whether the file (if any) holds the whole output."""
        return self.file is not None and self._written == self.total

    def render(self, budget: int | None = None) -> str:
        """The output as text: whole when it fits ``budget`` (default: what is kept), else
        head and tail with the exact number of bytes cut and the file that holds all."""
        limit = budget if budget is not None else self.head_bytes + self.tail_bytes
        tail = bytes(self._tail[-self.tail_bytes:]) if self._tail else b""
        if self.total <= limit and self.total == len(self._head) + len(tail):
            return (bytes(self._head) + tail).decode("utf-8", "replace")
        head_n = min(len(self._head), limit // 2)
        tail_n = min(len(tail), limit - head_n)
        cut = self.total - head_n - tail_n
        where = ""
        if self.file_complete:
            where = f"; the whole output is in {self.file}"
        elif self.file is not None:
            where = f"; only its first {self._written} bytes are in {self.file} ({self.cut_by})"
        elif self.cut_by:
            where = f"; none of it was kept in a file ({self.cut_by})"
        note = f"\n[... {cut} bytes cut{where} ...]\n"
        return (bytes(self._head[:head_n]).decode("utf-8", "replace") + note
                + tail[len(tail) - tail_n:].decode("utf-8", "replace"))
