"""The worker's end of the output pipes a local coordinator makes: output that survives a death.

A coordinator on the same machine (``ipc://``) makes three FIFOs in the worker's socket
directory before it starts the worker, holds their read ends, and names the directory in
its start (``StartSpec.output``).  The worker opens them (``open_fifos``) before it confines itself:

- ``out``: every output frame (``contract.wire.Out``) is written here instead of to the socket, as a
  4-byte big-endian length and the msgpack frame.  A write to a pipe is in the kernel when
  ``os.write`` returns, so what the code flushed is out of the process before it can die: a
  frame handed to ZeroMQ's I/O thread would die with it under a SIGKILL.
- ``fd1``, ``fd2``: the pipes behind fd 1 and 2.  The capture pump moves what waits there into
  ``out`` with ``splice(2)`` (``PipeWriter.move``): the kernel moves the bytes from one pipe to
  the other, so every byte a subprocess or C code wrote is in one of the two pipes at every
  moment, and the coordinator, which reads ``fd1``/``fd2`` once the worker is dead, finds
  whatever the pump had not moved.

A frame is written whole or, if the process dies while writing it, cut at the end of the
stream (the coordinator drops a cut frame, and delivers the part of a moved chunk that
arrived).  It is never torn by an exception: the write blocks every signal but the runtime's
interrupt (``keep``), whose handler puts the interrupt off while output is being sent (see
``runtime``), so no signal handler can raise between two partial writes; an asynchronous
exception (the interrupt of a block in another thread) can land only between two Python calls,
and with signals blocked a write to a blocking pipe returns only once all of it is written.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import threading

from .contract.output import NAMES, moved, out_frame
from .contract.wire import Out

_SIG_BLOCK, _SIG_SETMASK = 0, 2
_SIGSET_BYTES = 128  # glibc's sigset_t


class Fifos:
    """The worker's descriptors of the three FIFOs: ``out``'s write end, and a (read, write)
    pair for each of fd 1 and 2."""

    def __init__(self, out: int, pipes: dict[int, tuple[int, int]]) -> None:
        self.out = out
        self.pipes = pipes


def open_fifos(directory: str) -> Fifos:
    """Open the FIFOs the coordinator made in ``directory``; OSError if one is missing or is not
    a FIFO.  Called before the worker confines itself: the process may still be root, and the
    FIFOs stay the coordinator's (mode 0600), usable by nobody else.  Every descriptor is
    blocking and close-on-exec (fd 1 and 2 become inheritable when the capture puts them there)."""
    opened: list[int] = []

    def fifo(name: str, flags: int) -> int:
        # Non-blocking open: a FIFO's write end opens at once when a reader holds it (the
        # coordinator does), and never hangs otherwise.
        fd = os.open(os.path.join(directory, name), flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        opened.append(fd)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a FIFO")
        os.set_blocking(fd, True)
        return fd

    try:
        out_name, *fd_names = NAMES
        out = fifo(out_name, os.O_WRONLY)
        pipes = {fd: (fifo(name, os.O_RDONLY), fifo(name, os.O_WRONLY)) for fd, name in zip((1, 2), fd_names, strict=True)}
    except OSError:
        for fd in opened:
            os.close(fd)
        raise
    return Fifos(out, pipes)


class _Mask:
    """``pthread_sigmask`` through ctypes with sets made once: ``signal.pthread_sigmask`` turns
    every mask into a set of ``Signals`` and costs some 60 us a call."""

    def __init__(self, keep: int | None) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.pthread_sigmask
        self.all = ctypes.create_string_buffer(_SIGSET_BYTES)
        self.most = ctypes.create_string_buffer(_SIGSET_BYTES)
        self.old = ctypes.create_string_buffer(_SIGSET_BYTES)
        libc.sigfillset(self.all)
        libc.sigfillset(self.most)
        if keep is not None:
            libc.sigdelset(self.most, keep)

    def save(self) -> None:
        self._call(_SIG_BLOCK, None, self.old)

    def block(self, which) -> None:
        self._call(_SIG_BLOCK, which, None)

    def restore(self) -> None:
        self._call(_SIG_SETMASK, self.old, None)


class PipeWriter:
    """Writes output to ``out``.  Its callers hold the router's send lock, one at a time."""

    def __init__(self, fd: int, keep: int | None = None, diag_fd: int = 2) -> None:
        self.fd = fd
        self.diag_fd = diag_fd
        self._main = threading.get_ident()  # made on the main thread, which keeps ``keep``
        try:
            self._mask: _Mask | None = _Mask(keep)
        except (OSError, AttributeError):  # no libc to call: frames are still written whole
            self._mask = None
        self._splice = hasattr(os, "splice")

    def send(self, msg: Out) -> None:
        """Write one message (an ``out`` frame), whole."""
        self._write(out_frame(msg))

    def move(self, block_id: str, stream: int, src: int, size: int) -> None:
        """Move ``size`` bytes that wait in pipe ``src`` into ``out``, for ``block_id``: a frame
        saying so (``raw``: [stream, size]), then the bytes themselves, which the kernel moves
        from pipe to pipe.  ``size`` must not exceed what waits in ``src`` (only the pump reads it)."""
        self._write(moved(block_id, stream, size), src, size)

    def _write(self, data: bytes, src: int = -1, size: int = 0) -> None:
        mask = self._mask
        if mask is not None:
            mask.save()  # before ``try``: an exception raised here has changed nothing
        try:
            if mask is not None:
                mask.block(mask.most if threading.get_ident() == self._main else mask.all)
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.write(self.fd, view[done:])
            moved = 0
            while moved < size and self._splice:
                try:
                    moved += os.splice(src, self.fd, size - moved)
                except OSError as exc:  # not here (an old kernel, a filter): copy instead, from now on
                    if exc.errno is None:
                        raise
                    self._splice = False
            while moved < size:  # copied through this process
                chunk = os.read(src, size - moved)
                if not chunk:
                    break
                piece = memoryview(chunk)
                while piece:
                    piece = piece[os.write(self.fd, piece):]
                moved += len(chunk)
        except OSError as exc:  # the coordinator is gone (EPIPE), or the code closed the fd
            if exc.errno is None:  # not the system's: a block's deadline (a TimeoutError) landed
                raise
            with contextlib.suppress(OSError):
                os.write(self.diag_fd, f"agentloop worker: output was not sent: {exc}\n".encode())
        finally:
            if mask is not None:
                mask.restore()
