"""The fork server: ``python -m worker.fork_server``, started once per run inside the run's sandbox.

It imports the modules its start names (``StartSpec.preload``) once, and the worker runtime with the
first request for a worker (``_prepare_workers``: a server that only starts sample slots, which
run a fresh interpreter of their own, never pays for it), then forks a worker per request in a
few milliseconds instead of starting an interpreter.  It runs no user code, holds no threads
and no ZeroMQ context (neither survives a fork), and talks to the coordinator over its
stdin/stdout (``contract.fork``).

Each worker gets the isolation of a freshly started one:

    server ── B (new PID, network, IPC, UTS and mount namespaces for its children; forks C,
               says C's pid, exits)
          ── C (re-parented to the server; pid 1 of its namespace: mounts its own /proc,
               brings its loopback up, waits for its request; then mounts its own /tmp and
               /dev/shm, shows only its worker's directories and socket, forks D, then
               becomes ``sleep infinity``)
               └─ D (the worker: applies its own confinement — uid, Landlock, seccomp,
                     rlimits — then serves)

B and C are made ahead, one spare at a time (``_Init``): once the server has been idle a
moment after a fork, the next worker's namespaces, /proc and loopback are made, so a request
waits only for what depends on it.

An unprivileged server (in bubblewrap's user namespace, with CAP_SYS_ADMIN and CAP_NET_ADMIN
there) has B make a user namespace of its own first (``_mounts.own_user_namespace``), as
rootless containers do: the namespaces B makes then belong to it, C holds its capabilities
there only, what the worker's tree counts against RLIMIT_NPROC is its own (as in a worker
started cold, in a bubblewrap of its own), and C allows no user namespace below it.  Root's
server needs none: its workers switch to the run's uid.

Killing C ends every process of that namespace.  C and D are also members of the sandbox's
PID namespace, so the server's death (and the coordinator's, which kills the server's
sandbox) ends them all.  C reaps nothing: the worker is a child subreaper, so orphans of user
code go to D, and D's own exit leaves a zombie whose status the coordinator reads before it
kills C.  As a tiny program instead of a copy of this interpreter, C costs a worker about
0.1 MB instead of 1.5 MB (and no share of the server's pages).
The channel (requests on stdin, reports on stdout) is ``contract.fork``: ``spawned`` and
``forked`` name C's pid; D is C's only child.  ``forked`` comes as C is handed its request, so
the coordinator moves C into the worker's cgroups while C sets up, and D is born inside them.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import select
import signal
import stat
import struct
import sys
import time
from collections.abc import Callable

from ._mounts import (
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    NEWIPC,
    NEWNET,
    NEWNS,
    NEWPID,
    NEWUTS,
    beneath,
    bind,
    check,
    libc,
    loopback_up,
    mount_points_under,
    no_user_namespaces,
    own_user_namespace,
)
from .contract import fork
from .contract.framing import (
    FrameBuffer,
    FrameError,
    decode,
    decode_json,
    encode,
    encode_json,
    frame,
    read_frame,
    read_frame_before,
    write_all,
)
from .contract.schema import ContractError

__all__ = ["probe", "serve"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_NEW = NEWPID | NEWIPC | NEWUTS | NEWNS


def _die_with_parent(parent: int | None) -> None:
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(70)  # the parent died before the signal was armed


def _exit_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _open_shown(path: str) -> int:
    """An O_PATH descriptor of ``path``, a directory or (kept read-only in a workspace) a
    regular file, its last component never a link."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        os.close(fd)
        raise OSError(errno.ELOOP, f"{path}: neither a directory nor a file")
    return fd


