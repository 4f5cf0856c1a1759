"""Code samples on a Ray cluster (``agentloop exec --jsonl ... --ray ADDRESS``).

Imported only then.  The samples go in chunks of ``CHUNK``, one Ray task a chunk, each task
taking one ``agent_slot`` (see ``engine.batch.on_ray``) and running its chunk through
``Engine.map`` on its node, ``--parallel`` samples at once, with one fork server for the
chunk.  The driver keeps at most the cluster's agent slots in flight and writes each chunk's
records as the chunk completes, through the same results file as a local run (resume works
the same way; a record's ``node`` says where it ran).  Ray re-executes a chunk whose node died
(``NODE_RETRIES``); a chunk lost for good is not recorded, so its samples run on the next
invocation.  Ctrl-C cancels the chunks in flight (their finished samples are kept only when
the chunk returned) and exits 130.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.batch.on_ray import NODE_RETRIES, agent_slots, on_cluster
from engine.batch.progress import LinesView, Tally
from engine.batch.results_file import ResultsFile
from engine.batch.stopping import Stopper
from engine.launch import WorkerSettings
from engine.workers import Engine

__all__ = ["CHUNK", "run_chunk", "run_on_ray"]

# The samples are ``engine.batch.sample_file.SampleSpec``s (not imported: that module imports this one).

#: Samples per Ray task.
CHUNK = 32


def run_chunk(specs: list[Any], settings: WorkerSettings, parallel: int, timeout: float) -> list[dict]:
    """The Ray task: run ``specs`` on this node; their records, in completion order."""
    import ray

    async def main() -> list[dict]:
        async with Engine(settings) as engine:
            return [r.record() async for r in engine.as_completed((s.sample() for s in specs), concurrency=parallel,
                                                           timeout=timeout)]

    node = ray.util.get_node_ip_address()
    return [{**record, "node": node} for record in asyncio.run(main())]


def run_on_ray(address: str, pending: list[Any], settings: WorkerSettings, *, results: ResultsFile,
               tally: Tally, view: LinesView, parallel: int, stopper: Stopper, timeout: float) -> None:
    """Run ``pending`` on the cluster at ``address``, writing each chunk's records as it comes."""
    with on_cluster(address, {}, stopper) as ray:
        slots = max(1, agent_slots(ray))
        remote = ray.remote(num_cpus=0, resources={"agent_slot": 1}, max_retries=NODE_RETRIES,
                            retry_exceptions=False)(run_chunk)
        chunks = [pending[i:i + CHUNK] for i in range(0, len(pending), CHUNK)]
        inflight: dict[Any, list[Any]] = {}
        cancelled = False
        while chunks or inflight:
            while not stopper.stopping and chunks and len(inflight) < slots:
                chunk = chunks.pop(0)
                inflight[remote.remote(chunk, settings, parallel, timeout)] = chunk
                for spec in chunk:
                    tally.start(spec.key)
            if stopper.stopping and not cancelled:
                cancelled = True
                chunks.clear()
                for ref in inflight:
                    ray.cancel(ref, force=False)
            if not inflight:
                break
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for ref in ready:
                chunk = inflight.pop(ref)
                try:
                    records = ray.get(ref)
                except ray.exceptions.RayError:
                    records = []  # lost or cancelled: its samples run again next time
                for record in records:
                    results.append(record)
                    tally.finish(str(record["id"]), record)
                    view.finished(record)
                for spec in chunk:
                    tally.running.pop(spec.key, None)
            view.tick()
