"""Commands run as a user: the suite's own, or the unprivileged ``alice`` (when the suite runs
as root), each with a home of theirs holding their projects and agentloop's state; and how
model code plants files there, through a real ``agentloop run`` against a scripted model.

A root coordinator's workers run as uids of their own, so ownership tells their files apart;
an unprivileged user's workers are that user, and only the coordinator's record of what they
could write does (``engine.trust``): every attack that plants runs as both where it can."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.sandbox import host_support
from engine.scripted import ScriptedServer

from ..conftest import REPO
from .harness import API_KEY, WAIT

__all__ = ["ROOT", "SYSTEM_PYTHON", "User", "make_venv", "plant", "planted_by", "planted_through", "user"]

ROOT = os.geteuid() == 0
SYSTEM_PYTHON = "/usr/bin/python3"


def _alice_problem() -> str | None:
    if not ROOT:
        return "only root can run a command as alice"
    try:
        pwd.getpwnam("alice")
    except KeyError:
        return "no user alice on this machine"
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) not installed"
    same = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True, timeout=WAIT).stdout.strip() if os.access(SYSTEM_PYTHON, os.X_OK) else ""
    if same != str(sys.version_info[:2]):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}"
    return None


#: What the commands import, for ``_alice_path``: everything a run, a batch, exec, ask and
#: doctor load, the HTTP client's lazily imported parts included.
_IMPORTS = ("import engine.cli, engine.agent._task, engine.models._client, engine.agent._ask, engine.launch._doctor, "
            "engine.batch.local, "
            "engine.batch.sample_file, httpx, httpcore, anyio._backends._asyncio, sniffio; httpx.create_ssl_context()\n"
            "import importlib.util\n"
            "if importlib.util.find_spec('mcp'):\n    import engine.integrations.mcp, engine.integrations.mcp_transports")


@pytest.fixture(scope="session")
def _alice_path() -> Iterator[str]:
    """A PYTHONPATH alice can use: this project, the venv's packages, and copies of the
    packages it takes from an interpreter alice cannot enter (a venv made with
    --system-site-packages from root's pyenv, as scripts/test makes it here).  Not beneath
    pytest's own directory, which alice cannot enter either."""
    purelib = sysconfig.get_paths()["purelib"]
    listing = "\nimport sys\nfor m in list(sys.modules.values()):\n    print(getattr(m, '__file__', None) or '')"
    out = subprocess.run([sys.executable, "-c", _IMPORTS + listing], capture_output=True, text=True,
                         timeout=WAIT, cwd="/", check=True).stdout.split()
    bases = {os.path.realpath(p) for p in sys.path if p.endswith("-packages")} - {os.path.realpath(purelib)}
    copies = Path(tempfile.mkdtemp(prefix="agentloop-alice-path-"))
    for file in out:
        base = next((b for b in bases if file.startswith(b + "/")), None)
        if base is None:
            continue
        top = os.path.join(base, os.path.relpath(file, base).split("/")[0])
        target = copies / os.path.basename(top)
        if not target.exists():
            (shutil.copytree if os.path.isdir(top) else shutil.copy2)(top, target)
    subprocess.run(["chmod", "-R", "a+rX", str(copies)], check=True, timeout=WAIT)
    os.chmod(copies, 0o755)
    yield f"{REPO}:{purelib}:{copies}"
    shutil.rmtree(copies, ignore_errors=True)


@dataclass
class User:
    """Who runs the commands: ``self`` (the suite's user) or ``alice``, with a directory of
    theirs (``home``) holding their projects and agentloop's state."""

    name: str
    home: Path
    path: str = ""  # alice's PYTHONPATH

    def project(self, name: str = "project") -> Path:
        path = self.home / name
        path.mkdir()
        self.own(path)
        return path

    def own(self, *paths: Path) -> None:
        if self.name == "alice":
            entry = pwd.getpwnam("alice")
            for path in paths:
                os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)

    def write(self, path: Path, text: str) -> Path:
        path.write_text(text)
        self.own(path)
        return path

    def agentloop(self, *args: str, cwd: Path, url: str | None = None, stdin: str | None = None,
                  timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``agentloop ARGS`` run in ``cwd`` as this user (its own state, the host's key in its
        environment, ``-P``: the directory it starts in is not on its import path; ``env``:
        more variables)."""
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8",
               "XDG_STATE_HOME": str(self.home / "state"), "LLM_API_KEY": API_KEY, **(env or {})}
        if url:
            env["LLM_URL"] = url
        if self.name == "alice":
            env["PYTHONPATH"] = self.path
            argv = ["setpriv", "--reuid=alice", "--regid=alice", "--init-groups", SYSTEM_PYTHON]
        else:
            env["PYTHONPATH"] = str(REPO)
            argv = [sys.executable]
        return subprocess.run([*argv, "-P", "-m", "engine.cli", *args], cwd=cwd, env=env, input=stdin,
                              stdin=None if stdin is not None else subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout)


@pytest.fixture(params=["self", "alice"])
def user(request, tmp_path: Path) -> Iterator[User]:
    """Who plants and who is attacked: the suite's user, or alice."""
    if host_support().bwrap is None:
        pytest.skip(reason=f"the attacks plant through a bubblewrap sandbox: {host_support().bwrap_problem}")
    if request.param == "alice":
        problem = _alice_problem()
        if problem:
            pytest.skip(reason=problem)
        home = Path(tempfile.mkdtemp(prefix="agentloop-obeyed-"))
        os.chmod(home, 0o755)
        who = User("alice", home, request.getfixturevalue("_alice_path"))
        who.own(home)
        yield who
        subprocess.run(["rm", "-rf", "--one-file-system", str(home)], timeout=WAIT, check=False)
    else:
        yield User("self", tmp_path)


def plant(code: str) -> str:
    """A model reply whose block runs ``code`` (in the workspace) and prints what it did."""
    return f"<run_code>\n{code}\n</run_code>"


def planted_by(user: User, project: Path, code: str, *extra: str) -> str:
    """Run ``agentloop run`` in ``project`` with the project as the workspace, its model code
    being ``code``; the text of the block's result, as the model got it."""
    with ScriptedServer({"*": [plant(code), "done"]}) as model:
        return planted_through(model, user, project, *extra)


def planted_through(model: ScriptedServer, user: User, project: Path, *extra: str) -> str:
    """``planted_by`` with a model of the caller's, whose script answers the task "tidy up"."""
    done = user.agentloop("run", "tidy up", "-q", "--workspace", ".", *extra, cwd=project, url=model.url)
    assert done.returncode == 0, done.stderr
    return [r for r in model.requests if "tidy up" in json.dumps(r)][1]["messages"][-1]["content"]


def make_venv(user: User, venv: Path) -> Path:
    """A virtual environment of ``user``'s at ``venv`` (skip where none can be made); its
    site-packages."""
    made = subprocess.run(["setpriv", "--reuid=alice", "--regid=alice", "--init-groups"] * (user.name == "alice")
                          + [SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], capture_output=True,
                          text=True, timeout=WAIT)
    if made.returncode != 0:
        pytest.skip(reason=f"cannot make a virtual environment here: {made.stderr[-300:]}")
    return next(venv.glob("lib/python3*/site-packages"))


