"""What agentloop serves over TCP is its owner's alone: ``agentloop mcp --http`` on loopback,
which every account of the machine can reach, answers only requests that carry its token.

The attack as it was found: another local user connects to a plain user's server with plain
MCP (JSON-RPC over HTTP, nothing but the standard library), calls ``run_python`` and prints the
server user's 0600 file.  Here bob (a real second user) does exactly that to alice's server,
without the token and with wrong ones, and runs nothing — no session, no worker, no file; with
the token (as if he had it) the same requests print alice's file, so the attack is real.  The
token lives in a file only alice may read, and never on a command line, which every local
user can read in ``/proc/PID/cmdline``.  Where the suite cannot become other users, the same
requests come from the suite's own user: the gate does not ask who is calling, only for the
token.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed (scripts/test installs it)")

from tests.conftest import REPO, wait_until  # noqa: E402

from .harness import SYSTEM_PYTHON, WAIT, as_user, other_users_problem, readable_pythonpath  # noqa: E402

pytestmark = pytest.mark.attack

#: Seconds a request may take (the first call of a session starts its worker).
CALL = 60.0

#: Plain MCP, standard library only: initialize, then call run_python with CODE.  Prints the
#: status of each step and the tool's result as JSON.  ``BEARER``: "" for none.
PLAIN_MCP = r'''
import json, sys, urllib.error, urllib.request
url, bearer, code = sys.argv[1], sys.argv[2], sys.argv[3]

def post(body, session=None):
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if bearer:
        headers["Authorization"] = "Bearer " + bearer
    if session:
        headers["Mcp-Session-Id"] = session
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("mcp-session-id"), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, None, exc.read().decode()[:300]

def messages(text):
    found = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return found or ([json.loads(text)] if text.strip().startswith("{") else [])

steps = {}
status, session, text = post({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "stranger", "version": "0"}}})
steps["initialize"], steps["said"] = status, text[:300]
if status == 200:
    post({"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    status, _, text = post({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                            "params": {"name": "run_python", "arguments": {"code": code}}}, session)
    steps["call"] = status
    steps["result"] = json.dumps([m["result"] for m in messages(text) if "result" in m])
print(json.dumps(steps))
'''

#: What ``agentloop mcp --http`` imports, for a PYTHONPATH alice can use.
_IMPORTS = ("import engine.cli, engine.cli.mcp, engine.integrations.mcp, engine.integrations.mcp_transports, "
            "engine.launch._doctor, uvicorn, uvicorn.lifespan.on, uvicorn.loops.auto, uvicorn.loops.asyncio, "
            "uvicorn.protocols.http.auto, uvicorn.protocols.http.h11_impl, uvicorn.protocols.websockets.auto, "
            "starlette.routing, mcp.server.streamable_http_manager, httpx, anyio._backends._asyncio, sniffio")


@dataclass
class Server:
    """A running ``agentloop mcp --http``: its process, URL (token in its path), token, project."""

    proc: subprocess.Popen
    url: str
    token: str
    project: Path
    log: Path

    @property
    def port(self) -> int:
        return int(re.search(r":(\d+)/", self.url).group(1))

    def at(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def sessions_started(self) -> list[str]:
        """The client directories the server made in its workspace: one per client that ran code."""
        files = self.project / "files"
        return sorted(p.name for p in files.iterdir()) if files.is_dir() else []


@contextlib.contextmanager
def mcp_server(project: Path, home: Path, *options: str, user: str | None = None,
               pythonpath: str = str(REPO)) -> Iterator[Server]:
    """``agentloop mcp --http 127.0.0.1:0`` in ``project``, as ``user`` (default: the suite's),
    its state in ``home``; stopped by SIGTERM after."""
    log = home / f"server-{secrets.token_hex(3)}.log"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": "",
           "XDG_STATE_HOME": str(home / "state"), "PYTHONPATH": pythonpath}
    argv = [*as_user(user), SYSTEM_PYTHON] if user else [sys.executable]
    with open(log, "w") as errors:
        proc = subprocess.Popen([*argv, "-P", "-m", "engine.cli", "mcp", "--http", "127.0.0.1:0", *options],
                                cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors)
    try:
        assert wait_until(lambda: "serving MCP at" in log.read_text() or proc.poll() is not None, CALL), \
            log.read_text()
        said = re.search(r"serving MCP at (http://\S+)", log.read_text())
        assert said, log.read_text()
        url = said.group(1)
        token = re.fullmatch(r"http://127\.0\.0\.1:\d+/([^/]+)/mcp", url).group(1)
        yield Server(proc, url, token, project, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(WAIT)


def plain_mcp(url: str, code: str, bearer: str = "", user: str | None = None) -> dict:
    """``PLAIN_MCP`` run as ``user`` (default: the suite's user): what each step got."""
    argv = [*as_user(user), SYSTEM_PYTHON] if user else [sys.executable]
    done = subprocess.run([*argv, "-I", "-c", PLAIN_MCP, url, bearer, code], capture_output=True, text=True,
                          timeout=2 * CALL + WAIT, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def refused_variants(server: Server) -> list[tuple[str, str]]:
    """(URL, bearer) pairs that do not carry the server's token: none, a wrong one, one cut
    short, one a character longer, the token in another place of the path."""
    token, wrong = server.token, secrets.token_urlsafe(32)
    return [(server.at("/mcp"), ""), (server.at(f"/{wrong}/mcp"), ""), (server.at("/mcp"), wrong),
            (server.at(f"/{token[:-1]}/mcp"), ""), (server.at(f"/{token}x/mcp"), ""),
            (server.at("/mcp"), token[:-1]), (server.at(f"/mcp/{token}"), ""), (server.at(f"/{wrong}/mcp"), token[::-1]),
            (server.at("/mcp"), "Basic " + token)]


def assert_ran_nothing(server: Server, got: dict, secret: str) -> None:
    assert got["initialize"] in (401, 403), got
    assert "call" not in got and secret not in json.dumps(got), got
    assert server.sessions_started() == [], server.sessions_started()


PROBE = "print(open({path!r}).read())"


@pytest.fixture(scope="module")
def alice_path() -> Iterator[str]:
    problem = other_users_problem("alice", "bob")
    if problem:
        pytest.skip(reason=problem)
    path, copies = readable_pythonpath(_IMPORTS)
    yield path
    shutil.rmtree(copies, ignore_errors=True)


@pytest.fixture
def alice_home() -> Iterator[Path]:
    """A home of alice's (0755 so that the suite's files beneath it can be reached; her own
    files are 0600), removed after."""
    home = Path(tempfile.mkdtemp(prefix="agentloop-alice-"))
    os.chmod(home, 0o755)
    os.chown(home, _uid("alice"), _uid("alice"))
    yield home
    subprocess.run(["rm", "-rf", "--one-file-system", str(home)], timeout=WAIT, check=False)


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


def _alices_project(home: Path) -> tuple[Path, Path, str]:
    """Alice's project, holding a file only she may read: (project, the file, its secret)."""
    project = home / "project"
    project.mkdir()
    secret = "alice-only-" + secrets.token_hex(8)
    private = project / "secret.txt"
    private.write_text(secret + "\n")
    private.chmod(0o600)
    for path in (project, private):
        os.chown(path, _uid("alice"), _uid("alice"))
    return project, private, secret


def test_another_user_cannot_drive_alices_server_without_its_token(alice_path: str, alice_home: Path):
    project, private, secret = _alices_project(alice_home)
    with mcp_server(project, alice_home, user="alice", pythonpath=alice_path) as server:
        code = PROBE.format(path=str(private))
        for url, bearer in refused_variants(server):
            assert_ran_nothing(server, plain_mcp(url, code, bearer, user="bob"), secret)
        # The same requests with the token (in the path, then as a header) do run, as alice:
        # the attack is real, and only the token stops it.
        got = plain_mcp(server.url, code, user="bob")
        assert got.get("call") == 200 and secret in got["result"], got
        got = plain_mcp(server.at("/mcp"), code, server.token, user="bob")
        assert got.get("call") == 200 and secret in got["result"], got
        assert len(server.sessions_started()) == 2


def test_the_token_is_alices_alone_and_on_no_command_line(alice_path: str, alice_home: Path):
    project, _, _ = _alices_project(alice_home)
    with mcp_server(project, alice_home, user="alice", pythonpath=alice_path) as server:
        file = alice_home / "state" / "agentloop" / "server-token"
        st = file.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (_uid("alice"), 0o600)
        assert stat.S_IMODE(file.parent.stat().st_mode) == 0o700  # agentloop's state directory
        assert file.read_text().strip() == server.token
        assert str(file) in server.log.read_text()  # the startup line says where it is kept
        # bob cannot read it (the file, and the directory it is in).
        peek = subprocess.run([*as_user("bob"), "cat", str(file)], capture_output=True, text=True, timeout=WAIT)
        assert peek.returncode != 0 and server.token not in peek.stdout
        # A run_python makes a worker: no process of the server's tree shows the token.
        assert plain_mcp(server.url, "print(1)").get("call") == 200
        assert _token_not_on_command_lines(server)
    # Started again, the server keeps its token: clients configured with the URL keep working.
    with mcp_server(project, alice_home, user="alice", pythonpath=alice_path) as again:
        assert again.token == server.token


def _token_not_on_command_lines(server: Server) -> bool:
    from tests.test_mcp import descendants

    pids = {server.proc.pid, *descendants(server.proc.pid)}
    assert len(pids) > 1, "the server has no worker to look at"
    for pid in pids:
        with contextlib.suppress(OSError):
            line = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert server.token.encode() not in line, (pid, line)
    return True


def test_a_fixed_token_comes_from_a_file_of_alices_never_the_command_line(alice_path: str, alice_home: Path):
    project, private, secret = _alices_project(alice_home)
    fixed = secrets.token_urlsafe(32)
    token_file = alice_home / "token"
    token_file.write_text(fixed + "\n")
    token_file.chmod(0o600)
    os.chown(token_file, _uid("alice"), _uid("alice"))
    with mcp_server(project, alice_home, "--token-file", str(token_file), user="alice", pythonpath=alice_path) as server:
        assert server.token == fixed
        code = PROBE.format(path=str(private))
        for url, bearer in refused_variants(server)[:3]:
            assert_ran_nothing(server, plain_mcp(url, code, bearer, user="bob"), secret)
        got = plain_mcp(server.url, code, user="bob")
        assert got.get("call") == 200 and secret in got["result"], got
        assert _token_not_on_command_lines(server)
        assert not (alice_home / "state" / "agentloop" / "server-token").exists()
    # A token file others may read, or one that is not alice's, is refused in words.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(alice_home), "XDG_STATE_HOME": str(alice_home / "state"),
           "PYTHONPATH": alice_path, "LANG": "C.UTF-8"}
    bobs = alice_home / "bobs-token"
    bobs.write_text(secrets.token_urlsafe(32) + "\n")
    bobs.chmod(0o600)
    os.chown(bobs, _uid("bob"), _uid("bob"))
    for mode, path in ((0o640, token_file), (0o604, token_file), (0o644, bobs)):  # (bob's: one he knows)
        path.chmod(mode)
        proc = subprocess.run([*as_user("alice"), SYSTEM_PYTHON, "-P", "-m", "engine.cli", "mcp", "--http", "127.0.0.1:0",
                               "--token-file", str(path)], cwd=project, env=env, capture_output=True, text=True,
                              timeout=CALL, stdin=subprocess.DEVNULL)
        assert proc.returncode == 125, (mode, proc.stderr)
        assert "the token file" in proc.stderr and "must be yours and no one else's" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_stranger_without_the_token_runs_nothing(tmp_path: Path):
    """The same requests from the suite's own user (any local account is a stranger to the
    gate): refused without the token, served with it."""
    project = tmp_path / "project"
    project.mkdir()
    secret = "owner-only-" + secrets.token_hex(8)
    (project / "secret.txt").write_text(secret)
    with mcp_server(project, tmp_path) as server:
        code = PROBE.format(path=str(project / "secret.txt"))
        for url, bearer in refused_variants(server):
            assert_ran_nothing(server, plain_mcp(url, code, bearer), secret)
        got = plain_mcp(server.url, code)
        assert got.get("call") == 200 and secret in got["result"], got


def test_a_bind_beyond_loopback_still_warns(tmp_path: Path):
    project = tmp_path / "project"
    project.mkdir()
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_RUNTIME_DIR": "", "PYTHONPATH": str(REPO)}
    log = tmp_path / "server.log"
    with open(log, "w") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "mcp", "--http", "0.0.0.0:0"], cwd=project,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors)
    try:
        assert wait_until(lambda: "serving MCP at" in log.read_text() or proc.poll() is not None, CALL)
        text = log.read_text()
        assert "warning:" in text and "plain HTTP" in text and "sees the token" in text, text
        url = re.search(r"serving MCP at (\S+)", text).group(1)
        port = re.search(r":(\d+)/", url).group(1)
        got = plain_mcp(f"http://127.0.0.1:{port}/mcp", "print(1)")
        assert got["initialize"] == 401 and "call" not in got, got
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(WAIT)
