"""One fork server for the runs of a batch (``agentloop batch``).

A worker started cold costs a bubblewrap sandbox and a fresh interpreter (~120 ms), and a fork
server of a run's own costs more than the one or two workers a run starts.  So the runs of a
batch share one: started by the first run that needs a worker, started again by the next one
if it died (its workers die with it), closed with the batch.  A run's worker then costs a fork
of a server that has already imported the runtime (~10 ms).

Its sandbox shows what all the runs need: the system and the workers' Python read-only, the
batch's runs directory read-write (every run's workspace and block outputs lie beneath it) and
one socket root read-only (every run's socket directories lie beneath it).  No worker is shown
that.  Each forked worker's namespace init (``worker.fork_server._private_tmp``) covers the runs
directory and the socket root with an empty read-only tmpfs and binds back its run's workspace
(read-write, what ``engine.sandbox`` names in it read-only), its run's outputs and its own
socket directory (read-only): what a worker of the run started cold is shown, and nothing of
another run — not its directory, its sockets, its outputs nor its transcript.  Its stderr is a
fifo of its own (``ForkServer.private_stderr``), so no run reads another's last words.  Everything
else stays the run's: the environment, the uid, the Landlock rules and rlimits (all in
its start's ``confine``), and a memory and a pids cgroup per worker with the run's limits.  Those
lie under one pair of parents for the batch (``cgroups``): the server makes each worker's
namespace init ahead of its request, and
``_cgroup.SpareGroups`` puts it in cgroups of its own ahead too, which the run that gets it
takes as its worker's (every run of the batch has the same limits).

Offered where a fork server gives the isolation of a cold start (bubblewrap, as root or in a
user namespace: ``provision.fork_server_refusal``) and to runs that are alike: the same
sandbox policy, Python and preloaded modules, ipc:// endpoints, a workspace, current
directory and output directory beneath the runs directory, and no
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

from engine.errors import SandboxError, UntrustedPython, WorkerStartError
from engine.launch._cgroup import SpareGroups, WorkerCgroups
from engine.launch._fork_server import ForkedProcess, ForkServer
from engine.launch._process import Launch
from engine.launch._settings import WorkerSettings
from engine.sandbox import TrustedPython, beneath, python_paths, server_plan, system_paths, trusted_python
from engine.trees import remove_tree

__all__ = ["RunView", "SharedForkServer"]


class RunView:
    """The shared server as one run uses it: every process it forks gets the run's view.  A
    provisioner (``engine.launch``) whose ``close`` leaves the server to the batch."""

    kind = "shared fork server"

    def __init__(self, shared: SharedForkServer, server: ForkServer, view: dict) -> None:
        self.shared = shared
        self.server = server
        self.view = view

    async def spawn(self, launch: Launch, on_root: Callable[[int], None] | None = None) -> ForkedProcess:
        if self.shared.closed:  # it would start again, with nobody left to close it
            raise WorkerStartError("the batch's fork server was closed")
        return await self.server.spawn(launch, on_root, view=self.view)

    async def close(self) -> None:
        pass  # the batch's, closed with the batch


class SharedForkServer:
    """One fork server for the runs beneath ``root`` (a batch's runs directory), started with
    the batch's ``settings`` (a run with other settings is not served).  Nothing starts before
    a run's first worker; ``close`` kills the server and every worker it forked, and removes
    the socket root."""

    def __init__(self, root: str | Path, settings: WorkerSettings) -> None:
        self.root = Path(os.path.realpath(root))
        self.settings = settings
        #: Where each run's socket directories go (a directory per run), made on first use.
        self.socket_root: Path | None = None
        self._runs = itertools.count(1)
        self._server: ForkServer | None = None
        self._closed = False
        self._holds_python: bool | None = None
        #: The batch's Python checked once for the whole root (False: it did not pass that check).
        self._python: TrustedPython | bool | None = None
        self._cgroups: tuple[WorkerCgroups | None, WorkerCgroups | None] | None = None
        #: Cgroups made ahead for the server's spare inits (``_cgroup.SpareGroups``).
        self.spares: SpareGroups | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pid(self) -> int | None:
        """The host pid of the server's sandbox (bubblewrap), while it runs."""
        return self._server.pid if self._server is not None else None

    def refuses(self, settings: WorkerSettings, *, cwd: Path, workspace: Path, output_dir: Path,
                own_workspaces: bool = False) -> str | None:
        """Why this server may not fork the workers of a run with ``settings`` and these
        directories (None: it may).  The caller has asked ``provision.fork_server_refusal``."""
        if self._closed:
            return "the batch's fork server is closed"
        if own_workspaces or settings.transport != "ipc":
            return "this run's workers start cold"
        if (settings.sandbox, settings.python, settings.preload) != \
                (self.settings.sandbox, self.settings.python, self.settings.preload):
            return "this run's sandbox, Python or preloaded modules differ from the batch's"
        root = str(self.root)
        workspace_path = os.path.realpath(workspace)
        inside = (workspace_path, os.path.realpath(output_dir))
        if workspace_path == root or not all(beneath(p, root) for p in inside) \
                or not beneath(os.path.realpath(cwd), workspace_path):
            return f"this run's directories do not all lie beneath {root}"
        if self._holds_python is None:  # (the same answer for every run: asked once)
            system, _ = system_paths()
            # (``settings.python``: the run's, checked by its launcher, and the batch's own.)
            self._holds_python = any(beneath(p, root) for p in (*system, *python_paths(settings.python)))
        if self._holds_python:
            return f"{root} holds a directory the workers' Python needs"
        return None

    def checked_python(self, python: str, workspace: Path) -> TrustedPython | None:
        """``python``, the batch's, as ``sandbox.trusted_python`` passed it for the whole root
        (every run's workspace lies beneath it, so none holds it), checked once for the batch
        instead of once a run; None for another Python, a workspace outside the root, or a Python
        that does not pass that stronger check (each run then checks its own, as before).  A
        batch's workers run that Python for the batch's life anyway: this server is one of it."""
        if python != self.settings.python or not beneath(os.path.realpath(workspace), str(self.root)):
            return None
        if self._python is None:
            try:
                self._python = trusted_python(python, self.root)
            except (UntrustedPython, SandboxError):
                self._python = False
        return self._python or None

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
            sandbox = self.settings.sandbox
            self.spares = SpareGroups([(cgroups, limit) for cgroups, limit in zip(
                self._cgroups, (sandbox.memory_bytes, sandbox.max_processes), strict=True) if cgroups])
        return self._cgroups

    def _spare(self, pid: int) -> None:
        """The server made the init ``pid`` ahead: its cgroups too, once the batch has them."""
        if self.spares is not None:
            self.spares.prepare(pid)

    def for_run(self, workspace: Path, output_dir: Path, env: dict[str, str], packages: dict[str, str],
                protected: tuple[str, ...] = (), *, python: str) -> RunView:
        """The server as a run it does not refuse uses it: its processes see the run's
        ``workspace`` (read-write, but ``protected``: read-only) and ``output_dir`` (read-only).
        ``env``, ``packages`` and ``python``: the server's environment, runtime packages and
        interpreter (``sandbox.TrustedPython``), the first run's (every run's are alike)."""
        assert self.socket_root is not None
        if self._server is None:
            settings = self.settings.replace(python=python)
            plan = server_plan(settings.sandbox, settings.python, self.root, self.socket_root)
            env = {**env, "HOME": "/"}  # (the server's; every worker gets its run's environment)
            self._server = ForkServer(plan, env, settings=settings, cwd=Path("/"), packages=packages,
                                      private_stderr=True, on_spare=self._spare)
        view = {"hide": [str(self.root), str(self.socket_root)],
                "show": [[os.path.realpath(workspace), False], [os.path.realpath(output_dir), True],
                         *([path, True] for path in protected)]}
        return RunView(self, self._server, view)

    async def close(self) -> None:
        """Kill the server (every worker it forked goes with it), remove the cgroups made
        ahead and the socket root.  A run opened afterwards starts its workers cold; one opened
        before gets WorkerStartError."""
        self._closed = True
        if self._server is not None:
            await self._server.close()
        if self.spares is not None:
            await asyncio.to_thread(self.spares.close)
        for cgroups in self._cgroups or ():
            if cgroups is not None:
                cgroups.close()
        if self.socket_root is not None:
            remove_tree(self.socket_root)
