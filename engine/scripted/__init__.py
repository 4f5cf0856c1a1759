"""A scripted OpenAI-compatible model server: real HTTP on loopback, replies from a script, the
requests it received checked and recorded (the stand-in for a model in tests and the tour)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "ScriptedServer": "_server", "Delay": "_turns", "EXHAUSTED": "_turns", "Fail": "_turns", "Script":
    "_turns"
}

if TYPE_CHECKING:
    from ._server import ScriptedServer
    from ._turns import EXHAUSTED, Delay, Fail, Script

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Delay", "EXHAUSTED", "Fail", "Script", "ScriptedServer"
]
