"""No interpreter a worker could have written runs, not even to be asked what it is.

Model code given a writable directory builds a virtual environment there whose ``bin/python``
is a link to a trusted interpreter and whose site-packages holds a ``.pth`` file that appends
a line to a marker file outside every sandbox: run on the host (a probe is a run: ``site``
executes ``.pth`` files), it would have run as the user, as root with every capability.  Each
way a command can be pointed at it (``--python``, ``AGENTLOOP_PYTHON``, ``python`` in
agentloop.toml, ``VIRTUAL_ENV``), and each command, refuses it in words that name the source,
and the marker never appears; the same files made by the user instead *are* run by the same
command lines (the control: the attack is real).  Then the variants: a ``pyvenv.cfg`` whose
``home`` names an installation a worker planted, and an environment an ``exec`` script made
(as the user, root included: only the record tells).  As the suite's user and, under root, as
alice too (``users.user``)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.scripted import ScriptedServer

from .users import SYSTEM_PYTHON, User, planted_by

pytestmark = pytest.mark.attack

VERSION = f"python{sys.version_info[0]}.{sys.version_info[1]}"


def base_python(user: User) -> str:
    """A trusted interpreter of ``user``'s Python version, resolved (what the planted link names)."""
    return os.path.realpath(SYSTEM_PYTHON if user.name == "alice" else sys.executable)


def marker_pth(marker: Path) -> str:
    """A ``.pth`` line that appends ``PID UID`` to ``marker`` whenever ``site`` runs it (and
    does nothing where ``marker``'s directory is not there: inside a sandbox)."""
    code = (f"try:\n    f = open({str(marker)!r}, 'a')\n    f.write('%d %d\\n' % (os.getpid(), os.getuid()))\n"
            "    f.close()\nexcept OSError:\n    pass\n")
    return f"import os; exec({code!r})\n"


@dataclass(frozen=True)
class Layout:
    """Files (relative path -> text) and links (relative path -> target) of a directory."""

    files: dict[str, str]
    links: dict[str, str]

    def code(self, top: str) -> str:
        """Model code that makes this layout at ``top`` (relative to the workspace)."""
        return (f"import os\ntop = {top!r}\n"
                f"for name, text in {self.files!r}.items():\n"
                "    os.makedirs(os.path.dirname(os.path.join(top, name)), exist_ok=True)\n"
                "    open(os.path.join(top, name), 'w').write(text)\n"
                f"for name, target in {self.links!r}.items():\n"
                "    os.makedirs(os.path.dirname(os.path.join(top, name)), exist_ok=True)\n"
                "    os.symlink(target, os.path.join(top, name))\n"
                "print('planted', sorted(os.listdir(top)))")

    def make(self, user: User, top: Path) -> None:
        """The same layout at ``top``, made by ``user`` (no worker)."""
        for name, text in self.files.items():
            (top / name).parent.mkdir(parents=True, exist_ok=True)
            (top / name).write_text(text)
        for name, target in self.links.items():
            (top / name).parent.mkdir(parents=True, exist_ok=True)
            (top / name).symlink_to(target)
        for path in [top, *top.rglob("*")]:
            user.own(path)


def evil_venv(user: User, marker: Path) -> Layout:
    """A virtual environment whose python is a link to a trusted one, its site-packages planted."""
    python = base_python(user)
    return Layout({"pyvenv.cfg": f"home = {os.path.dirname(python)}\ninclude-system-site-packages = false\n"
                                 f"version = {platform.python_version()}\n",
                   f"lib/{VERSION}/site-packages/evil.pth": marker_pth(marker)},
                  {"bin/python": python})


def pointed(source: str, venv: Path, where: Path, user: User) -> tuple[list[str], dict[str, str], str]:
    """How ``source`` points a command at ``venv``'s python: options, variables, and the words
    the refusal names it by.  (``agentloop.toml`` is the user's own, written in ``where``.)"""
    python = str(venv / "bin" / "python")
    if source == "--python":
        return ["--python", python], {}, "chosen by --python"
    if source == "AGENTLOOP_PYTHON":
        return [], {"AGENTLOOP_PYTHON": python}, "chosen by AGENTLOOP_PYTHON"
    if source == "agentloop.toml":
        user.write(where / "agentloop.toml", f"python = {json.dumps(python)}\n")
        return [], {}, "chosen by python in agentloop.toml"
    return [], {"VIRTUAL_ENV": str(venv)}, f"VIRTUAL_ENV={venv}"