def _private_tmp(request: fork.Spawn, userns: bool) -> None:
    """A /tmp and /dev/shm of this worker's own, and a view of the server's directories that
    holds this worker's own and nothing of its neighbours'.

    ``hide``: directories whose whole content the worker must not see (a run's socket
    directory; for a server shared by a batch, the batch's runs directory and its socket root
    too).  ``show``: (path, read-only) beneath them that the worker sees again (its run's
    workspace and outputs, and what stays read-only in the workspace); its own socket directory
    is always shown, read-only (it connects, it writes nothing there).  Without ``hide`` it is the run's socket directory.

    Order: descriptors of what is shown are opened first (in this mount namespace: a bind
    comes from a mount of the same one), /tmp is replaced, what the sandbox mounted beneath
    /tmp (the project, the workspace, ...) is mounted again on top unless hidden, an empty
    read-only tmpfs covers each hidden directory that is still there, and the shown paths are
    bound back in it.  Unprivileged (``userns``), the worker has the uid that makes the
    directories of its fresh /tmp: a hidden directory beneath /tmp is made again there and
    covered too, or the worker could write beside what is shown in it (if only on its own
    /tmp)."""
    endpoint = request.endpoint
    own = os.path.dirname(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None
    hide = list(request.hide or ([os.path.dirname(own)] if own else []))
    show = list(request.show) + ([(own, True)] if own else [])
    shown = [(path, ro, _open_shown(path)) for path, ro in show if any(beneath(path, h) for h in hide)]
    keep = [(point, ro, os.open(point, os.O_PATH)) for point, ro in mount_points_under("/tmp")
            if not any(beneath(point, h) for h in hide)]
    size = f"size={request.tmp_bytes},mode=1777".encode()
    check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, size), "/tmp")
    for point, ro, fd in keep:
        bind(fd, point, ro)
        os.close(fd)
    if userns:
        for hidden in hide:
            if beneath(hidden, "/tmp"):
                os.makedirs(hidden, exist_ok=True)
    covered = [h for h in hide if os.path.isdir(h)]  # (root's beneath /tmp are gone with the old /tmp)
    for hidden in covered:
        check(libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                           b"size=1m,mode=0755"), hidden)
    for path, ro, fd in sorted(shown, key=lambda item: item[0].count("/")):
        bind(fd, path, ro)
        os.close(fd)
    for hidden in covered:  # nothing may be written to the cover (the binds keep their own mode)
        if all(path != hidden for path, _, _ in shown):
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
            check(libc.mount(None, hidden.encode(), None, flags, None), hidden)
    if os.path.isdir("/dev/shm"):
        check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, size), "/dev/shm")


