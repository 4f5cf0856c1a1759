"""Real attacks against real sandboxes.

Each test plans a sandbox with `engine.sandbox.plan()`, starts `plan.argv_prefix + [python, -c,
SCRIPT]` where SCRIPT applies `worker._confine.apply(plan.confine)` and then attacks, and checks
the safe outcome.  Every attack runs in four variants where the machine allows: as the user
running the tests (root, typically) and as `nobody`, each with bubblewrap and in the
Landlock-only fallback (mode "landlock").
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.launch import report
from engine.sandbox import LaunchPlan, SandboxPolicy, host_support, workspace_excess
from engine.sandbox._host import fork_server_problem
from engine.sandbox._plan import plan
from tests.conftest import read_line
from worker._confine import seccomp_program
from worker.contract.confinement import Confinement, Seccomp

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
# nobody cannot enter /root, where this venv's interpreter lives: it runs the system python of
# the same minor version with this project and the venv's packages on PYTHONPATH.
NOBODY_PATH = f"{ROOT}:{sysconfig.get_paths()['purelib']}"
WAIT = 60  # seconds: the bound on every wait below

PRELUDE = r'''
import errno, json, os, sys
from worker._confine import apply
from worker.contract.confinement import Confinement
print("APPLIED", json.dumps(apply(Confinement.from_json(sys.argv[1]))), flush=True)
ARGS = json.loads(sys.argv[2])

def probe(name, fn):
    try:
        r = fn()
    except BaseException as e:
        code = getattr(e, "errno", None)
        r = type(e).__name__ + ("" if code is None else " " + errno.errorcode.get(code, str(code)))
    else:
        r = "ok" if r is None else "ok " + str(r)
    print(name + ": " + r, flush=True)
'''

DENIED = ("PermissionError", "OSError EROFS", "OSError EPERM", "OSError EACCES")
ABSENT_OR_DENIED = ("FileNotFoundError", "PermissionError")


def _can_run_as_nobody() -> str | None:
    if os.geteuid() != 0:
        return "not root: cannot switch to nobody"
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) not installed"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} missing: nobody cannot run the root-owned venv python"
    same = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                          capture_output=True, text=True, timeout=WAIT).stdout.strip()
    if same != str(sys.version_info[:2]):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}"
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            SYSTEM_PYTHON, "-c", "import engine.sandbox._plan"], cwd="/",
                           env={"PYTHONPATH": NOBODY_PATH, "PATH": "/usr/bin:/bin"},
                           capture_output=True, timeout=WAIT)
    if probe.returncode != 0:
        return f"nobody cannot import this project: {probe.stderr.decode()[-200:]}"
    return None


_NOBODY_PROBLEM = _can_run_as_nobody()
# "self": the user running the tests (root here); "nobody": an unprivileged user.
VARIANTS = [("self", "bwrap"), ("self", "landlock"), ("nobody", "bwrap"), ("nobody", "landlock")]


@dataclasses.dataclass
class _Planned:
    """What a plan made by another user says (its command line, spec and words), as a test needs it."""

    argv: list[str]
    confine: Confinement
    notes: list[str]
    env: dict[str, str]
    cwd: str | None
    uid: int | None
    details: list[str]

    @property
    def argv_prefix(self) -> list[str]:
        return self.argv

    @property
    def pid_namespace(self) -> bool:
        return bool(self.argv)

    def grant(self, path: Path) -> None:
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)


@dataclasses.dataclass
class Result:
    rc: int
    out: dict[str, str]
    stdout: str
    stderr: str

    def __getitem__(self, key: str) -> str:
        return self.out[key]


class Box:
    """One planned sandbox: its host directories, its plan, a way to run scripts in it."""

    def __init__(self, base: Path, user: str, mode: str, policy: SandboxPolicy):
        self.base, self.user, self.mode = base, user, mode
        self.workspace, self.socket_dir = base / "run" / "workspace", base / "sockets" / "w1"
        self.output_dir, self.cwd = base / "run" / "outputs", base / "project"
        self.other_ws = base / "other-run" / "workspace"
        for d in (self.workspace, self.socket_dir, self.output_dir, self.cwd, self.other_ws):
            d.mkdir(parents=True)
        (self.cwd / "main.py").write_text("print('project file')\n")
        (self.output_dir / "block-1.txt").write_text("full output\n")
        (self.other_ws / "secret.txt").write_text("other run's secret\n")
        self.python = sys.executable if user == "self" else SYSTEM_PYTHON
        if user == "nobody":
            for d in base.rglob("*"):
                os.chown(d, NOBODY, NOBODY)
        self.plan = self._plan(policy)

    def _plan(self, policy: SandboxPolicy) -> LaunchPlan | _Planned:
        kwargs = dict(socket_dir=self.socket_dir, workspace=self.workspace, cwd=self.cwd,
                      output_dir=self.output_dir, python=self.python)
        if self.user == "self":
            return plan(policy, **kwargs)
        driver = ("import json, sys, dataclasses\nfrom pathlib import Path\n"
                  "from engine.sandbox import SandboxPolicy, plan\n"
                  "a = json.loads(sys.argv[1])\n"
                  "p = plan(SandboxPolicy(**a.pop('policy')), python=a.pop('python'),"
                  " **{k: Path(v) for k, v in a.items()})\n"
                  "print(json.dumps({'argv': p.argv_prefix, 'confine': p.confine.to_json(), 'notes': p.notes,"
                  " 'env': p.env, 'cwd': p.cwd, 'uid': p.uid, 'details': p.details}))\n")
        arg = {"policy": dataclasses.asdict(policy), **{k: str(v) for k, v in kwargs.items()}}
        done = subprocess.run(self._as_user([SYSTEM_PYTHON, "-c", driver, json.dumps(arg)]),
                              cwd=self.cwd, env=self._env({}), capture_output=True, text=True,
                              timeout=WAIT)
        assert done.returncode == 0, done.stderr
        fields = json.loads(done.stdout)
        return _Planned(**{**fields, "confine": Confinement.from_json(fields["confine"])})

    def _as_user(self, argv: list[str]) -> list[str]:
        if self.user == "self":
            return argv
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", **extra}
        if self.user == "nobody":
            env["PYTHONPATH"] = NOBODY_PATH
        return env

    def argv(self, code: str, **args) -> list[str]:
        return self._as_user(self.plan.argv_prefix + [self.python, "-c", PRELUDE + code,
                                                      self.plan.confine.to_json(), json.dumps(args)])

    def popen(self, code: str, **args) -> subprocess.Popen:
        return subprocess.Popen(self.argv(code, **args), cwd=self.plan.cwd, env=self._env(self.plan.env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def run(self, code: str, **args) -> Result:
        done = subprocess.run(self.argv(code, **args), cwd=self.plan.cwd, env=self._env(self.plan.env),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=WAIT,
                              start_new_session=True)
        out = {}
        for line in done.stdout.splitlines():
            name, sep, value = line.partition(": ")
            if sep:
                out[name] = value
        assert done.stdout.startswith("APPLIED"), f"sandbox did not start: {done.stderr[-2000:]}"
        return Result(done.returncode, out, done.stdout, done.stderr)

    @property
    def has_pid_ns(self) -> bool:
        return self.plan.pid_namespace


@pytest.fixture(params=VARIANTS, ids=[f"{u}-{m}" for u, m in VARIANTS])
def variant(request) -> tuple[str, str]:
    user, mode = request.param
    if user == "nobody" and _NOBODY_PROBLEM:
        pytest.skip(reason=_NOBODY_PROBLEM)
    if mode == "landlock" and host_support().landlock_abi < 1:
        pytest.skip(reason="Landlock is not available on this kernel")
    if mode == "bwrap" and user == "self" and host_support().bwrap is None:
        pytest.skip(reason=f"bubblewrap unusable: {host_support().bwrap_problem}")
    return user, mode


@pytest.fixture
def make_box(variant) -> Iterator:
    bases: list[Path] = []

    def make(**policy) -> Box:
        base = Path(tempfile.mkdtemp(prefix="agentloop-sbx-"))
        base.chmod(0o755)
        bases.append(base)
        user, mode = variant
        try:
            return Box(base, user, mode, SandboxPolicy(mode=mode, **policy))
        except AssertionError as exc:
            if user == "nobody" and mode == "bwrap" and "bubblewrap" in str(exc):
                pytest.skip(reason="bubblewrap unusable for nobody")
            raise

    yield make
    for base in bases:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def box(make_box) -> Box:
    return make_box()


def _marked_pids(marker: str, *, python_only: bool = False) -> list[int]:
    """Host pids whose command line carries `marker` (bwrap's own processes carry it too)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() not in f.read():
                        continue
                with open(f"/proc/{entry.name}/comm") as f:
                    if python_only and f.read().strip() in ("bwrap", "setpriv"):
                        continue
            except OSError:
                continue
            pids.append(int(entry.name))
    return pids


def _wait_until(cond, what: str, bound: float = WAIT) -> None:
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {bound}s waiting for {what}")
        time.sleep(0.05)  # polling a kernel-side condition (process table); not a synchronisation sleep


def _kill_tree(box: Box, proc: subprocess.Popen) -> None:
    # With a PID namespace, killing bwrap (the outer process) tears the namespace down; without
    # one the worker's process group is the tree (seccomp keeps everyone in it).
    if box.has_pid_ns:
        proc.kill()
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=WAIT)


