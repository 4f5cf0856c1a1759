"""MCP clients of one ``agentloop mcp --http`` server against each other, and web pages against it.

Two clients connect with the SDK's own client, each an MCP session of its own: everything one
of them made (sessions, their variables, their files, the directory names) is out of the
other's reach by every tool, by the resources and from inside its own sandbox, and a file the
user put in the workspace is nobody's resource.  When a client ends its MCP session its
workers stop at once; the other's keep running.

A web page must not drive the server through DNS rebinding, whatever address it is bound to:
a Host that names no address (the rebinding domain) or an Origin of another site is refused
before the SDK sees the request.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed (scripts/test installs it)")

import anyio  # noqa: E402
import httpx  # noqa: E402
from mcp import Client, ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

from tests.conftest import wait_until  # noqa: E402
from tests.test_mcp import alive  # noqa: E402

from .harness import WAIT  # noqa: E402

pytestmark = pytest.mark.attack

#: Seconds one MCP request may take, at most (a session's first call starts its worker).
CALL = 60.0


@contextlib.contextmanager
def http_server(tmp_path: Path, address: str = "127.0.0.1") -> Iterator[tuple[str, Path, Path]]:
    """``agentloop mcp --http ADDRESS:0`` in a project directory, with the default workspace
    (``./files``, beneath the directory the workers are shown); yields its URL, the project
    directory and the server's log.  Stopped by SIGTERM after."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    log = tmp_path / f"server-{address.replace(':', '_')}.log"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_RUNTIME_DIR": "",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    shown = f"[{address}]" if ":" in address else address
    with open(log, "w") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "-v", "mcp", "--http", f"{shown}:0"],
                                cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=errors)
    try:
        assert wait_until(lambda: "serving MCP at" in log.read_text() or proc.poll() is not None, CALL), \
            log.read_text()
        said = re.search(r"serving MCP at (\S+)", log.read_text())
        assert said, log.read_text()
        yield said.group(1), project, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(WAIT)


@contextlib.asynccontextmanager
async def handshake_client(url: str) -> AsyncIterator[ClientSession]:
    """The SDK's ClientSession over streamable HTTP, initialized: an MCP session of its own,
    ended (DELETE) when the block exits."""
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as client:
        with anyio.fail_after(CALL):
            await client.initialize()
        yield client


async def call(client: ClientSession | Client, tool: str, **arguments) -> tuple[str, dict, bool]:
    """A tool's result: its text, its structured content, whether it is an error."""
    with anyio.fail_after(CALL):
        result = await client.call_tool(tool, arguments)
    text = "".join(part.text for part in result.content if part.type == "text")
    return text, result.structured_content or {}, bool(result.is_error)


async def test_two_http_clients_share_no_session_variable_file_or_name(tmp_path: Path):
    with http_server(tmp_path) as (url, project, log):
        user_secret = "the-user's-own-" + os.urandom(4).hex()
        (project / "files" / "notes").mkdir(parents=True)
        (project / "files" / "notes" / "secret.txt").write_text(user_secret)
        a_secret, a_file = "a-variable-" + os.urandom(4).hex(), "a-file-" + os.urandom(4).hex()
        async with handshake_client(url) as a:
            # Client A: a variable and a file in its default session, a variable in a named one.
            _, _, error = await call(a, "run_python", code=f"secret = {a_secret!r}")
            assert not error
            _, listed, _ = await call(a, "list_sessions")
            a_workspace = listed["sessions"][0]["workspace"]
            text, _, error = await call(a, "run_python", code=f"open({a_workspace!r} + '/a.txt', 'w').write({a_file!r})")
            assert not error, text
            assert not (await call(a, "run_python", code=f"secret = {a_secret!r}", session="private-a"))[2]
            _, listed, _ = await call(a, "list_sessions")
            a_pids = [s["pid"] for s in listed["sessions"]]

            # Client B, the SDK's high-level Client in its default mode, a session of its own.
            async with Client(url) as b:
                text, listed, _ = await call(b, "list_sessions")
                assert "private-a" not in text and a_secret not in text and a_workspace not in text, text
                assert listed["sessions"] == []
                for session in ("default", "private-a"):  # A's names are B's own, fresh sessions
                    text, _, error = await call(b, "run_python", code="print(secret)", session=session)
                    assert error and "NameError" in text, text
                _, listed, _ = await call(b, "list_sessions")
                assert a_workspace not in {s["workspace"] for s in listed["sessions"]}
                # From inside B's sandbox: the workspace root, A's files by their path, the user's.
                probe = (f"import os\nfor path in [{str(project / 'files')!r}, {a_workspace!r}]:\n"
                         "    for root, dirs, files in os.walk(path):\n"
                         "        for name in files:\n"
                         "            try:\n"
                         "                print('read', open(os.path.join(root, name)).read())\n"
                         "            except OSError as exc:\n"
                         "                print('refused', type(exc).__name__)\n"
                         f"for path in [{a_workspace + '/a.txt'!r}, {str(project / 'files/notes/secret.txt')!r}]:\n"
                         "    try:\n"
                         "        print('read', open(path).read())\n"
                         "    except OSError as exc:\n"
                         "        print('refused', type(exc).__name__)\n")
                text, _, _ = await call(b, "run_python", code=probe)
                assert a_file not in text and user_secret not in text, text
                # Resources: none of A's files, nor the user's, are listed or readable.
                with anyio.fail_after(CALL):
                    uris = [str(r.uri) for r in (await b.list_resources()).resources]
                assert not any("a.txt" in u or "notes" in u for u in uris), uris
                for uri in ("agentloop://default/a.txt", "agentloop://private-a/a.txt",
                            "agentloop://notes/secret.txt"):
                    with pytest.raises(MCPError), anyio.fail_after(CALL):
                        await b.read_resource(uri)
                # B resets "private-a": its own, never A's.
                await call(b, "reset_session", session="private-a")
                text, _, error = await call(a, "run_python", code="print(secret)", session="private-a")
                assert not error and a_secret in text, text

                # A still has all of its own, and only that.
                with anyio.fail_after(CALL):
                    read = await a.read_resource("agentloop://default/a.txt")
                assert read.contents[0].text == a_file
                with pytest.raises(MCPError), anyio.fail_after(CALL):
                    await a.read_resource("agentloop://notes/secret.txt")
                _, b_listed, _ = await call(b, "list_sessions")
                b_pids = [s["pid"] for s in b_listed["sessions"]]

        # A ended its MCP session (the SDK's client sends DELETE on exit): its workers are gone.
        # (B ended first; that another client's workers run on is the next test's.)
        assert wait_until(lambda: not alive(set(a_pids)), WAIT), \
            f"client A's workers outlived its MCP session: {log.read_text()[-2000:]}"
        assert b_pids and set(b_pids).isdisjoint(a_pids)


