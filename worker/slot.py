"""A sample slot: runs code samples one after another, each in a sandbox of its own.

``python -I -B -c "...; from worker.slot import main; main()"`` is what the fork server
starts in place of a worker (a fresh, small interpreter: forking it costs a third of forking
the worker runtime).  It keeps its PID and UTS namespaces (and its network one while unused),
its capabilities, its cgroups and its uid (a root coordinator gives each slot a uid of its
own: samples that run at once are in different slots, so no per-user kernel quota, terminal
or file is shared through a uid) from sample to sample.  Its own mount namespace holds no
layer of the run's sockets, outputs or workspace (``_own_view``), and it gives every sample
what no later sample can see:

- a process of its own (forked from the slot), in a session of its own, with mount, IPC and
  cgroup namespaces of its own: a fresh ``/tmp``, ``/dev/shm`` and an empty workspace (its
  current directory), tmpfs that the kernel frees with the namespace; a devpts instance of its
  own (it sees no other sample's terminal, and holds at most ``PTYS``); a ``/proc`` that shows
  its own processes only (``hidepid``: the slot and the namespace's init are not there); its
  cgroup is ``/``; its command line and ``sys.orig_argv`` name no path of the run's (the slot
  is told its socket in its environment, which no sample may read).  Forked from the slot, a
  sample's memory is a copy of the slot's: it holds no secret (the token is spent once the
  hello is accepted), only paths that the sample's view does not show;
- a network namespace nobody else used: the slot's, unless the sample before it moved any
  of its counters (a packet, a connection tried), in which case the slot moves to a new one
  first (a new namespace costs more than the rest of a sample together, and most samples never
  touch the network);
- the worker's confinement (uid, Landlock, seccomp, rlimits), applied in that process before
  the code runs; the slot itself runs no code of the sample's;
- at its end, every process it started is killed (``kill(-1)`` from the slot, which is
  the sample's subreaper) and reaped before the next sample begins, and what it left that
  outlives its processes is looked for (``SlotRuntime._left_behind``): a slot that finds any asks to
  be replaced (``retire`` in its result).

A sample runs as ``python sample.py ARGS`` would: ``sys.argv``, ``__file__``, ``__name__ ==
"__main__"``, stdin, the exit status, tracebacks, threads waited for and ``atexit``
handlers run (``worker.script_run``).  At its deadline it gets a ``TimeoutError`` raised in its
main thread (signal ``SIGRTMIN+5``, as a worker's block does); ``grace`` seconds later every
process of it is killed.

The channel, one stream socket to the coordinator, is ``contract.sample``.  The slot exits
when the coordinator closes the socket, and dies with its namespace's init.
"""

from __future__ import annotations

import builtins
import gc
import os
import select
import signal
import socket
import sys
import time
import traceback
import types

from . import _confine, script_run
from ._fetch import FETCHED_FD, read_fetched, send_fetched
from ._mounts import (
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    NEWCGROUP,
    NEWIPC,
    NEWNET,
    NEWNS,
    beneath,
    bind,
    check,
    libc,
    loopback_up,
    mount_points_under,
)
from .contract import sample
from .contract.confinement import Confinement
from .contract.egress import FORWARDER_PORT
from .contract.framing import FrameBuffer, FrameError, decode, encode, frame
from .contract.limits import INTERRUPT_SIGNAL, HeadTail
from .contract.sample import SlotSettings
from .contract.schema import ContractError
from .contract.start import StartSpec

__all__ = ["SlotRuntime", "main"]

_PR_SET_CHILD_SUBREAPER = 36
_READ = 65536
_MNT_DETACH = 2
# The new mount API (Linux 5.2; one number on every architecture).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT = 428, 429
_AT_FDCWD, _OPEN_TREE_CLONE, _MOVE_MOUNT_F_EMPTY_PATH = -100, 1, 4
#: Terminals a sample may hold at once, in the devpts instance of its own (the kernel's pool of
#: them is the host's).
PTYS = 64
#: Where a sample with a way out (``--allow-net``) finds its slot's gate socket, bound read-only
#: in its own /tmp (its forwarder relays there; the code may as well, to the same policy).
EGRESS_SOCKET = "/tmp/.agentloop-net/egress.sock"