# ---------------------------------------------------------------------------------------------
# The layers are there, and ordinary work still works
# ---------------------------------------------------------------------------------------------

def test_all_planned_layers_apply(box: Box) -> None:
    code = ("import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "def caps():\n    data = ctypes.create_string_buffer(24)\n"
            "    libc.capget(struct.pack('Ii', 0x20080522, 0), data)\n"
            "    e0, p0, i0, e1, p1, i1 = struct.unpack('6I', data.raw)\n"
            "    return hex(e0 | e1 << 32), hex(p0 | p1 << 32), hex(i0 | i1 << 32)\n"
            "probe('uid', os.getuid)\nprobe('groups', os.getgroups)\nprobe('caps', caps)\n"
            "probe('no_new_privs', lambda: libc.prctl(39, 0, 0, 0, 0))\n"
            "probe('seccomp_mode', lambda: libc.prctl(21, 0, 0, 0, 0))")
    r = box.run(code)
    applied = json.loads(r.stdout.splitlines()[0].split(" ", 1)[1])
    assert applied[:1] == ["rlimits"] and applied[-1] == "seccomp"
    assert {"caps", "no_new_privs"} <= set(applied) and any(a.startswith("landlock") for a in applied)
    assert r["no_new_privs"] == "ok 1" and r["seccomp_mode"] == "ok 2"
    if box.user == "self" and os.geteuid() == 0 and box.plan.uid is not None:
        assert "uid" in applied and r["uid"] == f"ok {box.plan.uid}"  # root workers leave uid 0
    elif box.user == "self" and os.geteuid() == 0:  # a path it needs is closed to other users
        assert any("keeps uid 0" in n for n in box.plan.notes), box.plan.notes
    else:
        assert r["uid"] == f"ok {NOBODY if box.user == 'nobody' else os.getuid()}"
    assert r["caps"] == "ok ('0x0', '0x0', '0x0')"  # no capability at all, root's workers included
    # Root's workers drop every supplementary group; a plain user cannot (its user namespace
    # denies setgroups): its worker keeps the user's own, any unmapped one shown as 65534.
    groups = set(json.loads(r["groups"].removeprefix("ok ")))
    assert groups <= (set() if os.geteuid() == 0 else {*os.getgroups(), 65534}), r["groups"]
    assert (box.mode == "bwrap") == box.plan.pid_namespace


def test_ordinary_work_still_works(box: Box) -> None:
    code = r'''
import asyncio, hashlib, socket, sqlite3, ssl, subprocess, tempfile, threading
ws = ARGS["ws"]
probe("write_ws", lambda: open(os.path.join(ws, "a.txt"), "w").write("hi"))
probe("mkdir_rename_ws", lambda: (os.makedirs(os.path.join(ws, "d/e")),
                                   os.rename(os.path.join(ws, "a.txt"), os.path.join(ws, "d/e/b.txt"))))
probe("tempfile", lambda: tempfile.NamedTemporaryFile().write(b"x"))
probe("read_cwd", lambda: open("main.py").read().strip())
probe("read_output", lambda: open(os.path.join(ARGS["out"], "block-1.txt")).read().strip())
probe("subprocess", lambda: subprocess.run(["sh", "-c", "echo hi"], capture_output=True, text=True).stdout.strip())
probe("thread", lambda: (lambda t: (t.start(), t.join()))(threading.Thread(target=hashlib.sha256)))
probe("socketpair", lambda: socket.socketpair()[0].close())
probe("sqlite", lambda: sqlite3.connect(os.path.join(tempfile.gettempdir(), "db")).execute("select 1").fetchone()[0])
probe("asyncio", lambda: asyncio.run(asyncio.sleep(0, result=7)))
probe("ssl", lambda: ssl.create_default_context() and 1)
probe("devnull", lambda: subprocess.run(["true"], stdout=subprocess.DEVNULL).returncode)
def unix_roundtrip():
    path = os.path.join(ARGS["ws"], "s")
    srv = socket.socket(socket.AF_UNIX); srv.bind(path); srv.listen()
    cli = socket.socket(socket.AF_UNIX); cli.connect(path)
    conn, _ = srv.accept(); cli.sendall(b"ping"); return conn.recv(4).decode()
probe("unix_socket", unix_roundtrip)
'''
    r = box.run(code, ws=str(box.workspace), out=str(box.output_dir), sock=str(box.socket_dir))
    assert r.rc == 0, r.stderr
    expect = {"write_ws": "ok 2", "read_cwd": "ok print('project file')", "read_output": "ok full output",
              "subprocess": "ok hi", "sqlite": "ok 1", "asyncio": "ok 7", "devnull": "ok 0",
              "unix_socket": "ok ping", "ssl": "ok 1"}
    for name, value in expect.items():
        assert r[name] == value, (name, r.stdout, r.stderr)
    for name in ("mkdir_rename_ws", "tempfile", "thread", "socketpair"):
        assert r[name].startswith("ok"), (name, r[name])
    assert (box.workspace / "d" / "e" / "b.txt").read_text() == "hi"


