"""Forking a live worker (``Worker.fork``): real workers, forked in their real sandboxes, as
root and (the last test) as a plain user."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import textwrap

import pytest

from engine.errors import ForkRefused, WorkerStartError
from engine.launch import WorkerSettings
from engine.sandbox import SandboxPolicy
from engine.workers import Engine
from tests.conftest import REPO, Unprivileged
from worker.contract.confinement import landlock_abi


async def _out(worker, code: str, timeout: float = 20) -> str:
    result = await worker.run(code, timeout=timeout)
    assert result.status == "ok", (result.status, result.error, result.message)
    return result.output.strip()


async def test_copies_hold_the_namespace_and_nothing_flows_between_them_afterwards(worker):
    await worker.run("import math\ndef area(r): return math.pi * r * r\nbig = bytes(50 * 2**20)\nn = 1")
    a, b = await worker.fork(2)
    assert (a.name, b.name) == ("test/1", "test/2")
    assert await _out(a, "print(round(area(2), 3), len(big), n)") == "12.566 52428800 1"
    await a.run("n = 'a'")
    await worker.run("n = 'parent'")
    assert await _out(b, "print(n)") == "1"
    assert await _out(a, "print(n)") == "a"
    assert await _out(worker, "print(n)") == "parent"
    pids = {await _out(w, "import os; print(os.getpid())") for w in (worker, a, b)}
    assert len(pids) == 3
    assert "n:str" in a.var_notes or "n" in a.vars


async def test_random_streams_differ_in_every_copy(worker):
    await worker.run("import random, numpy\nrandom.seed(7)\nnumpy.random.seed(7)")
    copies = await worker.fork(3)
    draws = {await _out(w, "print(random.random(), numpy.random.random())") for w in [worker, *copies]}
    assert len(draws) == 4, draws


async def test_a_copy_of_a_copy(worker):
    await worker.run("depth = 0")
    (child,) = await worker.fork()
    await child.run("depth += 1")
    (grandchild,) = await child.fork()
    assert grandchild.name == "test/1/1"
    assert await _out(grandchild, "depth += 1; print(depth)") == "2"
    assert await _out(child, "print(depth)") == "1"
    assert await _out(worker, "print(depth)") == "0"


async def test_a_running_thread_is_refused_in_words_and_joined_it_forks(worker):
    await worker.run("import threading\nstop = threading.Event()\n"
                     "t = threading.Thread(target=stop.wait, name='crawler'); t.start()")
    with pytest.raises(ForkRefused, match="thread 'crawler'.*join it"):
        await worker.fork()
    await worker.run("stop.set(); t.join()")
    assert len(await worker.fork()) == 1


async def test_the_event_loops_idle_executor_threads_do_not_stop_a_fork(worker):
    await worker.run("import asyncio\nfirst = await asyncio.to_thread(sum, [1, 2])")  # leaves 'asyncio_0' idle
    (copy,) = await worker.fork()
    assert await _out(copy, "print(first, await asyncio.to_thread(sum, [3, 4]))") == "3 7"


async def test_a_pending_task_and_a_live_process_are_refused_in_words(worker):
    await worker.run("import asyncio\nparked = asyncio.ensure_future(asyncio.sleep(3600))\nawait asyncio.sleep(0)")
    with pytest.raises(ForkRefused, match="task .*pending.*cancel it"):
        await worker.fork()
    await worker.run("parked.cancel()\nawait asyncio.sleep(0.05)")
    await worker.run("import subprocess\np = subprocess.Popen(['sleep', '3600'])")
    with pytest.raises(ForkRefused, match=r"process \d+ \(sleep 3600\).*kill it"):
        await worker.fork()
    await worker.run("p.kill(); p.wait()")
    assert len(await worker.fork()) == 1


async def test_a_fork_while_a_block_runs_is_refused_not_waited_for(worker):
    slow = asyncio.ensure_future(worker.run("import time; time.sleep(30)", block_id="slow", timeout=60))
    for _ in range(200):
        if "slow" in worker.running:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(ForkRefused, match="block 'slow' is running"):
        await worker.fork()
    await worker.cancel("slow")
    assert (await slow).status == "cancelled"


async def test_killing_or_timing_out_one_copy_leaves_the_others_and_the_parent(worker):
    await worker.run("x = 41")
    a, b, c = await worker.fork(3)
    stubborn = "import time\nwhile True:\n    try:\n        time.sleep(0.05)\n    except BaseException:\n        pass"
    result = await a.run(stubborn, timeout=0.5)
    assert result.status == "timeout" and result.worker_killed, result
    await b.restart()
    assert await _out(c, "x += 1; print(x)") == "42"
    assert await _out(worker, "print(x)") == "41"
    # A killed copy is replaced as any worker is: a fresh process, an empty namespace.
    assert await _out(a, "print('x' in globals())") == "False"
    assert await _out(b, "print('x' in globals())") == "False"


async def test_a_copy_that_dies_says_so_and_the_others_go_on(worker):
    await worker.run("x = 1")
    a, b = await worker.fork(2)
    died = await a.run("import os; os._exit(3)")
    assert died.status == "died" and died.exit_code == 3, died
    assert await _out(b, "print(x)") == "1"


async def test_sixty_four_copies_of_one_worker_each_answer(worker):
    await worker.run("import os\nmine = os.getpid()")
    try:
        copies = await worker.fork(64)
    except ForkRefused as exc:  # a plain user's worker: one process limit for it and its copies
        assert os.geteuid() != 0 and "process limit" in str(exc), exc
        copies = await worker.fork(int(re.search(r"fork at most (\d+) now", str(exc)).group(1)))
        assert len(copies) >= 32, exc
    answers = await asyncio.gather(*(_out(c, "print(os.getpid() != mine)", timeout=60) for c in copies))
    assert answers == ["True"] * len(copies)
    assert len({c.name for c in copies}) == len(copies)
    await asyncio.gather(*(c.close() for c in copies))
    assert await _out(worker, "print(os.getpid() == mine)") == "True"


#: The parent listens on an abstract unix socket; a copy told its sibling's pid tries to reach
#: each of them and prints what the kernel answered (errno names).
_LISTEN = ("import os, socket\nparent = os.getpid()\nname = '\\0agentloop-apart-%d' % parent\n"
           "server = socket.socket(socket.AF_UNIX)\nserver.bind(name)\nserver.listen()")
_APART = """
import errno, json, os, socket, subprocess, sys
def tried(attempt):
    try:
        attempt()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
