"""Code samples: many independent programs, each run as ``agentloop exec`` runs a file, each in
a sandbox of its own (``Engine.map``; ``agentloop exec --jsonl`` on top of it).

A sample is ``code`` plus, optionally, ``stdin``, ``args``, ``timeout``, ``files`` and ``env``.
Guarantees, for every sample:

- It runs in a process of its own, in a session and in mount, IPC and network namespaces of
  its own, with its own empty ``/tmp``, ``/dev/shm`` and workspace (its current directory,
  where ``files`` are written): tmpfs that the kernel frees with the namespaces.  The process
  is forked by a sample slot (``engine.slots``, ``worker.slot``): a sandbox that the fork
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
- It runs as ``python sample.py ARGS`` would (``engine.script_run``): ``sys.argv``, ``__file__``,
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
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from worker.contract.limits import HeadTail

from ._process import descendants
from ._tree import remove_tree
from .durations import DEFAULT_BLOCK_TIMEOUT
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OWN, EXIT_TIMEOUT, ConfigError
from .launcher import Launcher
from .provision import fork_server_refusal
from .results import BlockResult, OutputChunk
from .sample_status import STATUSES, Ending, cancelled_outcome, classify
from .script_run import ScriptRun
from .slots import SlotPool
from .worker import Worker

#: Bytes of each stream kept at the head and at the tail of a result (the middle is counted).
OUTPUT_BYTES = 8 * 1024
#: What the code is called: ``__file__``, the name in its tracebacks and ``sys.argv[0]``, relative to
#: its workspace (its current directory; as Python before 3.9 named a script), so that a sample's
#: output does not depend on where a run's workspace happened to lie.
SCRIPT_NAME = "sample.py"
#: Bytes of ``files`` one sample may carry (they travel in one message to the worker).
FILES_CAP = 8 * 1024 * 1024


@dataclass(frozen=True)
class Sample:
    """One program to run.  ``files``: (path relative to the workspace, content, mode), written
    before the code starts; ``env``: variables set for it (names from ``ENV_ALLOWLIST``);
    ``timeout``: its deadline in seconds (None: the caller's default)."""

    id: str | int
    code: str
    stdin: str | bytes | None = None
    args: tuple[str, ...] = ()
    timeout: float | None = None
    files: tuple[tuple[str, bytes, int], ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.id)


@dataclass
class SampleResult:
    """How one sample ended.  ``exit_code`` is what ``agentloop exec`` exits with for it (124
    at the deadline, 128+N for a death by signal N); ``stdout_cut``/``stderr_cut``: bytes cut
    between the head and the tail kept; ``max_rss_mb``: peak resident memory of the sample's
    process (None when it died before it could say)."""

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

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def record(self) -> dict:
        """The result as one JSON-able line of a results file."""
        return {"id": self.id, "status": self.status, "exit_code": self.exit_code, "stdout": self.stdout,
                "stderr": self.stderr, "stdout_cut": self.stdout_cut, "stderr_cut": self.stderr_cut,
                "duration_s": round(self.duration_s, 4), "max_rss_mb": self.max_rss_mb,
                "message": self.message}


def exit_code(result: BlockResult) -> int:
    """The exit status ``agentloop exec`` gives a block's result (see ``engine.cli.exec``)."""
    if result.exited:  # SystemExit: its status, as Python exits with it
        return result.exit_code or 0
    if result.status == "ok":
        return 0
    if result.status == "timeout":
        return EXIT_TIMEOUT
    if result.status == "died":
        if result.signal:
            return 128 + result.signal
        return result.exit_code if result.exit_code else EXIT_ERROR
    if result.status == "cancelled":
        return EXIT_INTERRUPTED
    return EXIT_ERROR


def _ending(result: BlockResult) -> Ending:
    """How a sample's worker block ended, as ``sample_status.classify`` takes it."""
    if result.status == "timeout":
        return Ending(timed_out=True, killed=result.worker_killed)
    if result.status == "died":  # by its own hand (a signal it sent, os._exit), or by a limit
        return Ending(code=None if result.signal else exit_code(result), signal=result.signal,
                      over_memory=result.over_memory)
    return Ending(code=exit_code(result))


def _prelude(sample: Sample, workspace: str) -> str:
    """A block that makes the worker's current directory the sample's workspace, writes the
    sample's files there and then its code, as ``SCRIPT_NAME`` (as a slot does: tracebacks
    quote it, spawn re-reads it), and sets its variables, leaving no name behind."""
    files = [(p, b, m) for p, b, m in sample.files] + [(SCRIPT_NAME, sample.code.encode(), 0o644)]
    lines = [f"__import__('os').chdir({workspace!r})\n"
             f"for _p, _b, _m in {files!r}:\n"
             "    __import__('os').makedirs(__import__('os').path.dirname(_p) or '.', exist_ok=True)\n"
             "    with open(_p, 'wb') as _f:\n"
             "        _f.write(_b)\n"
             "    __import__('os').chmod(_p, _m)\n"
             "del _p, _b, _m, _f"]
    if sample.env:
        lines.append(f"__import__('os').environ.update({dict(sample.env)!r}); __import__('time').tzset()")
    return "\n".join(lines)


def peak_rss_mb(root: int | None) -> float | None:
    """The largest peak resident memory (VmHWM) of a process in the tree of ``root``, in MiB:
    the sample's own process (the fork server's namespace init and bubblewrap are tiny)."""
    if root is None:
        return None
    peak = 0
    for pid in (root, *descendants(root)):
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
                        break
        except (OSError, ValueError):
            continue
    return round(peak / 1024, 1) if peak else None


async def run_sample(launcher: Launcher, sample: Sample, *, timeout: float = DEFAULT_BLOCK_TIMEOUT,
                     output_bytes: int = OUTPUT_BYTES) -> SampleResult:
    """Run one sample in a fresh worker of ``launcher`` (an open one, whose workspace is the
    sample's own) and kill it after.  Never raises for what the code did (files that do not fit
    its workspace are its ``error``, exit code 125); a worker that cannot start raises
    ``WorkerStartError``, which ends ``map_samples`` too (the machine cannot run samples)."""
    started = time.monotonic()
    streams = {"stdout": HeadTail(output_bytes), "stderr": HeadTail(output_bytes)}

    def collect(chunk: OutputChunk) -> None:
        streams[chunk.stream].add(chunk.data)

    worker = Worker(launcher, f"sample-{sample.key}"[:60])
    stdin_fd = None
    rss = None
    try:
        await worker.start()
        ready = await worker.run(_prelude(sample, str(launcher.workspace)), timeout=30)
        if ready.status != "ok":  # its /tmp-sized workspace is too small for them, say
            why = (ready.error.strip().splitlines() or [ready.message])[-1]
            return SampleResult(sample.id, "error", EXIT_OWN, "", "", 0, 0, time.monotonic() - started, None,
                                f"its files could not be written to its workspace: {why}")
        if sample.stdin is not None:
            stdin_fd = _stdin_file(sample.stdin)
        script = ScriptRun(SCRIPT_NAME, [SCRIPT_NAME, *sample.args], stdin_fd)  # relative: see SCRIPT_NAME
        result = await worker.run(sample.code, timeout=sample.timeout or timeout, block_id="main",
                                  on_output=collect, script=script)
        if result.status in ("ok", "error"):  # the process lives (a kill would have replaced it)
            rss = peak_rss_mb(worker.pid)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(worker.close())
        if stdin_fd is not None:
            os.close(stdin_fd)
    status, code, words = classify(_ending(result), sample.timeout or timeout, launcher.settings.sandbox.memory_bytes)
    (out, out_cut), (err, err_cut) = streams["stdout"].text(), streams["stderr"].text()
    return SampleResult(sample.id, status, code, out, err, out_cut, err_cut, time.monotonic() - started, rss, words)


def _stdin_file(data: str | bytes) -> int:
    """A file descriptor that reads ``data`` and then an end of file (forwarded as ``exec``
    forwards a piped stdin)."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.memfd_create("agentloop-stdin", os.MFD_CLOEXEC)
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def cancelled(sample: Sample, started: float) -> SampleResult:
    status, code, words = cancelled_outcome()
    return SampleResult(sample.id, status, code, "", "", 0, 0, time.monotonic() - started, None, words)


async def map_samples(runner: SampleRunner, samples: Iterable[Sample], *, concurrency: int | None = None,
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


class SampleRunner:
    """Runs samples for ``Engine.map``, with the settings of the engine's launcher (``base``).

    Slots come from one launcher of the runner's own, kept from one ``map`` to the next.  Where
    no fork server can give the isolation of a cold start (``provision.fork_server_refusal``),
    each sample gets a launcher and a worker of its own with a workspace of its own instead: the
    same isolation, started cold."""

    def __init__(self, base: Launcher) -> None:
        self.base = base
        # A sample starts in its workspace; the engine's directory (which may hold the results
        # of other samples) is shown only when asked for (``share_cwd=True``, ``--share-cwd``).
        sandbox = base.settings.sandbox
        self.settings = base.settings.replace(sandbox=replace(sandbox, share_cwd=sandbox.share_cwd is True))
        self.forked = fork_server_refusal(self.settings) is None
        self.slots: SlotPool | None = None
        self._slot_launcher: Launcher | None = None

    def _launcher(self, where: Path, **own: Any) -> Launcher:
        launcher = Launcher(self.settings.replace(state_dir=where / "state", **own), cwd=self.base.cwd,
                            workspace=where / "workspace", own_workspaces=self.forked)
        launcher.open()
        return launcher

    async def run(self, sample: Sample, *, timeout: float = DEFAULT_BLOCK_TIMEOUT,
                  output_bytes: int = OUTPUT_BYTES) -> SampleResult:
        if self.forked:
            if self.slots is None:
                self._slot_launcher = self._launcher(self.base.run_dir / "samples")
                self.slots = SlotPool(self._slot_launcher)
            started = time.monotonic()
            deadline = sample.timeout or timeout
            ran = await self.slots.run(sample, timeout=deadline, output_bytes=output_bytes, script_name=SCRIPT_NAME)
            status, code, words = classify(ran.ending, deadline, self.settings.sandbox.memory_bytes)
            (out, out_cut), (err, err_cut) = (HeadTail.of(ran.out, output_bytes).text(),
                                              HeadTail.of(ran.err, output_bytes).text())
            return SampleResult(sample.id, status, code, out, err, out_cut, err_cut,
                                time.monotonic() - started, ran.rss_mb, words)
        where = Path(tempfile.mkdtemp(prefix="sample-", dir=self.base.run_dir))
        launcher = self._launcher(where, fork_server=False)
        try:
            return await run_sample(launcher, sample, timeout=timeout, output_bytes=output_bytes)
        finally:
            await launcher.close()
            await asyncio.to_thread(remove_tree, where)

    async def close(self) -> None:
        """Close the runner's slots and remove their directories."""
        if self.slots is not None:
            await self.slots.close()
            self.slots = None
        if self._slot_launcher is not None:
            await self._slot_launcher.close()
            await asyncio.to_thread(remove_tree, self._slot_launcher.workspace.parent)
            self._slot_launcher = None


def check_env(env: Mapping[str, Any], allowed: Iterable[str]) -> dict[str, str]:
    """``env`` as str -> str, refusing names outside ``allowed`` (ConfigError naming them)."""
    allowed = set(allowed)
    bad = sorted(str(k) for k in env if k not in allowed)
    if bad:
        raise ConfigError(f"env may set only {', '.join(sorted(allowed))}; not {', '.join(bad)}")
    if not all(isinstance(v, str) for v in env.values()):
        raise ConfigError("env values must be strings")
    return {str(k): v for k, v in env.items()}


__all__ = ["FILES_CAP", "OUTPUT_BYTES", "SCRIPT_NAME", "STATUSES", "Sample", "SampleResult", "SampleRunner",
           "cancelled", "check_env", "exit_code", "map_samples", "peak_rss_mb", "run_sample"]
