"""The "batch" section of ``scripts/bench``: what a batch run pays to start its worker, with the
batch's one fork server (``engine.launch``) and cold (a bubblewrap sandbox and a fresh
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
- ``parallel``: the same runs through ``agentloop batch``'s scheduler, ``parallel`` at once
  (the batch's fork server started with its first run, as a user's batch does), as runs per
  second in each mode, with the CPU a run costs (``cpu_ms_per_run``: every process the bench
  starts, through a cpuacct cgroup where the machine has one: the steadiest figure on a busy
  machine; ``coordinator_cpu_ms_per_run``: this process alone);
- ``model_server``: the scripted model runs in a process of its own, as a real server does, so
  that its work is neither on the coordinator's interpreter lock nor in its figures: its CPU
  per run, and the chat completions it answers per second on its own (``parallel`` clients
  at once, each request the shape of a run's: streamed), so that its ceiling is seen to be
  far above the runs' (a run makes two requests).

The targets: a batch run's worker start costs at most 20 ms with the shared server, and
``parallel`` at once (4 on 2 cores) reach 50 runs/s.  And the coordinator's CPU per run with
the shared server at most half of what it was before the runs of a batch shared one HTTP client
per endpoint (its connections kept from run to run), the check of the workers' Python and
their first sandbox plan: ``COORDINATOR_BEFORE_MS``, the median of four rounds of 64 runs 4 at
once (as here), alternating with the change on the same machine (root, load 3 to 3.5;
docs/performance.md); CPU time swells with the load, so compare figures taken under a like one.  Needs a fork server (root's, or an
unprivileged user's in a user namespace: ``engine.launch.fork_server_refusal``); elsewhere
both modes start cold and the section says so.

``python scripts/bench_batch.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _section  # noqa: E402 - scripts/_section.py, beside this file
from bench_samples import CpuMeter  # noqa: E402 - scripts/bench_samples.py, beside this file

from engine.batch import RunSettings, execute, run_batch  # noqa: E402
from engine.batch.tasks import TaskSpec  # noqa: E402
from engine.launch import (
    WorkerSettings,  # noqa: E402
    fork_server_refusal,  # noqa: E402
)
from engine.models import load_models  # noqa: E402
from engine.scripted import ScriptedServer  # noqa: E402
from engine.workers import Engine  # noqa: E402

TARGET_MS = 20.0
TARGET_RUNS_PER_S = 50.0
#: The coordinator's CPU per run (ms, the batch's fork server), before this change: the anchor.
COORDINATOR_BEFORE_MS = 61.8
BLOCK = "<run_code>\nprint(6 * 7)\n</run_code>"


def _answer(body: dict) -> str:
    """The second turn: the block's result, quoted back (so a run that did not run it shows)."""
    return "answer: " + body["messages"][-1]["content"][:200].replace("<", "[")


SCRIPT = {"*": [BLOCK, _answer]}


def _serve(conn) -> None:
    with ScriptedServer(SCRIPT) as server:
        conn.send(server.url)
        conn.recv()  # until told to stop, or the bench is gone


@contextlib.contextmanager
def _model_server() -> Iterator[tuple[str, int]]:
    """The scripted model in a process of its own (forked: its script holds a function); its
    URL and pid."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(theirs,), daemon=True)
    proc.start()
    try:
        if not ours.poll(60):
            raise RuntimeError("the scripted model server did not start within 60 s")
        yield ours.recv(), proc.pid
    finally:
        with contextlib.suppress(OSError):
            ours.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def _cpu_s(pid: int) -> float:
    """CPU seconds a live process has used (utime + stime)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_capacity(url: str, clients: int, each: int) -> float:
    """Chat completions per second the scripted server answers, ``clients`` at once, each
    request streamed as a run's are: the ceiling it puts on a batch."""
    where = urlsplit(url)
    body = json.dumps({"model": "scripted", "stream": True,
                       "messages": [{"role": "user", "content": "[capacity] run one block"}]})
    failed: list[str] = []

    def client() -> None:
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        try:
            for _ in range(each):
                conn.request("POST", f"{where.path}/chat/completions", body, {"Content-Type": "application/json"})
                reply = conn.getresponse()
                reply.read()
                if reply.status != 200:
                    failed.append(str(reply.status))
        finally:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if failed:
        raise RuntimeError(f"the scripted server answered {failed[0]}")
    return clients * each / (time.perf_counter() - t0)


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

    async def timed(self, name: str = "worker", **options):
        t0 = time.perf_counter()
        try:
            return await original(self, name, **options)
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


