"""The worker's side of the connection: handshake, then serve requests until shutdown.

All sends go through one queue and one sender task, so a block's output always leaves
before its ``done`` and frames never interleave.
"""

from __future__ import annotations

import asyncio
import os
import sys

import zmq
import zmq.asyncio

from . import wire
from .capture import FdCapture, NoInput, Router, TextStream, inherit_block_in_threads
from .runtime import Runtime

HANDSHAKE_TIMEOUT = 15.0


class Connection:
    """One DEALER socket to the coordinator with an ordered, bounded send queue."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME)
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.connect(endpoint)
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)
        self._sender = asyncio.get_running_loop().create_task(self._send_loop())

    async def send(self, msg: dict) -> None:
        await self._queue.put(wire.encode(msg))

    async def _send_loop(self) -> None:
        while True:
            frame = await self._queue.get()
            await self.sock.send(frame, copy=len(frame) < 65536)
            self._queue.task_done()

    async def recv(self) -> dict | None:
        frame = await self.sock.recv(copy=True)
        try:
            return wire.decode(frame)
        except wire.WireError:
            return None

    async def drain(self) -> None:
        await asyncio.wait_for(self._queue.join(), timeout=10)


async def serve(endpoint: str, token: str) -> int:
    loop = asyncio.get_running_loop()
    conn = Connection(endpoint)
    router = Router(loop, conn.send)
    fdcap = FdCapture(router)
    inherit_block_in_threads()
    sys.stdout = TextStream(router, wire.STDOUT)
    sys.stderr = TextStream(router, wire.STDERR)
    sys.stdin = NoInput()

    await conn.send({"t": "hello", "v": wire.PROTOCOL_VERSION, "token": token, "pid": os.getpid()})
    try:
        welcome = await asyncio.wait_for(conn.recv(), HANDSHAKE_TIMEOUT)
    except TimeoutError:
        os.write(fdcap.diag_fd, b"agentloop worker: no welcome from the coordinator\n")
        return 3
    if not welcome or welcome.get("t") != "welcome" or welcome.get("v") != wire.PROTOCOL_VERSION:
        os.write(fdcap.diag_fd, b"agentloop worker: handshake refused (protocol version?)\n")
        return 4

    async def on_done(block_id: str, status: str, error: str) -> None:
        await conn.send({"t": "done", "id": block_id, "status": status, "error": error,
                         "vars": runtime.user_vars()})

    runtime = Runtime(loop, router, fdcap, on_done)
    while True:
        msg = await conn.recv()
        if msg is None:
            continue
        kind = msg["t"]
        if kind == "run":
            block_id, code = msg.get("id"), msg.get("code")
            if isinstance(block_id, str) and isinstance(code, str):
                runtime.start(block_id, code)
        elif kind == "cancel":
            runtime.cancel(str(msg.get("id")))
        elif kind == "shutdown":
            await router.flush()
            await conn.send({"t": "bye"})
            await conn.drain()
            conn.sock.close(linger=2000)
            return 0
