"""Containment of what a worker leaves behind and what it may read: planted modules never run
with privileges, workers hold no capability, the user's workspace files keep their owner's
protection, the socket directory and netlink stay closed, a directory of other people's files
is not shown, shared memory counts against the memory limit, output files never collide, and a
coordinator stopped by a signal leaves nothing behind."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine.sandbox import SandboxPolicy, host_support
from engine.sandbox._plan import MiB, plan
from engine.workers import Engine

from ..conftest import REPO, wait_until
from .harness import WAIT, Host, assert_still_works, attack, needs_namespaces

pytestmark = pytest.mark.attack

ROOT = os.geteuid() == 0

# -- 1. planted modules ---------------------------------------------------------------------

#: What a planted module does when imported: it leaves a mark only where it runs unconfined
#: (uid 0, any capability, or no seccomp filter yet) — the escape this test looks for.
_PAYLOAD = '''\
import os as _o
_s = open("/proc/self/status").read()
_f = dict(l.split(":", 1) for l in _s.splitlines() if ":" in l)
if _f["Uid"].split()[0] == "0" or int(_f["CapEff"], 16) or _f["Seccomp"].strip() == "0":
    for _d in {dirs!r}:
        try:
            open(_o.path.join(_d, "PLANTED-RAN-{name}"), "w").write(_s)
        except OSError:
            pass
'''

_PLANTS = ("worker/__init__.py", "worker/__main__.py", "worker/fork_server.py", "zmq/__init__.py",
           "msgpack/__init__.py", "sitecustomize.py", "usercustomize.py", "encodings/__init__.py",
           "cloudpickle/__init__.py", "evil.pth")


def _plant_code(dirs: list[str], marks: list[str]) -> str:
    """Model code planting every module of `_PLANTS` in every directory of `dirs`."""
    lines = ["import os"]
    for name in _PLANTS:
        body = _PAYLOAD.format(dirs=marks, name=name.replace("/", "."))
        if name.endswith(".pth"):
            body = "import os; exec(" + repr(body) + ")\n"
        lines.append(f"for d in {dirs!r}:\n"
                     f"    p = os.path.join(d, {name!r}); os.makedirs(os.path.dirname(p), exist_ok=True)\n"
                     f"    open(p, 'w').write({body!r})")
    lines.append("print('planted', flush=True)")
    return "\n".join(lines)


async def test_planted_modules_never_run_with_privileges(tmp_path: Path):
    """A worker plants `worker/`, `zmq/`, `encodings/`, `sitecustomize.py`, a `.pth`, ... in
    every directory it can write — the workspace, which is also the run's current directory,
    /tmp and its HOME — then a replacement worker starts, a fork server starts, and a new run
    starts in the same workspace: none of them imports a planted module before confinement."""
    ws = tmp_path / "ws"
    ws.mkdir()
    targets = [str(ws), "/tmp", "/dev/shm"]
    code = _plant_code(targets, [str(ws)])
    forked = ROOT and host_support().bwrap is not None
    async with Engine(cwd=ws, workspace=ws, state_dir=tmp_path / "state", pool=0) as engine:
        worker = await engine.start_worker("planter")
        got = await worker.run(code, timeout=WAIT)
        assert got.output.strip() == "planted", got
        killed = await worker.run("import os; os._exit(3)", timeout=WAIT)
        assert killed.status == "died", killed
        await assert_still_works(worker)  # the replacement worker
        sub = await worker.run("import importlib, sys; print(sys.path[0] == '')", timeout=WAIT)
        assert sub.output.strip() == "True", sub  # user code still imports from its directory
    for fork_server in ([True, False] if forked else [False]):
        async with Engine(cwd=ws, workspace=ws, state_dir=tmp_path / "state", pool=0,
                          fork_server=fork_server) as engine:  # a new run: fork server or cold start
            await assert_still_works(await engine.start_worker("next"))
    assert not sorted(p.name for p in ws.iterdir() if p.name.startswith("PLANTED-RAN")), \
        [p.read_text()[:400] for p in ws.iterdir() if p.name.startswith("PLANTED-RAN")]


def test_workspace_on_the_import_path_is_refused(tmp_path: Path):
    """A workspace that holds the directory agentloop imports from would let a worker plant
    code for the coordinator: the engine refuses it before anything starts."""
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="choose another --workspace"):
        Engine(cwd=tmp_path, workspace=REPO, state_dir=tmp_path / "state").open()


# -- 2. capabilities ------------------------------------------------------------------------

_ROOT_ONLY_PROC = ("/proc/slabinfo", "/proc/kpageflags", "/proc/timer_list", "/proc/vmallocinfo",
                   "/proc/1/environ", "/proc/self/../1/mem")


async def test_workers_hold_no_capability(worker):
    """Every capability set of the worker, and of what it starts, is empty; root-only procfs
    files stay closed to it."""
    code = '''
fields = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
    probe(name, lambda: int(fields[name], 16))
import subprocess
probe("child", lambda: subprocess.run(["grep", "-h", "^Cap", "/proc/self/status"], capture_output=True,
                                      text=True).stdout.split())
'''
    for path in _ROOT_ONLY_PROC:
        code += f"probe({path!r}, lambda: open({path!r}, 'rb').read(64) and 'read')\n"
    got = await attack(worker, code)
    for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert got[name] == "ok 0", (name, got.probes)
    assert set(eval(got["child"][3:])[1::2]) == {"0000000000000000"}, got["child"]
    for path in _ROOT_ONLY_PROC:
        assert got[path].startswith(("PermissionError", "FileNotFoundError")), (path, got.probes)
    await assert_still_works(worker)


# -- 3. the user's files in the workspace ------------------------------------------------------

@pytest.mark.skipif(not ROOT, reason="as an unprivileged user the worker is that user: the workspace's files are its own")
async def test_user_files_in_the_workspace_keep_their_protection(engine, worker, host: Host):
    """A root-owned config.json and data.csv put in the workspace by the user can be neither
    rewritten, replaced, renamed nor deleted by a worker; what workers write, they (and a
    replacement worker) may still change and delete."""
    config, data = host.workspace / "config.json", host.workspace / "data.csv"
    config.write_text('{"safe": true}\n')
    data.write_text("a,b\n1,2\n")
    got = await attack(worker, f'''
import os
ws = {str(host.workspace)!r}
probe("rewrite", lambda: open(os.path.join(ws, "config.json"), "w").write("{{}}"))
probe("delete", lambda: os.remove(os.path.join(ws, "data.csv")))
probe("rename", lambda: os.rename(os.path.join(ws, "config.json"), os.path.join(ws, "old.json")))
open(os.path.join(ws, "new.json"), "w").write("{{}}")
probe("replace", lambda: os.replace(os.path.join(ws, "new.json"), os.path.join(ws, "config.json")))
probe("chmod", lambda: os.chmod(os.path.join(ws, "config.json"), 0o666))
probe("own", lambda: open(os.path.join(ws, "mine.txt"), "w").write("mine"))
''')
    for name in ("rewrite", "delete", "rename", "replace", "chmod"):
        assert got[name].startswith("PermissionError"), (name, got.probes)
    assert config.read_text() == '{"safe": true}\n' and data.read_text() == "a,b\n1,2\n"
    assert got["own"] == "ok 4"
    await worker.run("import os; os._exit(1)", timeout=WAIT)  # a replacement worker ...
    again = await attack(worker, f'''
import os
probe("delete_own", lambda: os.remove({str(host.workspace / "mine.txt")!r}))
probe("delete_new", lambda: os.remove({str(host.workspace / "new.json")!r}))
''')
    assert again["delete_own"] == "ok" and again["delete_new"] == "ok", again.probes  # ... owns them


# -- 7. netlink -----------------------------------------------------------------------------

async def test_netlink_beyond_routing_is_refused(worker):
    """Device events (NETLINK_KOBJECT_UEVENT), audit and the other netlink families read host
    state; only NETLINK_ROUTE (address lookups, interface lists) opens."""
    got = await attack(worker, '''
import socket
for name, proto in (("uevent", 15), ("audit", 9), ("sock_diag", 4), ("generic", 16), ("netfilter", 12)):
    probe(name, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, proto).close())
probe("route", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close())
probe("ifaces", lambda: len(socket.if_nameindex()) >= 1)
''')
    if not host_support().seccomp:
        pytest.skip(reason="no seccomp on this host")
    for name in ("uevent", "audit", "sock_diag", "generic", "netfilter"):
        assert got[name] == "PermissionError EPERM", (name, got.probes)
    assert got["route"] == "ok" and got["ifaces"] == "ok True", got.probes


# -- 8. the socket directory ------------------------------------------------------------------

async def test_socket_directory_is_not_writable(worker):
    """The worker's socket lives in a directory on the host's disk: it may connect to the
    socket but write nothing beside it (a place outside the workspace and /tmp caps)."""
    sock_dir = worker.session.sock_dir
    got = await attack(worker, f'''
import os
d = {str(sock_dir)!r}
probe("write", lambda: open(os.path.join(d, "fill"), "wb").write(b"x" * 4096))
probe("mkdir", lambda: os.mkdir(os.path.join(d, "sub")))
probe("replant_socket", lambda: open(os.path.join(d, "sock"), "w"))
''')
    for name in ("write", "mkdir", "replant_socket"):
        assert got[name].startswith(("PermissionError", "OSError EROFS")), (name, got.probes)
    assert list(sock_dir.iterdir()) == []  # (its socket file, too, is gone once it is in)
    await assert_still_works(worker)


async def test_no_second_connection_to_the_coordinator(worker):
    """Each connection to the coordinator's socket gets queues of its own, which ZeroMQ fills
    before anything is read: once the worker is in, its socket's file is gone."""
    sock = worker.session.sock_dir / "sock"
    got = await attack(worker, f'''
import socket
s = socket.socket(socket.AF_UNIX)
probe("connect", lambda: s.connect({str(sock)!r}))
''')
    assert got["connect"] in ("FileNotFoundError ENOENT", "ConnectionRefusedError ECONNREFUSED"), got.probes
    assert not sock.exists()
    await assert_still_works(worker)


