"""The worker's side of the connection: handshake, then serve requests until shutdown.

Two event loops in two threads.  The *connection loop* (the main thread) owns the socket and
never runs user code, so it keeps receiving cancels, streaming output and answering host
calls even while user code blocks.  The *user loop* runs blocks that use ``await``; a block
without ``await`` gets a thread of its own.  A host function called synchronously from the
user loop therefore still gets its reply: the connection loop delivers it.

All sends go through one queue and one sender task, so a block's output always leaves before
its ``done`` and frames never interleave.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import threading
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from . import wire
from .capture import FdCapture, NoInput, Router, TextStream, inherit_block_in_threads
from .runtime import Runtime

HANDSHAKE_TIMEOUT = 15.0


class HostError(Exception):
    """A host function (tool, ``self``) failed or refused; the message says why."""


class Connection:
    """One DEALER socket to the coordinator with an ordered, bounded send queue."""

    def __init__(self, endpoint: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME)
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.connect(endpoint)
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)
        self._sender = self.loop.create_task(self._send_loop())
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count(1)

    async def send(self, msg: dict) -> None:
        await self._queue.put(wire.encode(msg))

    async def _send_loop(self) -> None:
        while True:
            frame = await self._queue.get()
            try:
                # copy=True always: the zero-copy path needs a new file descriptor, and user code
                # that used them all up must not cut the channel.
                await self.sock.send(frame, copy=True)
            except zmq.ZMQError as exc:
                os.write(2, f"agentloop worker: a frame was not sent: {exc}\n".encode())
            finally:
                self._queue.task_done()

    async def recv(self) -> dict | None:
        frame = await self.sock.recv(copy=True)
        try:
            return wire.decode(frame)
        except wire.WireError:
            return None

    async def drain(self) -> None:
        await asyncio.wait_for(self._queue.join(), timeout=10)

    # -- host calls (any thread) -----------------------------------------------------------
    def call(self, name: str, args: list, kwargs: dict, block: str | None) -> Future:
        """Ask the coordinator to run host function ``name``; a thread-safe future of its value."""
        cid = next(self._call_ids)
        future: Future = Future()
        self._calls[cid] = future
        msg = {"t": "call", "cid": cid, "name": name, "args": args, "kwargs": kwargs, "block": block}
        try:
            frame = wire.encode(msg)
        except (TypeError, ValueError) as exc:
            self._calls.pop(cid, None)
            future.set_exception(HostError(f"{name}(): arguments must be plain data "
                                           f"(str, numbers, lists, dicts, bytes, None): {exc}"))
            return future
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._queue.put(frame)))
        return future

    def resolve(self, msg: dict) -> None:
        future = self._calls.pop(msg.get("cid"), None)  # type: ignore[arg-type]
        if future is None or future.done():
            return
        if msg.get("ok"):
            future.set_result(msg.get("value"))
        else:
            future.set_exception(HostError(str(msg.get("error") or "host call failed")))

    def fail_calls(self, why: str) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(HostError(why))
        self._calls.clear()


def _start_user_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    threading.Thread(target=run, name="agentloop-user-loop", daemon=True).start()
    ready.wait(10)
    return loop


async def serve(endpoint: str, token: str) -> int:
    conn_loop = asyncio.get_running_loop()
    conn = Connection(endpoint)
    router = Router(conn_loop, conn.send)
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

    runtime = Runtime(conn_loop, _start_user_loop(), router, fdcap, on_done, conn.call)
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
            block_id = str(msg.get("id"))
            at_cancel = runtime.position(block_id)
            if runtime.cancel(block_id):
                conn_loop.create_task(_report_stuck(conn, runtime, block_id, at_cancel))
        elif kind == "reply":
            conn.resolve(msg)
        elif kind == "req":
            conn_loop.create_task(_answer(conn, runtime, msg))
        elif kind == "shutdown":
            await router.flush()
            await conn.send({"t": "bye"})
            await conn.drain()
            conn.sock.close(linger=2000)
            return 0


async def _report_stuck(conn: Connection, runtime: Runtime, block_id: str, at_cancel) -> None:
    if await runtime.stuck(block_id, at_cancel):
        await conn.send({"t": "stuck", "id": block_id})


async def _answer(conn: Connection, runtime: Runtime, msg: dict) -> None:
    """Answer a coordinator request (bind tools, export/inject a namespace, describe)."""
    rid = msg.get("rid")
    try:
        value: Any = await runtime.control(str(msg.get("op")), msg.get("args") or {})
        reply = {"t": "resp", "rid": rid, "ok": True, "value": value}
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator as words
        reply = {"t": "resp", "rid": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    await conn.send(reply)
