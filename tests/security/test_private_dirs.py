"""What agentloop keeps on the host is its user's alone, and another user cannot stop it.

* The runtime directory (``$TMPDIR/agentloop-UID``, in a shared sticky ``/tmp``): bob makes
  alice's name first — a directory, a link, a file, a fifo — which alice cannot remove.  Her
  ``run`` once failed every time with "remove it and retry"; now it runs in a private directory
  of its own, says so in one line naming what was in the way, and bob's entry stays his.
* The state directory: ``~/.local/state/agentloop`` and ``runs`` (whose entries name the live
  runs) are 0700, made so and brought back to it when found open; bob lists nothing there.

The squats are real: bob's entry is there, his, before alice's command starts (and after it).
Where the suite cannot become other users, its own user squats its own name (a link, a file, a
fifo, a directory others may enter: the same refusal, the same way out).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.scripted import ScriptedServer
from tests.conftest import REPO

from .harness import SYSTEM_PYTHON, WAIT, as_user, other_users_problem, readable_pythonpath

pytestmark = pytest.mark.attack

_IMPORTS = ("import engine.cli, engine.cli.run, engine.agent._task, engine.models._client, engine.models._server, "
            "httpx, httpcore, anyio._backends._asyncio, sniffio; httpx.create_ssl_context()")

#: How each squat is made, as code run by the squatter in the sticky directory: NAME is the
#: victim's entry, ELSEWHERE a directory of the squatter's.
SQUATS = {
    "directory": "os.mkdir(NAME, 0o755)",
    "open-directory": "os.mkdir(NAME); os.chmod(NAME, 0o777)",
    "link": "os.symlink(ELSEWHERE, NAME)",
    "file": "open(NAME, 'w').write('mine')",
    "fifo": "os.mkfifo(NAME, 0o644)",
}


@dataclass
class Who:
    """Who runs agentloop (``victim``) and who squats (``squatter``): users' names, or None for
    the suite's own user."""

    victim: str | None
    squatter: str | None
    path: str  # the victim's PYTHONPATH

    def uid(self, name: str | None) -> int:
        return pwd.getpwnam(name).pw_uid if name else os.getuid()

    def python(self, name: str | None) -> list[str]:
        return [*as_user(name), SYSTEM_PYTHON] if name else [sys.executable]

    def own(self, path: Path, name: str | None) -> None:
        if name:
            entry = pwd.getpwnam(name)
            os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)


@pytest.fixture(scope="module", params=["alice-and-bob", "self"])
def who(request) -> Iterator[Who]:
    if request.param == "self":
        yield Who(None, None, str(REPO))
        return
    problem = other_users_problem("alice", "bob")
    if problem:
        pytest.skip(reason=problem)
    path, copies = readable_pythonpath(_IMPORTS)
    yield Who("alice", "bob", path)
    shutil.rmtree(copies, ignore_errors=True)


@pytest.fixture
def sticky() -> Iterator[Path]:
    """A shared sticky directory like /tmp (short: sockets live beneath it)."""
    where = Path(tempfile.mkdtemp(prefix="al-", dir="/tmp"))
    os.chmod(where, 0o1777)
    yield where
    subprocess.run(["rm", "-rf", "--one-file-system", str(where)], timeout=WAIT, check=False)


def _home(who: Who) -> Path:
    home = Path(tempfile.mkdtemp(prefix="agentloop-home-"))
    os.chmod(home, 0o755)
    who.own(home, who.victim)
    return home


def _run(who: Who, home: Path, model: ScriptedServer, tmpdir: Path) -> subprocess.CompletedProcess:
    project = home / "project"
    project.mkdir(exist_ok=True)
    who.own(project, who.victim)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "TMPDIR": str(tmpdir),
           "XDG_STATE_HOME": str(home / "state"), "LLM_URL": model.url, "PYTHONPATH": who.path}
    return subprocess.run([*who.python(who.victim), "-P", "-m", "engine.cli", "run", "tidy up", "-q", "--workspace", "."],
                          cwd=project, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


SCRIPT = {"*": ["<run_code>\nprint(6 * 7)\n</run_code>", "all tidy"]}


@pytest.mark.parametrize("squat", list(SQUATS))
def test_a_squatted_runtime_directory_is_replaced_by_a_private_one(who: Who, sticky: Path, squat: str):
    if who.squatter is None and squat == "directory":
        pytest.skip(reason="a directory of one's own, 0755, is the user's to use: nobody else's squat")
    name = sticky / f"agentloop-{who.uid(who.victim)}"
    elsewhere = Path(tempfile.mkdtemp(prefix="elsewhere-", dir=sticky))
    who.own(elsewhere, who.squatter)
    code = f"import os\nNAME, ELSEWHERE = {str(name)!r}, {str(elsewhere)!r}\n{SQUATS[squat]}\n"
    made = subprocess.run([*who.python(who.squatter), "-I", "-c", code], capture_output=True, text=True, timeout=WAIT)
    assert made.returncode == 0, made.stderr
    before = os.lstat(name)
    assert before.st_uid == who.uid(who.squatter)  # the squat is there, the squatter's
    home = _home(who)
    try:
        with ScriptedServer(SCRIPT) as model:
            proc = _run(who, home, model, sticky)
            assert proc.returncode == 0 and proc.stdout.strip() == "all tidy", proc.stderr
            assert "42" in json.dumps(model.requests[-1]["messages"][-1])  # the block ran
            said = [line for line in proc.stderr.splitlines() if "is not a private directory" in line]
            assert len(said) == 1 and f"using {sticky}/agentloop-{who.uid(who.victim)}-" in said[0], proc.stderr
            kind = {"directory": "a directory", "open-directory": "a directory", "link": "a link", "file": "a file",
                    "fifo": "a fifo"}[squat]
            assert f"(it is {kind}, " in said[0], said[0]
            if who.squatter:
                assert f"uid {who.uid('bob')}'s (bob)" in said[0], said[0]
            # Again: the same way out, and the first run's directory is gone (it was left empty).
            again = _run(who, home, model, sticky)
            assert again.returncode == 0 and again.stdout.strip() == "all tidy", again.stderr
        after = os.lstat(name)
        assert (after.st_ino, after.st_uid, stat.S_IFMT(after.st_mode)) == \
            (before.st_ino, before.st_uid, stat.S_IFMT(before.st_mode))  # bob's entry is untouched
        left = [p.name for p in sticky.iterdir() if p.name.startswith(f"agentloop-{who.uid(who.victim)}-")]
        assert left == [], left
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(home)], timeout=WAIT, check=False)


def test_the_state_directory_is_private_and_made_so_again(who: Who, sticky: Path):
    home = _home(who)
    try:
        state = home / "state" / "agentloop"
        (state / "runs" / "20240101-000000-1-abcdef").mkdir(parents=True)  # as an older agentloop left it
        for path in (home / "state", state, state / "runs", state / "runs" / "20240101-000000-1-abcdef"):
            os.chmod(path, 0o755)
            who.own(path, who.victim)
        with ScriptedServer(SCRIPT) as model:
            proc = _run(who, home, model, sticky)
        assert proc.returncode == 0, proc.stderr
        for path in (state, state / "runs", state / "writable"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        assert stat.S_IMODE((home / "state").stat().st_mode) == 0o755  # the user's own XDG directory: theirs
        if who.squatter:
            listing = subprocess.run([*as_user(who.squatter), "ls", str(state / "runs")], capture_output=True,
                                     text=True, timeout=WAIT)
            assert listing.returncode != 0 and "20240101" not in listing.stdout
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(home)], timeout=WAIT, check=False)
