"""Durations as people and models write them: ``250ms``, ``30s``, ``5m``, ``1h``, ``1m30s``, ``12``.

One parser for every place a duration enters the system (tag attributes, CLI options,
config files), so they all accept the same forms and fail with the same words.
"""

from __future__ import annotations

import math
import re

from engine.errors import ConfigError

__all__ = ["DEFAULT_BLOCK_TIMEOUT", "format_duration", "parse_duration"]

#: A block's deadline, in seconds, when neither the model nor the caller names one.
DEFAULT_BLOCK_TIMEOUT = 10.0

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
# Units in descending order, each at most once. `m(?!s)` keeps "5ms" from reading as "5m" + "s".
_DURATION_RE = re.compile(
    rf"(?:(?P<h>{_NUMBER})\s*h)?\s*"
    rf"(?:(?P<m>{_NUMBER})\s*m(?!s))?\s*"
    rf"(?:(?P<s>{_NUMBER})\s*s)?\s*"
    rf"(?:(?P<ms>{_NUMBER})\s*ms)?",
    re.IGNORECASE,
)
_PLAIN_RE = re.compile(_NUMBER)
_SCALE = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_FORMS = "a duration like 250ms, 30s, 5m, 1h or plain seconds"


def parse_duration(text: str | int | float | None, default: float | None = None, *,
                   allow_zero: bool = False) -> float | None:
    """Seconds in `text`, or `default` when it is None or blank.

    Accepts plain seconds (``12``, ``1.5``), one unit (``250ms``, ``30s``, ``5m``, ``1h``) or
    units combined largest first (``1h30m``, ``1m30s``, ``2s500ms``). Negative, infinite and,
    unless `allow_zero`, zero durations are refused: raises ConfigError naming the accepted forms.
    """
    if text is None:
        return default
    if isinstance(text, bool):  # bool is an int; True seconds is never meant
        raise ConfigError(f"expected {_FORMS}, got {text!r}")
    if isinstance(text, (int, float)):
        seconds = float(text)
        if not math.isfinite(seconds) or seconds < 0:
            raise ConfigError(f"expected {_FORMS}, got {text!r}")
    else:
        stripped = str(text).strip()
        if not stripped:
            return default
        seconds = _parse_text(stripped)
        if seconds is None:
            raise ConfigError(f"expected {_FORMS}, got {stripped!r}")
    if seconds == 0 and not allow_zero:
        raise ConfigError(f"expected {_FORMS}, greater than zero, got {text!r}")
    return seconds


def _parse_text(text: str) -> float | None:
    if _PLAIN_RE.fullmatch(text):
        return float(text)
    match = _DURATION_RE.fullmatch(text)
    if match is None or not any(match.groupdict().values()):
        return None
    return sum(float(value) * _SCALE[unit] for unit, value in match.groupdict().items() if value)


def format_duration(seconds: float) -> str:
    """Compact form that parse_duration reads back: ``250ms``, ``30s``, ``1.5s``, ``5m``, ``1h30m``.

    Rounded to the millisecond; below one second it is written in ms.
    """
    if seconds < 0:
        return "-" + format_duration(-seconds)
    total_ms = round(seconds * 1000)
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest = divmod(total_ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    parts = []
    if hours:
        parts.append(f"{hours}h")
    if minutes:
        parts.append(f"{minutes}m")
    if millis:
        parts.append(f"{secs}.{millis:03d}".rstrip("0") + "s")
    elif secs:
        parts.append(f"{secs}s")
    return "".join(parts)
