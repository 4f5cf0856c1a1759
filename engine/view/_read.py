"""Reading what ``view`` is given: a recording or a results file, told apart by its first line.

A recording (``--record``, a batch run's ``transcript.jsonl``) is JSON lines with ``t`` and
``type``; a results file (``batch -o``, ``exec --jsonl -o``) is JSON lines with ``id`` and a
``status`` of ours.  Anything else is refused in one sentence that says what was expected.  A
last line that does not parse is a file cut short (its writer was killed mid-line): the file is
read as far as it goes and the caller warns; a damaged line anywhere else is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

RECORDING, BATCH, SAMPLES = "recording", "batch", "samples"
BATCH_STATUSES = ("answered", "failed", "timed_out", "cancelled")
SAMPLE_STATUSES = ("ok", "error", "timeout", "killed", "died", "cancelled")
EXPECTED = ("a --record file (JSON lines with \"t\" and \"type\") or the results of batch or exec --jsonl "
            "(JSON lines with \"id\" and \"status\")")


@dataclass
class Lines:
    """A file's records, its kind, and whether its last line was cut short."""

    kind: str
    records: list[dict[str, Any]]
    cut_line: int | None = None  # the number of the torn last line, if there was one


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


def read_lines(path: Path) -> Lines:
    """The records of ``path``; ConfigError (one line, naming what was expected) for anything
    that is not one of the files ``view`` reads."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{path} is not a file view reads ({what}); it expects {EXPECTED}")

    try:
        stream = open(path, "rb")  # noqa: SIM115 - closed below; a recording may be large: read lazily
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    kind: str | None = None
    records: list[dict[str, Any]] = []
    pending: tuple[int, str] | None = None  # a line that did not parse: fatal unless it is the last
    with stream:
        for number, raw in enumerate(stream, 1):
            if not raw.strip():
                continue
            if pending is not None:
                raise refuse(f"line {pending[0]} is {pending[1]}")
            try:
                record = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
            except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
                if kind is None:
                    raise refuse(f"line {number} is not JSON") from None
                pending = (number, "not JSON")
                continue
            found = kind_of(record)
            if kind is None:
                if found is None:
                    raise refuse(f"line {number} is {_described(record)}")
                kind = found
            elif found != kind:
                raise refuse(f"line {number} is not like the lines before it: {_described(record)}")
            records.append(record)
    if kind is None:
        raise refuse("it is empty")
    return Lines(kind, records, pending[0] if pending is not None else None)


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


__all__ = ["BATCH", "BATCH_STATUSES", "EXPECTED", "RECORDING", "SAMPLES", "SAMPLE_STATUSES", "Lines", "kind_of",
           "read_lines"]