def test_worker_connects_to_a_socket_the_coordinator_binds(box: Box) -> None:
    path = box.socket_dir / "worker.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()
    srv.settimeout(WAIT)
    if box.user == "nobody":
        os.chown(path, NOBODY, NOBODY)
    box.plan.grant(path)  # the root coordinator's step once the socket exists
    try:
        code = ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
                "probe('connect', lambda: (s.connect(ARGS['path']), s.sendall(b'hello')))")
        r = box.run(code, path=str(path))
        assert r["connect"].startswith("ok"), r.stdout + r.stderr
        conn, _ = srv.accept()
        conn.settimeout(WAIT)
        assert conn.recv(5) == b"hello"
        conn.close()
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def _host_home_file() -> str | None:
    for cand in ("/root/.bashrc", "/root/.profile", *(str(p) for p in Path("/home").glob("*/.*"))):
        if os.path.isfile(cand) and not cand.startswith(str(Path(sys.base_prefix))):
            return cand
    return None


def test_secrets_are_not_readable(box: Box) -> None:
    code = r'''
probe("shadow", lambda: open("/etc/shadow").read())
probe("gshadow", lambda: open("/etc/gshadow").read())
probe("other_run", lambda: open(ARGS["other"]).read())
probe("coordinator_environ", lambda: open(f"/proc/{ARGS['pid']}/environ", "rb").read())
probe("coordinator_cmdline", lambda: open(f"/proc/{ARGS['pid']}/cmdline", "rb").read())
probe("root_listing", lambda: sorted(os.listdir("/root")))
if ARGS["home_file"]:
    probe("home_file", lambda: open(ARGS["home_file"]).read())
probe("ssh_keys", lambda: os.listdir("/root/.ssh"))
probe("pyenv_other", lambda: os.listdir("/root/.pyenv/shims"))
'''
    home_file = _host_home_file()
    r = box.run(code, other=str(box.other_ws / "secret.txt"), pid=os.getpid(), home_file=home_file)
    for name in ("shadow", "gshadow", "other_run", "coordinator_environ", "coordinator_cmdline",
                 "ssh_keys", "pyenv_other") + (("home_file",) if home_file else ()):
        assert r[name].startswith(ABSENT_OR_DENIED), (name, r[name])
    if box.mode == "bwrap":
        # Only the worker python's own prefix, if it lives there, exists under /root.
        assert r["root_listing"] in ("ok ['.pyenv']", "FileNotFoundError ENOENT"), r["root_listing"]
    else:
        assert r["root_listing"].startswith("PermissionError")


def test_writes_outside_the_workspace_fail(box: Box) -> None:
    name = f"agentloop-probe-{uuid.uuid4().hex}"
    targets = {"cwd": box.cwd / name, "home": Path(os.path.expanduser("~")) / name,
               "usr": Path("/usr") / name, "etc": Path("/etc") / name,
               "outputs": box.output_dir / name, "other_run": box.other_ws / name,
               "python": Path(sys.base_prefix) / name}
    if box.mode == "landlock":
        targets["host_tmp"] = Path("/tmp") / name  # the fallback has no private /tmp
    code = r'''
for key, path in ARGS["targets"].items():
    probe(key, lambda: open(path, "w").write("x"))
probe("overwrite_cwd_file", lambda: open("main.py", "a").write("x"))
probe("delete_cwd_file", lambda: os.unlink("main.py"))
probe("chmod_cwd_file", lambda: os.chmod("main.py", 0o777))
'''
    r = box.run(code, targets={k: str(v) for k, v in targets.items()})
    for key, path in targets.items():
        assert r[key].startswith(DENIED + ("FileNotFoundError",)), (key, r[key])
        assert not path.exists(), path
    for key in ("overwrite_cwd_file", "delete_cwd_file"):
        assert r[key].startswith(DENIED), (key, r[key])
    if box.mode == "bwrap":
        assert r["chmod_cwd_file"].startswith(DENIED)
    # else: Landlock does not govern metadata (chmod, chown, utimes) — a documented gap of the fallback
    assert (box.cwd / "main.py").read_text() == "print('project file')\n"


def test_workspace_escapes_fail(box: Box) -> None:
    # Links planted in the workspace (by an earlier block, or the host) point at another run's
    # workspace and at /root.
    (box.workspace / "to_other").symlink_to(box.other_ws)
    (box.workspace / "to_root").symlink_to("/root")
    code = r'''
ws = ARGS["ws"]
probe("read_via_symlink", lambda: open(os.path.join(ws, "to_other", "secret.txt")).read())
probe("write_via_symlink", lambda: open(os.path.join(ws, "to_other", "planted"), "w").write("x"))
probe("write_via_root_link", lambda: open(os.path.join(ws, "to_root", "planted"), "w").write("x"))
probe("dotdot", lambda: open(os.path.join(ws, "..", "..", "planted"), "w").write("x"))
os.symlink("/etc/shadow", os.path.join(ws, "shadow"))
probe("new_symlink", lambda: open(os.path.join(ws, "shadow")).read())
probe("rename_out", lambda: (open(os.path.join(ws, "f"), "w").close(),
                             os.rename(os.path.join(ws, "f"), os.path.join(ws, "..", "f"))))
probe("hardlink_in", lambda: os.link(ARGS["other"], os.path.join(ws, "stolen")))
'''
    r = box.run(code, ws=str(box.workspace), other=str(box.other_ws / "secret.txt"))
    assert r["read_via_symlink"].startswith(ABSENT_OR_DENIED)
    for key in ("write_via_symlink", "write_via_root_link", "hardlink_in"):
        assert r[key].startswith(DENIED + ("FileNotFoundError", "OSError EXDEV")), (key, r[key])
    for key in ("dotdot", "rename_out"):
        # Under bwrap the parents of a workspace that lies in /tmp are directories of the
        # private /tmp, which an unprivileged worker may write (a root coordinator's are
        # root's); the host must see nothing either way.
        unprivileged = box.user == "nobody" or os.geteuid() != 0
        if not (box.mode == "bwrap" and unprivileged and str(box.base).startswith("/tmp/")):
            assert r[key].startswith(DENIED + ("FileNotFoundError", "OSError EXDEV")), (key, r[key])
    assert r["new_symlink"].startswith(ABSENT_OR_DENIED)
    assert sorted(p.name for p in box.other_ws.iterdir()) == ["secret.txt"]
    assert not (box.base / "planted").exists() and not (box.base / "run" / "f").exists()
    assert not os.path.exists("/root/planted")  # (a plain user running the tests cannot look)


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------

