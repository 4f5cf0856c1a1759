"""One worker process and its socket: launch, handshake, reading, death.

A session is the part of a worker that a kill destroys.  It may sit in the engine's warm
pool, started and handshaken but owned by nobody, until a ``Worker`` takes it; then every
message goes to the owner.  Nothing a peer sends is trusted: frames are size-bounded and
decoded without unpickling, and only the peer that completed the handshake is heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import zmq
import zmq.asyncio

from worker import wire

from ._process import Process, spawn
from .errors import WorkerStartError
from .results import describe_exit

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("agentloop")
_ids = itertools.count(1)


class Owner(Protocol):
    name: str

    async def _dispatch(self, session: Session, msg: dict) -> None: ...

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
        self.sock: zmq.asyncio.Socket | None = None
        self.sock_dir: Path | None = None
        self._hello: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._reader: asyncio.Task | None = None
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
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
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
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def send(self, msg: dict) -> None:
        if self.peer is not None and self.sock is not None:
            await self.sock.send_multipart([self.peer, wire.encode(msg)])

    async def send_frame(self, frame: bytes) -> None:
        if self.peer is not None and self.sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self.sock.send_multipart([self.peer, frame])

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
                await self.send({"t": "shutdown"})
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
        await self.kill()

    async def discard(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        if self.sock is not None:
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

    async def _read_loop(self) -> None:
        sock = self.sock
        assert sock is not None
        while True:
            try:
                parts = await sock.recv_multipart(copy=True)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if len(parts) != 2:
                self.drop("not a [peer, payload] frame")
                continue
            ident, frame = parts
            try:
                msg = wire.decode(frame)
            except wire.WireError as exc:
                self.drop(str(exc))
                continue
            if self.peer is None:
                self._handshake(ident, msg)
            elif ident != self.peer:
                self.drop("sender is not this worker")
            elif self.owner is None:
                self.drop(f"{msg['t']!r} from an idle worker")
            else:
                try:
                    await self.owner._dispatch(self, msg)
                except Exception as exc:  # noqa: BLE001 - a hostile message must not kill the reader
                    self.drop(f"bad {msg.get('t')!r} message: {exc!r}")

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
        assert self.sock is not None
        self.sock.send_multipart([ident, wire.encode({"t": "welcome", "v": wire.PROTOCOL_VERSION})])
        if not self._hello.done():
            self._hello.set_result(msg)
