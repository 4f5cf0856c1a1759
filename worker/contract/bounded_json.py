"""JSON from whoever may be hostile, parsed within bounds: the one ``loads`` for text a worker,
a tool process or a model sent.

``json.loads`` recurses once per level of nesting: a reply that nests arrays 100,000 deep
ends in ``RecursionError`` (which is not a ``ValueError``, so the usual ``except`` misses it
and a traceback ends the command), and a 1,000,000-digit integer in Python's own limit on
integer conversion.  Here every such value is refused the same way as text that is not JSON
at all: ``JSONRefused``, a ``ValueError`` whose message says what was wrong in a few words
the model can act on.  Nesting is bounded by ``MAX_DEPTH`` (checked after parsing, without
recursion, for what the parser's own recursion let through), numbers by ``MAX_DIGITS``.
Standard library only: the tool process imports it too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["JSONRefused", "MAX_DEPTH", "MAX_DIGITS", "loads"]

#: Deepest nesting of arrays and objects accepted (tool arguments, stream chunks and the
#: messages of our own channels are a few levels deep).
MAX_DEPTH = 100
#: Longest number accepted, in characters.
MAX_DIGITS = 1000


class JSONRefused(ValueError):
    """Text that is JSON beyond the bounds (too deep, a number too long), in words."""


def _number(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if len(text) > MAX_DIGITS:
            raise JSONRefused(f"a number of {len(text)} digits (at most {MAX_DIGITS})")
        return convert(text)
    return parse


_INT = _number(int)
_FLOAT = _number(float)


def loads(text: str | bytes | bytearray, *, parse_float: Callable[[str], Any] | None = None,
          parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(text)`` within the bounds; ``JSONRefused`` beyond them, ``JSONDecodeError``
    (a ValueError too) for text that is not JSON."""
    floats = _FLOAT if parse_float is None else _number(parse_float)
    try:
        value = json.loads(text, parse_int=_INT, parse_float=floats, parse_constant=parse_constant)
    except RecursionError:
        raise JSONRefused(f"nested more than {MAX_DEPTH} levels deep") from None
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    """JSONRefused when ``value`` nests arrays and objects more than ``MAX_DEPTH`` deep (walked
    with a stack of its own: the value may be as deep as the parser allowed)."""
    if not isinstance(value, dict | list):
        return
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise JSONRefused(f"nested more than {MAX_DEPTH} levels deep")
        children = item.values() if isinstance(item, dict) else item
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
