"""The "batch" section of ``scripts/bench``: what a batch run pays to start its worker, with the
batch's one fork server (``engine.shared_fork_server``) and cold (a bubblewrap sandbox and a fresh
interpreter per worker: ``RunSettings(worker=WorkerSettings(fork_server=False))``, and every run where the server
cannot be had).

Each run is the smallest real one: ``engine.batch.run.execute`` against a scripted model
(``engine.scripted.ScriptedServer``, over HTTP) that answers with one ``<run_code>`` block and
then a final answer, so the run starts its worker, runs one block and ends.  Runs go one at a
time, a shared-server run and a cold run in turn (so both see the same machine), after one
untimed run of each (the first shared run starts the server: reported on its own).

Figures, milliseconds, p50/p99 over the runs:

- ``worker_start_ms``: the run's ``start_worker``, from asking for the worker to its hello,
  the run's directories, sandbox plan and cgroups included;
- ``run_ms``: the whole run (directories, worker, two model requests, one block, shutdown);
- ``saved_ms_per_run``: cold minus shared, p50 of ``run_ms``;
- ``fork_server_start_ms``: the first shared run's worker start (the server starting with it);
- ``parallel``: the same runs through ``agentloop batch``'s scheduler, ``parallel`` at once,
  as runs per second in each mode.

The target: a batch run's worker start costs at most 20 ms with the shared server.  Needs root
and bubblewrap (the fork server's); elsewhere both modes start cold and the section says so.

``python scripts/bench_batch.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _section  # noqa: E402 - scripts/_section.py, beside this file

from engine.batch import RunSettings, execute, run_batch  # noqa: E402
from engine.batch.tasks import TaskSpec  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.models import load_models  # noqa: E402
from engine.sandbox import host_support  # noqa: E402
from engine.scripted import ScriptedServer  # noqa: E402
from engine.settings import WorkerSettings  # noqa: E402

TARGET_MS = 20.0
BLOCK = "<run_code>\nprint(6 * 7)\n</run_code>"


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)

    def pct(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p50": pct(0.5), "p99": pct(0.99), "min": round(ordered[0], 1), "n": len(ordered)}


@contextlib.contextmanager
def _timed_starts(into: list[float]):
    """Record how long each batch run's ``start_worker`` takes (milliseconds)."""
    original = Engine.start_worker

    async def timed(self, name: str = "worker"):
        t0 = time.perf_counter()
        try:
            return await original(self, name)
        finally:
            into.append((time.perf_counter() - t0) * 1000)

    Engine.start_worker = timed
    try:
        yield
    finally:
        Engine.start_worker = original


async def _sequential(settings: dict[str, RunSettings], count: int) -> dict:
    """``count`` timed runs of each mode, in turn, after one untimed run of each."""
    starts: dict[str, list[float]] = {mode: [] for mode in settings}
    runs: dict[str, list[float]] = {mode: [] for mode in settings}
    servers = {mode: s.shared_fork_server() for mode, s in settings.items()}
    first_start = None
    try:
        for i in range(count + 1):
            for mode, s in settings.items():
                spec = TaskSpec(id=f"{mode}-{i}", task=f"[{mode}-{i}] run one block", line=i + 1)
                got: list[float] = []
                t0 = time.perf_counter()
                with _timed_starts(got):
                    record = await execute(spec, s, fork_server=servers[mode])
                took = (time.perf_counter() - t0) * 1000
                if record["status"] != "answered" or "42" not in (record["answer"] or ""):
                    raise RuntimeError(f"a {mode} run did not run its block: {record['status']} {record['error']}")
                if i == 0:
                    first_start = got[0] if mode == "shared" and got else first_start
                    continue
                starts[mode] += got[:1]
                runs[mode].append(took)
    finally:
        for server in servers.values():
            if server is not None:
                await server.close()
    return {"starts": starts, "runs": runs, "first_shared_start": first_start}


