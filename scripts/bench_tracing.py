"""The "tracing" section of ``scripts/bench``: what OpenTelemetry traces cost when they are on.

Off, tracing costs nothing to measure here: no observer is attached and OpenTelemetry is not
imported (compare ``exec_rtt_ms`` and the ``batch`` section with the figures of an earlier
commit).  On, each run has one ``engine.observe._spans.SpanObserver`` and the SDK's batching processor
sends the spans over OTLP/HTTP protobuf, here to a sink on loopback that answers 200.

Figures:

- ``observer_us_per_block``: the observer's own time for one code block's events (launched,
  two output chunks, a heartbeat, finished: one span with an event), p50/p99 over batches of 50
  blocks, each batch's spans sent before the next;
- ``run_ms_per_block``: a real agent run of ``BLOCKS`` blocks against a scripted model (one
  block a reply), off and on in turn, and the difference per block (p50 of the runs).

``python scripts/bench_tracing.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _section  # noqa: E402 - scripts/_section.py, beside this file

from engine.agent import run_task  # noqa: E402
from engine.models import load_models  # noqa: E402
from engine.scripted import ScriptedServer  # noqa: E402
from engine.workers import Engine  # noqa: E402

BLOCKS = 20


class _Sink(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _stats(values: list[float], digits: int = 1) -> dict:
    ordered = sorted(values)
    return {"p50": round(ordered[len(ordered) // 2], digits),
            "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], digits), "n": len(ordered)}


def _tracing(endpoint: str):
    import os

    from engine.observe import _tracing as tracing

    tracing.shutdown()
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_EXPORTER": "otlp"})
    return tracing.start()


def observer_cost(current, batches: int, per_batch: int = 50) -> dict:
    """Microseconds of observer time per block; the spans of each batch are sent before the next
    (untimed), as an agent's blocks come tens a second, not thousands."""
    spans = current.observer()
    spans.event("run_started", name="main", task="bench", model="default")
    samples = []
    for b in range(batches):
        current.flush()
        t0 = time.perf_counter()
        for i in range(per_batch):
            block = f"b{b}-{i}"
            spans.event("launched", name="main", id=block, timeout=30.0, heartbeat=None, code="print(1)")
            spans.event("output", name="main", id=block, stream="stdout", text="1\n")
            spans.event("output", name="main", id=block, stream="stderr", text="warning\n")
            spans.event("progress", name="main", id=block, current=1.0, output="1\n")
            spans.event("finished", name="main", id=block, duration=0.001, cancelled=False, output="1\n",
                        status="ok", output_bytes=10, killed=False, lost=[], message="")
        samples.append((time.perf_counter() - t0) / per_batch * 1e6)
    spans.event("run_finished", name="main", status="answered", error="", error_type="", tokens_in=1,
                tokens_out=1, cost=0.0, duration=1.0)
    return _stats(samples)


async def _runs(models, count: int, traced) -> dict:
    """``count`` runs of ``BLOCKS`` blocks each, off and on in turn (one untimed run of each first)."""
    took = {"off": [], "on": []}
    base = Path(tempfile.mkdtemp(prefix="agentloop-bench-tracing-"))
    async with Engine(cwd=base, state_dir=base / "state") as engine:
        for i in range(count + 1):
            for mode in ("off", "on"):
                display = traced.observer(models) if mode == "on" else None
                t0 = time.perf_counter()
                result = await run_task(f"[{mode}-{i}] run blocks", models=models, engine=engine, display=display,
                                        timeout=120)
                if display is not None:
                    display.close()
                if result.status != "answered":
                    raise RuntimeError(f"a {mode} run ended {result.status}: {result.error}")
                if i:
                    took[mode].append((time.perf_counter() - t0) * 1000 / BLOCKS)
    return took


def measure(quick: bool = False, base: Path | None = None) -> dict:
    """The section's figures (see the module docstring)."""
    try:
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        return {"note": "the OpenTelemetry SDK is not installed (scripts/bench installs it with the bench extra)"}
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    from engine.observe import _tracing as tracing

    try:
        current = _tracing(f"http://127.0.0.1:{sink.server_address[1]}")
        observer = observer_cost(current, 20 if quick else 200)
        turn = lambda body: "<run_code>\nx = 6 * 7\nprint(x)\n</run_code>"  # noqa: E731
        script = {"*": [turn] * (BLOCKS - 1) + [turn, "done"]}
        with ScriptedServer(script) as server:
            models = load_models(None, env={"LLM_URL": server.url, "LLM_MODEL": "scripted"})
            took = asyncio.run(_runs(models, 2 if quick else 8, current))
    finally:
        tracing.shutdown()
        sink.shutdown()
    off, on = statistics.median(took["off"]), statistics.median(took["on"])
    return {"observer_us_per_block": observer,
            "run_ms_per_block": {"off": round(off, 2), "on": round(on, 2), "cost": round(on - off, 2),
                                 "blocks_per_run": BLOCKS, "runs": len(took["on"])}}


def table(section: dict) -> str:
    if "note" in section:
        return f"tracing: {section['note']}"
    o, r = section["observer_us_per_block"], section["run_ms_per_block"]
    return (f"tracing on: the observer takes {o['p50']} us a block (p99 {o['p99']}); an agent run takes "
            f"{r['on']} ms a block traced against {r['off']} ms untraced ({r['cost']:+} ms)")


def main(argv: list[str] | None = None) -> int:
    return _section.main("scripts/bench_tracing.py", __doc__, "20 batches of blocks, 2 runs of each mode", measure,
                         table, argv)


if __name__ == "__main__":
    sys.exit(main())
