"""Code samples in workers: ``Engine.map``'s choice between a sample slot (``engine.samples``) and,
where no fork server can give the isolation of a cold start, a cold worker of its own per sample."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.durations import DEFAULT_BLOCK_TIMEOUT
from engine.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OWN, EXIT_TIMEOUT
from engine.launch import Launcher, descendants, fork_server_refusal
from engine.results import BlockResult, OutputChunk
from engine.samples import OUTPUT_BYTES, SCRIPT_NAME, Ending, Sample, SampleResult, SlotPool, classify
from engine.trees import remove_tree
from worker.contract.limits import HeadTail

__all__ = ["SampleRunner", "exit_code", "run_sample"]


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
    from engine.workers._script_run import ScriptRun  # (with ZeroMQ: samples in slots never need them)
    from engine.workers._worker import Worker

    started = time.monotonic()
    streams = {"stdout": HeadTail(output_bytes), "stderr": HeadTail(output_bytes)}

    def collect(chunk: OutputChunk) -> None:
        streams[chunk.stream].add(chunk.data)

    worker = Worker(launcher, f"sample-{sample.key}"[:60])
    stdin_fd = None
    rss = None
    network = None
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
        if launcher.gates is not None:  # (closed with the worker: every connection it made)
            network = [{k: v for k, v in r.items() if k != "process"} for r in launcher.gates.records]
        if stdin_fd is not None:
            os.close(stdin_fd)
    status, code, words = classify(_ending(result), sample.timeout or timeout, launcher.settings.sandbox.memory_bytes)
    if sample.fetch:  # (the workspace of a worker started cold is gone with it)
        words = "; ".join(w for w in (words, "files are fetched by sample slots only, and this machine runs "
                                             "samples without a fork server") if w)
    (out, out_cut), (err, err_cut) = streams["stdout"].text(), streams["stderr"].text()
    return SampleResult(sample.id, status, code, out, err, out_cut, err_cut, time.monotonic() - started, rss, words,
                        network=network)


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
        if self.base.opened:  # (its Python judged: only the new workspace is judged again)
            own.setdefault("python", self.base.settings.python)
        launcher = Launcher(self.settings.replace(state_dir=where / "state", **own), cwd=self.base.cwd,
                            workspace=where / "workspace", own_workspaces=self.forked)
        launcher.open()
        return launcher

    async def run(self, sample: Sample, *, timeout: float = DEFAULT_BLOCK_TIMEOUT,
                  output_bytes: int = OUTPUT_BYTES) -> SampleResult:
        if sample.allow_net and not self.settings.allow_net:
            return SampleResult(sample.id, "error", EXIT_OWN, "", "", 0, 0, 0.0, None,
                                "its allow_net needs the run's own allowlist (--allow-net, network.allow, "
                                "WorkerSettings(allow_net=...)): without one no sample's sandbox has a way out")
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
            words = "; ".join(w for w in (words, ran.note) if w)
            return SampleResult(sample.id, status, code, out, err, out_cut, err_cut,
                                time.monotonic() - started, ran.rss_mb, words, network=ran.network,
                                files=ran.fetched)
        where = Path(tempfile.mkdtemp(prefix="sample-", dir=self.base.run_dir))
        own = {"allow_net": sample.allow_net} if sample.allow_net else {}
        launcher = self._launcher(where, fork_server=False, **own)
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
