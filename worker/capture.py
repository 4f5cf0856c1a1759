"""Per-block output capture inside the worker.

Python-level writes (``print``, ``sys.stdout.write``, threads a block started, tasks it
spawned) are routed by a context variable that names the block, so two concurrent blocks
never mix.  fd-level writes (a subprocess, a C extension writing to fd 1/2) cannot be
attributed that way: they go through a pipe and land in the block that runs when only one
runs; with several running, in the one that started first.  Output written while no block
runs is kept (up to ``MAX_STRAY``) and handed to the next block, so nothing is dropped.

A ``print`` costs a dictionary lookup and a deque append: text is encoded and framed only
when it is sent.  A block's output leaves when ``MAX_BATCH`` of it waits (sent by the thread
that wrote it, which therefore waits while the coordinator is behind: output exerts
backpressure instead of growing without bound), at the listener's tick every
``FLUSH_INTERVAL`` seconds, before the block's ``done``, and at once when the code calls
``flush()`` (``print(..., flush=True)``).  The pump sends fd-level output as it comes.

What survives the worker's death (``os._exit``, SIGKILL, a segfault, the OOM killer), with a
local coordinator (its output pipes, see ``_outpipe``): everything written to fd 1/2, by the
worker, its subprocesses or C code, and every Python-level write that was flushed (or sent
because a batch filled, or at a tick) before the death.  What was printed and not flushed may
be lost, as CPython loses a block-buffered stdout that was not flushed.  ``os._exit`` called
from Python sends that too (see ``serve``).  A remote worker (``tcp://``) sends its output over
the socket, whose I/O thread a SIGKILL can stop before it has written what it was handed.
Under a terminal (``StartSpec.tty``: fd 1/2 are a pty), bytes in the pty that the pump had not
read yet die with the worker.
"""

from __future__ import annotations

import collections
import contextvars
import fcntl
import io
import os
import select
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable

from .contract.limits import STDERR, STDOUT
from .contract.wire import Out

__all__ = [
    "FLUSH_INTERVAL", "FdCapture", "MAX_BATCH", "MAX_STRAY", "NoInput", "Router", "SENDING_CODES",
    "TextStream", "after_send", "current_block", "hide_runtime_threads", "inherit_block_in_threads",
    "plain_streams_in_children", "queued"
]

FLUSH_INTERVAL = 0.05
MAX_BATCH = 256 * 1024
MAX_STRAY = 1024 * 1024
_ENCODING = ("utf-8", "backslashreplace")

#: The block the current thread or task writes for; None outside any block.
current_block: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentloop_block", default=None)


def _nothing() -> None:
    pass


#: Called by a thread that has sent output (``Router.send_out``), once it is sent: the runtime
#: raises there an interrupt it put off while the output was on its way out (see ``runtime``).
after_send: Callable[[], None] = _nothing


class _Out:
    """What one running block wrote and was not sent yet: (stream, str | bytes) in order.

    Appends need no lock (a deque append is atomic); ``size`` is approximate under
    concurrent writers, which only moves the moment a batch leaves."""

    __slots__ = ("block", "parts", "size", "ended")

    def __init__(self, block: str | None) -> None:
        self.block = block
        self.parts: collections.deque = collections.deque()
        self.size = 0
        self.ended = False


