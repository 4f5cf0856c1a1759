"""Limits and small shared types both sides of the sandbox boundary hold to.

A bound the coordinator checks and the worker must respect lives here once, so the two can
never disagree: a worker that exceeds one is broken or hostile, and is treated so.
"""

from __future__ import annotations

import signal

__all__ = ["COPY_NOT_APART", "HeadTail", "INTERRUPT_SIGNAL", "MAX_CHUNK", "MAX_DISPLAYS", "MAX_DISPLAY_TEXT", "MAX_ERROR", "MAX_FRAME",
           "MAX_ID", "MAX_IMAGE", "MAX_NAME", "MAX_NOTE", "MAX_VARS", "MAX_VAR_NAME", "STDERR", "STDOUT"]

#: The exit status of a fork's copy that could not be given a Landlock domain of its own
#: (``worker._confine.separate``: the kernel stacks 16 layers, and each copy of a copy adds
#: one): it ends before it serves, and the coordinator says why in words.
COPY_NOT_APART = 73

#: Largest frame either side accepts on any channel (a channel may hold to less).  Big enough
#: for a batch of output or a pickled object handed to a sub-agent (half of it); anything
#: larger is a hostile or broken peer.  With the coordinator's receive queue of 4 messages,
#: what a worker can make it hold unread stays under 100 MiB.
MAX_FRAME = 24 * 1024 * 1024

#: Largest output chunk in one message.  The worker cuts its output into pieces of 256 KiB;
#: the bound keeps one message from costing the coordinator more than a few MiB however the
#: frame was made.
MAX_CHUNK = 1024 * 1024

#: Bounds of the words a worker sends with a result: a traceback, a note on an interrupt, the
#: names of its variables.  The worker cuts to them; the coordinator refuses beyond them.
MAX_ERROR = 64 * 1024
MAX_NOTE = 600
MAX_VAR_NAME = 100
MAX_VARS = 200
#: Bounds of what ``display()`` sends: bytes of one image, characters of one text
#: representation (HTML, SVG, Markdown, JSON, plain text), and displays per block.  The worker
#: refuses (an image) or cuts (a text) beyond them and says so in the block's output; the
#: coordinator treats a display beyond them as a broken worker.  One display's frame stays well
#: under ``MAX_FRAME`` whatever it holds.
MAX_IMAGE = 4 * 1024 * 1024
MAX_DISPLAY_TEXT = 256 * 1024
MAX_DISPLAYS = 32
#: Identifiers (block ids, host function names, tokens) and short names.
MAX_ID = 4096
MAX_NAME = 256

#: Output streams, as numbered in messages.
STDOUT = 1
STDERR = 2

#: The signal the coordinator's deadline and cancel arrive by in a worker or a sample process
#: (its handler raises there); chosen among the realtime signals no library uses.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 5


class HeadTail:
    """The head and the tail of one output stream, and the count of every byte, in memory
    bounded by ``keep``: what is kept of an output too long to keep whole."""

    __slots__ = ("keep", "head", "tail", "total")

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.keep:
                del self.tail[:len(self.tail) - self.keep]

    def parts(self) -> tuple[bytes, bytes, int]:
        """(head, tail, total bytes): what crosses a channel."""
        return bytes(self.head), bytes(self.tail[-self.keep:]) if self.keep else b"", self.total

    @classmethod
    def of(cls, parts: tuple[bytes, bytes, int], keep: int) -> HeadTail:
        """The stream ``parts`` describes (as ``parts`` gives them)."""
        made = cls(keep)
        made.head, made.tail, made.total = bytearray(parts[0]), bytearray(parts[1]), parts[2]
        return made

    def text(self) -> tuple[str, int]:
        """The stream as text, with a note where bytes were cut, and how many were."""
        tail = bytes(self.tail[-self.keep:]) if self.tail else b""
        cut = self.total - len(self.head) - len(tail)
        if not cut:
            return (bytes(self.head) + tail).decode("utf-8", "replace"), 0
        return (bytes(self.head).decode("utf-8", "replace") + f"\n[... {cut} bytes cut ...]\n"
                + tail.decode("utf-8", "replace")), cut