def test_tcp_to_host_loopback_fails(box: Box) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    try:
        code = ("import socket\n"
                "probe('tcp', lambda: socket.create_connection(('127.0.0.1', ARGS['port']), timeout=10))\n"
                "probe('bind', lambda: socket.create_server(('0.0.0.0', 0)).getsockname()[1])")
        r = box.run(code, port=listener.getsockname()[1])
        assert r["tcp"].startswith(("ConnectionRefusedError", "PermissionError", "OSError")), r["tcp"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever arrived
        if box.mode == "bwrap":
            assert r["bind"].startswith("ok")  # its own loopback, invisible from the host
    finally:
        listener.close()


def test_udp_to_host_loopback_never_arrives(box: Box) -> None:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.setblocking(False)
    try:
        code = ("import socket\n"
                "probe('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                ".sendto(b'leak', ('127.0.0.1', ARGS['port'])))")
        r = box.run(code, port=receiver.getsockname()[1])
        assert r.rc == 0
        # Loopback delivery is synchronous: a datagram sent before the process exited is queued.
        with pytest.raises(BlockingIOError):
            receiver.recvfrom(16)
        if box.mode == "landlock":
            assert r["udp"].startswith("PermissionError")
    finally:
        receiver.close()


def test_dns_resolution_fails(box: Box) -> None:
    code = ("import socket\n"
            "probe('dns', lambda: socket.getaddrinfo('example.com', 443))\n"
            "probe('localhost', lambda: socket.getaddrinfo('localhost', 1)[0][4][0])")
    r = box.run(code)
    assert r["dns"].startswith(("gaierror", "OSError", "PermissionError")), r["dns"]


def test_network_policy_opens_the_network(make_box) -> None:
    box = make_box(network=True)
    assert "--unshare-net" not in box.plan.argv_prefix
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(WAIT)
    try:
        code = "import socket\nprobe('tcp', lambda: socket.create_connection(('127.0.0.1', ARGS['port']), timeout=10).close())"
        r = box.run(code, port=listener.getsockname()[1])
        assert r["tcp"] == "ok", r.stdout + r.stderr
        listener.accept()[0].close()
    finally:
        listener.close()


# ---------------------------------------------------------------------------------------------
# Processes and privileges
# ---------------------------------------------------------------------------------------------

def test_cannot_signal_the_coordinator(box: Box) -> None:
    r = box.run("probe('kill', lambda: os.kill(ARGS['pid'], 0))\nprobe('kill_init', lambda: os.kill(1, 0))",
                pid=os.getpid())
    assert r["kill"].startswith(("ProcessLookupError", "PermissionError")), r["kill"]
    if box.has_pid_ns:
        assert r["kill"].startswith("ProcessLookupError")  # not even visible
    assert r["kill_init"].startswith("PermissionError"), r["kill_init"]


def test_privileged_syscalls_are_refused(box: Box) -> None:
    code = r'''
import ctypes, fcntl, termios
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
X86 = os.uname().machine == "x86_64"
NR = {"clone": 56 if X86 else 220, "clone3": 435, "bpf": 321 if X86 else 280,
      "io_uring_setup": 425, "keyctl": 250 if X86 else 219, "open_tree": 428}
def c(fn, *a):
    r = fn(*a)
    if r == -1:
        e = ctypes.get_errno(); raise OSError(e, os.strerror(e))
    return r
def raw(nr, *a):
    r = c(libc.syscall, ctypes.c_long(nr), *[ctypes.c_long(x) for x in a])
    if r == 0 and nr == NR["clone"]:
        os._exit(0)  # only reached if the filter failed: the child must not run the test
    return r
probe("ptrace_attach", lambda: c(libc.ptrace, ctypes.c_long(16), ctypes.c_long(ARGS["pid"]), None, None))
probe("ptrace_traceme", lambda: c(libc.ptrace, ctypes.c_long(0), ctypes.c_long(0), None, None))
probe("mount", lambda: c(libc.mount, b"none", b"/tmp", b"tmpfs", ctypes.c_ulong(0), None))
probe("umount", lambda: c(libc.umount2, b"/tmp", 2))
probe("unshare_user", lambda: c(libc.unshare, 0x10000000))
probe("unshare_net", lambda: c(libc.unshare, 0x40000000))
probe("setns", lambda: c(libc.setns, -1, 0))
probe("clone_newuser", lambda: raw(NR["clone"], 0x10000000 | 17, 0, 0, 0, 0))
probe("clone3", lambda: raw(NR["clone3"], 0, 0))
probe("chroot", lambda: os.chroot("/"))
probe("setuid0", lambda: os.setuid(0) if os.getuid() != 0 else os.setuid(12345))
probe("setuid_other", lambda: os.setuid(12345))
probe("bpf", lambda: raw(NR["bpf"], 0, 0, 0))
probe("io_uring", lambda: raw(NR["io_uring_setup"], 1, 0))
probe("keyctl", lambda: raw(NR["keyctl"], 0, 0, 0, 0, 0))
probe("open_tree", lambda: raw(NR["open_tree"], -100, 0, 0))
probe("personality_aslr_off", lambda: c(libc.personality, ctypes.c_ulong(0x0040000)))
probe("personality_query", lambda: c(libc.personality, ctypes.c_ulong(0xFFFFFFFF)))
probe("tiocsti", lambda: fcntl.ioctl(0, termios.TIOCSTI, b"x"))
probe("raise_nofile", lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_NOFILE, (10**6, 10**6)))
'''
    r = box.run(code, pid=os.getpid())
    eperm = "PermissionError EPERM"
    for key in ("ptrace_attach", "ptrace_traceme", "mount", "umount", "unshare_user", "unshare_net",
                "setns", "clone_newuser", "chroot", "bpf", "io_uring", "keyctl", "open_tree",
                "personality_aslr_off", "tiocsti"):
        assert r[key] == eperm, (key, r[key])
    assert r["clone3"] == "OSError ENOSYS"  # so libc falls back to clone, whose flags are checked
    assert r["personality_query"].startswith("ok")
    for key in ("setuid0", "setuid_other"):
        assert r[key] in (eperm, "OSError EINVAL"), (key, r[key])  # EINVAL: uid unmapped in the userns
    assert r["raise_nofile"].startswith(("ValueError", "PermissionError")), r["raise_nofile"]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x32 syscall numbers exist on x86_64 only")
def test_foreign_syscall_abi_kills_the_process(box: Box) -> None:
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint('before: x32', flush=True)\n"
            "libc.syscall(ctypes.c_long(0x40000000 | 39))\nprint('after: survived', flush=True)")
    r = box.run(code)
    assert "before" in r.out and "after" not in r.out
    assert r.rc in (-signal.SIGSYS, 128 + signal.SIGSYS), r.rc


