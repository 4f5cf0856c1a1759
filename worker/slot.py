"""A sample slot: runs code samples one after another, each in a sandbox of its own.

``python -I -B -c "...; from worker.slot import main; main()" SOCKET`` is what the fork server
starts in place of a worker (a fresh, small interpreter: forking it costs a third of forking
the worker runtime).  It keeps its PID and UTS namespaces (and its network one while unused),
its capabilities and its cgroups from sample to sample, and gives every sample what no later
sample can see:

- a process of its own (forked from the slot), in a session of its own, with a mount and an
  IPC namespace of its own: a fresh ``/tmp``, ``/dev/shm`` and an empty workspace (its
  current directory), tmpfs that the kernel frees with the namespace;
- a network namespace nobody else used: the slot's, unless the sample before it moved any
  of its counters (a packet, a connection tried), in which case the slot moves to a new one
  first (a new namespace costs more than the rest of a sample together, and most samples never
  touch the network);
- the worker's confinement (uid, Landlock, seccomp, rlimits), applied in that process before
  the code runs; the slot itself runs no code of the sample's;
- at its end, every process it started is killed (``kill(-1)`` from the slot, which is
  the sample's subreaper) and reaped before the next sample begins.

A sample runs as ``python sample.py ARGS`` would: ``sys.argv``, ``__file__``, ``__name__ ==
"__main__"``, stdin, the exit status, tracebacks, threads waited for and ``atexit``
handlers run (``worker.script``).  At its deadline it gets a ``TimeoutError`` raised in its
main thread (signal ``SIGRTMIN+5``, as a worker's block does); ``grace`` seconds later every
process of it is killed.

Protocol, over one stream socket (4-byte big-endian length, then one msgpack map):
    slot  -> coordinator  hello  {token, pid}    (or failed {error}: it cannot serve)
    coordinator -> slot   run    {id, code, path, argv, stdin, files, env, timeout, keep}
    slot  -> coordinator  result {id, status, timed_out, killed, out, err, rss_kb, seconds, note}
``status``: the sample process's wait status (None if it could not be started); ``out`` and
``err``: [head, tail, total bytes], head and tail at most ``keep`` bytes each.  The slot exits
when the coordinator closes the socket, and dies with its namespace's init.
"""

from __future__ import annotations

import builtins
import ctypes
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
import types

from . import _confine, script, wire
from .zygote import _bind, _check, _loopback_up, _mount_points_under

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_CHILD_SUBREAPER = 36
_NEWNS, _NEWIPC, _NEWNET = 0x00020000, 0x08000000, 0x40000000
_MS_NOSUID, _MS_NODEV = 2, 4
INTERRUPT_SIGNAL = signal.SIGRTMIN + 5  # as ``worker.runtime``'s
MAX_REQUEST = 64 * 1024 * 1024  # code, stdin and files of one sample, checked by the coordinator too
_READ = 65536


class HeadTail:
    """Head and tail of one output stream, and the count of every byte: what a slot keeps of
    a sample's output (``engine.samples.Stream`` reads it back), in memory bounded by ``keep``."""

    __slots__ = ("keep", "head", "tail", "total")

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.keep:
                del self.tail[:len(self.tail) - self.keep]

    def parts(self) -> list:
        return [bytes(self.head), bytes(self.tail[-self.keep:]) if self.keep else b"", self.total]


