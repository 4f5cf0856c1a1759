"""The TCP transport's guard: one connection per worker, authenticated before anything is
buffered, every other one refused.

Anyone who can reach a TCP port can connect to it, and ZeroMQ buffers whatever a connected
peer sends (up to ``MAXMSGSIZE`` a message, ``RCVHWM`` messages a connection) before the
coordinator reads a byte.  So a worker's socket is guarded three ways:

- **CurveZMQ.**  Each worker gets a key pair of its own and its socket's server key (in its
  environment, as its token).  ZeroMQ takes no message from a peer before the CURVE handshake,
  and the ZAP handler (``Gatekeeper``) lets in that worker's key alone, once.  Everything on
  the wire is encrypted and authenticated too: a worker may be on another machine.
- **A door.**  A handshake message may itself be as large as ``MAXMSGSIZE``, and ZeroMQ reads
  it before the handshake can fail.  So ZeroMQ binds to a listening socket of ours
  (``ZMQ_USE_FD``) that lets one connection in at a time: once one is accepted, and until it
  has gone (its handshake failed) or for good once the worker is in, ZeroMQ's descriptor is
  pointed at a listener nobody can reach, and the coordinator itself accepts and closes
  whatever comes meanwhile (``Door``).  Strangers then cost one handshake in flight, not one
  per connection.  (A socket filter dropping SYNs would do it without the accepts, but Linux
  6.x allows one on a TCP socket only with CAP_NET_ADMIN.)
- **A short handshake** (``HANDSHAKE_IVL``): a stranger who sits in the door is cut off.
"""

from __future__ import annotations

import asyncio
import os
import socket

import zmq
from zmq.utils import z85

from engine.errors import ConfigError

#: How long a connection may take to complete its handshake before it is cut (ms).
HANDSHAKE_MS = 3000
#: The ZAP endpoint ZeroMQ asks (fixed by the ZAP specification).
_ZAP = "inproc://zeromq.zap.01"
_IP_FREEBIND = 15
_UNREACHABLE = ("192.0.2.1", 0)  # TEST-NET-1: never a local address, never routed back here
_inert: socket.socket | None = None


def _inert_listener() -> socket.socket:
    """A listening socket nobody can connect to (bound, by IP_FREEBIND, to an address this
    host does not have): ``accept`` on it always says EAGAIN.  One for the process."""
    global _inert
    if _inert is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IP, _IP_FREEBIND, 1)
        sock.bind(_UNREACHABLE)
        sock.listen(1)
        sock.setblocking(False)
        _inert = sock
    return _inert


class Door:
    """The listening socket of one worker's ZeroMQ socket, letting in one connection at a time
    (see the module docstring).  ``accepted``, ``gone`` and ``admit`` follow the ZeroMQ
    socket's connection events and the worker's handshake; ``close`` before the ZeroMQ socket
    is closed (which must find its own descriptor as it left it)."""

    def __init__(self, host: str) -> None:
        host = "0.0.0.0" if host == "*" else host.strip("[]")
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
            self._sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host!r} for workers over TCP: {exc}") from exc
        try:
            self._sock.bind(address)
            self._sock.listen(16)
            self._sock.setblocking(False)
            self._inert = _inert_listener()
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"cannot listen on {host!r} for workers over TCP: {exc}") from exc
        self.host, self.port = self._sock.getsockname()[:2]
        self.family = family
        self._loop = asyncio.get_running_loop()
        self._zmq_fd: int | None = None  # ZeroMQ's descriptor of the listener (it closes it)
        self._pending: set[int] = set()  # connections accepted and not yet gone
        self._inside = False
        self._shut = False

    def bind(self, sock: zmq.Socket) -> None:
        """Bind ``sock`` through this door (it takes a descriptor of its own)."""
        if self.family == socket.AF_INET6:
            sock.setsockopt(zmq.IPV6, 1)
        self._zmq_fd = os.dup(self._sock.fileno())
        sock.setsockopt(zmq.USE_FD, self._zmq_fd)
        host = f"[{self.host}]" if self.family == socket.AF_INET6 else self.host
        sock.bind(f"tcp://{host}:{self.port}")

    def accepted(self, fd: int) -> None:
        self._pending.add(fd)
        self._close()

    def gone(self, fd: int) -> None:
        self._pending.discard(fd)
        if not self._pending and not self._inside:
            self._open()

    def admit(self) -> None:
        """The worker is in: nobody else comes in."""
        self._inside = True
        self._close()

    def _close(self) -> None:
        # ZeroMQ's poller still watches the listener (level-triggered) and wakes as a
        # connection arrives, but its accept finds the unreachable listener: EAGAIN.  The
        # arrival is ours to turn away (``_refuse``), at once.
        if not self._shut and self._zmq_fd is not None:
            os.dup2(self._inert.fileno(), self._zmq_fd, inheritable=False)
            self._loop.add_reader(self._sock.fileno(), self._refuse)
            self._shut = True

    def _open(self) -> None:
        if self._shut and self._zmq_fd is not None:
            self._loop.remove_reader(self._sock.fileno())
            os.dup2(self._sock.fileno(), self._zmq_fd, inheritable=False)
            self._shut = False

    def _refuse(self) -> None:
        for _ in range(64):  # a turn's worth; the rest at the next one
            try:
                conn, _ = self._sock.accept()
            except OSError:  # none waits (or it went): nothing to turn away
                return
            conn.close()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() == -1

    def close(self) -> None:
        self._open()  # ZeroMQ closes its descriptor as the listener it registered
        self._sock.close()