class Router:
    """Collects output per running block and sends it, batched, with ``send`` (thread-safe).

    With the coordinator's output pipes, ``send`` writes to them, ``move`` moves fd-level output
    into them, and ``last`` (the socket) carries what a block wrote and had not sent when it
    ended, together with its ``done``: one wake-up of the coordinator for both, where the pipe
    and the socket would cost two on the round trip of a short block.  That output was never
    flushed, so nothing that must outlive a death takes that way; the coordinator reads the
    pipe before it acts on a message from the socket, so the order holds."""

    def __init__(self, send: Callable[[dict], None], *,
                 move: Callable[[str, int, int, int], None] | None = None,
                 last: Callable[[dict], None] | None = None) -> None:
        self._send = send
        self._move = move
        self._last = last or send
        self.outs: dict[str | None, _Out] = {}  # running blocks, in start order
        self._lock = threading.Lock()  # changes to ``outs`` and the stray output
        self._sending = threading.Lock()  # one sender of output at a time keeps the order
        self._stray = _Out(None)
        self._next_tick = 0.0

    # -- block lifecycle ----------------------------------------------------------------
    def begin(self, block_id: str) -> None:
        out = _Out(block_id)
        with self._lock:
            stray = self._stray.parts
            while stray:
                out.parts.append(stray.popleft())
            out.size, self._stray.size = self._stray.size, 0
            self.outs[block_id] = out

    def end(self, block_id: str) -> None:
        """The block finished: send everything it wrote (before its ``done``, which the caller
        sends next).  Late writes from threads it left running go to another block."""
        with self._lock:
            out = self.outs.pop(block_id, None)
        if out is not None:
            out.ended = True
            self.send_out(out, self._last)
            if out.parts:  # a thread of the block wrote while it was being sent
                self.late(out)
        else:
            with self._sending:  # a tick may still be sending this block's output: wait for it
                pass

    # -- writing (any thread) -----------------------------------------------------------
    def write(self, stream: int, data: bytes | str, block_id: str | None = None) -> _Out | None:
        """Route one write: to ``block_id`` (or the current block) if it runs, else to the
        block that started first, else to the stray output.  Returns the block's queue it
        went to (None: stray)."""
        if not data:
            return None
        out = self.outs.get(block_id or current_block.get())
        if out is None:
            with self._lock:
                out = next(iter(self.outs.values()), None)
                if out is None:
                    if self._stray.size < MAX_STRAY:
                        self._stray.parts.append((stream, data))
                        self._stray.size += len(data)
                    return None
        out.parts.append((stream, data))
        size = out.size = out.size + len(data)
        if size >= MAX_BATCH:
            self.send_out(out)
        if out.ended:
            self.late(out)
        return out

    def move(self, stream: int, fd: int) -> bool:
        """Send what waits in capture pipe ``fd`` (at most ``MAX_BATCH``) to the block that
        started first, after what that block wrote before, moved by the kernel from the pipe
        into the output (``_move``): no byte is ever only in this process's memory.  False when
        nothing can be moved (no block runs, no output pipes, or nothing waits): the caller
        reads it instead."""
        if self._move is None or not self.outs:
            return False
        size = min(queued(fd), MAX_BATCH)
        if size <= 0:
            return False
        with self._sending:
            # Under the send lock: a block that ends now sends its last output, then its
            # ``done``, only after this.
            with self._lock:
                out = next(iter(self.outs.values()), None)
            if out is None:
                return False
            self._send_locked(out)
            self._move(out.block, stream, fd, size)  # type: ignore[arg-type]
        return True

    def late(self, out: _Out) -> None:
        """Output appended to a block that has ended: give it to a running block (or keep it)."""
        parts = []
        while out.parts:
            try:
                parts.append(out.parts.popleft())
            except IndexError:
                break
        for stream, data in parts:
            self.write(stream, data, out.block)

    # -- sending --------------------------------------------------------------------------
    def send_out(self, out: _Out, send: Callable[[dict], None] | None = None) -> None:
        with self._sending:
            self._send_locked(out, send)
        after_send()

    def tick(self) -> float | None:
        """Send every block's waiting output if a tick is due; seconds until the next one is
        (None while no block runs).  Called by the listening thread; it never waits here for
        another sender."""
        if not self.outs:
            return None
        now = time.monotonic()
        if now < self._next_tick:
            return self._next_tick - now
        self._next_tick = now + FLUSH_INTERVAL
        if self._sending.acquire(blocking=False):
            try:
                for out in list(self.outs.values()):
                    self._send_locked(out)
            finally:
                self._sending.release()
        return FLUSH_INTERVAL

    def owner(self, block_id: str | None = None) -> str | None:
        """The running block a write for ``block_id`` (default: the current block) goes to: that
        block, else the one that started first; None while no block runs."""
        block = block_id or current_block.get()
        if block in self.outs:
            return block
        with self._lock:
            return next(iter(self.outs), None)

    def flush_block(self, block_id: str | None = None) -> None:
        """Send what ``block_id`` (default: the current block) wrote and is not sent yet."""
        out = self.outs.get(block_id or current_block.get())
        if out is not None and out.parts:
            self.send_out(out)

    def flush_all(self) -> None:
        with self._sending:
            for out in list(self.outs.values()):
                self._send_locked(out)

    def _send_locked(self, out: _Out, send: Callable[[dict], None] | None = None) -> None:
        send = send or self._send
        parts = out.parts
        count = len(parts)
        if not count:
            return
        out.size = 0
        # Runs of one stream, each joined and encoded once.
        runs: list[tuple[int, list]] = []
        stream = None
        pieces: list = []
        for _ in range(count):
            try:
                st, data = parts.popleft()
            except IndexError:  # ``late`` took the rest: a thread of an ended block wrote
                break
            if st != stream:
                pieces = []
                runs.append((st, pieces))
                stream = st
            pieces.append(data)
        batch: list[list] = []
        size = 0
        for st, pieces in runs:
            data = _join(pieces)
            for start in range(0, len(data), MAX_BATCH):
                piece = data[start:start + MAX_BATCH] if len(data) > MAX_BATCH else data
                batch.append([st, piece])
                size += len(piece)
                if size >= MAX_BATCH:
                    send(Out(out.block, batch))
                    batch, size = [], 0
        if batch:
            send(Out(out.block, batch))



