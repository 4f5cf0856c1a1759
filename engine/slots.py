"""Sample slots: sandboxes that run code samples one after another (``worker.slot``).

A slot is started by the run's fork server like a worker (its own PID, network and UTS
namespaces, cgroups, a socket directory only it sees) and then runs each sample it is given
in a process with mount, IPC and cgroup namespaces of its own, confined as a worker is, with
an empty ``/tmp``, ``/dev/shm`` and workspace, terminals of its own and a ``/proc`` of its
own processes; everything a sample started is killed and reaped before the next one begins.
What a sample costs is then a fork of a small interpreter and a few mounts, not the start of
a worker: the reason slots exist (``agentloop exec --jsonl``).

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
import json
import os
import secrets
import socket
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker import wire
from worker.slot import MAX_REQUEST

from .errors import EXIT_OWN, EXIT_TIMEOUT, WorkerStartError
from .sandbox import runtime_argv

if TYPE_CHECKING:
    from ._process import Process
    from .launcher import Launcher

#: An ``engine.samples.Sample`` (not imported: samples import this module).
Sample = Any
_ids = itertools.count(1)
_MAX_REPLY = 1024 * 1024  # a hello; a result: this, or more where it keeps more output
#: Seconds a slot may take past a sample's deadline and grace to answer (reaping what it left).
_SLACK = 10.0
#: Memory a slot's cgroup may still hold after a sample beyond what the slot held when it
#: started (its own heap grows a little), in bytes, or as a share of the memory limit when
#: that is more; and how long the kernel may take to free the rest (an IPC namespace's
#: segments go a moment after its last process).
_KEPT_BYTES, _KEPT_SHARE, _FREED_WITHIN = 32 * 2**20, 1 / 32, 1.0


class SlotError(Exception):
    """A slot broke, stopped answering or said something it may not: it is not used again."""


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
        """Fork the slot and wait for its hello; WorkerStartError (after cleaning up) if it fails."""
        try:
            await asyncio.wait_for(self._start(), self.launcher.start_timeout)
        except BaseException as exc:
            await asyncio.shield(self.close())
            if isinstance(exc, TimeoutError):
                raise WorkerStartError(f"a sample slot did not start within {self.launcher.start_timeout:g} s") from exc
            if isinstance(exc, SlotError):  # it died, or said something else, before its hello
                raise WorkerStartError(f"a sample slot did not start: {exc}") from exc
            raise

    async def _start(self) -> None:
        launcher = self.launcher
        endpoint, self.sock_dir = launcher.endpoint(self.number)
        path = endpoint[len("ipc://"):]
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(path)
            listener.listen(1)
            listener.setblocking(False)
            token = secrets.token_hex(16)
            # A uid of the slot's own: samples that run at once are in different slots, and
            # share no terminal, /proc entry, signal or per-user kernel quota through a uid.
            name = f"{launcher.workspace}#slot{self.number}"
            uid = launcher.own_uid(name)
            self.uid_name = name if uid is not None else None
            launch = launcher.launch(endpoint, self.sock_dir, token, uid=uid)
            os.chown(path, os.getuid(), os.getgid())  # the slot connects as the sandbox's root, not a worker uid
            os.chmod(path, 0o600)
            launch.env["AGENTLOOP_SLOT"] = json.dumps({
                "workspace": str(launcher.workspace), "tmp_bytes": launcher.sandbox.tmp_bytes,
                "grace": launcher.grace, "socket_dir": str(self.sock_dir), "outputs": str(launcher.output_dir),
                "private_net": not launcher.sandbox.network, "preload": list(launcher.preload),
                "endpoint": endpoint})  # (not in its command line, which every sample could read)
            zygote = launcher.fork_server(launch)
            if zygote is None:
                raise WorkerStartError("sample slots need the fork server (root and bubblewrap)")
            argv = runtime_argv(launcher.python, "worker.slot:main", packages=launcher.runtime_packages)
            self.proc = await zygote.spawn(launch, exec_argv=argv)
            conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)  # nobody else connects
        self._reader, self._writer = await asyncio.open_unix_connection(sock=conn)
        hello = await self._read()
        if hello.get("t") == "failed":
            raise WorkerStartError(f"a sample slot could not start: {str(hello.get('error'))[:500]}")
        if hello.get("t") != "hello" or not isinstance(hello.get("token"), str) or \
                not hmac.compare_digest(hello["token"].encode(), token.encode()):
            raise WorkerStartError("a sample slot did not say a valid hello")
        self.cgroups = await asyncio.to_thread(launcher.worker_groups, self.number)
        await asyncio.to_thread(launcher.adopt, self.cgroups, self.proc.pid, {})
        self.oom_kills = launcher.oom_kills(self.cgroups)
        self.memory_base = launcher.memory_held(self.cgroups)

    async def _read(self, limit: int = _MAX_REPLY) -> dict:
        assert self._reader is not None
        try:
            size = struct.unpack(">I", await self._reader.readexactly(4))[0]
            if size > limit:
                raise SlotError(f"it sent a {size}-byte message")
            return wire.decode(await self._reader.readexactly(size), limit)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise SlotError("it died") from exc
        except wire.WireError as exc:
            raise SlotError(f"it sent an undecodable message ({exc})") from exc

    async def run(self, sample: Sample, *, timeout: float, output_bytes: int, script_name: str) -> dict:
        """Run one sample; the slot's checked reply.  SlotError if the slot is not usable after."""
        assert self._writer is not None
        request = {"t": "run", "id": 1, "code": sample.code, "path": script_name,
                   "argv": [script_name, *sample.args], "stdin": sample.stdin,
                   "files": [list(f) for f in sample.files], "env": dict(sample.env),
                   "timeout": timeout, "keep": output_bytes}
        data = wire.encode(request)
        if len(data) > MAX_REQUEST:
            raise ValueError(f"the sample is {len(data)} bytes with its stdin and files; at most {MAX_REQUEST}")
        self._writer.write(struct.pack(">I", len(data)) + data)
        limit = timeout + self.launcher.grace + _SLACK
        try:
            # Two heads and two tails of ``output_bytes`` at most, and a few words.
            reply = await asyncio.wait_for(self._read(max(_MAX_REPLY, 4 * output_bytes + 65536)), limit)
        except TimeoutError as exc:
            raise SlotError(f"it did not answer within {limit:g} s") from exc
        return _checked(reply, output_bytes)

    async def memory_clean(self) -> bool:
        """Whether the slot's memory cgroup, now that its sample is gone, holds no more than
        the slot itself did (within ``_KEPT_BYTES``), waiting up to ``_FREED_WITHIN`` seconds
        for what the kernel frees late.  Memory the sample left charged there (a memfd in
        flight, say) would count against every later sample's limit."""
        if self.memory_base is None:
            return True
        limit = self.launcher.sandbox.memory_bytes
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


