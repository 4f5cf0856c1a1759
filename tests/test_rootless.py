"""The unprivileged path: an engine run by a plain user gets its workers and code samples from a
fork server in a user namespace; a cgroup subtree delegated to the user (as systemd's
``Delegate=yes`` does: a directory and its ``cgroup.procs`` handed over, the process started
inside) is used for each worker's memory and process limits, and without one the limit is per
process and ``doctor`` says how to get one; a kernel that gives no user namespace at all means
cold starts (the Landlock fallback), said in one line.

Each test starts a Python that prints one JSON object: from a root run, ``/usr/bin/python3`` as
``nobody`` (with this project and the venv's packages on its path, as
``tests/test_sandbox_layers.py`` does); from a plain user's, the venv's as that user.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.test_sandbox_layers import _NOBODY_PROBLEM, NOBODY, NOBODY_PATH, ROOT, SYSTEM_PYTHON

WAIT = 120
ROOTED = os.geteuid() == 0
#: Whom the engine runs as: nobody from a root run, else the user running the tests.
USER = NOBODY if ROOTED else os.getuid()

pytestmark = pytest.mark.skipif(ROOTED and _NOBODY_PROBLEM is not None, reason=str(_NOBODY_PROBLEM))

#: Prepended to each script: an engine of the user's, in ``BASE`` (argv[1]).
_PRELUDE = """
import asyncio, json, os, sys
from pathlib import Path
from engine.workers import Engine
from engine.samples import Sample
BASE = Path(sys.argv[1])
def engine(**kw):
    return Engine(cwd=BASE / "cwd", workspace=BASE / "cwd" / "files", state_dir=BASE / "state", pool=0, **kw)
