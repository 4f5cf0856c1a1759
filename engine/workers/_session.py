"""One worker process and its socket: launch, handshake, reading, death.

A session is the part of a worker that a kill destroys.  It may sit in the engine's warm
pool, started and handshaken but owned by nobody, until a ``Worker`` takes it; then every
message goes to the owner.  Nothing a peer sends is trusted: frames are size-bounded and
decoded without unpickling, and only the peer that completed the handshake is heard.

The handshaken peer that breaks the protocol (a message of several frames, a frame that
does not decode, a malformed or unknown message, or a connection cut by ZeroMQ itself for an
oversized frame or bytes that are not ZeroMQ) is not argued with: the session stops reading
it and has it killed at once (``Owner.broken``), so no block waits for its deadline on a
worker that cannot talk any more.  Frames of any other sender are dropped.  Messages are
received frame by frame, so a message of a million frames is never held as a list.

The socket is a plain (blocking-API) ZeroMQ socket watched with ``loop.add_reader``:
messages are received and dispatched in the reader callback, and sends never wait (a
ROUTER drops rather than blocks at its high-water mark).  This costs about half of what
``zmq.asyncio``'s future per operation does on the round trip of a short block.  Its file
descriptor is edge-triggered, so after every send the socket is checked for messages that
the send may have taken the signal of.

A local worker's output comes through its output pipes instead (``engine.launch``), which
outlive it: a flushed ``print`` or a subprocess's output is in the kernel before the worker
can die.  Order across the two is kept where it matters: before a message from the socket is
dispatched, every output frame that waits in ``out`` is (the worker writes a block's output
before it sends the block's ``done``); if that output must wait for a slow consumer, the
message waits with it.  After the death, ``settle`` reads ``out`` to its end, and
``leftovers`` what fd 1 and 2 still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from engine.errors import OutputError, WorkerStartError
from engine.launch import Guard, OutputPipes, Process, grant_socket, start_fork
from engine.results import describe_exit
from worker.contract import wire
from worker.contract.framing import FrameError, encode
from worker.contract.limits import MAX_FRAME
from worker.contract.schema import ContractError

if TYPE_CHECKING:
    from engine.launch import Launcher

log = logging.getLogger("agentloop")
_ids = itertools.count(1)
# Plain ints: the enum members cost an enum construction per use on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_RCVMORE, _DISCONNECTED = int(zmq.RCVMORE), int(zmq.EVENT_DISCONNECTED)
_READ_BATCH = 64  # messages read per callback before other work gets a turn
_DRAIN_BATCH = 1024  # frames of a stranger's multi-frame message discarded per turn
_AFTER_DEATH = 4 * 1024 * 1024  # bytes of ``out`` read once the worker is dead, at most (it holds 512 KiB)
_LEFTOVER_BYTES = 4 * 1024 * 1024  # bytes of each of fd 1 and 2 read then, at most
MAX_HELLO = 4096  # a stranger's frame is decoded only this far before it is dropped


@dataclass(frozen=True)
class Owner:
    """Who a session's events go to: the ``Worker`` that took it, as callbacks handed down (a
    session never calls up into its owner otherwise).  ``message``: a parsed message from the
    process, returning an awaitable when the consumer is behind (reading waits for it);
    ``exited``: the process died on its own, with its status; ``broken``: it broke the
    protocol, in words."""

    name: str
    message: Callable[[Session, wire.Message], Awaitable[None] | None]
    exited: Callable[[Session, int], Awaitable[None]]
    broken: Callable[[Session, str], Awaitable[None]]


class Session:
    """A started worker process: socket, process, handshake, reader and death watch."""

    def __init__(self, launcher: Launcher, *, on_lost: Callable[[Session], None] | None = None) -> None:
        self.launcher = launcher
        self.number = next(_ids)
        self.token = secrets.token_hex(16)
        self.owner: Owner | None = None
        # Told when the process of a session nobody owns (an idle one) dies or is killed.
        self._on_lost = on_lost
        self.peer: bytes | None = None
        self.proc: Process | None = None
        self.notes: list[str] = []
        self.killing = False
        self.broken: str | None = None  # how the peer broke the protocol, once it has
        self.dropped = 0
        self.sock: zmq.Socket | None = None
        self.sock_dir: Path | None = None
        self.endpoint = ""  # where a fork's copy dials (``fork_of``)
        #: The socket directory its process sees (its own; a fork's, its first ancestor's).
        self.seen_dir: Path | None = None
        self.pipes: OutputPipes | None = None  # a local worker's output pipes
        self.guard: Guard | None = None  # over TCP: what lets this worker in and nobody else
        self._out_watched = False
        # The message that waits for the output written before it (at most one: the reading
        # stops while it waits).
        self._held: wire.Message | None = None
        self.cgroups: list[Path] = []  # its memory and process-count cgroups, where the run has them
        self._loop = asyncio.get_running_loop()
        self._hello: asyncio.Future[wire.Hello] = self._loop.create_future()
        self._reading = False
        self._paused: asyncio.Task | None = None  # the owner's backpressure: reading waits for it
        self._watcher: asyncio.Task | None = None
        self._monitor: zmq.Socket | None = None  # the socket's connection events
        self._peer_fd: int | None = None  # the peer's connection, to tell its disconnection
        self._gone = asyncio.Event()  # the peer's connection was seen closed
        self._draining = False  # the rest of a stranger's multi-frame message waits to be discarded
        self._tasks: set[asyncio.Task] = set()  # ending a broken or disconnected peer

    @property
    def name(self) -> str:
        return self.owner.name if self.owner else f"pool-{self.number}"

    @classmethod
    async def start(cls, launcher: Launcher, *, on_lost: Callable[[Session], None] | None = None) -> Session:
        """Launch a worker process and wait for its handshake; WorkerStartError if it fails.
        Cancelled half-way, it leaves nothing running.  ``on_lost``: told if the process dies
        or is killed while no ``Worker`` owns the session (an idle one of the warm pool)."""
        session = cls(launcher, on_lost=on_lost)
        try:
            await session._start()
        except asyncio.CancelledError:
            await asyncio.shield(session.kill())
            raise
        return session

    async def _start(self) -> None:
        launcher = self.launcher
        endpoint, self.sock_dir = launcher.endpoint(self.number)
        self.seen_dir = self.sock_dir
        try:
            self.pipes = launcher.output_pipes(self.sock_dir)
        except OSError as exc:
            await self.discard()
            raise WorkerStartError(f"could not make a worker's output pipes: {exc}") from exc
        self._watch_out(True)
        endpoint = self._listen(endpoint)
        launch = launcher.launch(endpoint, self.sock_dir, self.token, output=self.pipes is not None, guard=self.guard)
        self.notes = launch.notes
        try:
            self.proc, self.cgroups, _ = await launcher.start_process(launch, self.number, self._hello, "worker")
        except BaseException:
            await asyncio.shield(self.discard())
            raise
        self._watcher = self._loop.create_task(self._watch())

    @classmethod
    def fork_of(cls, parent: Session) -> Session:
        """A session for one fork of ``parent``'s process, listening where that process can
        dial (a socket beside its own: the sandbox shows it that directory): ``endpoint`` and
        ``token`` go into the ``fork`` request, then ``adopt`` takes the process.  Its output
        comes over the socket (the copy cannot open output pipes: its sandbox is already up)."""
        seen = parent.seen_dir
        if seen is None or parent.proc is None or parent.launcher.settings.transport != "ipc":
            raise WorkerStartError("only a local worker (the ipc transport) can be forked: a copy dials a "
                                   "socket beside its parent's")
        session = cls(parent.launcher)
        session.seen_dir = seen
        session.endpoint = session._listen(f"ipc://{seen}/f{session.number}")
        grant_socket(parent.launcher, seen, session.endpoint)
        return session

    async def adopt(self, parent: Session, pid: int) -> None:
        """Take the fork ``pid`` (as ``parent``'s process numbers it) once it was made, and
        wait for its hello; WorkerStartError (its process killed) if it does not come."""
        assert parent.proc is not None
        try:
            self.proc, self.cgroups, _ = await start_fork(self.launcher, parent.proc, pid, self.number, self._hello)
        except BaseException:
            await asyncio.shield(self.discard())
            raise
        self._watcher = self._loop.create_task(self._watch())

    def _listen(self, endpoint: str) -> str:
        """Bind the session's socket to ``endpoint`` and watch it; the address its process dials."""
        launcher = self.launcher
        sock = self.sock = launcher.socket()
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        sock.setsockopt(zmq.RCVHWM, 4)  # with MAX_FRAME: what a worker can make us hold unread
        endpoint, self.guard = launcher.bind(sock, endpoint, self.number)
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._readable)
        self._reading = True
        # A peer whose frame ZeroMQ refuses (over MAXMSGSIZE, or bytes that are not ZMTP) is
        # disconnected by ZeroMQ itself and reconnects under a new identity; only this event
        # tells us.  Over TCP the guard's door follows the connections too.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | (self.guard.EVENTS if self.guard else 0))
        self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._monitor_readable)
        self._monitor_readable()  # ZeroMQ signals only a reader that found the queue empty
        return endpoint

    def send(self, msg: wire.Message) -> None:
        self.send_frame(encode(msg))

    def send_frame(self, frame: bytes) -> None:
        """Send now (never waits); a frame the worker's queue has no room for is dropped."""
        sock = self.sock
        if self.peer is None or sock is None:
            return
        try:
            sock.send_multipart([self.peer, frame], _NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("worker %s: a frame was not sent: %s", self.name, exc)
        self._recheck()

    async def kill(self) -> None:
        """Kill the process tree and release the socket.  Idempotent."""
        self.killing = True
        if self.proc is not None:
            await self.proc.kill()
        # Not the watcher itself (a death it reported ends in this kill): cancelling it would
        # cut the rest of this kill, and of its owner's clean-up, at their next await.
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        await self.discard()

    async def shutdown(self, timeout: float = 2.0) -> None:
        """Ask the worker to exit, then kill whatever did not."""
        if self.proc is not None and self.proc.returncode is None and self.peer is not None:
            with contextlib.suppress(Exception):
                self.send(wire.Shutdown())
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
        await self.kill()

    async def discard(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._paused
            self._paused = None
        if self._monitor is not None:
            self._loop.remove_reader(self._monitor.getsockopt(zmq.FD))
            if self.sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self.sock is not None:
            if self._reading:
                self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
                self._reading = False
            self.sock.close(linger=0)
            self.sock = None
        if self.pipes is not None:
            self._watch_out(False)
            self.pipes.close()
            self.pipes = None
        self._held = None
        groups, self.cgroups, sock_dir, self.sock_dir = self.cgroups, [], self.sock_dir, None
        await self.launcher.release(groups, sock_dir)

    def over_memory_limit(self) -> bool:
        """Whether the kernel killed a process of this worker for its memory cgroup's limit."""
        return bool(self.cgroups) and self.launcher.memory_exceeded(self.cgroups)

    async def _watch(self) -> None:
        assert self.proc is not None
        rc = await self.proc.wait()
        if self.killing:
            return
        if self.owner is not None:
            await self.owner.exited(self, rc)
        else:
            log.info("idle worker %s exited (%s)", self.name, describe_exit(rc, via_namespace=True)[0])
            if self._on_lost is not None:
                self._on_lost(self)
            self.killing = True
            await self.kill()

    # -- receiving ----------------------------------------------------------------------------
    def drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped <= 10 or self.dropped % 1000 == 0:
            log.warning("worker %s: dropped a frame (%s); %d so far", self.name, why, self.dropped)

    def _recheck(self) -> None:
        """Any operation on the socket may take the signal of a message that arrived: look
        again soon if one waits."""
        sock = self.sock
        if sock is not None and self._paused is None:
            with contextlib.suppress(zmq.ZMQError):
                if sock.getsockopt(_EVENTS) & _POLLIN:
                    self._loop.call_soon(self._readable)

    def _readable(self) -> None:
        """Receive and dispatch what waits, a batch at a time."""
        if not self._catch_up():
            return
        for _ in range(_READ_BATCH):
            sock = self.sock
            if sock is None or self._paused is not None or self.broken is not None:
                return
            try:
                if self._draining:
                    self._drain(sock)
                    continue
                if not sock.getsockopt(_EVENTS) & _POLLIN:
                    return
                # Frame by frame: a ROUTER puts the sender's identity first, then what it sent.
                ident = sock.recv(_NOBLOCK)
                if not sock.getsockopt(_RCVMORE):
                    self.drop("a message without a payload")
                    continue
                # The handshake needs the frame's connection (SRCFD); later a plain copy is cheaper.
                frame: bytes | zmq.Frame = sock.recv(_NOBLOCK, copy=self.peer is not None)
                more = sock.getsockopt(_RCVMORE)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us
                return
            if more:
                self._draining = True
                self._reject(ident, "it sent a message of more than one frame")
                continue
            pending = self._receive(ident, frame)
            if pending is not None:
                self._pause(pending)
                return
        self._loop.call_soon(self._readable)  # more may wait; let other callbacks run first

    def _pause(self, pending: Awaitable[None]) -> None:
        """The owner's consumer is behind: read nothing (socket or pipe) until ``pending`` is done."""
        self._paused = self._loop.create_task(self._resume_after(pending))
        self._watch_out(False)

    # -- the output pipe ----------------------------------------------------------------------
    def _watch_out(self, on: bool) -> None:
        pipes = self.pipes
        if pipes is None or on == self._out_watched or (on and pipes.ended):
            return
        if on:
            self._loop.add_reader(pipes.out, self._out_readable)
        else:
            self._loop.remove_reader(pipes.out)
        self._out_watched = on

    def _out_readable(self) -> None:
        pipes = self.pipes
        if pipes is None or self._paused is not None or self.broken is not None:
            self._watch_out(False)  # a pause or a broken worker: reading resumes, or never
            return
        pipes.read(pipes.capacity, probe=True)
        self._dispatch_out()
        if pipes.ended:
            self._watch_out(False)  # no writer left: the end of the file is readable for ever

    def _drain_out(self) -> bool:
        """Dispatch every output frame that waits in ``out`` now (reading as much as the pipe
        holds: what was written before anything else arrived); False when that paused the
        reading or the worker broke the protocol."""
        if self.pipes is not None:
            self.pipes.read(self.pipes.capacity)
        return self._dispatch_out()

    def _dispatch_out(self) -> bool:
        """Dispatch the whole messages read from ``out``; False when one paused the reading
        or the worker broke the protocol."""
        while self._paused is None and self.broken is None:
            if self.pipes is None:
                return True
            try:
                msg = self.pipes.next()
            except OutputError as exc:
                self.violation(str(exc))
                return False
            if msg is None:
                return True
            pending = self._deliver(msg)
            if pending is not None:
                self._pause(pending)
        return False

    def _catch_up(self) -> bool:
        """What a pause held back, in order: output frames already read, then the held
        messages, each after the output written before it.  False while paused or broken."""
        if not self._dispatch_out():
            return False
        if self._held is not None:
            if not self._drain_out():
                return False
            held, self._held = self._held, None
            pending = self._deliver(held)
            if pending is not None:
                self._pause(pending)
                return False
        self._watch_out(True)
        return True

    def leftovers(self) -> list[tuple[int, bytes]]:
        """After the process died (and ``settle``): what its fd 1 and 2 held that its pump had
        not sent, as (stream, bytes), for the owner to give to the block the worker would have
        given it to (the first started of those running)."""
        if self.pipes is None or self.broken is not None:
            return []
        return self.pipes.leftovers(_LEFTOVER_BYTES)

    async def settle(self, timeout: float) -> None:
        """After the process died: wait (at most ``timeout`` s) until its connection is seen
        closed, which ZeroMQ reports once it has read all the process sent, then dispatch what
        waits.  So output sent just before a death (``os._exit``, a kill) still reaches its block."""
        if self._peer_fd is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gone.wait(), timeout)
        budget = _AFTER_DEATH
        for _ in range(100_000):  # bounded: what a dead peer can have left is finite anyway
            if self._paused is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._paused)
                continue
            sock = self.sock
            if sock is None or self.broken is not None:
                return
            if not self._catch_up():
                continue
            try:
                waiting = sock.getsockopt(_EVENTS) & _POLLIN
            except zmq.ZMQError:
                return
            if waiting:
                self._readable()
                continue
            # The socket is empty: what the worker wrote to ``out`` after its last message.
            pipes = self.pipes
            if pipes is None or pipes.ended or budget <= 0:
                return
            got = pipes.read(min(pipes.capacity, budget), probe=True)
            budget -= got
            self._dispatch_out()
            if not got and not pipes.ended:
                return  # nothing more now (a process it forked may hold the pipe open)

    def _drain(self, sock: zmq.Socket) -> None:
        """Discard the next frames of a multi-frame message (they are already in memory)."""
        for _ in range(_DRAIN_BATCH):
            sock.recv(_NOBLOCK, copy=False)
            if not sock.getsockopt(_RCVMORE):
                self._draining = False
                return

    async def _resume_after(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception as exc:  # noqa: BLE001 - a hostile message must not stop the reading
            self.drop(f"bad message: {exc!r}")
        finally:
            self._paused = None
        self._readable()

    def _reject(self, ident: bytes, why: str) -> None:
        """A frame that breaks the protocol: the end of the peer, or a stranger's frame dropped."""
        if self.peer is not None and ident == self.peer:
            self.violation(why)
        else:
            self.drop(why)

    def _receive(self, ident: bytes, frame: bytes | zmq.Frame) -> Awaitable[None] | None:
        fd = None
        if isinstance(frame, zmq.Frame):
            with contextlib.suppress(zmq.ZMQError):
                fd = frame.get(zmq.SRCFD)
            frame = frame.bytes
        if self.peer is None:
            self._handshake(ident, frame, fd)
            return None
        if ident != self.peer:
            self.drop("sender is not this worker")
            return None
        try:
            msg = wire.decode_message(frame, wire.TO_COORDINATOR)
        except FrameError as exc:
            self.violation(str(exc))
            return None
        except ContractError as exc:
            self.violation(f"it sent a malformed message: {exc}")
            return None
        if self.owner is None:
            self.drop(f"{msg.kind!r} from an idle worker")
        elif self.pipes is not None and not self._drain_out():
            self._held = msg  # after the output before it, once the reading resumes
        else:
            return self._deliver(msg)
        return None

    def _deliver(self, msg: wire.Message) -> Awaitable[None] | None:
        if self.owner is None:
            self.drop(f"{msg.kind!r} from an idle worker")
            return None
        try:
            return self.owner.message(self, msg)
        except Exception as exc:  # noqa: BLE001 - a bug must not stop the reading
            self.violation(f"its {msg.kind!r} message could not be handled ({type(exc).__name__}: {exc})")
        return None

    def violation(self, why: str) -> None:
        """The handshaken peer broke the protocol: read nothing more from it, and have it
        killed now (by its owner, which ends its blocks saying so).  Idempotent."""
        if self.broken is not None or self.killing:
            return
        self.broken = why
        self._watch_out(False)
        log.warning("worker %s broke the protocol (%s); stopping it", self.name, why)
        self._spawn(self._end_broken(why))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = self._loop.create_task(work)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end_broken(self, why: str) -> None:
        if self.owner is not None:
            await self.owner.broken(self, why)
        else:
            if self._on_lost is not None:
                self._on_lost(self)
            await self.kill()

    def _monitor_readable(self) -> None:
        """Connection events: the peer's connection dropped while its process lives on."""
        monitor = self._monitor
        while monitor is not None and monitor is self._monitor:
            try:
                if not monitor.getsockopt(_EVENTS) & _POLLIN:
                    return
                event = monitor.recv_multipart(_NOBLOCK)
            except zmq.ZMQError:
                return
            kind, value = struct.unpack("=HI", event[0][:6])
            if self.guard is not None:
                self.guard.follow(kind, value)
            if kind == _DISCONNECTED and self._peer_fd is not None and value == self._peer_fd:
                self._peer_fd = None
                self._gone.set()
                self._spawn(self._disconnected())

    async def _disconnected(self) -> None:
        # A worker that dies drops its connection too, often a moment before its exit is seen:
        # give the death watch the time to report it with its cause first.
        if self.proc is not None and not self.killing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), self.launcher.settings.grace)
        if self.proc is not None and self.proc.returncode is None:
            self.violation("its connection was cut: a frame over the size limit, bytes that are not "
                           "ZeroMQ, or its socket closed")

    def _close_door(self) -> None:
        """Once the worker is in, nobody else comes in: the ipc:// socket's file goes (a TCP
        guard's door shuts), so every connection a worker could add (each with queues of its
        own, which ZeroMQ fills before anything is read) is refused.  The connection made stays."""
        if self.guard is not None:
            self.guard.door.admit()
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if self.sock is not None else ""
        if endpoint.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(endpoint[len("ipc://"):])
        if self.pipes is not None:
            self.pipes.unlink()  # opened by the worker before its hello: no one opens them again

    def _handshake(self, ident: bytes, frame: bytes, fd: int | None) -> None:
        try:
            msg = wire.decode_message(frame, wire.TO_COORDINATOR, MAX_HELLO)
        except (ContractError, FrameError):
            self.drop("not a valid hello")
            return
        if not isinstance(msg, wire.Hello) or not hmac.compare_digest(msg.token.encode(), self.token.encode()):
            self.drop("not a valid hello")
            return
        if msg.v != wire.PROTOCOL_VERSION:
            if not self._hello.done():
                self._hello.set_exception(WorkerStartError(
                    f"worker speaks protocol {msg.v!r}, coordinator {wire.PROTOCOL_VERSION}: "
                    "reinstall agentloop so both sides match"))
            return
        self.peer = ident
        self._peer_fd = fd
        self._close_door()
        self.send(wire.Welcome())
        if not self._hello.done():
            self._hello.set_result(msg)
