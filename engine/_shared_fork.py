"""One fork server for the runs of a batch (``agentloop batch``).

A worker started cold costs a bubblewrap sandbox and a fresh interpreter (~120 ms), and a fork
server of a run's own costs more than the one or two workers a run starts.  So the runs of a
batch share one: started by the first run that needs a worker, started again by the next one
if it died (its workers die with it), closed with the batch.  A run's worker then costs a fork
of a server that has already imported the runtime (~10 ms).

Its sandbox shows what all the runs need: the system and the workers' Python read-only, the
batch's runs directory read-write (every run's workspace and block outputs lie beneath it) and
one socket root read-only (every run's socket directories lie beneath it).  No worker is shown
that.  Each forked worker's namespace init (``worker.zygote._private_tmp``) covers the runs
directory and the socket root with an empty read-only tmpfs and binds back its run's workspace
(read-write, what ``engine.protected`` names in it read-only), its run's outputs and its own
socket directory (read-only): what a worker of the run started cold is shown, and nothing of
another run — not its directory, its sockets, its outputs nor its transcript.  Its stderr is a
fifo of its own (``Zygote.private_stderr``), so no run reads another's last words.  Everything
else stays the run's: the environment, the uid, the Landlock rules and rlimits (all in
``AGENTLOOP_CONFINE``), and a memory and a pids cgroup per worker with the run's limits.  Those
lie under one pair of parents for the batch (``cgroups``): the server makes each worker's
namespace init ahead of its request, and
``_cgroup.SpareGroups`` puts it in cgroups of its own ahead too, which the run that gets it
takes as its worker's (every run of the batch has the same limits).

Offered where a fork server gives the isolation of a cold start (root with bubblewrap) and to
runs that are alike: the same sandbox policy, Python and preloaded modules, ipc:// endpoints,
a workspace, current directory and output directory beneath the runs directory, and no
directory of the system or of the Python beneath it (covering the runs directory would hide
it).  A launcher handed a server that cannot serve it starts its workers cold.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ._bwrap import View, _beneath, bwrap_argv
from ._cgroup import SpareGroups, WorkerCgroups
from ._process import Launch
from ._tree import remove_tree
from ._zygote import Zygote, ZygoteProcess
from .errors import WorkerStartError
from .sandbox import LaunchPlan, SandboxPolicy, _system_paths, host_support, python_paths


class Launcher(Protocol):
    """What the server asks of a run's launcher (``engine.launcher.Launcher``, which imports
    this module)."""

    zygote: bool | None
    own_workspaces: bool
    transport: str
    sandbox: SandboxPolicy
    python: str
    preload: tuple[str, ...]
    workspace: Path
    output_dir: Path
    cwd: Path
    sock_root: Path | None
    protected: tuple[str, ...]
    runtime_packages: dict[str, str]

    def env(self, token: str, plan: LaunchPlan) -> dict[str, str]: ...


class RunForkServer:
    """The shared server as one run uses it: every worker it forks gets the run's view."""

    def __init__(self, shared: SharedForkServer, zygote: Zygote, view: dict) -> None:
        self.shared = shared
        self.zygote = zygote
        self.view = view

    async def spawn(self, launch: Launch, exec_argv: list[str] | None = None, *,
                    on_forked: Callable[[int], None] | None = None) -> ZygoteProcess:
        if self.shared.closed:  # it would start again, with nobody left to close it
            raise WorkerStartError("the batch's fork server was closed")
        return await self.zygote.spawn(launch, exec_argv, view=self.view, on_forked=on_forked)


