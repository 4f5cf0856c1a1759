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
  only.  Where the fork server cannot run (it needs root and bubblewrap) each sample gets an
  engine of its own instead: the same isolation, started cold (~100 ms a sample).
- It runs as ``python sample.py ARGS`` would (``engine.script``): ``sys.argv``, ``__file__``,
  ``__name__ == "__main__"``, ``stdin`` on ``sys.stdin``, ``SystemExit`` as the exit status,
  tracebacks on stderr, threads waited for and ``atexit`` handlers run.
- Exactly one ``SampleResult`` comes back (``status``: ``ok``, ``error``, ``timeout``,
  ``killed``, ``died``; ``cancelled`` only when the caller stopped it), with the exit code
  ``exec`` would give, stdout and stderr each as head and tail with the count of bytes cut
  between, the wall time and the peak resident memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from worker.slot import HeadTail

from ._process import descendants
from ._tree import remove_tree
from .durations import DEFAULT_BLOCK_TIMEOUT
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OWN, EXIT_TIMEOUT, ConfigError
from .results import BlockResult, OutputChunk
from .sandbox import host_support
from .script import Script
from .slots import SlotPool

#: An ``engine.Engine`` (not imported: the engine imports this module).
Engine = Any

#: Bytes of each stream kept at the head and at the tail of a result (the middle is counted).
OUTPUT_BYTES = 8 * 1024
#: What the code is called: ``__file__``, the name in its tracebacks and ``sys.argv[0]``, relative to
#: its workspace (its current directory; as Python before 3.9 named a script), so that a sample's
#: output does not depend on where a run's workspace happened to lie.
SCRIPT_NAME = "sample.py"
#: Bytes of ``files`` one sample may carry (they travel in one message to the worker).
FILES_CAP = 8 * 1024 * 1024
STATUSES = ("ok", "error", "timeout", "killed", "died", "cancelled")
_MEMORY_WORDS = "over its memory limit"  # what ``engine.worker`` says of a worker the cgroup killed


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


class Stream(HeadTail):
    """Head and tail of one output stream, with the exact count of what lies between."""

    @classmethod
    def of(cls, parts: tuple[bytes, bytes, int], keep: int) -> Stream:
        """The stream a sample slot kept: (head, tail, total bytes)."""
        stream = cls(keep)
        stream.head, stream.tail, stream.total = bytearray(parts[0]), bytearray(parts[1]), parts[2]
        return stream

    def text(self) -> tuple[str, int]:
        tail = bytes(self.tail[-self.keep:]) if self.tail else b""
        cut = self.total - len(self.head) - len(tail)
        if not cut:
            return (bytes(self.head) + tail).decode("utf-8", "replace"), 0
        return (bytes(self.head).decode("utf-8", "replace") + f"\n[... {cut} bytes cut ...]\n"
                + tail.decode("utf-8", "replace")), cut


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


def _status(result: BlockResult, code: int) -> str:
    if result.status in ("ok", "error"):
        return "ok" if code == 0 else "error"
    if result.status == "died":  # by its own hand (a signal it sent, os._exit), or by a limit
        if _MEMORY_WORDS in result.message:
            return "killed"
        if not result.signal:  # os._exit(N): an exit status, as a slot (and the shell) sees it
            return "ok" if code == 0 else "error"
        return "died"
    return result.status  # timeout, cancelled, killed


def _words(status: str, result: BlockResult, timeout: float) -> str:
    """What happened, in words, when it is not what the exit code says alone."""
    if status == "timeout":
        return f"its deadline ({timeout:g} s) passed" + (
            ", and it was killed: the interrupt did not stop it" if result.worker_killed else "")
    if status == "killed":
        return result.message.split(";")[0]  # the memory limit, as the engine words it
    if status == "died":
        return f"it died of signal {result.signal}"
    return "cancelled" if status == "cancelled" else ""


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


async def run_sample(engine: Engine, sample: Sample, *, timeout: float = DEFAULT_BLOCK_TIMEOUT,
                     output_bytes: int = OUTPUT_BYTES) -> SampleResult:
    """Run one sample in a fresh worker of ``engine`` (whose workers must each see a workspace of
    their own: see ``Engine.map``) and kill it after.  Never raises for what the code did (files
    that do not fit its workspace are its ``error``, exit code 125); a worker that cannot start
    raises ``WorkerStartError``, which ends ``map_samples`` too (the machine cannot run samples)."""
    started = time.monotonic()
    streams = {"stdout": Stream(output_bytes), "stderr": Stream(output_bytes)}

    def collect(chunk: OutputChunk) -> None:
        streams[chunk.stream].add(chunk.data)

    worker = await engine.start_worker(f"sample-{sample.key}"[:60])
    stdin_fd = None
    rss = None
    try:
        ready = await worker.run(_prelude(sample, str(engine.workspace)), timeout=30)
        if ready.status != "ok":  # its /tmp-sized workspace is too small for them, say
            why = (ready.error.strip().splitlines() or [ready.message])[-1]
            return SampleResult(sample.id, "error", EXIT_OWN, "", "", 0, 0, time.monotonic() - started, None,
                                f"its files could not be written to its workspace: {why}")
        if sample.stdin is not None:
            stdin_fd = _stdin_file(sample.stdin)
        script = Script(SCRIPT_NAME, [SCRIPT_NAME, *sample.args], stdin_fd)  # relative: see SCRIPT_NAME
        result = await worker.run(sample.code, timeout=sample.timeout or timeout, block_id="main",
                                  on_output=collect, script=script)
        if result.status in ("ok", "error"):  # the process lives (a kill would have replaced it)
            rss = peak_rss_mb(worker.pid)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(worker.close())
        with contextlib.suppress(ValueError):
            engine.workers.remove(worker)
        if stdin_fd is not None:
            os.close(stdin_fd)
    code = exit_code(result)
    (out, out_cut), (err, err_cut) = streams["stdout"].text(), streams["stderr"].text()
    status = _status(result, code)
    return SampleResult(sample.id, status, code, out, err, out_cut, err_cut, time.monotonic() - started,
                        rss, _words(status, result, sample.timeout or timeout))


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
    return SampleResult(sample.id, "cancelled", EXIT_INTERRUPTED, "", "", 0, 0, time.monotonic() - started,
                        None, "cancelled")