#: The code objects that send output: an interrupt that lands in one of them would lose what is
#: on its way out, so the runtime puts it off until they are left (``runtime._put_off``).
SENDING_CODES = frozenset(f.__code__ for f in (Router.send_out, Router._send_locked, Router.flush_all))

def _join(pieces: list) -> bytes:
    try:
        return "".join(pieces).encode(*_ENCODING)
    except TypeError:  # bytes among them (binary writes, fd output)
        return b"".join(p if isinstance(p, bytes) else p.encode(*_ENCODING) for p in pieces)


class TextStream:
    """What ``sys.stdout``/``sys.stderr`` become: a text stream that routes by block."""

    encoding = "utf-8"
    errors = "backslashreplace"
    newlines = None
    line_buffering = False

    def __init__(self, router: Router, stream: int) -> None:
        self._router = router
        self._stream = stream
        self._outs = router.outs
        self._get = current_block.get
        self.buffer = _BinaryStream(router, stream)

    def write(self, s: str) -> int:
        # The hot path of every print: a lookup and an append; Router.write does the rest.
        if type(s) is not str:
            if not isinstance(s, str):
                raise TypeError(f"write() argument must be str, not {type(s).__name__}")
            s = str.__str__(s)
        out = self._outs.get(self._get())
        if out is None or out.size >= MAX_BATCH:
            self._router.write(self._stream, s)
            return len(s)
        out.parts.append((self._stream, s))
        out.size += len(s)
        if out.ended:  # the block ended as this was written: route it elsewhere
            self._router.late(out)
        return len(s)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        # An explicit flush sends now, as a flush to a pipe writes now: what was printed with
        # ``flush=True`` has left the process before a kill or a crash that follows it.
        self._router.flush_block()

    def fileno(self) -> int:
        return self._stream  # fd 1/2 are the capture pipes: subprocesses land in the same place

    def isatty(self) -> bool:
        return _isatty(self._stream)

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
        self._router.flush_block()

    def fileno(self) -> int:
        return self._stream

    def isatty(self) -> bool:
        return _isatty(self._stream)

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


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _terminal() -> tuple[int, int]:
    """A pty (read end, write end); a pipe where the sandbox has no terminal of its own to give
    (Landlock alone: the host's /dev/pts stays out of reach)."""
    try:
        return os.openpty()
    except OSError:
        return os.pipe()


def _raw_output(fd: int, size: str) -> None:
    """A pty slave that passes bytes as a pipe does (no ``\n`` made ``\r\n``), with the
    terminal's size when it is known."""
    attrs = termios.tcgetattr(fd)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(fd, termios.TCSANOW, attrs)
    rows, _, cols = size.partition("x")
    if rows.isdigit() and cols.isdigit():
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", int(rows), int(cols), 0, 0))


