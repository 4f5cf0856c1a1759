"""The egress proxy (``engine.net.EgressGate``) spoken to directly on its unix socket: what it forwards,
what it refuses and in what words, its bounds, its records.  Real sockets and servers on the
host's loopback only (``tests.net_servers``); the sandboxed side is ``tests/security/test_egress.py``."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from engine.net import Allowlist, EgressGate, Limits
from engine.net import _relay as relay
from tests.net_servers import WAIT, BlobSource, Canary, Echo, Resolver, Sink


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="agentloop-egress-"))  # (short: a unix socket path has 107 bytes)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def echo():
    server = Echo()
    yield server
    server.close()


@pytest.fixture
def canaries():
    found = [Canary("127.0.0.1"), Canary("127.0.0.3")]
    yield found
    for canary in found:
        canary.close()


async def _gate(sock_dir: Path, entries: list[str], **kwargs) -> EgressGate:
    return await EgressGate(sock_dir / "egress.sock", Allowlist.parse(entries), **kwargs).start()


async def ask(gate: EgressGate, data: bytes, *, shut: bool = False) -> bytes:
    """Send ``data`` on a fresh connection to the gate; everything it answers until it closes.
    A send the gate stopped reading (a head over its bound) still leaves its answer to read."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, str(gate.path))
        try:
            await loop.sock_sendall(sock, data)
            if shut:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        async with asyncio.timeout(WAIT):
            while chunk := await loop.sock_recv(sock, 1 << 16):
                answer += chunk
        return answer


async def tunnel(gate: EgressGate, target: str):
    """A CONNECT to ``target``: (status line, reader, writer)."""
    reader, writer = await asyncio.open_unix_connection(str(gate.path))
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    return head.split(b"\r\n")[0].decode(), reader, writer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> str:
    return answer.partition(b"\r\n\r\n")[2].decode()


# -- CONNECT --------------------------------------------------------------------------------

async def test_a_listed_address_gets_a_tunnel_and_a_record(sock_dir, echo):
    async with await _gate(sock_dir, [echo.address]) as gate:
        line, reader, writer = await tunnel(gate, echo.address)
        assert line == "HTTP/1.1 200 Connection established"
        writer.write(b"ping" * 1000)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(4000), WAIT) == b"ping" * 1000
        writer.write_eof()  # a half-close is passed on: the echo ends, and so does the tunnel
        assert await asyncio.wait_for(reader.read(), WAIT) == b""
        writer.close()
        await _until(lambda: gate.records[0].seconds is not None)
        record = gate.records[0]
        assert (record.host, record.port, record.method, record.verdict, record.status, record.address) == \
            ("127.0.0.2", echo.port, "CONNECT", "allowed", 200, "127.0.0.2")
        assert (record.sent, record.received) == (4000, 4000)


async def test_bytes_sent_with_the_connect_go_into_the_tunnel(sock_dir, echo):
    async with await _gate(sock_dir, [echo.address]) as gate:
        answer = await ask(gate, f"CONNECT {echo.address} HTTP/1.1\r\n\r\nearly bytes".encode(), shut=True)
        assert answer == b"HTTP/1.1 200 Connection established\r\n\r\nearly bytes"


async def test_an_unlisted_target_is_refused_in_words_before_any_lookup(sock_dir, echo, canaries):
    resolver = Resolver({"secret-data.evil.example": ["127.0.0.3"]})
    async with await _gate(sock_dir, [echo.address], resolver=resolver) as gate:
        answer = await ask(gate, b"CONNECT secret-data.evil.example:443 HTTP/1.1\r\n\r\n")
        assert status_of(answer) == 403
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"secret-data.evil.example is not on this sandbox's network allowlist" in head.split(b"\r\n")[0]
        assert "to allow it: --allow-net secret-data.evil.example:443" in body.decode()
        assert b"Proxy-Status: agentloop; error=destination_ip_prohibited" in head
        for target in (f"127.0.0.3:{canaries[1].port}", f"127.0.0.1:{canaries[0].port}", f"127.0.0.2:{echo.port + 1}"):
            assert status_of(await ask(gate, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())) == 403
    assert resolver.lookups == []  # no DNS query for a name no entry names
    assert [r.why for r in gate.records] == ["not-listed"] * 3 + ["port"]
    for canary in canaries:
        canary.assert_untouched()


