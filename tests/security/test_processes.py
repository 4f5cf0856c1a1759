"""Attacks on processes: signalling or tracing the coordinator and other host processes, CPU
spins past the deadline, a fork bomb, and a daemon (setsid + double fork) meant to outlive
the kill.

The worker's PID namespace holds only its own processes: the coordinator's pid does not exist
there, and killing the namespace's outer process takes every process in it down."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from engine.results import OutputChunk
from tests.conftest import processes_with, wait_until

from .harness import (
    PRELUDE,
    PRINT_PID_NAMESPACE,
    WAIT,
    Host,
    agent_attack,
    assert_still_works,
    attack,
    block,
    described,
    gone,
    in_pid_namespace,
    needs_namespaces,
    probes_in,
)

pytestmark = pytest.mark.attack


def _status_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)


@pytest.fixture
def bystander(host: Host) -> Iterator[subprocess.Popen]:
    """An unrelated host process of the coordinator's user, waiting on its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", host.token],
                            stdin=subprocess.PIPE)
    yield proc
    proc.stdin.close()
    proc.wait(WAIT)


# Signals and tracing aimed at the coordinator (this test process) and a bystander.
def _signal_code(targets: list[int]) -> str:
    return f'''
import signal
for pid in {targets!r}:
    probe(f"kill{{pid}}", lambda: _os.kill(pid, signal.SIGKILL))
    probe(f"stop{{pid}}", lambda: _os.kill(pid, signal.SIGSTOP))
    probe(f"pgrp{{pid}}", lambda: _os.killpg(pid, signal.SIGKILL))
probe("init", lambda: _os.kill(1, signal.SIGKILL))
probe("everyone", lambda: _os.kill(-1, signal.SIGKILL))
'''


async def test_cannot_signal_the_coordinator(worker, bystander):
    needs_namespaces()
    me, other = os.getpid(), bystander.pid
    got = await attack(worker, _signal_code([me, other]))
    for pid in (me, other):
        for what in ("kill", "stop", "pgrp"):
            assert got[f"{what}{pid}"] == "ProcessLookupError ESRCH", (what, pid, got.probes)
    # The namespace's init (bubblewrap's): refused (another uid), or ignored by the kernel, which
    # never delivers SIGKILL to a namespace's init from inside it.
    assert got["init"] in ("PermissionError EPERM", "ok"), got.probes
    assert got["everyone"] == "ProcessLookupError ESRCH", got.probes  # nobody else to kill
    assert bystander.poll() is None
    assert _status_of(me)["State"].startswith(("R", "S"))
    await assert_still_works(worker)


async def test_cannot_ptrace_the_coordinator(worker, bystander):
    needs_namespaces()
    me, other = os.getpid(), bystander.pid
    got = await attack(worker, f'''
import ctypes
PTRACE_TRACEME, PTRACE_ATTACH, PTRACE_SEIZE = 0, 16, 0x4206
for pid in ({me}, {other}, 1):
    probe(f"attach{{pid}}", lambda: libc("ptrace", PTRACE_ATTACH, pid, None, None))
    probe(f"seize{{pid}}", lambda: libc("ptrace", PTRACE_SEIZE, pid, None, None))
    probe(f"mem{{pid}}", lambda: open(f"/proc/{{pid}}/mem", "rb").read(1))


class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


buf = ctypes.create_string_buffer(64)
local, remote = iovec(ctypes.addressof(buf), 64), iovec(0x400000, 64)
probe("vm_read", lambda: libc("process_vm_readv", {me}, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))
probe("traceme", lambda: libc("ptrace", PTRACE_TRACEME, 0, None, None))
''')
    for pid in (me, other, 1):
        assert got[f"attach{pid}"] == "PermissionError EPERM", (pid, got.probes)  # seccomp
        assert got[f"seize{pid}"] == "PermissionError EPERM", (pid, got.probes)
    for pid in (me, other):
        assert got[f"mem{pid}"] == "FileNotFoundError ENOENT", (pid, got.probes)
    assert got["vm_read"] == "PermissionError EPERM" and got["traceme"] == "PermissionError EPERM", got.probes
    assert _status_of(me)["TracerPid"].strip() == "0"
    assert _status_of(other)["TracerPid"].strip() == "0"
    assert bystander.poll() is None
    await assert_still_works(worker)


