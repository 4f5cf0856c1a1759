"""Reading what ``view`` is given: a recording or a results file, told apart by its first line.

A recording (``--record``, a batch run's ``transcript.jsonl``) is JSON lines with ``t`` and
``type``; a results file (``batch -o``, ``exec --jsonl -o``) is JSON lines with ``id`` and a
``status`` of ours.  Anything else is refused in one sentence that says what was expected.  A
last line that does not parse is a file cut short (its writer was killed mid-line): the file is
read as far as it goes and the caller warns; a damaged line anywhere else is refused.

The file is streamed, never held: ``open_lines`` reads the first record (the kind), and
``Lines.records()`` yields every record, a line at a time, as often as the caller asks (a report
reads its file twice).  A line longer than ``MAX_LINE`` is left out unread (``Lines.long``
counts them), so that memory stays bounded whatever the file holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from engine.errors import ConfigError
from worker.contract.bounded_json import loads as bounded_loads

RECORDING, BATCH, SAMPLES = "recording", "batch", "samples"
BATCH_STATUSES = ("answered", "failed", "timed_out", "cancelled")
SAMPLE_STATUSES = ("ok", "error", "timeout", "killed", "died", "cancelled")
EXPECTED = ("a --record file (JSON lines with \"t\" and \"type\") or the results of batch or exec --jsonl "
            "(JSON lines with \"id\" and \"status\")")
#: Longest line read, in bytes: a longer one is left out (and counted) without being held.
MAX_LINE = 16 * 1024 * 1024


@dataclass
class Lines:
    """A file's kind, and its records read as they are asked for.  After a whole pass of
    ``records()``: ``cut_line`` is the torn last line, if there was one; ``long`` counts the
    lines left out for their length, ``count`` the records read."""

    kind: str
    path: Path
    cut_line: int | None = None  # the number of the torn last line, if there was one
    long: int = 0
    count: int = 0
    _given: list[dict[str, Any]] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, kind: str, records: list[dict[str, Any]], path: Path = Path("records")) -> Lines:
        """Records already at hand (tests, a caller that made them)."""
        return cls(kind, path, count=len(records), _given=records)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record of the file, in order; ConfigError for a damaged line or one of another kind."""
        if self._given is not None:
            yield from self._given
            return
        self.cut_line, self.long, self.count = None, 0, 0
        with _open(self.path) as stream:
            for number, record in _parsed(self.path, stream, self):
                found = kind_of(record)
                if found != self.kind:
                    raise _refuse(self.path, f"line {number} is not like the lines before it: {_described(record)}")
                self.count += 1
                yield record

    def summary(self) -> list[str]:
        """What was left out of the file for the bounds, in sentences for the page."""
        if not self.long:
            return []
        return [f"{self.long} line{'s' * (self.long != 1)} longer than {MAX_LINE // (1024 * 1024)} MiB "
                f"{'were' if self.long != 1 else 'was'} left out unread"]


def kind_of(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("type"), str) and isinstance(record.get("t"), int | float) \
            and not isinstance(record.get("t"), bool):
        return RECORDING
    ident, status = record.get("id"), record.get("status")
    if isinstance(ident, str | int) and not isinstance(ident, bool):
        if "exit_code" in record and status in SAMPLE_STATUSES:
            return SAMPLES
        if status in BATCH_STATUSES:
            return BATCH
    return None


def _refuse(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path} is not a file view reads ({what}); it expects {EXPECTED}")


def _open(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")  # noqa: SIM115 - the callers close it (``with``)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _raw_lines(stream: IO[bytes], lines: Lines) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of each line of at most ``MAX_LINE`` bytes; longer ones are read past in
    pieces, never held, and counted in ``lines.long``."""
    number = 0
    while True:
        raw = stream.readline(MAX_LINE + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE:
            while raw and not raw.endswith(b"\n"):
                raw = stream.readline(1024 * 1024)
            lines.long += 1
            continue
        yield number, raw


def _parsed(path: Path, stream: IO[bytes], lines: Lines) -> Iterator[tuple[int, Any]]:
    """(number, value) of each line that parses; a line that does not is fatal unless it is the
    last (then ``lines.cut_line`` names it)."""
    pending: tuple[int, str] | None = None  # a line that did not parse: fatal unless it is the last
    seen = False
    for number, raw in _raw_lines(stream, lines):
        if not raw.strip():
            continue
        if pending is not None:
            raise _refuse(path, f"line {pending[0]} is {pending[1]}")
        try:
            record = bounded_loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
        except (UnicodeDecodeError, ValueError):  # JSONDecodeError and JSON beyond the bounds are ValueErrors
            if not seen:
                raise _refuse(path, f"line {number} is not JSON") from None
            pending = (number, "not JSON")
            continue
        seen = True
        yield number, record
    lines.cut_line = pending[0] if pending is not None else None


def open_lines(path: Path) -> Lines:
    """The file at ``path``, its kind told by its first record; ConfigError (one line, naming
    what was expected) for anything that is not one of the files ``view`` reads."""
    probe = Lines("", path)
    with _open(path) as stream:
        for number, record in _parsed(path, stream, probe):
            found = kind_of(record)
            if found is None:
                raise _refuse(path, f"line {number} is {_described(record)}")
            return Lines(found, path)
    raise _refuse(path, "it is empty")


def read_lines(path: Path) -> Lines:
    """``open_lines``, its records read once through (so that a damaged line is refused now)."""
    lines = open_lines(path)
    for _ in lines.records():
        pass
    return lines


def _no_constant(name: str) -> None:
    return None  # NaN and Infinity, which Python writes and reads and a browser's JSON does not: unknown


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _described(record: Any) -> str:
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    keys = ", ".join(repr(str(k))[:40] for k in list(record)[:6])
    return f"a JSON object with {keys}{', ...' if len(record) > 6 else ''}" if record else "an empty JSON object"


__all__ = ["BATCH", "BATCH_STATUSES", "EXPECTED", "MAX_LINE", "RECORDING", "SAMPLES", "SAMPLE_STATUSES", "Lines",
           "kind_of", "open_lines", "read_lines"]
