"""The launcher: everything that touches the operating system to start a run's processes.

``Engine`` decides (the pool, shutdown, how many workers); the launcher acts: from the run's ``WorkerSettings``
it owns the run's directories, the ZeroMQ context and the endpoints, the sandbox plan, the processes'
environment, the cgroups, and the provisioner that starts them (``engine.launch``: cold, the run's fork server,
or a batch's), chosen once, here.  Sessions, workers and slots are handed a launcher and call only its public
methods; nothing here calls back up.  A run owns a private socket directory (mode 0700, one sub-directory per worker process, with its socket and
its output pipes, so a sandbox can expose exactly one worker's) and an output directory for block outputs too
large to keep in memory.  A run of a batch may be handed the batch's fork server (``engine.launch``): its
socket directory then lies beneath that server's socket root, and its workers are forked there, each shown
its own run's directories only.  Workers get an environment built from an allowlist, never a copy of the
coordinator's: API keys set for the coordinator do not reach model code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from engine import trust
from engine.environment import ALLOWLIST, environment
from engine.errors import ConfigError, WorkerStartError
from engine.launch._cgroup import SpareGroups, WorkerCgroups
from engine.launch._egress import Gates, proxy_env
from engine.launch._fork_server import ForkServer
from engine.launch._outpipe import OutputPipes
from engine.launch._process import (
    Launch,
    Process,
    descendants,
)
from engine.launch._provision import ColdStart, Provisioner, cold_note, fork_server_refusal, insisted
from engine.launch._run_dirs import (
    file_part,
    give_back,
    held_alone,
    hold_workspace,
    missing_dirs,
    remove_stale_runs,
    runtime_dir,
)
from engine.launch._settings import WorkerSettings
from engine.launch._shared_fork_server import RunView, SharedForkServer
from engine.results import OutputBudget, describe_exit
from engine.sandbox import (
    LaunchPlan,
    check_workspace,
    claim_uid,
    not_importable,
    protected_paths,
    release_uid,
    runtime_argv,
    runtime_packages,
    trusted_python,
)
from engine.sandbox import plan as make_plan
from engine.trees import remove_tree
from engine.trust import state_home
from worker.contract.sample import SlotSettings
from worker.contract.start import WORKER, StartSpec

if TYPE_CHECKING:  # (ZeroMQ is imported with the first worker's socket: a run of samples never needs it)
    import zmq

    from engine.launch._tcp import Gatekeeper, Guard

__all__ = ["Launcher"]
T = TypeVar("T")


log = logging.getLogger("agentloop")
#: The plans' details logged so far (``LaunchPlan.details``: once per process each).
_detailed: set[str] = set()


class Launcher:
    """Starts the processes of one run from its ``settings``: directories, sockets, sandbox,
    cgroups and the provisioner.  ``cwd`` and ``workspace``: the run's directories;
    ``own_workspaces``: each process sees an empty workspace of its own instead of the shared
    one (a tmpfs the fork server mounts there: code samples); ``shared``: a fork server shared
    with other runs (a batch's), which forks this run's workers where it can serve it.

    ``open`` is idempotent and ``close`` removes everything the run made (its fork server and
    every process it forked included); what a worker wrote to the workspace stays."""

    def __init__(self, settings: WorkerSettings, *, cwd: Path, workspace: Path, own_workspaces: bool = False,
                 shared: SharedForkServer | None = None, output_budget: OutputBudget | None = None) -> None:
        self.settings = settings
        #: What the run's output files may hold in all (and, through its parent, with the
        #: other runs sharing ``output_budget``: a batch's).
        self.output_budget = OutputBudget(settings.max_output, parent=output_budget) \
            if settings.max_output is not None else output_budget
        self.cwd = cwd
        self.workspace = workspace
        self.own_workspaces = own_workspaces
        self.shared = shared
        self._provisioner: Provisioner | None = None
        #: The directories this run made for its workspace, the workspace first, then each missing
        #: parent (``--workspace /new/dir``): removed again, as far as nothing was written there.
        self._made: list[Path] = []
        self._hold: int | None = None  # the workspace, open and locked shared (``hold_workspace``)
        self._found: os.stat_result | None = None
        self._uid_claim: str | None = None  # the workspace (real path) whose uid this run claimed
        #: Runtime packages the workers' Python lacks, loaded from agentloop's own copies.
        self.runtime_packages: dict[str, str] = {}
        # The pid in the name lets a later start remove what a killed coordinator left.
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + f"{os.getpid()}-{secrets.token_hex(3)}"
        self.run_dir = Path(settings.state_dir or state_home()) / "runs" / self.run_id
        self.output_dir = self.run_dir / "outputs"
        self.sock_root: Path | None = None
        self.memory_cgroups: WorkerCgroups | None = None  # each worker's memory limit
        self.pids_cgroups: WorkerCgroups | None = None  # each worker's process limit
        self._opened = False
        self._ctx: zmq.Context | None = None
        self._gatekeeper: Gatekeeper | None = None  # the ZAP handler of ``tcp`` workers' sockets
        self._guards: list[Guard] = []  # closed (again) before the context: see ``_tcp.Door``
        self._spares: SpareGroups | None = None  # cgroups made ahead for its fork server's spare inits
        self._outputs = 0
        self._first_plan: tuple[Path, LaunchPlan] | None = None
        self._shared_view: RunView | None = None
        #: What stays read-only in the workspace (``engine.sandbox``), found when it opens.
        self.protected: tuple[str, ...] = ()
        #: The record that workers may write the workspace (``engine.trust``), from the first plan.
        self._grant: trust.Grant | None = None
        #: Each sandbox's way out, with an allowlist (``--allow-net``); None without one.
        self.gates = Gates(settings.allow_net, self.run_dir / "network.jsonl") if settings.allow_net else None

    @property
    def opened(self) -> bool:
        return self._opened

    def open(self) -> None:
        """Create the run's directories (idempotent); the ZeroMQ context comes with the first socket."""
        if self._opened:
            return
        self.check_python()
        settings = self.settings
        if settings.sandbox.mode != "none":
            check_workspace(self.workspace, settings.python)
        try:
            self._made = missing_dirs(self.workspace)
            self._hold = hold_workspace(self.workspace)
            if self._hold is not None:
                self._found = os.fstat(self._hold)  # its owner and mode, given back at close
            self.protected = protected_paths(self.workspace)
            # Each directory of the state, the run's own included, is the user's alone: the run
            # ids in ``runs`` name live runs (``trust.state_dir``).
            trust.state_dir("runs", self.run_dir.name, base=self.run_dir.parent.parent)
            self.output_dir.mkdir(exist_ok=True)
            if settings.keep_output:
                (self.run_dir / ".kept").touch()
            remove_stale_runs(self.run_dir.parent)
            runtime = runtime_dir()
            remove_stale_runs(runtime)
            if self._served_by_shared():
                assert self.shared is not None
                self.sock_root = self.shared.run_sockets(runtime)
            else:
                self.sock_root = runtime / self.run_id
                self.sock_root.mkdir(mode=0o700)
        except OSError as exc:
            raise ConfigError(f"cannot create the run's directories: {exc}; "
                              "choose another --workspace or check permissions") from exc
        if (settings.sandbox.mode != "none" and os.geteuid() == 0 and settings.sandbox.worker_uid is None
                and not settings.sandbox.as_caller):  # (code that runs as the caller needs no uid of its own)
            workspace = os.path.realpath(self.workspace)  # (as the sandbox plan names it)
            try:
                claim_uid(workspace)  # the run's uid: this run's claim, held while it lives
            except OSError as exc:
                raise ConfigError(f"cannot claim a uid for the workers: {exc}") from exc
            self._uid_claim = workspace
        if self.shared is not None and self.sock_root.parent == self.shared.socket_root:
            self._shared_view = self.shared.for_run(self.workspace, self.output_dir, self.env(StartSpec(), None),
                                                    self.runtime_packages, self.protected, python=settings.python)
        self._opened = True
        if self._shared_view is not None:  # its workers' cgroups lie beside the other runs' (see close)
            self.memory_cgroups, self.pids_cgroups = self.shared.cgroups()
        elif settings.sandbox.mode != "none":
            self.memory_cgroups = WorkerCgroups.find(self.run_id.rsplit("-", 1)[-1])
            self.pids_cgroups = WorkerCgroups.find(self.run_id.rsplit("-", 1)[-1], "pids")

    def check_python(self) -> None:
        """ConfigError, in one line, unless the workers' Python starts, can run agentloop's
        runtime and imports every ``preload`` module; UntrustedPython for one a worker could
        have written, before it runs at all.  From here on ``settings.python`` is the checked
        interpreter (``sandbox.TrustedPython``), which every start of this run is given.  A run
        handed a batch's fork server takes the batch's Python as that server checked it once for
        every run beneath its root (``SharedForkServer.checked_python``)."""
        python = self.shared.checked_python(self.settings.python, self.workspace) if self.shared else None
        python = python or trusted_python(self.settings.python, self.workspace)
        self.settings = self.settings.replace(python=python)
        self.runtime_packages = runtime_packages(python)
        missing = not_importable(python, self.settings.preload)
        if missing:
            raise ConfigError(f"--preload: {', '.join(missing)} cannot be imported by the workers' Python "
                              f"{python}; install {'it' if len(missing) == 1 else 'them'} there "
                              f"({python} -m pip install ...) or choose that interpreter with --python")

    async def close(self) -> None:
        """Kill the fork server, destroy the context, remove the sockets, the cgroups and the
        run's directory (unless ``keep_output``; then only when empty); give the workspace back
        its group and mode, or remove it when this run made it and nothing was written there
        (either only when no other run holds it).  Workers are closed by their owners before
        this."""
        if self.gates is not None:
            await self.gates.close_all()
        if self._provisioner is not None and self._provisioner is not self._shared_view:
            await self._provisioner.close()
        if self._spares is not None:
            await asyncio.to_thread(self._spares.close)
        for guard in self._guards:
            guard.close()
        if self._gatekeeper is not None:
            self._gatekeeper.close()
            self._gatekeeper = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self.sock_root is not None:
            remove_tree(self.sock_root)
        for cgroups in (self.memory_cgroups, self.pids_cgroups) if self._shared_view is None else ():
            if cgroups is not None:  # (a shared server's parents are its own, closed with it)
                cgroups.close()
        if self._grant is not None:  # every worker is gone: what changes there now is not theirs
            await asyncio.to_thread(self._grant.end)
        if self._uid_claim is not None:
            release_uid(self._uid_claim)
            self._uid_claim = None
        if not self.settings.keep_output:
            await asyncio.to_thread(remove_tree, self.run_dir)
        with contextlib.suppress(OSError):
            self.output_dir.rmdir()  # only if no block needed a file
            (self.run_dir / ".kept").unlink()
            self.run_dir.rmdir()
        if self._hold is not None:
            alone = held_alone(self._hold)  # (another run on it keeps it as it is)
            if alone and self._found is not None:
                give_back(self._hold, self._found)
            if self._made and alone:
                for leftover in (self.workspace / ".tmp", *self._made):  # (.tmp: the fallback's TMPDIR)
                    try:
                        leftover.rmdir()
                    except FileNotFoundError:
                        continue
                    except OSError:  # something was written: it and what holds it stay
                        break
            os.close(self._hold)  # (the lock goes with it)
            self._hold = None

    def _context(self) -> zmq.Context:
        assert self._opened, "open() the launcher first"
        if self._ctx is None:  # (three sockets a worker: the default cap, 1023, stops at ~340)
            from zmq import MAX_SOCKETS, Context
            self._ctx = Context()
            self._ctx.set(MAX_SOCKETS, 16384)
        return self._ctx

    def socket(self) -> zmq.Socket:
        """A ROUTER socket of this run's context, for one worker."""
        from zmq import ROUTER
        return self._context().socket(ROUTER)

    def endpoint(self, number: int) -> tuple[str, Path]:
        """Where worker ``number`` connects: the endpoint to bind, and its own socket directory."""
        assert self.sock_root is not None, "open() the launcher first"
        sock_dir = self.sock_root / f"w{number}"
        sock_dir.mkdir(mode=0o700)
        if self.settings.transport == "tcp":
            return f"tcp://{self.settings.tcp_bind}:*", sock_dir
        return f"ipc://{sock_dir}/sock", sock_dir

    def bind(self, sock: zmq.Socket, endpoint: str, number: int) -> tuple[str, Guard | None]:
        """Bind worker ``number``'s socket to ``endpoint``; the address the worker dials, and
        for ``tcp`` the guard that lets that worker in and nobody else (``engine.launch``), which
        the session follows with the socket's connection events and closes when it ends."""
        import zmq

        from engine.launch._tcp import Gatekeeper, Guard
        settings = self.settings
        if settings.transport != "tcp":
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT), None
        if self._gatekeeper is None:
            self._gatekeeper = Gatekeeper(self._context())
        guard = Guard(sock, settings.tcp_bind, self._gatekeeper, f"w{number}")
        self._guards = [g for g in self._guards if not g.closed] + [guard]
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if settings.connect_host:
            endpoint = f"tcp://{settings.connect_host}:{endpoint.rsplit(':', 1)[1]}"
        return endpoint, guard

    def output_pipes(self, sock_dir: Path) -> OutputPipes | None:
        """The output pipes of the worker whose socket directory is ``sock_dir``, made (with
        the coordinator's read ends open) before it starts; None for a worker that may run on
        another machine (``tcp``), whose output comes over its socket."""
        return OutputPipes(sock_dir) if self.settings.transport == "ipc" else None

    def output_path(self, index: int, block_id: str) -> Path:
        """A file name of its own for one block's output: a sequence number makes it unique
        (a block id may be reused, and ids differing only in characters a file name cannot
        hold would otherwise meet); the id follows, readable where it is plain."""
        self._outputs += 1
        return self.output_dir / f"w{index}-{self._outputs}-{file_part(block_id)}.txt"

    def display_path(self, index: int, block_id: str, number: int) -> Path:
        """The files of display ``number`` of a block, without their endings (``.png``,
        ``.svg``, ``.html`` follow), beside the block outputs: named by the block and the
        number, unique as ``output_path``'s names are."""
        self._outputs += 1
        return self.output_dir / f"w{index}-{self._outputs}-{file_part(block_id)}-{number}"

    def plan(self, sock_dir: Path) -> LaunchPlan:
        """The sandbox plan for a process that may see ``sock_dir`` (a worker's, or the root).

        The plans of one run differ in the socket directory alone: the first is made in full
        (a few milliseconds: the view, the uid, the confinement), whether for the socket root
        (``run_uid``, the run's fork server) or a worker's directory in it; later ones are that
        plan shown their own directory (``for_socket_dir``), made searchable by the run's uid as
        the full one would.

        Before the first plan is returned (before any worker can exist), the record notes that
        workers may write the workspace, and what stays read-only there (``engine.trust``)."""
        first = self._first_plan  # (the run's socket root, its plan): its directories' plans follow from it
        if first is None or (sock_dir != first[0] and sock_dir.parent != first[0]):
            plan = make_plan(self.settings.sandbox, socket_dir=sock_dir, workspace=self.workspace,
                             cwd=self.cwd, output_dir=self.output_dir, python=self.settings.python,
                             memory_cgroup=self.memory_cgroups is not None,
                             pids_cgroup=self.pids_cgroups is not None, protected=self.protected)
            if self._grant is None and self.settings.sandbox.mode != "none":
                self._grant = trust.open_grant(self.workspace, self.protected if plan.pid_namespace else ())
            if first is None and self.sock_root in (sock_dir, sock_dir.parent):
                self._first_plan = (self.sock_root, plan.for_socket_dir(self.sock_root))
            return plan
        plan = first[1]
        if sock_dir == first[0]:
            return plan.for_socket_dir(sock_dir)  # (a copy: the kept one stays as it is)
        if plan.uid is not None:
            os.chmod(sock_dir, 0o711)  # as ``sandbox._share_with_run`` leaves a worker's directory
        return plan.for_socket_dir(sock_dir)

    def run_uid(self) -> int | None:
        """The uid (and gid) this run's workers switch to: a root coordinator's run has one of
        its own; None where they keep the coordinator's (not root, ``--sandbox none``, or a
        Python other users may not read).  The run is open."""
        assert self.sock_root is not None, "open() the launcher first"
        return self.plan(self.sock_root).uid

    def env(self, start: StartSpec, plan: LaunchPlan | None) -> dict[str, str]:
        """A process's whole environment: the ``ALLOWLIST`` policy's (``environment``, with the
        run's ``env_allow``), the sandbox's needs, and ``start`` (its token, confinement, ...:
        ``contract.start``) with what the plan decides of it.  Without a plan: the environment
        a fork server passes on (it confines nothing itself)."""
        env = environment(ALLOWLIST, allow=self.settings.env_allow)
        env["HOME"] = str(self.workspace)
        env["TMPDIR"] = "/tmp"
        if plan is None:
            env.update(start.to_env())
            return env
        if start.egress:  # its forwarder's port, for every client that reads a proxy variable
            env.update(proxy_env())
        env.update(plan.env)  # what the sandbox needs (a private TMPDIR without bubblewrap)
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # for the Pythons user code starts (``-B`` is ours)
        tty = ""
        if self.settings.tty and start.token:
            size = shutil.get_terminal_size()
            tty = f"{','.join(map(str, self.settings.tty))}:{size.lines}x{size.columns}"
        # Inside a PID namespace the process's parent is the namespace's init, not us.
        start = start.replace(confine=plan.confine, tty=start.tty or tty,
                              parent=0 if plan.pid_namespace else os.getpid())
        env.update(start.to_env())
        return env

    def launch(self, endpoint: str, sock_dir: Path, token: str, *, entry: str = WORKER, output: bool = False,
               slot: SlotSettings | None = None, uid: int | None = None, guard: Guard | None = None) -> Launch:
        """How to start one process (``entry``: a worker, or a sample slot) whose socket lives
        in ``sock_dir``; ``output``: its output pipes are there too (``output_pipes``).  The
        process opens them before it confines itself (while it has the coordinator's uid, or
        root's), so they stay 0600.  ``uid`` (``own_uid``): where the run's workers switch uid,
        this process switches to ``uid`` instead of the run's.  ``guard``: its socket's
        (``bind``), whose keys it needs to connect."""
        plan = self.plan(sock_dir)
        if uid is not None and plan.uid is not None:  # (a copy: the first plan is kept)
            plan = dataclasses.replace(plan, uid=uid, confine=plan.confine.replace(uid=(uid, uid)))
        if endpoint.startswith("ipc://"):
            plan.grant(Path(endpoint[len("ipc://"):]))
        egress = self.gates.open(sock_dir, plan) if self.gates is not None else ""
        # A slot is told its endpoint in its settings, not on its command line (every sample
        # could read that).
        args = (endpoint,) if entry == WORKER else ()
        command = runtime_argv(self.settings.python, entry, *args, packages=self.runtime_packages)
        env = self.env(StartSpec(token=token, output=str(sock_dir) if output else "", slot=slot,
                                 curve=guard.env if guard is not None else "", egress=egress), plan)
        for detail in plan.details:
            if detail not in _detailed:
                _detailed.add(detail)
                log.info("%s", detail)
        note = cold_note(self.settings)
        return Launch(plan.argv_prefix, command, endpoint, env, Path(plan.cwd) if plan.cwd else self.cwd,
                      plan.pid_namespace, [*plan.notes, note] if note else plan.notes, serves_blocks=entry == WORKER)

    def own_uid(self, name: str) -> int | None:
        """A uid of its own for one process of this run (a sample slot: samples that run at
        once then share no per-user kernel quota, terminal or file), claimed under ``name``
        (unique to the process) until ``release_uid(name)``; None where workers do not switch
        uid (an unprivileged coordinator, ``--sandbox none``, a ``worker_uid`` chosen)."""
        sandbox = self.settings.sandbox
        if sandbox.mode == "none" or os.geteuid() != 0 or sandbox.worker_uid is not None:
            return None
        return claim_uid(name)

    @staticmethod
    def release_uid(name: str) -> None:
        """Give back the uid ``own_uid(name)`` claimed, once no process runs as it."""
        release_uid(name)

    def _served_by_shared(self) -> bool:
        return (self.shared is not None and fork_server_refusal(self.settings) is None
                and self.shared.refuses(self.settings, cwd=self.cwd, workspace=self.workspace,
                                        output_dir=self.output_dir, own_workspaces=self.own_workspaces) is None)

    def provisioner(self) -> Provisioner:
        """What starts this run's processes, chosen once (the run is open).

        A fork server where it gives the isolation of a cold start (``fork_server_refusal``):
        the batch's shared one when it serves this run, else the run's own; otherwise a cold
        start — or, where the run insists (``fork_server=True``, code samples), ConfigError."""
        if self._provisioner is not None:
            return self._provisioner
        assert self.sock_root is not None, "open() the launcher first"
        if self._shared_view is not None:
            self._provisioner = self._shared_view
            return self._provisioner
        why = fork_server_refusal(self.settings)
        if why is None and self.shared is not None:
            why = self.shared.refuses(self.settings, cwd=self.cwd, workspace=self.workspace,
                                      output_dir=self.output_dir, own_workspaces=self.own_workspaces) \
                or "this run opened before the batch's fork server could serve it"
        if why is not None:
            insisted(self.settings, self.own_workspaces, why)
            self._provisioner = ColdStart()
            return self._provisioner
        plan = self.plan(self.sock_root)
        self._spares = SpareGroups(self.group_limits())
        server = ForkServer(plan, self.env(StartSpec(), None), settings=self.settings, cwd=self.cwd,
                            packages=self.runtime_packages,
                            own_workspace=str(self.workspace) if self.own_workspaces else None,
                            on_spare=self._spares.prepare)
        self._provisioner = server
        return server

    async def start_process(self, launch: Launch, number: int, greeting: Awaitable[T],
                            what: str = "worker") -> tuple[Process, list[Path], T]:
        """Start ``launch`` (process ``number`` of the launcher's run, a ``what``) and wait for
        ``greeting``: the process, the cgroups it is in, and what the greeting gave.

        Its memory and process cgroups are made and entered while it starts, from the moment its
        tree has a root (for a forked process, the namespace's init, whose children are then born
        inside), and checked again once it has said hello: before it runs any code.  On failure —
        the greeting raising, the process exiting, ``start_timeout`` passing, a cgroup refused —
        the process is killed, its cgroups released and WorkerStartError says why, with the end of
        what it wrote on stderr.  Cancelled half-way, it leaves nothing running."""
        provisioner = self.provisioner()
        moved: dict[Path, set[int]] = {}
        groups: list[Path] = []
        adopting: asyncio.Future | None = None

        def enter(root: int) -> None:
            groups.extend(self.worker_groups(number, root))
            self.adopt(groups, root, moved)

        def on_root(root: int) -> None:
            nonlocal adopting
            if adopting is None:
                adopting = asyncio.ensure_future(asyncio.to_thread(enter, root))

        greeted = asyncio.ensure_future(greeting)
        proc: Process | None = None
        try:
            making = asyncio.ensure_future(provisioner.spawn(launch, on_root))
            try:
                proc = await asyncio.shield(making)
            except asyncio.CancelledError:
                # asyncio's clean-up of a half-made subprocess can wait for ever and leave the
                # sandbox running: it is made whole, then killed below with its tree.
                while not making.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([making])
                proc = None if making.cancelled() or making.exception() else making.result()
                raise
            except OSError as exc:
                raise WorkerStartError(f"could not start a process ({launch.argv[0]}): {exc}") from exc
            on_root(proc.pid)
            exited = asyncio.ensure_future(proc.wait())
            try:
                done, _ = await asyncio.wait({greeted, exited}, timeout=self.settings.start_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                exited.cancel()
            assert adopting is not None
            await adopting
            if greeted in done and not greeted.exception() and groups:
                tree = {proc.pid, *descendants(proc.pid)}
                if any(not tree <= moved.get(group, set()) for group in groups):  # (a move waits)
                    await asyncio.to_thread(self.adopt, groups, proc.pid, moved)
            if greeted not in done or greeted.exception():
                died = exited in done
                await proc.kill()  # waits for the exit status too, wherever it comes from
                if greeted.done() and greeted.exception():
                    reason = str(greeted.exception())
                elif died:
                    reason = describe_exit(proc.returncode or 0, via_namespace=launch.pid_namespace)[0]
                else:
                    reason = f"no handshake within {self.settings.start_timeout:g} s"
                said = proc.stderr_tail.decode("utf-8", "replace").strip()
                raise WorkerStartError(f"{what} failed to start: {reason}" + (f"\n{said}" if said else ""))
            return proc, groups, greeted.result()
        except BaseException:
            greeted.cancel()
            if adopting is not None:  # its thread is done with the cgroups before they go
                with contextlib.suppress(BaseException):
                    await asyncio.shield(asyncio.gather(adopting, return_exceptions=True))
            if proc is not None:
                await asyncio.shield(proc.kill())
            self.release_groups(groups)
            raise

    def group_limits(self) -> list[tuple[WorkerCgroups, int]]:
        """The run's cgroup parents, each with the limit a worker gets there."""
        sandbox = self.settings.sandbox
        return [(cgroups, limit) for cgroups, limit in ((self.memory_cgroups, sandbox.memory_bytes),
                                                        (self.pids_cgroups, sandbox.max_processes))
                if cgroups is not None]

    def worker_groups(self, number: int, root: int | None = None) -> list[Path]:
        """The cgroups of worker ``number``: one limiting its memory and one its processes,
        where the run has them; those made ahead for ``root`` (its fork server's spare init:
        already inside them) where there are.  Raises WorkerStartError when one cannot be
        made: the sandbox was planned on it."""
        spares = self._spares if self._shared_view is None else self.shared.spares
        made = spares.take(root) if spares is not None and root is not None else None
        if made is not None:
            return made
        groups: list[Path] = []
        for cgroups, limit in self.group_limits():
            group = cgroups.make(f"w{number}", limit)
            if group is None:
                self.release_groups(groups)
                raise WorkerStartError(f"could not make the worker's {cgroups.controller} cgroup (agentloop "
                                       "-v logs why); its limit would not hold")
            groups.append(group)
        return groups

    @staticmethod
    def adopt(groups: list[Path], root: int, moved: dict[Path, set[int]]) -> None:
        """Move the tree of process ``root`` into each of ``groups`` (see ``adopt_tree``)."""
        for group in groups:
            if not WorkerCgroups.adopt_tree(group, root, moved.setdefault(group, set())):
                raise WorkerStartError("could not put the worker in its cgroups (agentloop -v logs "
                                       "why); its limits would not hold")

    @staticmethod
    def release_groups(groups: list[Path]) -> None:
        for group in groups:
            WorkerCgroups.remove(group)

    async def release(self, groups: list[Path], sock_dir: Path | None) -> None:
        """What a worker process held once it is dead: its cgroups and its socket directory,
        removed off the event loop by a walk that takes any shape or size (the directory is
        read-only to the worker, but nothing it could reach is trusted)."""
        self.release_groups(groups)
        if self.gates is not None:
            await self.gates.close(sock_dir)
        if sock_dir is not None:
            await asyncio.to_thread(remove_tree, sock_dir)

    def memory_exceeded(self, groups: list[Path]) -> bool:
        """Whether the kernel killed a process in one of ``groups`` for its memory limit."""
        cgroups = self.memory_cgroups
        return cgroups is not None and any(g.parent == cgroups.base and cgroups.oom_killed(g) for g in groups)

    def memory_held(self, groups: list[Path], within: int = 0) -> int | None:
        """Bytes charged to the memory cgroup among ``groups`` that reclaim cannot free
        (``WorkerCgroups.held``, ``within`` included), None without one."""
        cgroups = self.memory_cgroups
        if cgroups is None:
            return None
        return next((cgroups.held(g, within) for g in groups if g.parent == cgroups.base), None)

    def oom_kills(self, groups: list[Path]) -> int:
        """How many processes of ``groups`` the kernel killed for their memory limit so far."""
        cgroups = self.memory_cgroups
        return 0 if cgroups is None else sum(cgroups.oom_kills(g) for g in groups if g.parent == cgroups.base)