async def test_agent_cannot_kill_the_coordinator(engine, bystander):
    needs_namespaces()
    me, other = os.getpid(), bystander.pid
    code = _signal_code([me, other]) + f'probe("attach", lambda: libc("ptrace", 16, {me}, None, None))\n'
    run = await agent_attack(engine, block("attack", code), name="kill")
    text = run.blocks["attack"]
    assert f"kill{me}: ProcessLookupError ESRCH" in text and "attach: PermissionError EPERM" in text, text
    assert bystander.poll() is None
    run.assert_kept_working()


# -- CPU -----------------------------------------------------------------------------------

SPIN = "while True:\n    pass\n"
# Swallows the cooperative cancel: only the kill ends it.
STUBBORN_SPIN = '''
while True:
    try:
        while True:
            pass
    except BaseException:
        pass
'''
# A loop in C that holds the GIL: the worker cannot even read the cancel request.
GIL_SPIN = "sum(range(10 ** 15))\n"


@pytest.mark.parametrize("code, killed", [(SPIN, False), (STUBBORN_SPIN, True), (GIL_SPIN, True)],
                         ids=["python-loop", "ignores-cancel", "holds-the-gil"])
async def test_cpu_spin_past_the_deadline(engine, worker, code, killed):
    pid = worker.pid
    result = await worker.run(code, timeout=1)
    assert result.status == "timeout", result
    assert result.message.startswith("timed out after 1 s"), result.message
    assert result.worker_killed is killed, result
    assert result.duration_s < 1 + engine.settings.grace + 5, result.duration_s
    if killed:
        assert not os.path.exists(f"/proc/{pid}") or _status_of(pid)["State"].startswith("Z")
    else:
        assert worker.pid == pid  # stopped cooperatively: same process, namespace kept
    await assert_still_works(worker)


async def test_agent_cpu_spin_is_killed_at_its_deadline(engine):
    run = await agent_attack(engine, block("attack", STUBBORN_SPIN, timeout="1s"), name="cpu")
    assert "timed out after 1 s" in run.blocks["attack"], run.blocks
    assert "the worker was killed" in run.blocks["attack"]
    run.assert_kept_working()


# -- fork bomb -------------------------------------------------------------------------------

#: Seconds the fork bomb runs before its deadline: the process limit is reached in well under
#: one on an idle machine, and the attack asserts it was reached.
BOMB_DEADLINE = 10
# The parent forks until the process limit refuses, each child waiting on a pipe (so that the
# parent, not hundreds of spinning children, has the CPU however loaded the machine is), and
# reports the refusal and how many it made in one write; then it lets them all go — each forks
# forever — keeps forking itself and ignores the cooperative cancel, so only the hard kill at
# the deadline ends it.
FORK_BOMB = PRINT_PID_NAMESPACE + '''
import errno, os
go, going = os.pipe()
born = 0
while True:
    try:
        pid = os.fork()
    except OSError as exc:
        print("fork:", type(exc).__name__, errno.errorcode[exc.errno], "born:", born, flush=True)
        break
    if pid == 0:
        os.close(going)
        os.read(go, 1)  # (until the parent closes its end)
        while True:
            try:
                os.fork()
            except OSError:
                pass
    born += 1
os.close(going)
while True:
    try:
        while True:
            try:
                os.fork()
            except OSError:
                pass
    except BaseException:
        pass
'''