async def test_a_client_s_workers_stop_when_its_mcp_session_ends_and_no_one_else_s(tmp_path: Path):
    with http_server(tmp_path) as (url, _, log):
        async with handshake_client(url) as b:
            assert not (await call(b, "run_python", code="kept = 42"))[2]
            async with handshake_client(url) as a:
                assert not (await call(a, "run_python", code="x = 1"))[2]
                _, listed, _ = await call(a, "list_sessions")
                a_pids = [s["pid"] for s in listed["sessions"]]
            assert wait_until(lambda: not alive(set(a_pids)), WAIT), log.read_text()[-2000:]
            text, _, error = await call(b, "run_python", code="print(kept)")
            assert not error and text.startswith("42\n"), text
    said = log.read_text()
    assert "1 session of an MCP client closed: it ended its MCP session" in said, said
    assert not re.search(r"[0-9a-f]{32}", said), said  # no MCP session id (a client's credential) in the log


# -- DNS rebinding, on every address ---------------------------------------------------------

def _lan_address() -> str | None:
    """This machine's address on its network, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


_INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
               "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                          "clientInfo": {"name": "rebinding-test", "version": "0"}}}


def _post(url: str, **headers: str) -> int:
    with httpx.Client(timeout=CALL) as http:
        response = http.post(url, json=_INITIALIZE, headers={
            "Accept": "application/json, text/event-stream", **headers})
        return response.status_code


@pytest.mark.parametrize("address", ["127.0.0.2", "0.0.0.0", "::1", "lan"])
async def test_dns_rebinding_is_refused_on_every_address(tmp_path: Path, address: str):
    if address == "lan":
        address = _lan_address() or pytest.skip(reason="this machine has no network address but loopback")
    if address == "::1" and not _has_ipv6_loopback():
        pytest.skip(reason="no IPv6 loopback here")
    with http_server(tmp_path, address) as (url, _, _):
        port = url.rsplit(":", 1)[1].split("/")[0]
        # A page of the attacker's domain, rebound to this address: its Host names the domain.
        assert _post(url, Host=f"attacker.example:{port}") == 421
        assert _post(url, Host="attacker.example") == 421
        # A page of another site, sending to the address itself: its Origin names that site.
        assert _post(url, Origin="http://attacker.example") == 403
        assert _post(url, Origin=f"http://attacker.example:{port}") == 403
        assert _post(url, Origin="null") == 403
        # A client that names the address (or localhost, which is this machine) is served.
        assert _post(url) == 200
        if address in ("0.0.0.0", "127.0.0.1", "::1"):
            assert _post(url, Host=f"localhost:{port}") == 200
        assert _post(url, Origin=f"http://localhost:{port}") == 200
        async with Client(url) as client:
            with anyio.fail_after(CALL):
                tools = await client.list_tools()
        assert "run_python" in {tool.name for tool in tools.tools}