def _own_stderr(path: str) -> None:
    """Make the fifo ``path`` (the coordinator reads it) this worker's stderr: a server shared
    by several runs must not pass one run's last words to another.  Without a reader the
    worker says nothing rather than wait."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        os.set_blocking(fd, True)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)


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


def _receive(fd: int) -> fork.Spawn | None:
    """The request the server hands C down its pipe (framed, as the server received it), or
    None at end of file: the server did not need this init after all."""
    body = read_frame(fd, fork.MAX_REQUEST)
    return None if body is None else fork.TO_SERVER.parse(decode(body))  # type: ignore[return-value]


def _child(private_net: bool, control: tuple[int, ...], report: int, requests: int, sleep: str | None) -> None:
    """B: runs in the forked child; never returns.  B only makes the namespaces (unprivileged:
    in a user namespace of its own), forks C into them, tells the server C's pid and leaves: C
    is re-parented to the server (a subreaper), which reaps it when the coordinator kills it.  C
    sets up what needs no request (its /proc, its loopback), then waits for its request on
    ``requests`` (made ahead of it: see ``_Init``), sets the worker's view up and says when D
    exists."""
    try:
        signal.set_wakeup_fd(-1)  # the server's wake-up pipe is not ours
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in control:
            os.close(fd)
        userns = os.geteuid() != 0
        if userns:
            own_user_namespace()
        # A network namespace of its own too, unless the run was given the host's network.
        check(libc.unshare(_NEW | (NEWNET if private_net else 0)), "unshare")
        init = os.fork()
        if init:
            write_all(report, frame(encode_json(fork.Init(init))))
            os._exit(0)
        # No parent-death signal for C: it would fire as B leaves.  C lives in the sandbox's
        # PID namespace too, which ends with the server and with the coordinator.
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
        # The worker's /proc shows only what it may trace (hidepid, which asks Landlock too): not
        # C (unprivileged, the worker has C's uid), not a slot's own process to its samples, and
        # to a fork's copy neither its parent nor its siblings (each in a domain of its own).
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible"),
              "/proc")
        if userns:
            no_user_namespaces()
        if private_net:
            loopback_up()
        request = _receive(requests)
        os.close(requests)
        if request is None:
            os._exit(0)
        _private_tmp(request, userns)
        if request.own_workspace:  # (code samples) an empty workspace of its own, gone with it
            check(libc.mount(b"tmpfs", request.own_workspace.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                               f"size={request.tmp_bytes},mode=1777".encode()), "workspace")
        worker = os.fork()
        if worker:
            write_all(report, frame(encode_json(fork.Child(worker))))
            _idle_init(sleep)
        os.close(report)
        if request.stderr:
            _own_stderr(request.stderr)
        _die_with_parent(1)
        os.environ.clear()
        os.environ.update(request.env)
        os.chdir(request.cwd)
        os.setsid()
        if request.exec:  # a sample slot: a fresh interpreter, cheaper to fork from
            if userns:  # (root keeps its capabilities across exec; another uid keeps only ambient ones)
                _keep_across_exec(_SLOT_CAPS)
            os.execve(request.exec[0], list(request.exec), dict(os.environ))
        from worker.__main__ import run_worker

        run_worker(request.endpoint)
    except BaseException as exc:  # noqa: BLE001 - the last words of a child that failed to start
        os.write(2, f"agentloop fork server: worker start failed: {exc}\n".encode())
    os._exit(72)


#: What a sample slot needs of its user namespace's capabilities: its samples' namespaces and
#: mounts, a fresh loopback, and emptying their bounding set.
_SLOT_CAPS = (21, 12, 8)  # CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SETPCAP
_CAP_VERSION_3 = 0x20080522
_SYS_CAPGET, _SYS_CAPSET = {"x86_64": (125, 126), "aarch64": (90, 91)}.get(os.uname().machine, (125, 126))


def _keep_across_exec(caps: tuple[int, ...]) -> None:
    """Make ``caps`` (held, permitted) ambient, so that the program this process executes next
    holds them too although its uid is not 0 in its user namespace; the others go at exec."""
    import ctypes

    header = struct.pack("Ii", _CAP_VERSION_3, 0)
    data = ctypes.create_string_buffer(24)
    check(libc.syscall(_SYS_CAPGET, header, data), "capget")
    words = list(struct.unpack("6I", data.raw))  # effective, permitted, inheritable; low then high
    wanted = sum(1 << cap for cap in caps)
    words[2], words[5] = wanted & 0xFFFFFFFF, wanted >> 32
    check(libc.syscall(_SYS_CAPSET, header, struct.pack("6I", *words)), "capset")
    for cap in caps:
        check(libc.prctl(47, 2, cap, 0, 0), f"ambient capability {cap}")  # PR_CAP_AMBIENT_RAISE


def _read_reports(fd: int, want: type[fork.Message], found: dict[type[fork.Message], int],
                  timeout: float = 10.0) -> None:
    """Add to ``found`` what B and C say on the report pipe (``fork.REPORTS``: ``Init`` -> C's
    pid, ``Child`` -> D's, in C's namespace) until ``want`` is there, the pipe ends or
    ``timeout`` passes.  Anything but their reports ends the reading as the pipe's end would:
    the start failed."""
    deadline = time.monotonic() + timeout
    while want not in found:
        try:
            body = read_frame_before(fd, fork.MAX_INSIDE, deadline)
            if body is None:
                return
            report = fork.REPORTS.parse(decode_json(body, fork.MAX_INSIDE))
        except (TimeoutError, ContractError):  # (FrameError is one)
            return
        found[type(report)] = report.pid  # type: ignore[attr-defined]


#: Seconds without a request after which the next worker's init is made: not at once, where
#: it would take CPU from the worker that has just been forked, which is starting.
_SPARE_AFTER = 0.03


class _Init:
    """A worker's namespace init made ahead of the request it will serve: B forked (C follows
    at once: new namespaces, /proc, loopback), the pipe its request goes down and the one it
    reports on.  What a worker start waits for is then only what depends on the request."""

    def __init__(self, private_net: bool, control: tuple[int, ...], sleep: str | None) -> None:
        self.private_net = private_net
        report_r, report_w = os.pipe()
        request_r, request_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (report_r, report_w, request_r, request_w):
                os.close(fd)
            raise
        if pid == 0:
            _child(private_net, (*control, report_r, request_w), report_w, request_r, sleep)
        os.close(report_w)
        os.close(request_r)
        self.reports, self.requests = report_r, request_w
        self.found: dict[type[fork.Message], int] = {}

    @property
    def pid(self) -> int | None:
        """C's pid (waiting for B to say it, the first time), None if B failed."""
        _read_reports(self.reports, fork.Init, self.found)
        return self.found.get(fork.Init)

    def hand_over(self, request: fork.Spawn, on_init: Callable[[int], None]) -> int | None:
        """Give ``request`` to C (``on_init(C's pid)`` first); C's pid once D exists, else None
        (C is killed).  The pipes are closed either way."""
        found = self.found
        if self.pid is not None:
            on_init(found[fork.Init])
            with contextlib.suppress(OSError):  # (C died: D never comes)
                write_all(self.requests, frame(encode(request)))
            os.close(self.requests)
            _read_reports(self.reports, fork.Child, found)
        else:
            os.close(self.requests)
        os.close(self.reports)
        if fork.Child not in found:
            if fork.Init in found:
                with contextlib.suppress(OSError):
                    os.kill(found[fork.Init], signal.SIGKILL)
            return None
        return found[fork.Init]

    def discard(self) -> None:
        """Not needed after all: its C reads the end of its request pipe and exits."""
        os.close(self.requests)
        os.close(self.reports)


