"""``agentloop exec --jsonl SAMPLES.jsonl -o RESULTS.jsonl``: a file of code samples, each run
in a sandbox of its own (``engine.samples``), every result kept.

Input: one JSON object a line, ``{"id": ..., "code": ...}`` plus, optionally, ``stdin`` (text),
``args`` (``sys.argv[1:]``), ``timeout`` (seconds or ``5s``), ``files`` (paths relative to the
samples file, copied into the sample's workspace, at most ``FILES_CAP`` bytes in all) and
``env`` (variables to set, named in ``ENV_ALLOWLIST`` only) and ``allow_net`` (the hosts it may
reach, ``--allow-net`` entries, in place of the command's own, which must be given for any
sample to have a way out).  Every line is checked before
anything starts; problems are reported with their line numbers.

Output: one JSON object a line per finished sample (``SampleResult.record``: ``id``,
``status``, ``exit_code``, ``stdout``, ``stderr`` and what was cut of them, ``duration_s``,
``max_rss_mb``; with an allowlist, ``network``: its connections), appended and fsynced as the sample ends.  Rerunning the same command skips the
ids already there; a torn last line is cut and its sample run again; ``cancelled`` samples
always run again, ``--redo STATUS`` adds others.  Ctrl-C (or SIGTERM) stops starting samples,
kills the running ones (recorded as ``cancelled``) and exits 130; a second Ctrl-C leaves at
once.  The progress bar, the lines and the summary are ``agentloop batch``'s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.batch.capacity import default_parallel
from engine.batch.local import BatchOutcome, drive
from engine.batch.progress import LinesView, Tally
from engine.batch.results_file import Lock, ResultsFile, open_results
from engine.batch.stopping import Stopper
from engine.batch.tasks import pack_files, read_lines, refuse_invalid, task_files
from engine.durations import parse_duration
from engine.environment import ENV_ALLOWLIST
from engine.errors import ConfigError
from engine.launch import WorkerSettings
from engine.net import Allowlist
from engine.observe import current_tracing
from engine.samples import FILES_CAP, STATUSES, Sample, SampleResult, cancelled, check_env
from engine.workers import Engine

__all__ = ["REDO", "SampleSpec", "read_samples", "run_samples"]

#: What ``--redo`` may name (``cancelled`` samples always run again).
REDO = ("error", "timeout", "oom", "died")


@dataclass(frozen=True)
class SampleSpec:
    """One valid line: the sample, with its ``files`` as absolute paths, read only when it runs."""

    id: str | int
    code: str
    line: int
    stdin: str | None = None
    args: tuple[str, ...] = ()
    timeout: float | None = None
    files: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    allow_net: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return str(self.id)

    def sample(self) -> Sample:
        """The sample to run (its files read now)."""
        files = tuple((path, data, mode) for path, data, mode in pack_files(self.files))
        return Sample(self.id, self.code, stdin=self.stdin, args=self.args, timeout=self.timeout, files=files,
                      env=dict(self.env), allow_net=self.allow_net)


def read_samples(path: str | Path) -> tuple[list[SampleSpec], list[str]]:
    """The valid samples of ``path`` in file order, and one ``"line N: ..."`` per invalid line
    (not a JSON object, no id or code, a repeated id, a bad field, a missing file).  Raises
    ConfigError only if the file cannot be read."""
    return read_lines(path, "samples file", _sample)


def _sample(data: Any, number: int, base: Path) -> SampleSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"not a JSON object but {type(data).__name__}")
    ident = data.get("id")
    if isinstance(ident, bool) or not (isinstance(ident, int) or (isinstance(ident, str) and ident.strip())):
        raise ConfigError("no id" if ident is None else f"id must be a non-empty string or an integer, not {ident!r}")
    where = f"id {ident!r}"
    code = data.get("code")
    if not isinstance(code, str):
        raise ConfigError(f"{where}: code must be a string")
    stdin = data.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise ConfigError(f"{where}: stdin must be a string")
    args = data.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}: args must be a list of strings")
    try:
        timeout = parse_duration(data.get("timeout"))
        env = check_env(data.get("env") or {}, ENV_ALLOWLIST) if isinstance(data.get("env") or {}, dict) else None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {'env' if 'env' in str(exc) else 'timeout'}: {exc}") from None
    if env is None:
        raise ConfigError(f"{where}: env must be an object of names and strings")
    allow_net = data.get("allow_net", [])
    if not isinstance(allow_net, list):
        raise ConfigError(f"{where}: allow_net must be a list of \"HOST[:PORT]\" strings")
    Allowlist.parse(allow_net, f"{where}: allow_net")  # (refused in its words, before anything runs)
    return SampleSpec(ident, code, number, stdin, tuple(args), timeout, _files(data.get("files"), where, base),
                      tuple(sorted(env.items())), tuple(allow_net))


def _files(value: Any, where: str, base: Path) -> tuple[str, ...]:
    """As a task's ``files`` (``task_files``), at most ``FILES_CAP`` bytes in all: they travel
    in one message to the sample's worker."""
    paths = task_files(value, where, base)
    size = sum(sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file()) if os.path.isdir(p)
               else os.path.getsize(p) for p in paths)
    if size > FILES_CAP:
        raise ConfigError(f"{where}: files hold {size} bytes, more than {FILES_CAP} a sample may carry")
    return paths