# -- 9. a current directory full of other people's files ---------------------------------------

def _plan_for(cwd: Path, tmp_path: Path, **policy) -> list[str]:
    return plan(SandboxPolicy(**policy), socket_dir=tmp_path / "s", workspace=tmp_path / "w",
                cwd=cwd, output_dir=tmp_path / "o", python=sys.executable)


def _other_home() -> str | None:
    """A home directory of another account that lies outside the system view (/var/www, a
    /home/NAME), if this machine has one."""
    system = ("/usr", "/bin", "/sbin", "/lib", "/dev", "/proc", "/run", "/sys", "/etc", "/nonexistent")
    homes = sorted({os.path.realpath(e.pw_dir) for e in pwd.getpwall() if e.pw_uid != os.getuid()
                    and os.path.isdir(e.pw_dir) and not os.path.realpath(e.pw_dir).startswith(system)
                    and os.path.realpath(e.pw_dir) != "/"})
    return homes[0] if homes else None


@pytest.mark.parametrize("where", ["/", "/home", "coordinator's home", "another user's home",
                                   "above a home"])
async def test_directories_of_homes_are_not_shown(where: str, tmp_path: Path):
    """Started in /, /home, a home directory (anyone's) or above one, the worker is shown none
    of it — a one-line note says so and names the flag that forces it."""
    needs_namespaces()
    other = _other_home()
    cwd = {"/": "/", "/home": "/home", "coordinator's home": os.path.realpath(os.path.expanduser("~")),
           "another user's home": other, "above a home": os.path.dirname(other) if other else None}[where]
    if cwd is None or not os.path.isdir(cwd):
        pytest.skip(reason="this machine has no such directory")
    # What the view holds beneath cwd anyway: the system and the Python the worker runs.
    from engine.sandbox import python_paths, system_paths

    needed = [*system_paths()[0], *python_paths(sys.executable)]
    allowed = {os.path.relpath(p, cwd).split("/")[0] for p in needed if p.startswith(cwd.rstrip("/") + "/")}
    on_the_way = {os.path.relpath(p, "/home").split("/")[0] for p in needed if p.startswith("/home/")}
    async with Engine(cwd=cwd, workspace=tmp_path / "ws", state_dir=tmp_path / "state", pool=0) as engine:
        worker = await engine.start_worker("w")
        assert any("is not shown to workers" in n and "--share-cwd" in n for n in worker.notes), worker.notes
        got = await attack(worker, f'''
import os
probe("cwd", os.getcwd)
probe("listing", lambda: sorted(set(os.listdir({cwd!r})) - set({sorted(allowed)!r})))
probe("homes", lambda: sorted(set(os.listdir("/home")) - set({sorted(on_the_way)!r})))
''')
    assert got["cwd"] == f"ok {str(tmp_path / 'ws')!r}", got.probes  # it starts in its workspace
    if cwd != "/":
        assert got["listing"] in ("FileNotFoundError ENOENT", "ok []"), got.probes
    assert got["homes"] in ("FileNotFoundError ENOENT", "ok []"), got.probes


