"""Bounded output of one block: head and tail in memory, everything (capped) in a file.

A block may print a gigabyte; the coordinator keeps ``head_bytes + tail_bytes`` of it in
memory with an exact count of what lies between, and streams the whole of it to a file,
itself capped at ``file_cap`` bytes with a closing note saying so.  The file is created
only once the output outgrows the head, so small blocks leave no files behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["FILE_CAP", "HEAD_BYTES", "OutputSink", "TAIL_BYTES"]

HEAD_BYTES = 64 * 1024
TAIL_BYTES = 64 * 1024
FILE_CAP = 256 * 1024 * 1024


class OutputSink:
    """Collects one block's output; memory use is bounded whatever the block prints."""

    def __init__(self, path: Path | Callable[[], Path] | None, *, head_bytes: int = HEAD_BYTES,
                 tail_bytes: int = TAIL_BYTES, file_cap: int = FILE_CAP) -> None:
        self.path = path
        self.head_bytes = head_bytes
        self.tail_bytes = tail_bytes
        self.file_cap = file_cap
        self.total = 0
        self._head = bytearray()
        self._tail = bytearray()
        self._fh = None  # binary file object, once the output outgrows the head
        self._written = 0
        self._file_used = False

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
        if callable(self.path):  # named only when needed: most blocks never need a file
            self.path = self.path()
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        self._fh = os.fdopen(fd, "wb")
        self._write(bytes(self._head))

    def _write(self, data: bytes) -> None:
        take = data[: max(0, self.file_cap - self._written)]
        if take:
            self._fh.write(take)
            self._written += len(take)

    def close(self) -> None:
        if self._fh is not None:
            if self.total > self._written:
                note = (f"\n[agentloop: output file capped at {self.file_cap} bytes; "
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
        where = f"; the whole output is in {self.file}" if self.file else ""
        note = f"\n[... {cut} bytes cut{where} ...]\n"
        return (bytes(self._head[:head_n]).decode("utf-8", "replace") + note
                + tail[len(tail) - tail_n:].decode("utf-8", "replace"))