class SharedForkServer:
    """One fork server for the runs beneath ``root`` (a batch's runs directory).

    ``sandbox``, ``python`` and ``preload`` are the runs' own (a run with others is not served).
    Nothing starts before a run's first worker; ``close`` kills the server and every worker it
    forked, and removes the socket root."""

    def __init__(self, root: str | Path, *, sandbox: SandboxPolicy, python: str, preload: tuple[str, ...] = (),
                 start_timeout: float = 30.0) -> None:
        self.root = Path(os.path.realpath(root))
        self.sandbox = sandbox
        self.python = python
        self.preload = tuple(preload)
        self.start_timeout = start_timeout
        #: Where each run's socket directories go (a directory per run), made on first use.
        self.socket_root: Path | None = None
        self._runs = itertools.count(1)
        self._zygote: Zygote | None = None
        self._closed = False
        self._holds_python: bool | None = None
        self._cgroups: tuple[WorkerCgroups | None, WorkerCgroups | None] | None = None
        #: Cgroups made ahead for the server's spare inits (``_cgroup.SpareGroups``).
        self.spares: SpareGroups | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pid(self) -> int | None:
        """The host pid of the server's sandbox (bubblewrap), while it runs."""
        return self._zygote.pid if self._zygote is not None else None

    def refuses(self, launcher: Launcher) -> str | None:
        """Why this server may not fork ``launcher``'s workers (None: it may)."""
        if self._closed:
            return "the batch's fork server is closed"
        if os.geteuid() != 0 or self.sandbox.mode not in ("auto", "bwrap") or host_support().bwrap is None:
            return "the fork server needs bubblewrap and a coordinator running as root"
        if launcher.zygote is False or launcher.own_workspaces or launcher.transport != "ipc":
            return "this run's workers start cold"
        if (launcher.sandbox, launcher.python, launcher.preload) != (self.sandbox, self.python, self.preload):
            return "this run's sandbox, Python or preloaded modules differ from the batch's"
        root = str(self.root)
        workspace = os.path.realpath(launcher.workspace)
        inside = (workspace, os.path.realpath(launcher.output_dir))
        if workspace == root or not all(_beneath(p, root) for p in inside) \
                or not _beneath(os.path.realpath(launcher.cwd), workspace):
            return f"this run's directories do not all lie beneath {root}"
        if self._holds_python is None:  # (the same answer for every run: asked once)
            system, _ = _system_paths()
            self._holds_python = any(_beneath(p, root) for p in (*system, *python_paths(self.python)))
        if self._holds_python:
            return f"{root} holds a directory the workers' Python needs"
        return None

    def run_sockets(self, runtime: Path) -> Path:
        """A new private directory for one run's socket directories.  ``runtime``: where the
        socket root goes (the coordinator's private runtime directory); its name is a run
        directory's (``DATE-TIME-PID-HEX``), so a later start removes what a killed batch left.
        The per-run names are short: an ipc:// path must fit in 107 bytes."""
        if self.socket_root is None:
            name = time.strftime("%Y%m%d-%H%M%S-") + f"{os.getpid()}-{secrets.token_hex(3)}"
            self.socket_root = Path(os.path.realpath(runtime)) / name  # as the server's view names it
            self.socket_root.mkdir(mode=0o700)
        path = self.socket_root / f"r{next(self._runs)}"
        path.mkdir(mode=0o700)
        return path

    def cgroups(self) -> tuple[WorkerCgroups | None, WorkerCgroups | None]:
        """The parents of every served run's worker cgroups (memory, pids), one pair for the
        batch (made on first use; None where this process may make none): the cgroups made
        ahead for a spare init must lie where the run that takes it keeps its workers'."""
        if self._cgroups is None:
            name = f"batch{secrets.token_hex(3)}"
            self._cgroups = (WorkerCgroups.find(name), WorkerCgroups.find(name, "pids"))
            self.spares = SpareGroups([(cgroups, limit) for cgroups, limit in zip(
                self._cgroups, (self.sandbox.memory_bytes, self.sandbox.max_processes), strict=True) if cgroups])
            if self._zygote is not None:
                self._zygote.on_spare = self.spares.prepare
        return self._cgroups

    def for_run(self, launcher: Launcher) -> RunForkServer:
        """The server as ``launcher`` (one it does not refuse, opened) uses it."""
        assert self.socket_root is not None and launcher.sock_root is not None
        if self._zygote is None:
            plan = self._plan()
            env = launcher.env("", plan)
            env["HOME"] = "/"  # (the server's; every worker gets its run's environment)
            self._zygote = Zygote(plan, env, python=self.python, cwd=Path("/"), sandbox=self.sandbox,
                                  start_timeout=self.start_timeout, preload=self.preload,
                                  packages=launcher.runtime_packages)
            self._zygote.private_stderr = True
            if self.spares is not None:
                self._zygote.on_spare = self.spares.prepare
        view = {"hide": [str(self.root), str(self.socket_root)],
                "show": [[os.path.realpath(launcher.workspace), False], [os.path.realpath(launcher.output_dir), True],
                         *([path, True] for path in launcher.protected)]}
        return RunForkServer(self, self._zygote, view)

    def _plan(self) -> LaunchPlan:
        """The server's sandbox: a worker's view, with the runs directory as the workspace and
        the socket root as the socket directory; it starts in ``/``."""
        assert self.socket_root is not None
        host = host_support()
        assert host.bwrap is not None
        system, links = _system_paths()
        view = View(tuple(system), tuple(links), python_paths(self.python), self.root, self.socket_root, None, None)
        argv = bwrap_argv(host.bwrap, root=host.root, network=self.sandbox.network,
                          tmp_bytes=self.sandbox.tmp_bytes, view=view, start_dir="/")
        return LaunchPlan(argv, True, cwd="/")

    async def close(self) -> None:
        """Kill the server (every worker it forked goes with it), remove the cgroups made
        ahead and the socket root.  A run opened afterwards starts its workers cold; one opened
        before gets WorkerStartError."""
        self._closed = True
        if self._zygote is not None:
            await self._zygote.close()
        if self.spares is not None:
            await asyncio.to_thread(self.spares.close)
        for cgroups in self._cgroups or ():
            if cgroups is not None:
                cgroups.close()
        if self.socket_root is not None:
            remove_tree(self.socket_root)
