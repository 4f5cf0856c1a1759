"""Code samples: many independent programs, each run as ``agentloop exec`` runs a file, each in
a sandbox of its own (``Engine.map``; ``agentloop exec --jsonl`` on top of it).

A sample is ``code`` plus, optionally, ``stdin``, ``args``, ``timeout``, ``files`` and ``env``.
Guarantees, for every sample:

- It runs in a process of its own, in a session and in mount, IPC and network namespaces of
  its own, with its own empty ``/tmp``, ``/dev/shm`` and workspace (its current directory,
  where ``files`` are written): tmpfs that the kernel frees with the namespaces.  The process
  is forked by a sample slot (``engine.samples``, ``worker.slot``): a sandbox that the fork
  server started with PID and UTS namespaces and cgroups of its own, which runs one sample
  after another, confines each as a worker is confined (uid, Landlock, seccomp, rlimits) and
  kills and reaps everything a sample started before the next begins.  Nothing a sample
  writes, starts or leaves behind is visible to another; a fork bomb, a memory bomb, an
  endless loop, a sample that kills its process group or fills ``/tmp`` costs its own result
  only.  Where no fork server can run (``provision.fork_server_refusal``: no bubblewrap, or a
  kernel that refuses an unprivileged one its user namespaces) each sample gets an engine of
  its own instead: the same isolation, started cold (~100 ms a sample).
- Samples that run at once cannot reach each other: each has its own terminals (a devpts
  instance), ``/proc`` (its own processes only), PID and network namespaces, and, under a root
  coordinator, a uid of its own (each slot's), so no per-user kernel quota (inotify instances,
  fanotify groups, pipe buffer pages, pending signals) is shared.  An unprivileged coordinator
  has one uid to give: its concurrent samples share its per-user quotas (and with its other
  processes), the rest holds.
- It runs as ``python sample.py ARGS`` would (``engine.workers``): ``sys.argv``, ``__file__``,
  ``__name__ == "__main__"``, ``stdin`` on ``sys.stdin``, ``SystemExit`` as the exit status,
  tracebacks on stderr, threads waited for and ``atexit`` handlers run.
- Exactly one ``SampleResult`` comes back (``status``: ``ok``, ``error``, ``timeout``,
  ``killed``, ``died``; ``cancelled`` only when the caller stopped it), with the exit code
  ``exec`` would give, stdout and stderr each as head and tail with the count of bytes cut
  between, the wall time and the peak resident memory.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.durations import DEFAULT_BLOCK_TIMEOUT
from engine.errors import ConfigError
from engine.samples._status import STATUSES, cancelled_outcome

#: Bytes of each stream kept at the head and at the tail of a result (the middle is counted).
OUTPUT_BYTES = 8 * 1024
#: What the code is called: ``__file__``, the name in its tracebacks and ``sys.argv[0]``, relative to
#: its workspace (its current directory; as Python before 3.9 named a script), so that a sample's
#: output does not depend on where a run's workspace happened to lie.
SCRIPT_NAME = "sample.py"
#: Bytes of ``files`` one sample may carry (they travel in one message to the worker).
FILES_CAP = 8 * 1024 * 1024
#: Bytes of the files one sample may send back (``fetch``), in all.
FETCH_CAP = 8 * 1024 * 1024


@dataclass(frozen=True)
class Sample:
    """One program to run.  ``files``: (path relative to the workspace, content, mode), written
    before the code starts; ``env``: variables set for it (names from ``ENV_ALLOWLIST``);
    ``timeout``: its deadline in seconds (None: the caller's default); ``allow_net``: the hosts it
    may reach (``--allow-net`` entries) in place of the run's, whose allowlist gives its sandbox
    a way out at all (empty: the run's); ``fetch``: paths relative to the workspace whose files
    come back in the result's ``files`` when the code ends by itself or at its deadline's
    interrupt (``FETCH_CAP`` bytes at most in all; a missing file, a link or anything but a
    regular file is left out)."""

    id: str | int
    code: str
    stdin: str | bytes | None = None
    args: tuple[str, ...] = ()
    timeout: float | None = None
    files: tuple[tuple[str, bytes, int], ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    allow_net: tuple[str, ...] = ()
    fetch: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return str(self.id)


@dataclass
class SampleResult:
    """How one sample ended.  ``exit_code`` is what ``agentloop exec`` exits with for it (124
    at the deadline, 128+N for a death by signal N); ``stdout_cut``/``stderr_cut``: bytes cut
    between the head and the tail kept; ``max_rss_mb``: peak resident memory of the sample's
    process (None when it died before it could say); ``network``: with an allowlist, every
    connection its code made through its way out (``engine.net.ConnectionRecord``'s fields);
    ``files``: what ``Sample.fetch`` brought back, by path."""

    id: str | int
    status: str
    exit_code: int
    stdout: str
    stderr: str
    stdout_cut: int
    stderr_cut: int
    duration_s: float
    max_rss_mb: float | None
    message: str = ""
    network: list[dict] | None = None
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def record(self) -> dict:
        """The result as one JSON-able line of a results file."""
        return {"id": self.id, "status": self.status, "exit_code": self.exit_code, "stdout": self.stdout,
                "stderr": self.stderr, "stdout_cut": self.stdout_cut, "stderr_cut": self.stderr_cut,
                "duration_s": round(self.duration_s, 4), "max_rss_mb": self.max_rss_mb,
                "message": self.message, **({"network": self.network} if self.network is not None else {})}


def cancelled(sample: Sample, started: float) -> SampleResult:
    status, code, words = cancelled_outcome()
    return SampleResult(sample.id, status, code, "", "", 0, 0, time.monotonic() - started, None, words)


class RunsSamples(Protocol):
    """What ``map_samples`` runs each sample with (``engine.workers``' runner: a slot, or a cold worker)."""

    async def run(self, sample: Sample, *, timeout: float, output_bytes: int) -> SampleResult: ...


async def map_samples(runner: RunsSamples, samples: Iterable[Sample], *, concurrency: int | None = None,
                      timeout: float = DEFAULT_BLOCK_TIMEOUT, output_bytes: int = OUTPUT_BYTES,
                      ordered: bool = True) -> AsyncIterator[SampleResult]:
    """Run ``samples`` (read lazily), ``concurrency`` at once (default: twice the usable CPUs),
    yielding each result in the order of ``samples`` (``ordered``, as ``Executor.map``; at
    most four times ``concurrency`` run or wait ahead of the first unfinished one) or as it
    completes.  Leaving the iteration early (or cancelling it) kills the samples still running."""
    concurrency = max(1, concurrency or 2 * len(os.sched_getaffinity(0)))
    window = 4 * concurrency if ordered else concurrency
    source = iter(samples)
    started: collections.deque[asyncio.Task] = collections.deque()  # in the order of ``samples``
    running: set[asyncio.Task] = set()
    try:
        while True:
            while len(running) < concurrency and len(started) < window:
                sample = next(source, None)
                if sample is None:
                    break
                task = asyncio.ensure_future(runner.run(sample, timeout=timeout, output_bytes=output_bytes))
                running.add(task)
                started.append(task)
            if not started:
                return
            if ordered and started[0].done():
                head = started.popleft()
                running.discard(head)
                yield head.result()
                continue
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            running -= done
            if not ordered:
                for task in done:
                    started.remove(task)
                    yield task.result()
    finally:
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)


def check_env(env: Mapping[str, Any], allowed: Iterable[str]) -> dict[str, str]:
    """``env`` as str -> str, refusing names outside ``allowed`` (ConfigError naming them)."""
    allowed = set(allowed)
    bad = sorted(str(k) for k in env if k not in allowed)
    if bad:
        raise ConfigError(f"env may set only {', '.join(sorted(allowed))}; not {', '.join(bad)}")
    if not all(isinstance(v, str) for v in env.values()):
        raise ConfigError("env values must be strings")
    return {str(k): v for k, v in env.items()}


__all__ = ["FETCH_CAP", "FILES_CAP", "OUTPUT_BYTES", "SCRIPT_NAME", "STATUSES", "Sample", "SampleResult", "cancelled", "check_env",
           "map_samples", "RunsSamples"]
