"""The sandbox: policy (data), the plan that applies it, the one bubblewrap argv builder, the
workers' Python and its trust check, protected paths, uids and cgroups, what this host offers
(``doctor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "beneath": "_bwrap", "bwrap_argv": "_bwrap", "fork_server_argv": "_bwrap", "namespace_flags":
    "_bwrap", "View": "_bwrap", "fork_server_problem": "_host", "host_support": "_host",
    "choose_python": "_interpreter", "probe": "_interpreter", "python_paths": "_interpreter",
    "runtime_argv": "_interpreter", "RUNTIME_ROOT": "_interpreter", "which_python": "_interpreter",
    "GiB": "_plan", "LaunchPlan": "_plan", "SandboxPolicy": "_plan", "server_plan": "_plan",
    "system_paths": "_plan", "tools_argv": "_plan", "workspace_excess": "_plan", "protected_paths":
    "_protected"
}

if TYPE_CHECKING:
    from ._bwrap import View, beneath, bwrap_argv, fork_server_argv, namespace_flags
    from ._host import fork_server_problem, host_support
    from ._interpreter import RUNTIME_ROOT, choose_python, probe, python_paths, runtime_argv, which_python
    from ._plan import GiB, LaunchPlan, SandboxPolicy, server_plan, system_paths, tools_argv, workspace_excess
    from ._protected import protected_paths

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "GiB", "LaunchPlan", "RUNTIME_ROOT", "SandboxPolicy", "View", "beneath", "bwrap_argv",
    "choose_python", "fork_server_argv", "fork_server_problem", "host_support", "namespace_flags",
    "probe", "protected_paths", "python_paths", "runtime_argv", "server_plan", "system_paths",
    "tools_argv", "which_python", "workspace_excess"
]