def test_fork_bomb_is_contained_and_the_tree_dies(make_box) -> None:
    limit = 40
    box = make_box(max_processes=limit)
    if box.plan.confine.limit("NPROC") is None:
        pytest.skip(reason="root without bubblewrap keeps uid 0 here: no process bound (documented note)")
    marker = f"bomb-{uuid.uuid4().hex}"
    code = r'''
import time
ROOT_PID = os.getpid()
started = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break  # EAGAIN: the process budget is spent
    if pid == 0:
        started = 0
        continue  # the child forks on, like any fork bomb
    started += 1
if os.getpid() == ROOT_PID:
    print("saturated: " + str(started), flush=True)
time.sleep(600)
'''
    proc = box.popen(code, marker=marker)
    try:
        line = ""
        deadline = time.monotonic() + WAIT
        while not line.startswith("saturated") and time.monotonic() < deadline:
            line = read_line(proc.stdout, max(0.0, deadline - time.monotonic()))
            if not line and proc.poll() is not None:
                break
        assert line.startswith("saturated"), proc.stderr.read()
        count = len(_marked_pids(marker, python_only=True))
        nproc = box.plan.confine.limit("NPROC")[0]
        allowed = limit if nproc == limit else nproc  # fallback as nobody: budget on top of the user's count
        assert 1 < count <= allowed, (count, allowed)
    finally:
        _kill_tree(box, proc)
    _wait_until(lambda: not _marked_pids(marker), "every bomb process to die")


def test_memory_bomb_raises_memory_error(make_box) -> None:
    box = make_box(memory_bytes=512 * 1024**2)
    code = r'''
probe("one_block", lambda: len(bytearray(600 * 1024**2)))
def grow():
    chunks = []
    while True:
        chunks.append(bytearray(32 * 1024**2))
probe("growth", grow)
probe("after", lambda: len(bytearray(1024)))
'''
    r = box.run(code)
    assert r["one_block"] == "MemoryError" and r["growth"] == "MemoryError", r.stdout + r.stderr
    assert r["after"] == "ok 1024"


def test_file_size_limit(make_box) -> None:
    box = make_box(max_file_bytes=1024**2)
    code = ("path = os.path.join(ARGS['ws'], 'big')\n"
            "probe('big_write', lambda: open(path, 'wb').write(b'x' * (2 * 1024**2)))\n"
            "probe('truncate', lambda: os.truncate(path, 10 * 1024**2))")
    r = box.run(code, ws=str(box.workspace))
    assert r["big_write"] == "OSError EFBIG" and r["truncate"] == "OSError EFBIG", r.out
    assert (box.workspace / "big").stat().st_size <= 1024**2


def test_fd_exhaustion(make_box) -> None:
    box = make_box(max_open_files=64)
    code = ("fds = []\n"
            "def exhaust():\n"
            "    while True:\n"
            "        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
            "probe('fds', exhaust)\nprobe('count', lambda: len(fds))")
    r = box.run(code)
    assert r["fds"] == "OSError EMFILE"
    assert int(r["count"].split()[1]) < 64


def test_tmp_is_private_and_size_capped(make_box, variant) -> None:
    if variant[1] != "bwrap":
        pytest.skip(reason="the fallback has no private /tmp (TMPDIR lies in the workspace)")
    box = make_box(tmp_bytes=4 * 1024**2)
    code = ("probe('tmp', lambda: open('/tmp/fill', 'wb').write(b'x' * (8 * 1024**2)))\n"
            "probe('shm', lambda: open('/dev/shm/fill', 'wb').write(b'x' * (8 * 1024**2)))\n"
            "probe('listing', lambda: sorted(os.listdir('/tmp')))")
    r = box.run(code)
    assert r["tmp"] == "OSError ENOSPC" and r["shm"] == "OSError ENOSPC", r.out
    assert not Path("/tmp/fill").exists()


def test_cpu_limit_kills(make_box) -> None:
    box = make_box(cpu_seconds=1)
    r = box.run("print('spinning: yes', flush=True)\nwhile True: pass")
    assert r.rc in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL), r.rc


# ---------------------------------------------------------------------------------------------
# Refusals, modes, notes
# ---------------------------------------------------------------------------------------------

def _run_apply(spec: dict, before: str = "") -> subprocess.CompletedProcess:
    code = (f"import json, sys\n{before}\nfrom worker._confine import apply\n"
            "from worker.contract.confinement import Confinement\n"
            "apply(Confinement.from_json(sys.argv[1]))\nprint('USER CODE RAN')")
    return subprocess.run([sys.executable, "-c", code, json.dumps({"t": "confinement", **spec})], capture_output=True,
                          text=True, timeout=WAIT, cwd=ROOT)


def test_half_applied_sandbox_refuses_to_run() -> None:
    done = _run_apply({"rlimits": [["CORE", 0, 0]], "landlock": {"rw": ["/nonexistent/ws"]}})
    assert done.returncode != 0 and "USER CODE RAN" not in done.stdout
    assert "ConfinementError" in done.stderr and "/nonexistent/ws" in done.stderr
    done = _run_apply({"landlock": {"ro": ["/"], "min_abi": 999}})
    assert done.returncode != 0 and "Landlock ABI" in done.stderr and "USER CODE RAN" not in done.stdout


def test_apply_refuses_once_threads_run() -> None:
    before = "import threading\nev = threading.Event()\nthreading.Thread(target=ev.wait, daemon=True).start()"
    done = _run_apply({"no_new_privs": True}, before)
    assert done.returncode != 0 and "before any thread starts" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="only root switches uid")
