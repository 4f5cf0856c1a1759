"""Secrets under unobvious names and inside URLs (``engine.secrets``).

A coordinator's environment holds credentials under many names (``SMTP_PASS``, ``GH_PAT``,
``CI_JOB_JWT``, ...) and inside URLs (``DATABASE_URL=postgres://user:PW@...``, proxies, package
indexes).  None reaches code agentloop runs — a script (``exec FILE``), a sample (``exec
--jsonl``), a worker (``run``) — unless the user passes it by name; and no URL agentloop
shows (an unreachable or failing model endpoint, an OTLP collector) carries its user part
into stderr, a recording, a results file, a run's transcript or a span.  Each check has its
control: the same variable passed with ``--env`` (or ``env_allow``) does reach the code, so
the code really looks where the secrets would be."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from engine.launch import WorkerSettings
from engine.scripted import Fail, ScriptedServer
from engine.workers import Engine
from tests.conftest import closed_port

from .harness import WAIT, attack

pytestmark = pytest.mark.attack

AGENTLOOP = [sys.executable, "-P", "-m", "engine.cli"]


def _pw(tag: str) -> str:
    return f"{tag}-{secrets.token_hex(6)}"


#: Variables a coordinator holds, by the families of names that hold credentials.
NAMED = {name: _pw(name.lower()) for name in (
    "SMTP_PASS", "BASIC_AUTH", "MYSQL_PWD", "GH_PAT", "GITHUB_PAT", "NPM_CONFIG__AUTH", "DOCKER_AUTH_CONFIG",
    "PGPASS", "VAULT_PASS", "CI_JOB_JWT", "SLACK_WEBHOOK", "SENTRY_DSN", "SESSION_COOKIE", "GCP_CREDENTIALS",
    "SSH_PRIVATE_KEY_B64", "OPENAI_API_KEY", "client_secret", "MY_TOKEN", "PGPASSWORD")}
#: Variables whose names say nothing, holding URLs with credentials: (name, value, the secret in it).
_URL_PASSWORDS = {name: _pw(name.lower()) for name in ("DATABASE_URL", "REDIS_URL", "HTTPS_PROXY", "PIP_INDEX_URL",
                                                       "MONGODB_URI", "AMQP_ADDR", "GIT_REMOTE", "STORAGE_URL")}
IN_URLS = {
    "DATABASE_URL": f"postgres://app:{_URL_PASSWORDS['DATABASE_URL']}@db.internal:5432/app",
    "REDIS_URL": f"redis://:{_URL_PASSWORDS['REDIS_URL']}@cache:6379/0",
    "HTTPS_PROXY": f"http://proxyuser:{_URL_PASSWORDS['HTTPS_PROXY']}%40x@proxy:3128",
    "PIP_INDEX_URL": f"https://__token__:{_URL_PASSWORDS['PIP_INDEX_URL']}@pypi.example/simple",
    "MONGODB_URI": f"mongodb+srv://u:{_URL_PASSWORDS['MONGODB_URI']}@c.example/?retryWrites=true",
    "AMQP_ADDR": f"amqps://u:{_URL_PASSWORDS['AMQP_ADDR']}@mq/vhost",
    "GIT_REMOTE": f"https://{_URL_PASSWORDS['GIT_REMOTE']}@github.com/org/repo.git",
    "STORAGE_URL": f"https://bucket.example/object?X-Sig=1&password={_URL_PASSWORDS['STORAGE_URL']}",
}
#: Ordinary variables the patterns must not catch: they reach the code.
ORDINARY = {"PWD_LIKE_NOT": "x", "GIT_AUTHOR_NAME": "A. Author", "PUBLIC_URL": "https://example.org/x?page=2",
            "SSH_URL": "ssh://git@example.org/repo", "BYPASS_NOTE": "", "KEYBOARD_LAYOUT_X": ""}
ORDINARY = {k: v for k, v in ORDINARY.items() if v}  # (the empty ones: placeholders, not passed)
SECRET_VALUES = [*NAMED.values(), *_URL_PASSWORDS.values()]

PRINT_ENVIRON = "import json, os\nprint('ENVIRON ' + json.dumps(dict(os.environ)))\n"


def _environ_in(text: str) -> dict[str, str]:
    line = next(x for x in text.splitlines() if x.startswith("ENVIRON "))
    return json.loads(line[len("ENVIRON "):])


def _coordinator_env(tmp_path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "AGENTLOOP_PYTHON")}
    return {**env, **NAMED, **IN_URLS, **ORDINARY, "XDG_STATE_HOME": str(tmp_path / "state"), **more}


def _assert_none_reached(environ: dict[str, str], text: str) -> None:
    leaked = [name for name in (*NAMED, *IN_URLS) if name in environ]
    assert leaked == [], f"reached the code: {leaked}"
    assert not [v for v in SECRET_VALUES if v in text], "a secret value reached the code"


def test_exec_passes_no_secret_by_name_or_in_a_url(tmp_path: Path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "env.py").write_text(PRINT_ENVIRON)
    proc = subprocess.run([*AGENTLOOP, "-v", "exec", "env.py"], capture_output=True, text=True, cwd=project,
                          env=_coordinator_env(tmp_path), timeout=WAIT * 4)
    assert proc.returncode == 0, proc.stderr
    got = _environ_in(proc.stdout)
    _assert_none_reached(got, proc.stdout)
    assert {k: got.get(k) for k in ORDINARY} == ORDINARY and got.get("PWD") == str(project), got
    said = next(x for x in proc.stderr.splitlines() if "look like secrets" in x)  # -v names them, no value
    assert all(name in said for name in (*NAMED, *IN_URLS)) and not [v for v in SECRET_VALUES if v in proc.stderr]
    # The control: passed by name, every one of them reaches the script.
    passed = [arg for name in (*NAMED, *IN_URLS) for arg in ("--env", name)]
    proc = subprocess.run([*AGENTLOOP, "exec", *passed, "env.py"], capture_output=True, text=True, cwd=project,
                          env=_coordinator_env(tmp_path), timeout=WAIT * 4)
    got = _environ_in(proc.stdout)
    assert {k: got.get(k) for k in (*NAMED, *IN_URLS)} == {**NAMED, **IN_URLS}, proc.stderr


def test_exec_jsonl_samples_get_no_secret(tmp_path: Path):
    (tmp_path / "s.jsonl").write_text(json.dumps({"id": "a", "code": PRINT_ENVIRON, "env": {"TZ": "XYZ+3"}}) + "\n")
    proc = subprocess.run([*AGENTLOOP, "exec", "--jsonl", "s.jsonl", "-o", "out.jsonl", "--progress", "none"],
                          capture_output=True, text=True, cwd=tmp_path, env=_coordinator_env(tmp_path),
                          timeout=WAIT * 4)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out.jsonl").read_text())
    got = _environ_in(record["stdout"])
    _assert_none_reached(got, (tmp_path / "out.jsonl").read_text())
    assert got.get("TZ") == "XYZ+3", got  # the control: what the sample's own env sets, it gets


async def test_workers_get_an_allowlist_that_holds_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name, value in {**NAMED, **IN_URLS}.items():
        monkeypatch.setenv(name, value)
    async with Engine(cwd=tmp_path, workspace=tmp_path / "w", state_dir=tmp_path / "state") as engine:
        got = await attack(await engine.start_worker("w"), PRINT_ENVIRON)
    _assert_none_reached(_environ_in(got.result.output), got.result.output)
    # The control: a variable the settings allow does reach a worker, so the scan would see one.
    allowed = WorkerSettings(env_allow=("DATABASE_URL",))
    async with Engine(allowed, cwd=tmp_path, workspace=tmp_path / "w", state_dir=tmp_path / "state") as engine:
        got = await attack(await engine.start_worker("w"), PRINT_ENVIRON)
    assert _environ_in(got.result.output).get("DATABASE_URL") == IN_URLS["DATABASE_URL"], got.result.output


PASSWORD = "model-pw-" + secrets.token_hex(6)
OTLP_PASSWORD = "otlp-pw-" + secrets.token_hex(6)


def _everything(tmp_path: Path, *texts: str) -> str:
    """``texts`` and every file under ``tmp_path`` (recordings, results, transcripts, state)."""
    files = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size < 1 << 24]
    return "\n".join([*texts, *files])


def test_an_unreachable_model_url_shows_no_password(tmp_path: Path):
    from tests.otlp_receiver import Receiver  # (the otel extra: installed by scripts/test)

    url = f"http://agent:{PASSWORD}@127.0.0.1:{closed_port()}/v1"
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "task": "hello"}) + "\n")
    shown = []
    with Receiver() as rx:
        env = _coordinator_env(tmp_path, LLM_URL=url, OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint)
        for args in (["--trace", "run", "hello", "-q", "--record", "rec.jsonl"], ["doctor"], ["models"],
                     ["-v", "batch", "tasks.jsonl", "-o", "out.jsonl"], ["chat", "-q"]):
            proc = subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                                  timeout=WAIT * 4, input="hi\n")
            shown += [proc.stdout, proc.stderr]
        assert rx.wait_for(lambda spans: any(s.name == "invoke_agent main" for s in spans))
        spans = json.dumps([vars(s) for s in rx.spans], default=str)
    said = "\n".join(shown)
    assert f"cannot reach the model at http://***@127.0.0.1:{url.rsplit(':', 1)[1]}" in said, said  # it was shown
    assert "agent:" not in said and PASSWORD not in _everything(tmp_path, said, spans)


def test_a_failing_model_url_shows_no_password_in_results_or_transcripts(tmp_path: Path):
    from tests.otlp_receiver import Receiver

    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "task": "hello"}) + "\n")
    with ScriptedServer({"hello": [Fail(404, 5), "never"]}) as model, Receiver() as rx:
        url = model.url.replace("http://", f"http://agent:{PASSWORD}@")
        env = _coordinator_env(tmp_path, LLM_URL=url, OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint)
        proc = subprocess.run([*AGENTLOOP, "--trace", "batch", "tasks.jsonl", "-o", "out.jsonl", "--progress",
                               "lines"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=WAIT * 4)
        assert rx.wait_for(lambda spans: any(s.name == "invoke_agent main" for s in spans))
        spans = json.dumps([vars(s) for s in rx.spans], default=str)
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert record["status"] == "failed" and "answered HTTP 404" in record["error"], record  # it reached the server
    assert "http://***@127.0.0.1" in record["error"], record["error"]
    assert Path(record["transcript"]).is_file()
    assert PASSWORD not in _everything(tmp_path, proc.stdout, proc.stderr, spans)


def test_an_otlp_endpoint_with_a_password_is_shown_without_it(tmp_path: Path):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    with ScriptedServer({"*": ["plain answer"]}) as model:
        env = _coordinator_env(tmp_path, LLM_URL=model.url,
                               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://collector:{OTLP_PASSWORD}@127.0.0.1:{closed_port()}")
        proc = subprocess.run([*AGENTLOOP, "-v", "--trace", "run", "x", "-q"], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=WAIT * 4)
    assert proc.returncode == 0 and proc.stdout == "plain answer\n", proc.stderr
    assert "traces could not all be sent to http://***@127.0.0.1:" in proc.stderr, proc.stderr  # it was shown
    assert OTLP_PASSWORD not in _everything(tmp_path, proc.stderr)