class SlotRuntime:
    def __init__(self, conn: socket.socket, settings: SlotSettings, confine: Confinement, egress: str = "") -> None:
        self.conn = conn
        self.forward = None
        if egress:  # (imported once here, for every sample; a slot without a way out never does)
            from .egress import start as forward

            self.forward = forward
        self.frames = FrameBuffer(sample.MAX_REQUEST)
        self.workspace = settings.workspace
        self.tmp_bytes = settings.tmp_bytes
        self.grace = settings.grace
        self.private_net = settings.private_net
        self.net_state = _net_state()
        self.confine = confine
        self.own_sockets: set[bytes] | None = None  # its channel's two ends, once accepted
        own = settings.socket_dir
        # Never shown to a sample: the workspace (each gets an empty one), the run's sockets
        # and its outputs.
        hidden = [d for d in (self.workspace, os.path.dirname(own) if own else "", settings.outputs) if d]
        # The way out of its samples (``--allow-net``): the slot's gate socket, copied before the
        # run's sockets are detached from this view, shown at ``EGRESS_SOCKET`` (and so in each
        # sample's /tmp, with what else the view keeps there).
        self.keep = _own_view(hidden, {egress: EGRESS_SOCKET} if egress else {})
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    # -- the channel --------------------------------------------------------------------------
    def send(self, msg: sample.Message) -> None:
        self.conn.sendall(frame(encode(msg)))

    def receive(self) -> sample.RunSample | None:
        """The next request; None when the coordinator closed the socket (or broke the contract,
        which only a bug of its own can: the slot then ends, and the coordinator starts another)."""
        while True:
            try:
                body = self.frames.next()
                if body is not None:
                    return sample.TO_SLOT.parse(decode(body, sample.MAX_REQUEST))  # type: ignore[return-value]
            except (ContractError, FrameError):
                return None
            try:
                chunk = self.conn.recv(1 << 20)
            except InterruptedError:
                continue
            if not chunk:
                return None
            self.frames.feed(chunk)

    def serve(self) -> None:
        while (request := self.receive()) is not None:
            if self.own_sockets is None:  # (the coordinator has accepted: its end has an inode)
                self.own_sockets = _unix_sockets()
            self.send(self.run(request))

    # -- one sample ---------------------------------------------------------------------------
    def run(self, req: sample.RunSample) -> sample.Result:
        keep = req.keep
        streams = {}
        reads = {}
        started = time.monotonic()
        fds = []
        try:
            for fd in (1, 2):
                r, w = os.pipe2(os.O_CLOEXEC)
                fds.append(w)
                reads[r] = streams[fd] = HeadTail(keep)
            stdin = self._stdin(req.stdin)
            fds.append(stdin)
            # Where the sample's process puts the files asked for as its code ends: a file of
            # the slot's, read once every process of the sample is dead.
            fetched = os.memfd_create("fetched", os.MFD_CLOEXEC) if req.fetch else -1
            fds.append(fetched)
            pid = os.fork()
        except OSError as exc:
            for fd in [*fds, *reads]:
                if fd >= 0:
                    os.close(fd)
            return sample.Result(req.id, None, note=f"could not start it: {exc}"[:2000])
        if pid == 0:
            self._sample(req, stdin, fds[0], fds[1], fetched)  # never returns
        for fd in fds[:-1]:
            os.close(fd)
        status, rusage, timed_out, killed = self._watch(pid, req, reads, started)
        for r in reads:
            os.close(r)
        files, note = read_fetched(fetched, req) if fetched >= 0 else ((), "")
        return sample.Result(req.id, status, timed_out, killed, streams[1].parts(), streams[2].parts(),
                             rusage.ru_maxrss if rusage is not None else None, time.monotonic() - started,
                             note=note, retire=self._left_behind(), fetched=files)

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

    def _watch(self, pid: int, req: sample.RunSample, reads: dict, started: float):
        """Collect the sample's output until it exits (interrupting it at its deadline, killing
        it ``grace`` s later), then kill and reap every process it left."""
        deadline, kill_at = started + req.timeout, None
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
        return status, rusage, timed_out, killed

    def _left_behind(self) -> bool:
        """Once every process of the sample is dead, look for what it left that outlives them;
        True when the slot must be replaced before the next sample.

        Descriptors passed by ``SCM_RIGHTS`` into a cycle of unix sockets that no process holds
        live until the kernel's unix-socket garbage collection (run when some unix socket
        closes): sockets and their ports, memfds charged to the slot's cgroup, inotify
        instances charged to its uid.  Such a cycle shows as unix sockets in the slot's network
        namespace that are not the slot's own: the collection is started and the slot is
        replaced.  A namespace whose counters moved (a packet, a connection tried, a socket in
        TIME_WAIT) is replaced by a fresh one, which costs more than the rest of a sample
        together; one whose counters and sockets are as they were is kept.  (The IPC namespace
        was the sample's own.)  On the host's network nothing tells the sample's sockets from
        the host's: the collection is started after every sample, and the coordinator's memory
        check stands."""
        if not self.private_net:
            _collect_unix_garbage()
            return False
        if _unix_sockets() - (self.own_sockets or set()):
            _collect_unix_garbage()
            return True
        if _net_state() != self.net_state:
            self._fresh_network()
        return False

    def _fresh_network(self) -> None:
        """A network namespace nobody has used, for the next sample."""
        check(libc.unshare(NEWNET), "unshare")
        loopback_up()
        self.net_state = _net_state()
        self.own_sockets = _unix_sockets()

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

    def _sample(self, req: sample.RunSample, stdin: int, out: int, err: int, fetched: int) -> None:
        """The sample's process: its own namespaces and confinement, then the code.  Never returns."""
        status = 1
        said = err  # where a failure is said: the stderr pipe, fd 2 once it is there
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            adj = os.open("/proc/self/oom_score_adj", os.O_WRONLY)  # a memory limit's first victim
            os.write(adj, b"1000")
            os.close(adj)
            self._own_mounts()
            for fd, target in ((stdin, 0), (out, 1), (err, 2)) + (((fetched, FETCHED_FD),) if fetched >= 0 else ()):
                os.dup2(fd, target)
            said = 2
            os.closerange(3 if fetched < 0 else FETCHED_FD + 1, 1 << 16)
            os.chdir(self.workspace)
            _confine.apply(self.confine)
            if self.forward is not None:  # confined, one thread, before any code: the forwarder
                self.forward(EGRESS_SOCKET, port=FORWARDER_PORT)
            if req.env:
                os.environ.update(req.env)
                time.tzset()  # (confined first: TZ may name a file)
            sys.stdin = sys.__stdin__ = _text(0, "r", "strict", False)
            sys.stdout = sys.__stdout__ = _text(1, "w", "strict", False)
            sys.stderr = sys.__stderr__ = _text(2, "w", "backslashreplace", True)
        except BaseException as exc:  # noqa: BLE001 - the sample never runs half-confined
            try:
                os.write(said, f"agentloop: the sample's sandbox could not be made: {exc}\n".encode())
            finally:
                os._exit(125)
        try:
            status = _run_script(req, self.workspace)
        finally:
            os._exit(status)

    def _own_mounts(self) -> None:
        """Mount, IPC and cgroup namespaces of the sample's own: empty /tmp, /dev/shm and
        workspace; a devpts instance of its own (no other sample's terminal exists for it);
        a /proc that shows its own processes only (``hidepid``: the slot and the namespace's
        init, root's, are not there); its cgroup is ``/``."""
        check(libc.unshare(NEWNS | NEWIPC | NEWCGROUP), "unshare")
        # Opened in the new namespace (a bind's source must be a mount of the caller's own),
        # before the fresh /tmp hides them.
        keep = [(point, read_only, os.open(point, os.O_PATH)) for point, read_only in self.keep]
        size = f"size={self.tmp_bytes},mode=1777".encode()
        check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, size), "/tmp")
        for point, read_only, fd in keep:
            if point == EGRESS_SOCKET:  # (a socket, not a directory: it is bound on a file)
                os.makedirs(os.path.dirname(point), mode=0o755, exist_ok=True)
                os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
            bind(fd, point, read_only)
            os.close(fd)
        os.makedirs(self.workspace, exist_ok=True)
        check(libc.mount(b"tmpfs", self.workspace.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size), "workspace")
        if os.path.isdir("/dev/shm"):
            check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, size), "/dev/shm")
        if os.path.isdir("/dev/pts"):  # (/dev/ptmx is bubblewrap's link to pts/ptmx)
            options = f"newinstance,ptmxmode=0666,mode=0620,max={PTYS}".encode()
            check(libc.mount(b"devpts", b"/dev/pts", b"devpts", MS_NOSUID | MS_NOEXEC, options), "/dev/pts")
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible"),
              "/proc")


