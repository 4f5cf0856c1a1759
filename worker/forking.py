"""A live worker forked into copies of itself (the ``fork`` request).

Each copy is what ``os.fork()`` in the worker makes — the whole namespace, every import and
every loaded byte, shared copy-on-write — and then becomes a worker of its own: it dials the
endpoint the coordinator made for it, says hello with its own token, and serves (see
``serve.Crew.become_fork``).  A copy lives where its parent lives, confined as it is: in its
sandbox, with its uid, Landlock rules and seccomp filter (the request gives it nothing the
code could not have made with ``os.fork()`` itself), so copies share with their parent and
with each other what processes of one sandbox share: its /tmp, its workspace, its network
namespace (ports) and its /proc.  Variables, output, deadlines and kills are their own, and
so is a Landlock domain (``_confine.separate``) that keeps a copy's signals, ptrace and
abstract sockets from its parent and its siblings.

``fork()`` copies only the thread that calls it, so what runs in another thread cannot be
copied: a fork is refused, in words that say what to stop, while a thread the code started
is alive, a task on its event loop is pending, or a process it started lives.  Open files
are inherited as ``fork()`` inherits them (a file's offset is shared with the parent).

The forks are made by one thread kept for them (``_Forker``): a copy's parent-death signal
belongs to the thread that forked it, and this one lives as long as the process.  It also
reaps the copies that ended (after the coordinator has read their status).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import resource
import signal
import stat
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["close_descriptors", "die_with_parent", "discard", "forget_forker", "forker", "own_descriptors", "refusal",
           "reseed", "runtime_children"]

_PR_SET_PDEATHSIG = 1
_REAP_EVERY = 1.0  # seconds between looks for copies that ended
_LOW_FDS = 1024  # descriptors looked at where /proc/self/fd cannot be read


def own_descriptors() -> dict[int, tuple[int, int]]:
    """The descriptors open now (beyond 0, 1 and 2) and what each is (device, inode): taken
    before any user code runs, they are the runtime's own, which a copy closes."""
    try:
        numbers = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # (a sandbox that does not show /proc: the runtime's are opened early, low)
        numbers = list(range(_LOW_FDS))
    found = {}
    for fd in numbers:
        if fd > 2:
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                found[fd] = (st.st_dev, st.st_ino)
    return found


def close_descriptors(own: dict[int, tuple[int, int]]) -> None:
    """Close the runtime's descriptors of ``own`` that are still what they were (a number the
    runtime closed and the code's files reuse is the code's, and stays open)."""
    for fd, ident in own.items():
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == ident and not stat.S_ISREG(st.st_mode):
                os.close(fd)


def _children() -> list[int]:
    """This process's live children (zombies left out)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    live = []
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                live.append(pid)
    return live


def runtime_children() -> set[int]:
    """The children this process has before any user code runs (the egress forwarder's)."""
    return set(_children())


def _command(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        words = f.read(200).split(b"\0")[:3]
        text = " ".join(w.decode("utf-8", "replace") for w in words if w)
        return "".join(c if c.isprintable() else "?" for c in text)[:80]
    return "?"


def refusal(running: list[str], caller: str | None, pending: list[str], own_children: set[int],
            idle: frozenset[int] = frozenset(), n: int = 1) -> str | None:
    """Why this process cannot be forked into ``n`` copies now, in words that say what to stop
    first; None when it can.  ``running``: the blocks that run (``caller``, the block asking,
    may); ``pending``: the user loop's tasks that are not done; ``own_children``: the runtime's
    own processes; ``idle``: threads (idents) a copy does without (the user loop's default
    executor's, whose loop a copy replaces)."""
    others = [b for b in running if b != caller]
    if others:
        return (f"block {', '.join(map(repr, others[:5]))} is still running: a worker forks between blocks; "
                "wait for it (or cancel it) and fork again")
    threads = [t for t in threading.enumerate()
               if t is not threading.main_thread() and t.is_alive() and t.ident not in idle]
    if threads:
        names = ", ".join(repr(t.name) for t in threads[:5])
        return (f"thread {names} of the code is still running, and a fork copies only the thread that "
                "forks: join it (or let it end) and fork again")
    if pending:
        return (f"task {', '.join(pending[:5])} is pending on the worker's event loop, whose thread a "
                "fork does not copy: await it or cancel it, and fork again")
    alive = [p for p in _children() if p not in own_children and p not in _forker_children()]
    if alive:
        named = ", ".join(f"{pid} ({_command(pid)})" for pid in alive[:5])
        return (f"process {named} started by the code is still alive, and would be shared by the copies: "
                "wait for it (or kill it) and fork again")
    return _over_limit(n)


def _over_limit(n: int) -> str | None:
    """Where a process limit (RLIMIT_NPROC, threads included) is shared by this worker and its
    copies — a plain user's worker, which has no pids cgroup of its own — whether ``n`` more
    copies would pass it: each starts about as many threads as this process runs now.  A copy
    that could not start its threads would die at birth; this says it first."""
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        each = len(os.listdir("/proc/self/task"))
    except OSError:
        return None
    copies = len(_forker_children())
    room = max(0, (soft - each - 2) // each - copies)  # (this process, its forking thread, the init)
    if n <= room:
        return None
    return (f"{n} {'copy' if n == 1 else 'copies'} would pass the worker's process limit ({soft} processes and threads, shared with "
            f"its copies: RLIMIT_NPROC, there being no pids cgroup of its own), each running about {each} "
            f"threads beside its {copies} live copies: fork at most {room} now, or close copies first")


def reseed() -> None:
    """A copy's own random streams: ``random``'s and numpy's global generator (when loaded) are
    seeded again from the kernel (``secrets`` and ``os.urandom`` read the kernel already)."""
    import random

    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            numpy_random.seed()


def die_with_parent(parent: int) -> None:
    """A copy ends with the worker it was forked from (its signal fires when the forking
    thread, which lives as long as that process, ends)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(70)


class _Forker:
    """The thread that forks: jobs go to it by ``run`` and come back as their value."""

    def __init__(self) -> None:
        self.children: set[int] = set()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], list[int]], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="agentloop-forker", daemon=True).start()

    def run(self, job: Callable[[], list[int]]) -> list[int]:
        future: Future = Future()
        self._jobs.put((job, future))
        return future.result()

    def _serve(self) -> None:
        while True:
            try:
                job, future = self._jobs.get(timeout=_REAP_EVERY if self.children else None)
            except queue.Empty:
                self._reap()
                continue
            try:
                pids = job()
            except BaseException as exc:  # noqa: BLE001 - the caller's to say
                future.set_exception(exc)
            else:
                self.children.update(pids)
                future.set_result(pids)
            self._reap()

    def _reap(self) -> None:
        """Reap the copies that ended, a moment after the coordinator (which watches each by a
        pidfd) read their status from the zombie."""
        for pid in list(self.children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.children.discard(pid)


def discard(pids: list[int]) -> None:
    """Kill and reap copies made by a fork that failed half-way."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


_forker: _Forker | None = None
_forker_lock = threading.Lock()


def forker() -> _Forker:
    """The process's forking thread, started on first use."""
    global _forker
    with _forker_lock:
        if _forker is None:
            _forker = _Forker()
        return _forker


def _forker_children() -> set[int]:
    return set(_forker.children) if _forker is not None else set()


def forget_forker() -> None:
    """In a copy: the parent's forking thread is not here (the next fork starts one)."""
    global _forker, _forker_lock
    _forker, _forker_lock = None, threading.Lock()
