"""Code samples (``Engine.map``): a sample reaches neither the slot that runs it, nor the
coordinator through it, nor another sample, whatever it tries; the slot runs the next one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.samples import Sample

pytestmark = pytest.mark.attack

_PROBE = """
import os
def probe(name, fn):
    try:
        print(name, repr(fn())[:120])
    except Exception as exc:
        print(name, type(exc).__name__)
"""


async def _run(tmp_path: Path, samples: list[Sample], concurrency: int = 1) -> dict:
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        return {r.id: r async for r in engine.map(samples, concurrency=concurrency, timeout=20)}


async def test_a_sample_cannot_reach_its_slot(tmp_path: Path):
    attack = _PROBE + """
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
for pid in (1, os.getppid()):
    probe(f"kill {pid}", lambda: os.kill(pid, signal.SIGKILL))
    probe(f"stop {pid}", lambda: os.kill(pid, signal.SIGSTOP))
    probe(f"ptrace {pid}", lambda: libc.ptrace(16, pid, 0, 0) or -ctypes.get_errno())  # PTRACE_ATTACH
    probe(f"mem {pid}", lambda: open(f"/proc/{pid}/mem", "rb").read(1))
    probe(f"environ {pid}", lambda: open(f"/proc/{pid}/environ", "rb").read())
    probe(f"fds {pid}", lambda: os.listdir(f"/proc/{pid}/fd"))
    probe(f"root {pid}", lambda: os.listdir(f"/proc/{pid}/root/"))
"""
    got = await _run(tmp_path, [Sample("attack", attack), Sample("next", "print('served')")])
    out = got["attack"].stdout
    for line in out.splitlines():
        name, _, outcome = line.partition(" ")[2].partition(" ") if line.startswith(("kill", "stop", "ptrace",
                                                                                     "mem", "environ", "fds",
                                                                                     "root")) else ("", "", "")
        # (FileNotFoundError: not in its /proc at all, as unprivileged, where they share its uid)
        assert outcome in ("PermissionError", "-1", "ProcessLookupError", "FileNotFoundError"), line
    assert out.count("\n") == 14, out
    assert (got["next"].status, got["next"].stdout) == ("ok", "served\n")


async def test_a_sample_sees_nothing_of_a_running_one(tmp_path: Path):
    secret = "sample-secret-" + secrets.token_hex(8)
    holder = (f"import os, time\nsecret = {secret!r}\nfor d in ('.', '/tmp', '/dev/shm'):\n"
              "    open(os.path.join(d, 'secret'), 'w').write(secret)\nos.environ['SECRET'] = secret\n"
              "open('/tmp/ready', 'w').close()\ntime.sleep(8)\n")
    thief = _PROBE + """
import glob
probe("procs", lambda: sorted(p for p in os.listdir('/proc') if p.isdigit() and int(p) > 2 and int(p) != os.getpid()))
probe("files", lambda: [p for d in ('.', '/tmp', '/dev/shm') for p in glob.glob(d + '/*') if 'secret' in p])
probe("runs", lambda: [p for p in glob.glob(os.path.dirname(os.getcwd()) + '/**', recursive=True) if 'secret' in p])
"""
    got = await _run(tmp_path, [Sample("holder", holder, timeout=20), Sample("thief", thief)], concurrency=2)
    assert got["holder"].status == "ok", got["holder"]
    assert secret not in got["thief"].stdout and secret not in got["thief"].stderr
    assert "procs []" in got["thief"].stdout and "files []" in got["thief"].stdout, got["thief"].stdout


async def test_a_sample_plants_nothing_the_slot_imports(tmp_path: Path):
    plant = _PROBE + """
import sys, worker
for d in [os.path.dirname(os.path.dirname(worker.__file__)), *[p for p in sys.path if p and os.path.isdir(p)]]:
    probe("plant " + d, lambda: open(os.path.join(d, "socket.py"), "w").write("raise SystemExit(99)"))
"""
    got = await _run(tmp_path, [Sample("plant", plant), Sample("next", "import socket\nprint('served')")])
    assert "plant" in got["plant"].stdout
    lines = got["plant"].stdout.splitlines()
    # Only its own workspace (sys.path[0], as a script's directory is) takes the file; and,
    # unprivileged, a directory of its own /tmp that holds a read-only bind of the Python (the
    # sample owns the directories that hold its binds there, as in a worker started cold).
    own_tmp = [line for line in lines if os.geteuid() != 0 and line.startswith("plant /tmp/")
               and not line.endswith(("OSError", "PermissionError")) and "/samples/workspace " not in line]
    assert [line for line in lines if not line.endswith(("OSError", "PermissionError"))] == \
        [line for line in lines if "/samples/workspace " in line or line in own_tmp], lines
    # The workspace (on sys.path[0]) is the sample's own and goes with it: the next sample, and
    # the slot, import the real module.
    assert (got["next"].status, got["next"].stdout) == ("ok", "served\n")