def reach(where):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(where)
def own_child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    p.kill()
    p.wait()
print(json.dumps({"signal parent": tried(lambda: os.kill(parent, 0)),
                  "signal sibling": tried(lambda: os.kill(sibling, 0)),
                  "parent environ": tried(lambda: open(f"/proc/{parent}/environ", "rb").read()),
                  "parent socket": tried(lambda: reach(name)),
                  "parent in /proc": "yes" if os.path.exists(f"/proc/{parent}") else "no",
                  "sibling in /proc": "yes" if os.path.exists(f"/proc/{sibling}") else "no",
                  "own child": tried(own_child), "itself": tried(lambda: os.kill(os.getpid(), 0))}))
"""
#: What a copy gets: nothing of its parent's or its sibling's (a /proc entry hidden or refused).
_APART_SEEN = {"signal parent": {"EPERM"}, "signal sibling": {"EPERM"}, "parent environ": {"EACCES", "ENOENT"},
               "parent socket": {"EPERM"}, "own child": {"ok"}, "itself": {"ok"},
               "parent in /proc": {"no"}, "sibling in /proc": {"no"}}


def _apart(seen: dict) -> bool:
    return seen.keys() == _APART_SEEN.keys() and all(seen[k] in _APART_SEEN[k] for k in seen)


async def test_a_copy_cannot_signal_trace_or_reach_its_parent_or_siblings(worker):
    if landlock_abi() < 6:
        pytest.skip("this kernel's Landlock does not scope signals and sockets (ABI < 6)")
    await worker.run(_LISTEN)
    a, b = await worker.fork(2)
    await a.run(f"sibling = {await _out(b, 'print(os.getpid())')}")
    seen = json.loads(await _out(a, _APART))
    assert _apart(seen), seen
    # The parent's own socket and signals are untouched, and the copies still serve blocks.
    assert await _out(worker, "with socket.socket(socket.AF_UNIX) as s: s.connect(name)\nprint('reached')") == "reached"
    assert await _out(b, "print(parent != os.getpid())") == "True"


async def test_copies_of_copies_end_in_words_where_the_kernel_stacks_no_more_domains(worker):
    if landlock_abi() < 6:
        pytest.skip("this kernel's Landlock does not scope signals and sockets (ABI < 6)")
    await worker.run("x = 1")
    current, depth = worker, 0
    with pytest.raises(WorkerStartError, match="at most 16, and each copy of a copy adds one"):
        while depth < 20:
            (current,) = await current.fork()
            depth += 1
    assert 10 <= depth < 16, depth
    assert await _out(current, "print(x)") == "1"  # (the deepest copy made still serves)


async def test_host_functions_of_a_copy_reach_its_owner(engine):
    calls = []

    async def on_call(name, args, kwargs, block):
        calls.append((name, args))
        return sum(args)

    worker = await engine.start_worker("tools", on_call=on_call)
    from worker.contract import wire

    await worker.request(wire.Bind((wire.host_function("add", "(a, b)"),)), keep=True)
    (copy,) = await worker.fork()
    assert await _out(copy, "print(add(2, 3))") == "5"
    assert calls == [("add", [2, 3])]


@pytest.mark.parametrize("mode", ["landlock", "none"])
async def test_copies_in_the_other_sandbox_modes(tmp_path, mode):
    settings = WorkerSettings(sandbox=SandboxPolicy(mode=mode))
    async with Engine(settings, cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        worker = await engine.start_worker("w")
        await worker.run("import threading\nx = [1]")
        a, b = await worker.fork(2)
        await a.run("x.append(2)")
        assert await _out(b, "print(x)") == "[1]"
        assert await _out(a, "print(x)") == "[1, 2]"
        (grandchild,) = await a.fork()
        assert await _out(grandchild, "print(x)") == "[1, 2]"
        await worker.run("t = threading.Thread(target=threading.Event().wait, args=(60,), name='idler', daemon=True)\n"
                         "t.start()")
        with pytest.raises(ForkRefused, match="thread 'idler'"):
            await worker.fork()


async def test_a_tcp_worker_is_refused_in_one_line(tmp_path):
    settings = WorkerSettings(transport="tcp", sandbox=SandboxPolicy(network=True))  # (loopback: the host's)
    async with Engine(settings, cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        worker = await engine.start_worker("remote")
        with pytest.raises(ForkRefused, match="only a local worker"):
            await worker.fork()


_AS_USER = """
import asyncio, json, tempfile
from pathlib import Path
from engine import Engine
from engine.errors import ForkRefused

