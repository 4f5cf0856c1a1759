"""The fork server: ``python -m worker.zygote``, started once per run inside the run's sandbox.

It imports the worker runtime (and modules named with ``AGENTLOOP_PRELOAD``) once, then forks
a worker per request in a few milliseconds instead of starting an interpreter.  It runs no
user code, holds no threads and no ZeroMQ context (neither survives a fork), and talks to the
coordinator over its stdin/stdout: 4-byte big-endian length, then one msgpack map.

Each worker gets the isolation of a freshly started one:

    zygote ── B (new PID, network, IPC, UTS and mount namespaces for its children; forks C,
               says C's pid, exits)
          ── C (re-parented to the zygote; pid 1 of its namespace: mounts its own /proc, /tmp
               and /dev/shm, shows only its worker's socket, brings its loopback up, forks D,
               then becomes ``sleep infinity``)
               └─ D (the worker: applies its own confinement — uid, Landlock, seccomp,
                     rlimits — then serves)

Killing C ends every process of that namespace.  C and D are also members of the sandbox's
PID namespace, so the zygote's death (and the coordinator's, which kills the zygote's
sandbox) ends them all.  C reaps nothing: the worker is a child subreaper, so orphans of user
code go to D, and D's own exit leaves a zombie whose status the coordinator reads before it
kills C.  As a tiny program instead of a copy of this interpreter, C costs a worker about
0.1 MB instead of 1.5 MB (and no share of the zygote's pages).
Requests:  spawn {id, endpoint, env, cwd, private_net, tmp_bytes, own_workspace?, exec?}
           (exec: an argv D runs instead of serving as a worker: a sample slot)  ->  spawned {id, pid}  |  failed {id, error}
           (pid: C's, in the zygote's namespace; D is C's only child)
Reports:   exited {id, pid, status}  when a worker's C is reaped (status as a shell's $?).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import select
import signal
import struct
import sys
import time

import msgpack

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_NEW = 0x20000000 | 0x08000000 | 0x04000000 | 0x00020000  # PID IPC UTS NS
_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _die_with_parent(parent: int | None) -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(70)  # the parent died before the signal was armed


def _exit_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _mount_points_under(top: str) -> list[tuple[str, bool]]:
    """(mount point, read-only) of every mount strictly below ``top``, shallowest first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
            if point.startswith(top.rstrip("/") + "/"):
                found.append((point, "ro" in fields[5].split(",")))
    return sorted(found, key=lambda item: item.count("/"))


def _bind(fd: int, where: str, read_only: bool) -> None:
    os.makedirs(where, exist_ok=True)
    _check(_libc.mount(f"/proc/self/fd/{fd}".encode(), where.encode(), None, _MS_BIND, None), where)
    if read_only:
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        _check(_libc.mount(None, where.encode(), None, flags, None), where)


def _private_tmp(request: dict) -> None:
    """A /tmp and /dev/shm of this worker's own.  What the sandbox mounted beneath /tmp (the
    project, the workspace, the outputs) is mounted again on top; of the run's socket
    directories, only this worker's own, so no worker sees another's."""
    endpoint = str(request.get("endpoint", ""))
    own = os.path.dirname(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None
    run_sockets = os.path.dirname(own) if own else None
    keep = [(point, ro, os.open(point, os.O_PATH)) for point, ro in _mount_points_under("/tmp")
            if point != run_sockets]
    own_fd = os.open(own, os.O_PATH) if own else None
    size = f"size={int(request['tmp_bytes'])},mode=1777".encode()
    _check(_libc.mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, size), "/tmp")
    for point, ro, fd in keep:
        _bind(fd, point, ro)
        os.close(fd)
    if own and own_fd is not None:
        if not own.startswith("/tmp/"):  # the run's sockets live elsewhere: hide the others there
            _check(_libc.mount(b"tmpfs", run_sockets.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                               b"size=1m,mode=0755"), run_sockets)
        _bind(own_fd, own, True)  # the worker connects to its socket; it writes nothing there
        os.close(own_fd)
    if os.path.isdir("/dev/shm"):
        _check(_libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, size), "/dev/shm")


def _loopback_up() -> None:
    """A new network namespace starts with its loopback down: servers the code starts on
    127.0.0.1 should work, as they do in a cold-started worker."""
    import fcntl
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags))  # SIOCSIFFLAGS


def _find_sleep() -> str | None:
    for path in ("/usr/bin/sleep", "/bin/sleep"):
        if os.access(path, os.X_OK):
            return path
    return None


