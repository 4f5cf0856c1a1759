"""The coordinator's side of the fork server (see ``worker/fork_server.py``).

One fork server per run (its launcher), or one for all the runs of a batch
(``engine.launch``), started on first use inside the run's sandbox with two extra
capabilities (CAP_SYS_ADMIN and CAP_NET_ADMIN, inside bubblewrap's namespaces) so that each
forked worker can get namespaces, a /proc, a /tmp and a loopback of its own; the worker drops
them with every other privilege before user code runs.  It is started by
``interpreter.runtime_argv`` (isolated mode, runtime by absolute path): it holds those
capabilities, so nothing a worker wrote may be on its import path.  A provisioner
(``engine.launch``), offered where ``provision.fork_server_refusal`` finds nothing against
it; elsewhere workers start cold (the warm pool still hides that cost).  Its channel is
``worker.contract.fork``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from engine.errors import WorkerStartError
from engine.launch._process import (
    STDERR_TAIL,
    Launch,
    Process,
    descendants,
    find_below,
    pipes,
    signal_quietly,
    spawn,
    watch_exit,
    zombie_status,
)
from engine.launch._settings import WorkerSettings
from engine.sandbox import LaunchPlan, runtime_argv
from engine.trust import started_at
from worker.contract import fork
from worker.contract.framing import decode, encode, frame, read_frame_async
from worker.contract.schema import ContractError
from worker.contract.start import FORK_SERVER, StartSpec
from worker.contract.start import NAMES as START_NAMES

__all__ = ["ForkServer", "ForkedProcess"]

log = logging.getLogger("agentloop")
_READY_TIMEOUT = 30.0


class ForkedProcess(Process):
    """A worker forked by the fork server: ``pid`` is its namespace's init (what a kill targets, the
    root of its tree); the worker below it is what is watched.  The init reaps nothing, so the
    worker's exit status is read from its zombie.

    ``stderr``: the read end of a fifo that is this worker's stderr alone (a server shared by
    several runs); without it the worker shares the server's."""

    def __init__(self, server: ForkServer, init_pid: int, worker_pid: int, stderr: int | None = None) -> None:
        #: The fork server that forked it.
        self.server = server
        self.proc = None
        self.worker_pid = worker_pid
        self._status: int | None = None
        self._init_watch(worker_pid, True, stderr)
        self._exited.add_done_callback(self._read_status)
        self._init_exited = watch_exit(init_pid)
        self.pid = init_pid
        self._own_tail = b""

    def _read_status(self, _: asyncio.Future) -> None:
        if self._status is None:
            self._status = zombie_status(self.worker_pid)

    def _gone(self) -> bool:
        # The worker may be gone while its init still holds the namespace.
        return self._init_exited.done()

    async def _kill(self, timeout: float) -> None:
        await super()._kill(timeout)
        # The init tears the namespace down (every process in it) before it is gone itself.
        try:
            await asyncio.wait_for(asyncio.shield(self._init_exited), timeout)
        except TimeoutError:
            log.error("worker namespace init %d did not exit %.0f s after SIGKILL", self.pid, timeout)

    @property
    def returncode(self) -> int | None:
        return self._status

    @property
    def stderr_tail(self) -> bytes:  # the worker's own, else the server's, which it shares
        return self._own_tail if self.server.private_stderr else self.server.stderr_tail

    @stderr_tail.setter
    def stderr_tail(self, value: bytes) -> None:
        self._own_tail = value


def _drain(fd: int) -> bytes:
    """What a non-blocking pipe holds now (its last ``STDERR_TAIL`` bytes)."""
    data = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 65536):
            data = (data + chunk)[-STDERR_TAIL:]
    return data


#: Pids ``ForkServer._host_pid`` keeps at most (inits whose exit went unreported are forgotten then).
_FOUND_MAX = 4096


