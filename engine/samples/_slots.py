"""Sample slots: sandboxes that run code samples one after another (``worker.slot``).

A slot is started by the run's fork server like a worker (its own PID, network and UTS
namespaces, cgroups, a socket directory only it sees) and then runs each sample it is given
in a process with mount, IPC and cgroup namespaces of its own, confined as a worker is, with
an empty ``/tmp``, ``/dev/shm`` and workspace, terminals of its own and a ``/proc`` of its
own processes; everything a sample started is killed and reaped before the next one begins.
What a sample costs is then a fork of a small interpreter and a few mounts, not the start of
a worker: the reason slots exist (``agentloop exec --jsonl``).

How a sample's sandbox is started, in order: ``SlotPool.run`` takes an idle slot or starts
one (``Slot.start``: the slot's own uid under a root coordinator, ``Launcher.launch`` with the
slot entry point, ``Launcher.start_process`` through the run's fork server, the slot's hello
on its unix socket); the slot (``worker/slot.py``) forks the sample, which takes its
namespaces, mounts and confinement and runs the code; the slot answers with a ``Result``
(``worker/contract/sample.py``), and ``engine.samples`` says what it means.

Samples that run at once run in different slots, and a root coordinator gives each slot a
uid of its own (``Launcher.own_uid``): what a uid allows or counts — opening a terminal,
reading another's ``/proc``, signalling, inotify instances, pipe buffer pages and the other
per-user kernel quotas — is never shared by two samples that run at once.  A slot is used
again only when what it hands the next sample was checked: the slot finds no socket left in
its network namespace (a cycle of unix sockets in flight, which outlives every process) and
moves to a fresh one when the last sample moved its counters, and the coordinator finds its
memory cgroup holding no more than the slot did at its start (``Slot.memory_clean``).
Otherwise it is replaced.

Nothing a slot says is trusted: replies are size-bounded, decoded without unpickling and
checked field by field; a slot that says anything else, stops answering past the sample's
deadline, or dies, is killed, and its sample gets a result that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import SlotError, WorkerStartError
from engine.net import Allowlist
from engine.samples._sample import FETCH_CAP
from engine.samples._status import Ending
from worker.contract import sample
from worker.contract.framing import FrameError, decode, encode, frame, read_frame_async
from worker.contract.limits import MAX_ID
from worker.contract.sample import SlotSettings
from worker.contract.schema import ContractError
from worker.contract.start import SLOT

if TYPE_CHECKING:
    from engine.launch import Launcher, Process
    from engine.samples._sample import Sample

_ids = itertools.count(1)
_MAX_REPLY = 1024 * 1024  # a hello; a result: this, or more where it keeps more output
#: Seconds a slot may take past a sample's deadline and grace to answer (reaping what it left).
_SLACK = 10.0
#: Memory a slot's cgroup may still hold after a sample beyond what the slot held when it
#: started (its own heap grows a little), in bytes, or as a share of the memory limit when
#: that is more; and how long the kernel may take to free the rest (an IPC namespace's
#: segments go a moment after its last process).
_KEPT_BYTES, _KEPT_SHARE, _FREED_WITHIN = 32 * 2**20, 1 / 32, 1.0


class Slot:
    """One started slot and its channel."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.number = next(_ids)
        self.proc: Process | None = None
        self.sock_dir: Path | None = None
        self.cgroups: list[Path] = []
        self.oom_kills = 0
        #: What the slot's memory cgroup holds that reclaim cannot free, as the slot started.
        self.memory_base: int | None = None
        #: The name of the uid claim of the slot's own (``Launcher.own_uid``), while it holds one.
        self.uid_name: str | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def start(self) -> None:
        """Start the slot and wait for its hello (``Launcher.start_process``, as for a
        worker); WorkerStartError, after cleaning up, if it fails."""
        launcher = self.launcher
        endpoint, self.sock_dir = launcher.endpoint(self.number)
        path = endpoint[len("ipc://"):]
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(path)
            listener.listen(1)
            listener.setblocking(False)
            token = secrets.token_hex(16)
            settings = launcher.settings
            # A uid of the slot's own: samples that run at once are in different slots, and
            # share no terminal, /proc entry, signal or per-user kernel quota through a uid.
            name = f"{launcher.workspace}#slot{self.number}"
            uid = launcher.own_uid(name)
            self.uid_name = name if uid is not None else None
            # (The endpoint travels in its settings, not in its command line, which every
            # sample could read.)
            slot = SlotSettings(str(launcher.workspace), settings.sandbox.tmp_bytes, settings.grace,
                                str(self.sock_dir), not settings.sandbox.network, settings.preload,
                                outputs=str(launcher.output_dir), endpoint=endpoint)
            launch = launcher.launch(endpoint, self.sock_dir, token, entry=SLOT, slot=slot, uid=uid)
            # After the launch (which hands a worker's socket to the run's uid): the slot connects
            # as the sandbox's root, not a worker uid.
            os.chown(path, os.getuid(), os.getgid())
            os.chmod(path, 0o600)
            self.proc, self.cgroups, _ = await launcher.start_process(launch, self.number,
                                                             self._greet(listener, path, token), "a sample slot")
        except BaseException:
            await asyncio.shield(self.close())
            raise
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)  # nobody else connects
        self.oom_kills = launcher.oom_kills(self.cgroups)
        self.memory_base = launcher.memory_held(self.cgroups)

    async def _greet(self, listener: socket.socket, path: str, token: str) -> sample.Hello:
        """The slot's hello: its connection, then its first message."""
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        with contextlib.suppress(OSError):
            os.unlink(path)  # nobody else connects
        self._reader, self._writer = await asyncio.open_unix_connection(sock=conn)
        try:
            hello = await self._read()
        except SlotError as exc:  # it died, or said something else, before its hello
            raise WorkerStartError(f"it said no hello ({exc})") from exc
        if isinstance(hello, sample.Failed):
            raise WorkerStartError(f"it cannot serve: {hello.error[:500]}")
        if not isinstance(hello, sample.Hello) or not hmac.compare_digest(hello.token.encode(), token.encode()):
            raise WorkerStartError("it did not say a valid hello")
        return hello

    async def _read(self, limit: int = _MAX_REPLY) -> sample.Message:
        assert self._reader is not None
        try:
            body = await read_frame_async(self._reader.readexactly, limit)
            if body is None:
                raise SlotError("it died")
            return sample.TO_COORDINATOR.parse(decode(body, limit))
        except (ContractError, FrameError) as exc:
            raise SlotError(f"it sent a malformed message ({exc})") from exc

    async def run(self, job: Sample, *, timeout: float, output_bytes: int, script_name: str) -> sample.Result:
        """Run one sample; the slot's result.  SlotError if the slot is not usable after."""
        assert self._writer is not None
        request = sample.RunSample(1, job.code, script_name, (script_name, *job.args), job.stdin,
                                   tuple(tuple(f) for f in job.files), dict(job.env), timeout, output_bytes,
                                   tuple(job.fetch), FETCH_CAP if job.fetch else 0)
        data = encode(request)
        if len(data) > sample.MAX_REQUEST:
            raise ValueError(f"the sample is {len(data)} bytes with its stdin and files; at most {sample.MAX_REQUEST}")
        gate = self._gate()
        if gate is not None:  # (its own allowlist, or the run's: the slot's gate is the sample's way out)
            gate.allowlist = Allowlist.parse(job.allow_net, f"sample {job.key}: allow_net") if job.allow_net \
                else self.launcher.settings.allow_net
        self._writer.write(frame(data))
        limit = timeout + self.launcher.settings.grace + _SLACK
        try:
            # Two heads and two tails of ``output_bytes`` at most, and a few words.
            reply = await asyncio.wait_for(self._read(max(_MAX_REPLY, 4 * output_bytes + request.fetch_bytes
                                                              + 2 * MAX_ID * len(job.fetch) + 65536)), limit)
        except TimeoutError as exc:
            raise SlotError(f"it did not answer within {limit:g} s") from exc
        if not isinstance(reply, sample.Result):
            raise SlotError(f"it sent {reply.kind!r} instead of a result")
        try:
            return reply.within(output_bytes, request.fetch, request.fetch_bytes)
        except ContractError as exc:
            raise SlotError(f"it sent a malformed result ({exc})") from exc

    def _gate(self):
        gates = self.launcher.gates
        return None if gates is None else gates.gate(self.sock_dir)

    async def network(self) -> list[dict] | None:
        """The connections of the sample that just ended (its processes are gone: whatever they
        left open is ended here); None without a way out."""
        gate = self._gate()
        if gate is None:
            return None
        await gate.cut()
        return [{k: v for k, v in r.items() if k != "process"} for r in self.launcher.gates.take(self.sock_dir)]

    async def memory_clean(self) -> bool:
        """Whether the slot's memory cgroup, now that its sample is gone, holds no more than
        the slot itself did (within ``_KEPT_BYTES``), waiting up to ``_FREED_WITHIN`` seconds
        for what the kernel frees late.  Memory the sample left charged there (a memfd in
        flight, say) would count against every later sample's limit."""
        if self.memory_base is None:
            return True
        limit = self.launcher.settings.sandbox.memory_bytes
        allowed = self.memory_base + max(_KEPT_BYTES, int(limit * _KEPT_SHARE) if limit else 0)
        deadline = asyncio.get_running_loop().time() + _FREED_WITHIN
        while True:
            held = self.launcher.memory_held(self.cgroups, allowed)
            if held is None or held <= allowed:
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.02)

    def memory_killed(self) -> bool:
        """Whether the kernel killed a process of this slot for its memory limit since last asked."""
        if not self.cgroups:
            return False
        count = self.launcher.oom_kills(self.cgroups)
        killed, self.oom_kills = count > self.oom_kills, count
        return killed

    async def close(self) -> None:
        """Kill the slot (its namespace and every process in it) and release what it held."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.proc is not None:
            await self.proc.kill()
        groups, self.cgroups, sock_dir, self.sock_dir = self.cgroups, [], self.sock_dir, None
        await self.launcher.release(groups, sock_dir)
        if self.uid_name is not None:  # (no process of the slot is left to run as it)
            self.launcher.release_uid(self.uid_name)
            self.uid_name = None


class SlotPool:
    """The slots of one launcher: started when every one is busy, reused sample after sample,
    replaced when one breaks."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self._idle: list[Slot] = []
        self._all: set[Slot] = set()
        self._closed = False

    async def _take(self) -> Slot:
        while self._idle:
            slot = self._idle.pop()
            if slot.proc is not None and slot.proc.returncode is None:
                return slot
            await self._drop(slot)
        slot = Slot(self.launcher)
        self._all.add(slot)
        try:
            await slot.start()
        except BaseException:
            self._all.discard(slot)
            raise
        return slot

    async def _drop(self, slot: Slot) -> None:
        self._all.discard(slot)
        await slot.close()

    async def run(self, job: Sample, *, timeout: float, output_bytes: int, script_name: str) -> Ran:
        """Run ``job`` in a free slot: exactly one outcome, whatever the sample or the slot did."""
        slot = await self._take()
        try:
            reply = await slot.run(job, timeout=timeout, output_bytes=output_bytes, script_name=script_name)
        except SlotError as exc:
            memory = slot.memory_killed()
            network = await slot.network()
            await self._drop(slot)
            return Ran(Ending(over_memory=memory, lost="" if memory else str(exc)), network=network)
        except BaseException:
            await asyncio.shield(self._drop(slot))
            raise
        network = await slot.network()
        # A slot whose sample left something behind that outlives it (it says so, or its
        # memory cgroup does) is not used again.
        if self._closed or reply.retire or not await slot.memory_clean():
            await self._drop(slot)
        else:
            self._idle.append(slot)
        return Ran(_ending(reply, slot.memory_killed()), reply.out, reply.err,
                   round(reply.rss_kb / 1024, 1) if reply.rss_kb else None, network=network,
                   fetched=dict(reply.fetched), note=reply.note if reply.status is not None else "")

    async def close(self) -> None:
        self._closed = True
        slots, self._idle = list(self._all), []
        self._all.clear()
        await asyncio.gather(*(s.close() for s in slots), return_exceptions=True)


@dataclass(frozen=True)
class Ran:
    """What a slot says of one sample: how it ended, its stdout and stderr as (head, tail,
    total bytes), its peak resident memory in MiB, with a way out its connections, the files
    it was asked to send back (by path) and words on them when they could not be."""

    ending: Ending
    out: tuple[bytes, bytes, int] = (b"", b"", 0)
    err: tuple[bytes, bytes, int] = (b"", b"", 0)
    rss_mb: float | None = None
    network: list[dict] | None = None
    fetched: dict[str, bytes] = field(default_factory=dict)
    note: str = ""


def _ending(reply: sample.Result, memory: bool) -> Ending:
    """How the sample's process ended, from the slot's result (its wait status)."""
    status = reply.status
    if status is None:
        return Ending(not_started=reply.note)
    if os.WIFSIGNALED(status):
        return Ending(signal=os.WTERMSIG(status), timed_out=reply.timed_out, killed=reply.killed, over_memory=memory)
    return Ending(code=os.WEXITSTATUS(status), timed_out=reply.timed_out, killed=reply.killed)


__all__ = ["Ran", "Slot", "SlotPool"]