"""


@pytest.fixture
def base() -> Path:
    """A directory of the user's own (a root test's tmp_path is root's, 0700)."""
    made = Path(tempfile.mkdtemp(prefix="agentloop-unprivileged-"))
    (made / "cwd").mkdir()
    for path in (made, made / "cwd") if ROOTED else ():
        os.chown(path, USER, USER)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _as_user(base: Path, script: str, *, inside: list[str] = (), cgroups: list[Path] = ()) -> dict:
    """Run ``script`` as the user in ``base`` (its own), inside ``cgroups`` (entered as root
    first) and under the command ``inside`` (run as the user); the JSON object it printed last."""
    enter = "".join(f"echo $$ > {g}/cgroup.procs; " for g in cgroups)
    become = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if ROOTED else []
    python = SYSTEM_PYTHON if ROOTED else sys.executable
    argv = ["sh", "-c", f'{enter}exec "$@"', "sh", *become, *inside, python, "-c", _PRELUDE + textwrap.dedent(script),
            str(base)]
    env = {"PYTHONPATH": NOBODY_PATH if ROOTED else str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(base),
           "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(argv, cwd=base, env=env, capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_workers_batches_and_samples_are_forked_in_a_user_namespace(base: Path):
    got = _as_user(base, """
        from engine.launch import fork_server_refusal
        from engine.launch import WorkerSettings
        async def main():
            async with engine() as e:
                a, b = await e.start_worker("a"), await e.start_worker("b")
                seen = [(await w.run("import os; print(os.getuid(), open('/proc/self/uid_map').read().split(), "
                                     "os.readlink('/proc/self/ns/user'), sorted(os.listdir('/proc'))[:2])")).output
                        for w in (a, b)]
                kind = e.launcher.provisioner().kind
                samples = [r.stdout async for r in e.map([Sample(i, "import os; print(os.getpid())") for i in range(3)])]
                return {"refusal": fork_server_refusal(WorkerSettings()), "kind": kind, "seen": seen,
                        "samples": samples, "slots": e._sample_runner().forked}
        print(json.dumps(asyncio.run(main())))
    """)
    assert got["refusal"] is None and got["kind"] == "fork server", got
    seen = [line.split(" ", 1) for line in got["seen"]]
    assert all(uid == str(USER) for uid, _ in seen), seen  # the user's own uid, as cold
    # Each worker in a user namespace of its own (mapping the user's uid alone), its init hidden
    # from its /proc (it shares the worker's uid).
    assert seen[0][1] != seen[1][1], seen
    assert all(f"['{USER}', '{USER}', '1']" in rest and "['2', " in rest for _, rest in seen), seen
    assert got["samples"] == ["3\n"] * 3 and got["slots"] is True, got  # forked by a slot: its init, the slot, the sample


def _v1(controller: str) -> Path | None:
    """The cgroup v1 hierarchy of ``controller``, where this machine mounts one."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup" and controller in right.split()[2].split(","):
                return Path(left.split()[4])
    return None


@pytest.fixture
def delegated() -> list[Path]:
    """A memory and a pids cgroup handed to nobody, as systemd's delegation hands one over."""
    if os.geteuid() != 0:
        pytest.skip(reason="delegating a cgroup takes root")
    tops = [_v1("memory"), _v1("pids")]
    if None in tops or not all(os.access(t, os.W_OK) for t in tops):
        pytest.skip(reason="no writable cgroup v1 memory and pids hierarchies here to delegate from")
    groups = [top / f"agentloop-test-{secrets.token_hex(3)}" for top in tops]
    for group in groups:
        group.mkdir()
        for path in (group, group / "cgroup.procs", group / "tasks"):
            os.chown(path, NOBODY, NOBODY)
    yield groups
    for group in groups:
        _remove_cgroup(group)


def _remove_cgroup(group: Path) -> None:
    """Remove ``group`` and the cgroups the run made in it, once the processes the run killed
    have left them: a killed process leaves its cgroup a moment after its parent saw it die
    (on a loaded machine, long enough for ``rmdir`` to say EBUSY)."""
    dirs = sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [group]
    for path in dirs:
        emptied = wait_until(lambda path=path: not (path / "cgroup.procs").read_text().strip(), timeout=30)
        assert emptied, f"{path} still holds processes: {(path / 'cgroup.procs').read_text()}"
        assert wait_until(lambda path=path: _rmdir(path), timeout=30), f"{path} stays busy"


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        return False
    return True


_MEMORY_BOMB = """
import os
fd = os.memfd_create("bomb")
chunk = b"x" * (1 << 20)
for _ in range(400):
    os.write(fd, chunk)
print("survived")
"""


def test_a_delegated_cgroup_bounds_each_workers_memory(base: Path, delegated: list[Path]):
    got = _as_user(base, f"""
        from engine.launch import report
        from engine.sandbox import SandboxPolicy
        async def main():
            async with engine(sandbox=SandboxPolicy(memory_bytes=128 << 20)) as e:
                w = await e.start_worker("bomb")
                cgroups = open(f"/proc/{{w.pid}}/cgroup").read()
                r = await w.run({_MEMORY_BOMB!r}, timeout=60)
                again = await w.run("print(6 * 7)", timeout=30)
                return {{"status": r.status, "over": r.over_memory, "message": r.message, "cgroups": cgroups,
                        "again": again.output, "notes": w.notes}}
        layers = {{layer.name: layer for layer in report(SandboxPolicy())}}
        print(json.dumps({{**asyncio.run(main()), "doctor": [layers["memory cgroup"].active,
                                                              layers["memory cgroup"].reason]}}))
    """, cgroups=delegated)
    assert got["over"] and "over its memory limit" in got["message"], got
    assert got["again"] == "42\n", got
    for group in delegated:  # the worker's own cgroups lie beneath the delegated ones
        assert f"/{group.name}/agentloop-" in got["cgroups"], got["cgroups"]
    assert not any("memory cgroup" in note for note in got["notes"]), got["notes"]
    assert got["doctor"][0] and "delegated to you" in got["doctor"][1], got["doctor"]


def test_without_a_delegated_cgroup_memory_is_per_process_and_doctor_says_how(base: Path):
    got = _as_user(base, f"""
        from engine.launch import report
        from engine.sandbox import SandboxPolicy
        async def main():
            async with engine() as e:
                w = await e.start_worker("bomb")
                r = await w.run({_MEMORY_BOMB!r}, timeout=60)
                return {{"error": r.error, "notes": w.notes}}
        layers = {{layer.name: layer for layer in report(SandboxPolicy())}}
        print(json.dumps({{**asyncio.run(main()), "doctor": [layers["memory cgroup"].active,
                                                              layers["memory cgroup"].reason]}}))
    """)
    if not ROOTED and got["doctor"][0]:
        pytest.skip(reason="a cgroup is delegated to the user running the tests")
    assert "PermissionError" in got["error"], got  # memfd_create refused: no cgroup would count it
    # A detail of the machine, not of this start: doctor says it (and -v, once per command).
    assert not any("memory cgroup" in note for note in got["notes"]), got["notes"]
    active, reason = got["doctor"]
    assert not active and "no cgroup delegated to you" in reason and "to get one" in reason, reason


def test_no_user_namespaces_means_cold_starts_said_in_one_line(base: Path):
    """Inside a sandbox that allows no further user namespace (as a kernel with
    ``unprivileged_userns_clone=0`` or ``user.max_user_namespaces=0`` gives), bubblewrap and the
    fork server are refused: workers and samples start cold, each in the Landlock fallback, and
    the start says why."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip(reason="needs bubblewrap to build the refusing sandbox")
    refusing = [bwrap, "--unshare-user", "--disable-userns", "--dev-bind", "/", "/", "--proc", "/proc", "--"]
    got = _as_user(base, """
        from engine.launch import fork_server_refusal
        from engine.launch import WorkerSettings
        async def main():
            async with engine() as e:
                w = await e.start_worker("w")
                ran = (await w.run("print(6 * 7)")).output
                kind = e.launcher.provisioner().kind
                samples = [r.status async for r in e.map([Sample(1, "print(1)")])]
                return {"refusal": fork_server_refusal(WorkerSettings()), "kind": kind, "ran": ran,
                        "notes": w.notes, "samples": samples}
        print(json.dumps(asyncio.run(main())))
    """, inside=refusing)
    assert got["kind"] == "cold" and got["ran"] == "42\n" and got["samples"] == ["ok"], got
    assert got["refusal"].startswith("no fork server: bubblewrap cannot create namespaces here"), got
    assert sum("bubblewrap cannot create namespaces here" in note for note in got["notes"]) == 1, got["notes"]
