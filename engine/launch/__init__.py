"""Starting sandboxed processes: a run's settings, its launcher (sockets, directories,
environment, cgroups), the provisioners that start each process (cold, the run's fork server,
a batch's shared one) and the process handle that kills a whole tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "WorkerCgroups": "_cgroup", "report": "_doctor", "Launcher": "_launcher", "OutputPipes": "_outpipe",
    "descendants": "_process", "kill_tree": "_process", "grant_socket": "_fork_start", "start_fork": "_fork_start",
    "Launch": "_process", "Process": "_process", "start": "_process", "fork_server_refusal":
    "_provision", "missing_dirs": "_run_dirs", "WorkerSettings": "_settings", "SharedForkServer":
    "_shared_fork_server", "Guard": "_tcp"
}

if TYPE_CHECKING:
    from ._cgroup import WorkerCgroups
    from ._doctor import report
    from ._fork_start import grant_socket, start_fork
    from ._launcher import Launcher
    from ._outpipe import OutputPipes
    from ._process import Launch, Process, descendants, kill_tree, start
    from ._provision import fork_server_refusal
    from ._run_dirs import missing_dirs
    from ._settings import WorkerSettings
    from ._shared_fork_server import SharedForkServer
    from ._tcp import Guard

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Guard", "Launch", "Launcher", "OutputPipes", "Process", "SharedForkServer", "WorkerCgroups", "WorkerSettings",
    "descendants", "fork_server_refusal", "grant_socket", "kill_tree", "missing_dirs", "report", "start",
    "start_fork"
]
