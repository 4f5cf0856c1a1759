"""The coordinator's end of a local worker's output pipes: what the worker wrote outlives it.

A worker on this machine (``ipc://``) writes its output into FIFOs that the coordinator makes
in the worker's socket directory before the worker starts, and whose read ends it opens then
(``OutputPipes``): it never opens a path a worker could have touched.  What the pipes carry is
``worker.contract.output``: ``out`` the output frames, ``fd1`` and ``fd2`` the pipes behind the
worker's fd 1 and 2, which the coordinator reads only once the worker is dead (``leftovers``),
for what its pump had not moved into ``out`` yet.

Nothing read here is trusted: whatever ``contract.output.OutputReader`` refuses is an
``OutputError`` (the session ends the worker), and every read is bounded.  A frame cut by the
worker's death is dropped; of a moved chunk, what arrived is delivered.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import termios
from pathlib import Path

from engine.errors import OutputError
from worker.contract.framing import FrameError
from worker.contract.limits import STDERR, STDOUT
from worker.contract.output import NAMES, OutputReader
from worker.contract.schema import ContractError
from worker.contract.wire import Out

#: Size ``out`` grows to once the worker fills half of it (the kernel may give less): room for
#: a few output batches, so a worker that streams seldom waits for the coordinator to read.
#: Only then: pipe memory counts against a per-user quota (``/proc/sys/fs/pipe-user-pages-*``)
#: past which every new pipe of that user gets one of 8 KiB, and most workers print little.
OUT_PIPE_BYTES = 512 * 1024  # (larger ones stream no faster here, and 2 MiB streams slower)
_READ_END = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW


def _queued(fd: int) -> int:
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder, signed=True)


class OutputPipes:
    """The three FIFOs of one worker, made in ``directory`` (the coordinator's, read-only to
    the worker), and the coordinator's read ends of them (non-blocking, close-on-exec)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fds: dict[str, int] = {}
        try:
            for name in NAMES:
                os.mkfifo(directory / name, 0o600)
                self.fds[name] = os.open(directory / name, _READ_END)
        except OSError:
            self.close()
            raise
        self.out = self.fds[NAMES[0]]
        #: What ``out`` holds at most: reading this much is reading all that waits in it.
        self.capacity = 65536
        self._grown = False
        self.ended = False  # ``out`` reached its end: no writer is left
        self._reader = OutputReader()

    def read(self, budget: int, probe: bool = False) -> int:
        """Read what waits in ``out`` now, at most ``budget`` bytes; how many were read.
        ``probe``: try even when nothing waits (the pipe was seen readable: its end?), which
        sets ``ended`` at the end of the file."""
        if self.ended:
            return 0
        want = min(_queued(self.out), budget)
        if not want and not probe:
            return 0
        if want >= self.capacity // 2 and not self._grown:
            self._grow()
        try:
            data = os.read(self.out, want or min(65536, budget))
        except BlockingIOError:
            return 0
        if not data:
            self.ended = True
            return 0
        self._reader.feed(data)
        return len(data)

    def _grow(self) -> None:
        self._grown = True
        with contextlib.suppress(OSError, AttributeError):  # past the user's pipe quota: as it is
            fcntl.fcntl(self.out, fcntl.F_SETPIPE_SZ, OUT_PIPE_BYTES)
        with contextlib.suppress(OSError, AttributeError):
            self.capacity = max(self.capacity, fcntl.fcntl(self.out, fcntl.F_GETPIPE_SZ))

    def next(self) -> Out | None:
        """The next whole message read from ``out`` (a moved chunk as one), or None until more
        is read.  Raises OutputError."""
        try:
            return self._reader.next()
        except (ContractError, FrameError) as exc:
            raise OutputError(str(exc)) from None

    def leftovers(self, limit: int) -> list[tuple[int, bytes]]:
        """After the worker died: what waits in ``fd1`` and ``fd2``, which its pump had not
        moved, at most ``limit`` bytes of each (a subprocess that outlived it may still write)."""
        found = []
        for stream, name in zip((STDOUT, STDERR), NAMES[1:], strict=True):
            fd = self.fds.get(name)
            pieces: list[bytes] = []
            got = 0
            while fd is not None and got < limit:
                try:
                    data = os.read(fd, min(65536, limit - got))
                except OSError:  # BlockingIOError: nothing more now
                    break
                if not data:
                    break
                pieces.append(data)
                got += len(data)
            if pieces:
                found.append((stream, b"".join(pieces)))
        return found

    def unlink(self) -> None:
        """Remove the FIFOs' names once the worker has opened them: nobody can open them again."""
        for name in NAMES:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}
        self._reader = OutputReader()