async def map_samples(runner: SampleRunner, samples: Iterable[Sample], *, concurrency: int | None = None,
                      timeout: float = DEFAULT_BLOCK_TIMEOUT,
                      output_bytes: int = OUTPUT_BYTES) -> AsyncIterator[SampleResult]:
    """Run ``samples`` (read lazily), ``concurrency`` at once, yielding each result as it
    completes.  Leaving the iteration early (or cancelling it) kills the samples still running."""
    concurrency = max(1, concurrency or 2 * len(os.sched_getaffinity(0)))
    source = iter(samples)
    running: dict[asyncio.Task, Sample] = {}
    try:
        while True:
            while len(running) < concurrency:
                sample = next(source, None)
                if sample is None:
                    break
                running[asyncio.ensure_future(runner.run(sample, timeout=timeout,
                                                         output_bytes=output_bytes))] = sample
            if not running:
                return
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                running.pop(task)
                yield task.result()
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


class SampleRunner:
    """Runs samples for ``Engine.map``.

    Slots come from one engine of the runner's own, with the base engine's sandbox and
    interpreter, and are kept from one ``map`` to the next.  Where no fork server can run (it
    needs root and bubblewrap), each sample gets an engine of its own with a workspace of its
    own instead: the same isolation, started cold."""

    def __init__(self, base: Engine, make_engine: Callable[..., Engine]) -> None:
        self.base = base
        self.make_engine = make_engine
        self.shared: Engine | None = None
        self.slots: SlotPool | None = None
        self._dirs: list[Path] = []

    def _options(self, workspace: Path, state: Path) -> dict[str, Any]:
        base = self.base
        # A sample starts in its workspace; the engine's directory (which may hold the results
        # of other samples) is shown only when asked for (``share_cwd=True``, ``--share-cwd``).
        return {"cwd": base.cwd, "workspace": workspace,
                "sandbox": replace(base.sandbox, share_cwd=base.sandbox.share_cwd is True),
                "python": base.python,
                "state_dir": state, "pool": 0, "preload": base.preload, "env_allow": base.launcher.env_allow}

    def forked(self) -> bool:
        """Whether samples are forked by a fork server (else each starts cold, alone)."""
        base = self.base
        return (os.geteuid() == 0 and base.launcher.zygote is not False and base.sandbox.mode in ("auto", "bwrap")
                and host_support().bwrap is not None)

    async def run(self, sample: Sample, *, timeout: float = DEFAULT_BLOCK_TIMEOUT,
                  output_bytes: int = OUTPUT_BYTES) -> SampleResult:
        if self.forked():
            if self.shared is None:
                self.base.open()
                where = self.base.run_dir / "samples"
                self._dirs.append(where)
                self.shared = self.make_engine(**self._options(where / "workspace", where / "state"),
                                               own_workspaces=True)
                self.shared.open()
                self.slots = SlotPool(self.shared.launcher)
            assert self.slots is not None
            started = time.monotonic()
            got = await self.slots.run(sample, timeout=sample.timeout or timeout, output_bytes=output_bytes,
                                       script_name=SCRIPT_NAME)
            (out, out_cut), (err, err_cut) = (Stream.of(got["out"], output_bytes).text(),
                                              Stream.of(got["err"], output_bytes).text())
            return SampleResult(sample.id, got["status"], got["code"], out, err, out_cut, err_cut,
                                time.monotonic() - started, got["rss_mb"], got["words"])
        self.base.open()
        where = Path(tempfile.mkdtemp(prefix="sample-", dir=self.base.run_dir))
        try:
            async with self.make_engine(**self._options(where / "workspace", where / "state"),
                                        zygote=False) as engine:
                return await run_sample(engine, sample, timeout=timeout, output_bytes=output_bytes)
        finally:
            await asyncio.to_thread(remove_tree, where)

    async def close(self) -> None:
        """Shut the runner's engine down and remove its directories."""
        if self.slots is not None:
            await self.slots.close()
            self.slots = None
        if self.shared is not None:
            await self.shared.shutdown()
            self.shared = None
        for where in self._dirs:
            await asyncio.to_thread(remove_tree, where)
        self._dirs.clear()


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