def _parallel(settings: RunSettings, base: Path, count: int, parallel: int, tag: str, meter: CpuMeter,
              server_pid: int) -> dict:
    """``count`` runs through the batch scheduler, ``parallel`` at once: runs per second, and
    the CPU a run costs (all of it; this process's; the model server's)."""
    tasks = base / f"{tag}-tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"{tag}-{i}", "task": f"[{tag}-p{i}] run one block"}) + "\n"
                             for i in range(count)))
    cpu0, own0, server0 = meter.seconds(), resource.getrusage(resource.RUSAGE_SELF), _cpu_s(server_pid)
    t0 = time.perf_counter()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
        outcome = run_batch(tasks, base / f"{tag}-out.jsonl", settings, parallel=parallel, progress="none")
    seconds = time.perf_counter() - t0
    cpu1, own1, server1 = meter.seconds(), resource.getrusage(resource.RUSAGE_SELF), _cpu_s(server_pid)
    if outcome.tally.counts["answered"] != count:
        raise RuntimeError(f"{tag}: {dict(outcome.tally.counts)} of {count} runs")
    own = own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime
    return {"runs_per_s": count / seconds,
            "cpu_ms_per_run": (cpu1 - cpu0) * 1000 / count if cpu0 is not None and cpu1 is not None else None,
            "coordinator_cpu_ms_per_run": own * 1000 / count,
            "model_server_cpu_ms_per_run": (server1 - server0) * 1000 / count}


def measure(quick: bool = False, base: Path | None = None) -> dict:
    """The section's figures (see the module docstring); ``quick``: 5 runs of each, 8 in
    parallel, one round."""
    count, parallel_count, rounds = (5, 8, 1) if quick else (30, 64, 2)
    parallel = min(8, 2 * (os.cpu_count() or 1))
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-batch-")) if base is None else base
    no_fork_server = fork_server_refusal(WorkerSettings())
    forked = no_fork_server is None
    meter = CpuMeter()
    try:
        with _model_server() as (url, server_pid):
            models = load_models(None, env={"LLM_URL": url, "LLM_MODEL": "scripted"})
            settings = {mode: RunSettings(models=models, runs_dir=base / f"batch-{mode}.runs",
                                          worker=WorkerSettings(fork_server=None if mode == "shared" else False),
                                          timeout=60.0)
                        for mode in ("shared", "cold")}
            seq = asyncio.run(_sequential(settings, count))
            got: dict[str, list[dict]] = {mode: [] for mode in settings}
            for r in range(rounds):  # in turn, so that both modes see the same machine
                for mode, s in settings.items():
                    got[mode].append(_parallel(s, base, parallel_count, parallel, f"{mode}-{r}", meter, server_pid))
            capacity = _server_capacity(url, parallel, 25 if quick else 100)
    finally:
        meter.close()
    start = {mode: _stats(v) for mode, v in seq["starts"].items()}
    run = {mode: _stats(v) for mode, v in seq["runs"].items()}
    shared_p50 = start["shared"]["p50"] if start["shared"] else None

    def median(mode: str, key: str) -> float | None:
        values = [g[key] for g in got[mode] if g[key] is not None]
        return round(statistics.median(values), 1) if values else None

    rates = {mode: median(mode, "runs_per_s") for mode in got}
    coordinator = median("shared", "coordinator_cpu_ms_per_run")
    return {
        "runs": count, "fork_server": forked,
        "worker_start_ms": start,
        "run_ms": run,
        "saved_ms_per_run": round(statistics.median(seq["runs"]["cold"]) - statistics.median(seq["runs"]["shared"]), 1),
        "fork_server_start_ms": round(seq["first_shared_start"], 1) if seq["first_shared_start"] else None,
        "parallel": {"runs": parallel_count, "at_once": parallel, "rounds": rounds, "runs_per_s": rates,
                     "cpu_ms_per_run": {mode: median(mode, "cpu_ms_per_run") for mode in got},
                     "coordinator_cpu_ms_per_run": {mode: median(mode, "coordinator_cpu_ms_per_run") for mode in got}},
        "model_server": {"cpu_ms_per_run": median("shared", "model_server_cpu_ms_per_run"),
                         "completions_per_s": round(capacity, 1), "clients": parallel},
        "load": _load(),
        "target": f"a batch run's worker start <= {TARGET_MS:g} ms (p50) with the shared fork server",
        "met": (shared_p50 <= TARGET_MS) if forked and shared_p50 is not None else None,
        "throughput_target": f"{parallel} at once >= {TARGET_RUNS_PER_S:g} runs/s with the shared fork server",
        "throughput_met": (rates["shared"] >= TARGET_RUNS_PER_S) if forked and rates["shared"] else None,
        "coordinator_target": (f"coordinator CPU per run with the shared fork server <= {COORDINATOR_BEFORE_MS / 2:g} ms: "
                               f"half of {COORDINATOR_BEFORE_MS:g} ms, before this change"),
        "coordinator_met": (coordinator <= COORDINATOR_BEFORE_MS / 2) if forked and coordinator else None,
        **({} if forked else {"note": f"{no_fork_server}: both modes start cold"}),
    }


