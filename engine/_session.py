"""One worker process and its socket: launch, handshake, reading, death.

A session is the part of a worker that a kill destroys.  It may sit in the engine's warm
pool, started and handshaken but owned by nobody, until a ``Worker`` takes it; then every
message goes to the owner.  Nothing a peer sends is trusted: frames are size-bounded and
decoded without unpickling, and only the peer that completed the handshake is heard.

The socket is a plain (blocking-API) ZeroMQ socket watched with ``loop.add_reader``:
messages are received and dispatched in the reader callback, and sends never wait (a
ROUTER drops rather than blocks at its high-water mark).  This costs about half of what
``zmq.asyncio``'s future per operation does on the round trip of a short block.  Its file
descriptor is edge-triggered, so after every send the socket is checked for messages that
the send may have taken the signal of.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import secrets
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import zmq

from worker import wire

from ._process import Process, spawn
from .errors import WorkerStartError
from .results import describe_exit

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("agentloop")
_ids = itertools.count(1)
# Plain ints: the enum members cost an enum construction per use on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_READ_BATCH = 64  # messages read per callback before other work gets a turn


class Owner(Protocol):
    name: str

    def _dispatch(self, session: Session, msg: dict) -> Awaitable[None] | None: ...

    async def _on_exit(self, session: Session, returncode: int) -> None: ...


class Session:
    """A started worker process: socket, process, handshake, reader and death watch."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.number = next(_ids)
        self.token = secrets.token_hex(16)
        self.owner: Owner | None = None
        self.peer: bytes | None = None
        self.proc: Process | None = None
        self.notes: list[str] = []
        self.killing = False
        self.dropped = 0
        self.sock: zmq.Socket | None = None
        self.sock_dir: Path | None = None
        self._loop = asyncio.get_running_loop()
        self._hello: asyncio.Future[dict] = self._loop.create_future()
        self._reading = False
        self._paused: asyncio.Task | None = None  # the owner's backpressure: reading waits for it
        self._watcher: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.owner.name if self.owner else f"pool-{self.number}"

    @classmethod
    async def start(cls, engine: Engine) -> Session:
        """Launch a worker process and wait for its handshake; WorkerStartError if it fails.
        Cancelled half-way, it leaves nothing running."""
        session = cls(engine)
        try:
            await session._start()
        except asyncio.CancelledError:
            await asyncio.shield(session.kill())
            raise
        return session

    async def _start(self) -> None:
        engine = self.engine
        endpoint, self.sock_dir = engine._endpoint(self.number)
        sock = self.sock = engine._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME)
        sock.setsockopt(zmq.RCVHWM, 64)
        sock.bind(endpoint)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if engine.connect_host and endpoint.startswith("tcp://"):
            endpoint = f"tcp://{engine.connect_host}:{endpoint.rsplit(':', 1)[1]}"
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._readable)
        self._reading = True
        launch = engine._launch(endpoint, self.sock_dir, self.token)
        self.notes = launch.notes
        pid_ns = launch.pid_namespace
        try:
            zygote = await engine._fork_server(launch)
            if zygote is not None:
                self.proc = await zygote.spawn(launch)
            else:
                self.proc = await spawn(launch.argv, env=launch.env, cwd=launch.cwd, pid_namespace=pid_ns)
        except OSError as exc:
            await self.discard()
            raise WorkerStartError(f"could not start a worker ({launch.argv[0]}): {exc}") from exc
        exited = asyncio.ensure_future(self.proc.wait())
        try:
            done, _ = await asyncio.wait({self._hello, exited}, timeout=engine.start_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if self._hello not in done or self._hello.exception():
            await self.proc.kill()  # waits for the exit status too, wherever it comes from
            await self.discard()
            said = self.proc.stderr_tail.decode("utf-8", "replace").strip()
            if self._hello.done() and self._hello.exception():
                reason = str(self._hello.exception())
            elif self.proc.returncode is not None:
                reason = describe_exit(self.proc.returncode, via_namespace=pid_ns)[0]
            else:
                reason = f"no handshake within {engine.start_timeout:.0f} s"
            raise WorkerStartError(f"worker failed to start: {reason}" + (f"\n{said}" if said else ""))
        self._watcher = self._loop.create_task(self._watch())

    def send(self, msg: dict) -> None:
        self.send_frame(wire.encode(msg))

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
        if self._watcher is not None:
            self._watcher.cancel()
        await self.discard()

    async def shutdown(self, timeout: float = 2.0) -> None:
        """Ask the worker to exit, then kill whatever did not."""
        if self.proc is not None and self.proc.returncode is None and self.peer is not None:
            with contextlib.suppress(Exception):
                self.send({"t": "shutdown"})
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
        await self.kill()

    async def discard(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._paused
            self._paused = None
        if self.sock is not None:
            if self._reading:
                self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
                self._reading = False
            self.sock.close(linger=0)
            self.sock = None
        if self.sock_dir is not None:
            self.engine._release_endpoint(self.sock_dir)
            self.sock_dir = None

    async def _watch(self) -> None:
        assert self.proc is not None
        rc = await self.proc.wait()
        if self.killing:
            return
        if self.owner is not None:
            await self.owner._on_exit(self, rc)
        else:
            log.info("idle worker %s exited (%s)", self.name, describe_exit(rc, via_namespace=True)[0])
            self.engine._pool_lost(self)
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
        for _ in range(_READ_BATCH):
            sock = self.sock
            if sock is None or self._paused is not None:
                return
            try:
                if not sock.getsockopt(_EVENTS) & _POLLIN:
                    return
                parts = sock.recv_multipart(_NOBLOCK, copy=True)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us
                return
            pending = self._receive(parts)
            if pending is not None:
                self._paused = self._loop.create_task(self._resume_after(pending))
                return
        self._loop.call_soon(self._readable)  # more may wait; let other callbacks run first

    async def _resume_after(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception as exc:  # noqa: BLE001 - a hostile message must not stop the reading
            self.drop(f"bad message: {exc!r}")
        finally:
            self._paused = None
        self._readable()

    def _receive(self, parts: list[bytes]) -> Awaitable[None] | None:
        if len(parts) != 2:
            self.drop("not a [peer, payload] frame")
            return None
        ident, frame = parts
        try:
            msg = wire.decode(frame)
        except wire.WireError as exc:
            self.drop(str(exc))
            return None
        if self.peer is None:
            self._handshake(ident, msg)
        elif ident != self.peer:
            self.drop("sender is not this worker")
        elif self.owner is None:
            self.drop(f"{msg['t']!r} from an idle worker")
        else:
            try:
                return self.owner._dispatch(self, msg)
            except Exception as exc:  # noqa: BLE001 - a hostile message must not stop the reading
                self.drop(f"bad {msg.get('t')!r} message: {exc!r}")
        return None

    def _handshake(self, ident: bytes, msg: dict) -> None:
        token = msg.get("token")
        if msg.get("t") != "hello" or not isinstance(token, str) or \
                not hmac.compare_digest(token.encode(), self.token.encode()):
            self.drop("not a valid hello")
            return
        if msg.get("v") != wire.PROTOCOL_VERSION:
            if not self._hello.done():
                self._hello.set_exception(WorkerStartError(
                    f"worker speaks protocol {msg.get('v')!r}, coordinator {wire.PROTOCOL_VERSION}: "
                    "reinstall agentloop so both sides match"))
            return
        self.peer = ident
        self.send({"t": "welcome", "v": wire.PROTOCOL_VERSION})
        if not self._hello.done():
            self._hello.set_result(msg)
