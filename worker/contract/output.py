"""The output pipe: a local worker's output, written where it outlives the worker.

A coordinator on the same machine makes three FIFOs in the worker's socket directory
(``NAMES``) and holds their read ends before the worker exists; the worker opens the write
ends before it confines itself.  ``out`` carries frames (``framing``) each holding one
``wire.Out`` message; one whose ``raw`` is [stream, n] is followed by n bytes of fd-level output
moved there from ``fd1``/``fd2`` (the pipes behind the worker's fd 1 and 2) by ``splice(2)``.
Only ``Out`` messages may appear here.  ``OutputReader`` turns the bytes read from ``out`` into
messages, checking everything; the reading itself (non-blocking, bounded) is the coordinator's.
"""

from __future__ import annotations

from .framing import FrameBuffer, decode, encode, frame
from .limits import MAX_FRAME
from .schema import ContractError
from .wire import TO_COORDINATOR, Out

__all__ = ["NAMES", "OutputReader", "moved", "out_frame"]

#: The FIFOs' names in the worker's socket directory: output frames, then fd 1's and fd 2's pipes.
NAMES = ("out", "fd1", "fd2")


def out_frame(msg: Out) -> bytes:
    """``msg`` framed for ``out``."""
    return frame(encode(msg))


def moved(block_id: str, stream: int, size: int) -> bytes:
    """The frame announcing ``size`` moved bytes of ``stream`` for ``block_id`` (they follow it)."""
    return frame(encode(Out(block_id, (), (stream, size))))


class OutputReader:
    """Messages out of the bytes of ``out``, fed as they are read (framing's ``FrameBuffer``
    cuts them).  ``next`` raises ContractError for anything but well-formed ``Out`` frames
    (an empty one included); of a moved chunk, each piece that arrived is given as an ``Out``
    of its own (a chunk cut by the worker's death is kept so far)."""

    def __init__(self) -> None:
        self.frames = FrameBuffer(MAX_FRAME, min_size=1)
        self._raw: tuple[str, int, int] | None = None  # (block, stream, bytes to come) of a moved chunk

    def feed(self, data: bytes) -> None:
        self.frames.feed(data)

    def next(self) -> Out | None:
        """The next whole message, or None until more is fed."""
        frames = self.frames
        while True:
            if self._raw is not None:
                block, stream, rest = self._raw
                data = frames.take(rest)
                if not data:
                    return None
                self._raw = (block, stream, rest - len(data)) if rest > len(data) else None
                return Out(block, ((stream, data),))
            body = frames.next()
            if body is None:
                return None
            msg = TO_COORDINATOR.parse(decode(body))
            if not isinstance(msg, Out):
                raise ContractError(f"it wrote a {msg.kind!r} message to its output pipe")
            if msg.raw is None:
                return msg
            self._raw = (msg.id, msg.raw[0], msg.raw[1])
