"""What a scripted server replies: conversations of turns, failures and delays, from Python
or from JSON (see ``engine.scripted``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Delay", "EXHAUSTED", "FALLBACK", "Fail", "Script"]

EXHAUSTED = "(script exhausted)"
FALLBACK = "*"


@dataclass(frozen=True)
class Fail:
    """Answer HTTP ``status`` (``times`` times) before the next real turn.  ``retry_after`` sets
    the Retry-After header; ``body`` replaces the default JSON error body."""

    status: int = 500
    times: int = 1
    retry_after: float | None = None
    body: str = ""


@dataclass(frozen=True)
class Delay:
    """Wait ``seconds`` before answering with ``then`` (any turn)."""

    seconds: float
    then: Any = ""


@dataclass
class _Step:
    fails: list[Fail]
    turn: Any


class Script:
    """Conversations keyed by a substring of their task; a bare list of turns is the ``"*"`` one."""

    def __init__(self, conversations: Mapping[str, Sequence[Any]] | Sequence[Any] | None = None) -> None:
        if conversations is None:
            conversations = {}
        elif not isinstance(conversations, Mapping):
            conversations = {FALLBACK: conversations}
        self._steps: dict[str, list[_Step]] = {}
        for key, turns in conversations.items():
            if isinstance(turns, str | bytes) or not isinstance(turns, Sequence):
                raise TypeError(f"script for {key!r} must be a list of turns, not {type(turns).__name__}")
            steps: list[_Step] = []
            fails: list[Fail] = []
            for turn in turns:
                if isinstance(turn, Fail):
                    fails.append(turn)
                else:
                    steps.append(_Step(fails, turn))
                    fails = []
            if fails:  # failures after the last turn precede the exhausted reply
                steps.append(_Step(fails, EXHAUSTED))
            self._steps[key] = steps

    def keys(self) -> list[str]:
        return list(self._steps)

    def match(self, task: str) -> str | None:
        """The key of the conversation ``task`` belongs to, or None."""
        for key in self._steps:
            if key != FALLBACK and key in task:
                return key
        return FALLBACK if FALLBACK in self._steps else None

    def step(self, key: str, index: int) -> _Step | None:
        steps = self._steps.get(key, [])
        return steps[index] if 0 <= index < len(steps) else None

    @classmethod
    def from_json(cls, data: Any) -> Script:
        """A script from parsed JSON: ``{key: [turn, ...]}`` or a bare list (the ``"*"`` key)."""
        if isinstance(data, list):
            data = {FALLBACK: data}
        if not isinstance(data, dict):
            raise ValueError("a JSON script is an object {key: [turns]} or a list of turns")
        return cls({key: [_turn_from_json(t) for t in turns] for key, turns in data.items()})


def _turn_from_json(turn: Any) -> Any:
    if isinstance(turn, dict) and "fail" in turn:
        return Fail(int(turn["fail"]), int(turn.get("times", 1)), turn.get("retry_after"), turn.get("body", ""))
    if isinstance(turn, dict) and "delay" in turn:
        return Delay(float(turn["delay"]), _turn_from_json(turn.get("then", "")))
    if isinstance(turn, str | dict):
        return turn
    raise ValueError(f"a JSON turn is a string or an object, not {turn!r}")
