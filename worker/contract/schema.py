"""Messages as typed values: one class per message gives its builder and its checked parser.

A message is an immutable value whose fields say their type and bounds (``text``, ``blob``,
``integer``, ...).  Building one and calling ``to_wire`` gives the map that is sent (its kind
under ``t``); ``Catalogue.parse`` turns a received map into an instance, checking every field,
or raises ``ContractError``.  Past the parser nothing checks a field again: "parse, don't
validate".

A field may hold a message of its own (``is_message``): on the wire it is that message's map
without its ``t`` (the field says which message it is), parsed by the same mechanism, so an
unknown key is refused at every level, not only the top.

Builders bound what they are given where the sender may hold more than fits (``cut``: a
traceback longer than the limit is cut, not refused); parsers refuse whatever an honest peer
never sends.  So a peer that breaks a bound is broken or hostile, and is treated so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

__all__ = ["Catalogue", "ContractError", "Message", "field", "is_any", "is_blob", "is_choice", "is_flag",
           "is_int", "is_list", "is_map", "is_message", "is_number", "is_optional", "is_plain", "is_text",
           "is_tuple", "message"]

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


def is_tuple(*items: Check) -> Check:
    """A list of exactly ``len(items)`` values, each passing its own check, kept as a tuple."""
    def check(value: Any) -> tuple:
        if type(value) not in (list, tuple) or len(value) != len(items):
            raise ContractError(f"not a list of {len(items)} items")
        return tuple(item(v) for item, v in zip(items, value, strict=True))
    return _carry(check, *items)


def is_list(item: Check, max_items: int) -> Check:
    """A list of at most ``max_items`` values passing ``item``, kept as a tuple."""
    def check(value: Any) -> tuple:
        if type(value) not in (list, tuple) or len(value) > max_items:
            raise ContractError(f"not a list of at most {max_items} items")
        return tuple(item(v) for v in value)
    return _carry(check, item)


def is_map(key: Check, item: Check, max_items: int) -> Check:
    """A map of at most ``max_items`` entries."""
    def check(value: Any) -> dict:
        if type(value) is not dict or len(value) > max_items:
            raise ContractError(f"not a map of at most {max_items} items")
        return {key(k): item(v) for k, v in value.items()}
    return _carry(check, item, mapping=True)


def is_optional(inner: Check) -> Check:
    """None, or a value passing ``inner``."""
    def check(value: Any) -> Any:
        return None if value is None else inner(value)
    return _carry(check, inner, optional=True)


def is_message(cls: type[Message]) -> Check:
    """A message of class ``cls``, held in a field: on the wire its map without ``t``, every
    key one of its fields (an unknown one is refused, as at the top)."""
    def check(value: Any) -> Message:
        if type(value) is not dict:
            raise ContractError(f"not a {cls.kind} map")
        return cls.from_wire(value, nested=True)
    check.wire = _nested_wire  # type: ignore[attr-defined]
    return check


def is_plain(max_depth: int) -> Check:
    """Plain data as msgpack decodes it (None, bools, numbers, str, bytes, lists and maps of
    them), nested at most ``max_depth`` deep: a value the receiver relays or hands on without
    reading it, whose depth must not exhaust a recursion on the way."""
    def check(value: Any, depth: int = 0) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if depth >= max_depth:
            raise ContractError(f"not plain data nested at most {max_depth} deep")
        if kind is list or kind is tuple:
            return [check(v, depth + 1) for v in value]
        if kind is dict:
            if not all(type(k) is str for k in value):
                raise ContractError("not plain data: a map key that is not a string")
            return {k: check(v, depth + 1) for k, v in value.items()}
        raise ContractError("not plain data")
    return check


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _nested_wire(value: Message) -> dict[str, Any]:
    return value.wire_fields()


def _carry(check: Check, *inner: Check, mapping: bool = False, optional: bool = False) -> Check:
    """``check``, given the wire form of the messages inside what it checks (a list of them, a
    map to them, ...) where one of ``inner`` has one; nothing otherwise (a value is sent as it
    is: the common case costs nothing)."""
    wires = [getattr(c, "wire", None) for c in inner]
    if not any(wires):
        return check
    if optional:
        (one,) = wires
        check.wire = lambda v: None if v is None else one(v)  # type: ignore[attr-defined]
    elif mapping:
        (one,) = wires
        check.wire = lambda v: {k: one(x) for k, x in v.items()}  # type: ignore[attr-defined]
    elif len(wires) == 1:
        (one,) = wires
        check.wire = lambda v: [one(x) for x in v]  # type: ignore[attr-defined]
    else:
        check.wire = lambda v: [w(x) if w else x for w, x in zip(wires, v, strict=True)]  # type: ignore[attr-defined]
    return check


def is_any(value: Any) -> Any:
    """Any value msgpack decoded (already bounded by its frame): the receiver interprets it."""
    return value


class _Field:
    """A field's declaration: its check and its default (or a factory making one)."""

    __slots__ = ("check", "default", "factory")

    def __init__(self, check: Check, default: Any, factory: Callable[[], Any] | None) -> None:
        self.check, self.default, self.factory = check, default, factory


def field(check: Check, default: Any = _MISSING) -> Any:
    """A message field that received values must pass ``check`` for.  A dict default is copied
    for each message."""
    if type(default) is dict:
        return _Field(check, _MISSING, dict)
    return _Field(check, default, None)


