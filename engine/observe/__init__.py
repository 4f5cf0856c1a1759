"""Watching runs: the console, activity intervals, OpenTelemetry spans and tracing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "Activity": "_activity", "AGENT": "_activity", "ATTEMPT": "_activity", "BLOCK": "_activity",
    "Piece": "_activity", "REQUEST": "_activity", "TOOL": "_activity", "ConsoleDisplay": "_console",
    "current_tracing": "_tracing", "start_tracing": "_tracing", "stop_tracing": "_tracing",
    "trace_observer": "_tracing", "tracing_env": "_tracing"
}

if TYPE_CHECKING:
    from ._activity import AGENT, ATTEMPT, BLOCK, REQUEST, TOOL, Activity, Piece
    from ._console import ConsoleDisplay
    from ._tracing import current_tracing, start_tracing, stop_tracing, trace_observer, tracing_env

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "AGENT", "ATTEMPT", "Activity", "BLOCK", "ConsoleDisplay", "Piece", "REQUEST", "TOOL",
    "current_tracing", "start_tracing", "stop_tracing", "trace_observer", "tracing_env"
]