class Slot:
    def __init__(self, conn: socket.socket, settings: dict, confine: dict) -> None:
        self.conn = conn
        self.buf = b""
        self.workspace = str(settings["workspace"])
        self.tmp_bytes = int(settings["tmp_bytes"])
        self.grace = float(settings.get("grace", 1.0))
        self.private_net = bool(settings.get("private_net", True))
        self.net_state = _net_state()
        self.confine = confine
        uid = confine.get("uid")
        self.owner = tuple(uid) if uid else None
        own = str(settings.get("socket_dir") or "")
        # What the sandbox mounted beneath /tmp, to be shown again on each sample's fresh /tmp
        # (the project, outputs): never the workspace (each sample gets an empty one) nor the
        # run's sockets.
        hidden = (self.workspace, os.path.dirname(own) if own else "")
        self.keep = [(point, ro) for point, ro in _mount_points_under("/tmp")
                     if not any(h and (point == h or point.startswith(h + "/")) for h in hidden)]
        self.hide = [d for d in (os.path.dirname(own) if own else "",) if d and not d.startswith("/tmp/")]
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    # -- the channel --------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        data = wire.encode(msg)
        self.conn.sendall(struct.pack(">I", len(data)) + data)

    def receive(self) -> dict | None:
        while True:
            if len(self.buf) >= 4:
                size = struct.unpack(">I", self.buf[:4])[0]
                if size > MAX_REQUEST:
                    return None
                if len(self.buf) >= 4 + size:
                    frame, self.buf = self.buf[4:4 + size], self.buf[4 + size:]
                    return wire.decode(frame, MAX_REQUEST)
            try:
                chunk = self.conn.recv(1 << 20)
            except InterruptedError:
                continue
            if not chunk:
                return None
            self.buf += chunk

    def serve(self) -> None:
        while True:
            request = self.receive()
            if request is None or request.get("t") != "run":
                return
            self.send(self.run(request))

    # -- one sample ---------------------------------------------------------------------------
    def run(self, req: dict) -> dict:
        keep = int(req.get("keep", 8192))
        streams = {}
        reads = {}
        started = time.monotonic()
        fds = []
        try:
            for fd in (1, 2):
                r, w = os.pipe2(os.O_CLOEXEC)
                fds.append(w)
                reads[r] = streams[fd] = HeadTail(keep)
            stdin = self._stdin(req.get("stdin"))
            fds.append(stdin)
            pid = os.fork()
        except OSError as exc:
            for fd in [*fds, *reads]:
                os.close(fd)
            return {"t": "result", "id": req.get("id"), "status": None, "note": f"could not start it: {exc}"}
        if pid == 0:
            self._sample(req, stdin, fds[0], fds[1])  # never returns
        for fd in fds:
            os.close(fd)
        status, rusage, timed_out, killed = self._watch(pid, req, reads, started)
        for r in reads:
            os.close(r)
        return {"t": "result", "id": req.get("id"), "status": status, "timed_out": timed_out,
                "killed": killed, "out": streams[1].parts(), "err": streams[2].parts(),
                "rss_kb": rusage.ru_maxrss if rusage is not None else None,
                "seconds": time.monotonic() - started, "note": ""}

    @staticmethod
    def _stdin(data) -> int:
        if data is None:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        view = memoryview(data.encode() if isinstance(data, str) else bytes(data))
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _watch(self, pid: int, req: dict, reads: dict, started: float):
        """Collect the sample's output until it exits (interrupting it at its deadline, killing
        it ``grace`` s later), then kill and reap every process it left."""
        timeout = float(req.get("timeout") or 60.0)
        deadline, kill_at = started + timeout, None
        status = rusage = None
        timed_out = killed = False
        open_reads = list(reads)
        while status is None:
            now = time.monotonic()
            if kill_at is None and now >= deadline:
                timed_out, kill_at = True, now + self.grace
                _signal(pid, INTERRUPT_SIGNAL)
            elif kill_at is not None and now >= kill_at and not killed:
                killed = True
                _kill_all()
            wait = (kill_at if kill_at is not None else deadline) - now
            ready, _, _ = select.select([*open_reads, self.wake_r], [], [], max(0.0, wait) if not killed else 0.05)
            for fd in ready:
                if fd == self.wake_r:
                    _drain(fd)
                    continue
                data = os.read(fd, _READ)
                if data:
                    reads[fd].add(data)
                else:
                    open_reads.remove(fd)
            got, st, ru = os.wait4(pid, os.WNOHANG)
            if got == pid:
                status, rusage = st, ru
        _kill_all()  # whatever it left running (a daemon, a grandchild)
        for fd in open_reads:  # every writer is dead now: read to the end
            while data := os.read(fd, _READ):
                reads[fd].add(data)
        self._reap()
        if self.private_net and _net_state() != self.net_state:
            self._fresh_network()
        return status, rusage, timed_out, killed

    def _fresh_network(self) -> None:
        """The sample used the network: the next one gets a namespace nobody has used.  (One
        that left the counters of every interface and protocol as they were, and no socket,
        since its processes are all dead, left nothing there to see: the namespace is kept.)"""
        _check(_libc.unshare(_NEWNET), "unshare")
        _loopback_up()
        self.net_state = _net_state()

    def _reap(self) -> None:
        """Wait until no process of the sample is left (the slot is the subreaper of them all)."""
        until = time.monotonic() + 30
        while time.monotonic() < until:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                return
            _kill_all()
            select.select([self.wake_r], [], [], 0.05)
            _drain(self.wake_r)
        os._exit(75)  # something would not die: the coordinator starts a fresh slot

    def _sample(self, req: dict, stdin: int, out: int, err: int) -> None:
        """The sample's process: its own namespaces and confinement, then the code.  Never returns."""
        status = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            with open("/proc/self/oom_score_adj", "w") as f:  # a memory limit's first victim
                f.write("1000")
            self._own_mounts()
            for fd, target in ((stdin, 0), (out, 1), (err, 2)):
                os.dup2(fd, target)
            os.closerange(3, 1 << 16)
            os.chdir(self.workspace)
            _confine.apply(self.confine)
            os.environ.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
            time.tzset()  # (confined first: TZ may name a file)
            sys.stdin = sys.__stdin__ = _text(0, "r", "strict", False)
            sys.stdout = sys.__stdout__ = _text(1, "w", "strict", False)
            sys.stderr = sys.__stderr__ = _text(2, "w", "backslashreplace", True)
        except BaseException as exc:  # noqa: BLE001 - the sample never runs half-confined
            os.write(err, f"agentloop: the sample's sandbox could not be made: {exc}\n".encode())
            os._exit(125)
        try:
            status = _run_script(req, self.workspace)
        finally:
            os._exit(status)

    def _own_mounts(self) -> None:
        """Mount and IPC namespaces of the sample's own, with empty /tmp, /dev/shm and workspace."""
        _check(_libc.unshare(_NEWNS | _NEWIPC), "unshare")
        # Opened in the new namespace (a bind's source must be a mount of the caller's own),
        # before the fresh /tmp hides them.
        keep = [(point, read_only, os.open(point, os.O_PATH)) for point, read_only in self.keep]
        size = f"size={self.tmp_bytes},mode=1777".encode()
        _check(_libc.mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, size), "/tmp")
        for point, read_only, fd in keep:
            _bind(fd, point, read_only)
            os.close(fd)
        for where in self.hide:
            _check(_libc.mount(b"tmpfs", where.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=0755"), where)
        os.makedirs(self.workspace, exist_ok=True)
        _check(_libc.mount(b"tmpfs", self.workspace.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, size), "workspace")
        if os.path.isdir("/dev/shm"):
            _check(_libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, size), "/dev/shm")


#: Per network namespace: every interface's counters and every protocol's (a packet sent, a
#: connection tried, refused or left in TIME_WAIT moves one of them).
_NET_STATE = ("/proc/net/dev", "/proc/net/snmp", "/proc/net/netstat", "/proc/net/snmp6")


def _net_state() -> bytes:
    state = []
    for path in _NET_STATE:
        try:
            with open(path, "rb") as f:
                state.append(f.read())
        except OSError:
            state.append(b"")
    return b"\0".join(state)


def _text(fd: int, mode: str, errors: str, line_buffering: bool):
    """A standard stream as CPython makes it for a pipe (UTF-8, buffered; stderr by lines)."""
    import io

    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=line_buffering)


