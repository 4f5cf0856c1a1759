"""Network egress: TCP and UDP to services on the host's loopback, other hosts, DNS, and the
host's abstract unix sockets.  The worker has a network namespace of its own holding only a
loopback interface; the listeners the tests open count what reaches them.

"Nothing arrived" is shown without waiting: after the attack the test itself connects (or
sends a datagram) and checks that its own marker is the first and only thing received.  On
loopback a connection or datagram is queued when the sender's call returns, so anything the
attack got through would be ahead of the marker."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from .harness import WAIT, Host, agent_attack, assert_still_works, attack, block, needs_namespaces

pytestmark = pytest.mark.attack

# A connection attempt on the worker's own network namespace: refused by its own loopback, or
# unreachable when that loopback is down (or has no address of the family).
NOT_CONNECTED = ("ConnectionRefusedError ECONNREFUSED", "OSError ENETUNREACH", "OSError EADDRNOTAVAIL")


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP server on the host's 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        yield srv


@pytest.fixture
def udp_sink() -> Iterator[socket.socket]:
    """A UDP socket on the host's 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


def assert_never_connected(srv: socket.socket, family: int = socket.AF_INET) -> None:
    """The only connection ``srv`` ever had queued is the test's own marker."""
    with socket.socket(family, socket.SOCK_STREAM) as marker:
        marker.settimeout(WAIT)
        marker.connect(srv.getsockname())
        srv.settimeout(WAIT)
        conn, _ = srv.accept()
        with conn:
            # The marker proves itself by the bytes it sends, whatever the address family.
            marker.sendall(b"marker")
            conn.settimeout(WAIT)
            assert conn.recv(16) == b"marker", "the first connection accepted was not the test's own"
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept()


def assert_nothing_arrived(sink: socket.socket) -> None:
    """The first and only datagram ``sink`` holds is the test's own marker."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        tx.sendto(b"marker", sink.getsockname())
    sink.settimeout(WAIT)
    assert sink.recv(65536) == b"marker", "a datagram arrived before the test's own"
    sink.setblocking(False)
    with pytest.raises(BlockingIOError):
        sink.recv(65536)


async def test_tcp_to_the_hosts_loopback_never_connects(worker, listener):
    needs_namespaces()
    port = listener.getsockname()[1]
    got = await attack(worker, f'''
import socket
probe("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=5).close())
probe("tcp_localhost", lambda: socket.create_connection(("localhost", {port}), timeout=5).close())
probe("tcp_any", lambda: socket.create_connection(("0.0.0.0", {port}), timeout=5).close())
probe("tcp_v6", lambda: socket.create_connection(("::1", {port}), timeout=5).close())
probe("tcp_outside", lambda: socket.create_connection(("192.0.2.1", 80), timeout=5).close())
probe("interfaces", lambda: [name for _, name in socket.if_nameindex()])
''')
    for name in ("tcp", "tcp_localhost", "tcp_any", "tcp_v6"):
        assert got[name] in NOT_CONNECTED, (name, got.probes)
    assert got["tcp_outside"] == "OSError ENETUNREACH", got.probes
    assert got["interfaces"] == "ok ['lo']", got.probes
    assert_never_connected(listener)
    await assert_still_works(worker)


async def test_udp_to_the_hosts_loopback_never_arrives(worker, udp_sink):
    needs_namespaces()
    port = udp_sink.getsockname()[1]
    got = await attack(worker, f'''
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = 0
for i in range(100):
    try:
        sent += s.sendto(b"exfiltrated %d" % i, ("127.0.0.1", {port}))
    except OSError:
        pass
print("udp_sent:", sent)
probe("udp_outside", lambda: s.sendto(b"x", ("192.0.2.1", 53)))
''')
    assert got["udp_outside"] == "OSError ENETUNREACH", got.probes
    assert_nothing_arrived(udp_sink)
    await assert_still_works(worker)


async def test_dns_does_not_resolve(worker):
    needs_namespaces()
    got = await attack(worker, '''
import socket
probe("dns", lambda: socket.getaddrinfo("example.com", 443))
probe("dns_raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(
    b"\\x12\\x34\\x01\\x00\\x00\\x01" + bytes(6) + b"\\x07example\\x03com\\x00\\x00\\x01\\x00\\x01",
    (open("/etc/resolv.conf").read().split("nameserver")[1].split()[0], 53)))
''')
    assert got["dns"].startswith("gaierror"), got.probes
    nameserver = open("/etc/resolv.conf").read().split("nameserver")[1].split()[0]
    if nameserver.startswith("127."):
        # A resolver on the loopback is the sandbox's own (empty) loopback: the query is lost.
        assert got["dns_raw"].startswith("ok"), got.probes
    else:
        assert got["dns_raw"] == "OSError ENETUNREACH", got.probes
    await assert_still_works(worker)


async def test_hosts_abstract_unix_socket_is_unreachable(worker, host: Host):
    """Abstract unix sockets belong to the network namespace: the host's are not there."""
    needs_namespaces()
    name = "\0" + host.token
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(name)
        srv.listen()
        got = await attack(worker, f'''
import socket
probe("abstract", lambda: socket.socket(socket.AF_UNIX).connect({name!r}))
''')
        assert got["abstract"] == "ConnectionRefusedError ECONNREFUSED", got.probes
        assert_never_connected(srv, socket.AF_UNIX)
    await assert_still_works(worker)


async def test_agent_network_egress_is_contained(engine, listener, udp_sink):
    needs_namespaces()
    tcp, udp = listener.getsockname()[1], udp_sink.getsockname()[1]
    code = f'''
import socket
probe("tcp", lambda: socket.create_connection(("127.0.0.1", {tcp}), timeout=5).close())
probe("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {udp})))
probe("dns", lambda: socket.getaddrinfo("example.com", 443))
'''
    run = await agent_attack(engine, block("attack", code), name="network")
    text = run.blocks["attack"]
    assert any(f"tcp: {n}\n" in text for n in NOT_CONNECTED) and "dns: gaierror" in text, text
    assert_never_connected(listener)
    assert_nothing_arrived(udp_sink)
    run.assert_kept_working()
