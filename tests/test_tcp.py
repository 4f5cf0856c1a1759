"""The TCP transport's door and gatekeeper, on real sockets: one connection in at a time, only
the expected CurveZMQ key, once."""

from __future__ import annotations

import asyncio

import zmq

from engine.launch import Guard
from engine.launch._tcp import Door, Gatekeeper


async def _greeted(port: int) -> bool:
    """Dial the door: True when ZeroMQ answers (its greeting), False when the connection is
    turned away (closed unread)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    try:
        return (await asyncio.wait_for(reader.read(1), 30)) == b"\xff"
    finally:
        writer.close()


async def test_the_door_lets_one_connection_in_at_a_time_and_none_once_the_worker_is_in():
    door = Door("127.0.0.1")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        door.bind(router)
        assert await _greeted(door.port)
        door.accepted(1000)  # (a number standing for the connection, as the monitor gives it)
        assert not await _greeted(door.port)  # turned away while one is in its handshake
        door.gone(1000)
        assert await _greeted(door.port)  # open again
        door.accepted(1001)
        door.admit()
        door.gone(1001)  # gone, but the worker was in: the door stays shut
        assert not await _greeted(door.port)
    finally:
        door.close()  # (before the ZeroMQ socket: it closes its descriptor as it left it)
        router.close(0)
        ctx.term()


async def test_only_the_expected_key_gets_in_and_only_once():
    ctx = zmq.Context()
    gatekeeper = Gatekeeper(ctx)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    guard = Guard(router, "127.0.0.1", gatekeeper, "w1")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    server, public, secret = guard.env.encode().split()
    peers = []

    def peer(public_key: bytes, secret_key: bytes) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.CURVE_SERVERKEY, server)
        s.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
        s.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
        s.connect(endpoint)
        peers.append(s)
        return s

    async def heard(payload: bytes) -> bool:
        for _ in range(40):  # up to 2 s, yielding to the loop (the gatekeeper answers on it)
            if router.poll(0):
                return router.recv_multipart()[1] == payload
            await asyncio.sleep(0.05)
        return False

    try:
        stranger_public, stranger_secret = zmq.curve_keypair()
        peer(stranger_public, stranger_secret).send(b"stranger")
        assert not await heard(b"stranger")
        peer(public, secret).send(b"worker")
        assert await heard(b"worker")
        peer(public, secret).send(b"again")  # the worker's key, a second time
        assert not await heard(b"again")
    finally:
        for s in peers:
            s.close(0)
        router.close(0)
        guard.close()
        gatekeeper.close()
        ctx.term()

