"""Every kind of sandboxed process gets the environment its policy names (``engine.environment``):
a worker (cold and forked), a code sample's slot and the repository tools' process under
``ALLOWLIST``; ``exec FILE``'s script under ``CALLER``.  Each process is
really started and says (or ``/proc`` says) what it was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.environment import ALLOWLIST, CALLER, ENV_ALLOWLIST, environment
from engine.launch import descendants
from engine.samples import Sample
from engine.tools import RepoTools
from engine.workers import Engine

from .conftest import needs_fork_server

PRINT = "import json, os; print(json.dumps(dict(os.environ)))"
#: Variables of the coordinator's own, and which policy passes them.
SECRETS = {"OPENAI_API_KEY": "sk-not-a-real-key", "GH_TOKEN": "ghp-not-real",
           "DATABASE_URL": "postgres://user:pw@db.example/app"}  # (a secret by its value)
ALLOWED, OTHER = "AGENTLOOP_TEST_ALLOWED", "AGENTLOOP_TEST_OTHER"
#: What a launch sets itself, whatever the policy: the process's home, its temporary
#: directory, its bytecode rule, and the working directory bubblewrap names.
SET_BY_LAUNCH = {"HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE", "PWD"}


@pytest.fixture
def coordinator_env(monkeypatch):
    """The coordinator's environment holds secrets, a variable the run allows and one it does not."""
    for name, value in {**SECRETS, ALLOWED: "allowed", OTHER: "other", "LANG": "C.UTF-8"}.items():
        monkeypatch.setenv(name, value)
    return os.environ


def _inherits_as_allowlist(seen: dict[str, str], allow: tuple[str, ...] = (), sets: set[str] = frozenset()) -> None:
    """``seen`` is what ``ALLOWLIST`` (with ``allow``) passes of ``os.environ``, plus what the
    launch sets itself and ``sets``: no other variable of the coordinator's, and no secret."""
    expected = environment(ALLOWLIST, allow=allow)
    assert not set(SECRETS) & set(seen), sorted(set(SECRETS) & set(seen))
    assert OTHER not in seen
    for name, value in expected.items():
        if name not in SET_BY_LAUNCH:
            assert seen.get(name) == value, name
    extra = set(seen) - set(expected) - SET_BY_LAUNCH - set(sets)
    assert not extra, f"passed beyond the allowlist: {sorted(extra)}"
    assert set(expected) <= {*ENV_ALLOWLIST, *allow}


@pytest.mark.parametrize("fork_server", [False, pytest.param(None, marks=needs_fork_server)],
                         ids=["cold", "forked"])
async def test_a_worker_and_a_sample_get_the_allowlist_and_env_allow(coordinator_env, fork_server, tmp_path):
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state", pool=0, fork_server=fork_server,
                      env_allow=(ALLOWED,)) as engine:
        worker = await engine.start_worker("env")
        result = await worker.run(PRINT, timeout=60)
        assert result.status == "ok", result.error
        seen = json.loads(result.output)
        _inherits_as_allowlist(seen, allow=(ALLOWED,))
        assert seen[ALLOWED] == "allowed" and seen["LANG"] == "C.UTF-8"

        samples = [s async for s in engine.map([Sample("env", PRINT, env={"TZ": "UTC"})], timeout=60)]
        assert samples[0].status == "ok", samples[0].stderr
        seen = json.loads(samples[0].stdout)
        _inherits_as_allowlist(seen, allow=(ALLOWED,), sets={"TZ"})
        assert seen[ALLOWED] == "allowed" and seen["TZ"] == "UTC"  # (the sample's own, named in the allowlist)


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if item)


def test_the_tool_process_gets_the_allowlist_alone(coordinator_env, tmp_path):
    # Its code is ours: the run's env_allow is not its business, and nothing else reaches it.
    (tmp_path / "a.txt").write_text("x\n")
    tools = RepoTools(tmp_path)
    try:
        assert "a.txt" in tools.list_dir()
        pid = tools._process.pid
        assert pid is not None
        pids = [pid, *descendants(pid)]
        assert any(b"tool" in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids), "the tool process ran"
        for p in pids:
            seen = _environ_of(p)
            _inherits_as_allowlist(seen)
            assert ALLOWED not in seen
    finally:
        tools.close()


def test_exec_passes_the_callers_environment_minus_its_secrets(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(PRINT + "\n")
    caller = {**os.environ, **SECRETS, OTHER: "other", "PLAIN_SETTING": "kept", "LANG": "C.UTF-8"}
    passed = ("GH_TOKEN", "NEW_ONE=1")
    done = subprocess.run([sys.executable, "-m", "engine.cli", "exec", "--env", passed[0], "--env", passed[1],
                           str(script)], capture_output=True, text=True, timeout=120, env=caller, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    expected = environment(CALLER, caller, passed=passed)
    assert "OPENAI_API_KEY" not in seen and "DATABASE_URL" not in seen  # by name, by value
    assert seen["GH_TOKEN"] == SECRETS["GH_TOKEN"] and seen["NEW_ONE"] == "1"  # asked for by name
    assert seen[OTHER] == "other" and seen["PLAIN_SETTING"] == "kept"
    assert {k: v for k, v in seen.items() if k not in SET_BY_LAUNCH} == \
        {k: v for k, v in expected.items() if k not in SET_BY_LAUNCH}


def test_the_policies_on_a_given_environment():
    environ = {"PATH": "/bin", "TZ": "UTC", "OPENAI_API_KEY": "k", "X_URL": "https://tok@host/", "PLAIN": "p"}
    assert environment(ALLOWLIST, environ) == {"PATH": "/bin", "TZ": "UTC"}
    assert environment(ALLOWLIST, environ, allow=("PLAIN", "ABSENT")) == {"PATH": "/bin", "TZ": "UTC", "PLAIN": "p"}
    assert environment(ALLOWLIST, {})["PATH"]  # a search path, when the coordinator has none
    assert environment(CALLER, environ) == {"PATH": "/bin", "TZ": "UTC", "PLAIN": "p"}
    assert environment(CALLER, environ, passed=("OPENAI_API_KEY", "N=1"), configured=("PLAIN",)) == \
        {"PATH": "/bin", "TZ": "UTC", "OPENAI_API_KEY": "k", "N": "1"}
