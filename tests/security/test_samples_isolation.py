"""Code samples (``Engine.map``): a sample reaches neither the slot that runs it, nor the
coordinator through it, nor another sample, whatever it tries; the slot runs the next one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from pathlib import Path

import pytest

from engine.launch._run_dirs import runtime_home
from engine.samples import Sample
from engine.sandbox import SandboxPolicy
from engine.workers import Engine

from ..conftest import NO_FORK_SERVER

pytestmark = pytest.mark.attack

_PROBE = """
import os
def probe(name, fn):
    try:
        print(name, repr(fn())[:120])
    except Exception as exc:
        print(name, type(exc).__name__)
"""


_REFUSED = ("FileNotFoundError", "PermissionError", "OSError")


def _needs_slots() -> None:
    """Skip where no slot runs samples (no fork server here): each sample then runs alone in a
    worker of its own, in a sandbox of its own, and that worker is the sample's own process —
    there is no slot to reach."""
    if NO_FORK_SERVER:
        pytest.skip(reason=f"samples start cold here ({NO_FORK_SERVER}); there is no slot")


async def _run(tmp_path: Path, samples: list[Sample], concurrency: int = 1) -> dict:
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        return {r.id: r async for r in engine.map(samples, concurrency=concurrency, timeout=20)}


async def test_a_sample_cannot_reach_its_slot(tmp_path: Path):
    _needs_slots()
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
    _needs_slots()
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


# -- samples that run at once ----------------------------------------------------------------

async def _until(predicate, timeout: float = 30.0):
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass, sleeping on the event
    loop (the engine's slots need it meanwhile); its last value."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value


def _sample_tmp(marker: str) -> Path | None:
    """The private /tmp, as the host sees it, of the running sample that made ``marker`` there."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            tmp = Path(f"/proc/{entry.name}/root/tmp")
            with contextlib.suppress(OSError):
                if (tmp / marker).exists():
                    return tmp
    return None


class _Held:
    """A sample that sets something up, says so with a marker in its own /tmp, and holds it
    until the test writes ``stop`` there (or 30 s pass): whatever runs meanwhile runs while
    it holds, with no timing to guess."""

    def __init__(self, engine: Engine, sample_id: str, setup: str, report: str = "") -> None:
        self.marker = "held-" + secrets.token_hex(6)
        code = (f"import os, time\n{setup}\nopen('/tmp/{self.marker}', 'w').close()\n"
                "deadline = time.monotonic() + 30\n"
                "while not os.path.exists('/tmp/stop') and time.monotonic() < deadline:\n"
                f"    time.sleep(0.02)\n{report}\n")
        self.task = asyncio.ensure_future(_collect(engine, [Sample(sample_id, code, timeout=60)]))
        self.tmp: Path | None = None

    async def ready(self) -> None:
        found = await _until(lambda: _sample_tmp(self.marker) or self.task.done())
        assert isinstance(found, Path), f"the held sample never got ready: {self.task}"
        self.tmp = found

    async def release(self) -> dict:
        assert isinstance(self.tmp, Path)
        with contextlib.suppress(OSError):
            (self.tmp / "stop").touch()
        return await asyncio.wait_for(self.task, 60)


async def _collect(engine: Engine, samples: list[Sample], concurrency: int = 1) -> dict:
    return {r.id: r async for r in engine.map(samples, concurrency=concurrency, timeout=20)}


async def test_samples_running_at_once_cannot_reach_each_others_terminal(tmp_path: Path):
    """A sample holding a terminal (a password typed and waiting to be read) is neither read
    nor written by another sample that runs meanwhile, whatever device it opens."""
    secret = "typed-password-" + secrets.token_hex(6)
    setup = (f"import termios\nmaster, slave = os.openpty()\n"
             "attrs = termios.tcgetattr(slave)\nattrs[3] &= ~termios.ECHO\n"
             "termios.tcsetattr(slave, termios.TCSANOW, attrs)\n"
             f"os.write(master, b'{secret}\\n')  # typed, waiting on the terminal for its reader\n"
             "os.set_blocking(master, False)\nprint('tty', os.ttyname(slave), flush=True)")
    report = ("try:\n    print('injected', os.read(master, 4096))\nexcept BlockingIOError:\n    pass\n"
              "os.set_blocking(slave, False)\nprint('still waiting', os.read(slave, 4096))")
    thief = _PROBE + """
import glob
for path in sorted(set(glob.glob('/dev/pts/*') + [f'/dev/pts/{n}' for n in range(16)] + ['/dev/tty', '/dev/console'])):
    if path.endswith('ptmx'):
        continue
    def steal(path=path):
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            try:
                got = os.read(fd, 4096)
            except BlockingIOError:
                got = b''
            os.write(fd, b'INJECTED\\n')
            return got
        finally:
            os.close(fd)
    probe(path, steal)
"""
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        victim = _Held(engine, "victim", setup, report)
        await victim.ready()
        thieves = await _collect(engine, [Sample("thief", thief)])
        held = await victim.release()
    out = thieves["thief"].stdout
    assert secret not in out, out
    assert all(line.split()[-1] in _REFUSED for line in out.splitlines()), out  # opened nothing
    victim = held["victim"]
    assert victim.status == "ok" and "injected" not in victim.stdout, victim
    assert f"still waiting b'{secret}" in victim.stdout, victim.stdout  # its input was there all along