def test_share_cwd_forces_either_way(tmp_path: Path):
    project = tmp_path / "project"
    project.mkdir()
    forced = _plan_for(Path("/home"), tmp_path, share_cwd=True)
    if host_support().bwrap:  # the forced directory is bound into the view, read-only
        argv = forced.argv_prefix
        assert any(argv[i:i + 3] == ["--ro-bind", "/home", "/home"] for i in range(len(argv))), argv
    assert forced.cwd == "/home" and not any("not shown" in n for n in forced.notes)
    refused = _plan_for(project, tmp_path, share_cwd=False)
    assert refused.cwd == str(tmp_path / "w") and any("--no-share-cwd" in n for n in refused.notes)
    assert _plan_for(project, tmp_path).cwd == str(project)  # a project directory is shown


# -- 15. shared memory and the memory limit -------------------------------------------------------

_SHARED_MEMORY = '''
import mmap, os
MB = 1 << 20
def memfd():
    fd = os.memfd_create("hog")
    chunk = b"x" * (16 * MB)
    for _ in range(48):  # 768 MiB
        os.write(fd, chunk)
    return "held"
def shared_anonymous():
    m = mmap.mmap(-1, 768 * MB)
    for i in range(0, 768 * MB, 4096):
        m[i] = 1
    return "held"
'''
_HOGS = {"memfd": "memfd", "mmap": "shared_anonymous"}