#: Every command that chooses the workers' Python, with what it needs (``ask`` runs none:
#: pointed at a planted one it answers as ever, and runs nothing of it).
COMMANDS = {
    "run": ["run", "hello", "-q"],
    "chat": ["chat", "-q"],
    "batch": ["batch", "tasks.jsonl", "-o", "out.jsonl"],
    "exec FILE": ["exec", "x.py"],
    "exec --read-only FILE": ["exec", "--read-only", "x.py"],
    "exec --jsonl": ["exec", "--jsonl", "samples.jsonl", "-o", "results.jsonl"],
    "mcp": ["mcp"],
    "doctor": ["doctor"],
    "ask": ["ask", "what is here?"],
}
SOURCES = ["--python", "AGENTLOOP_PYTHON", "agentloop.toml", "VIRTUAL_ENV"]


def elsewhere(user: User, name: str = "elsewhere") -> Path:
    """A project of the user's own, no worker ever wrote, with what the commands need."""
    where = user.project(name)
    user.write(where / "x.py", "print('the script ran')\n")
    user.write(where / "tasks.jsonl", json.dumps({"id": "t", "task": "hello"}) + "\n")
    user.write(where / "samples.jsonl", json.dumps({"id": "s", "code": "print(1)"}) + "\n")
    return where


def command_line(name: str, options: list[str]) -> list[str]:
    """``COMMANDS[name]`` with ``options`` after the command's name (ask takes no --python)."""
    args = COMMANDS[name]
    at = 2 if args[0] == "exec" and len(args) > 2 and args[1] == "--read-only" else 1
    return [*args[:at], *(options if name != "ask" else []), *args[at:]]


def assert_not_used(proc: subprocess.CompletedProcess, name: str, because: str) -> None:
    """``name`` refused the interpreter in words naming ``because`` (its source): one line and
    125, or for doctor its line among the others and 1."""
    if name == "doctor":
        line = next((x for x in proc.stdout.splitlines() if x.startswith("workers' python: ")), "")
        assert proc.returncode == 1 and "is not used: " in line and because in line, (proc.stdout, proc.stderr)
        assert "worker: not started" in proc.stdout, proc.stdout
        return
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 125 and len(lines) == 1, (name, proc.returncode, proc.stdout, proc.stderr)
    assert "is not used: " in lines[0] and because in lines[0], (name, lines[0])


def plant_venv(user: User, marker: Path) -> tuple[Path, Path]:
    """A run whose workspace is a project builds ``v`` there (``evil_venv``); the project and it."""
    project = user.project()
    said = planted_by(user, project, evil_venv(user, marker).code("v"))
    assert "planted ['bin', 'lib', 'pyvenv.cfg']" in said, said  # the attack's first half ran
    venv = project / "v"
    assert os.readlink(venv / "bin" / "python") == base_python(user)
    assert (venv / "lib" / VERSION / "site-packages" / "evil.pth").read_text() == marker_pth(marker)
    return project, venv


@pytest.mark.parametrize("source", SOURCES)
def test_a_planted_python_is_run_by_no_command(user: User, source: str):
    marker = user.home / "PLANTED-PTH-RAN"
    _, venv = plant_venv(user, marker)
    assert not marker.exists(), "the plant ran on the host while it was made"
    where = elsewhere(user)
    options, env, because = pointed(source, venv, where, user)
    with ScriptedServer({"*": ["fine"]}) as model:
        for name in COMMANDS:
            proc = user.agentloop(*command_line(name, options), cwd=where, url=model.url, env=env,
                                  stdin="" if name in ("chat", "mcp") else None)
            assert not marker.exists(), f"{name}: the planted .pth ran: {marker.read_text()}"
            if name == "ask":  # (no worker: the interpreter is not its business, nor run)
                assert proc.returncode == 0 and proc.stdout.strip() == "fine", (proc.stdout, proc.stderr)
            else:
                assert_not_used(proc, name, because)