async def _run_local(pending: list[SampleSpec], settings: WorkerSettings, results: ResultsFile, tally: Tally,
                     view, parallel: int, stopper: Stopper, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    started: dict[str, tuple[SampleSpec, float]] = {}
    me = asyncio.current_task()
    assert me is not None
    stopper.adopt(me.cancel)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopper.interrupt)

    def feed() -> Iterator[Sample]:
        for spec in pending:
            if stopper.stopping:
                return
            started[spec.key] = (spec, time.monotonic())
            tally.start(spec.key)
            yield spec.sample()

    def record(result: SampleResult) -> None:
        started.pop(str(result.id), None)
        line = result.record()
        results.append(line)
        tally.finish(str(result.id), line)
        view.finished(line)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.5)
            view.tick()

    ticking = asyncio.ensure_future(ticker())
    try:
        async with Engine(settings) as engine:
            results_of = engine.as_completed(feed(), concurrency=parallel, timeout=timeout)
            try:
                async for result in results_of:
                    record(result)
            except asyncio.CancelledError:
                if not stopper.interrupted:
                    raise
            finally:
                await results_of.aclose()  # kills what still runs
    finally:
        ticking.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for spec, at in list(started.values()):  # killed by the interrupt: run again next time
            record(cancelled(Sample(spec.id, ""), at))


class _TracedView:
    """A progress view that also sends a span for each sample that ends (tracing on): the view
    sees every finished record, local or from Ray, as it is written."""

    def __init__(self, view: Any, tracing: Any) -> None:
        self.view = view
        self.tracing = tracing

    def finished(self, record: dict) -> None:
        self.tracing.sample_span(record)
        self.view.finished(record)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.view, name)


def traced(view: Any) -> Any:
    """``view``, sending a span per finished sample when tracing is on."""
    current = current_tracing()
    return view if current is None else _TracedView(view, current)


def run_samples(samples_path: str | Path, output: str | Path, settings: WorkerSettings, *,
                parallel: int | None = None, timeout: float, progress: str = "auto", skip_invalid: bool = False,
                redo: Iterable[str] = (), ray_address: str | None = None) -> BatchOutcome:
    """Run every sample of ``samples_path`` not yet in ``output``; see the module docstring.

    ``settings``: how the workers that run them are started and contained.  Raises
    ConfigError, before anything starts, for invalid lines (unless ``skip_invalid``), a damaged
    output, or an output another process is writing."""
    output = Path(output)
    specs, problems = read_samples(samples_path)
    refuse_invalid(samples_path, problems, skip_invalid)
    given = next((spec for spec in specs if spec.allow_net), None)
    if given is not None and not settings.allow_net:
        raise ConfigError(f"{samples_path}: line {given.line}: allow_net needs the command's own allowlist "
                          "(--allow-net HOST[:PORT] or network.allow in agentloop.toml): without one no sample's "
                          "sandbox has a way out")
    output.parent.mkdir(parents=True, exist_ok=True)
    lock = Lock(output.with_name(f".{output.name}.lock"), f"another agentloop is writing {output}; wait for it or stop it")
    results, resumed = open_results(output, redo, "sample", lock=lock)
    parallel = parallel or default_parallel()
    where = f"on Ray at {ray_address}" if ray_address else f"{parallel} at once"

    def run(pending: list, tally: Tally, view: LinesView, stopper: Stopper) -> None:
        view = traced(view)
        if ray_address is not None:
            from engine.batch import sample_file_ray

            sample_file_ray.run_on_ray(ray_address, pending, settings, results=results, tally=tally, view=view,
                                       parallel=parallel, stopper=stopper, timeout=timeout)
        else:
            asyncio.run(_run_local(pending, settings, results, tally, view, parallel, stopper, timeout))

    def tally(total: int, before: int) -> Tally:
        return Tally(total, before, kind="samples", statuses=STATUSES)

    return drive("samples", specs, results, resumed.done, lock, progress=progress, tally=tally, run=run,
                 header=f"{where}; results in {output}")
