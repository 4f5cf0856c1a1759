"""uid 0 without capabilities rewrites a set-user-ID file through a shared mapping.

``exec`` as root, and ``run --write-cwd`` as root, run code as uid 0 without any capability in
a directory it writes.  It cannot make a set-id file, but one already there (a root-owned 4755
binary, a 2755 one, one whose ``security.capability`` grants a capability), opened read-write
and changed through ``mmap(MAP_SHARED)``, keeps its bit: the kernel clears it on ``write(2)``
and truncate only.  First the attack is shown to work, on this kernel, on copies outside any
sandbox (as uid 0 with no capability, as the sandbox runs it); then, in the sandbox, every such
file — at the top and in a subdirectory — is bound read-only, the rewrite fails, and the files
are what they were, while the script's own files are written as ever."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.sandbox import host_support
from engine.sandbox._protected import privileged_files
from engine.scripted import ScriptedServer

from .harness import PRELUDE, WAIT, needs_namespaces, probes_in

pytestmark = [pytest.mark.attack,
              pytest.mark.skipif(os.geteuid() != 0, reason="only code that runs as uid 0 can rewrite root's files")]

AGENTLOOP = [sys.executable, "-P", "-m", "engine.cli"]

#: The rewrite: the file opened read-write, a few bytes changed through a shared mapping.
REWRITE = r'''
import mmap
def rewrite(name):
    fd = _os.open(name, _os.O_RDWR)
    try:
        m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[64:72] = b"PLANTED!"
        m.flush()
        m.close()
    finally:
        _os.close(fd)
for name in ("suid", "sub/deeper/suid", "sgid", "capped"):
    probe("rewrite/" + name, lambda: rewrite(name))
probe("own_file", lambda: open("mine.txt", "w").write("written"))
'''
#: In the sandbox, after the rewrite: nor may the file's mode change (uid 0 owns it).
CHMOD = 'probe("chmod", lambda: _os.chmod("suid", 0o755))\n'


def _has_setcap() -> str | None:
    return shutil.which("setcap")


def _privileged_project(tmp_path: Path) -> Path:
    """A project holding root's set-user-ID, set-group-ID and file-capability copies of true(1)."""
    project = tmp_path / "project"
    (project / "sub" / "deeper").mkdir(parents=True)
    for name, mode in (("suid", 0o4755), ("sub/deeper/suid", 0o4755), ("sgid", 0o2755), ("capped", 0o755)):
        shutil.copy("/bin/true", project / name)
        os.chmod(project / name, mode)
    if _has_setcap():
        subprocess.run(["setcap", "cap_net_raw+ep", str(project / "capped")], check=True, timeout=WAIT)
    return project


def _state(project: Path) -> dict[str, tuple]:
    out = {}
    for name in ("suid", "sub/deeper/suid", "sgid", "capped"):
        path = project / name
        try:
            caps = os.getxattr(path, "security.capability")
        except OSError:
            caps = None
        out[name] = (stat.S_IMODE(path.stat().st_mode), hashlib.sha256(path.read_bytes()).hexdigest(), caps)
    return out


def test_control_the_rewrite_keeps_the_bit_outside_a_sandbox(tmp_path: Path):
    # Proof the attack is real here: uid 0 with no capability at all, on unprotected copies.
    if not shutil.which("setpriv"):
        pytest.skip(reason="setpriv (util-linux) is not installed")
    project = _privileged_project(tmp_path)
    before = _state(project)
    script = tmp_path / "rewrite.py"
    script.write_text(PRELUDE + 'probe("caps", lambda: [l for l in open("/proc/self/status") '
                                'if l.startswith("CapEff")][0].split()[1])\n' + REWRITE)
    done = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, str(script)],
                          capture_output=True, text=True, cwd=project, timeout=WAIT)
    got = probes_in(done.stdout)
    assert got["caps"] == "ok '0000000000000000'", (got, done.stderr)
    after = _state(project)
    for name in before:
        assert got[f"rewrite/{name}"] == "ok", (name, got)
        assert after[name][1] != before[name][1], f"{name} was not rewritten"
        assert after[name][0] == before[name][0] and after[name][2] == before[name][2], (name, before, after)
    assert after["suid"][0] & stat.S_ISUID and after["sgid"][0] & stat.S_ISGID
    if _has_setcap():
        assert after["capped"][2] is not None, "the capability was dropped by the rewrite"


def _assert_kept(got: dict[str, str], project: Path, before: dict[str, tuple]) -> None:
    for name in ("suid", "sub/deeper/suid", "sgid") + (("capped",) if _has_setcap() else ()):
        assert got[f"rewrite/{name}"] == "OSError EROFS", (name, got)
    assert got["chmod"] in ("OSError EROFS", "PermissionError EPERM"), got
    assert got["own_file"].startswith("ok") and (project / "mine.txt").read_text() == "written", got
    assert _state(project) == before


def test_exec_as_root_keeps_set_id_files_read_only(tmp_path: Path):
    needs_namespaces()
    project = _privileged_project(tmp_path)
    before = _state(project)
    script = tmp_path / "attack.py"
    script.write_text(PRELUDE + REWRITE + CHMOD)
    done = subprocess.run([*AGENTLOOP, "exec", str(script)], capture_output=True, text=True, cwd=project,
                          timeout=WAIT * 4)
    assert done.returncode == 0, done.stderr
    _assert_kept(probes_in(done.stdout), project, before)


def test_run_write_cwd_as_root_keeps_set_id_files_read_only(tmp_path: Path):
    needs_namespaces()
    project = _privileged_project(tmp_path)
    before = _state(project)
    block = f"<run_code>\n{PRELUDE}{REWRITE}{CHMOD}\n</run_code>"
    with ScriptedServer({"*": [block, "done"]}) as model:
        done = subprocess.run([*AGENTLOOP, "run", "tidy up", "-q", "--write-cwd"], capture_output=True, text=True,
                              cwd=project, timeout=WAIT * 4,
                              env={**os.environ, "LLM_URL": model.url, "XDG_STATE_HOME": str(tmp_path / "state")})
        said = model.requests[1]["messages"][-1]["content"]
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    _assert_kept(probes_in(said), project, before)


def test_without_bubblewrap_a_directory_with_a_set_id_file_is_not_written_as_uid_0(tmp_path: Path):
    if host_support().landlock_abi < 1:
        pytest.skip(reason="no Landlock here: the fallback itself is unavailable")
    project = _privileged_project(tmp_path)
    before = _state(project)
    (tmp_path / "x.py").write_text("open('mine.txt', 'w').write('written')\n")
    done = subprocess.run([*AGENTLOOP, "exec", "--sandbox", "landlock", str(tmp_path / "x.py")], capture_output=True,
                          text=True, cwd=project, timeout=WAIT * 4)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 125 and len(lines) == 1 and "cannot be kept read-only" in lines[0], done.stderr
    assert not (project / "mine.txt").exists() and _state(project) == before


def test_the_walk_finds_each_and_is_bounded(tmp_path: Path):
    project = _privileged_project(tmp_path)
    for n in range(20):
        (project / f"f{n}").write_text("")
    (project / "link").symlink_to(project / "suid")  # (a link is not followed: the file is found once)
    expected = {"suid", "sub/deeper/suid", "sgid", *(("capped",) if _has_setcap() else ())}
    assert set(privileged_files(project)) == {str(project / n) for n in expected}
    with pytest.raises(ConfigError, match="too many to look through"):
        privileged_files(project, limit=10)