def _run_script(req: dict, workspace: str) -> int:
    """Write the sample's files, then run its code as ``python FILE ARGS`` would; the exit status."""
    for path, content, mode in req.get("files") or ():
        full = os.path.join(workspace, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(content)
        os.chmod(full, mode)
    name = str(req.get("path") or "sample.py")  # as the code sees it: relative to its workspace, its cwd
    code = str(req.get("code", ""))
    with open(os.path.join(workspace, name), "w", encoding="utf-8") as f:  # tracebacks quote it, spawn re-reads it
        f.write(code)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=name, __cached__=None, __builtins__=builtins)
    sys.modules["__main__"] = main
    sys.argv = [str(a) for a in req.get("argv") or [name]]
    sys.path[0:0] = [workspace]
    timeout = float(req.get("timeout") or 60.0)

    def interrupt(signum, frame):
        raise TimeoutError(f"the deadline ({timeout:g} s) passed")

    signal.signal(INTERRUPT_SIGNAL, interrupt)
    status = 0
    try:
        exec(compile(code, name, "exec"), main.__dict__)
    except SystemExit as exc:
        status, text = script.exit_status(exc)
        if text is not None:
            _flush(sys.stdout)
            print(text, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - what CPython does with an uncaught exception
        _flush(sys.stdout)
        exc.__traceback__ = tb = _user_frames(exc.__traceback__, interrupt.__code__)
        try:
            sys.excepthook(type(exc), exc, tb)  # a hook the code set is called, as CPython calls it
        except BaseException:  # noqa: BLE001 - a hook that fails: CPython prints both
            traceback.print_exception(type(exc), exc, tb)
        status = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    try:
        script.finish()
    except SystemExit as exc:
        status = script.exit_status(exc)[0]
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        if not _flush(stream) and status == 0:
            status = 120  # as CPython, when flushing stdout at exit fails
    if status == -signal.SIGINT:  # as CPython ends after an uncaught KeyboardInterrupt: by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 130
    return status


def _user_frames(tb, handler):
    """The traceback from the sample's first frame (not this runner's), without the frame of
    the deadline's signal handler at its end."""
    tb = tb.tb_next if tb is not None else None
    at = tb
    while at is not None and at.tb_next is not None:
        if at.tb_next.tb_frame.f_code is handler:
            at.tb_next = None
            break
        at = at.tb_next
    return tb


def _flush(stream) -> bool:
    try:
        stream.flush()
        return True
    except Exception:  # noqa: BLE001 - a closed pipe, as CPython it says so and goes on
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all() -> None:
    """Every process of this PID namespace but its init and the slot: the sample's."""
    try:
        os.kill(-1, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def main() -> None:
    token = os.environ.pop("AGENTLOOP_TOKEN", "")
    confine = json.loads(os.environ.pop("AGENTLOOP_CONFINE", "") or "{}")
    settings = json.loads(os.environ.pop("AGENTLOOP_SLOT", "") or "{}")
    os.environ.pop("AGENTLOOP_PARENT", None)
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    endpoint = sys.argv[1]
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else endpoint
    settings.setdefault("socket_dir", os.path.dirname(path))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    try:
        for name in settings.get("preload") or ():  # --preload: imported once, shared by every sample
            __import__(str(name))
        slot = Slot(conn, settings, confine)
        _confine.seccomp_program(**_seccomp_args(confine))  # built once here, reused by each sample
    except BaseException as exc:  # noqa: BLE001 - said to the coordinator; the slot is not used
        conn.sendall(_framed({"t": "failed", "error": f"{type(exc).__name__}: {exc}"}))
        os._exit(72)
    gc.collect()
    gc.freeze()  # the pages shared with each sample's process stay shared
    conn.sendall(_framed({"t": "hello", "token": token, "pid": os.getpid()}))
    slot.serve()
    os._exit(0)


def _seccomp_args(confine: dict) -> dict:
    opts = confine.get("seccomp")
    opts = opts if isinstance(opts, dict) else {}
    return {"socket_families": opts.get("socket_families"), "lock_session": bool(opts.get("lock_session")),
            "shared_memory": bool(opts.get("shared_memory", True))}


def _framed(msg: dict) -> bytes:
    data = wire.encode(msg)
    return struct.pack(">I", len(data)) + data


if __name__ == "__main__":
    main()
