"""Reading a file by its descriptor within bounds: at most so many bytes, or a window of its
lines counted in one pass (what ``read_file`` and ``search`` show), whatever the file holds."""

from __future__ import annotations

import os

__all__ = ["CHUNK", "MAX_COUNT_BYTES", "read_at_most", "scan_lines"]

CHUNK = 1 << 20
MAX_COUNT_BYTES = 1 << 30  # bytes read past read_file's window to count the file's lines


def read_at_most(fd: int, size: int) -> bytes:
    parts = []
    while size > 0:
        chunk = os.read(fd, min(CHUNK, size))
        if not chunk:
            break
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def scan_lines(fd: int, first: int, count: int, cap: int) -> tuple[list[str], int, bool]:
    """(lines ``first`` .. ``first + count - 1`` as text, line count, whether the count is exact).

    Reads ``fd`` once in CHUNK pieces; lines before the window are counted, not kept, each
    shown line keeps at most ``cap`` bytes (the rest is counted), and counting past the window
    stops after MAX_COUNT_BYTES (then the count is a lower bound).  Memory: one chunk plus the
    window.  A line is what ends in ``\\n``; a ``\\r`` before it is dropped.
    """
    stop = first + count
    shown: list[str] = []
    head = bytearray()
    length = 0  # bytes of the current line inside the window, whole
    lineno = 1  # the line the next byte belongs to
    partial = False  # bytes seen after the last newline
    past = 0  # bytes read since the window closed
    while True:
        chunk = os.read(fd, CHUNK)
        if not chunk:
            break
        partial = not chunk.endswith(b"\n")
        pos, n = 0, len(chunk)
        while pos < n:
            if lineno < first:
                newlines = chunk.count(b"\n", pos)
                if lineno + newlines < first:
                    lineno += newlines
                    break
                while lineno < first:
                    pos = chunk.index(b"\n", pos) + 1
                    lineno += 1
                continue
            if lineno >= stop:
                lineno += chunk.count(b"\n", pos)
                past += n - pos
                break
            nl = chunk.find(b"\n", pos)
            end = n if nl < 0 else nl
            room = cap - len(head)
            if room > 0:
                head += chunk[pos:min(end, pos + room)]
            length += end - pos
            if nl < 0:
                break
            shown.append(_line(head, length, cap, True))
            head.clear()
            length = 0
            lineno += 1
            pos = nl + 1
        if past > MAX_COUNT_BYTES:
            return shown, lineno - 1, False
    if partial and first <= lineno < stop:
        shown.append(_line(head, length, cap, False))
    return shown, lineno if partial else lineno - 1, True


def _line(head: bytearray, length: int, cap: int, ended: bool) -> str:
    """One shown line: its first ``cap`` bytes decoded, a note when the rest was cut."""
    text = head.decode("utf-8", "replace")
    if length > cap:
        return f"{text}…[agent] line cut at {cap} of {length} bytes\n"
    if ended:
        return (text[:-1] if text.endswith("\r") else text) + "\n"
    return text
