"""The files agentloop obeys, and the record that tells a worker's from the user's: what is kept
read-only in a writable directory, which changes are refused and how a user says "mine".
(The attacks themselves are in tests/security/test_obeyed_files.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import trust
from engine.errors import ConfigError, UntrustedFile
from engine.models import load_models
from engine.sandbox import protected_paths


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def test_protected_paths_lists_what_exists_and_is_not_a_link(tmp_path: Path):
    ws = tmp_path / "ws"
    for venv in ("venv", ".env"):
        (ws / venv).mkdir(parents=True)
        (ws / venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (ws / "data").mkdir()
    (ws / ".git").mkdir()
    (ws / "agentloop.toml").symlink_to(tmp_path / "elsewhere.toml")  # a link: the record judges it
    (ws / "lib").mkdir()
    assert protected_paths(ws, extra=[str(ws / "lib"), str(tmp_path / "outside")]) == (
        str(ws / ".env"), str(ws / ".git"), str(ws / "lib"), str(ws / "venv"))
    (ws / "agentloop.toml").unlink()
    (ws / "agentloop.toml").write_text("")
    assert str(ws / "agentloop.toml") in protected_paths(ws)


def _config(path: Path) -> Path:
    path.write_text('[models.mine]\nbase_url = "http://127.0.0.1:9/v1"\n')
    return path


def test_a_file_changed_while_workers_could_write_is_refused_until_the_user_touches_it(tmp_path: Path):
    ws = tmp_path / "ws"
    ws.mkdir()
    grant = trust.open_grant(ws)
    config = _config(ws / "agentloop.toml")  # as a worker would
    with pytest.raises(UntrustedFile, match="still going .* once that run has ended"):
        load_models(config, env={})
    grant.end()
    with pytest.raises(UntrustedFile) as refused:
        load_models(config, env={})
    line = str(refused.value)
    assert "\n" not in line and f"touch {config}" in line and "could write" in line, line
    time.sleep(0.1)  # (past the window's margin)
    os.utime(config)
    assert load_models(config, env={}).get("mine")


def test_files_from_before_or_after_the_workers_are_the_users(tmp_path: Path):
    ws = tmp_path / "ws"
    ws.mkdir()
    before = _config(ws / "before.toml")
    time.sleep(0.1)
    trust.open_grant(ws).end()
    time.sleep(0.1)
    after = _config(ws / "after.toml")
    assert load_models(before, env={}).get("mine") and load_models(after, env={}).get("mine")


def test_what_was_kept_read_only_stays_trusted_unless_replaced(tmp_path: Path):
    ws = tmp_path / "ws"
    ws.mkdir()
    config = _config(ws / "agentloop.toml")
    grant = trust.open_grant(ws, kept=[str(config)])
    os.utime(config)  # the user, meanwhile, outside the sandbox
    grant.end()
    assert trust.refusal(config) is None
    replaced = ws / "new.toml"
    _config(replaced)
    trust.open_grant(ws, kept=[str(config)]).end()  # (noted while the old file was there)
    os.replace(replaced, config)  # a new file at the kept path is not the one kept
    assert "changed at" in (trust.refusal(config) or "")


def test_a_run_that_died_without_ending_its_window_is_ended_when_noticed(tmp_path: Path, state: Path):
    ws = tmp_path / "ws"
    ws.mkdir()
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent.parent)!r}); from engine import trust; "
            f"trust.open_grant({str(ws)!r}); import os; os._exit(9)")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "XDG_STATE_HOME": str(state)}, check=False,
                   timeout=60)
    config = _config(ws / "agentloop.toml")
    assert "could write" in (trust.refusal(config) or "")  # ended now: the file changed within
    (entry,) = [json.loads(p.read_text()) for p in (state / "agentloop" / "writable").glob("*.json")]
    assert entry["windows"][0]["end"] is not None
    time.sleep(0.1)
    os.utime(config)
    assert trust.refusal(config) is None


def test_the_record_stays_bounded(tmp_path: Path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for _ in range(trust.MAX_WINDOWS + 20):
        trust.open_grant(ws).end()
    (file,) = (trust.record_directory()).glob("*.json")
    windows = json.loads(file.read_text())["windows"]
    assert len(windows) == trust.MAX_WINDOWS
    assert windows[0]["start"] < windows[1]["start"]


def test_a_workspace_may_not_hold_the_record(tmp_path: Path, state: Path):
    with pytest.raises(ConfigError, match="record of what workers could write"):
        trust.refuse_holding_record(state.parent)


def test_a_directory_others_can_write_is_no_place_for_a_configuration(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    config = _config(shared / "agentloop.toml")
    assert "writable by every user" in (trust.owner_refusal(config) or "")
    shared.chmod(0o1777)  # sticky, as /tmp: nobody else may replace the user's file
    assert trust.owner_refusal(config) is None
    config.chmod(0o666)
    assert "writable by every user" in (trust.owner_refusal(config) or "")


def test_directories_that_are_gone_are_forgotten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(trust, "PRUNE_EVERY", 0.0)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        trust.open_grant(tmp_path / name).end()
    (tmp_path / "a").rmdir()
    (tmp_path / "c").mkdir()
    trust.open_grant(tmp_path / "c")  # a new directory sweeps; a run still going is kept
    kept = sorted(json.loads(f.read_text())["directory"] for f in trust.record_directory().glob("*.json"))
    assert kept == [str(tmp_path / "b"), str(tmp_path / "c")]
