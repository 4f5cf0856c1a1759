"""Per-block output capture inside the worker.

Python-level writes (``print``, ``sys.stdout.write``, threads a block started, tasks it
spawned) are routed by a context variable that names the block, so two concurrent blocks
never mix.  fd-level writes (a subprocess, a C extension writing to fd 1/2) cannot be
attributed that way: they go through a pipe and land in the block that runs when only one
runs; with several running, in the one that started first.  Output written while no block
runs is kept and handed to the next block, so nothing is dropped.

Batches leave at most every ``FLUSH_INTERVAL`` seconds while there is new output, with no
flush needed in user code.  A writer thread that gets more than ``HIGH_WATER`` bytes ahead
of the socket waits: output exerts backpressure instead of growing without bound.
"""

from __future__ import annotations

import asyncio
import contextvars
import fcntl
import os
import select
import struct
import termios
import threading
import time
from collections.abc import Awaitable, Callable

from .wire import STDERR, STDOUT

FLUSH_INTERVAL = 0.05
HIGH_WATER = 4 * 1024 * 1024
MAX_BATCH = 256 * 1024
MAX_STRAY = 1024 * 1024

#: The block the current thread or task writes for; None outside any block.
current_block: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentloop_block", default=None)


class Router:
    """Collects output per block and feeds it, batched, to ``send`` on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 send: Callable[[dict], Awaitable[None]]) -> None:
        self._loop = loop
        self._send = send
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._pending: dict[str, list[list]] = {}
        self._pending_bytes = 0
        self._armed = False
        self._running: list[str] = []  # in start order
        self._running_set: set[str] = set()
        self._stray: list[list] = []
        self._stray_bytes = 0
        self._loop_thread = threading.get_ident()
        self._flush_lock = asyncio.Lock()  # one flush at a time: bounds what is in flight
        self._urgent = False

    # -- block lifecycle ----------------------------------------------------------------
    def begin(self, block_id: str) -> None:
        with self._lock:
            self._running.append(block_id)
            self._running_set.add(block_id)
            if self._stray:
                self._pending.setdefault(block_id, []).extend(self._stray)
                self._stray, self._stray_bytes = [], 0
                self._arm_locked()

    def end(self, block_id: str) -> None:
        with self._lock:
            if block_id in self._running_set:
                self._running.remove(block_id)
                self._running_set.discard(block_id)

    # -- writing (any thread) -----------------------------------------------------------
    def write(self, stream: int, data: bytes, block_id: str | None = None) -> None:
        # The hot path of every print: keep it to one lock and a few dict and list operations.
        size = len(data)
        if not size:
            return
        target = block_id or current_block.get()
        with self._lock:
            if target is None or target not in self._running_set:
                target = self._running[0] if self._running else None
                if target is None:
                    if self._stray_bytes < MAX_STRAY:
                        self._stray.append([stream, data])
                        self._stray_bytes += size
                    return
            chunks = self._pending.get(target)
            if chunks is None:
                chunks = self._pending[target] = []
            last = chunks[-1] if chunks else None
            if last is not None and last[0] == stream and len(last[1]) < MAX_BATCH:
                last[1] += data
            else:
                chunks.append([stream, bytearray(data)])
            pending = self._pending_bytes = self._pending_bytes + size
            if not self._armed:
                self._arm_locked()
            if pending >= MAX_BATCH and not self._urgent:
                # A full batch is waiting: send it now rather than at the next tick, so a
                # fast writer is limited by the socket, not by the flush interval.
                self._urgent = True
                self._loop.call_soon_threadsafe(self._tick)
            if pending > HIGH_WATER and threading.get_ident() != self._loop_thread:
                # Backpressure for writer threads; the loop thread itself must never wait here.
                deadline = time.monotonic() + 30
                while self._pending_bytes > HIGH_WATER and time.monotonic() < deadline:
                    self._drained.wait(0.05)

    def _arm_locked(self) -> None:
        if not self._armed:
            self._armed = True
            self._loop.call_soon_threadsafe(self._loop.call_later, FLUSH_INTERVAL, self._tick)

    def _tick(self) -> None:
        self._loop.create_task(self.flush())

    # -- sending (event loop) -----------------------------------------------------------
    def _take(self, block_id: str | None) -> list[tuple[str, list[list]]]:
        with self._lock:
            if block_id is None:
                taken, self._pending = list(self._pending.items()), {}
                self._armed = False
                self._urgent = False
            else:
                chunks = self._pending.pop(block_id, None)
                taken = [(block_id, chunks)] if chunks else []
            self._pending_bytes -= sum(len(d) for _, cs in taken for _, d in cs)
            self._drained.notify_all()
        return taken

    async def flush(self, block_id: str | None = None) -> None:
        """Send what is pending: for one block (before its ``done``) or for all."""
        if block_id is not None and block_id not in self._pending and not self._flush_lock.locked():
            return  # nothing of it pending, and no flush in flight that could hold some
        async with self._flush_lock:
            await self._flush_locked(block_id)

    async def _flush_locked(self, block_id: str | None) -> None:
        for bid, chunks in self._take(block_id):
            batch: list[list] = []
            size = 0
            for stream, data in chunks:
                batch.append([stream, bytes(data)])
                size += len(data)
                if size >= MAX_BATCH:
                    await self._send({"t": "out", "id": bid, "o": batch})
                    batch, size = [], 0
            if batch:
                await self._send({"t": "out", "id": bid, "o": batch})


class TextStream:
    """What ``sys.stdout``/``sys.stderr`` become: a text stream that routes by block."""

    encoding = "utf-8"
    errors = "backslashreplace"
    newlines = None
    line_buffering = False

    def __init__(self, router: Router, stream: int) -> None:
        self._router = router
        self._stream = stream
        self._write = router.write
        self.buffer = _BinaryStream(router, stream)

    def write(self, s: str) -> int:
        if type(s) is not str and not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self._write(self._stream, s.encode("utf-8", "backslashreplace"))
        return len(s)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self._stream  # fd 1/2 are the capture pipes: subprocesses land in the same place

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        pass


class _BinaryStream:
    def __init__(self, router: Router, stream: int) -> None:
        self._router = router
        self._stream = stream

    def write(self, b: bytes) -> int:
        self._router.write(self._stream, bytes(b))
        return len(b)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self._stream

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True


class NoInput:
    """``sys.stdin``: there is no interactive input in a worker; reading says so at once."""

    encoding = "utf-8"
    closed = False
    _MESSAGE = ("no interactive input: code run by agentloop has an empty stdin; "
                "put the data in the code or in a file instead")

    def _refuse(self, *args, **kwargs):
        raise EOFError(self._MESSAGE)

    read = readline = readlines = __next__ = _refuse

    def __iter__(self):
        return self

    def fileno(self) -> int:
        return 0

    def isatty(self) -> bool:
        return False

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        pass


class FdCapture:
    """Replaces fd 1 and 2 with pipes drained by a thread into the router.

    The worker's original stderr is kept as ``diag_fd`` for its own last words (a fatal
    error before the socket is up); user code never writes there.
    """

    def __init__(self, router: Router) -> None:
        self._router = router
        self.diag_fd = os.dup(2)
        os.set_inheritable(self.diag_fd, False)
        self._reads: dict[int, int] = {}
        for fd, stream in ((1, STDOUT), (2, STDERR)):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, True)
            self._reads[r] = stream
        self._busy = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="agentloop-fd", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        fds = list(self._reads)
        while fds:
            ready, _, _ = select.select(fds, [], [])
            with self._busy:
                for fd in ready:
                    data = os.read(fd, 65536)
                    if data:
                        self._router.write(self._reads[fd], data)
                    else:
                        fds.remove(fd)

    def drain(self, timeout: float = 0.05) -> None:
        """Wait (briefly) until what was written to fd 1/2 so far has been routed."""
        deadline = time.monotonic() + timeout
        buf = bytearray(4)
        while True:
            queued = 0
            for fd in self._reads:
                fcntl.ioctl(fd, termios.FIONREAD, buf)
                queued += struct.unpack("i", bytes(buf))[0]
            if queued == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        with self._busy:  # the pump finished routing whatever it had read
            pass


def inherit_block_in_threads() -> None:
    """Make threads started by a block write for that block.

    Threads start with an empty context (before Python 3.14), so the block a thread was
    started from is carried over explicitly.
    """
    original_start = threading.Thread.start
    original_bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def start(self, *args, **kwargs):
        self._agentloop_block = current_block.get()
        return original_start(self, *args, **kwargs)

    def bootstrap_inner(self):
        block = getattr(self, "_agentloop_block", None)
        if block is not None:
            current_block.set(block)
        return original_bootstrap(self)

    threading.Thread.start = start  # type: ignore[method-assign]
    threading.Thread._bootstrap_inner = bootstrap_inner  # type: ignore[attr-defined]
