"""The README's "Start here", run as written: the tour of ``run``, ``batch`` and ``ask``
against the scripted model server, and the first run of ``scripts/agentloop`` on a fresh copy
of the checkout, as root and as an unprivileged user."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from .conftest import alive

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534
WAIT = 300  # seconds: a first setup runs pip


def tour_lines() -> str:
    """The README's tour: the shell block of "Start here" that starts the scripted server."""
    start = ROOT.joinpath("README.md").read_text().split("## Start here", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", start, re.DOTALL)
    [tour] = [b for b in blocks if "scripted --background" in b]
    return tour


def test_the_tour_runs_run_batch_and_ask_against_the_scripted_server(tmp_path):
    lines = tour_lines()
    assert [line.split()[1] for line in lines.splitlines()[1:]] == ["run", "batch", "ask"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "XDG_", "AGENT_"))}
    env["HOME"] = str(tmp_path)  # where the tour's results go (~/agentloop-tour.jsonl)
    before = set(os.listdir(ROOT))
    done = subprocess.run(["bash", "-e", "-c", lines], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=WAIT)
    pid = re.search(r"\(pid (\d+)\)", done.stderr)
    try:
        assert done.returncode == 0, done.stderr
        assert "There are 1229 primes below 10,000" in done.stdout
        assert "1229 primes below 10000" in done.stderr  # what the sandboxed block printed
        results = [json.loads(line) for line in (tmp_path / "agentloop-tour.jsonl").read_text().splitlines()]
        assert sorted((r["id"], r["status"]) for r in results) == [
            ("fibonacci", "answered"), ("hello", "answered"), ("squares", "answered")]
        assert (tmp_path / "agentloop-tour.runs" / "hello" / "workspace" / "hello.txt").is_file()
        assert "engine/agent/_tags.py holds the tag protocol" in done.stdout
        assert ' ⚙ read_file({"path": "engine/agent/_tags.py", "limit": 14})' in done.stderr
        assert set(os.listdir(ROOT)) == before  # nothing left in the checkout
    finally:
        assert pid, done.stderr
        if alive(int(pid.group(1))):
            os.kill(int(pid.group(1)), signal.SIGTERM)


def _copy_of_the_checkout(dest: Path) -> None:
    """The checkout's files as a fresh clone has them (no .venv, no caches)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(reason=f"not a git checkout: {listed.stderr.decode()[-200:]}")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _first_and_second_run(copy: Path, env: dict[str, str], user: list[str]) -> subprocess.Popen:
    script = "scripts/agentloop --version && echo SECOND >&2 && scripts/agentloop --version"
    return subprocess.Popen([*user, "bash", "-c", script], cwd=copy, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(2 * WAIT)  # two pip installs at once: beyond the suite's 120 s on a loaded machine
def test_the_first_run_says_each_step_and_how_long_as_root_and_as_a_plain_user():
    """``scripts/agentloop`` on a fresh copy: one line per step on stderr (stdout stays the
    command's), how long it will take and took; the second run is silent."""
    users = {"self": []}
    if os.geteuid() == 0 and shutil.which("setpriv"):
        users["nobody"] = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    pip = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}  # this machine's index, if any
    base = Path(tempfile.mkdtemp(prefix="agentloop-first-run-"))
    try:
        os.chmod(base, 0o755)
        running = {}
        for name, user in users.items():
            copy = base / name / "agentloop"
            copy.mkdir(parents=True)
            _copy_of_the_checkout(copy)
            env = {**os.environ, "HOME": str(base / name)}
            if name == "nobody":
                env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(base / name), "LANG": "C.UTF-8", **pip}
                subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(base / name)], check=True, timeout=60)
            running[name] = (copy, _first_and_second_run(copy, env, user))
        for name, (copy, proc) in running.items():
            stdout, stderr = proc.communicate(timeout=WAIT)
            assert proc.returncode == 0, f"{name}: {stderr}"
            assert stdout == "agentloop, version 0.1.0\n" * 2, f"{name}: {stdout}"
            first, second = stderr.split("SECOND\n")
            ours = [line for line in first.splitlines() if line.startswith("agentloop: ")]
            assert ours[0].startswith(f"agentloop: first run: setting up {copy}/.venv (about 15 s"), ours
            assert ours[1].startswith("agentloop: making the virtual environment ("), ours
            assert ours[2:4] == ["agentloop: installing agentloop and its packages (pip)",
                                 "agentloop: compiling the worker runtime's bytecode"], ours
            assert re.fullmatch(r"agentloop: ready: set up in \d+ s", ours[-1]), ours
            assert second == "", f"{name}: the second run said {second!r}"
    finally:
        shutil.rmtree(base, ignore_errors=True)