SPELLINGS = ["127.1", "0x7f.0.0.1", "0x7f000001", "2130706433", "0177.0.0.1", "127.000.000.001", "0", "0.0.0.0",
             "[::]", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[::127.0.0.1]", "[64:ff9b::7f00:1]",
             "[2002:7f00:1::]", "[fe80::1%25lo]", "localhost", "localhost.", "LOCALHOST", "foo.localhost",
             "127.0.0.1.nip.io", "169.254.169.254", "[fd00:ec2::254]", "100.100.100.200", "168.63.129.16",
             "metadata.google.internal", "127.0.0.01", "127.0.0.1%00.example.com", "127.0.0.1 ", "[127.0.0.1]"]


async def test_the_machine_in_every_spelling_is_refused(sock_dir, canaries):
    resolver = Resolver({"127.0.0.1.nip.io": ["127.0.0.1"]})
    port = canaries[0].port
    async with await _gate(sock_dir, [f"127.0.0.1.nip.io:{port}", "example.com"], resolver=resolver) as gate:
        for host in SPELLINGS:
            answer = await ask(gate, f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
            assert status_of(answer) in (400, 403), (host, answer)
            plain = await ask(gate, f"GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            assert status_of(plain) in (400, 403), (host, plain)
    assert resolver.lookups == ["127.0.0.1.nip.io"] * 2  # (listed, looked up, its loopback answer refused)
    canaries[0].assert_untouched()


async def test_a_listed_name_that_resolves_to_the_machine_or_a_private_network_is_refused(sock_dir, echo, canaries):
    resolver = Resolver({"evil.test": ["127.0.0.3"], "private.test": ["10.0.0.1"], "meta.test": ["169.254.169.254"],
                         "mixed.test": ["93.184.216.34", "127.0.0.3"], "mapped.test": ["::ffff:127.0.0.3"],
                         "nat64.test": ["64:ff9b::a9fe:a9fe"]})
    port = canaries[1].port
    names = ["evil.test", "private.test", "meta.test", "mixed.test", "mapped.test", "nat64.test"]
    async with await _gate(sock_dir, [f"{n}:{port}" for n in names], resolver=resolver) as gate:
        for name in names:
            answer = await ask(gate, f"CONNECT {name}:{port} HTTP/1.1\r\n\r\n".encode())
            assert status_of(answer) == 403, answer
            assert f"{name} resolves to" in body_of(answer) and "--allow-net" in body_of(answer)
    assert all(r.address == "" for r in gate.records)  # nothing was dialled, the public answer neither
    canaries[1].assert_untouched()


async def test_listing_the_address_too_lets_the_name_through_to_exactly_that_address(sock_dir, echo, canaries):
    # A rebinding resolver: the first answer is the echo's address, any later one the canary's.
    resolver = Resolver({"echo.test": [[echo.host], [canaries[1].host]]})
    async with await _gate(sock_dir, [f"echo.test:{echo.port}", echo.address], resolver=resolver) as gate:
        line, reader, writer = await tunnel(gate, f"echo.test:{echo.port}")
        assert line.endswith("200 Connection established")
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), WAIT) == b"hello"
        writer.close()
    assert resolver.lookups == ["echo.test"] and gate.records[0].address == echo.host
    canaries[1].assert_untouched()


async def test_a_port_not_listed_is_refused_and_the_hint_names_it(sock_dir, echo):
    resolver = Resolver({"echo.test": [echo.host]})
    async with await _gate(sock_dir, ["echo.test", echo.address], resolver=resolver) as gate:
        for port in (22, 25, 6379, 8443):
            answer = await ask(gate, f"CONNECT echo.test:{port} HTTP/1.1\r\n\r\n".encode())
            assert status_of(answer) == 403
            assert f"echo.test is allowed on ports 443, 80 only, not {port}; to allow it: --allow-net echo.test:{port}" \
                in body_of(answer)
    assert resolver.lookups == []