@pytest.mark.parametrize("source", SOURCES)
def test_control_the_same_files_made_by_the_user_are_run(user: User, source: str):
    # Proof that the attack above is real: the same environment, the user's own, is trusted and
    # run, on the host first (the probe, where its .pth runs), by the same command lines.
    marker = user.home / "PLANTED-PTH-RAN"
    where = elsewhere(user)
    venv = where.parent / "own-venv"
    evil_venv(user, marker).make(user, venv)
    options, env, _ = pointed(source, venv, where, user)
    proc = user.agentloop(*command_line("exec FILE", options), cwd=where, env=env)
    assert proc.returncode == 0 and proc.stdout == "the script ran\n", proc.stderr
    ran = marker.read_text().split()
    uid = os.geteuid() if user.name == "self" else int(subprocess.check_output(["id", "-u", "alice"]))
    assert ran and ran[1::2] == [str(uid)] * (len(ran) // 2), ran
    marker.unlink()
    proc = user.agentloop(*command_line("doctor", options), cwd=where, env=env)
    assert marker.exists() and f"workers' python: {venv / 'bin' / 'python'}" in proc.stdout, proc.stdout


def planted_home(user: User, marker: Path) -> Layout:
    """An installation whose standard library announces itself: ``lib/pythonX.Y/os.py`` (the
    landmark an interpreter's start looks for) and an ``encodings`` package, imported by every
    start before anything else, that appends a line to ``marker``."""
    announce = (f"import posix\nposix.write(posix.open({str(marker)!r}, posix.O_WRONLY | posix.O_CREAT | "
                "posix.O_APPEND, 0o644), b'planted stdlib ran\\n')\n")
    return Layout({f"lib/{VERSION}/os.py": "", f"lib/{VERSION}/encodings/__init__.py": announce,
                   "bin/README": "the installation's programs\n"}, {})


def test_a_pyvenv_cfg_home_in_a_workspace_is_never_run(user: User):
    """The user's own virtual environment names, as its ``home``, an installation in a project
    that workers wrote (a Python built there, say); a worker planted its standard library.  The
    interpreter is refused before its start could import that library — even ``-I -S`` would."""
    marker = user.home / "PLANTED-STDLIB-RAN"
    project = user.project()
    said = planted_by(user, project, planted_home(user, marker).code("built"))
    assert "planted ['bin', 'lib']" in said, said
    where = elsewhere(user)
    venv = where.parent / "own-venv"
    cfg = f"home = {project / 'built' / 'bin'}\nversion = {platform.python_version()}\n"
    Layout({"pyvenv.cfg": cfg}, {"bin/python": base_python(user)}).make(user, venv)
    for name in ("exec FILE", "run", "doctor"):
        with ScriptedServer({"*": ["fine"]}) as model:
            proc = user.agentloop(*command_line(name, ["--python", str(venv / "bin" / "python")]), cwd=where,
                                  url=model.url)
        assert not marker.exists(), f"{name}: the planted standard library ran"
        assert_not_used(proc, name, "chosen by --python")
    # The control: the same installation, the user's own, is what that interpreter's start runs.
    own = where.parent / "own-built"
    planted_home(user, marker).make(user, own)
    (venv / "pyvenv.cfg").write_text(cfg.replace(str(project / "built"), str(own)))
    user.own(venv / "pyvenv.cfg")
    user.agentloop("exec", "--python", str(venv / "bin" / "python"), "x.py", cwd=where)
    assert marker.read_text().startswith("planted stdlib ran"), "the control's standard library did not run"


def test_a_venv_an_exec_script_planted_is_refused_by_the_record(user: User):
    """A script run with ``agentloop exec`` writes the current directory as the user — as root,
    as uid 0 — so ownership tells nothing of what it made; it builds the environment there.
    ``VIRTUAL_ENV`` pointed at it later: the record of what the script could write refuses it."""
    marker = user.home / "PLANTED-PTH-RAN"
    project = user.project()
    user.write(project / "build.py", evil_venv(user, marker).code("v") + "\n")
    made = user.agentloop("exec", "build.py", cwd=project)
    assert made.returncode == 0 and "planted ['bin', 'lib', 'pyvenv.cfg']" in made.stdout, made.stderr
    venv = project / "v"
    assert (venv / "pyvenv.cfg").stat().st_uid == (os.geteuid() if user.name == "self" else
                                                    int(subprocess.check_output(["id", "-u", "alice"])))
    where = elsewhere(user)
    with ScriptedServer({"*": ["fine"]}) as model:
        for name in ("exec FILE", "run", "doctor"):
            proc = user.agentloop(*command_line(name, []), cwd=where, url=model.url, env={"VIRTUAL_ENV": str(venv)})
            assert not marker.exists(), f"{name}: the planted .pth ran"
            assert_not_used(proc, name, f"VIRTUAL_ENV={venv}")
            assert "could write" in (proc.stdout + proc.stderr), proc.stdout + proc.stderr