async def test_fork_bomb_is_contained_and_killed(engine, worker):
    needs_namespaces()
    said, alive = bytearray(), []

    def count(chunk: OutputChunk) -> None:  # how many processes the bomb has while it runs
        said.extend(chunk.data)
        if b"born:" in said and not alive:
            alive.append(len(in_pid_namespace(probes_in(said.decode())["pidns"])))

    result = await worker.run(PRELUDE + FORK_BOMB, timeout=BOMB_DEADLINE, on_output=count)
    assert "fork: BlockingIOError EAGAIN" in result.output, result  # RLIMIT_NPROC
    born = int(result.output.split("born:")[1].split()[0])
    assert 0 < born < engine.settings.sandbox.max_processes, result.output
    assert alive and alive[0] > 10, alive  # the bomb really went off
    assert result.status == "timeout" and result.worker_killed, result
    ns = probes_in(result.output)["pidns"]
    assert wait_until(lambda: not in_pid_namespace(ns), WAIT), f"left behind: {described(in_pid_namespace(ns))}"
    await assert_still_works(worker)


async def test_agent_fork_bomb_is_contained(engine):
    needs_namespaces()
    run = await agent_attack(engine, block("attack", FORK_BOMB, timeout=f"{BOMB_DEADLINE}s"), name="fork bomb")
    text = run.blocks["attack"]
    assert "fork: BlockingIOError EAGAIN" in text and "the worker was killed" in text, text
    ns = probes_in(text)["pidns"]
    assert wait_until(lambda: not in_pid_namespace(ns), WAIT), f"left behind: {described(in_pid_namespace(ns))}"
    run.assert_kept_working()


# -- daemons ---------------------------------------------------------------------------------

def _daemon_code(token: str) -> str:
    """Detach a grandchild into a session of its own that ignores hangups and terminations,
    named by ``token`` on its command line."""
    body = ("import signal, time\\n"
            "for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT): signal.signal(s, signal.SIG_IGN)\\n"
            "while True: time.sleep(60)")
    return f'''
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "{body}", {token!r}])
    finally:
        os._exit(0)
os.waitpid(pid, 0)
print("daemon: detached", flush=True)
'''


async def test_setsid_daemon_does_not_survive_the_kill(worker, host: Host):
    needs_namespaces()
    got = await attack(worker, _daemon_code(host.token))
    assert got["daemon"] == "detached", got.probes
    assert wait_until(lambda: processes_with(host.token), WAIT), "the daemon never started"
    spin = await worker.run(STUBBORN_SPIN, timeout=1)  # the kill at the deadline
    assert spin.status == "timeout" and spin.worker_killed, spin
    assert gone(host.token), f"survived the kill: {processes_with(host.token)}"
    await assert_still_works(worker)


async def test_setsid_daemon_does_not_survive_shutdown(engine, worker, host: Host):
    needs_namespaces()
    got = await attack(worker, _daemon_code(host.token))
    assert got["daemon"] == "detached", got.probes
    assert wait_until(lambda: processes_with(host.token), WAIT), "the daemon never started"
    await engine.shutdown()
    assert gone(host.token), f"survived the shutdown: {processes_with(host.token)}"


async def test_agent_daemon_dies_with_the_kill(engine, host: Host):
    needs_namespaces()
    seen: dict[str, list[int]] = {}

    def after_daemon(body: dict) -> str:
        seen["started"] = processes_with(host.token) if wait_until(
            lambda: processes_with(host.token), WAIT) else []
        return block("spin", STUBBORN_SPIN, timeout="1s")

    def after_kill(body: dict) -> str:
        seen["after_kill"] = [] if gone(host.token) else processes_with(host.token)
        return "<run_code id=\"check\">\nprint('still here')\n</run_code>"

    run = await agent_attack(engine, block("attack", _daemon_code(host.token)), after_daemon, after_kill,
                             name="daemon")
    assert "daemon: detached" in run.blocks["attack"], run.blocks
    assert seen["started"], "the daemon never started"
    assert "the worker was killed" in run.blocks["spin"], run.blocks
    assert seen["after_kill"] == [], f"survived the kill: {seen['after_kill']}"
    assert run.blocks["check"].strip() == "still here"
    run.assert_kept_working()

