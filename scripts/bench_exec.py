"""The "exec" section of ``scripts/bench``: ``agentloop exec FILE`` end to end, against ``python FILE``.

What a user of ``agentloop exec`` waits for, measured as a shell would: each command is a
process started by the bench and waited for, under the same interpreter, in the same loop (the
two sides alternate, so both see the same machine).

- ``start_ms``: ``exec pass.py`` from the process's start to its exit (the CLI, the sandbox and
  its first process, the interpreter, the script), p50/p99, against ``python pass.py``;
  ``overhead_ms`` is the difference of the medians;
- ``jsonl_start_ms``: ``exec --jsonl`` on a file of one sample (``pass``) from the process's
  start to its exit, its results file removed before each (the CLI, the probes, the sandbox, the
  fork server, the first slot, the sample, the summary), p50/p99; the target is 300 ms;
- ``stream_mb_s``: a script printing ``stream_mb`` MB in 1 KiB lines, its stdout a pipe the
  bench reads to its end (median of three after one untimed run), against ``python``.

``python scripts/bench_exec.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _section  # noqa: E402 - scripts/_section.py, beside this file

LINE = 1024
STREAM = "import sys\nline = 'x' * {w} + '\\n'\nwrite = sys.stdout.write\nfor _ in range({n}):\n    write(line)\n"


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 2),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2), "n": len(ordered)}


def _timed(argv: list[str], cwd: Path, env: dict) -> float:
    """Milliseconds from the command's start to its exit.  Waited for without a timeout: with
    one, ``Popen.wait`` polls, by sleeps growing to 50 ms, which would be counted; a timer
    kills a command that hangs instead."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        code = proc.wait()
    finally:
        watchdog.cancel()
    elapsed = (time.perf_counter() - started) * 1000
    if code != 0:
        raise subprocess.CalledProcessError(code, argv)
    return elapsed


def _streamed(argv: list[str], cwd: Path, env: dict, size: int) -> float:
    """MB/s of the command's stdout, read to its end through a pipe."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    got = 0
    while chunk := proc.stdout.read1(1 << 20):
        got += len(chunk)
    proc.wait(300)
    seconds = time.perf_counter() - started
    assert got == size, (got, size)
    return size / seconds / 1e6


def measure(quick: bool = False, base: Path | None = None) -> dict:
    rounds, mb = (5, 10) if quick else (30, 100)
    top = Path(tempfile.mkdtemp(prefix="agentloop-bench-exec-", dir=base))
    try:
        return _measure(rounds, mb, top)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _measure(rounds: int, mb: int, top: Path) -> dict:
    # The scripts' directory (which exec writes) and agentloop's state (never inside it) apart.
    work = top / "project"
    work.mkdir()
    (work / "pass.py").write_text("pass\n")
    (work / "one.jsonl").write_text('{"id": "pass", "code": "pass"}\n')
    lines = mb * 1_000_000 // LINE
    (work / "stream.py").write_text(STREAM.format(w=LINE - 1, n=lines))
    env = {**os.environ, "XDG_STATE_HOME": str(top / "state"), "PYTHONPATH": str(ROOT)}
    python = [sys.executable]
    ours = [sys.executable, "-P", "-m", "engine.cli", "exec", "--timeout", "300s"]
    jsonl = ours + ["--jsonl", "one.jsonl", "-o", "one-results.jsonl", "--progress", "none"]
    _timed(ours + ["pass.py"], work, env)  # untimed: caches warm
    start: dict[str, list[float]] = {"agentloop": [], "python": []}
    jsonl_start: list[float] = []
    for _ in range(rounds):
        start["agentloop"].append(_timed(ours + ["pass.py"], work, env))
        start["python"].append(_timed(python + ["pass.py"], work, env))
        (work / "one-results.jsonl").unlink(missing_ok=True)  # (else it is done before)
        jsonl_start.append(_timed(jsonl, work, env))
    size = lines * LINE
    stream: dict[str, list[float]] = {"agentloop": [], "python": []}
    for i in range(4):
        for side, argv in (("agentloop", ours), ("python", python)):
            rate = _streamed(argv + ["stream.py"], work, env, size)
            if i:  # (the first of each: untimed)
                stream[side].append(rate)
    starts = {side: _stats(values) for side, values in start.items()}
    return {
        "start_ms": starts,
        "overhead_ms": round(starts["agentloop"]["p50"] - starts["python"]["p50"], 1),
        "jsonl_start_ms": _stats(jsonl_start),
        "jsonl_start_target_ms": 300,
        "jsonl_start_met": statistics.median(jsonl_start) < 300,
        "stream_mb_s": {side: round(statistics.median(v), 1) for side, v in stream.items()},
        "stream_mb": mb,
        "line_bytes": LINE,
    }


def table(section: dict) -> str:
    a, p = section["start_ms"]["agentloop"], section["start_ms"]["python"]
    s = section["stream_mb_s"]
    return (f"exec FILE: start to exit p50 {a['p50']} ms (p99 {a['p99']}) against python's {p['p50']} ms "
            f"({section['overhead_ms']} ms of sandbox); exec --jsonl of one sample: p50 "
            f"{section['jsonl_start_ms']['p50']} ms (target < 300); {section['stream_mb']} MB of print through a pipe: "
            f"{s['agentloop']} MB/s against python's {s['python']} MB/s")


def main(argv: list[str] | None = None) -> int:
    return _section.main("scripts/bench_exec.py", __doc__, "5 starts, 10 MB", measure, table, argv)


if __name__ == "__main__":
    sys.exit(main())