@pytest.mark.parametrize("how", ["memfd", "mmap"])
async def test_shared_memory_counts_against_the_memory_limit(how: str, host: Host):
    """memfd_create and shared anonymous mappings escape RLIMIT_DATA; under a 256 MiB limit
    neither may hold 768 MiB: the worker is stopped (memory cgroup) or the call refused
    (where no cgroup can be made), the coordinator goes on and the next block runs."""
    policy = SandboxPolicy(memory_bytes=256 * MiB)
    async with Engine(cwd=host.cwd, workspace=host.workspace, state_dir=host.state, sandbox=policy,
                      pool=0) as engine:
        worker = await engine.start_worker("hog")
        got = await attack(worker, _SHARED_MEMORY + f"probe({how!r}, {_HOGS[how]})\n")
        if engine.launcher.memory_cgroups is not None:
            assert got.result.status == "died" and "memory limit" in got.result.message, got.result
        else:
            assert got[how] == "PermissionError EPERM", got.probes
        assert "held" not in got.result.output
        await assert_still_works(worker)


# -- 16. output files ---------------------------------------------------------------------------

async def test_output_files_never_collide(worker):
    """Blocks `x/y` and `x_y` (and a reused id) print more than is kept in memory: each keeps a
    file of its own with its own output."""
    results = []
    for block_id, mark in (("x/y", "A"), ("x_y", "B"), ("x/y", "C")):
        results.append(await worker.run(f"print({mark!r} * (1 << 20))", timeout=WAIT, block_id=block_id))
    files = [r.output_file for r in results]
    assert all(files) and len(set(files)) == 3, files
    for result, mark in zip(results, "ABC", strict=True):
        assert Path(result.output_file).read_text().strip() == mark * (1 << 20)


# -- 17. a coordinator ended by a signal -----------------------------------------------------------

def _coordinator(tmp_path: Path, runtime: str, code: str) -> subprocess.Popen:
    """``exec --jsonl`` running ``code`` as its one sample: a coordinator with a fork server, its
    sockets and its run directory (``exec FILE`` has none: the script is its sandbox's child)."""
    env = {**os.environ, "XDG_RUNTIME_DIR": runtime, "XDG_STATE_HOME": str(tmp_path / "state")}
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "samples.jsonl").write_text(json.dumps({"id": "s", "code": code, "timeout": 60}) + "\n")
    (project / "out.jsonl").unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "exec", "--jsonl", "samples.jsonl", "-o", "out.jsonl",
                             "--progress", "none"], cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def _left(runtime: str, tmp_path: Path) -> list[str]:
    runs = [Path(runtime) / "agentloop", tmp_path / "state" / "agentloop" / "runs"]
    return sorted(str(p) for d in runs if d.is_dir() for p in d.iterdir())


