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
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import zmq
import zmq.asyncio

import worker as _worker_pkg

from . import sandbox as _sandbox
from .errors import ConfigError
from .worker import Worker

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
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        self.run_dir = Path(state_dir or _state_home()) / "runs" / self.run_id
        self.output_dir = self.run_dir / "outputs"
        self.workers: list[Worker] = []
        self.notes: list[str] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._sock_root: Path | None = None
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
        try:
            self.workspace.mkdir(parents=True, exist_ok=True)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
            self._sock_root = _private_dir(_runtime_home()) / self.run_id
            self._sock_root.mkdir(mode=0o700)
        except OSError as exc:
            raise ConfigError(f"cannot create the run's directories: {exc}; "
                              "choose another --workspace or check permissions") from exc
        self._ctx = zmq.asyncio.Context()
        self.notes = self._plan(self._sock_root).notes

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
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._sock_root is not None:
            shutil.rmtree(self._sock_root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.output_dir.rmdir()  # only if no block needed a file
            self.run_dir.rmdir()

    # -- used by Worker ------------------------------------------------------------------------
    def _endpoint(self, index: int, generation: int) -> tuple[str, Path]:
        assert self._sock_root is not None
        sock_dir = self._sock_root / f"w{index}.{generation}"
        sock_dir.mkdir(mode=0o700)
        if self.transport == "tcp":
            return f"tcp://{self.tcp_bind}:*", sock_dir
        return f"ipc://{sock_dir}/sock", sock_dir

    def _release_endpoint(self, sock_dir: Path) -> None:
        shutil.rmtree(sock_dir, ignore_errors=True)

    def _output_path(self, index: int, block_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in block_id)[:64]
        return self.output_dir / f"w{index}-{safe}.txt"

    def _plan(self, sock_dir: Path) -> _sandbox.LaunchPlan:
        return _sandbox.plan(self.sandbox, socket_dir=sock_dir, workspace=self.workspace,
                             cwd=self.cwd, output_dir=self.output_dir, python=self.python)

    def _env(self, token: str, confine: dict, pid_namespace: bool) -> dict[str, str]:
        env = {k: os.environ[k] for k in (*ENV_ALLOWLIST, *self.env_allow) if k in os.environ}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env["HOME"] = str(self.workspace)
        env["TMPDIR"] = "/tmp"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPATH"] = str(Path(_worker_pkg.__file__).resolve().parent.parent)
        env["AGENTLOOP_TOKEN"] = token
        if not pid_namespace:  # inside a PID namespace our parent is the namespace's init
            env["AGENTLOOP_PARENT"] = str(os.getpid())
        if confine:
            env["AGENTLOOP_CONFINE"] = json.dumps(confine)
        return env

    def _launch(self, endpoint: str, sock_dir: Path, token: str) -> tuple[list[str], dict, bool, list[str]]:
        plan = self._plan(sock_dir)
        argv = [*plan.argv_prefix, self.python, "-m", "worker", endpoint]
        return argv, self._env(token, plan.confine, plan.pid_namespace), plan.pid_namespace, plan.notes
