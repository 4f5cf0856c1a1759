"""The engine: one run's workers, their sockets, sandbox and output files.

``Engine`` is the asyncio entry point of the coordinator::

    async with Engine() as engine:
        worker = await engine.start_worker()
        result = await worker.run("print(6 * 7)", timeout=5)
        print(result.status, result.output)

A run owns a private socket directory (mode 0700, one sub-directory per worker process so a
sandbox can expose exactly one socket) and an output directory for block outputs too large
to keep in memory.  Workers get an environment built from an allowlist, never a copy of
the coordinator's: API keys set for the coordinator do not reach model code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq

from . import sandbox as _sandbox
from ._cgroup import WorkerCgroups
from ._session import Session
from ._tree import remove_tree
from ._zygote import Zygote
from .errors import AgentloopError, ConfigError, WorkerStartError
from .worker import Worker

log = logging.getLogger("agentloop")


@dataclass
class Launch:
    """Everything needed to start one worker process."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    pid_namespace: bool
    notes: list[str]


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
    A PID taken again by another process keeps its directory until that one ends too."""
    with contextlib.suppress(OSError):
        for entry in list(parent.iterdir()):
            fields = entry.name.split("-")
            if (len(fields) == 4 and fields[2].isdigit() and int(fields[2]) != os.getpid()
                    and not os.path.exists(f"/proc/{fields[2]}") and entry.is_dir()
                    and not entry.is_symlink() and entry.lstat().st_uid == os.getuid()):
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


class Engine:
    """Starts, supervises and shuts down the workers of one run."""

    def __init__(
        self,
        *,
        cwd: str | Path | None = None,
        workspace: str | Path | None = None,
        sandbox: _sandbox.SandboxPolicy | None = None,
        transport: str = "ipc",
        tcp_bind: str = "127.0.0.1",
        connect_host: str | None = None,
        state_dir: str | Path | None = None,
        start_timeout: float = 30.0,
        grace: float = 0.5,
        env_allow: Iterable[str] = (),
        python: str | None = None,
        output_file_cap: int = 256 * 1024 * 1024,
        pool: int = 1,
        pool_idle: float = 60.0,
        zygote: bool | None = None,
        preload: Iterable[str] = (),
    ) -> None:
        if transport not in ("ipc", "tcp"):
            raise ConfigError(f"transport must be 'ipc' or 'tcp', not {transport!r}")
        if not 0 < grace <= 1.0:
            raise ConfigError("grace must be in (0, 1] seconds")
        self.cwd = Path(cwd or os.getcwd()).resolve()
        self.workspace = Path(workspace).resolve() if workspace else self.cwd / "files"
        self.sandbox = sandbox or _sandbox.SandboxPolicy()
        self.transport = transport
        self.tcp_bind = tcp_bind
        self.connect_host = connect_host
        self.start_timeout = start_timeout
        self.grace = grace
        self.env_allow = tuple(env_allow)
        self.python = python or sys.executable
        self.output_file_cap = output_file_cap
        self.pool_size = max(0, pool)
        self.pool_idle = pool_idle
        self.zygote = zygote
        self.preload = tuple(preload)
        self._zygote: Zygote | None = None
        self._pool: list[Session] = []
        self._pool_filling: asyncio.Task | None = None
        self._pool_shrink: asyncio.TimerHandle | None = None
        # The pid in the name lets a later start remove what a killed coordinator left.
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + f"{os.getpid()}-{secrets.token_hex(3)}"
        self.run_dir = Path(state_dir or _state_home()) / "runs" / self.run_id
        self.output_dir = self.run_dir / "outputs"
        self.workers: list[Worker] = []
        self._ctx: zmq.Context | None = None
        self._sock_root: Path | None = None
        self._cgroups: WorkerCgroups | None = None  # each worker's memory limit
        self._pids: WorkerCgroups | None = None  # each worker's process limit
        self._outputs = 0
        self._closed = False

    async def __aenter__(self) -> Engine:
        self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def open(self) -> None:
        """Create the run's directories and the ZeroMQ context (idempotent)."""
        if self._ctx is not None:
            return
        if self.sandbox.mode != "none":
            _sandbox.check_workspace(self.workspace, self.python)
        try:
            self.workspace.mkdir(parents=True, exist_ok=True)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
            _remove_stale_runs(self.run_dir.parent)
            runtime = _private_dir(_runtime_home())
            _remove_stale_runs(runtime)
            self._sock_root = runtime / self.run_id
            self._sock_root.mkdir(mode=0o700)
        except OSError as exc:
            raise ConfigError(f"cannot create the run's directories: {exc}; "
                              "choose another --workspace or check permissions") from exc
        self._ctx = zmq.Context()
        # Each worker costs three ZeroMQ sockets (its channel, a monitor and the monitor's peer);
        # the default cap of 1023 would stop an engine at about 340 workers.
        self._ctx.set(zmq.MAX_SOCKETS, 16384)
        if self.sandbox.mode != "none":
            self._cgroups = WorkerCgroups.find(self.run_id.rsplit("-", 1)[-1])
            self._pids = WorkerCgroups.find(self.run_id.rsplit("-", 1)[-1], "pids")

    async def start_worker(self, name: str = "worker") -> Worker:
        """Start a worker and wait until it is ready to run code."""
        if self._closed:
            raise ConfigError("this engine was shut down; create a new Engine")
        self.open()
        worker = Worker(self, name)
        self.workers.append(worker)
        await worker.start()
        return worker

    async def shutdown(self) -> None:
        """Close every worker (killing what does not stop) and remove the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._pool_filling is not None:
            self._pool_filling.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pool_filling
        if self._pool_shrink is not None:
            self._pool_shrink.cancel()
        pooled, self._pool = self._pool, []
        await asyncio.gather(*(w.close() for w in self.workers), *(s.kill() for s in pooled),
                             return_exceptions=True)
        if self._zygote is not None:
            await self._zygote.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._sock_root is not None:
            remove_tree(self._sock_root)
        for cgroups in (self._cgroups, self._pids):
            if cgroups is not None:
                cgroups.close()
        with contextlib.suppress(OSError):
            self.output_dir.rmdir()  # only if no block needed a file
            self.run_dir.rmdir()

    # -- the warm pool ---------------------------------------------------------------------------
    def _pool_take(self) -> Session | None:
        """A started, handshaken idle worker process, if one is ready; refills in the background."""
        session = None
        while self._pool and session is None:
            candidate = self._pool.pop(0)
            if candidate.proc is not None and candidate.proc.returncode is None and not candidate.killing:
                session = candidate
        self.fill_pool()
        return session

    def fill_pool(self) -> None:
        """Start idle workers in the background until ``pool_size`` are ready (no-op when full)."""
        if self._closed or self.pool_size == 0 or self._ctx is None:
            return
        loop = asyncio.get_running_loop()
        if self._pool_shrink is not None:
            self._pool_shrink.cancel()
        self._pool_shrink = loop.call_later(self.pool_idle, lambda: loop.create_task(self._shrink()))
        if self._pool_filling is None or self._pool_filling.done():
            self._pool_filling = loop.create_task(self._fill())

    async def _fill(self) -> None:
        while not self._closed and len(self._pool) < self.pool_size:
            try:
                session = await Session.start(self)
            except AgentloopError as exc:
                log.warning("could not start an idle worker for the pool: %s", exc)
                return
            if self._closed:
                await session.kill()
                return
            self._pool.append(session)

    async def _shrink(self) -> None:
        """Unused for ``pool_idle`` seconds: give the idle workers' memory back."""
        idle, self._pool = self._pool, []
        await asyncio.gather(*(s.kill() for s in idle), return_exceptions=True)

    def _pool_lost(self, session: Session) -> None:
        if session in self._pool:
            self._pool.remove(session)

    # -- used by sessions ------------------------------------------------------------------------
    async def _fork_server(self, launch: Launch) -> Zygote | None:
        """The fork server to start ``launch`` with, or None to start it cold.

        ``zygote=None`` (the default) uses one where it can give the same isolation: a root
        coordinator with bubblewrap."""
        if self.zygote is False or not launch.pid_namespace or not Zygote.usable(launch.argv):
            if self.zygote:
                raise ConfigError("the fork server needs bubblewrap and a coordinator running as root")
            return None
        if self._zygote is None:
            self._zygote = Zygote(self, self.preload)
        return self._zygote

    def _endpoint(self, number: int) -> tuple[str, Path]:
        assert self._sock_root is not None
        sock_dir = self._sock_root / f"w{number}"
        sock_dir.mkdir(mode=0o700)
        if self.transport == "tcp":
            return f"tcp://{self.tcp_bind}:*", sock_dir
        return f"ipc://{sock_dir}/sock", sock_dir

    def _output_path(self, index: int, block_id: str) -> Path:
        """A file name of its own for one block's output: a sequence number makes it unique
        (a block id may be reused, and ids differing only in characters a file name cannot
        hold would otherwise meet); the id follows, readable where it is plain."""
        self._outputs += 1
        return self.output_dir / f"w{index}-{self._outputs}-{_file_part(block_id)}.txt"

    def _plan(self, sock_dir: Path) -> _sandbox.LaunchPlan:
        return _sandbox.plan(self.sandbox, socket_dir=sock_dir, workspace=self.workspace,
                             cwd=self.cwd, output_dir=self.output_dir, python=self.python,
                             memory_cgroup=self._cgroups is not None, pids_cgroup=self._pids is not None)

    def _worker_groups(self, number: int) -> list[Path]:
        """The cgroups of worker ``number``: one limiting its memory and one its processes,
        where the engine has them.  Raises WorkerStartError when one cannot be made: the
        sandbox was planned on it."""
        groups: list[Path] = []
        for cgroups, limit in ((self._cgroups, self.sandbox.memory_bytes), (self._pids, self.sandbox.max_processes)):
            if cgroups is None:
                continue
            group = cgroups.make(f"w{number}", limit)
            if group is None:
                self._release_groups(groups)
                raise WorkerStartError(f"could not make the worker's {cgroups.controller} cgroup (agentloop "
                                       "-v logs why); its limit would not hold")
            groups.append(group)
        return groups

    def _adopt(self, groups: list[Path], root: int, moved: dict[Path, set[int]]) -> None:
        """Move the tree of process ``root`` into each of ``groups`` (see ``adopt_tree``)."""
        for group in groups:
            if not WorkerCgroups.adopt_tree(group, root, moved.setdefault(group, set())):
                raise WorkerStartError("could not put the worker in its cgroups (agentloop -v logs "
                                       "why); its limits would not hold")

    def _release_groups(self, groups: list[Path]) -> None:
        for group in groups:
            WorkerCgroups.remove(group)

    def _memory_exceeded(self, groups: list[Path]) -> bool:
        cgroups = self._cgroups
        return cgroups is not None and any(g.parent == cgroups.base and cgroups.oom_killed(g) for g in groups)

    def _env(self, token: str, plan: _sandbox.LaunchPlan) -> dict[str, str]:
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
        return env

    def _launch(self, endpoint: str, sock_dir: Path, token: str) -> Launch:
        """How to start one worker process whose socket lives in ``sock_dir``."""
        plan = self._plan(sock_dir)
        if endpoint.startswith("ipc://"):
            plan.grant(Path(endpoint[len("ipc://"):]))
        argv = [*plan.argv_prefix, *_sandbox.runtime_argv(self.python, "worker.__main__:main", endpoint)]
        return Launch(argv, self._env(token, plan), Path(plan.cwd) if plan.cwd else self.cwd,
                      plan.pid_namespace, plan.notes)
