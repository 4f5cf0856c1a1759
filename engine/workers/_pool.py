"""The engine: one run's workers, their warm pool and their shutdown.

``Engine`` is the asyncio entry point of the coordinator::

    async with Engine() as engine:
        worker = await engine.start_worker()
        result = await worker.run("print(6 * 7)", timeout=5)
        print(result.status, result.output)

The engine decides (which workers exist, the idle pool, when everything stops); its
``Launcher`` (``engine.launch``) does what touches the operating system: directories,
sockets, the sandbox, cgroups and the fork server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.durations import DEFAULT_BLOCK_TIMEOUT
from engine.environment import ENV_ALLOWLIST
from engine.errors import AgentloopError, ConfigError, WorkerError
from engine.launch import Launch, Launcher, SharedForkServer, WorkerSettings
from engine.results import OutputBudget
from engine.samples import OUTPUT_BYTES, Sample, SampleResult, map_samples
from engine.workers._samples import SampleRunner

if TYPE_CHECKING:  # (imported with the first worker: they bring ZeroMQ, which a run of samples never needs)
    from engine.workers._session import Session
    from engine.workers._worker import HostCall, Worker

__all__ = ["ENV_ALLOWLIST", "Engine", "Launch"]

log = logging.getLogger("agentloop")


class Engine:
    """Starts, supervises and shuts down the workers of one run.

    ``settings`` (``engine.launch.WorkerSettings``) say how every worker is started and
    contained; keyword ``options`` are its fields, for short (``Engine(python=..., preload=...)``
    is ``Engine(WorkerSettings(python=..., preload=...))``).  The run's directories are the
    engine's: ``cwd`` (default the current directory) and ``workspace`` (default ``./files``,
    made when missing and removed again at shutdown if nothing was written to it).  A block's
    output beyond what is kept in memory goes to a file under ``run_dir`` (in the settings'
    ``state_dir``), removed at shutdown unless ``keep_output``; each file holds at most the
    settings' ``output_file_cap`` bytes, all of the run's together at most ``max_output``, and,
    with ``output_budget`` (an ``engine.results.OutputBudget`` shared with other runs, as a
    batch's), what those runs keep together stays within it too.  ``pool``: idle workers kept
    started.  ``max_workers``: live workers at most (None: no bound); ``start_worker`` refuses
    beyond it in words a model can read.  ``shared_fork_server``: a fork server shared with
    other runs (a batch's) that forks this run's workers, each shown this run's directories
    only; where it cannot serve the run, they start cold."""

    def __init__(self, settings: WorkerSettings | None = None, *, cwd: str | Path | None = None,
                 workspace: str | Path | None = None, pool: int = 1, pool_idle: float = 60.0,
                 max_workers: int | None = None, shared_fork_server: SharedForkServer | None = None,
                 output_budget: OutputBudget | None = None, own_workspaces: bool = False, **options: Any) -> None:
        settings = settings or WorkerSettings()
        if options:
            settings = settings.replace(**options)
        cwd = Path(cwd or os.getcwd()).resolve()
        self.launcher = Launcher(settings, cwd=cwd, workspace=Path(workspace).resolve() if workspace else cwd / "files",
                                 own_workspaces=own_workspaces, shared=shared_fork_server,
                                 output_budget=output_budget)
        self.pool_size = max(0, pool)
        self.pool_idle = pool_idle
        self.max_workers = max_workers
        self._pool: list[Session] = []
        self._pool_filling: asyncio.Task | None = None
        self._pool_shrink: asyncio.TimerHandle | None = None
        self.workers: list[Worker] = []
        self._samples: SampleRunner | None = None
        self._closed = False

    # The run, as its launcher holds it.
    settings = property(lambda self: self.launcher.settings)
    cwd = property(lambda self: self.launcher.cwd)
    workspace = property(lambda self: self.launcher.workspace)
    run_id = property(lambda self: self.launcher.run_id)
    run_dir = property(lambda self: self.launcher.run_dir)
    output_dir = property(lambda self: self.launcher.output_dir)

    async def __aenter__(self) -> Engine:
        self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def open(self) -> None:
        """Create the run's directories (idempotent)."""
        self.launcher.open()

    async def start_worker(self, name: str = "worker", *, on_call: HostCall | None = None) -> Worker:
        """Start a worker and wait until it is ready to run code.  WorkerError, in words a
        model can act on, beyond ``max_workers`` live ones.  ``on_call``: its owner's host calls
        (code in the worker calling functions of the coordinator); without one, every call is
        refused in words until ``Worker.adopt`` gives it one."""
        self.admit(1)
        self.open()
        from engine.workers._worker import Worker

        worker = Worker(self.launcher, name, take_idle=self._pool_take, on_call=on_call, roster=self)
        self.workers.append(worker)
        await worker.start()
        return worker

    def admit(self, n: int) -> None:
        """Raise, in words a model can act on, unless ``n`` more workers may start now (a new
        one, or a fork's copies: ``Worker.fork`` asks here)."""
        if self._closed:
            raise ConfigError("this engine was shut down; create a new Engine")
        if self.max_workers is not None:
            from engine.workers._worker import WorkerState

            live = sum(1 for w in self.workers if w.state is not WorkerState.CLOSED)
            if live + n > self.max_workers:
                raise WorkerError(f"this run already holds {live} workers, and may hold {self.max_workers}; wait "
                                  "for a sub-agent to finish, or do the work yourself, before starting another")

    def add(self, worker: Worker) -> None:
        """Count ``worker`` (a fork's copy) among the engine's: it is closed with them."""
        self.workers.append(worker)

    async def shutdown(self) -> None:
        """Close every worker (killing what does not stop) and remove the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._samples is not None:
            await self._samples.close()
        if self._pool_filling is not None:
            self._pool_filling.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pool_filling
        if self._pool_shrink is not None:
            self._pool_shrink.cancel()
        pooled, self._pool = self._pool, []
        await asyncio.gather(*(w.close() for w in self.workers), *(s.kill() for s in pooled),
                             return_exceptions=True)
        await self.launcher.close()

    def map(self, samples: Iterable[Sample], *, concurrency: int | None = None,
            timeout: float = DEFAULT_BLOCK_TIMEOUT, output_bytes: int = OUTPUT_BYTES) -> AsyncIterator[SampleResult]:
        """Run code samples, ``concurrency`` at once (default: twice the usable CPUs), each as
        ``agentloop exec`` runs a file, in a sandbox of its own that is killed after; an async
        iterator of ``SampleResult`` in the order of ``samples``, as ``Executor.map`` (see
        ``as_completed`` for the order they end in).  ``timeout``: the deadline of a sample that
        names none.  Leaving the iteration early kills the samples still running.  See
        ``engine.samples`` (what a sample may carry) and ``engine.samples`` (what its
        status means)::

            async for result in engine.map([Sample("a", "print(1)"), Sample("b", "1/0")]):
                print(result.id, result.status, result.exit_code)
        """
        return map_samples(self._sample_runner(), samples, concurrency=concurrency, timeout=timeout,
                           output_bytes=output_bytes)

    def as_completed(self, samples: Iterable[Sample], *, concurrency: int | None = None,
                     timeout: float = DEFAULT_BLOCK_TIMEOUT,
                     output_bytes: int = OUTPUT_BYTES) -> AsyncIterator[SampleResult]:
        """``map``, yielding each result as soon as its sample ends (an RL trainer's rewards, a
        results file written as they come)."""
        return map_samples(self._sample_runner(), samples, concurrency=concurrency, timeout=timeout,
                           output_bytes=output_bytes, ordered=False)

    def _sample_runner(self) -> SampleRunner:
        if self._closed:
            raise ConfigError("this engine was shut down; create a new Engine")
        if self._samples is None:
            self.open()
            self._samples = SampleRunner(self.launcher)
        return self._samples

    # -- the warm pool ---------------------------------------------------------------------------
    @property
    def idle_pids(self) -> list[int]:
        """The pids of the started, unowned worker processes waiting in the warm pool."""
        return [s.proc.pid for s in self._pool if s.proc is not None]

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
        if self._closed or self.pool_size == 0 or not self.launcher.opened:
            return
        loop = asyncio.get_running_loop()
        if self._pool_shrink is not None:
            self._pool_shrink.cancel()
        self._pool_shrink = loop.call_later(self.pool_idle, lambda: loop.create_task(self._shrink()))
        if self._pool_filling is None or self._pool_filling.done():
            self._pool_filling = loop.create_task(self._fill())

    async def _fill(self) -> None:
        from engine.workers._session import Session

        while not self._closed and len(self._pool) < self.pool_size:
            try:
                session = await Session.start(self.launcher, on_lost=self._pool_lost)
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