class _Wire:
    """The server's end of ``contract.fork``: requests on stdin, reports on stdout."""

    def __init__(self) -> None:
        self.inp = sys.stdin.buffer.fileno()
        self.out = os.dup(sys.stdout.buffer.fileno())
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints must not corrupt the channel
        self.frames = FrameBuffer(fork.MAX_REQUEST)

    def send(self, msg: fork.Message) -> None:
        write_all(self.out, frame(encode(msg)))

    def read(self) -> list[fork.Spawn] | None:
        """The requests that came whole (None: the coordinator is gone)."""
        chunk = os.read(self.inp, 65536)
        if not chunk:
            return None
        self.frames.feed(chunk)
        requests = []
        try:
            while (body := self.frames.next()) is not None:
                requests.append(fork.TO_SERVER.parse(decode(body, fork.MAX_REQUEST)))
        except (ContractError, FrameError) as exc:  # the coordinator's own bug: nothing to serve
            sys.stderr.write(f"agentloop fork server: a malformed request ({exc})\n")
            return None
        return requests


def probe() -> None:
    """Make one worker's namespace init as the server would (B and C: unprivileged, in a user
    namespace of their own), let it go, and exit 0 when it was made and ended cleanly; else 1,
    with what was refused on stderr.  ``engine.sandbox.fork_server_problem`` runs it once, in a
    fork server's sandbox, to learn whether this kernel (and its AppArmor policy) allows that."""
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # C comes back to us
    init = _Init(True, (), _find_sleep())
    made = init.pid
    init.discard()  # C reads the end of its request pipe and exits 0, if it got that far
    ok = made is not None
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == made:
            ok = ok and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    os._exit(0 if ok else 1)


def _freeze() -> None:
    """What is imported now is shared with every worker forked after; the collector must not
    write to it (its bookkeeping would copy each page into each worker), so it never looks at
    it again."""
    gc.collect()
    gc.freeze()