async def test_a_server_that_cannot_be_reached_is_a_502_in_words(sock_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        closed = s.getsockname()[1]
    resolver = Resolver({"down.test": ["127.0.0.2"]})
    async with await _gate(sock_dir, [f"127.0.0.2:{closed}", f"down.test:{closed}", "nowhere.test"],
                           resolver=resolver) as gate:
        answer = await ask(gate, f"CONNECT 127.0.0.2:{closed} HTTP/1.1\r\n\r\n".encode())
        assert status_of(answer) == 502 and "cannot connect to 127.0.0.2" in body_of(answer)
        assert status_of(await ask(gate, b"CONNECT nowhere.test:443 HTTP/1.1\r\n\r\n")) == 502
    assert [(r.verdict, r.why) for r in gate.records] == [("failed", "dial"), ("failed", "resolve")]


# -- plain HTTP -----------------------------------------------------------------------------

async def test_plain_http_is_forwarded_once_in_origin_form_with_connection_close(sock_dir, index, canaries):
    async with await _gate(sock_dir, [index.address]) as gate:
        url = f"http://{index.address}/echo?x=1"
        answer = await ask(gate, (f"POST {url} HTTP/1.1\r\nHost: {index.address}\r\nProxy-Authorization: secret\r\n"
                                  "Proxy-Connection: keep-alive\r\nKeep-Alive: 5\r\nConnection: keep-alive, X-Drop\r\n"
                                  "X-Drop: 1\r\nContent-Length: 5\r\n\r\nhello"
                                  f"GET http://{canaries[0].address}/ HTTP/1.1\r\nHost: {canaries[0].address}\r\n\r\n"
                                  ).encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close" in head and b"keep-alive" not in head.lower()
    seen = json.loads(body)
    assert (seen["method"], seen["path"], seen["body"]) == ("POST", "/echo?x=1", "hello")
    assert seen["headers"]["connection"] == "close"
    assert not {"proxy-authorization", "proxy-connection", "keep-alive", "x-drop"} & set(seen["headers"])
    assert len(index.requests) == 1  # the pipelined second request was never forwarded
    record = gate.records[0]
    assert (record.verdict, record.status, record.method) == ("allowed", 200, "POST")
    assert record.sent > 5 and record.received == len(answer)
    canaries[0].assert_untouched()


async def test_expect_100_continue_is_answered_by_the_proxy(sock_dir, index):
    async with await _gate(sock_dir, [index.address]) as gate:
        reader, writer = await asyncio.open_unix_connection(str(gate.path))
        writer.write(f"PUT http://{index.address}/echo HTTP/1.1\r\nHost: {index.address}\r\nExpect: 100-continue\r\n"
                     "Content-Length: 3\r\n\r\n".encode())
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        answer = await asyncio.wait_for(reader.read(), WAIT)
        writer.close()
    assert json.loads(body_of(answer))["body"] == "abc" and "expect" not in json.loads(body_of(answer))["headers"]


BAD_PLAIN = {
    "GET / HTTP/1.1\r\nHost: {a}\r\n\r\n": (400, "origin-form"),
    "GET https://{a}/ HTTP/1.1\r\nHost: {a}\r\n\r\n": (400, "CONNECT"),
    "GET ftp://{a}/ HTTP/1.1\r\nHost: {a}\r\n\r\n": (400, "CONNECT"),
    "GET http://{a}/ HTTP/1.1\r\n\r\n": (400, "exactly one Host"),
    "GET http://{a}/ HTTP/1.1\r\nHost: {a}\r\nHost: {a}\r\n\r\n": (400, "exactly one Host"),
    "GET http://{a}/ HTTP/1.1\r\nHost: 127.0.0.3:{p}\r\n\r\n": (400, "another host"),
    "GET http://{a}/ HTTP/1.1\r\nHost: 127.0.0.2\r\n\r\n": (400, "another host"),  # (port 80, not {p})
    "GET http://{a}@127.0.0.3:{p}/ HTTP/1.1\r\nHost: 127.0.0.3:{p}\r\n\r\n": (400, "not host:port"),
    "GET http://127.0.0.3:{p}#.{a}/ HTTP/1.1\r\nHost: {a}\r\n\r\n": (400, "fragment"),
    "GET http://{a}\\@127.0.0.3:{p}/ HTTP/1.1\r\nHost: {a}\r\n\r\n": (400, "not host:port"),
    "POST http://{a}/ HTTP/1.1\r\nHost: {a}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n": (501, "Transfer-Encoding"),
    "POST http://{a}/ HTTP/1.1\r\nHost: {a}\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n": (501, "Transfer"),
    "POST http://{a}/ HTTP/1.1\r\nHost: {a}\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd": (400, "Content-Length"),
    "POST http://{a}/ HTTP/1.1\r\nHost: {a}\r\nContent-Length: -3\r\n\r\n": (400, "Content-Length"),
    "GET http://{a}/ HTTP/1.1\r\nHost: {a}\r\nUpgrade: websocket\r\n\r\n": (400, "Upgrade"),
    "GET http://{a}/ HTTP/1.1\r\nHost: {a}\r\nExpect: something\r\n\r\n": (417, "Expect"),
    "GET http://{a}/ HTTP/1.1\r\nHost: {a}\r\n folded: x\r\n\r\n": (400, "malformed header"),
    "GET http://{a}/ HTTP/1.1\r\nHost : {a}\r\n\r\n": (400, "malformed header"),
    "GET http://{a}/ HTTP/1.1\nHost: {a}\r\n\r\n": (400, "CRLF"),
    "GET http://{a}/ HTTP/1.1\r\nHost: {a}\r\nX: a\x00b\r\n\r\n": (400, "control"),
    "GET http://{a}/ HTTP/2.0\r\nHost: {a}\r\n\r\n": (505, "HTTP/1.1"),
    "GET  http://{a}/ HTTP/1.1\r\nHost: {a}\r\n\r\n": (400, "request line"),
    "\x05\x01\x00": (400, "SOCKS"),
    "\x04\x01\x00\x50\x7f\x00\x00\x03\x00": (400, "SOCKS"),
    "\x16\x03\x01\x02\x00\x01\x00": (400, "HTTP proxy"),
}


async def test_plain_requests_the_proxy_does_not_read_are_refused_and_never_forwarded(sock_dir, index, canaries):
    async with await _gate(sock_dir, [index.address]) as gate:
        for template, (status, words) in BAD_PLAIN.items():
            request = template.replace("{a}", index.address).replace("{p}", str(canaries[1].port))
            answer = await ask(gate, request.encode("latin-1"))
            assert status_of(answer) == status and words in body_of(answer), (request, answer)
    assert index.requests == [] and all(r.verdict == "refused" and r.why == "malformed" for r in gate.records)
    canaries[1].assert_untouched()


async def test_bounds_of_a_request_head(sock_dir, index):
    limits = Limits(head_bytes=4096, headers=10, head_seconds=0.5)
    async with await _gate(sock_dir, [index.address], limits=limits) as gate:
        base = f"GET http://{index.address}/echo HTTP/1.1\r\nHost: {index.address}\r\n"
        many = base + "".join(f"X-{i}: {i}\r\n" for i in range(10)) + "\r\n"
        assert status_of(await ask(gate, many.encode())) == 431
        big = base + "X: " + "y" * 5000 + "\r\n\r\n"
        assert status_of(await ask(gate, big.encode())) == 431
        huge = base + "X: " + "y" * (1 << 20)  # 1 MiB of head, never ended: refused at the bound
        assert status_of(await ask(gate, huge.encode())) == 431
        began = time.monotonic()
        slow = await ask(gate, base.encode())  # a head that never ends: refused when its time is up
        assert status_of(slow) == 408 and time.monotonic() - began < 5
    assert index.requests == []
    assert [r.why for r in gate.records] == ["malformed", "malformed", "malformed", "timeout"]


async def test_garbage_never_stops_the_gate(sock_dir, index):
    rng = random.Random(7)
    pieces = [b"CONNECT ", b"GET ", b"http://", index.address.encode(), b":", b"\r\n", b"Host: ", b"[", b"]", b"\x00",
              b"%", b"@", b"::1", b" ", b"HTTP/1.1", b"Content-Length: 9999999999999999999\r\n", bytes(range(256))]
    async with await _gate(sock_dir, [index.address], limits=Limits(head_seconds=0.5)) as gate:
        for _ in range(200):
            data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
            answer = await ask(gate, data + b"\r\n\r\n", shut=True)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 "), answer[:200]
        good = await ask(gate, f"GET http://{index.address}/echo HTTP/1.1\r\nHost: {index.address}\r\n\r\n".encode())
        assert status_of(good) == 200


# -- bounds, policy per socket, closing ----------------------------------------------------

async def test_connections_beyond_the_bound_are_refused_at_once(sock_dir, echo):
    async with await _gate(sock_dir, [echo.address], limits=Limits(connections=4)) as gate:
        held = [await tunnel(gate, echo.address) for _ in range(4)]
        assert all(line.endswith("200 Connection established") for line, _, _ in held)
        answer = await ask(gate, f"CONNECT {echo.address} HTTP/1.1\r\n\r\n".encode())
        assert status_of(answer) == 503 and "4 connections open" in body_of(answer)
        for _, _, writer in held:
            writer.close()
        await _until(lambda: len(gate._open) == 0)
        line, _, writer = await tunnel(gate, echo.address)
        assert line.endswith("200 Connection established")
        writer.close()


async def test_a_hundred_tunnels_at_once(sock_dir, echo):
    async with await _gate(sock_dir, [echo.address]) as gate:
        async def one(i: int) -> bytes:
            line, reader, writer = await tunnel(gate, echo.address)
            writer.write(b"%05d" % i * 1000)
            data = await asyncio.wait_for(reader.readexactly(5000), WAIT)
            writer.close()
            return data

        got = await asyncio.gather(*(one(i) for i in range(100)))
    assert got == [b"%05d" % i * 1000 for i in range(100)]
    assert sum(r.verdict == "allowed" for r in gate.records) == 100


@pytest.mark.parametrize("how", ["spliced", "copied"])
async def test_64_mib_each_way_byte_for_byte(sock_dir, how, monkeypatch):
    if how == "copied":  # (as where no pipe can be had)
        monkeypatch.setattr(relay, "MAX_SPLICING", 0)
    source, sink = BlobSource(64 << 20), Sink()
    try:
        async with await _gate(sock_dir, [source.address, sink.address]) as gate:
            _, reader, writer = await tunnel(gate, source.address)
            import hashlib

            digest, size = hashlib.sha256(), 0
            while data := await asyncio.wait_for(reader.read(1 << 20), WAIT):
                digest.update(data)
                size += len(data)
            writer.close()
            assert (digest.hexdigest(), size) == (source.sha256, 64 << 20)
            _, reader, writer = await tunnel(gate, sink.address)
            for _ in range(64):
                writer.write(source.chunk)
                await writer.drain()
            writer.write_eof()
            assert (await asyncio.wait_for(reader.read(), WAIT)).decode().split() == [source.sha256, str(64 << 20)]
            writer.close()
            await _until(lambda: all(r.seconds is not None for r in gate.records))
        assert [(r.sent, r.received) for r in gate.records] == [(0, 64 << 20), (64 << 20, 66 + len(str(64 << 20)))]
    finally:
        source.close()
        sink.close()


async def test_each_socket_applies_its_own_policy(sock_dir, echo, index):
    (sock_dir / "a").mkdir()
    (sock_dir / "b").mkdir()
    async with await _gate(sock_dir / "a", [echo.address]) as a, await _gate(sock_dir / "b", [index.address]) as b:
        assert status_of(await ask(a, f"CONNECT {index.address} HTTP/1.1\r\n\r\n".encode())) == 403
        assert status_of(await ask(b, f"CONNECT {echo.address} HTTP/1.1\r\n\r\n".encode())) == 403
        line, _, writer = await tunnel(b, index.address)
        assert line.endswith("200 Connection established")
        writer.close()
    assert echo.connections == 0


async def test_closing_ends_every_tunnel_and_removes_the_socket(sock_dir, echo):
    gate = await _gate(sock_dir, [echo.address])
    assert os.stat(gate.path).st_mode & 0o777 == 0o600
    _, reader, writer = await tunnel(gate, echo.address)
    await gate.close()
    assert await asyncio.wait_for(reader.read(), WAIT) == b""  # the open tunnel ended with the gate
    writer.close()
    assert not gate.path.exists()
    with pytest.raises(OSError):
        await asyncio.open_unix_connection(str(gate.path))
    assert gate.records[0].why == "closed"


async def test_records_are_bounded(sock_dir, echo):
    async with await _gate(sock_dir, [], limits=Limits(records=3)) as gate:
        for _ in range(5):
            await ask(gate, f"CONNECT {echo.address} HTTP/1.1\r\n\r\n".encode())
    assert (len(gate.records), gate.dropped) == (3, 2)


async def _until(predicate, bound: float = WAIT) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)  # polling the gate's own state, bounded
