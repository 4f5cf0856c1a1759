"""The local scheduler: runs at once up to --parallel, stopping on Ctrl-C or when the
infrastructure keeps failing."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.batch.capacity import default_parallel
from engine.batch.progress import LinesView, Meter, Tally, make_view, short
from engine.batch.results_file import Lock, ResultsFile, lock_runs_dir, open_results
from engine.batch.stopping import Stopper, infra_threshold
from engine.batch.tasks import TaskSpec, read_tasks, refuse_invalid
from engine.errors import EXIT_INTERRUPTED, AgentloopError, ConfigError, ForeignServer, ModelUnreachable

if TYPE_CHECKING:
    from engine.batch.run import RunSettings
    from engine.models import ModelConfig

__all__ = ["BatchOutcome", "EXIT_STOPPED", "drive", "run_batch"]

EXIT_STOPPED = 1


@dataclass
class BatchOutcome:
    """How an invocation ended: its tally and why it stopped early (None: it did not)."""

    tally: Tally
    stopped: str | None

    @property
    def exit_code(self) -> int:
        if self.stopped == "interrupted":
            return EXIT_INTERRUPTED
        return EXIT_STOPPED if self.stopped else 0


async def _run_local(pending: list[TaskSpec], settings: RunSettings, results: ResultsFile, tally: Tally,
                     view: LinesView, parallel: int, stopper: Stopper) -> None:
    from engine.batch.run import execute  # (the agent loop and its HTTP client: loaded for task batches only)
    from engine.models import ClientPool

    loop = asyncio.get_running_loop()
    running: dict[asyncio.Task, TaskSpec] = {}

    def cancel_all() -> None:
        for task in running:
            task.cancel()

    stopper.adopt(cancel_all)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopper.interrupt)
    # One fork server for every run (closed below, once they are over; a second Ctrl-C leaves
    # at once and takes it down with this process: bubblewrap's --die-with-parent).
    fork_server = settings.shared_fork_server()
    output_budget = settings.output_budget()  # what the runs' kept outputs may hold together
    clients = ClientPool()  # one HTTP client per endpoint, its connections kept from run to run

    async def one(spec: TaskSpec) -> None:
        meter = Meter()
        tally.start(spec.key, meter)
        record = await execute(spec, settings, display=meter, fork_server=fork_server, output_budget=output_budget,
                               clients=clients)
        try:
            results.append(record)
        except OSError as exc:
            raise AgentloopError(f"cannot write to {results.path}: {exc}; the batch stops (rerun to resume)") from exc
        tally.finish(spec.key, record)
        view.finished(record)
        if tally.consecutive_infra >= infra_threshold(parallel):
            stopper.abort(f"{tally.consecutive_infra} runs in a row failed for infrastructure reasons "
                          f"(last: {short(record['error'], 200)}); fix it and run the same command again")

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.5)
            view.tick()

    ticking = asyncio.ensure_future(ticker())
    queue = iter(pending)
    try:
        while True:
            while not stopper.stopping and len(running) < parallel:
                spec = next(queue, None)
                if spec is None:
                    break
                running[asyncio.ensure_future(one(spec))] = spec
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                running.pop(task)
                task.result()  # a failure to write the output ends the batch, loudly
    finally:
        ticking.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if running:  # the output failed: stop the rest before leaving
            cancel_all()
            await asyncio.gather(*running, return_exceptions=True)
        await clients.aclose()
        if fork_server is not None:
            await fork_server.close()


def drive(noun: str, specs: list, results: ResultsFile, done: set[str], lock: Lock, *, header: str,
          progress: str, tally: Callable[[int, int], Tally], run: Callable[[list, Tally, LinesView, Stopper], None]
          ) -> BatchOutcome:
    """What every batch (of ``noun``: "tasks", "samples") does around its runs: what is left
    after a resume (ids in ``done`` are skipped), one line saying so (``header`` ends it), the
    ``tally`` (made of the total and those done before) and its view, a stopper for Ctrl-C and
    for giving up, and ``run`` (the local or the
    Ray scheduler) for what is pending.  The results file and the ``lock`` are closed after."""
    try:
        pending = [s for s in specs if s.key not in done]
        before = len(specs) - len(pending)
        print(f"agentloop: {len(specs)} {noun}, {before} done before, {len(pending)} to run, {header}",
              file=sys.stderr, flush=True)
        counts = tally(len(specs), before)
        view = make_view(progress, counts)
        stopper = Stopper()
        view.start()
        try:
            if pending:
                run(pending, counts, view, stopper)
        finally:
            view.stop()
        return BatchOutcome(counts, stopper.reason)
    finally:
        results.close()
        lock.release()
async def check_endpoints(models: Iterable[ModelConfig]) -> None:
    """ModelUnreachable, saying what to do, when an endpoint the tasks use does not answer at
    all (its ``/models``, within ``model_server.PROBE_TIMEOUT``): else every run would fail the
    same way, seconds each, and be recorded as failed."""
    from engine.models import probe  # (its HTTP client: loaded for task batches only, not samples)

    configs = list({(m.base_url, m.model): m for m in models}.values())
    for config, server in zip(configs, await asyncio.gather(*(probe(c) for c in configs)), strict=True):
        if server.foreign:
            raise ForeignServer(f"nothing was run: {server.foreign}")
        if server.models_status is None:
            raise ModelUnreachable(f"nothing was run: {server.silence(config.base_url)} Then run the same "
                                   "command again.")


def run_batch(tasks_path: str | Path, output: str | Path, settings: RunSettings, *,
              parallel: int | None = None, progress: str = "auto", skip_invalid: bool = False,
              redo: Iterable[str] = (), ray_address: str | None = None) -> BatchOutcome:
    """Run every task of ``tasks_path`` not yet in ``output``; see the module docstring.

    Raises ConfigError, before anything starts, for invalid task lines (unless
    ``skip_invalid``: then they are reported and left out), a damaged output or a runs
    directory another batch holds; ModelUnreachable, before anything is made, for a model
    endpoint that does not answer (``check_endpoints``; not with Ray)."""
    output = Path(output)
    specs, problems = read_tasks(tasks_path, settings.models)
    refuse_invalid(tasks_path, problems, skip_invalid)
    given = next((spec for spec in specs if spec.allow_net), None)
    if given is not None and settings.worker.sandbox.network:
        raise ConfigError(f"{tasks_path}: line {given.line}: allow_net and --network together: --network gives "
                          "every run the host's whole network, allow_net only the hosts it names; choose one")
    if ray_address is None:  # (a Ray node may reach what this machine does not, and the reverse)
        asyncio.run(check_endpoints(settings.models.get(s.model or settings.model) for s in specs))
    lock = lock_runs_dir(settings.runs_dir)
    results, resumed = open_results(output, redo, lock=lock)
    if ray_address is None:
        parallel = parallel or default_parallel()
    where = f"on Ray at {ray_address}" if ray_address else f"{parallel} at once"

    def run(pending: list, tally: Tally, view: LinesView, stopper: Stopper) -> None:
        if ray_address is not None:
            from engine.batch import on_ray

            on_ray.run_on_ray(ray_address, pending, settings, results=results, tally=tally, view=view,
                              parallel=parallel, stopper=stopper)
        else:
            asyncio.run(_run_local(pending, settings, results, tally, view, parallel, stopper))

    return drive("tasks", specs, results, resumed.done, lock, progress=progress, tally=Tally, run=run,
                 header=f"{where}; results in {output}, runs in {settings.runs_dir}")