class ForkServer:
    """Starts the fork server and asks it for workers.

    ``plan`` and ``env`` are the sandbox and environment the server runs in (the run's, with
    no worker's token); each forked worker gets its own environment from its ``Launch``."""

    kind = "fork server"

    def __init__(self, plan: LaunchPlan, env: dict[str, str], *, settings: WorkerSettings, cwd: Path,
                 packages: dict[str, str] | None = None, own_workspace: str | None = None,
                 private_stderr: bool = False, on_spare: Callable[[int], None] | None = None) -> None:
        self.plan = plan
        self.env = env
        self.settings = settings
        self.cwd = cwd
        self.packages = packages  # see ``runtime_argv``
        #: Where set, each worker gets an empty workspace of its own there, a tmpfs gone with it
        #: (code samples: ``engine.samples``).
        self.own_workspace = own_workspace
        #: Each worker's stderr is a fifo of its own (in its socket directory), not the server's:
        #: set for a server that several runs share (``engine.launch``).
        self.private_stderr = private_stderr
        # Told the host pid of each namespace init the server makes ahead of its request
        # (``_cgroup.SpareGroups.prepare``: its cgroups are made and entered meanwhile).
        self._on_spare = on_spare
        self._proc: Process | None = None  # the server's sandbox (bubblewrap)
        self._requests: asyncio.StreamWriter | None = None
        self._close_pipes: Callable[[], None] | None = None
        self._reader: asyncio.Task | None = None
        self._waiting: dict[int, asyncio.Future[fork.Message]] = {}
        self._host_pids: dict[int, int] = {}  # server-namespace pid -> host pid
        self._found: dict[int, tuple[int, int | None]] = {}  # what ``_host_pid`` found: (host pid, start time)
        self._forked: dict[int, Callable[[int], None]] = {}  # request id -> told C's host pid
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @property
    def stderr_tail(self) -> bytes:
        """The end of what the server (and the workers that share its stderr) said."""
        return self._proc.stderr_tail if self._proc is not None else b""

    @property
    def pid(self) -> int | None:
        """The host pid of the server's sandbox (bubblewrap), while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    async def start(self) -> None:
        plan = self.plan
        # CAP_KILL for the server of code samples: a root slot kills what its samples (another
        # uid) leave running.
        argv = plan.as_server("fork+kill" if self.own_workspace is not None else "fork").argv_prefix
        env = {k: v for k, v in self.env.items() if k not in START_NAMES}  # it confines nothing itself
        # With an allowlist each worker starts a forwarder: its module imported once, here.
        egress = ("worker.egress",) if self.settings.allow_net else ()
        env.update(StartSpec(preload=(*self.settings.preload, *egress)).to_env())
        if self._close_pipes is not None:  # (a server that died: its successor's pipes are new)
            self._close_pipes()
        launch = Launch(argv, runtime_argv(self.settings.python, FORK_SERVER, packages=self.packages),
                        "", env, Path(plan.cwd or self.cwd), True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._proc = spawn(launch)
        stdout, self._requests, self._close_pipes = await pipes(self._proc.proc)
        ready = asyncio.get_running_loop().create_future()
        self._waiting[0] = ready
        self._reader = asyncio.get_running_loop().create_task(self._read(stdout))
        try:
            await asyncio.wait_for(ready, _READY_TIMEOUT)
        except (TimeoutError, EOFError) as exc:
            await self.close()
            said = self.stderr_tail.decode("utf-8", "replace").strip()
            raise WorkerStartError(f"the fork server did not start: {said or exc}") from exc

    async def _read(self, stdout: asyncio.StreamReader) -> None:
        try:
            while (body := await read_frame_async(stdout.readexactly, fork.MAX_REPORT)) is not None:
                self._dispatch(fork.TO_COORDINATOR.parse(decode(body, fork.MAX_REPORT)))
            log.info("fork server gone")
        except ContractError as exc:
            log.info("fork server gone: %s", exc)
        finally:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(EOFError("the fork server exited"))
            self._waiting.clear()

    def _dispatch(self, msg: fork.Message) -> None:
        if isinstance(msg, fork.Ready):
            future = self._waiting.pop(0, None)
        elif isinstance(msg, (fork.Spawned, fork.Failed)):
            future = self._waiting.pop(msg.id, None)
        elif isinstance(msg, fork.Exited):  # a worker's init, reaped: the worker's status was read before
            self._host_pids.pop(msg.pid, None)
            self._found.pop(msg.pid, None)
            return
        elif isinstance(msg, fork.Spare):  # the next worker's init, made ahead: its cgroups may be made ahead too
            if self._on_spare is not None:
                with contextlib.suppress(WorkerStartError):
                    self._on_spare(self._host_pid(msg.pid))
            return
        else:  # forked: a worker's init exists (its setup goes on): whoever asked is told
            told = self._forked.pop(msg.id, None)
            if told is not None:
                with contextlib.suppress(WorkerStartError):
                    told(self._host_pid(msg.pid))
            return
        if future is not None and not future.done():
            future.set_result(msg)

    async def spawn(self, launch: Launch, on_root: Callable[[int], None] | None = None, *,
                    view: dict | None = None) -> ForkedProcess:
        """Fork a process for ``launch`` (its env, cwd and confinement); start the server first
        if needed.  A launch that does not serve blocks (a sample slot) has its ``command``
        executed in the forked process: a fresh interpreter.  ``view``: ``hide`` and ``show``
        for the forked process (see ``worker.fork_server._private_tmp``).  ``on_root``: called
        with the host pid of the process's namespace init as soon as it exists, before it forks
        the process (so its cgroups can be entered while it sets the namespace up)."""
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                await self.start()
        assert self._requests is not None
        rid = next(self._ids)
        stderr, stderr_path = self._stderr_fifo(launch) if self.private_stderr else (None, None)
        view = view or {}
        sandbox = self.settings.sandbox
        request = fork.Spawn(rid, launch.endpoint, launch.env, str(launch.cwd), not sandbox.network,
                             sandbox.tmp_bytes, self.own_workspace,
                             None if launch.serves_blocks else tuple(launch.command),
                             tuple(view.get("hide", ())), tuple((p, ro) for p, ro in view.get("show", ())),
                             stderr_path)
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future  # (after the fifo: a failure to make it leaves nothing waiting)
        if on_root is not None:
            self._forked[rid] = on_root
        try:
            reply = await self._ask(request, future)
            host = self._host_pid(reply.pid)
            self._host_pids[reply.pid] = host
            below = descendants(host)
            if not below:  # the worker died at once; its init is all there is to kill
                signal_quietly(host, 9)
                said = self.stderr_tail if stderr is None else _drain(stderr)
                raise WorkerStartError(f"the forked worker exited at once: {said.decode('utf-8', 'replace').strip()}")
        except BaseException:
            if stderr is not None:
                os.close(stderr)
            raise
        finally:
            self._forked.pop(rid, None)
        return ForkedProcess(self, host, below[0], stderr)

    async def _ask(self, request: fork.Spawn, future: asyncio.Future) -> fork.Spawned:
        """Send one spawn request; the server's ``spawned`` reply."""
        assert self._requests is not None
        self._requests.write(frame(encode(request)))
        try:
            reply = await asyncio.wait_for(asyncio.shield(future), self.settings.start_timeout)
        except (TimeoutError, EOFError, asyncio.CancelledError) as exc:
            # The request stands: a worker forked for it after all would belong to nobody.
            future.add_done_callback(self._unowned)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise WorkerStartError(f"the fork server did not fork: {exc}") from exc
        if isinstance(reply, fork.Failed):
            raise WorkerStartError(f"the fork server could not fork: {reply.error}")
        return reply

    @staticmethod
    def _stderr_fifo(launch: Launch) -> tuple[int, str]:
        """A fifo in the worker's socket directory (which only it is shown, read-only; the fifo
        is root's, 0600) to be its stderr: its read end, non-blocking, and its path.  Opened
        before the worker opens the other end, so the worker never waits for a reader."""
        endpoint = launch.endpoint
        if not endpoint.startswith("ipc://"):
            raise WorkerStartError("a shared fork server needs ipc:// endpoints")
        path = os.path.join(os.path.dirname(endpoint[len("ipc://"):]), "stderr")
        try:
            os.mkfifo(path, 0o600)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise WorkerStartError(f"could not make the worker's stderr fifo {path}: {exc}") from exc
        return fd, path

    def _unowned(self, future: asyncio.Future) -> None:
        """Kill what the server forked for a request nobody waits for any more (its namespace's
        init: the worker goes with it)."""
        if future.cancelled() or future.exception() is not None or not isinstance(future.result(), fork.Spawned):
            return
        with contextlib.suppress(WorkerStartError):
            signal_quietly(self._host_pid(future.result().pid), 9)

    def _host_pid(self, zpid: int) -> int:
        """The host pid of the server's child ``zpid`` (numbered in the sandbox's namespace).
        Each init is asked after two or three times (made ahead, forked, spawned) and a busy
        server's tree is large, so a pid found is kept with its process's start time: a kept
        one is used while that same process (pid and start time) lives, else looked for again."""
        assert self._proc is not None
        kept = self._found.get(zpid)
        if kept is not None and started_at(kept[0]) == kept[1] is not None:
            return kept[0]
        pid = find_below(self._proc.pid, zpid, level=1)  # (the sandbox's namespace is the second)
        if pid is not None:
            if len(self._found) >= _FOUND_MAX:
                self._found.clear()
            self._found[zpid] = (pid, started_at(pid))
            return pid
        raise WorkerStartError(f"forked worker {zpid} is not visible from the host")

    async def close(self) -> None:
        """Kill the server's sandbox: every worker it forked goes with it."""
        if self._proc is None:
            return
        await self._proc.kill(timeout=5)
        if self._reader is not None:
            self._reader.cancel()
        if self._close_pipes is not None:
            self._close_pipes()
            self._close_pipes = None
