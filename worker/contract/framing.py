"""The one framing of every byte stream across the sandbox boundary: a 4-byte big-endian
length, then that many bytes (one encoded message).

Readers never trust a length: it is checked against the channel's bound before a byte of the
body is read or buffered.  Messages inside frames are msgpack maps (``encode``/``decode``,
every length bounded by the frame itself), except on the tool channel, whose file names may
hold lone surrogates and so travel as ASCII JSON (``encode_json``/``decode_json``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

try:
    import msgpack
except ImportError:  # the tool process runs without site-packages: it speaks JSON only
    msgpack = None

from .bounded_json import loads as bounded_loads
from .limits import MAX_FRAME
from .schema import ContractError, Message

__all__ = ["HEADER", "FrameBuffer", "FrameError", "decode", "decode_json", "encode", "encode_json", "frame",
           "read_frame", "read_frame_async", "read_frame_before", "write_all"]

HEADER = struct.Struct(">I")


class FrameError(ContractError):
    """Bytes that are not a frame of this channel: a length over its bound, or a body that does
    not decode."""


def encode(msg: Message | dict) -> bytes:
    """One message as msgpack.  Bytes stay bytes, str stays str (``use_bin_type``)."""
    return msgpack.packb(msg.to_wire() if isinstance(msg, Message) else msg, use_bin_type=True)


def decode(body: bytes, max_size: int = MAX_FRAME) -> Any:
    """Unpack one msgpack value with every length bounded by ``body`` itself; FrameError for an
    oversized body, bad msgpack or trailing bytes."""
    if len(body) > max_size:
        raise FrameError(f"frame of {len(body)} bytes exceeds {max_size}")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=len(body),
                               max_bin_len=len(body), max_array_len=len(body),
                               max_map_len=len(body) // 2 + 1, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc


def encode_json(msg: Message | dict) -> bytes:
    """One message as ASCII JSON (lone surrogates survive as escapes)."""
    obj = msg.to_wire() if isinstance(msg, Message) else msg
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def decode_json(body: bytes, max_size: int = MAX_FRAME) -> Any:
    if len(body) > max_size:
        raise FrameError(f"frame of {len(body)} bytes exceeds {max_size}")
    try:
        return bounded_loads(body)
    except ValueError as exc:  # not JSON, or JSON beyond its bounds (too deep, a number too long)
        raise FrameError(f"not JSON: {exc}") from None


def frame(body: bytes) -> bytes:
    """``body`` with its length in front."""
    return HEADER.pack(len(body)) + body


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to the blocking descriptor ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int, max_size: int) -> bytes | None:
    """The next frame's body from the blocking descriptor ``fd``; None at the end of the
    stream (also inside a frame: a writer that died half-way); FrameError past ``max_size``."""
    head = _read_exact(fd, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > max_size:
        raise FrameError(f"a frame of {size} bytes (at most {max_size})")
    return _read_exact(fd, size)


def _read_exact(fd: int, n: int, deadline: float | None = None) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            _wait_readable(fd, deadline)
        try:
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame_before(fd: int, max_size: int, deadline: float) -> bytes | None:
    """``read_frame`` from a descriptor, each wait bounded by ``deadline`` (``time.monotonic``):
    TimeoutError past it (a frame may then be half read: the caller ends the stream)."""
    head = _read_exact(fd, HEADER.size, deadline)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > max_size:
        raise FrameError(f"a frame of {size} bytes (at most {max_size})")
    return _read_exact(fd, size, deadline)


async def read_frame_async(readexactly: Callable[[int], Awaitable[bytes]], max_size: int) -> bytes | None:
    """The next frame's body from an asyncio stream (its ``readexactly``); None at the end of
    the stream (also inside a frame); FrameError past ``max_size``, before the body is read.
    Bound the wait with ``asyncio.wait_for`` where the peer may fall silent."""
    import asyncio

    try:
        (size,) = HEADER.unpack(await readexactly(HEADER.size))
        if size > max_size:
            raise FrameError(f"a frame of {size} bytes (at most {max_size})")
        return await readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _wait_readable(fd: int, deadline: float) -> None:
    import select
    import time

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if poller.poll(max(1, int(left * 1000 + 0.999))):  # rounds up: never a busy loop
            return


class FrameBuffer:
    """Frames cut out of a byte stream read in pieces, each checked against ``max_size`` as
    soon as its length is known (before its body is buffered).  ``min_size``: a shorter frame
    is refused too (a channel whose every frame holds something).  A stream whose frames may
    announce unframed bytes after them (the output pipe) takes those with ``take``."""

    __slots__ = ("max_size", "min_size", "buf")

    def __init__(self, max_size: int, min_size: int = 0) -> None:
        self.max_size = max_size
        self.min_size = min_size
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def next(self) -> bytes | None:
        """The next whole frame's body, or None until more bytes come; FrameError for a
        length over the bound."""
        buf = self.buf
        if len(buf) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(buf)
        if not self.min_size <= size <= self.max_size:
            raise FrameError(f"a frame of {size} bytes (at least {self.min_size}, at most {self.max_size})")
        end = HEADER.size + size
        if len(buf) < end:
            return None
        body = bytes(buf[HEADER.size:end])
        del buf[:end]
        return body

    def take(self, n: int) -> bytes:
        """At most ``n`` of the bytes buffered next, unframed (what a frame said follows it);
        fewer, or none, until more are fed."""
        buf = self.buf
        if n >= len(buf):
            data = bytes(buf)
            buf.clear()
            return data
        data = bytes(buf[:n])
        del buf[:n]
        return data

    def __len__(self) -> int:
        return len(self.buf)
