"""Watching runs: the console, activity intervals, OpenTelemetry spans and tracing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "Activity": "_activity", "AGENT": "_activity", "ATTEMPT": "_activity", "BLOCK": "_activity",
    "Piece": "_activity", "REQUEST": "_activity", "TOOL": "_activity", "ConsoleDisplay": "_console"
}

if TYPE_CHECKING:
    from ._activity import AGENT, ATTEMPT, BLOCK, REQUEST, TOOL, Activity, Piece
    from ._console import ConsoleDisplay

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "AGENT", "ATTEMPT", "Activity", "BLOCK", "ConsoleDisplay", "Piece", "REQUEST", "TOOL"
]