def _checked(reply: dict, keep: int) -> dict:
    """The reply if it is a well-formed result (SlotError if not)."""
    def parts(value) -> tuple[bytes, bytes, int]:
        if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], bytes)
                and isinstance(value[1], bytes) and isinstance(value[2], int)
                and len(value[0]) <= keep and len(value[1]) <= keep
                and value[2] >= len(value[0]) + len(value[1])):
            raise SlotError("it sent a malformed result")
        return value[0], value[1], value[2]

    if reply.get("t") != "result":
        raise SlotError(f"it sent {str(reply.get('t'))[:40]!r} instead of a result")
    status = reply.get("status")
    if status is not None and not isinstance(status, int):
        raise SlotError("it sent a malformed result")
    rss = reply.get("rss_kb")
    return {"status": status, "timed_out": reply.get("timed_out") is True, "killed": reply.get("killed") is True,
            "out": parts(reply.get("out")) if status is not None else (b"", b"", 0),
            "err": parts(reply.get("err")) if status is not None else (b"", b"", 0),
            "rss_kb": rss if isinstance(rss, int) and rss >= 0 else None,
            "note": reply.get("note") if isinstance(reply.get("note"), str) else "",
            "retire": reply.get("retire") is not False}


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

    async def run(self, sample: Sample, *, timeout: float, output_bytes: int, script_name: str) -> dict:
        """Run ``sample`` in a free slot: exactly one outcome, whatever the sample or the slot
        did — {status, code, words, out, err (head, tail, total), rss_mb}."""
        slot = await self._take()
        try:
            reply = await slot.run(sample, timeout=timeout, output_bytes=output_bytes, script_name=script_name)
        except SlotError as exc:
            memory = slot.memory_killed()
            await self._drop(slot)
            words = ("it went over its memory limit and its sandbox was killed" if memory
                     else f"its sandbox stopped: {exc}")
            return {"status": "killed" if memory else "died", "code": 137, "words": words,
                    "out": (b"", b"", 0), "err": (b"", b"", 0), "rss_mb": None}
        except BaseException:
            await asyncio.shield(self._drop(slot))
            raise
        # A slot whose sample left something behind that outlives it (it says so, or its
        # memory cgroup does) is not used again.
        if self._closed or reply["retire"] or not await slot.memory_clean():
            await self._drop(slot)
        else:
            self._idle.append(slot)
        status, code, words = _outcome(reply, timeout, slot.memory_killed(), self.launcher.sandbox.memory_bytes)
        return {"status": status, "code": code, "words": words, "out": reply["out"], "err": reply["err"],
                "rss_mb": round(reply["rss_kb"] / 1024, 1) if reply["rss_kb"] else None}

    async def close(self) -> None:
        self._closed = True
        slots, self._idle = list(self._all), []
        self._all.clear()
        await asyncio.gather(*(s.close() for s in slots), return_exceptions=True)


def _outcome(reply: dict, timeout: float, memory: bool, memory_bytes: int | None) -> tuple[str, int, str]:
    """(status, exit code, words) of a slot's result, as ``agentloop exec`` would give them."""
    status = reply["status"]
    if status is None:
        return "error", EXIT_OWN, f"it could not be started: {reply['note'][:500]}"
    if reply["timed_out"]:
        return "timeout", EXIT_TIMEOUT, f"its deadline ({timeout:g} s) passed" + (
            ", and it was killed: the interrupt did not stop it" if reply["killed"] else "")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if memory:
            limit = f" ({memory_bytes / 2**20:.0f} MiB)" if memory_bytes else ""
            return "killed", 128 + sig, f"it went over its memory limit{limit} and was killed"
        return "died", 128 + sig, f"it died of signal {sig}"
    code = os.WEXITSTATUS(status)
    return ("ok" if code == 0 else "error"), code, ""


__all__ = ["Slot", "SlotError", "SlotPool"]
