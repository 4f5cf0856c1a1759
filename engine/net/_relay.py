"""Moving bytes between two sockets on the event loop, for the egress proxy.

``pump`` copies one socket to another until the first ends (or for a given number of bytes),
counting what it moved.  It splices through a pipe, so the kernel moves the pages and none
pass through this process; where no pipe can be had (descriptors are short, or this process
already splices ``MAX_SPLICING`` pumps) or the sockets refuse splice, it copies through a
buffer instead.  ``both`` runs two of them (a tunnel's two directions) as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Awaitable, Callable

__all__ = ["MAX_SPLICING", "both", "pump"]

_CHUNK = 256 * 1024  # a copying pump's buffer
_SPLICE = 1 << 20  # the most one splice asks for (what the pipe holds bounds it)
_F_SETPIPE_SZ = 1031
_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
#: Pumps that splice at once in this process (two descriptors each); more copy.  The first
#: ``BIG_PIPES`` of them get 1 MiB pipes (fewer wake-ups for a bulk transfer), the others the
#: default 64 KiB: pipe memory counts against the user's limit for every process it runs
#: (``/proc/sys/fs/pipe-user-pages-soft``, 64 MiB by default), so this process takes at most
#: 16 + 3 MiB of it.
MAX_SPLICING = 64
BIG_PIPES = 16
#: A big pipe's pump into a unix socket (the sandbox's side) asks that socket for this send
#: buffer: a unix stream's only buffer is its sender's, and the default (~208 KiB) wakes the
#: forwarder for every few splices.  The kernel caps it at ``net.core.wmem_max`` (a no-op
#: where that is the default); at most ``BIG_PIPES`` of them, so at most 16 x 4 MiB (the
#: kernel counts double) of this process's socket memory.
UNIX_SNDBUF = 2 << 20
_splicing = _big = 0


class _NoSplice(Exception):
    """These sockets refuse splice (nothing was moved yet): copy instead."""


async def pump(src: socket.socket, dst: socket.socket, count: Callable[[int], None], limit: int | None = None) -> None:
    """Move ``src``'s bytes to ``dst`` until ``src`` ends, or ``limit`` bytes (EOFError when
    ``src`` ends before them); ``count(n)`` after each ``n`` moved.  Both sockets non-blocking."""
    global _splicing, _big
    if _splicing < MAX_SPLICING:
        try:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            pass
        else:
            _splicing += 1
            big = False
            try:
                if _big < BIG_PIPES:
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(w, _F_SETPIPE_SZ, _SPLICE)
                        big = True
                        _big += 1
                    if big and dst.family == socket.AF_UNIX:  # (TCP tunes its own: never set it there)
                        with contextlib.suppress(OSError):
                            dst.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
                return await _splice(src, dst, count, limit, r, w)
            except _NoSplice:
                pass
            finally:
                _splicing -= 1
                _big -= big
                os.close(r)
                os.close(w)
    await _copy(src, dst, count, limit)


async def _copy(src: socket.socket, dst: socket.socket, count: Callable[[int], None], limit: int | None) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(bytearray(_CHUNK))
    while limit is None or limit > 0:
        n = await loop.sock_recv_into(src, view if limit is None else view[:min(_CHUNK, limit)])
        if not n:
            if limit is not None:
                raise EOFError("the sender closed before all its bytes came")
            return
        await loop.sock_sendall(dst, view[:n])
        count(n)
        if limit is not None:
            limit -= n


async def _splice(src: socket.socket, dst: socket.socket, count: Callable[[int], None], limit: int | None,
                  r: int, w: int) -> None:
    loop = asyncio.get_running_loop()
    s, d = src.fileno(), dst.fileno()
    moved = 0
    while limit is None or limit > 0:
        try:
            n = os.splice(s, w, _SPLICE if limit is None else min(_SPLICE, limit), flags=_FLAGS)
        except BlockingIOError:
            await _ready(loop, s, write=False)
            continue
        except OSError as exc:
            if moved == 0 and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise _NoSplice from None
            raise
        if not n:
            if limit is not None:
                raise EOFError("the sender closed before all its bytes came")
            return
        left = n
        while left:
            try:
                left -= os.splice(r, d, left, flags=_FLAGS)
            except BlockingIOError:
                await _ready(loop, d, write=True)
        moved += n
        count(n)
        if limit is not None:
            limit -= n


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, write: bool) -> None:
    """Wait until ``fd`` is readable (writable)."""
    waiter = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await waiter
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def both(first: Awaitable[None], second: Awaitable[None], until_second: bool = False) -> None:
    """Run both; return when both have ended (``until_second``: when the second has), and as
    soon as either raises, cancelling the other and raising that."""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # (raises what it raised)
            if until_second and tasks[1].done():
                return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