def _own_view(hidden: list[str], files: dict[str, str] | None = None) -> list[tuple[str, bool]]:
    """Give the slot a mount namespace of its own holding nothing a sample may not see, since
    each sample's is a copy of it and a covered mount still shows in ``/proc/self/mountinfo``:
    every layer of ``/tmp``, ``/dev/shm`` and of the ``hidden`` directories (the paths of the
    run's sockets, outputs and workspace) is detached, and what the sandbox mounted beneath
    ``/tmp`` outside them (the project, the interpreter) is mounted again on a fresh ``/tmp``,
    from copies made before (a detached mount cannot be bound).  Returns those mounts,
    shallowest first: (mount point, read-only), for each sample's ``/tmp``.

    Unprivileged, the layers that the server's sandbox mounted are locked into every namespace
    below it (the kernel lets what is under a mount be covered, never uncovered): they stay,
    named in ``mountinfo``, and an empty read-only tmpfs covers each hidden directory again.
    ``files``: a file (the slot's gate socket) -> where in the fresh ``/tmp`` it is shown
    read-only, kept as the other mounts are."""
    check(libc.unshare(NEWNS), "unshare")
    os.chdir("/")  # (not in a mount about to go)
    shown: dict[str, bool] = {}
    for point, read_only in mount_points_under("/tmp"):  # (the topmost of a point comes last)
        if not any(beneath(point, h) for h in hidden):
            shown[point] = read_only
    keep = sorted(shown.items(), key=lambda item: item[0].count("/"))
    copies = [_copy_mount(point) for point, _ in keep]
    moved = [(_copy_mount(source), target) for source, target in (files or {}).items()]
    for top in ("/tmp", "/dev/shm", *hidden):
        while libc.umount2(top.encode(), _MNT_DETACH) == 0:  # every layer, until none is left
            pass
    check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755"), "/tmp")
    for top in hidden:
        if not beneath(top, "/tmp") and os.path.isdir(top):
            check(libc.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, b"size=4k,mode=0555"),
                  top)
    for (point, _), fd in zip(keep, copies, strict=True):
        os.makedirs(point, exist_ok=True)
        check(libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, point.encode(), _MOVE_MOUNT_F_EMPTY_PATH), point)
        os.close(fd)
    for fd, target in moved:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))  # (a file to mount on)
        check(libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH), target)
        os.close(fd)
        keep.append((target, True))
    return keep