_QUOTAS = """
import ctypes, fcntl
libc = ctypes.CDLL(None, use_errno=True)


def checked(result):
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def inotify():
    return checked(libc.inotify_init1(0))


def fanotify():
    return checked(libc.fanotify_init(0x200, 0))  # FAN_REPORT_FID: open to unprivileged users


def big_pipe():
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 1 << 20)  # pages counted against the user
    return read, write


def take_all(make):
    held = []
    while True:
        try:
            held.append(make())
        except OSError:
            return held
"""


async def test_samples_running_at_once_do_not_share_per_user_quotas(tmp_path: Path):
    """A sample that takes every inotify instance, fanotify group and pipe buffer page its user
    may have leaves another sample that runs meanwhile with its own."""
    if os.geteuid() != 0:
        pytest.skip(reason="unprivileged, every sample runs as the user, whose per-user kernel quotas "
                           "it shares (docs/security.md: concurrent samples)")
    hog = _QUOTAS + """
took = [len(take_all(make)) for make in (inotify, fanotify, big_pipe)]
print("took", took, flush=True)
"""
    innocent = _PROBE + _QUOTAS + "probe('inotify', inotify)\nprobe('fanotify', fanotify)\nprobe('pipe', big_pipe)\n"
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state") as engine:
        holder = _Held(engine, "hog", hog)
        await holder.ready()
        got = await _collect(engine, [Sample("innocent", innocent)])
        held = await holder.release()
    assert held["hog"].status == "ok" and "took" in held["hog"].stdout, held["hog"]
    lines = got["innocent"].stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["inotify", "fanotify", "pipe"], got["innocent"]
    assert not any(line.endswith("Error") for line in lines), lines  # each one opened


async def test_what_a_sample_leaves_in_flight_does_not_reach_the_next(tmp_path: Path):
    """Sockets (a listening port, a unix socket's name) and memory (a memfd of most of the
    memory limit) passed into a cycle of unix sockets that no process holds outlive every
    process of the sample; the next samples in the slot see none of it and get all their memory."""
    limit = 512 * 2**20
    token = "leak-" + secrets.token_hex(6)
    port = 20000 + secrets.randbelow(30000)
    leak = f"""
import array, ctypes, os, socket
listener = socket.socket()
listener.bind(("127.0.0.1", {port}))
listener.listen()
named = socket.socket(socket.AF_UNIX)
named.bind("\\0{token}")
libc = ctypes.CDLL(None, use_errno=True)
segment = libc.shmget(0x5eed, 1 << 20, 0o1600)  # a SysV segment no process maps (IPC_CREAT | 0600)
fds = [listener.fileno(), named.fileno()]
try:
    memory = os.memfd_create("leak")
    chunk = b"x" * (1 << 20)
    for _ in range({int(limit * 0.8) >> 20}):
        os.write(memory, chunk)
    fds.append(memory)
except OSError as exc:  # (no memory cgroup: the sandbox refuses memfds)
    print("no memfd:", exc)
a, b = socket.socketpair()
fds += [a.fileno(), b.fileno()]
for end in (a, b):  # each end holds the other in flight: a cycle no process holds
    end.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
print("leaked", len(fds), "descriptors; segment", segment, flush=True)
"""
    look = _PROBE + f"""
import socket
probe("unix", lambda: [line for line in open("/proc/net/unix") if "{token}" in line])
probe("tcp", lambda: [line for line in open("/proc/net/tcp").readlines()[1:]])
probe("shm", lambda: open("/proc/sysvipc/shm").readlines()[1:])
probe("port", lambda: socket.socket().bind(("127.0.0.1", {port})))
probe("name", lambda: socket.socket(socket.AF_UNIX).bind("\\0{token}"))
"""
    use = f"block = b'y' * {int(limit * 0.6)}\nprint('used', len(block) >> 20, 'MiB')\n"
    samples = [Sample("leak", leak), Sample("look", look), *(Sample(f"use{i}", use) for i in range(4))]
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state",
                      sandbox=SandboxPolicy(memory_bytes=limit)) as engine:
        got = {r.id: r async for r in engine.map(samples, concurrency=1, timeout=30)}
    assert got["leak"].status == "ok" and "leaked" in got["leak"].stdout, got["leak"]
    assert got["look"].stdout.splitlines() == ["unix []", "tcp []", "shm []", "port None", "name None"], got["look"]
    for i in range(4):
        assert (got[f"use{i}"].status, got[f"use{i}"].stdout) == ("ok", f"used {int(limit * 0.6) >> 20} MiB\n"), \
            got[f"use{i}"]


