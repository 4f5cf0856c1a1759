"""A client of ours sends nothing to another user's server on this machine.

Any local account can bind a loopback port first.  The attack as it was found: with the
model endpoint on loopback, ``run`` sent ``Authorization: Bearer $LLM_API_KEY`` to another
user's server there and ran the blocks it replied with.  Here bob (a real second user) serves
a free loopback port with a server that records every request it gets and replies with a block
that would leave a file behind; alice's commands named at it (``run``, ``models``, ``doctor``,
``batch``; ``--trace`` with the collector there) stop in one line naming bob, and bob's record
holds nothing of theirs — no key, no prompt, no span.  The server is real and records what
reaches it (the suite's own request is in the record), and alice's commands did reach it: the
line that stops them names bob, which only his socket could tell.  The same commands against
alice's own server, and against root's, work.  And an endpoint that is only the built-in
default (no ``LLM_URL``) gets no key at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.models import ModelConfig, load_models, unsent_key_note
from engine.models._http import auth_headers
from engine.scripted import ScriptedServer

from .harness import API_KEY, SYSTEM_PYTHON, WAIT, as_user, other_users_problem, readable_pythonpath

pytestmark = pytest.mark.attack

#: bob's server: records each request (method, path, Authorization, body) as a JSON line, and
#: answers as a model would — its reply is a block that leaves a file where it runs.
THIEF = r'''
import http.server, json, socket, sys
log, host = sys.argv[1], sys.argv[2]

class Handler(http.server.BaseHTTPRequestHandler):
    def record(self, body=b""):
        with open(log, "a") as f:
            f.write(json.dumps({"method": self.command, "path": self.path,
                                "authorization": self.headers.get("authorization"),
                                "body": body.decode("utf-8", "replace")[:2000]}) + "\n")

    def answer(self, data):
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.record()
        self.answer({"object": "list", "data": [{"id": "stolen", "object": "model"}]})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.record(body)
        reply = '<run_code>\nopen("pwned-by-bob", "w").write("x")\nprint("pwned")\n</run_code>'
        self.answer({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": reply}}]})

    def log_message(self, *args):
        pass

class Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def server_bind(self):
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] takes IPv4 too
        super().server_bind()

server = Server((host, 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
'''

#: What alice's commands import, for a PYTHONPATH she can use.
_IMPORTS = ("import engine.cli, engine.cli.run, engine.cli.models, engine.cli.doctor, engine.cli.batch, "
            "engine.cli.scripted, engine.agent._task, engine.models._client, engine.models._server, "
            "engine.launch._doctor, engine.batch.local, engine.batch.sample_file, engine.observe._tracing, "
            "engine.observe._collector, engine.observe._spans, httpx, httpcore, anyio._backends._asyncio, sniffio, "
            "requests, urllib3, opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http.trace_exporter; "
            "httpx.create_ssl_context()")


@dataclass
class Thief:
    """bob's recording server: where it listens and what it received."""

    host: str
    port: int
    log: Path

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/v1"

    def received(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@contextlib.contextmanager
def thief(where: Path, host: str = "127.0.0.1") -> Iterator[Thief]:
    """bob's server on a free port of ``host``, recording into ``where`` (a directory of bob's)."""
    log = where / f"received-{secrets.token_hex(3)}.jsonl"
    proc = subprocess.Popen([*as_user("bob"), SYSTEM_PYTHON, "-I", "-c", THIEF, str(log), host], cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})
    try:
        port = proc.stdout.readline().strip()
        assert port.isdigit(), proc.stderr.read() if proc.poll() is not None else port
        found = Thief(host, int(port), log)
        # The server is real and records what reaches it: the suite's own request is there.
        probe = urllib.request.Request(found.url + "/models", headers={"Authorization": "Bearer the-suite's-probe"})
        with urllib.request.urlopen(probe, timeout=WAIT) as answer:
            assert answer.status == 200
        assert [r["authorization"] for r in found.received()] == ["Bearer the-suite's-probe"]
        log.write_text("")
        yield found
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(WAIT)
        proc.stdout.close()
        proc.stderr.close()