class Gatekeeper:
    """The ZAP handler of one ZeroMQ context: lets in the worker key each socket (ZAP
    domain) expects, once, and refuses every other handshake.  Runs on the event loop."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP)
        self._expected: dict[bytes, bytes] = {}  # domain -> the worker's public key (raw)
        self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._readable)
        self._readable()  # (an edge-triggered descriptor: look once before the first edge)

    def expect(self, domain: bytes, public_key: bytes) -> None:
        self._expected[domain] = z85.decode(public_key)

    def forget(self, domain: bytes) -> None:
        self._expected.pop(domain, None)

    def _readable(self) -> None:
        sock = self._sock
        while sock is not None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            request = sock.recv_multipart(zmq.NOBLOCK)
            # version, request id, domain, address, identity, mechanism, credentials
            ok = (len(request) == 7 and request[0] == b"1.0" and request[5] == b"CURVE"
                  and self._expected.get(request[2]) == request[6])
            if ok:
                del self._expected[request[2]]  # one connection per worker
            sock.send_multipart([b"1.0", request[1] if len(request) > 1 else b"",
                                 b"200" if ok else b"400", b"OK" if ok else b"not this socket's worker",
                                 b"", b""])

    def close(self) -> None:
        if self._sock is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._sock.close(linger=0)
            self._sock = None


class Guard:
    """What guards one worker's TCP socket: its door and its keys.  ``env`` is what the
    worker needs to connect (``StartSpec.curve``: the server's public key, its own public and
    secret keys).  The socket's monitor passes its ``EVENTS`` to ``follow``."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED

    def __init__(self, sock: zmq.Socket, host: str, gatekeeper: Gatekeeper, domain: str) -> None:
        if not zmq.has("curve"):
            raise ConfigError("transport 'tcp' needs CurveZMQ, which this pyzmq lacks; install a pyzmq "
                              "wheel (pip install --force-reinstall pyzmq)")
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        self.env = b" ".join((server_public, public, secret)).decode()
        self.domain = domain.encode()
        self._gatekeeper = gatekeeper
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, self.domain)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler: nobody in
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        gatekeeper.expect(self.domain, public)
        self.door = Door(host)
        try:
            self.door.bind(sock)
        except BaseException:
            self.close()
            raise

    def follow(self, event: int, fd: int) -> None:
        """A connection event of the socket: the door opens and shuts with them."""
        if event == zmq.EVENT_ACCEPTED:
            self.door.accepted(fd)
        elif event == zmq.EVENT_DISCONNECTED:
            self.door.gone(fd)

    @property
    def closed(self) -> bool:
        return self.door.closed

    def close(self) -> None:
        """Idempotent; before the ZeroMQ socket is closed (see ``Door``)."""
        self._gatekeeper.forget(self.domain)
        self.door.close()
