"""The TCP transport's door and gatekeeper, on real sockets: one connection in at a time, only
the expected CurveZMQ key, once."""

from __future__ import annotations

import asyncio
import socket

import zmq

from engine._tcp import Door, Gatekeeper, Guard


def _dial(port: int, timeout: float = 1.0) -> socket.socket | None:
    """A TCP connection to the door, or None when it went unanswered."""
    sock = socket.socket()
    sock.settimeout(timeout)
    try:
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def test_the_door_lets_one_connection_in_at_a_time_and_none_once_the_worker_is_in():
    door = Door("127.0.0.1")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        door.bind(router)
        first = socket.create_connection(("127.0.0.1", door.port), timeout=30)
        door.accepted(first.fileno())  # (the fd stands for the connection, as the monitor's would)
        assert _dial(door.port, 1.0) is None  # refused while one is in the handshake
        door.gone(first.fileno())
        second = socket.create_connection(("127.0.0.1", door.port), timeout=30)  # the door opened again
        door.accepted(second.fileno())
        door.admit()
        door.gone(second.fileno())  # even once it is gone: the worker was in
        assert _dial(door.port, 1.0) is None
        first.close()
        second.close()
    finally:
        router.close(0)
        ctx.term()
        door.close()


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

