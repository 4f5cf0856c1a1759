"""The launcher: everything that touches the operating system to start a worker.

``Engine`` decides (the pool, shutdown, how many workers); the launcher acts: it owns the
run's directories, the ZeroMQ context and the endpoints, the sandbox plan, the worker's
environment, the cgroups, the cold start and the fork server.  Sessions, workers and the fork
server are handed a launcher and call only its public methods; nothing here calls back up.

A run owns a private socket directory (mode 0700, one sub-directory per worker process, with
its socket and its output pipes, so a sandbox can expose exactly one worker's) and an output
directory for block outputs too large to keep in memory.  A run of a batch may be handed the
batch's fork server (``engine._shared_fork``): its socket directory then lies beneath that
server's socket root, and its workers are forked there, each shown its own run's directories
only.  Workers get an environment built from an allowlist, never a copy of the coordinator's:
API keys set for the coordinator do not reach model code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import zmq

from . import _uids, interpreter
from . import sandbox as _sandbox
from ._cgroup import SpareGroups, WorkerCgroups
from ._outpipe import OutputPipes
from ._process import Launch
from ._shared_fork import RunForkServer, SharedForkServer
from ._tree import remove_tree
from ._zygote import Zygote
from .errors import ConfigError, WorkerStartError
from .file_sandbox import kept_read_only

#: Variables a worker inherits from the coordinator's environment, if set.  Everything else
#: (API keys, cloud credentials, tokens) stays behind.
ENV_ALLOWLIST = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_NUMERIC",
                 "TERM", "TZ", "PYTHONIOENCODING", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def _state_home() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "agentloop"


def _runtime_home() -> Path:
    # Short on purpose: an ipc:// path must fit in 107 bytes.
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and len(xdg) < 40:
        return Path(xdg) / "agentloop"
    return Path("/tmp") / f"agentloop-{os.getuid()}"


def _remove_stale_runs(parent: Path) -> None:
    """Remove what coordinators that were killed (SIGKILL, a crash) left in ``parent``: run
    directories are named ``DATE-TIME-PID-HEX``, and one whose PID no longer runs is stale.
    A PID taken again by another process keeps its directory until that one ends too; a run
    that was asked to keep its output (a ``.kept`` file) keeps it."""
    with contextlib.suppress(OSError):
        for entry in list(parent.iterdir()):
            fields = entry.name.split("-")
            if (len(fields) == 4 and fields[2].isdigit() and int(fields[2]) != os.getpid()
                    and not os.path.exists(f"/proc/{fields[2]}") and entry.is_dir()
                    and not entry.is_symlink() and entry.lstat().st_uid == os.getuid()
                    and not (entry / ".kept").exists()):
                remove_tree(entry)


def _file_part(block_id: str) -> str:
    """``block_id`` as a short file-name part: ASCII letters, digits, ``-`` and ``.`` as they
    are, every other character as ``_`` and its UTF-8 bytes in hex (so ``x/y`` and ``x_y``
    stay apart), cut at 48 characters."""
    out = "".join(c if c.isascii() and (c.isalnum() or c in "-.") else
                  "".join(f"_{b:02x}" for b in c.encode()) for c in block_id)
    return out.lstrip(".")[:48]


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or path.is_symlink():
        raise ConfigError(f"{path} is not a private directory of this user; remove it and retry")
    return path


class Launcher:
    """Starts worker processes for one run: directories, sockets, sandbox, cgroups, fork server.

    ``open`` is idempotent and ``close`` removes everything the run made (the fork server and
    every worker it forked included); what a worker wrote to the workspace stays."""

    def __init__(
        self,
        *,
        cwd: Path,
        workspace: Path,
        sandbox: _sandbox.SandboxPolicy,
        python: str,
        transport: str = "ipc",
        tcp_bind: str = "127.0.0.1",
        connect_host: str | None = None,
        state_dir: str | Path | None = None,
        start_timeout: float = 30.0,
        grace: float = 0.5,
        env_allow: Iterable[str] = (),
        output_file_cap: int = 256 * 1024 * 1024,
        zygote: bool | None = None,
        preload: Iterable[str] = (),
        keep_output: bool = False,
        own_workspaces: bool = False,
        tty: Iterable[int] = (),
        fork_server: SharedForkServer | None = None,
    ) -> None:
        if transport not in ("ipc", "tcp"):
            raise ConfigError(f"transport must be 'ipc' or 'tcp', not {transport!r}")
        self.cwd = cwd
        self.workspace = workspace
        self.sandbox = sandbox
        self.python = python
        self.transport = transport
        self.tcp_bind = tcp_bind
        self.connect_host = connect_host
        self.start_timeout = start_timeout
        #: Seconds a block or process that was asked to stop is given before the hard kill.
        self.grace = grace
        self.env_allow = tuple(env_allow)
        self.output_file_cap = output_file_cap
        self.zygote = zygote
        self.preload = tuple(preload)
        #: Keep the run's directory (block outputs too large for memory) after ``close``.
        self.keep_output = keep_output
        #: Each worker sees an empty workspace of its own instead of the shared one (a tmpfs the
        #: fork server mounts there; code samples).  Needs the fork server.
        self.own_workspaces = own_workspaces
        #: The workers' fds (1, 2) that are a terminal (a pty of their own, with the size of the
        #: coordinator's terminal) instead of a pipe: what ``exec`` gives a script on a terminal.
        self.tty = tuple(fd for fd in tty if fd in (1, 2))
        #: A fork server shared with other runs (a batch's).  Where it serves this run, the
        #: run's workers are forked there; where it refuses, they start cold: a run handed one
        #: never starts a server of its own.
        self.shared = fork_server
        self._shared_view: RunForkServer | None = None
        self._made_workspace = False  # made by this run: removed again when nothing was written
        self._uid_claimed = False
        #: Runtime packages the workers' Python lacks, loaded from agentloop's own copies.
        self.runtime_packages: dict[str, str] = {}
        # The pid in the name lets a later start remove what a killed coordinator left.
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + f"{os.getpid()}-{secrets.token_hex(3)}"
        self.run_dir = Path(state_dir or _state_home()) / "runs" / self.run_id
        self.output_dir = self.run_dir / "outputs"
        self.sock_root: Path | None = None
        self.memory_cgroups: WorkerCgroups | None = None  # each worker's memory limit
        self.pids_cgroups: WorkerCgroups | None = None  # each worker's process limit
        self._ctx: zmq.Context | None = None
        self._zygote: Zygote | None = None
        self._spares: SpareGroups | None = None  # cgroups made ahead for its fork server's spare inits
        self._outputs = 0
        self._first_plan: tuple[Path, _sandbox.LaunchPlan] | None = None
        #: What stays read-only in the workspace (``file_sandbox.kept_read_only``), found when it opens.
        self.protected: tuple[str, ...] = ()

    @property
    def opened(self) -> bool:
        return self._ctx is not None

    def open(self) -> None:
        """Create the run's directories and the ZeroMQ context (idempotent)."""
        if self._ctx is not None:
            return
        self.check_python()
        if self.sandbox.mode != "none":
            _sandbox.check_workspace(self.workspace, self.python)
        try:
            self._made_workspace = not self.workspace.exists()
            self.workspace.mkdir(parents=True, exist_ok=True)
            self.protected = kept_read_only(self.workspace.resolve(), self.python)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
            if self.keep_output:
                (self.run_dir / ".kept").touch()
            _remove_stale_runs(self.run_dir.parent)
            runtime = _private_dir(_runtime_home())
            _remove_stale_runs(runtime)
            if self.shared is not None and self.shared.refuses(self) is None:
                self.sock_root = self.shared.run_sockets(runtime)
            else:
                self.sock_root = runtime / self.run_id
                self.sock_root.mkdir(mode=0o700)
        except OSError as exc:
            raise ConfigError(f"cannot create the run's directories: {exc}; "
                              "choose another --workspace or check permissions") from exc
        if (self.sandbox.mode != "none" and os.geteuid() == 0 and self.sandbox.worker_uid is None
                and not self.sandbox.as_caller):
            self._uid_claimed = True
            _uids.claim(str(self.workspace))  # the run's uid, its own while it lives
        if self.shared is not None and self.sock_root.parent == self.shared.socket_root:
            self._shared_view = self.shared.for_run(self)
        self._ctx = zmq.Context()
        # Each worker costs three ZeroMQ sockets (its channel, a monitor and the monitor's peer);
        # the default cap of 1023 would stop an engine at about 340 workers.
        self._ctx.set(zmq.MAX_SOCKETS, 16384)
        if self._shared_view is not None:  # its workers' cgroups lie beside the other runs' (see close)
            self.memory_cgroups, self.pids_cgroups = self.shared.cgroups()
        elif self.sandbox.mode != "none":
            self.memory_cgroups = WorkerCgroups.find(self.run_id.rsplit("-", 1)[-1])
            self.pids_cgroups = WorkerCgroups.find(self.run_id.rsplit("-", 1)[-1], "pids")

    def check_python(self) -> None:
        """ConfigError, in one line, unless the workers' Python starts, can run agentloop's
        runtime and imports every ``preload`` module; nor one a worker could have written."""
        interpreter.refuse_untrusted(self.python, self.workspace)
        self.runtime_packages = interpreter.runtime_packages(self.python)
        missing = interpreter.not_importable(self.python, self.preload)
        if missing:
            raise ConfigError(f"--preload: {', '.join(missing)} cannot be imported by the workers' Python "
                              f"{self.python}; install {'it' if len(missing) == 1 else 'them'} there "
                              f"({self.python} -m pip install ...) or choose that interpreter with --python")

    async def close(self) -> None:
        """Kill the fork server, destroy the context, remove the sockets, the cgroups and the
        run's directory (unless ``keep_output``; then only when empty), and the workspace when
        this run made it and nothing was written there.  Workers are closed by their owners
        before this."""
        if self._zygote is not None:
            await self._zygote.close()
        if self._spares is not None:
            await asyncio.to_thread(self._spares.close)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self.sock_root is not None:
            remove_tree(self.sock_root)
        for cgroups in (self.memory_cgroups, self.pids_cgroups) if self._shared_view is None else ():
            if cgroups is not None:  # (a shared server's parents are its own, closed with it)
                cgroups.close()
        if self._uid_claimed:
            self._uid_claimed = False
            _uids.release(str(self.workspace))
        if not self.keep_output:
            await asyncio.to_thread(remove_tree, self.run_dir)
        with contextlib.suppress(OSError):
            self.output_dir.rmdir()  # only if no block needed a file
            (self.run_dir / ".kept").unlink()
            self.run_dir.rmdir()
        if self._made_workspace:
            for leftover in (self.workspace / ".tmp", self.workspace):  # (.tmp: the fallback's TMPDIR)
                with contextlib.suppress(OSError):
                    leftover.rmdir()

    # -- one worker -------------------------------------------------------------------------------
    def socket(self) -> zmq.Socket:
        """A ROUTER socket of this run's context, for one worker."""
        assert self._ctx is not None, "open() the launcher first"
        return self._ctx.socket(zmq.ROUTER)

    def endpoint(self, number: int) -> tuple[str, Path]:
        """Where worker ``number`` connects: the endpoint to bind, and its own socket directory."""
        assert self.sock_root is not None, "open() the launcher first"
        sock_dir = self.sock_root / f"w{number}"
        sock_dir.mkdir(mode=0o700)
        if self.transport == "tcp":
            return f"tcp://{self.tcp_bind}:*", sock_dir
        return f"ipc://{sock_dir}/sock", sock_dir

    def output_pipes(self, sock_dir: Path) -> OutputPipes | None:
        """The output pipes of the worker whose socket directory is ``sock_dir``, made (with
        the coordinator's read ends open) before it starts; None for a worker that may run on
        another machine (``tcp``), whose output comes over its socket."""
        return OutputPipes(sock_dir) if self.transport == "ipc" else None

    def output_path(self, index: int, block_id: str) -> Path:
        """A file name of its own for one block's output: a sequence number makes it unique
        (a block id may be reused, and ids differing only in characters a file name cannot
        hold would otherwise meet); the id follows, readable where it is plain."""
        self._outputs += 1
        return self.output_dir / f"w{index}-{self._outputs}-{_file_part(block_id)}.txt"

    def plan(self, sock_dir: Path) -> _sandbox.LaunchPlan:
        """The sandbox plan for a process that may see ``sock_dir`` (a worker's, or the root).

        The plans of one run differ in the socket directory alone: the first is made in full
        (a few milliseconds: the view, the uid, the confinement), later ones are copies of it
        naming their own directory, made searchable by the run's uid as the full one would."""
        first = self._first_plan
        if first is None or sock_dir.parent != first[0].parent:
            plan = _sandbox.plan(self.sandbox, socket_dir=sock_dir, workspace=self.workspace,
                                 cwd=self.cwd, output_dir=self.output_dir, python=self.python,
                                 memory_cgroup=self.memory_cgroups is not None,
                                 pids_cgroup=self.pids_cgroups is not None, protected=self.protected)
            if first is None and sock_dir.parent == self.sock_root:
                self._first_plan = (sock_dir, plan)
            return plan
        old, plan = first
        if plan.uid is not None:
            os.chmod(sock_dir, 0o711)  # as ``sandbox._share_with_run`` leaves a worker's directory
        return dataclasses.replace(plan, argv_prefix=[str(sock_dir) if a == str(old) else a
                                                      for a in plan.argv_prefix],
                                   confine=json.loads(json.dumps(plan.confine)), notes=list(plan.notes),
                                   env=dict(plan.env))

    def env(self, token: str, plan: _sandbox.LaunchPlan) -> dict[str, str]:
        """A worker's whole environment: the allowlist, the sandbox's needs, the handshake token."""
        env = {k: os.environ[k] for k in (*ENV_ALLOWLIST, *self.env_allow) if k in os.environ}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env["HOME"] = str(self.workspace)
        env["TMPDIR"] = "/tmp"
        env.update(plan.env)  # what the sandbox needs (a private TMPDIR without bubblewrap)
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # for the Pythons user code starts (``-B`` is ours)
        env["AGENTLOOP_TOKEN"] = token
        if not plan.pid_namespace:  # inside a PID namespace our parent is the namespace's init
            env["AGENTLOOP_PARENT"] = str(os.getpid())
        if plan.confine:
            env["AGENTLOOP_CONFINE"] = json.dumps(plan.confine)
        if self.tty and token:
            size = shutil.get_terminal_size()
            env["AGENTLOOP_TTY"] = f"{','.join(map(str, self.tty))}:{size.lines}x{size.columns}"
        return env

    def launch(self, endpoint: str, sock_dir: Path, token: str, *, output: bool = False) -> Launch:
        """How to start one worker process whose socket lives in ``sock_dir``; ``output``: its
        output pipes are there too (``output_pipes``).  The worker opens them before it
        confines itself (while it has the coordinator's uid, or root's), so they stay 0600."""
        plan = self.plan(sock_dir)
        if endpoint.startswith("ipc://"):
            plan.grant(Path(endpoint[len("ipc://"):]))
        argv = [*plan.argv_prefix, *_sandbox.runtime_argv(self.python, "worker.__main__:main", endpoint,
                                                          packages=self.runtime_packages)]
        env = self.env(token, plan)
        if output:
            env["AGENTLOOP_OUTPUT"] = str(sock_dir)
        return Launch(argv, env, Path(plan.cwd) if plan.cwd else self.cwd, plan.pid_namespace, plan.notes)

    def fork_server(self, launch: Launch) -> Zygote | RunForkServer | None:
        """The fork server to start ``launch`` with, or None to start it cold.

        ``zygote=None`` (the default) uses one where it can give the same isolation: a root
        coordinator with bubblewrap.  A run handed a shared server uses that one or none."""
        usable = self.zygote is not False and launch.pid_namespace and Zygote.usable(launch.argv)
        if not usable or (self.shared is not None and self._shared_view is None):
            if self.zygote or self.own_workspaces:
                why = self.shared.refuses(self) if self.shared is not None and usable else None
                raise ConfigError(why or "the fork server needs bubblewrap and a coordinator running as root")
            return None
        if self._shared_view is not None:
            return self._shared_view
        if self._zygote is None:
            assert self.sock_root is not None
            plan = self.plan(self.sock_root)
            self._zygote = Zygote(plan, self.env("", plan), python=self.python, packages=self.runtime_packages,
                                  cwd=self.cwd, sandbox=self.sandbox, start_timeout=self.start_timeout,
                                  preload=self.preload)
            if self.own_workspaces:
                self._zygote.own_workspace = str(self.workspace)
            self._spares = SpareGroups(self.group_limits())
            self._zygote.on_spare = self._spares.prepare
        return self._zygote

    # -- cgroups ----------------------------------------------------------------------------------
    def group_limits(self) -> list[tuple[WorkerCgroups, int]]:
        """The run's cgroup parents, each with the limit a worker gets there."""
        return [(cgroups, limit) for cgroups, limit in ((self.memory_cgroups, self.sandbox.memory_bytes),
                                                        (self.pids_cgroups, self.sandbox.max_processes))
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
        if sock_dir is not None:
            await asyncio.to_thread(remove_tree, sock_dir)

    def memory_exceeded(self, groups: list[Path]) -> bool:
        """Whether the kernel killed a process in one of ``groups`` for its memory limit."""
        cgroups = self.memory_cgroups
        return cgroups is not None and any(g.parent == cgroups.base and cgroups.oom_killed(g) for g in groups)

    def oom_kills(self, groups: list[Path]) -> int:
        """How many processes of ``groups`` the kernel killed for their memory limit so far."""
        cgroups = self.memory_cgroups
        return 0 if cgroups is None else sum(cgroups.oom_kills(g) for g in groups if g.parent == cgroups.base)