def _parallel(settings: RunSettings, base: Path, count: int, parallel: int, tag: str) -> float:
    """Runs per second of ``count`` runs through the batch scheduler, ``parallel`` at once."""
    tasks = base / f"{tag}-tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"{tag}-{i}", "task": f"[{tag}-p{i}] run one block"}) + "\n"
                             for i in range(count)))
    t0 = time.perf_counter()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
        outcome = run_batch(tasks, base / f"{tag}-out.jsonl", settings, parallel=parallel, progress="none")
    seconds = time.perf_counter() - t0
    if outcome.tally.counts["answered"] != count:
        raise RuntimeError(f"{tag}: {dict(outcome.tally.counts)} of {count} runs")
    return count / seconds


def measure(quick: bool = False, base: Path | None = None) -> dict:
    """The section's figures (see the module docstring); ``quick``: 5 runs of each, 8 in parallel."""
    count, parallel_count = (5, 8) if quick else (30, 64)
    parallel = min(8, 2 * (os.cpu_count() or 1))
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-batch-")) if base is None else base
    forked = os.geteuid() == 0 and host_support().bwrap is not None
    script = {"*": [BLOCK, lambda body: "answer: " + body["messages"][-1]["content"][:200].replace("<", "[")]}
    with ScriptedServer(script) as server:
        models = load_models(None, env={"LLM_URL": server.url, "LLM_MODEL": "scripted"})
        settings = {mode: RunSettings(models=models, runs_dir=base / f"batch-{mode}.runs",
                                      worker=WorkerSettings(fork_server=None if mode == "shared" else False),
                                      timeout=60.0)
                    for mode in ("shared", "cold")}
        seq = asyncio.run(_sequential(settings, count))
        rates = {mode: round(_parallel(s, base, parallel_count, parallel, mode), 1) for mode, s in settings.items()}
    start = {mode: _stats(v) for mode, v in seq["starts"].items()}
    run = {mode: _stats(v) for mode, v in seq["runs"].items()}
    shared_p50 = start["shared"]["p50"] if start["shared"] else None
    return {
        "runs": count, "fork_server": forked,
        "worker_start_ms": start,
        "run_ms": run,
        "saved_ms_per_run": round(statistics.median(seq["runs"]["cold"]) - statistics.median(seq["runs"]["shared"]), 1),
        "fork_server_start_ms": round(seq["first_shared_start"], 1) if seq["first_shared_start"] else None,
        "parallel": {"runs": parallel_count, "at_once": parallel, "runs_per_s": rates},
        "target": f"a batch run's worker start <= {TARGET_MS:g} ms (p50) with the shared fork server",
        "met": (shared_p50 <= TARGET_MS) if forked and shared_p50 is not None else None,
        **({} if forked else {"note": "no fork server here (it needs root and bubblewrap): both modes start cold"}),
    }


def table(section: dict) -> str:
    s, c = section["worker_start_ms"]["shared"], section["worker_start_ms"]["cold"]
    rs, rc = section["run_ms"]["shared"], section["run_ms"]["cold"]
    rate = section["parallel"]["runs_per_s"]
    met = {True: "met", False: "NOT met", None: "not measured"}[section["met"]]
    return (f"batch ({section['runs']} runs of each, one block each): worker start p50 {s['p50']} ms "
            f"(p99 {s['p99']}) with the shared fork server, {c['p50']} ms (p99 {c['p99']}) cold; "
            f"run p50 {rs['p50']} vs {rc['p50']} ms: {section['saved_ms_per_run']} ms saved a run; "
            f"server start {section['fork_server_start_ms']} ms once; {section['parallel']['at_once']} at once: "
            f"{rate['shared']} vs {rate['cold']} runs/s (target <= {TARGET_MS:g} ms: {met})"
            + (f"; {section['note']}" if section.get("note") else ""))


def main(argv: list[str] | None = None) -> int:
    return _section.main('scripts/bench_batch.py', __doc__, '5 runs of each mode, 8 in parallel', measure, table, argv)


if __name__ == "__main__":
    sys.exit(main())