def queued(fd: int) -> int:
    """Bytes waiting to be read in pipe (or pty) ``fd``."""
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder, signed=True)


class FdCapture:
    """Replaces fd 1 and 2 with pipes drained by a thread into the router.

    ``fifos``: the coordinator's capture FIFOs (``_outpipe.open_fifos``), a (read, write) pair
    per fd, used instead of a pipe of this process's own (but not for a fd that gets a pty):
    what the pump has not moved out when the worker dies is still there for the coordinator.
    With the FIFOs, the pump sends what it takes at once, so little waits in this process.

    The worker's original stderr is kept as ``diag_fd`` for its own last words (a fatal
    error before the socket is up); user code never writes there.
    """

    def __init__(self, router: Router, tty: str = "",
                 fifos: dict[int, tuple[int, int]] | None = None) -> None:
        self._router = router
        self.diag_fd = os.dup(2)
        os.set_inheritable(self.diag_fd, False)
        self._reads: dict[int, int] = {}
        self._movable: set[int] = set()  # read ends the router can move from (the FIFOs)
        terminals, _, size = tty.partition(":")  # "1,2:ROWSxCOLS": which fds get a pty, and its size
        for fd, stream in ((1, STDOUT), (2, STDERR)):
            pair = (fifos or {}).get(fd)
            if str(fd) in terminals.split(","):
                for end in pair or ():
                    os.close(end)
                r, w = _terminal()
            elif pair is not None:
                r, w = pair
                self._movable.add(r)
            else:
                r, w = os.pipe()
            if os.isatty(w):
                _raw_output(w, size)
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, True)
            self._reads[r] = stream
        # Sent at once only where output goes to the coordinator's pipe: over the socket a
        # send is a message per read, and what is sent there dies with us anyway.
        self._now = fifos is not None
        self._busy = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="agentloop-fd", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        fds = list(self._reads)
        router = self._router
        while fds:
            ready, _, _ = select.select(fds, [], [])
            with self._busy:
                for fd in ready:
                    stream = self._reads[fd]
                    if fd in self._movable and router.move(stream, fd):
                        continue
                    try:
                        data = os.read(fd, 65536)
                    except OSError:  # EIO: a pty whose every writer is gone, as a pipe's EOF
                        data = b""
                    if data:
                        out = router.write(stream, data)
                        if self._now and out is not None and out.parts:
                            router.send_out(out)  # into the output pipe, where it outlives us
                    else:
                        fds.remove(fd)

    def drain(self, timeout: float = 0.05) -> None:
        """Wait (briefly) until what was written to fd 1/2 so far has been routed."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = sum(queued(fd) for fd in self._reads)
            if not waiting or time.monotonic() > deadline:
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


def hide_runtime_threads() -> None:
    """``threading.enumerate()`` and ``active_count()`` leave out the runtime's own threads
    (named ``agentloop-...``: the output pump, the listeners, the threads of concurrent
    blocks), so a script counts the threads it started, as under ``python``."""
    everything = threading.enumerate

    def enumerate() -> list[threading.Thread]:  # noqa: A001 - threading's own name
        return [t for t in everything() if not t.name.startswith("agentloop-")]

    threading.enumerate = enumerate
    threading.active_count = lambda: len(enumerate())


def plain_streams_in_children() -> None:
    """In a process forked from the worker (``multiprocessing``'s fork, ``os.fork``),
    ``sys.stdout`` and ``sys.stderr`` write to fd 1 and 2 as in a child of a script: the
    worker's streams send over its socket, which a forked child cannot use.  fd 1 and 2 are
    the capture pipes (or ptys), so what the child writes reaches the block as a subprocess's
    output does.  Buffered as CPython buffers them (stdout by lines on a terminal, else by
    blocks: ``multiprocessing`` flushes them when its child ends; ``os._exit`` loses what was
    not flushed, as in CPython)."""

    def child() -> None:
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                      encoding="utf-8", errors="strict", line_buffering=os.isatty(1))
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                      encoding="utf-8", errors="backslashreplace", line_buffering=True)

    os.register_at_fork(after_in_child=child)