def _wait_ready(proc: subprocess.Popen, runtime: str, tmp_path: Path) -> None:
    """Wait until the coordinator has made its run's directories."""
    assert wait_until(lambda: _left(runtime, tmp_path) or proc.poll() is not None, WAIT)
    assert proc.poll() is None, proc.stderr.read1(4096)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_coordinator_leaves_nothing(sig: int, tmp_path: Path):
    """SIGTERM cleans up as Ctrl-C does (sockets, run directories, workers); what a SIGKILLed
    coordinator could not clean up, the next start removes."""
    runtime = tempfile.mkdtemp(prefix="al-", dir="/tmp")  # short: ipc:// paths are limited
    try:
        proc = _coordinator(tmp_path, runtime, "import time\ntime.sleep(60)\n")
        _wait_ready(proc, runtime, tmp_path)  # the run's directories exist while it runs
        proc.send_signal(sig)
        proc.wait(timeout=WAIT)
        if sig == signal.SIGTERM:
            assert proc.returncode != 0
            assert _left(runtime, tmp_path) == []
        else:
            assert _left(runtime, tmp_path)  # nobody could clean up ...
            nxt = _coordinator(tmp_path, runtime, "print('ready')\n")
            nxt.wait(timeout=WAIT)
            assert nxt.returncode == 0
            assert _left(runtime, tmp_path) == []  # ... until the next start
        assert wait_until(lambda: not _workers_in(tmp_path), WAIT), _workers_in(tmp_path)
    finally:
        subprocess.run(["rm", "-rf", runtime], check=False)


def _workers_in(tmp_path: Path) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and os.readlink(f"/proc/{entry.name}/cwd").startswith(str(tmp_path)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not ROOT, reason="only a root coordinator changes owners and modes")
def test_a_link_where_a_run_directory_belongs_is_not_followed(tmp_path: Path):
    """Root gives the run's directories to its group; a worker that swapped one it can write
    (the fallback's files/.tmp) for a link to a host file must not get that file's mode or
    owner changed — the directory is put back instead."""
    from engine.sandbox._plan import _set_dir

    host_file = tmp_path / "host.conf"
    host_file.write_text("root's\n")
    host_file.chmod(0o600)
    before = host_file.stat()
    planted = tmp_path / "ws" / ".tmp"
    planted.parent.mkdir()
    planted.symlink_to(host_file)
    _set_dir(planted, 2_000_000_123, 0o3770)
    after = host_file.stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)
    assert planted.is_dir() and not planted.is_symlink()
    assert planted.stat().st_gid == 2_000_000_123 and planted.stat().st_mode & 0o7777 == 0o3770


def test_a_python_a_worker_could_have_written_is_never_run(tmp_path):
    # The coordinator asks the workers' interpreter what it is, and the fork server runs it with
    # privileges: one planted in the workspace, or (root) in a directory a worker's uid owns, is
    # refused before it runs at all.
    from engine.sandbox import _uids

    marker = tmp_path / "ran"
    planted = f'#!/bin/sh\ntouch {marker}\nexec {sys.executable} "$@"\n'
    (tmp_path / "x.py").write_text("print(1)\n")
    places = [tmp_path / "files" / "venv" / "bin"]
    if os.geteuid() == 0:
        places.append(tmp_path / "elsewhere" / "bin")
    for place in places:
        place.mkdir(parents=True)
        python = place / "python"
        python.write_text(planted)
        python.chmod(0o755)
        if "elsewhere" in str(place):
            os.chown(place, _uids.UID_BASE + 7, _uids.UID_BASE + 7)  # as a root worker's files are
        proc = subprocess.run([sys.executable, "-m", "engine.cli", "exec", "--python", str(python), "x.py"],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120,
                              env={**os.environ, "XDG_STATE_HOME": str(tmp_path.parent / f"{tmp_path.name}-state")})
        assert proc.returncode == 125, proc.stderr
        assert "workspace" in proc.stderr or "which workers of a run write as" in proc.stderr, proc.stderr
        assert not marker.exists(), f"{python} ran"