# -- messages ------------------------------------------------------------------------------------

class Message:
    """Base of every message class.  ``kind`` is its ``t``; subclasses are declared with
    ``@message("kind")``: immutable values built from their fields in order (positionally or by
    name), equal when their class and fields are.

    Not dataclasses: a dataclass compiles an ``__init__``, ``__eq__``, ``__repr__`` and more for
    each class when it is made, which cost a cold worker ~20 ms for the contract's messages at
    every start; these share one of each."""

    kind: ClassVar[str] = ""
    _checks: ClassVar[tuple[tuple[str, Check, bool], ...]] = ()
    _specs: ClassVar[tuple[tuple[str, Any, Callable[[], Any] | None], ...]] = ()
    _order: ClassVar[tuple[str, ...]] = ()
    _names: ClassVar[frozenset[str]] = frozenset()
    _omit: ClassVar[frozenset[str]] = frozenset()
    _wires: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        specs = self._specs
        if len(args) > len(specs):
            raise TypeError(f"{type(self).__name__}() takes {len(specs)} fields, {len(args)} were given")
        values = self.__dict__
        values.update(zip(self._order, args, strict=False))  # (fewer args: the rest by name or default)
        if kwargs:
            if not kwargs.keys() <= self._names or not kwargs.keys().isdisjoint(values):
                raise TypeError(f"{type(self).__name__}() got an unknown or repeated field "
                                f"{sorted(k for k in kwargs if k not in self._names or k in values)[0]!r}")
            values.update(kwargs)
        if len(values) < len(specs):
            self._fill(values)

    def _fill(self, values: dict[str, Any]) -> None:
        for name, default, factory in self._specs:
            if name not in values:
                if factory is not None:
                    values[name] = factory()
                elif default is _MISSING:
                    raise TypeError(f"{type(self).__name__}() is missing its field {name!r}")
                else:
                    values[name] = default

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a {type(self).__name__} cannot change: {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a {type(self).__name__} cannot change: {name!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self), *self.__dict__.values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self._order)})"

    @classmethod
    def fields(cls) -> tuple[tuple[str, Check, bool], ...]:
        """``(name, check, required)`` of each field, in order."""
        return cls._checks

    def replace(self: T, **changes: Any) -> T:
        """This message with ``changes`` to some of its fields (built, not checked: a builder)."""
        return type(self)(**{**self.__dict__, **changes})

    def to_wire(self) -> dict[str, Any]:
        """The map that is sent: ``t`` and every field, those at a default of None left out,
        a message held in a field as its own map (without its ``t``)."""
        out: dict[str, Any] = {"t": self.kind}
        out.update(self.wire_fields())
        return out

    def wire_fields(self) -> dict[str, Any]:
        """Every field as it is sent (``to_wire`` without ``t``: how a message held in a field
        of another is sent)."""
        out: dict[str, Any] = {}
        wires = self._wires
        for name, _, _ in self._checks:
            value = getattr(self, name)
            if value is None and name in self._omit:
                continue
            convert = wires.get(name)
            if convert is not None:
                out[name] = convert(value)
            else:
                out[name] = list(value) if type(value) is tuple else value
        return out

    @classmethod
    def from_wire(cls: type[T], msg: dict, nested: bool = False) -> T:
        """The message ``msg`` holds (its ``t`` already matched; ``nested``: a map held in a
        field, which has no ``t``); ContractError naming the first field that breaks the
        contract, or the first key that is none of its fields."""
        values = {}
        for name, check, required in cls._checks:
            if name in msg:
                try:
                    values[name] = check(msg[name])
                except ContractError as exc:
                    raise ContractError(f"{cls.kind}.{name}: {exc}") from None
            elif required:
                raise ContractError(f"{cls.kind}: {name} is missing")
        if len(msg) > len(values) + (not nested and "t" in msg):
            extra = sorted(str(k)[:40] for k in msg if (nested or k != "t") and k not in values)
            raise ContractError(f"{cls.kind}: unknown field {extra[0]!r}")
        made = cls.__new__(cls)  # (checked above: no argument binding to do again)
        if len(values) < len(cls._specs):
            made._fill(values)
        made.__dict__.update(values)
        made.validate()
        return made

    def validate(self) -> None:
        """Checks across fields (a subclass's); raise ContractError."""


def message(kind: str) -> Callable[[type[T]], type[T]]:
    """Declare a message class whose ``t`` is ``kind``: its annotated class attributes, in
    order, each a ``field(...)``, are its fields."""
    def make(cls: type[T]) -> type[T]:
        specs, checks, omit, wires = [], [], set(), {}
        for name in cls.__dict__.get("__annotations__", {}):
            spec = cls.__dict__.get(name)
            if not isinstance(spec, _Field):
                raise TypeError(f"{cls.__name__}.{name} has no check")
            delattr(cls, name)  # (the instance's value is its own)
            specs.append((name, spec.default, spec.factory))
            checks.append((name, spec.check, spec.default is _MISSING and spec.factory is None))
            if spec.default is None:
                omit.add(name)
            if (wire := getattr(spec.check, "wire", None)) is not None:
                wires[name] = wire  # (a message in it, or in what it holds)
        cls.kind = kind
        cls._specs, cls._checks = tuple(specs), tuple(checks)
        cls._order = tuple(n for n, _, _ in specs)
        cls._names, cls._omit, cls._wires = frozenset(cls._order), frozenset(omit), wires
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
