"""A root coordinator's workers run as a uid of their workspace's own: while anything of a run
lives, no other workspace gets that uid — not when the run shares its workspace with a run
that has ended, and not through a workspace named to collide with it."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

from engine.sandbox import _uids
from engine.workers import Engine
from tests.conftest import read_line

from .harness import WAIT, assert_still_works, attack, needs_namespaces

pytestmark = [pytest.mark.attack,
              pytest.mark.skipif(os.geteuid() != 0, reason="only a root coordinator switches workers' uids")]

_REPO = Path(__file__).resolve().parents[2]


def _colliding(parent: Path) -> tuple[Path, Path]:
    """Two workspaces beneath ``parent`` whose first choice of uid is the same: what whoever
    names workspaces would look for (the test reads the registry's key, as root may)."""
    first = getattr(_uids, "first_choice", None) or \
        (lambda path: _uids.UID_BASE + zlib.crc32(path.encode()) % _uids.UID_SPAN)
    seen: dict[int, Path] = {}
    for i in range(1_000_000):
        path = parent / f"ws{i}"
        uid = first(str(path))
        if uid in seen:
            return seen[uid], path
        seen[uid] = path
    raise AssertionError("no collision found")


#: A coordinator of its own (so that it can be killed): one worker on the workspace runs the code,
#: prints its uid and ``ready``, and stays; SIGTERM ends it as it ends agentloop's commands.
COORDINATOR = """
import asyncio, signal, sys
from engine.workers import Engine

def stop(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, stop)

async def main():
    async with Engine(cwd=sys.argv[1], workspace=sys.argv[2]) as engine:
        worker = await engine.start_worker("a")
        result = await worker.run(open(sys.argv[3]).read() + "\\nprint(os.getuid())", timeout=100)
        print(result.output.strip(), flush=True)
        print("ready", flush=True)
        await asyncio.sleep(120)

try:
    asyncio.run(main())
except KeyboardInterrupt:
    sys.exit(143)
"""


def _run(project: Path, workspace: Path, state: Path, code: str) -> tuple[subprocess.Popen, int]:
    """A coordinator in ``project`` running ``code`` in a worker on ``workspace``; returns it
    with its workers' uid once the worker has run the code."""
    script = state / f"{secrets.token_hex(4)}.py"
    script.write_text("import os\n" + code + "\n")
    env = {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(_REPO)}
    proc = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(project), str(workspace), str(script)],
                            cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    uid, ready = read_line(proc.stdout, WAIT), read_line(proc.stdout, WAIT)
    assert ready.strip() == b"ready", (uid, ready, proc.stderr.read1(4096) if proc.poll() is not None else b"")
    return proc, int(uid)


def _end(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(timeout=WAIT)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["exits", "is-killed"])
async def test_a_uid_is_not_handed_on_while_a_second_run_of_its_workspace_lives(how: int, tmp_path: Path):
    """Two runs on one workspace share its uid; the first one ends (cleanly, or by SIGKILL)
    while the second still runs.  A workspace whose name collides with theirs must not get
    the uid now: its workers could read the second run's 0600 files wherever they see them
    (here: through the project directory, shown to every run read-only)."""
    needs_namespaces()
    project = Path(tempfile.mkdtemp(prefix="agentloop-claims-", dir="/tmp"))
    project.chmod(0o755)  # a project directory, shown to workers
    state = tmp_path / "state"
    state.mkdir()
    secret = "second-run-secret-" + secrets.token_hex(8)
    runs: list[subprocess.Popen] = []
    try:
        shared, colliding = _colliding(project)
        first, uid = _run(project, shared, state, "")
        runs.append(first)
        assert _uids.UID_BASE <= uid < _uids.UID_BASE + _uids.UID_SPAN  # a uid of the workspace's own
        second, same = _run(project, shared, state, f"open({str(shared / 'secret.txt')!r}, 'w').write({secret!r})\n"
                                                    f"os.chmod({str(shared / 'secret.txt')!r}, 0o600)")
        runs.append(second)
        assert same == uid  # one workspace, one uid: the second run owns what the first wrote
        _end(first, how)
        assert second.poll() is None

        async with Engine(cwd=project, workspace=colliding, state_dir=tmp_path / "attacker") as engine:
            worker = await engine.start_worker("attacker")
            got = await attack(worker, f"""
probe("read", lambda: open({str(shared / 'secret.txt')!r}).read())
probe("list", lambda: _os.listdir({str(shared)!r}))
print("uid:", _os.getuid())
""")
            assert secret not in got.result.output, got.probes
            assert got["read"].startswith(("PermissionError", "FileNotFoundError")), got.probes
            assert f"uid: {uid}\n" not in got.result.output, got.result.output
            await assert_still_works(worker)
        assert second.poll() is None
    finally:
        for run in runs:
            _end(run, signal.SIGKILL)
        shutil.rmtree(project, ignore_errors=True)