def _prepare_workers(first: fork.Spawn) -> None:
    """With the first request for a worker: everything a worker imports, and what each would
    otherwise make for itself — the seccomp filter of its confinement (the runs of a batch
    share it), the installed distributions its system prompt lists (``worker.environment``)
    — made once, before that worker is forked, and shared by every worker forked after."""
    import worker.__main__  # noqa: F401
    import worker._confine
    import worker._memory
    import worker.environment
    import worker.serve  # noqa: F401
    from worker.contract.start import StartSpec

    worker._memory.tune()  # (what workers inherit; after the imports, whose heap it would keep)
    with contextlib.suppress(ContractError):  # (the worker itself says what is wrong with it)
        confine = StartSpec.take(dict(first.env)).confine
        if confine.seccomp is not None:
            worker._confine.seccomp_program(confine.seccomp)
    worker.environment.prepare()
    _freeze()


def serve() -> None:
    from worker.contract.start import StartSpec

    try:
        preload = StartSpec.take().preload
    except ContractError as exc:  # (the coordinator's own bug: nothing to serve)
        sys.stderr.write(f"agentloop fork server: {exc}\n")
        sys.exit(1)
    for name in preload:
        try:
            __import__(name)
        except BaseException as exc:  # noqa: BLE001 - said in one line; the coordinator says the rest
            sys.stderr.write(f"--preload {name}: importing it failed: {type(exc).__name__}: {exc}\n")
            sys.exit(1)
    _freeze()

    wire = _Wire()
    sleep = _find_sleep()
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # workers' inits come back to us
    children: dict[int, object] = {}
    # SIGCHLD wakes select(): the self-pipe turns the signal into a readable fd.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    control = (wire.inp, wire.out, wake_r, wake_w)  # (not a forked child's)
    spare: _Init | None = None  # the next worker's init, made ahead ...
    spare_due: float | None = time.monotonic() + _SPARE_AFTER  # ... once the server is idle this long
    private_net = True  # (as the last request had it)
    runtime = False  # (the worker runtime is imported: ``_prepare_workers``)
    wire.send(fork.Ready(os.getpid()))
    while True:
        wait = None if spare_due is None else max(0.0, spare_due - time.monotonic())
        ready, _, _ = select.select([wire.inp, wake_r], [], [], wait)
        if not ready and spare_due is not None:
            # The next worker's init, made while nothing else happens: most of what a start
            # costs that does not depend on its request.  The coordinator is told its pid, to
            # put it in the next worker's cgroups ahead (the worker is then born inside them).
            spare_due = None
            with contextlib.suppress(OSError):
                spare = _Init(private_net, control, sleep)
                if spare.pid is not None:
                    wire.send(fork.Spare(spare.pid))
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
                    wire.send(fork.Exited(children.pop(pid), pid, _exit_status(status)))
        if wire.inp in ready:
            messages = wire.read()
            if messages is None:
                os._exit(0)  # the coordinator is gone
            for request in messages:
                rid = request.id
                private_net = request.private_net
                if not request.exec and not runtime:  # the first worker: a spare made before lacks it all
                    _prepare_workers(request)
                    runtime = True
                    if spare is not None:
                        spare.discard()
                        spare = None
                init, spare = (spare, None) if spare is not None and spare.private_net == private_net else (None, spare)
                if spare is not None:  # made for another kind of request
                    spare.discard()
                    spare = None
                try:
                    init = init or _Init(private_net, control, sleep)
                except OSError as exc:
                    wire.send(fork.Failed(rid, str(exc)[:2000]))
                    continue
                pid = init.hand_over(request, lambda init_pid, rid=rid: wire.send(fork.Forked(rid, init_pid)))
                if pid is None:
                    wire.send(fork.Failed(rid, "the worker did not start"))
                else:
                    children[pid] = rid
                    wire.send(fork.Spawned(rid, pid))
                spare_due = time.monotonic() + _SPARE_AFTER  # (not while this worker starts)


if __name__ == "__main__":
    serve()
