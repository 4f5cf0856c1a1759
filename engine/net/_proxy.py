"""A sandbox's one way out: an HTTP proxy on a unix socket, outside the sandbox.

An ``EgressGate`` is one listening socket for one sandbox, with that sandbox's allowlist and its
connection records.  The socket a connection arrives on is the whole of its identity: no
token, no header, no earlier verdict counts, so code that reaches the socket directly (or
relays through anything in the sandbox) gets exactly what the forwarder gets.

Per connection, in order (``engine.net._decide``): read the head (bounded in bytes, fields and
time), canonicalise the target, judge it before any lookup, resolve a name once with the
injected resolver (``system_resolver`` in production), judge every address, dial the exact
addresses judged (no second lookup, so no rebinding between the check and the connect), and
only then answer: ``200`` and a byte tunnel for CONNECT, or the one plain request forwarded
and its response relayed, then close.  A refusal is an HTTP answer in words (403 for the
policy, 400 for the request, 502/504 for the server, 503 when the sandbox has as many
connections open as it may); the gate itself never raises for anything a client sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path

from engine.net._address import machine_addresses
from engine.net._allow import Allowlist
from engine.net._decide import after_lookup, before_lookup
from engine.net._host import show_host
from engine.net._http import BadRequest, Request, continue_head, parse_request, parse_response, refusal
from engine.net._records import ConnectionRecord
from engine.net._relay import both, pump

__all__ = ["EgressGate", "Limits", "Resolver", "system_resolver"]

log = logging.getLogger("agentloop.net")

#: ``resolver(name, port)``: the addresses of ``name``, as strings or ``ipaddress`` values.
Resolver = Callable[[str, int], Awaitable[Sequence[object]]]

_DISCARD = 1 << 20  # bytes read and dropped after a plain request's body, at most
_TOKEN_START = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


async def system_resolver(name: str, port: int) -> list[str]:
    """The machine's resolver (``getaddrinfo``), for names the allowlist already names."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM,
                                                         proto=socket.IPPROTO_TCP)
    return [info[4][0] for info in infos]


@dataclass(frozen=True)
class Limits:
    """A gate's bounds: ``head_bytes`` and ``headers`` of a request head, ``head_seconds`` to
    send it, ``resolve_seconds`` and ``dial_seconds`` (per address, at most ``addresses`` of
    them), ``connections`` open at once (more wait for none: 503), ``records`` kept."""

    head_bytes: int = 64 * 1024
    headers: int = 100
    head_seconds: float = 10.0
    resolve_seconds: float = 10.0
    dial_seconds: float = 10.0
    addresses: int = 8
    connections: int = 256
    records: int = 10_000


class _Refuse(Exception):
    """Ends a connection with a refusal (internal to the gate)."""

    def __init__(self, status: int, why: str, words: str, hint: str = "", verdict: str = "refused") -> None:
        super().__init__(words)
        self.status, self.why, self.words, self.hint, self.verdict = status, why, words, hint, verdict