def _idle_init(sleep: str | None) -> None:
    """C, pid 1 of the worker's namespace, once D is forked: it only has to exist (the
    namespace lasts as long as it does).  Never returns."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, 1024)
    if sleep is not None:
        with contextlib.suppress(OSError):
            os.execve(sleep, [sleep, "infinity"], {})
    while True:  # no sleep(1) here: wait as this interpreter instead
        signal.pause()


def _child(request: dict, control: tuple[int, ...], report: int, sleep: str | None) -> None:
    """B: runs in the forked child; never returns.  B only makes the namespaces, forks C into
    them, tells the zygote C's pid and leaves: C is re-parented to the zygote (a subreaper),
    which reaps it when the coordinator kills it.  C says when D exists."""
    try:
        signal.set_wakeup_fd(-1)  # the zygote's wake-up pipe is not ours
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in control:
            os.close(fd)
        # A network namespace of its own too, unless the run was given the host's network.
        _check(_libc.unshare(_NEW | (_NEWNET if request.get("private_net", True) else 0)), "unshare")
        init = os.fork()
        if init:
            os.write(report, b"C" + struct.pack(">I", init))
            os._exit(0)
        # No parent-death signal for C: it would fire as B leaves.  C lives in the sandbox's
        # PID namespace too, which ends with the zygote and with the coordinator.
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
        _check(_libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "/proc")
        _private_tmp(request)
        if request.get("own_workspace"):  # (code samples) an empty workspace of its own, gone with it
            _check(_libc.mount(b"tmpfs", str(request["own_workspace"]).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                               f"size={int(request['tmp_bytes'])},mode=1777".encode()), "workspace")
        if request.get("private_net", True):
            _loopback_up()
        worker = os.fork()
        if worker:
            os.write(report, b"D" + struct.pack(">I", worker))
            _idle_init(sleep)
        os.close(report)
        _die_with_parent(1)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        os.chdir(request["cwd"])
        os.setsid()
        if request.get("exec"):  # a sample slot: a fresh interpreter, cheaper to fork from
            argv = [str(a) for a in request["exec"]]
            os.execve(argv[0], argv, dict(os.environ))
        from worker.__main__ import run_worker

        run_worker(request["endpoint"])
    except BaseException as exc:  # noqa: BLE001 - the last words of a child that failed to start
        os.write(2, f"agentloop zygote: worker start failed: {exc}\n".encode())
    os._exit(72)


def _read_reports(fd: int, timeout: float = 10.0) -> dict[bytes, int]:
    """What B and C say on the report pipe: b"C" -> C's pid, b"D" -> D's (in C's namespace),
    in whichever order they come; stops at end of file or after ``timeout``."""
    found: dict[bytes, int] = {}
    deadline = time.monotonic() + timeout
    while len(found) < 2:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        record = os.read(fd, 5) if ready else b""
        if len(record) != 5:
            break
        found[record[:1]] = struct.unpack(">I", record[1:])[0]
    return found


class _Wire:
    def __init__(self) -> None:
        self.inp = sys.stdin.buffer.fileno()
        self.out = os.dup(sys.stdout.buffer.fileno())
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints must not corrupt the channel
        self.buf = b""

    def send(self, msg: dict) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        os.write(self.out, struct.pack(">I", len(data)) + data)

    def read(self) -> list[dict] | None:
        chunk = os.read(self.inp, 65536)
        if not chunk:
            return None
        self.buf += chunk
        messages = []
        while len(self.buf) >= 4:
            size = struct.unpack(">I", self.buf[:4])[0]
            if len(self.buf) < 4 + size:
                break
            messages.append(msgpack.unpackb(self.buf[4:4 + size], raw=False))
            self.buf = self.buf[4 + size:]
        return messages


def serve() -> None:
    for name in filter(None, os.environ.pop("AGENTLOOP_PRELOAD", "").split(",")):
        try:
            __import__(name.strip())
        except BaseException as exc:  # noqa: BLE001 - said in one line; the coordinator says the rest
            sys.stderr.write(f"--preload {name.strip()}: importing it failed: {type(exc).__name__}: {exc}\n")
            sys.exit(1)
    import worker.__main__  # noqa: F401 - everything a worker imports, imported once, shared by all
    import worker._confine  # noqa: F401
    import worker._memory
    import worker.serve  # noqa: F401

    worker._memory.tune()
    # What is imported now is shared with every worker; the collector must not write to it
    # (its bookkeeping would copy each page into each worker), so it never looks at it again.
    gc.collect()
    gc.freeze()

    wire = _Wire()
    sleep = _find_sleep()
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # workers' inits come back to us
    children: dict[int, object] = {}
    # SIGCHLD wakes select(): the self-pipe turns the signal into a readable fd.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    wire.send({"t": "ready", "pid": os.getpid()})
    while True:
        ready, _, _ = select.select([wire.inp, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid in children:  # not the short-lived B processes
                    wire.send({"t": "exited", "id": children.pop(pid), "pid": pid,
                               "status": _exit_status(status)})
        if wire.inp in ready:
            messages = wire.read()
            if messages is None:
                os._exit(0)  # the coordinator is gone
            for request in messages:
                if request.get("t") != "spawn":
                    continue
                report_r, report_w = os.pipe()
                try:
                    pid = os.fork()
                except OSError as exc:
                    os.close(report_r)
                    os.close(report_w)
                    wire.send({"t": "failed", "id": request.get("id"), "error": str(exc)})
                    continue
                if pid == 0:
                    os.close(report_r)
                    _child(request, (wire.inp, wire.out, wake_r, wake_w), report_w, sleep)
                os.close(report_w)
                reports = _read_reports(report_r)
                os.close(report_r)
                init = reports.get(b"C") if b"D" in reports else None
                if init is None:
                    if b"C" in reports:
                        with contextlib.suppress(OSError):
                            os.kill(reports[b"C"], signal.SIGKILL)
                    wire.send({"t": "failed", "id": request.get("id"), "error": "the worker did not start"})
                    continue
                children[init] = request.get("id")
                wire.send({"t": "spawned", "id": request.get("id"), "pid": init})


if __name__ == "__main__":
    serve()
