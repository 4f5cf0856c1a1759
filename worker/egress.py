"""The sandbox's end of its way out: a forwarder on the sandbox's own loopback.

``start(socket_path)`` binds 127.0.0.1 (and ::1) on one port, forks the forwarder and returns
its port; ``open_way_out`` does that and sets the proxy variables (``contract.egress``) in the
environment the code inherits.  The forwarder relays every connection it accepts, byte for
byte, to the egress proxy's unix socket (``engine.net.EgressGate``) and holds nothing else: it is
plumbing with no privilege beyond the code's own.

Why that is enough: the proxy outside decides every connection from the request alone and from
the socket it arrives on, so anything in the sandbox may talk to that socket directly, or kill
or replace this process, and gain nothing; if the forwarder dies, the sandbox (an empty network
namespace) simply has no network.  It is therefore started *after* the confinement, by the
confined process while it still has a single thread (a fork then copies no lock in use):
it inherits the uid, Landlock domain, seccomp filter and rlimits, and needs only what the
filter allows every worker under bubblewrap (``socket`` of AF_INET, AF_INET6 and AF_UNIX).

One thread, one ``selectors`` loop, at most ``connections`` pairs open (more wait in the
listen queue), half-closes passed on, an error in either side ending both.  Each direction
splices through a pipe (the kernel moves the pages, none pass through this process), or copies
through a buffer for the pairs beyond the first few.  Standard library only: it runs where the
runtime's own packages are not loaded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import selectors
import signal
import socket
from dataclasses import dataclass

from .contract.egress import proxy_environment

__all__ = ["Forwarder", "open_way_out", "start"]

_SPLICE = 1 << 20  # the most one splice asks for (what the pipe holds bounds it)
_BIG = 1 << 20
#: Pairs that splice (four descriptors each, within the code's own RLIMIT_NOFILE), the first
#: ``_BIG_PAIRS`` of them through 1 MiB pipes (fewer wake-ups for a bulk transfer), the others
#: through the default 64 KiB ones; pipe memory counts against the user's limit for all its
#: processes (``/proc/sys/fs/pipe-user-pages-soft``, 64 MiB by default): at most 16 + 3 MiB.
_SPLICED_PAIRS = 32
_BIG_PAIRS = 8
_COPY = 64 * 1024  # the buffer of a direction that copies (pairs beyond the spliced ones)
#: A big pair's send buffer on its unix socket to the proxy (uploads: a unix stream's only
#: buffer is its sender's); the kernel caps it at ``net.core.wmem_max``.
_UNIX_SNDBUF = 2 << 20
_F_SETPIPE_SZ = 1031
_SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
#: Whether flows splice (False: every flow copies through a buffer).
SPLICE = True
_PR_SET_PDEATHSIG, _PR_SET_NAME, _PR_SET_DUMPABLE = 1, 15, 4
_START_SECONDS = 10.0
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)


@dataclass(frozen=True)
class Forwarder:
    """A running forwarder: its process and the port it listens on (127.0.0.1, and ::1 where
    the sandbox's loopback has it)."""

    pid: int
    port: int


def _listeners(port: int) -> list[socket.socket]:
    """127.0.0.1:``port`` (0: any free one) and ::1 on the same port where IPv6 is there."""
    for _ in range(8):  # (another listener may hold the v6 twin of a free v4 port: try another)
        v4 = socket.create_server(("127.0.0.1", port), backlog=512)
        chosen = v4.getsockname()[1]
        try:
            v6 = socket.create_server(("::1", chosen), family=socket.AF_INET6, backlog=512)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and port == 0:
                v4.close()
                continue
            return [v4]  # no IPv6 on this loopback: 127.0.0.1 is what the variables name anyway
        return [v4, v6]
    raise OSError(errno.EADDRINUSE, "no port free on both 127.0.0.1 and ::1")


def start(socket_path: str, *, port: int = 0, connections: int = 256) -> Forwarder:
    """Listen, fork the forwarder to ``socket_path`` and return it.  Call it while the process
    has one thread (after its confinement, before anything starts threads)."""
    listeners = _listeners(port)
    chosen = listeners[0].getsockname()[1]
    parent = os.getpid()
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            _become_forwarder(parent, [*(listener.fileno() for listener in listeners), ready_w])
            os.write(ready_w, b"1")
            os.close(ready_w)
            _Relay(listeners, socket_path, connections).run()
        finally:  # whatever ended it, the sandbox's network simply ends with it
            os._exit(1)
    for listener in listeners:
        listener.close()
    os.close(ready_w)
    try:
        # Started means set up: non-dumpable, its descriptors closed, its signals ignored.
        ready = select.select([ready_r], [], [], _START_SECONDS)[0] and os.read(ready_r, 1) == b"1"
    finally:
        os.close(ready_r)
    if not ready:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise OSError(errno.ECHILD, "the egress forwarder did not start")
    return Forwarder(pid, chosen)


def open_way_out(socket_path: str, environ: dict | None = None, **kwargs) -> Forwarder:
    """``start``, then the proxy variables in ``environ`` (default ``os.environ``): what the
    code and every program it starts read."""
    forwarder = start(socket_path, **kwargs)
    (os.environ if environ is None else environ).update(proxy_environment(forwarder.port))
    return forwarder


def _become_forwarder(parent: int, kept: list[int]) -> None:
    """In the child: die with the process that started it, keep no descriptor but ``kept``
    (the listeners; the parent's output pipes would otherwise stay open after it ends), ignore
    what a terminal sends its process group."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)  # the parent is gone already
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(b"agentloop-net"), 0, 0, 0)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep = sorted(kept)
    low = 3
    for fd in keep:
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def _pipe(big: bool) -> tuple[int, int] | None:
    """A pipe to splice through (``big``: of 1 MiB, if the user's pipe memory allows), or
    None: descriptors are short."""
    try:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if big:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, _F_SETPIPE_SZ, _BIG)
    return r, w


class _Flow:
    """One direction of a pair: bytes read from ``src`` not yet written to ``dst``.

    The bytes go through a pipe by ``splice`` (the kernel moves pages: no copy through this
    process), or, where no pipe can be had or splice refuses these sockets, through a buffer."""

    __slots__ = ("src", "dst", "pipe", "held", "view", "lo", "hi", "ended", "done")

    def __init__(self, src: socket.socket, dst: socket.socket, splice: bool, big: bool) -> None:
        self.src, self.dst = src, dst
        self.pipe = _pipe(big) if splice and SPLICE else None
        self.held = 0  # bytes in the pipe
        self.view: memoryview | None = None
        self.lo = self.hi = 0
        self.ended = self.done = False  # src ended; and that end was passed on to dst

    def pending(self) -> bool:
        return self.held > 0 or self.lo < self.hi

    def pull(self) -> None:
        try:
            if self.pipe is not None:
                n = os.splice(self.src.fileno(), self.pipe[1], _SPLICE, flags=_SPLICE_FLAGS)
                self.held = n
            else:
                if self.view is None:
                    self.view = memoryview(bytearray(_COPY))
                n = self.src.recv_into(self.view)
                self.lo, self.hi = 0, n
        except OSError as exc:
            if exc.errno in _AGAIN:
                return
            if self.pipe is not None and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                self.close()  # (splice refuses these sockets: copy instead)
                return self.pull()
            raise
        if n == 0:
            self.ended = True
        self.push()

    def push(self) -> None:
        while self.held:
            try:
                self.held -= os.splice(self.pipe[0], self.dst.fileno(), self.held, flags=_SPLICE_FLAGS)
            except OSError as exc:
                if exc.errno in _AGAIN:
                    return
                raise
        while self.lo < self.hi:
            try:
                self.lo += self.dst.send(self.view[self.lo:self.hi])
            except OSError as exc:
                if exc.errno in _AGAIN:
                    return
                raise
        if self.ended and not self.done:
            self.done = True
            with contextlib.suppress(OSError):
                self.dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        if self.pipe is not None:
            for fd in self.pipe:
                os.close(fd)
            self.pipe = None


class _Pair:
    """A client's connection and its connection to the proxy."""

    __slots__ = ("a", "b", "out", "back", "relay", "big")

    def __init__(self, relay: _Relay, a: socket.socket, b: socket.socket) -> None:
        self.relay, self.a, self.b = relay, a, b
        splice = len(relay.pairs) < _SPLICED_PAIRS
        self.big = splice and relay.big < _BIG_PAIRS
        relay.big += self.big
        if self.big:
            with contextlib.suppress(OSError):
                b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_SNDBUF)
        self.out, self.back = _Flow(a, b, splice, self.big), _Flow(b, a, splice, self.big)

    def wants(self, sock: socket.socket) -> int:
        inward, outward = (self.out, self.back) if sock is self.a else (self.back, self.out)
        events = 0
        if not inward.ended and not inward.pending():
            events |= selectors.EVENT_READ
        if outward.pending():
            events |= selectors.EVENT_WRITE
        return events

    def on(self, sock: socket.socket, events: int) -> None:
        if self not in self.relay.pairs:
            return  # (an event of the same round, for a pair dropped meanwhile)
        inward, outward = (self.out, self.back) if sock is self.a else (self.back, self.out)
        try:
            if events & selectors.EVENT_WRITE:
                outward.push()
            if events & selectors.EVENT_READ:
                inward.pull()
        except OSError:
            self.relay.drop(self)
            return
        if self.out.done and self.back.done:
            self.relay.drop(self)
        else:
            self.relay.watch(self)


class _Relay:
    def __init__(self, listeners: list[socket.socket], path: str, connections: int) -> None:
        self.listeners, self.path, self.limit = listeners, path, connections
        self.selector = selectors.DefaultSelector()
        self.pairs: set[_Pair] = set()
        self.big = 0  # pairs with 1 MiB pipes
        self.paused = False
        for listener in listeners:
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ, None)

    def run(self) -> None:
        while True:
            for key, events in self.selector.select():
                if key.data is None:
                    self.accept(key.fileobj)  # type: ignore[arg-type]
                    continue
                try:
                    key.data.on(key.fileobj, events)
                except Exception:  # noqa: BLE001 - one pair's trouble ends that pair, never the others
                    self.drop(key.data)

    def accept(self, listener: socket.socket) -> None:
        while len(self.pairs) < self.limit:
            try:
                client, _ = listener.accept()
            except OSError as exc:
                if exc.errno in _AGAIN or exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    if self.pairs:  # out of descriptors: clients wait in the queue until one closes
                        self.pause(True)
                    return
                raise
            client.setblocking(False)
            with contextlib.suppress(OSError):
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            proxy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            try:
                proxy.connect(self.path)  # a unix connect completes at once, or fails
            except OSError:
                proxy.close()
                client.close()  # no proxy: no network, and never another way
                continue
            pair = _Pair(self, client, proxy)
            self.pairs.add(pair)
            self.watch(pair)
        self.pause(True)

    def pause(self, paused: bool) -> None:
        if paused != self.paused:
            self.paused = paused
            for listener in self.listeners:
                if paused:
                    self.selector.unregister(listener)
                else:
                    self.selector.register(listener, selectors.EVENT_READ, None)

    def watch(self, pair: _Pair) -> None:
        for sock in (pair.a, pair.b):
            events = pair.wants(sock)
            try:
                key = self.selector.get_key(sock)
            except KeyError:
                key = None
            if events and key is None:
                self.selector.register(sock, events, pair)
            elif events and key.events != events:
                self.selector.modify(sock, events, pair)
            elif not events and key is not None:
                self.selector.unregister(sock)

    def drop(self, pair: _Pair) -> None:
        if pair not in self.pairs:
            return
        self.pairs.discard(pair)
        for sock in (pair.a, pair.b):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(sock)
            sock.close()
        pair.out.close()
        pair.back.close()
        self.big -= pair.big
        if len(self.pairs) < self.limit:
            self.pause(False)