def _copy_mount(point: str) -> int:
    """A descriptor of a detached copy of the mount at ``point`` (``open_tree``), flags and all."""
    fd = libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, point.encode(), _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        check(fd, point)
    return fd


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


def _unix_sockets() -> set[bytes]:
    """The inodes of the unix sockets of this network namespace (its processes' and those in
    flight), from ``/proc/net/unix``."""
    with open("/proc/net/unix", "rb") as f:
        return {line.split()[6] for line in f.readlines()[1:] if len(line.split()) > 6}


def _collect_unix_garbage() -> None:
    """Start the kernel's unix-socket garbage collection: closing a unix socket does, while
    any descriptor is in flight."""
    a, b = socket.socketpair()
    a.close()
    b.close()


def _text(fd: int, mode: str, errors: str, line_buffering: bool):
    """A standard stream as CPython makes it for a pipe (UTF-8, buffered; stderr by lines)."""
    import io

    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=line_buffering)


def _run_script(req: sample.RunSample, workspace: str) -> int:
    """Write the sample's files, then run its code as ``python FILE ARGS`` would; the exit status."""
    for path, content, mode in req.files:
        full = os.path.join(workspace, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(content)
        os.chmod(full, mode)
    name = req.path  # as the code sees it: relative to its workspace, its cwd
    code = req.code
    # A script is a file: tracebacks quote it, spawn re-reads it.
    fd = os.open(os.path.join(workspace, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(code.encode("utf-8"))
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=name, __cached__=None, __builtins__=builtins)
    sys.modules["__main__"] = main
    sys.argv = list(req.argv) or [name]
    sys.orig_argv = [sys.executable, *sys.argv]  # as ``python sample.py ARGS`` has it, not the slot's
    sys.path[0:0] = [workspace]
    timeout = req.timeout

    def interrupt(signum, frame):
        raise TimeoutError(f"the deadline ({timeout:g} s) passed")

    signal.signal(INTERRUPT_SIGNAL, interrupt)
    status = 0
    try:
        exec(compile(code, name, "exec"), main.__dict__)
    except SystemExit as exc:
        status, text = script_run.exit_status(exc)
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
        script_run.finish()
    except SystemExit as exc:
        status = script_run.exit_status(exc)[0]
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        if not _flush(stream) and status == 0:
            status = 120  # as CPython, when flushing stdout at exit fails
    if req.fetch:
        send_fetched(req, workspace, FETCHED_FD)
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
    start = StartSpec.take()
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    endpoint = start.slot.endpoint if start.slot is not None else ""
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else endpoint
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    try:
        if start.slot is None:
            raise ContractError("no slot settings")
        for name in start.slot.preload:  # --preload: imported once, shared by every sample
            __import__(name)
        slot = SlotRuntime(conn, start.slot, start.confine, start.egress)
        _confine.prepare(start.confine)  # once here for every sample: seccomp built, bounding set empty
    except BaseException as exc:  # noqa: BLE001 - said to the coordinator; the slot is not used
        conn.sendall(frame(encode(sample.Failed(f"{type(exc).__name__}: {exc}"[:2000]))))
        os._exit(72)
    gc.collect()
    gc.freeze()  # the pages shared with each sample's process stay shared
    conn.sendall(frame(encode(sample.Hello(start.token, os.getpid()))))
    slot.serve()
    os._exit(0)


if __name__ == "__main__":
    main()