async def main():
    d = Path(tempfile.mkdtemp())
    async with Engine(cwd=d, state_dir=d / "state") as engine:
        worker = await engine.start_worker("main")
        await worker.run("import random\\nx = [1, 2, 3]")
        copies = await worker.fork(4)
        seen = []
        for c in copies:
            r = await c.run("import json, os\\nx.append(os.getpid()); print(json.dumps([len(x), random.random()]))")
            seen.append(json.loads(r.output))
        parent = (await worker.run("print(len(x))")).output.strip()
        await worker.run(LISTEN)
        a, b = await worker.fork(2)
        await a.run("sibling = " + (await b.run("print(os.getpid())")).output)
        apart = json.loads((await a.run(APART)).output)
        try:
            await worker.fork(64)
            over = "forked"
        except ForkRefused as exc:
            over = str(exc)
        print(json.dumps({"seen": seen, "parent": parent, "apart": apart, "over": over, "notes": worker.notes}))

asyncio.run(main())
"""


def test_copies_as_a_plain_user(unprivileged: Unprivileged):
    script = f"LISTEN, APART = {_LISTEN!r}, {_APART!r}\n" + textwrap.dedent(_AS_USER)
    done = subprocess.run([*unprivileged.python, "-c", script], cwd=unprivileged.home,
                          env={**unprivileged.env, "PYTHONPATH": f"{REPO}:{unprivileged.env.get('PYTHONPATH', '')}"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert [s[0] for s in got["seen"]] == [4, 4, 4, 4], got
    assert len({s[1] for s in got["seen"]}) == 4, got
    assert got["parent"] == "3", got
    assert landlock_abi() < 6 or _apart(got["apart"]), got
    # No pids cgroup for a plain user here: the copies share the worker's process limit, and a fork
    # that would pass it is refused in words, saying how many would fit.
    assert "process limit" in got["over"] and "fork at most" in got["over"], got


# -- the model's protocol: <run_agent fork> and self.run_agent(fork=True) ----------------------

async def test_a_forked_sub_agent_sees_the_whole_namespace_and_keeps_its_changes(engine):
    from tests.test_agent import Recorder, last_user, solve

    script = {
        "parent task": [
            "<run_code>\nbasket = ['apple']\ndef weigh(xs):\n    return len(xs) * 10\n</run_code>",
            '<run_agent name="try-a" fork>child task</run_agent>',
            "<run_code>\nprint('parent sees', basket)\n</run_code>",
            "Done."],
        "child task": ["<run_code>\nbasket.append('pear'); print(weigh(basket), basket)\n</run_code>", "twenty"],
    }
    display = Recorder()
    result, server = await solve(engine, script, "parent task", display=display)
    assert result.status == "answered", result
    child = server.conversation("child task")
    assert "20 ['apple', 'pear']" in last_user(child[1])
    assert "basket" in child[0]["messages"][0]["content"]  # its system prompt lists what it holds
    parent = "".join(last_user(r) for r in server.conversation("parent task"))
    assert "parent sees ['apple']" in parent and "<agent_result name=try-a" in parent
    assert "fork" in server.conversation("parent task")[0]["messages"][0]["content"]
    assert any(t == "agent_started" and f.get("forked") for t, f in display.events)


async def test_self_run_agent_fork_copies_the_calling_block_as_far_as_it_ran(engine):
    from tests.test_agent import last_user, solve

    script = {
        "fan out": [
            "<run_code>\nseed = 41\nh = self.run_agent('grow it', name='g', fork=True)\nprint(await h)\n"
            "print('parent', seed)\n</run_code>",
            "waiting", "waiting", "all done"],
        "grow it": ["<run_code>\nseed += 1; print(seed)\n</run_code>", "grown"],
    }
    result, server = await solve(engine, script, "fan out")
    assert "42" in last_user(server.conversation("grow it")[1])
    texts = "".join(last_user(r) for r in server.conversation("fan out"))
    assert "grown" in texts and "parent 41" in texts


async def test_a_fork_refused_reaches_the_model_in_words(engine):
    from tests.test_agent import last_user, solve

    script = {"busy": [
        "<run_code>\nimport threading\nhold = threading.Event()\n"
        "threading.Thread(target=hold.wait, name='poller', daemon=True).start()\n</run_code>",
        '<run_agent name="f" fork>never</run_agent>',
        "gave up"]}
    result, server = await solve(engine, script, "busy")
    text = last_user(server.requests[2])
    assert text.startswith("<error name=f>") and "thread 'poller'" in text, text


def test_the_viewer_draws_a_forked_sub_agent_as_a_branch_of_its_parent(tmp_path):
    from engine.view.timeline import build

    records = [{"t": 1.0, "type": "run_started", "name": "main", "task": "t", "model": "m"},
               {"t": 1.1, "type": "agent_started", "name": "try-a", "parent": "main", "model": "m", "task": "x",
                "forked": True},
               {"t": 1.2, "type": "agent_started", "name": "plain", "parent": "main", "model": "m", "task": "y"}]
    data, _ = build(records, tmp_path / "run.jsonl")
    lanes = {lane["name"]: lane for lane in data["lanes"]}
    assert lanes["try-a"]["forked"] is True and lanes["try-a"]["parent"] == 0
    assert "forked" not in lanes["plain"]


async def test_a_cold_started_worker_forks_and_its_copy_is_confined_as_it_is(tmp_path):
    # Without the fork server (each worker in a bubblewrap of its own, where there is one): the
    # copy lives in its parent's sandbox, and sees nothing of another worker's.
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state", fork_server=False) as engine:
        worker, other = await engine.start_worker("w"), await engine.start_worker("other")
        await other.run("open('/tmp/theirs', 'w').write('x')")
        await worker.run("open('/tmp/ours', 'w').write('x')\nv = 7")
        (copy,) = await worker.fork()
        assert await _out(copy, "import os\nprint(v, os.path.exists('/tmp/ours'), os.path.exists('/tmp/theirs'))") \
            == f"7 True {not engine.launcher.plan(engine.launcher.sock_root).pid_namespace}"
