"""engine.integrations.http_gate: which Host and Origin headers reach the MCP server."""

from __future__ import annotations

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed (scripts/test installs it)")

from engine.integrations.http_gate import host_allowed, origin_allowed  # noqa: E402


@pytest.mark.parametrize("host", [
    "127.0.0.1:8000", "127.0.0.2:8000", "127.9.9.9", "10.0.0.5:80", "192.168.1.20:8000", "0.0.0.0:1",
    "[::1]:8000", "[::1]", "[fe80::1]:9", "localhost:8000", "LOCALHOST", "devbox:8000",
])
def test_hosts_that_name_an_address_localhost_or_an_allowed_name(host):
    assert host_allowed(host, {"devbox"})


@pytest.mark.parametrize("host", [
    None, "", "attacker.example:8000", "attacker.example", "localhost.:8000", "127.0.0.1.nip.io:8000",
    "devbox.attacker.example", "::1", "[::1", "[::1]x", "[localhost]:80", "127.0.0.1:http", ":8000",
    "user@127.0.0.1",
])
def test_hosts_refused(host):
    assert not host_allowed(host, {"devbox"})


@pytest.mark.parametrize("origin, host", [
    (None, "attacker.example"),  # not a web page: the Host check decides
    ("http://localhost:6274", "127.0.0.1:8000"), ("https://127.0.0.1:3000", "127.0.0.1:8000"),
    ("http://[::1]:5173", "[::1]:8000"), ("http://192.168.1.20:8000", "192.168.1.20:8000"),
    ("http://devbox:9000", "10.0.0.5:8000"),
])
def test_origins_of_this_machine_the_named_host_or_an_allowed_name(origin, host):
    assert origin_allowed(origin, host, {"devbox"})


@pytest.mark.parametrize("origin, host", [
    ("http://attacker.example", "127.0.0.1:8000"), ("http://attacker.example:8000", "127.0.0.1:8000"),
    ("null", "127.0.0.1:8000"), ("file://", "127.0.0.1:8000"), ("http://10.0.0.9:80", "192.168.1.20:8000"),
    ("http://127.0.0.1:8000/path", "127.0.0.1:8000"), ("http://user@localhost", "127.0.0.1:8000"),
    ("ftp://localhost", "127.0.0.1:8000"),
])
def test_origins_refused(origin, host):
    assert not origin_allowed(origin, host, {"devbox"})