@dataclass
class Alice:
    home: Path
    path: str  # her PYTHONPATH

    def project(self) -> Path:
        project = Path(tempfile.mkdtemp(prefix="project-", dir=self.home))
        os.chmod(project, 0o755)
        _give(project, "alice")
        return project

    def agentloop(self, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
        full = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8",
                "XDG_STATE_HOME": str(self.home / "state"), "LLM_API_KEY": API_KEY, "PYTHONPATH": self.path, **env}
        return subprocess.run([*as_user("alice"), SYSTEM_PYTHON, "-P", "-m", "engine.cli", *args], cwd=cwd, env=full,
                              capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def _give(path: Path, user: str) -> None:
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="module")
def users_path() -> Iterator[str]:
    problem = other_users_problem("alice", "bob")
    if problem:
        pytest.skip(reason=problem)
    path, copies = readable_pythonpath(_IMPORTS)
    yield path
    shutil.rmtree(copies, ignore_errors=True)


@pytest.fixture
def alice(users_path: str) -> Iterator[Alice]:
    home = Path(tempfile.mkdtemp(prefix="agentloop-alice-"))
    os.chmod(home, 0o755)
    _give(home, "alice")
    yield Alice(home, users_path)
    subprocess.run(["rm", "-rf", "--one-file-system", str(home)], timeout=WAIT, check=False)


@pytest.fixture
def bobs(users_path: str) -> Iterator[Path]:
    """A directory of bob's for his server's record (readable by the suite, root)."""
    where = Path(tempfile.mkdtemp(prefix="agentloop-bob-"))
    os.chmod(where, 0o755)
    _give(where, "bob")
    yield where
    shutil.rmtree(where, ignore_errors=True)


def assert_stopped_naming_bob(proc: subprocess.CompletedProcess, thief: Thief, project: Path) -> None:
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    named = [line for line in proc.stderr.splitlines() if "uid" in line and "bob" in line]
    assert named and "another user of this machine" in named[0], proc.stderr
    assert f"uid {pwd.getpwnam('bob').pw_uid}, bob" in named[0], named[0]
    assert API_KEY not in proc.stderr + proc.stdout
    assert thief.received() == [], f"bob's server got {thief.received()}"
    assert not any(project.rglob("pwned-by-bob"))


def _v6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host, named", [("127.0.0.1", "127.0.0.1"), ("127.0.0.1", "localhost"),
                                         ("::", "127.0.0.1"), ("::1", "[::1]"), ("0.0.0.0", "127.0.0.1")])
def test_run_named_at_bobs_port_stops_before_sending_anything(alice: Alice, bobs: Path, host: str, named: str):
    if ":" in host and not _v6_loopback():
        pytest.skip(reason="no IPv6 loopback here")
    project = alice.project()
    with thief(bobs, host) as bob:
        proc = alice.agentloop("run", "tidy up my files", "-q", "--workspace", ".", cwd=project,
                               LLM_URL=f"http://{named}:{bob.port}/v1")
        assert_stopped_naming_bob(proc, bob, project)


def test_models_doctor_and_batch_named_at_bobs_port_send_nothing(alice: Alice, bobs: Path):
    project = alice.project()
    tasks = project / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "task": "tidy up"}) + "\n")
    _give(tasks, "alice")
    with thief(bobs) as bob:
        for args in (("models",), ("doctor",), ("batch", "tasks.jsonl", "-o", "out.jsonl", "--progress", "none")):
            proc = alice.agentloop(*args, cwd=project, LLM_URL=bob.url)
            text = proc.stdout + proc.stderr
            assert f"uid {pwd.getpwnam('bob').pw_uid}, bob" in text and "another user of this machine" in text, \
                (args, text)
            assert API_KEY not in text and bob.received() == [], (args, bob.received())
            if args[0] != "models":  # (models lists the alias, with the words for its server)
                assert proc.returncode != 0, (args, text)