class EgressGate:
    """One sandbox's proxy: a unix socket at ``path`` (bound by ``start``, mode 0600: give it
    to the sandbox's uid with ``LaunchPlan.grant``), the ``allowlist`` it applies, and
    ``records`` (``ConnectionRecord``, oldest first; ``dropped`` counts those beyond
    ``limits.records``).  ``close`` ends every connection and removes the socket."""

    def __init__(self, path: str | Path, allowlist: Allowlist, *, resolver: Resolver | None = None,
                 limits: Limits | None = None) -> None:
        self.path = Path(path)
        self.allowlist = allowlist
        self.limits = limits or Limits()
        self.records: list[ConnectionRecord] = []
        self.dropped = 0
        self._resolve = resolver or system_resolver
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._accepting: asyncio.Task | None = None
        self._open: set[asyncio.Task] = set()

    async def __aenter__(self) -> EgressGate:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> EgressGate:
        """Bind and listen (once: a started gate is returned as it is); a stale socket at
        ``path`` is replaced."""
        return self.listen()

    def listen(self) -> EgressGate:
        """``start`` for a caller that cannot await (it runs in the event loop that serves the
        gate): the socket is bound and accepts when this returns."""
        if self._listener is not None:
            return self
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            os.fchmod(sock.fileno(), 0o600)  # (bind takes the mode from the socket: no window)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    os.unlink(self.path)
            sock.bind(str(self.path))
            sock.listen(max(128, self.limits.connections))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        st = os.lstat(self.path)
        self._listener, self._inode = sock, (st.st_dev, st.st_ino)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        return self

    async def settled(self, timeout: float) -> None:
        """Wait until the connections open now have ended, for at most ``timeout`` s: one whose
        client has just closed it ends a moment later, once the close has come through the
        sandbox's forwarder; one the client keeps open stays so (it is told when it ends)."""
        if self._open:
            await asyncio.wait(set(self._open), timeout=timeout)

    async def close(self) -> None:
        """Stop accepting, end every open connection, remove the socket."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
        tasks = list(self._open)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def cut(self) -> None:
        """End every open connection and keep accepting: what one program of the sandbox
        opened ends with it (a sample slot's gate, between its samples)."""
        tasks = list(self._open)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- accepting -------------------------------------------------------------------------

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("egress gate %s: cannot accept (%s); retrying shortly", self.path, exc)
                    await asyncio.sleep(0.1)  # (descriptors run out: wait for some to close)
                    continue
                log.warning("egress gate %s stopped accepting: %s", self.path, exc)
                return
            conn.setblocking(False)
            record = self._record()
            if len(self._open) >= self.limits.connections:
                words = f"this sandbox already has {self.limits.connections} connections open through the proxy"
                self._finish(record, _Refuse(503, "busy", words))
                record.seconds = 0.0
                if len(self._open) >= 2 * self.limits.connections:
                    conn.close()  # (even the answers wait: no more tasks)
                    continue
                task = loop.create_task(self._answer(conn, refusal(503, words)))
                task.add_done_callback(lambda _, conn=conn: conn.close())
            else:
                task = loop.create_task(self._serve(conn, record))
            self._open.add(task)
            task.add_done_callback(self._open.discard)

    def _record(self) -> ConnectionRecord:
        record = ConnectionRecord()
        if len(self.records) < self.limits.records:
            self.records.append(record)
        else:
            self.dropped += 1
        return record

    @staticmethod
    def _finish(record: ConnectionRecord, refused: _Refuse) -> None:
        record.verdict, record.why, record.status = refused.verdict, refused.why, refused.status
        record.words = refused.words + (f"; to allow it: {refused.hint}" if refused.hint else "")

    # -- one connection --------------------------------------------------------------------

    async def _serve(self, conn: socket.socket, record: ConnectionRecord) -> None:
        loop = asyncio.get_running_loop()
        upstream: socket.socket | None = None
        began = time.monotonic()
        try:
            try:
                request, extra = await self._request(conn, record)
                upstream = await self._connect(request, record)
            except _Refuse as refused:
                self._finish(record, refused)
                await self._answer(conn, refusal(refused.status, refused.words, refused.hint))
                return
            record.verdict = "allowed"
            if request.connect:
                record.status = 200
                await loop.sock_sendall(conn, _ESTABLISHED)
                if extra:  # what the client sent after its head belongs to the tunnel
                    await loop.sock_sendall(upstream, extra)
                    record.sent += len(extra)
                await self._tunnel(conn, upstream, record)
            else:
                await self._exchange(conn, upstream, request, extra, record)
        except (OSError, EOFError):
            pass  # one side went away: the connection ends
        except asyncio.CancelledError:
            record.why = record.why or "closed"
            raise
        except Exception:  # noqa: BLE001 - nothing a client sends may stop the gate
            log.exception("egress gate %s: connection failed", self.path)
        finally:
            record.seconds = round(time.monotonic() - began, 6)
            for sock in (conn, upstream):
                if sock is not None:
                    sock.close()

    async def _answer(self, conn: socket.socket, answer: bytes) -> None:
        """Send ``answer``, end the sending side, and read what the client still sends until it
        closes (bounded in bytes and time): closing a unix socket with unread bytes resets it,
        and the client would lose the answer."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(self.limits.head_seconds):
                await loop.sock_sendall(conn, answer)
                conn.shutdown(socket.SHUT_WR)
                dropped = 0
                while dropped < _DISCARD and (n := len(await loop.sock_recv(conn, 65536))):
                    dropped += n

    async def _request(self, conn: socket.socket, record: ConnectionRecord) -> tuple[Request, bytes]:
        """The request's head, parsed, and the bytes that came after it."""
        try:
            async with asyncio.timeout(self.limits.head_seconds):
                head, extra = await self._read_head(conn)
            request = parse_request(head, self.limits.headers)
        except TimeoutError:
            raise _Refuse(408, "timeout", f"the request head did not come within {self.limits.head_seconds:g} s") from None
        except EOFError as exc:
            raise _Refuse(400, "malformed", str(exc)) from None
        except BadRequest as exc:
            raise _Refuse(exc.status, "malformed", exc.words) from None
        record.host, record.port, record.method = show_host(request.host), request.port, request.method
        return request, extra

    async def _read_head(self, conn: socket.socket) -> tuple[bytes, bytes]:
        loop = asyncio.get_running_loop()
        buf = bytearray()
        limit = self.limits.head_bytes
        while True:
            chunk = await loop.sock_recv(conn, 65536)
            if not chunk:
                raise EOFError("the client closed before its request head ended")
            start = max(0, len(buf) - 3)
            buf += chunk
            if buf[0] not in _TOKEN_START:  # a TLS hello, SOCKS, anything but HTTP: no need to wait
                if buf[0] in (4, 5):
                    raise BadRequest(400, "SOCKS is not offered: this proxy speaks HTTP (CONNECT and http:// requests)")
                raise BadRequest(400, "this is an HTTP proxy: send CONNECT host:port, or GET http://host/path")
            end = buf.find(b"\r\n\r\n", start)
            if 0 <= end <= limit:
                return bytes(buf[:end]), bytes(buf[end + 4:])
            if len(buf) > limit + 4:
                raise BadRequest(431, f"the request head is larger than {limit // 1024} KiB")

    async def _connect(self, request: Request, record: ConnectionRecord) -> socket.socket:
        """The decision (``engine.net._decide``), the lookup and the dial: a connected socket."""
        verdict = before_lookup(self.allowlist, request.host, request.port)
        if not verdict.allowed:
            raise _Refuse(403, verdict.why, verdict.words, verdict.hint)
        if isinstance(request.host, str):
            addresses = await self._addresses(request.host, request.port)
            verdict = after_lookup(self.allowlist, request.host, request.port, addresses, machine_addresses())
            if not verdict.allowed:
                raise _Refuse(403, verdict.why, verdict.words, verdict.hint)
        else:
            addresses = [request.host]
        return await self._dial(addresses[:self.limits.addresses], request, record)

    async def _addresses(self, name: str, port: int) -> list[IPv4Address | IPv6Address]:
        try:
            async with asyncio.timeout(self.limits.resolve_seconds):
                answers = await self._resolve(name, port)
        except TimeoutError:
            raise _Refuse(504, "resolve", f"{name} did not resolve within {self.limits.resolve_seconds:g} s",
                          verdict="failed") from None
        except OSError as exc:
            raise _Refuse(502, "resolve", f"{name} does not resolve ({exc.strerror or exc})", verdict="failed") from None
        found: list[IPv4Address | IPv6Address] = []
        for answer in answers:
            try:
                address = ip_address(str(answer).partition("%")[0])
            except ValueError:
                raise _Refuse(502, "resolve", f"{name} resolved to something that is no address",
                              verdict="failed") from None
            if isinstance(address, IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            if address not in found:
                found.append(address)
        return found

    async def _dial(self, addresses: Sequence[IPv4Address | IPv6Address], request: Request,
                    record: ConnectionRecord) -> socket.socket:
        loop = asyncio.get_running_loop()
        failure = "no address"
        for address in addresses:
            family = socket.AF_INET6 if isinstance(address, IPv6Address) else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)
            record.address = str(address)
            try:
                async with asyncio.timeout(self.limits.dial_seconds):
                    await loop.sock_connect(sock, (str(address), request.port))
            except TimeoutError:
                sock.close()
                failure = f"{address} did not answer within {self.limits.dial_seconds:g} s"
                continue
            except OSError as exc:
                sock.close()
                failure = f"{address}: {exc.strerror or exc}"
                continue
            except BaseException:  # (the gate closing meanwhile)
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        timed_out = "did not answer" in failure
        raise _Refuse(504 if timed_out else 502, "dial", f"cannot connect to {request.authority} ({failure})",
                      verdict="failed")

    # -- relaying --------------------------------------------------------------------------

    async def _tunnel(self, conn: socket.socket, upstream: socket.socket, record: ConnectionRecord) -> None:
        """Bytes both ways until both sides have ended; an end in one direction is passed on
        (half-close), an error in either ends both."""

        async def one_way(src: socket.socket, dst: socket.socket, count: Callable[[int], None]) -> None:
            await pump(src, dst, count)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        await both(one_way(conn, upstream, _counter(record, "sent")), one_way(upstream, conn, _counter(record, "received")))

    async def _exchange(self, conn: socket.socket, upstream: socket.socket, request: Request, extra: bytes,
                        record: ConnectionRecord) -> None:
        """The one plain request: its head rewritten, exactly its body, the response relayed with
        ``Connection: close``; nothing the client sends after the body is forwarded."""
        loop = asyncio.get_running_loop()
        head = request.upstream_head()
        await loop.sock_sendall(upstream, head)
        record.sent += len(head)
        first = extra[:request.length]

        async def upload() -> None:
            if request.expect and request.length > len(first):
                await loop.sock_sendall(conn, continue_head())
            if first:
                await loop.sock_sendall(upstream, first)
                record.sent += len(first)
            await pump(conn, upstream, _counter(record, "sent"), request.length - len(first))
            dropped = 0
            while dropped < _DISCARD:  # read what follows and drop it, so closing resets nothing
                n = len(await loop.sock_recv(conn, 65536))
                if not n:
                    return
                dropped += n

        await both(upload(), self._respond(conn, upstream, request, record), until_second=True)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)

    async def _respond(self, conn: socket.socket, upstream: socket.socket, request: Request,
                       record: ConnectionRecord) -> None:
        loop = asyncio.get_running_loop()
        buf = b""
        while True:
            try:
                head, buf = await self._response_head(upstream, buf)
                response = parse_response(head, request.method, self.limits.headers)
            except BadRequest as exc:
                record.verdict, record.why, record.words, record.status = "failed", "malformed", exc.words, 502
                if record.received == 0:
                    await loop.sock_sendall(conn, refusal(502, exc.words))
                return
            await loop.sock_sendall(conn, response.head)
            record.received += len(response.head)
            if not response.interim:
                break
        record.status = response.status
        body = buf if response.length is None else buf[:response.length]
        if body:
            await loop.sock_sendall(conn, body)
            record.received += len(body)
        left = None if response.length is None else response.length - len(body)
        if left is None or left > 0:
            with contextlib.suppress(EOFError):
                await pump(upstream, conn, _counter(record, "received"), left)

    async def _response_head(self, upstream: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
        loop = asyncio.get_running_loop()
        data = bytearray(buf)
        while True:
            end = data.find(b"\r\n\r\n")
            if 0 <= end <= self.limits.head_bytes:
                return bytes(data[:end]), bytes(data[end + 4:])
            if len(data) > self.limits.head_bytes + 4:
                raise BadRequest(502, f"the server's response head is larger than {self.limits.head_bytes // 1024} KiB")
            chunk = await loop.sock_recv(upstream, 65536)
            if not chunk:
                raise BadRequest(502, "the server closed the connection without a complete response head")
            data += chunk


def _counter(record: ConnectionRecord, field: str) -> Callable[[int], None]:
    def count(n: int) -> None:
        setattr(record, field, getattr(record, field) + n)

    return count