def test_uid_switch_keeps_the_parent_death_signal() -> None:
    # The kernel clears PR_SET_PDEATHSIG on a credential change; the worker arms it before
    # apply() so that it dies with the coordinator.
    before = ("import ctypes, signal\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "libc.prctl(1, signal.SIGKILL, 0, 0, 0)\nsig = ctypes.c_int(-1)")
    code = (f"import json, sys\n{before}\nfrom worker._confine import apply\n"
            "from worker.contract.confinement import Confinement\n"
            "print(apply(Confinement.from_json(sys.argv[1])))\n"
            "libc.prctl(2, ctypes.byref(sig), 0, 0, 0)\nprint('pdeathsig', sig.value)")
    spec = {"t": "confinement", "uid": [2_111_111_111] * 2, "drop_caps": True}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True,
                          text=True, timeout=WAIT, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "'uid'" in done.stdout and f"pdeathsig {int(signal.SIGKILL)}" in done.stdout


def test_mode_none_applies_nothing_and_says_so(tmp_path: Path) -> None:
    p = plan(SandboxPolicy(mode="none"), socket_dir=tmp_path, workspace=tmp_path, cwd=tmp_path,
             output_dir=tmp_path, python=sys.executable)
    assert p.argv_prefix == [] and not p.confine and not p.pid_namespace
    assert p.notes and "none" in p.notes[0]
    done = _run_apply({})
    assert done.returncode == 0 and "USER CODE RAN" in done.stdout


def test_unknown_mode_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        plan(SandboxPolicy(mode="strict"), socket_dir=tmp_path, workspace=tmp_path, cwd=tmp_path,
             output_dir=tmp_path, python=sys.executable)


def test_without_bubblewrap_the_plan_falls_back_with_a_note(tmp_path: Path) -> None:
    # A fresh interpreter whose PATH lacks bwrap: what a machine without the package sees.
    code = ("import json, sys\nfrom pathlib import Path\nfrom engine.errors import SandboxError\n"
            "from engine.sandbox import SandboxPolicy, plan\nt = Path(sys.argv[1])\n"
            "kw = dict(socket_dir=t / 's', workspace=t / 'w', cwd=t, output_dir=t / 'o', python=sys.executable)\n"
            "p = plan(SandboxPolicy(), **kw)\n"
            "print(json.dumps([p.argv_prefix, p.notes, sorted(k for k, v in p.confine.wire_fields().items() if v)]))\n"
            "try:\n    plan(SandboxPolicy(mode='bwrap'), **kw)\nexcept SandboxError as e:\n    print('ERR', e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=WAIT, cwd=ROOT, env={"PATH": "/nonexistent"})
    assert done.returncode == 0, done.stderr
    first, err = done.stdout.splitlines()
    argv, notes, layers = json.loads(first)
    assert argv == []
    assert any("bubblewrap not found" in n and "apt-get install bubblewrap" in n for n in notes), notes
    assert {"rlimits", "seccomp", "no_new_privs"} <= set(layers)
    assert err.startswith("ERR") and "apt-get install bubblewrap" in err


def test_bwrap_argv_has_the_promised_namespaces(tmp_path: Path) -> None:
    if host_support().bwrap is None:
        pytest.skip(reason=f"bubblewrap unusable: {host_support().bwrap_problem}")
    (tmp_path / "c").mkdir()
    kw = dict(socket_dir=tmp_path / "s", workspace=tmp_path / "w", cwd=tmp_path / "c",
              output_dir=tmp_path / "o", python=sys.executable)
    argv = plan(SandboxPolicy(tmp_bytes=1234567), **kw).argv_prefix
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                 "--new-session", "--remount-ro"):
        assert flag in argv
    assert argv[argv.index("--tmpfs") - 1] == "1234567"
    assert ("--cap-drop" in argv) == (os.geteuid() == 0)
    c = str(tmp_path / "c")
    tail = argv[argv.index("--tmpfs"):]
    assert ["--ro-bind", c, c] == tail[tail.index(c) - 1:tail.index(c) + 2]  # cwd read-only, after /tmp
    w = str(tmp_path / "w")
    assert ["--bind", w, w] == tail[tail.index(w) - 1:tail.index(w) + 2]


def test_a_hidden_directory_is_covered_beneath_the_cwd_or_the_cwd_is_not_shown(tmp_path: Path) -> None:
    project = tmp_path / "project"
    hidden, workspace = project / "files", project / "files" / "client" / "w"
    hidden.mkdir(parents=True)
    kw = dict(socket_dir=tmp_path / "s", workspace=workspace, cwd=project, output_dir=tmp_path / "o",
              python=sys.executable)
    support = host_support()
    if support.bwrap is not None:  # covered by a read-only tmpfs, the workspace bound back on top
        p = plan(SandboxPolicy(hidden=(str(hidden),)), **kw)
        argv = p.argv_prefix
        assert p.cwd == str(project)
        assert argv.index(str(project)) < argv.index("--tmpfs", argv.index("/tmp") + 1) < argv.index(str(workspace))
        assert argv[argv.index("--tmpfs", argv.index("/tmp") + 1) + 1] == str(hidden)
        assert ["--remount-ro", str(hidden)] == argv[argv.index(str(hidden), argv.index(str(workspace))) - 1:][:2]
    if support.landlock_abi >= 1:  # Landlock cannot take it back from the cwd: the cwd is not shown
        p = plan(SandboxPolicy(mode="landlock", hidden=(str(hidden),)), **kw)
        assert p.cwd == str(workspace) and any(f"({hidden} is hidden from them)" in n for n in p.notes), p.notes
        assert p.confine.landlock is not None and str(project) not in p.confine.landlock.ro
    p = plan(SandboxPolicy(hidden=(str(project),)), **kw)  # a cwd inside a hidden directory
    assert p.cwd == str(workspace)


def test_home_directory_as_cwd_is_not_shared(tmp_path: Path) -> None:
    home = os.path.realpath(os.path.expanduser("~"))
    p = plan(SandboxPolicy(), socket_dir=tmp_path / "s", workspace=tmp_path / "w", cwd=Path(home),
             output_dir=tmp_path / "o", python=sys.executable)
    assert any("is not shown to workers" in n and "--share-cwd" in n for n in p.notes), p.notes
    assert p.cwd == str(tmp_path / "w")
    argv = p.argv_prefix
    assert not [i for i in range(len(argv) - 1) if argv[i] in ("--bind", "--ro-bind") and argv[i + 1] == home]


def test_workspace_excess(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 300_000)
    assert workspace_excess(SandboxPolicy(workspace_bytes=10**6), tmp_path) is None
    msg = workspace_excess(SandboxPolicy(workspace_bytes=100_000), tmp_path)
    assert msg and "delete files" in msg


def test_doctor_reports_every_layer() -> None:
    layers = {layer.name: layer for layer in report(SandboxPolicy())}
    for name in ("bubblewrap", "pid namespace", "network namespace", "rlimits", "no_new_privs",
                 "landlock", "seccomp", "process limit", "memory cgroup", "fork server"):
        assert name in layers and layers[name].reason
    host = host_support()
    assert layers["fork server"].available == (fork_server_problem() is None)
    assert layers["bubblewrap"].available == (host.bwrap is not None)
    assert layers["landlock"].available == (host.landlock_abi > 0)
    assert not any(layer.active for layer in report(SandboxPolicy(mode="none")))
    assert not report(SandboxPolicy(mode="landlock"))[0].active
    assert not {layer.name: layer for layer in report(SandboxPolicy(network=True))}["network namespace"].active


def _run_bpf(prog: bytes, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """A classic-BPF interpreter for the few opcodes the filter uses, over one seccomp_data."""
    args = (*args, 0, 0, 0, 0, 0, 0)[:6]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    ins = [struct.unpack("HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


def test_seccomp_program_covers_both_architectures() -> None:
    x86, arm, arm32 = 0xC000003E, 0xC00000B7, 0x40000028
    prog = seccomp_program(Seccomp(socket_families=(1, 16), lock_session=True))
    allow, eperm, enosys, kill = 0x7FFF0000, 0x50001, 0x50000 | errno.ENOSYS, 0x80000000
    cases = [
        (x86, 165, (), eperm), (arm, 40, (), eperm),             # mount
        (x86, 39, (), allow), (arm, 172, (), allow),              # getpid
        (x86, 56, (0x10000000 | 17,), eperm), (arm, 220, (0x10000000 | 17,), eperm),  # clone NEWUSER
        (x86, 56, (0x003D0F00,), allow), (arm, 220, (0x003D0F00,), allow),  # clone for a thread
        (x86, 435, (), enosys), (arm, 435, (), enosys),           # clone3
        (x86, 41, (2,), eperm), (arm, 198, (10,), eperm),         # socket(AF_INET/6) here refused
        (x86, 41, (1,), allow), (arm, 198, (1,), allow),          # socket(AF_UNIX)
        (x86, 135, (0xFFFFFFFF,), allow), (arm, 92, (0x0040000,), eperm),  # personality
        (x86, 16, (0, 0x5412), eperm), (arm, 29, (0, 0x5401), allow),      # ioctl TIOCSTI / TCGETS
        (x86, 112, (), eperm), (arm, 157, (), eperm),             # setsid, locked session
        (x86, 0x40000000 | 39, (), kill), (arm32, 21, (), kill),  # x32 ABI, arm32 compat
        (0x40000003, 1, (), kill),                                # i386
    ]
    for arch, nr, args, expected in cases:
        assert _run_bpf(prog, arch, nr, args) == expected, (hex(arch), nr, args)
    open_prog = seccomp_program(Seccomp())
    assert _run_bpf(open_prog, x86, 41, (2,)) == allow and _run_bpf(open_prog, x86, 112) == allow


def test_without_a_memory_cgroup_shared_memory_is_refused(box: Box) -> None:
    """Planned without a memory cgroup (as for an unprivileged user), the memory RLIMIT_DATA
    does not count is refused, and what multiprocessing and ordinary mmap use still works."""
    if box.plan.confine.seccomp is None:
        pytest.skip(reason="no seccomp on this host")
    assert any("no memory cgroup" in n for n in box.plan.details), box.plan.details
    assert not any("no memory cgroup" in n for n in box.plan.notes)  # doctor and -v say it, not every start
    code = r'''
import ctypes, mmap, multiprocessing.shared_memory
libc = ctypes.CDLL(None, use_errno=True)
def shmget():
    if libc.shmget(0, 1 << 20, 0o1600) == -1:
        raise OSError(ctypes.get_errno(), "shmget")
def file_shared():
    path = os.path.join(ARGS["ws"], "m")
    with open(path, "wb") as f:
        f.truncate(4096)
    with open(path, "r+b") as f:
        mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED).close()
probe("memfd", lambda: os.memfd_create("x"))
probe("shmget", shmget)
probe("shared_anonymous", lambda: mmap.mmap(-1, 1 << 20))
probe("private_anonymous", lambda: mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE).close())
probe("file_shared", file_shared)
probe("shm_open", lambda: multiprocessing.shared_memory.SharedMemory(create=True, size=4096).unlink())
'''
    r = box.run(code, ws=str(box.workspace))
    for name in ("memfd", "shared_anonymous", "shmget"):
        assert r[name] == "PermissionError EPERM", (name, r.stdout)
    for name in ("private_anonymous", "file_shared"):
        assert r[name].startswith("ok"), (name, r.stdout)
    if box.mode == "bwrap":  # a private /dev/shm, size-capped
        assert r["shm_open"] == "ok", r.stdout


def test_netlink_is_routing_only(box: Box) -> None:
    if box.plan.confine.seccomp is None:
        pytest.skip(reason="no seccomp on this host")
    code = r'''
import socket
probe("uevent", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15).close())
probe("route", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close())
'''
    r = box.run(code)
    assert r["uevent"] == "PermissionError EPERM" and r["route"] == "ok", r.stdout


def test_bwrap_argv_argument_for_argument() -> None:
    """The bubblewrap command line is a pure function of the view: checked whole."""
    from engine.sandbox import View, bwrap_argv

    view = View(system=("/usr", "/etc/passwd"), links=(("usr/bin", "/bin"),), python=("/opt/py",),
                workspace=Path("/w/ws"), socket_dir=Path("/run/s/w1"), output_dir=Path("/w/out"),
                cwd=Path("/w/proj"))
    argv = bwrap_argv("/usr/bin/bwrap", root=True, network=False, tmp_bytes=1024, view=view,
                      start_dir="/w/proj")
    assert argv == [
        "/usr/bin/bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--unshare-net", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
        "--cap-add", "CAP_SETPCAP", "--die-with-parent", "--new-session", "--hostname", "agentloop",
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", "1024", "--tmpfs", "/dev/shm",
        "--perms", "1777", "--size", "1024", "--tmpfs", "/tmp",
        "--ro-bind", "/usr", "/usr",
        "--perms", "0755", "--dir", "/etc", "--ro-bind", "/etc/passwd", "/etc/passwd",
        "--perms", "0755", "--dir", "/opt", "--ro-bind", "/opt/py", "/opt/py",
        "--symlink", "usr/bin", "/bin",
        "--perms", "0755", "--dir", "/w", "--ro-bind", "/w/out", "/w/out",
        "--ro-bind", "/w/proj", "/w/proj",
        "--bind", "/w/ws", "/w/ws",
        "--perms", "0755", "--dir", "/run", "--perms", "0755", "--dir", "/run/s",
        "--ro-bind", "/run/s/w1", "/run/s/w1",
        "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/w/proj", "--"]
    # A hidden directory beneath the current one: covered after it, the workspace bound back after that.
    covered = bwrap_argv("/usr/bin/bwrap", root=True, network=False, tmp_bytes=1024,
                         view=dataclasses.replace(view, workspace=Path("/w/proj/files/c/ws"),
                                                  hidden=("/w/proj/files",)), start_dir="/w/proj")
    assert covered[covered.index("--ro-bind", covered.index("/w/out")):] == [
        "--ro-bind", "/w/proj", "/w/proj",
        "--perms", "0755", "--dir", "/run", "--perms", "0755", "--dir", "/run/s",
        "--ro-bind", "/run/s/w1", "/run/s/w1",
        "--perms", "0755", "--size", "65536", "--tmpfs", "/w/proj/files",
        "--perms", "0755", "--dir", "/w/proj/files/c", "--bind", "/w/proj/files/c/ws", "/w/proj/files/c/ws",
        "--remount-ro", "/dev", "--remount-ro", "/w/proj/files", "--remount-ro", "/", "--chdir", "/w/proj", "--"]
    unprivileged = bwrap_argv("bwrap", root=False, network=True, tmp_bytes=1, view=view, start_dir="/w/ws")
    assert unprivileged[1:8] == ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                                 "--unshare-user", "--disable-userns", "--die-with-parent"]
    assert "--unshare-net" not in unprivileged and "--cap-add" not in unprivileged


def test_a_fork_servers_sandbox_argument_for_argument() -> None:
    """A fork server's sandbox is its run's with the capabilities it makes namespaces with:
    root's without a user namespace (CAP_KILL for samples that run as another uid), an
    unprivileged user's in bubblewrap's user namespace, which may then make user namespaces
    (one per process the server forks, which allows none below it).  The probe of a server's
    user namespaces runs in the same flags."""
    from engine.sandbox import namespace_flags, probe_argv

    assert ["bwrap", *namespace_flags(True, network=False, server="fork")] == [
        "bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--unshare-net",
        "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN",
        "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
        "--die-with-parent", "--new-session"]
    assert namespace_flags(True, network=False, server="fork+kill")[5:9] == ["--cap-drop", "ALL", "--cap-add", "CAP_KILL"]
    assert namespace_flags(False, network=True, server="fork") == namespace_flags(False, network=True,
                                                                                 server="fork+kill") == [
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--unshare-user",
        "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN", "--die-with-parent", "--new-session"]
    assert probe_argv("bwrap", False, server="fork") == [
        "bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--unshare-net",
        "--unshare-user", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN", "--die-with-parent",
        "--new-session", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--"]
    with pytest.raises(ValueError):
        namespace_flags(True, network=False, server="anything")


def test_bwrap_argv_of_a_script_argument_for_argument() -> None:
    """``exec FILE``'s view: no socket or output directory; the current directory writable with
    what stays read-only bound over it; the script's directory shown (not where the current
    directory shows it already); for code that keeps uid 0, /proc/sys read-only and root's own
    /proc files covered."""
    from engine.sandbox import View, bwrap_argv

    view = View(system=("/usr",), links=(), python=("/opt/py",), workspace=Path("/w/proj"), socket_dir=None,
                output_dir=None, cwd=Path("/w/proj"), protected=("/w/proj/.git", "/w/proj/.venv"),
                shown=(Path("/w/tools"), Path("/w/proj/sub"), Path("/usr/local/bin")),
                root_proc=("/proc/kpageflags", "/proc/sysrq-trigger"))
    argv = bwrap_argv("/usr/bin/bwrap", root=True, network=False, tmp_bytes=1024, view=view, start_dir="/w/proj")
    at = argv.index("--tmpfs", argv.index("--tmpfs") + 1) + 2  # after /proc, /dev, /dev/shm and /tmp
    assert argv[at:at + 9] == ["--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind", "/dev/null", "/proc/kpageflags",
                               "--ro-bind", "/dev/null", "/proc/sysrq-trigger"]
    assert "--hostname" in argv  # (exec's plan takes it out: the script sees the host's name)
    tail = argv[argv.index("/opt/py") + 2:]
    assert tail == ["--perms", "0755", "--dir", "/w", "--ro-bind", "/w/tools", "/w/tools",
                    "--bind", "/w/proj", "/w/proj",
                    "--ro-bind", "/w/proj/.git", "/w/proj/.git", "--ro-bind", "/w/proj/.venv", "/w/proj/.venv",
                    "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/w/proj", "--"]


def test_protected_paths_are_bound_read_only_last() -> None:
    """What stays read-only in the workspace is bound over it, after every other bind, and
    with no directory made for it (it exists there already)."""
    from engine.sandbox import View, bwrap_argv

    kept = ("/w/ws/agentloop.toml", "/w/ws/.git", "/w/ws/.venv")
    view = View(system=("/usr",), links=(), python=(), workspace=Path("/w/ws"), socket_dir=Path("/w/s"),
                output_dir=None, cwd=Path("/w/ws"), protected=kept)
    argv = bwrap_argv("bwrap", root=True, network=False, tmp_bytes=1, view=view, start_dir="/w/ws")
    assert argv[argv.index("--bind"):] == [
        "--bind", "/w/ws", "/w/ws",
        "--ro-bind", "/w/ws/agentloop.toml", "/w/ws/agentloop.toml", "--ro-bind", "/w/ws/.git", "/w/ws/.git",
        "--ro-bind", "/w/ws/.venv", "/w/ws/.venv",
        "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/w/ws", "--"]


def test_a_plan_keeps_protected_paths_read_only_or_says_it_cannot(tmp_path: Path) -> None:
    """Under bubblewrap the plan binds them; with Landlock alone it cannot, and a note says so."""
    ws = tmp_path / "ws"
    (ws / ".git").mkdir(parents=True)
    kept = (str(ws / ".git"),)
    args = dict(socket_dir=tmp_path / "s", workspace=ws, cwd=tmp_path, output_dir=tmp_path / "out",
                python=sys.executable, protected=kept)
    if host_support().bwrap is not None:
        bound = plan(SandboxPolicy(), **args)
        assert bound.argv_prefix[-10:-7] == ["--ro-bind", kept[0], kept[0]], bound.argv_prefix
    if host_support().landlock_abi >= 1:
        alone = plan(SandboxPolicy(mode="landlock"), **args)
        assert any("nothing in the workspace can be kept read-only (.git there" in n for n in alone.notes), alone.notes