def test_traces_go_to_no_collector_of_bobs(alice: Alice, bobs: Path):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed (scripts/test installs it)")
    project = alice.project()
    with thief(bobs) as bob, ScriptedServer({"*": ["all tidy"]}) as model:  # root's model server: allowed
        for endpoint in (f"http://127.0.0.1:{bob.port}", f"http://localhost:{bob.port}"):
            proc = alice.agentloop("--trace", "run", "tidy up", "-q", "--workspace", ".", cwd=project,
                                   LLM_URL=model.url, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
            assert proc.returncode == 125, proc.stderr
            assert "tracing: the trace collector at" in proc.stderr and ", bob)" in proc.stderr, proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert bob.received() == [] and model.requests == []


def test_the_collector_session_checks_each_connection(bobs: Path):
    """The trace exporter's HTTP session, as it runs inside a command: a connection to bob's
    collector is refused before a byte is written (the start-up check aside)."""
    problem = other_users_problem("bob")
    if problem:
        pytest.skip(reason=problem)
    pytest.importorskip("requests")
    from engine.errors import ForeignServer
    from engine.observe._collector import checked_session

    with thief(bobs) as bob:
        session = checked_session({})
        with pytest.raises(ForeignServer, match="bob"):
            session.post(f"http://127.0.0.1:{bob.port}/v1/traces", data=b"spans of prompts", timeout=WAIT)
        assert bob.received() == []


def test_alices_own_server_and_roots_work(alice: Alice):
    project = alice.project()
    script = project / "script.json"
    script.write_text(json.dumps({"*": ["all tidy"]}))
    _give(script, "alice")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(alice.home), "LANG": "C.UTF-8", "PYTHONPATH": alice.path}
    own = subprocess.Popen([*as_user("alice"), SYSTEM_PYTHON, "-P", "-m", "engine.cli", "scripted", str(script),
                            "--port", "0"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = own.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), own.stderr.read() if own.poll() is not None else url
        proc = alice.agentloop("run", "tidy up", "-q", "--workspace", ".", cwd=project, LLM_URL=url)
        assert proc.returncode == 0 and proc.stdout.strip() == "all tidy", proc.stderr
    finally:
        own.send_signal(signal.SIGTERM)
        own.wait(WAIT)
        own.stdout.close()
        own.stderr.close()
    with ScriptedServer({"*": ["all tidy"]}) as roots:
        proc = alice.agentloop("run", "tidy up", "-q", "--workspace", ".", cwd=project, LLM_URL=roots.url)
        assert proc.returncode == 0 and proc.stdout.strip() == "all tidy", proc.stderr
        assert [r.headers.get("authorization") for r in roots.received if r.path.endswith("/chat/completions")] \
            == [f"Bearer {API_KEY}"]  # a server the user named gets the key


def test_an_endpoint_nobody_named_gets_no_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """With LLM_URL unset the endpoint is only the built-in default, a loopback port anyone may
    hold: no key goes there, and one sentence says so.  Named, by LLM_URL or base_url, it does."""
    monkeypatch.setenv("LLM_API_KEY", API_KEY)
    monkeypatch.chdir(tmp_path)
    default = load_models(env={}).default
    assert not default.url_named and default.api_key() is None and auth_headers(default) == {}
    note = unsent_key_note(load_models(env={}), env={"LLM_API_KEY": API_KEY})
    assert "$LLM_API_KEY is set but no model URL was named" in note and "no key is sent" in note
    assert unsent_key_note(load_models(env={}), env={}) == ""
    named = load_models(env={"LLM_URL": "http://127.0.0.1:9/v1"}).default
    assert named.url_named and auth_headers(named) == {"Authorization": f"Bearer {API_KEY}"}
    # A file's alias: named by its own base_url, or by LLM_URL it inherits; not by the default.
    (tmp_path / "agentloop.toml").write_text('[models.a]\nbase_url = "http://127.0.0.1:9/v1"\n[models.b]\nmodel = "m"\n')
    from_file = load_models("agentloop.toml", env={})
    assert from_file.get("a").api_key() == API_KEY and from_file.get("b").api_key() is None
    assert load_models("agentloop.toml", env={"LLM_URL": "http://127.0.0.1:9/v1"}).get("b").api_key() == API_KEY
    assert ModelConfig(alias="x", base_url="http://h/v1", model="m").url_named  # given in code: named


def test_a_key_for_the_default_endpoint_is_said_not_sent(tmp_path: Path):
    """A real command with LLM_URL unset: the note, in one line; whatever listens at the default
    port gets no key (its owner aside, which the rule above judges)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "OTEL_"))}
    env.update(LLM_API_KEY=API_KEY, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "models"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    notes = [line for line in proc.stderr.splitlines() if "no key is sent" in line]
    assert len(notes) == 1 and "http://127.0.0.1:8080/v1" in notes[0], proc.stderr
