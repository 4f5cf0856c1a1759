"""The sandbox: policy (data), the plan that applies it, the one bubblewrap argv builder, the
workers' Python and its trust check, protected paths, uids and cgroups, what this host offers
(``doctor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "beneath": "_bwrap", "bwrap_argv": "_bwrap", "namespace_flags": "_bwrap", "probe_argv": "_bwrap",
    "View": "_bwrap", "choose_python": "_choice", "which_python": "_choice", "fork_server_problem":
    "_host", "host_support": "_host", "HostSupport": "_host", "root_blocker": "_host",
    "check_workspace": "_interpreter", "not_importable": "_interpreter", "probe": "_interpreter",
    "python_paths": "_interpreter", "runtime_argv": "_interpreter", "runtime_dirs": "_interpreter",
    "runtime_packages": "_interpreter", "RUNTIME_ROOT": "_interpreter", "trusted_python":
    "_interpreter", "TrustedPython": "_interpreter", "GiB": "_plan", "LaunchPlan": "_plan", "plan":
    "_plan", "SandboxPolicy": "_plan", "server_plan": "_plan", "shareable_cwd": "_plan", "system_paths":
    "_plan", "tools_plan": "_plan", "workspace_excess": "_plan", "protected_paths": "_protected",
    "claim_uid": "_uids", "release_uid": "_uids"
}

if TYPE_CHECKING:
    from ._bwrap import View, beneath, bwrap_argv, namespace_flags, probe_argv
    from ._choice import choose_python, which_python
    from ._host import HostSupport, fork_server_problem, host_support, root_blocker
    from ._interpreter import (
        RUNTIME_ROOT,
        TrustedPython,
        check_workspace,
        not_importable,
        probe,
        python_paths,
        runtime_argv,
        runtime_dirs,
        runtime_packages,
        trusted_python,
    )
    from ._plan import (
        GiB,
        LaunchPlan,
        SandboxPolicy,
        plan,
        server_plan,
        shareable_cwd,
        system_paths,
        tools_plan,
        workspace_excess,
    )
    from ._protected import protected_paths
    from ._uids import claim_uid, release_uid

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "GiB", "HostSupport", "LaunchPlan", "RUNTIME_ROOT", "SandboxPolicy", "TrustedPython", "View",
    "beneath", "bwrap_argv", "check_workspace", "choose_python", "claim_uid", "fork_server_problem",
    "host_support", "namespace_flags", "not_importable", "plan", "probe", "probe_argv",
    "protected_paths", "python_paths", "release_uid", "root_blocker", "runtime_argv", "runtime_dirs",
    "runtime_packages", "server_plan", "shareable_cwd", "system_paths", "tools_plan", "trusted_python",
    "which_python", "workspace_excess"
]
