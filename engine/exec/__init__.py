"""``agentloop exec FILE``: ``python FILE`` in its sandbox (its plan, its confiner, its terminal)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "ScriptGate": "_egress", "appeared": "_obeyed", "snapshot": "_obeyed", "plan_script": "_plan",
    "exit_as": "_script", "inherited_ignored": "_script", "run_script": "_script", "ScriptCgroups":
    "_script"
}

if TYPE_CHECKING:
    from ._egress import ScriptGate
    from ._obeyed import appeared, snapshot
    from ._plan import plan_script
    from ._script import ScriptCgroups, exit_as, inherited_ignored, run_script

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "ScriptCgroups", "ScriptGate", "appeared", "exit_as", "inherited_ignored", "plan_script", "run_script",
    "snapshot"
]