async def test_memory_left_in_flight_on_the_hosts_network_is_not_the_next_samples(tmp_path: Path):
    """With the host's network a slot cannot tell a sample's sockets from the host's: memfds
    passed into a cycle of unix sockets are freed (the slot starts the kernel's collection)
    or the slot is replaced before the next sample, which gets its whole memory limit."""
    _needs_slots()
    limit = 512 * 2**20
    leak = f"""
import array, os, socket, sys
try:
    memory = os.memfd_create("leak")
except PermissionError:  # no memory cgroup here (unprivileged, none delegated): none to leave in flight
    print("refused")
    sys.exit()
chunk = b"x" * (1 << 20)
for _ in range({int(limit * 0.8) >> 20}):
    os.write(memory, chunk)
a, b = socket.socketpair()
for end in (a, b):
    end.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memory, a.fileno(), b.fileno()]))])
print("leaked")
"""
    use = f"block = b'y' * {int(limit * 0.6)}\nprint('used')\n"
    samples = [Sample("leak", leak), *(Sample(f"use{i}", use) for i in range(4))]
    async with Engine(cwd=tmp_path, state_dir=tmp_path / "state",
                      sandbox=SandboxPolicy(memory_bytes=limit, network=True)) as engine:
        got = {r.id: r async for r in engine.map(samples, concurrency=1, timeout=30)}
    refused = os.geteuid() != 0 and got["leak"].stdout == "refused\n"
    assert (got["leak"].status, "leaked\n" if refused else got["leak"].stdout) == ("ok", "leaked\n"), got["leak"]
    assert all((got[f"use{i}"].status, got[f"use{i}"].stdout) == ("ok", "used\n") for i in range(4)), got


async def test_a_sample_sees_nothing_of_its_slot(tmp_path: Path):
    """No process of its slot (its namespace's init, the slot), no path of the coordinator's
    (the run's sockets and outputs, the cgroups): a sample sees its own processes, its own
    files and the system."""
    _needs_slots()
    attack = _PROBE + """
for pid in ("1", "2", str(os.getppid())):
    for what in ("mountinfo", "cgroup", "cmdline", "environ", "status", "mounts"):
        probe(f"{pid}/{what}", lambda: open(f"/proc/{pid}/{what}").read())
probe("procs", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()) == [os.getpid()])
probe("cgroup", lambda: sorted({line.rsplit(":", 1)[1].strip() for line in open("/proc/self/cgroup")}))
import json, sys
points = [line.split()[4] for line in open("/proc/self/mountinfo")]
print("LISTED", json.dumps({p: sorted(os.listdir(p))[:3] for p in points
                            if ("agentloop" in p or "/state/" in p) and os.path.isdir(p)}))
print("SEEN")  # what names paths: its mounts, its command line
print(open("/proc/self/mountinfo").read(), open("/proc/self/cmdline").read(), sys.orig_argv)
"""
    state = tmp_path / "state"
    got = await _run(tmp_path, [Sample("attack", attack)])
    out, _, seen = got["attack"].stdout.partition("SEEN\n")
    probes = dict(line.split(" ", 1) for line in out.splitlines())
    for name, outcome in probes.items():
        if "/" in name:
            assert outcome == "FileNotFoundError", (name, outcome)
    assert probes["procs"] == "True" and probes["cgroup"] == "['/']", probes
    # Of the run's state (its outputs among it), the sample's own workspace only; of its
    # sockets, nothing.
    workspace = [line for line in seen.splitlines() if str(state) in line]
    assert any(line.split()[4].endswith("/samples/workspace") for line in workspace), workspace
    assert "ipc://" not in seen, seen
    if os.geteuid() == 0:
        assert all(line.split()[4].endswith("/samples/workspace") for line in workspace), workspace
        assert str(runtime_home()) not in seen, seen
    else:  # the layers of the server's sandbox are locked beneath covers (docs/security.md): named, never shown
        listed = json.loads(probes["LISTED"])
        for point, names in listed.items():
            if point.startswith((str(state), str(runtime_home()))) and not point.endswith("/samples/workspace"):
                assert not names, (point, names)
