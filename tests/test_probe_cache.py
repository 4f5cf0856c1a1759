"""The interpreter probes' kept answers (engine.sandbox._probe_cache): given again only while
nothing they were made from changed, and never from a file the user would not have written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sandbox._probe_cache import remembered
from tests.conftest import Unprivileged

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def install(tmp_path, monkeypatch):
    """A made-up installation: an interpreter file and two directories it imports from."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_bytes(b"\x7fELF" + bytes(60))  # (an interpreter itself, as far as the kept answers go)
    site, lib = tmp_path / "site-packages", tmp_path / "lib"
    site.mkdir()
    lib.mkdir()
    (site / "one.pth").write_text(str(lib) + "\n")
    return python, site, lib


def asker(answer):
    asked = []

    def ask():
        asked.append(1)
        return answer

    return ask, asked


def recall(python, ask, settle_ns=0):
    return remembered("test", str(python), ask, lambda a: isinstance(a, list), lambda a: a, settle_ns=settle_ns)


def test_an_answer_is_given_again_while_nothing_it_depends_on_changed(install):
    python, site, lib = install
    ask, asked = asker([str(site), str(lib)])
    assert recall(python, ask) == [str(site), str(lib)]
    assert recall(python, ask) == [str(site), str(lib)]
    assert len(asked) == 1


@pytest.mark.parametrize("change", ["new pth", "pth edited", "sitecustomize", "package added", "interpreter"])
def test_any_change_to_what_it_was_made_from_asks_again(install, change):
    python, site, lib = install
    ask, asked = asker([str(site), str(lib)])
    recall(python, ask)
    if change == "new pth":
        (site / "two.pth").write_text("/elsewhere\n")
    elif change == "pth edited":
        (site / "one.pth").write_text(str(lib) + "\n/elsewhere-too\n")
    elif change == "sitecustomize":
        (lib / "sitecustomize.py").write_text("import sys\n")
    elif change == "package added":
        (lib / "zmq").mkdir()
        os.utime(lib, ns=(0, 0))  # (its ctime moves all the same: no process can set that back)
    else:
        python.write_bytes(b"\x7fELF" + bytes(61))
    recall(python, ask)
    assert len(asked) == 2


def test_a_launcher_script_is_asked_every_time(install):
    """pyenv's shim picks its interpreter by a file and a variable of its own."""
    python, site, _ = install
    python.write_text("#!/bin/sh\nexec python3.11 \"$@\"\n")
    ask, asked = asker([str(site)])
    recall(python, ask)
    recall(python, ask)
    assert len(asked) == 2


def test_an_answer_made_while_its_files_were_changing_is_not_kept(install):
    python, site, lib = install
    ask, asked = asker([str(site)])
    recall(python, ask, settle_ns=3600 * 10**9)  # (everything here changed within the hour)
    recall(python, ask, settle_ns=3600 * 10**9)
    assert len(asked) == 2


@pytest.mark.parametrize("damage", ["mode", "garbage", "shape", "link"])
def test_a_kept_file_not_as_agentloop_wrote_it_is_not_obeyed(install, damage):
    python, site, _ = install
    ask, asked = asker([str(site)])
    recall(python, ask)
    [kept] = (Path(os.environ["XDG_STATE_HOME"]) / "agentloop" / "probes").iterdir()
    if damage == "mode":
        kept.chmod(0o644)
    elif damage == "garbage":
        kept.write_bytes(b"\xff{not json")
    elif damage == "shape":
        record = json.loads(kept.read_text())
        kept.write_text(json.dumps({**record, "answer": {"not": "a list"}}))
    else:
        other = kept.with_name("elsewhere")
        kept.rename(other)
        kept.symlink_to(other)
    assert recall(python, ask) == [str(site)]
    assert len(asked) == 2


def test_the_workers_python_is_asked_once_across_commands(tmp_path):
    """Two commands in turn: the second starts the workers' Python for neither probe, and still
    runs every judgement of the trust check (a kept answer the check would refuse is refused)."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    code = ("import sys, time; from engine.sandbox._interpreter import trusted_python, _probe;"
            "trusted_python(sys.executable); print(_probe(sys.executable).version)")
    first = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert first.stdout.strip() == sys.version.split()[0]
    probes = tmp_path / "state" / "agentloop" / "probes"
    kept = sorted(probes.iterdir())
    assert len(kept) == 2  # the site-free probe's and the full one's
    for file in kept:  # marked, to tell a kept answer from a fresh one
        record = json.loads(file.read_text())
        if isinstance(record["answer"], dict):
            record["answer"]["version"] = "kept"
            file.write_text(json.dumps(record))
    again = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert again.stdout.strip() == "kept"
    for file in kept:  # a path a worker could write, named by a kept answer: still refused
        record = json.loads(file.read_text())
        if isinstance(record["answer"], list):
            planted = tmp_path / "planted"
            planted.mkdir(mode=0o777)
            planted.chmod(0o777)
            record["answer"].append(str(planted))
            from engine.sandbox._probe_cache import _fingerprint

            record["fingerprint"] = _fingerprint(sys.executable, record["answer"])
            file.write_text(json.dumps(record))
    refused = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "planted" in refused.stderr and "writable by every user" in refused.stderr


def test_an_answer_is_given_again_only_in_the_context_it_was_made_in(install):
    python, site, _ = install
    ask, asked = asker([str(site)])

    def in_context(context):
        return remembered("test", str(python), ask, lambda a: isinstance(a, list), lambda a: a, settle_ns=0,
                          context=context)

    in_context(["boot-1", "96362"])
    in_context(["boot-1", "96362"])
    assert len(asked) == 1
    in_context(["boot-2", "96362"])  # (rebooted, or a setting changed: asked again)
    assert len(asked) == 2


def test_an_answer_valid_rejects_is_asked_every_time(install):
    python, _, _ = install
    ask, asked = asker("refused")
    for _ in range(2):
        assert remembered("test", str(python), ask, lambda a: a is None, lambda a: [], settle_ns=0) == "refused"
    assert len(asked) == 2


_FORK_PROBE = """
import json, sys
from engine.sandbox import _host
if sys.argv[1] == "watched":  # (a probe run now would say so)
    _host._fork_server_probe = lambda bwrap: "probed again"
print(json.dumps(_host.fork_server_problem()))
"""


def test_a_plain_users_fork_server_probe_is_run_once_across_commands(unprivileged: Unprivileged):
    """Its answer (that a user namespace below bubblewrap's is allowed) is kept: the next
    command does not start the probe's interpreter again."""
    env = {**unprivileged.env, "PYTHONPATH": f"{ROOT}:{unprivileged.env.get('PYTHONPATH', '')}",
           "XDG_STATE_HOME": str(unprivileged.home / "state")}

    def command(mode: str):
        done = subprocess.run([*unprivileged.python, "-c", _FORK_PROBE, mode], cwd=unprivileged.home, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    first = command("first")
    if first is not None:
        pytest.skip(f"no fork server for a plain user here: {first}")
    assert command("watched") is None
