"""The "fork" section of ``scripts/bench``: forking a live worker (``Worker.fork``).

A worker of a real ``Engine`` (its sandbox, its fork server where there is one) holds ``size``
MB of Python objects (bytearrays of 1 MiB, every page written); it is forked into ``n`` copies:

- ``answered_ms``: from the call of ``fork(n)`` until every copy has answered its first block
  (median of the rounds);
- ``child_pss_mb``: one copy's proportional set size after it has written 1% of the data
  (every page of 1% of the arrays) — which counts its share of the pages it still shares with
  its parent and siblings (size / (n + 1) of the data), by definition — and
  ``child_private_mb``, the pages it holds alone; ``beyond_written_mb`` is that less the pages
  it wrote: what a copy costs beyond what it changes.

Anchors: the hosted sandboxes that fork do it by VM snapshot — E2B's published pause, about
4 s per GiB of memory; CodeSandbox's clone of a running VM, about 2 s. Targets: four copies of
a 200 MB worker all answering within 100 ms; a copy's PSS beyond what it writes under 5 MB.

``python scripts/bench_fork.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _section  # noqa: E402 - scripts/_section.py, beside this file

from engine.workers import Engine  # noqa: E402

ANCHORS = {"e2b_pause_s_per_gib": 4.0, "codesandbox_clone_s": 2.0}
TARGETS = {"four_of_200mb_ms": 100.0, "beyond_written_mb": 5.0}
_FILL = "data = [bytearray(b'x' * (1 << 20)) for _ in range({mb})]"
_WRITE = ("for chunk in data[:max(1, len(data) // 100)]:\n"
          "    chunk[::4096] = b'y' * len(range(0, len(chunk), 4096))\n"
          "import os; print(os.getpid())")


def _memory_mb(pid: int) -> dict[str, float]:
    """Process ``pid``'s PSS and private memory (clean and dirty), in MB."""
    found = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Private_Clean", "Private_Dirty"):
                    found[key] = int(rest.split()[0]) / 1024
    except OSError:
        return {}
    return found


async def _one(engine: Engine, mb: int, n: int, rounds: int) -> dict:
    worker = await engine.start_worker(f"holder-{mb}-{n}")
    filled = await worker.run(_FILL.format(mb=mb), timeout=120)
    if filled.status != "ok":
        await worker.close()
        return {"error": filled.message or filled.error}
    times = []
    memory: dict[str, float] = {}
    for r in range(rounds):
        t0 = time.perf_counter()
        copies = await worker.fork(n)
        answers = await asyncio.gather(*(c.run("pass", timeout=60) for c in copies))
        times.append((time.perf_counter() - t0) * 1000)
        if any(a.status != "ok" for a in answers):
            return {"error": next(a.message for a in answers if a.status != "ok")}
        if r == 0:
            wrote = await copies[0].run(_WRITE, timeout=60)
            session = copies[0].session
            if wrote.status == "ok" and session is not None and session.proc is not None:
                memory = _memory_mb(session.proc.pid)
        await asyncio.gather(*(c.close() for c in copies))
    await worker.close()
    private = memory.get("Private_Clean", 0) + memory.get("Private_Dirty", 0) if memory else None
    return {"answered_ms": round(statistics.median(times), 1), "rounds": rounds,
            "child_pss_mb": round(memory["Pss"], 1) if "Pss" in memory else None,
            "child_private_mb": None if private is None else round(private, 1),
            "beyond_written_mb": None if private is None else round(private - max(1, mb // 100), 1)}


async def _measure(quick: bool, base: Path | None) -> dict:
    sizes = (10, 200) if quick else (10, 100, 200, 1000)
    counts = (1, 4) if quick else (1, 4, 16)
    rounds = 1 if quick else 3
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-fork-", dir=base))
    results: dict[str, dict] = {}
    async with Engine(cwd=base, state_dir=base / "state") as engine:
        for mb in sizes:
            for n in counts:
                results[f"{mb}mb_x{n}"] = await _one(engine, mb, n, rounds)
    four = results.get("200mb_x4", {}).get("answered_ms")
    beyond = [r["beyond_written_mb"] for r in results.values() if r.get("beyond_written_mb") is not None]
    return {"forks": results, "anchors": ANCHORS, "targets": TARGETS,
            "met": {"four_of_200mb_ms": four is not None and four <= TARGETS["four_of_200mb_ms"],
                    "beyond_written_mb": bool(beyond) and max(beyond) <= TARGETS["beyond_written_mb"]}}


def measure(quick: bool = False, base: Path | None = None) -> dict:
    """The section's figures (``quick``: two sizes, one round); its files under ``base``."""
    return asyncio.run(_measure(quick, base))


def table(section: dict) -> str:
    lines = ["fork a live worker          answered_ms   child_pss_mb   child_private_mb   beyond_written_mb"]
    for key, r in section["forks"].items():
        lines.append(f"  {key:<26}{r.get('answered_ms', '-')!s:>11}   {r.get('child_pss_mb', '-')!s:>12}   "
                     f"{r.get('child_private_mb', '-')!s:>16}   {r.get('beyond_written_mb', r.get('error', '-'))!s:>17}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return _section.main("scripts/bench_fork.py", __doc__, "two sizes, one round (seconds)", measure, table, argv)


if __name__ == "__main__":
    sys.exit(main())
