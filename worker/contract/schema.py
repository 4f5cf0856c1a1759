"""Messages as typed values: one class per message gives its builder and its checked parser.

A message is a frozen dataclass whose fields say their type and bounds (``text``, ``blob``,
``integer``, ...).  Building one and calling ``to_wire`` gives the map that is sent (its kind
under ``t``); ``Catalogue.parse`` turns a received map into an instance, checking every field,
or raises ``ContractError``.  Past the parser nothing checks a field again: "parse, don't
validate".

Builders bound what they are given where the sender may hold more than fits (``cut``: a
traceback longer than the limit is cut, not refused); parsers refuse whatever an honest peer
never sends.  So a peer that breaks a bound is broken or hostile, and is treated so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

__all__ = ["Catalogue", "ContractError", "Message", "field", "is_any", "is_blob", "is_choice", "is_flag",
           "is_int", "is_list", "is_map", "is_number", "is_optional", "is_text", "message"]

T = TypeVar("T", bound="Message")
Check = Callable[[Any], Any]


class ContractError(ValueError):
    """A message that is not one of its channel's, or one whose fields break the contract."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


_MISSING: Any = _Missing()


# -- checks: each turns a received value into the field's value, or raises ContractError ------

def is_text(max_len: int) -> Check:
    """A str of at most ``max_len`` characters."""
    def check(value: Any) -> str:
        if type(value) is not str or len(value) > max_len:
            raise ContractError(f"not a string of at most {max_len} characters")
        return value
    return check


def is_blob(max_len: int) -> Check:
    """Bytes, at most ``max_len``."""
    def check(value: Any) -> bytes:
        if type(value) is not bytes or len(value) > max_len:
            raise ContractError(f"not bytes, at most {max_len}")
        return value
    return check


def is_int(lo: int = -(2**63), hi: int = 2**63 - 1) -> Check:
    """An int in [lo, hi]; a bool is not one."""
    def check(value: Any) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise ContractError(f"not an integer in [{lo}, {hi}]")
        return value
    return check


def is_number(lo: float = -math.inf, hi: float = math.inf) -> Check:
    """A finite int or float in [lo, hi], as a float."""
    def check(value: Any) -> float:
        if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
            raise ContractError(f"not a number in [{lo}, {hi}]")
        return float(value)
    return check


def is_flag(value: Any) -> bool:
    """A bool."""
    if type(value) is not bool:
        raise ContractError("not a boolean")
    return value


def is_choice(*values: Any) -> Check:
    """One of ``values``, of the same type (``True`` is not ``1``)."""
    types = {type(v) for v in values}

    def check(value: Any) -> Any:
        if type(value) not in types or value not in values:
            raise ContractError(f"not one of {', '.join(map(repr, values))}")
        return value
    return check


def is_list(item: Check, max_items: int) -> Check:
    """A list of at most ``max_items`` values passing ``item``, kept as a tuple."""
    def check(value: Any) -> tuple:
        if type(value) not in (list, tuple) or len(value) > max_items:
            raise ContractError(f"not a list of at most {max_items} items")
        return tuple(item(v) for v in value)
    return check


def is_map(key: Check, item: Check, max_items: int) -> Check:
    """A map of at most ``max_items`` entries."""
    def check(value: Any) -> dict:
        if type(value) is not dict or len(value) > max_items:
            raise ContractError(f"not a map of at most {max_items} items")
        return {key(k): item(v) for k, v in value.items()}
    return check


def is_optional(inner: Check) -> Check:
    """None, or a value passing ``inner``."""
    def check(value: Any) -> Any:
        return None if value is None else inner(value)
    return check


def is_any(value: Any) -> Any:
    """Any value msgpack decoded (already bounded by its frame): the receiver interprets it."""
    return value


def field(check: Check, default: Any = _MISSING) -> Any:
    """A message field that received values must pass ``check`` for.  A dict default is copied
    for each message."""
    meta = {"check": check}
    if type(default) is dict:
        return dataclasses.field(default_factory=dict, metadata=meta)
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# -- messages ------------------------------------------------------------------------------------

class Message:
    """Base of every message class.  ``kind`` is its ``t``; subclasses are frozen dataclasses
    declared with ``@message("kind")``."""

    kind: ClassVar[str] = ""
    _checks: ClassVar[tuple[tuple[str, Check, bool], ...]] = ()
    _omit: ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> dict[str, Any]:
        """The map that is sent: ``t`` and every field, those at a default of None left out."""
        out: dict[str, Any] = {"t": self.kind}
        for name, _, _ in self._checks:
            value = getattr(self, name)
            if value is None and name in self._omit:
                continue
            out[name] = list(value) if type(value) is tuple else value
        return out

    @classmethod
    def from_wire(cls: type[T], msg: dict) -> T:
        """The message ``msg`` holds (its ``t`` already matched); ContractError naming the
        first field that breaks the contract."""
        values = {}
        for name, check, required in cls._checks:
            if name in msg:
                try:
                    values[name] = check(msg[name])
                except ContractError as exc:
                    raise ContractError(f"{cls.kind}.{name}: {exc}") from None
            elif required:
                raise ContractError(f"{cls.kind}: {name} is missing")
        if len(msg) > len(values) + ("t" in msg):
            extra = sorted(str(k)[:40] for k in msg if k != "t" and k not in values)
            raise ContractError(f"{cls.kind}: unknown field {extra[0]!r}")
        made = cls(**values)
        made.validate()
        return made

    def validate(self) -> None:
        """Checks across fields (a subclass's); raise ContractError."""


def message(kind: str) -> Callable[[type[T]], type[T]]:
    """Declare a message class: a frozen dataclass with slots whose ``t`` is ``kind``."""
    def make(cls: type[T]) -> type[T]:
        cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        cls.kind = kind
        checks = []
        omit = set()
        for f in dataclasses.fields(cls):
            check = f.metadata.get("check")
            if check is None:
                raise TypeError(f"{cls.__name__}.{f.name} has no check")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            checks.append((f.name, check, required))
            if f.default is None:
                omit.add(f.name)
        cls._checks = tuple(checks)
        cls._omit = frozenset(omit)
        return cls
    return make



class Catalogue:
    """The messages one side of a channel may receive: ``parse`` a decoded map into one of them."""

    def __init__(self, name: str, messages: Iterable[type[Message]]) -> None:
        self.name = name
        self.by_kind: dict[str, type[Message]] = {m.kind: m for m in messages}

    def __contains__(self, kind: str) -> bool:
        return kind in self.by_kind

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.by_kind)

    def parse(self, msg: Any) -> Message:
        """The typed message ``msg`` (a decoded map) is; ContractError if it is none of this
        catalogue's or a field breaks the contract."""
        if type(msg) is not dict:
            raise ContractError(f"{self.name}: not a message map")
        kind = msg.get("t")
        cls = self.by_kind.get(kind) if type(kind) is str else None
        if cls is None:
            raise ContractError(f"{self.name}: not a message of this channel: {str(kind)[:40]!r}")
        return cls.from_wire(msg)
