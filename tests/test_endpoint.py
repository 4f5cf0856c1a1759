"""engine.models._endpoint: whose server a connection reached, read from /proc/net/tcp*."""

from __future__ import annotations

import ipaddress
import socket

import httpx
import pytest

from engine.models import address_refusal, checked_client, connection_refusal
from engine.models._endpoint import _hex_address
from engine.scripted import ScriptedServer


def test_proc_net_addresses_are_read_as_the_kernel_writes_them():
    assert _hex_address("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert _hex_address("00000000000000000000000001000000:0050") == (ipaddress.ip_address("::1"), 80)
    assert _hex_address("0000000000000000FFFF00000100007F:0050") == (ipaddress.ip_address("127.0.0.1"), 80)
    assert _hex_address("00000000:0000") == (ipaddress.ip_address("0.0.0.0"), 0)


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_connection_to_ones_own_listener_is_used(family, host):
    try:
        server = socket.socket(family)
        server.bind((host, 0))
    except OSError:
        pytest.skip(reason=f"no {host} here")
    with server:
        server.listen()
        port = server.getsockname()[1]
        assert address_refusal(host, port) is None
        with socket.create_connection((host, port)) as client:
            assert connection_refusal(client) is None


def test_a_server_elsewhere_is_not_judged_here():
    assert address_refusal("192.0.2.1", 80) is None  # TEST-NET-1: not an address of this machine
    assert address_refusal("no-such-host.invalid", 80) is None  # left to the client to report


async def test_the_checked_client_talks_to_ones_own_server():
    with ScriptedServer({"*": ["hi"]}) as server:
        async with checked_client() as client:
            response = await client.get(f"{server.url}/models")
    assert response.status_code == 200


async def test_the_checked_client_keeps_other_hooks():
    seen = []

    async def hook(request: httpx.Request) -> None:
        seen.append(request.url.path)

    with ScriptedServer({"*": ["hi"]}) as server:
        async with checked_client(event_hooks={"request": [hook]}) as client:
            await client.get(f"{server.url}/models")
    assert seen == ["/v1/models"]