def _load() -> float | None:
    """The machine's one-minute load average (other work skews every figure: say how much)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return float(Path("/proc/loadavg").read_text().split()[0])
    return None


def table(section: dict) -> str:
    s, c = section["worker_start_ms"]["shared"], section["worker_start_ms"]["cold"]
    rs, rc = section["run_ms"]["shared"], section["run_ms"]["cold"]
    par = section["parallel"]
    rate, cpu = par["runs_per_s"], par["cpu_ms_per_run"]
    server = section["model_server"]
    words = {True: "met", False: "NOT met", None: "not measured"}
    met, rate_met = words[section["met"]], words[section["throughput_met"]]
    own, own_met = par["coordinator_cpu_ms_per_run"], words[section.get("coordinator_met")]
    return (f"batch ({section['runs']} runs of each, one block each): worker start p50 {s['p50']} ms "
            f"(p99 {s['p99']}) with the shared fork server (target <= {TARGET_MS:g} ms: {met}), {c['p50']} ms "
            f"(p99 {c['p99']}) cold; run p50 {rs['p50']} vs {rc['p50']} ms: {section['saved_ms_per_run']} ms saved "
            f"a run; server start {section['fork_server_start_ms']} ms once; "
            f"{par['at_once']} at once: {rate['shared']} vs {rate['cold']} runs/s, {cpu['shared']} vs {cpu['cold']} "
            f"ms CPU a run (target >= {TARGET_RUNS_PER_S:g} runs/s: {rate_met}), the coordinator's {own['shared']} vs "
            f"{own['cold']} ms (target <= {COORDINATOR_BEFORE_MS / 2:g}, half of {COORDINATOR_BEFORE_MS:g} before: "
            f"{own_met}); the scripted model "
            f"{server['cpu_ms_per_run']} ms CPU a run, {server['completions_per_s']} completions/s on its own; "
            f"load {section['load']}"
            + (f"; {section['note']}" if section.get("note") else ""))


def main(argv: list[str] | None = None) -> int:
    return _section.main('scripts/bench_batch.py', __doc__, '5 runs of each mode, 8 in parallel', measure, table, argv)


if __name__ == "__main__":
    sys.exit(main())
