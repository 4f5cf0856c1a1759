"""``--allow-net`` on the commands that serve code from elsewhere: ``agentloop mcp`` (a real MCP
client over stdio), ``agentloop chat`` (a scripted model) and ``agentloop serve`` (a /run_code
request).  Each reaches a listed listener on 127.0.0.2 and is refused, in words naming the
option, an unlisted one there that never sees a connection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sandbox import host_support
from engine.scripted import ScriptedServer
from tests.net_servers import ALLOWED, Canary, Index

pytestmark = pytest.mark.skipif(host_support().bwrap is None, reason="--allow-net needs bubblewrap")

AGENTLOOP = [sys.executable, "-m", "engine.cli"]

#: A block that asks the listed URL and then the unlisted one, a line each: status, or the
#: refusal's code and body.
FETCH = '''
import urllib.request, urllib.error
for url in URLS:
    try:
        with urllib.request.urlopen(url, timeout=20) as answer:
            print("got", answer.status)
    except urllib.error.HTTPError as exc:
        print("refused", exc.code, exc.read().decode(errors="replace").strip()[:300])
'''


@pytest.fixture
def unlisted():
    """A listener on the allowed address, on a port no entry names: nothing may reach it."""
    canary = Canary(ALLOWED)
    yield canary
    canary.assert_untouched()
    canary.close()


def fetch_block(index: Index, unlisted: Canary) -> str:
    return f"URLS = [{index.url + 'egresstest/'!r}, 'http://{unlisted.address}/']\n" + FETCH


def assert_reached_only_the_listed(output: str, index: Index, unlisted: Canary) -> None:
    assert "got 200" in output, output
    assert "refused 403" in output and f"--allow-net {unlisted.address}" in output, output
    assert [path for _, path, _ in index.requests] == ["/simple/egresstest/"]


def _last_user(body: dict) -> str:
    """The block's result as the model read it, '<' shown as '(' (the console hides tags)."""
    return [m["content"] for m in body["messages"] if m["role"] == "user"][-1]


def _dirs(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)  # (a root coordinator's workers run as another uid)
    (tmp_path / "cwd").mkdir()
    return tmp_path / "cwd"


async def test_mcp_run_python_reaches_the_listed_listener_only(tmp_path, index, unlisted):
    pytest.importorskip("mcp", reason="the mcp extra is not installed (scripts/test installs it)")
    from tests.test_mcp import serving, text

    _dirs(tmp_path)
    async with serving(tmp_path, "--allow-net", index.address, cwd=tmp_path / "cwd") as server:
        tools = await server.client.list_tools()
        described = next(t.description for t in tools.tools if t.name == "run_python")
        assert index.address in described and "without network" not in described, described
        result = await server.run(fetch_block(index, unlisted))
        assert not result.is_error, text(result)
        assert_reached_only_the_listed(text(result), index, unlisted)
        seen = [(c["host"], c["port"], c["verdict"]) for c in result.structured_content["network"]]
        assert seen == [(ALLOWED, index.port, "allowed"), (ALLOWED, unlisted.port, "refused")], seen
        assert f"connections: {index.address} allowed" in text(result), text(result)
        assert f"{unlisted.address} refused (" in text(result), text(result)
        quiet = await server.run("print(1)")  # each connection is told once, with its block
        assert "network" in quiet.structured_content and not quiet.structured_content["network"]
        assert "connections:" not in text(quiet), text(quiet)


def test_chat_block_reaches_the_listed_listener_only(tmp_path, index, unlisted):
    cwd = _dirs(tmp_path)
    script = {"fetch": [f"<run_code>\n{fetch_block(index, unlisted)}</run_code>",
                        lambda body: "saw: " + _last_user(body).replace("<", "(")]}
    with ScriptedServer(script) as model:
        env = {**os.environ, "LLM_URL": model.url, "XDG_STATE_HOME": str(tmp_path / "state")}
        done = subprocess.run([*AGENTLOOP, "chat", "--workspace", str(tmp_path / "ws"), "--allow-net", index.address],
                              input="fetch them\n", cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "saw: " in done.stdout, done.stdout + done.stderr
    assert_reached_only_the_listed(done.stdout, index, unlisted)
    assert f"network refused: {unlisted.address}" in done.stderr, done.stderr


def test_serve_run_code_reaches_the_listed_listener_only(tmp_path, index, unlisted):
    pytest.importorskip("uvicorn")
    from tests.test_serve import run_code, serving

    _dirs(tmp_path)
    with serving(tmp_path, "--allow-net", index.address) as server:
        answer = run_code(server, fetch_block(index, unlisted), run_timeout=30)
    assert answer["status"] == "Success", answer
    assert_reached_only_the_listed(answer["run_result"]["stdout"], index, unlisted)
    seen = [(c["host"], c["port"], c["verdict"]) for c in answer["network"]]
    assert seen == [(ALLOWED, index.port, "allowed"), (ALLOWED, unlisted.port, "refused")], seen
