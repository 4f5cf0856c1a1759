"""The plan of ``exec FILE`` (``engine.exec``): what it keeps read-only, shows, refuses,
and which environment the script gets."""

from __future__ import annotations

import os
import sys
import venv
from pathlib import Path

import pytest

from engine.environment import CALLER, environment
from engine.errors import ConfigError
from engine.exec import plan_script
from engine.exec._plan import kept_read_only
from engine.sandbox import SandboxPolicy, host_support
from engine.secrets import secret_names


def test_secrets_are_names_that_look_like_them_or_hold_a_models_key():
    environ = {"HOME": "/h", "OPENAI_API_KEY": "k", "keyboard": "us", "GH_TOKEN": "t", "client_secret": "s",
               "PGPASSWORD": "p", "MY_CREDENTIALS": "c", "VENDOR": "v", "PATH": "/bin"}
    assert secret_names(environ, configured={"VENDOR"}) == {"OPENAI_API_KEY", "keyboard", "GH_TOKEN",
                                                            "client_secret", "PGPASSWORD", "MY_CREDENTIALS", "VENDOR"}
    env = environment(CALLER, environ, passed=("GH_TOKEN", "NEW=1", "ABSENT"), configured={"VENDOR"})
    assert env == {"HOME": "/h", "PATH": "/bin", "GH_TOKEN": "t", "NEW": "1"}


def test_what_stays_read_only_in_a_writable_directory(tmp_path):
    project = tmp_path / "p"
    (project / ".git").mkdir(parents=True)
    (project / "agentloop.toml").write_text("")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(project / "env")
    (project / "notes").mkdir()
    (project / "link").symlink_to(project / "notes")
    assert kept_read_only(project, sys.executable) == (str(project / ".git"), str(project / "agentloop.toml"),
                                                       str(project / "env"))
    python = str(project / "env" / "bin" / "python")
    kept = kept_read_only(project, python)
    assert str(project / "env") in kept and all(p.startswith(str(project)) for p in kept)


def _plan(tmp_path: Path, **kwargs):
    args = {"python": sys.executable, "cwd": tmp_path, "script": None, "write_cwd": True, "workspace": None,
            "environ": {"PATH": "/usr/bin:/bin"}}
    return plan_script(SandboxPolicy(**kwargs.pop("policy", {})), **{**args, **kwargs})


def test_a_script_is_its_sandboxs_pid_1s_child_under_the_hosts_name(tmp_path):
    if host_support().bwrap is None:
        pytest.skip("no bubblewrap here")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "job.py").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    plan = _plan(work, script=str(tools / "job.py"))
    assert plan.argv_prefix[1] == "--as-pid-1" and "--hostname" not in plan.argv_prefix
    assert plan.pid_namespace and plan.cwd == str(work) and plan.writable == str(work)
    at = plan.argv_prefix.index(str(tools))
    assert plan.argv_prefix[at - 1:at + 2] == ["--ro-bind", str(tools), str(tools)]
    assert "/dev/tty" in plan.confine.landlock.dev and not plan.confine.seccomp.lock_session
    assert plan.confine.uid is None  # the script runs as the user


@pytest.mark.parametrize("kwargs, words", [
    ({"cwd": Path("/")}, "filesystem root"),
    ({"workspace": Path("/tmp")}, "--workspace DIR goes with --read-only"),
    ({"policy": {"share_cwd": False}}, "--no-share-cwd goes with --read-only"),
])
def test_what_write_cwd_refuses(tmp_path, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        _plan(tmp_path, **kwargs)


def test_read_only_writes_the_workspace_it_makes(tmp_path):
    plan = _plan(tmp_path, write_cwd=False)
    assert plan.writable == str(tmp_path / "files") and plan.made[-1] == str(tmp_path / "files")
    for made in plan.made:
        os.rmdir(made)


def test_a_directory_holding_agentloops_record_is_not_written(tmp_path, monkeypatch):
    # The record of what code could write tells its files from the user's: no script rewrites it.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with pytest.raises(ConfigError, match="holds .*agentloop's record of what code could write"):
        _plan(tmp_path)
    plan = _plan(tmp_path, write_cwd=False)  # (./files does not hold it)
    assert plan.writable == str(tmp_path / "files")


def test_a_workspace_made_with_its_parents_is_removed_with_them(tmp_path):
    plan = _plan(tmp_path, write_cwd=False, workspace=tmp_path / "a" / "b")
    assert plan.made == (str(tmp_path / "a" / "b"), str(tmp_path / "a"))
    for made in plan.made:
        os.rmdir(made)
