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


# -- the owner's token ------------------------------------------------------------------------

import os  # noqa: E402
import stat  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
from starlette.responses import Response  # noqa: E402

from engine.errors import ConfigError  # noqa: E402
from engine.integrations.http_gate import ServerToken, TokenGate  # noqa: E402

TOKEN = ServerToken("tok-" + "x" * 40, Path("/nowhere/server-token"))


async def test_only_requests_that_carry_the_token_reach_the_app():
    seen: list[str] = []

    async def app(scope, receive, send):
        seen.append(scope["path"])
        await Response("ok")(scope, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(TokenGate(app, token=TOKEN)),
                                 base_url="http://127.0.0.1:9") as client:
        async def status(path: str, **headers: str) -> int:
            return (await client.get(path, headers=headers)).status_code

        assert await status(f"/{TOKEN.value}/mcp") == 200 and seen[-1] == "/mcp"  # the app never sees it
        assert await status(f"/{TOKEN.value}") == 200 and seen[-1] == "/"
        assert await status("/mcp", authorization=f"Bearer {TOKEN.value}") == 200 and seen[-1] == "/mcp"
        assert await status("/mcp", authorization=f"bearer  {TOKEN.value} ") == 200
        before = len(seen)
        for path in ("/mcp", "/", f"/{TOKEN.value}x/mcp", f"/{TOKEN.value[:-1]}/mcp", f"/mcp/{TOKEN.value}",
                     f"//{TOKEN.value}/mcp", f"/{TOKEN.value.upper()}/mcp"):
            assert await status(path) == 401, path
        for header in ("Bearer wrong", f"Basic {TOKEN.value}", f"Bearer {TOKEN.value[:-1]}", "Bearer", "",
                       f"Bearer {TOKEN.value}{TOKEN.value}"):
            assert await status("/mcp", authorization=header) in (401, 403), header
        assert len(seen) == before  # nothing of the refused reached the app
        response = await client.get("/mcp")
        assert "carry its token" in response.text


def test_the_default_token_is_made_once_0600_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    first = ServerToken.load()
    assert first.path == tmp_path / "state" / "agentloop" / "server-token" and len(first.value) >= 40
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(first.path.parent.stat().st_mode) == 0o700
    assert ServerToken.load() == first and first.value not in repr(first)


@pytest.mark.parametrize("problem", ["group-readable", "world-readable", "short", "not-url-safe", "link", "dir",
                                     "missing"])
def test_a_token_file_that_is_not_the_users_alone_or_no_token_is_refused(tmp_path, problem):
    file = tmp_path / "token"
    good = "a" * 43
    file.write_text({"short": "abc", "not-url-safe": "a/" * 20}.get(problem, good) + "\n")
    file.chmod({"group-readable": 0o640, "world-readable": 0o604}.get(problem, 0o600))
    if problem == "link":
        (tmp_path / "link").symlink_to(file)
        file = tmp_path / "link"
    elif problem == "dir":
        file = tmp_path
    elif problem == "missing":
        file = tmp_path / "absent"
    with pytest.raises(ConfigError, match="token file"):
        ServerToken.load(file)
    assert ServerToken.load(tmp_path / "token").value == good if problem in ("link", "dir", "missing") else True
    os.chmod(tmp_path / "token", 0o600)
