"""Starting a sandboxed process and killing it with everything it started.

Every sandboxed process — a worker, a sample slot, a fork server, the tool process, exec's
confiner — is started by ``start`` from its ``Launch`` (the plan's command line, then what runs
inside, its environment and descriptors), and killed by ``kill_tree``.

The kill is one small function that always ends the whole tree.  With a PID namespace
(bubblewrap) it is atomic: SIGKILL to the namespace's init takes it down, and the kernel kills
every process in the namespace, daemons that double-forked or called ``setsid`` included; the
outer process is stopped first and its children read once it is, so that it cannot make the
init between the look and the kill.  Without one, the process is a child subreaper (orphans
stay below it), and the whole tree is frozen with SIGSTOP until it stops growing, then
SIGKILLed: a fork loop cannot outrun a stopped parent.  ``Process.kill`` runs it shielded from
cancellation and always reaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("agentloop")

#: Diagnostics kept from a worker's own stderr (its last words before the capture is up).
STDERR_TAIL = 4096


@dataclass
class Launch:
    """Everything needed to start one sandboxed process: ``prefix``, the sandbox's command line
    (bubblewrap's; empty without it), then ``command``, what runs inside it (agentloop's
    runtime, started by ``sandbox.runtime_argv``).  ``endpoint``: where the process connects;
    ``serves_blocks``: it is a worker (a fork server's child can serve in place), else its
    ``command`` is executed (a sample slot).  ``stdin``, ``stdout``, ``stderr``, ``pass_fds``:
    its descriptors, as ``subprocess.Popen`` takes them (by default nothing in, nothing out,
    stderr kept for diagnostics); ``preexec``: run in the child before it executes (entering
    cgroups)."""

    prefix: list[str]
    command: list[str]
    endpoint: str
    env: dict[str, str]
    cwd: Path
    pid_namespace: bool
    notes: list[str] = field(default_factory=list)
    serves_blocks: bool = True
    stdin: int | None = subprocess.DEVNULL
    stdout: int | None = subprocess.DEVNULL
    stderr: int | None = subprocess.PIPE
    pass_fds: tuple[int, ...] = ()
    preexec: Callable[[], None] | None = None

    @property
    def argv(self) -> list[str]:
        return [*self.prefix, *self.command]


def start(launch: Launch) -> subprocess.Popen:
    """Start ``launch``'s process, in a session of its own, with no descriptor of ours but those
    it is given: the one place a sandboxed process is executed.  OSError when it cannot be."""
    return subprocess.Popen(launch.argv, stdin=launch.stdin, stdout=launch.stdout, stderr=launch.stderr,
                            env=launch.env, cwd=str(launch.cwd), start_new_session=True, close_fds=True,
                            pass_fds=launch.pass_fds, preexec_fn=launch.preexec)


class Process:
    """A started sandboxed process, as the event loop watches it; ``stderr_tail`` holds the end
    of what it said on its own.  Exit is watched through a pidfd and the status reaped from it."""

    def __init__(self, proc: subprocess.Popen, pid_namespace: bool) -> None:
        self.proc = proc
        self._init_watch(proc.pid, pid_namespace, proc.stderr.fileno() if proc.stderr is not None else None)

    def _init_watch(self, pid: int, pid_namespace: bool, stderr: int | None) -> None:
        """Watch process ``pid``'s exit, and keep the end of what it writes to ``stderr`` (the
        read end of a pipe or fifo that is its stderr, which this handle closes)."""
        self.pid = pid
        self.pid_namespace = pid_namespace
        self.stderr_tail = b""
        self._exited = watch_exit(pid)
        self._killing: asyncio.Future[None] | None = None
        self._stderr_fd = stderr
        if stderr is not None:
            os.set_blocking(stderr, False)
            asyncio.get_running_loop().add_reader(stderr, self._read_stderr)

    def _on_exit(self) -> None:
        if not self._exited.done():
            self._exited.set_result(None)

    def _read_stderr(self) -> None:
        fd = self._stderr_fd
        if fd is None:
            return
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self.stderr_tail = (self.stderr_tail + chunk)[-STDERR_TAIL:]
        else:  # every writer is gone
            self._stop_reading()

    def _stop_reading(self) -> None:
        fd, self._stderr_fd = self._stderr_fd, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            if self.proc is None:  # (a pipe of Popen's is closed with its other pipes)
                with contextlib.suppress(OSError):
                    os.close(fd)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self._exited.done() else self.proc.returncode

    async def wait(self) -> int:
        """The exit status, once the process has exited (its own children may live on)."""
        await asyncio.shield(self._exited)
        # Whoever reaps it (the child watcher, the fork server) reports the status a moment later.
        for _ in range(1000):
            if self.returncode is not None:
                return self.returncode
            await asyncio.sleep(0.001)
        return -signal.SIGKILL

    async def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the worker and every process it started; reap it.  Idempotent: every call
        after the first waits for that one (signalling a pid again could hit a process that
        was given the pid since)."""
        if self._killing is None:
            self._killing = asyncio.ensure_future(self._kill(timeout))
        await asyncio.shield(self._killing)

    def _gone(self) -> bool:
        """The root of the tree has exited: its pid may be another process's by now, and with a
        PID namespace nothing of the tree is left."""
        return self._exited.done()

    async def _kill(self, timeout: float) -> None:
        if not self._gone():  # (gone: nothing left to signal, and its pid is not ours any more)
            for _ in _kill_steps(self.pid, self.pid_namespace):
                await asyncio.sleep(0.001)
        try:
            await asyncio.wait_for(self.wait(), timeout)
        except TimeoutError:
            log.error("process %d did not exit %.0f s after SIGKILL", self.pid, timeout)
        if not self.pid_namespace:
            for _ in _kill_steps(self.pid, False, include_root=False):  # stragglers reparented meanwhile
                await asyncio.sleep(0.001)
        self._on_exit()
        await self._close_pipes()

    async def _close_pipes(self) -> None:
        self._read_stderr()  # what it said last, already in the pipe
        self._stop_reading()
        # A descendant may still hold the stderr pipe open: ours is closed all the same.  (Its
        # stdin and stdout, when pipes, are whoever connected them: ``pipes``.)
        if self.proc is not None and self.proc.stderr is not None:
            with contextlib.suppress(OSError):
                self.proc.stderr.close()


class Descendant(Process):
    """A process below one of ours that is not our child (a fork of a worker, see
    ``Worker.fork``): its exit is watched through a pidfd, its status read from its zombie
    (its parent reaps it a moment later), and a kill ends its tree as any tree without a PID
    namespace of its own ends."""

    def __init__(self, pid: int) -> None:
        self.proc = None
        self._status: int | None = None
        self._init_watch(pid, False, None)
        self._exited.add_done_callback(self._read_status)

    def _read_status(self, _: asyncio.Future) -> None:
        if self._status is None:
            self._status = zombie_status(self.pid)

    @property
    def returncode(self) -> int | None:
        return self._status


def zombie_status(pid: int) -> int:
    """The exit status (as a shell's $?) of a process that has exited but is not reaped; a
    process already gone was killed with its namespace (or reaped): 128 + SIGKILL."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 128 + 9
    if fields[0] not in (b"Z", b"X") or len(fields) < 50:
        return 128 + 9
    status = int(fields[49])  # field 52, exit_code: as waitpid(2) reports it
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def nspids(pid: int) -> tuple[int, ...]:
    """Process ``pid``'s pid in each PID namespace it is in, outermost first (``NSpid`` of
    ``/proc/PID/status``); empty when it is gone or the kernel does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return tuple(int(n) for n in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def find_below(root: int, nspid: int, level: int = -1) -> int | None:
    """The host pid of the process below ``root`` whose pid at ``level`` of its PID namespaces
    (``nspids``; default the innermost) is ``nspid``; None if there is none."""
    for pid in descendants(root):
        ids = nspids(pid)
        if len(ids) > (level if level >= 0 else -level - 1) and ids[level] == nspid:
            return pid
    return None


def watch_exit(pid: int) -> asyncio.Future[None]:
    """A future that is done once process ``pid`` has exited (at once if it is gone), watched
    through a pidfd that is closed when the future is done, whoever completes it."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        exited.set_result(None)
        return exited
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))

    def release(_: asyncio.Future) -> None:
        loop.remove_reader(fd)
        os.close(fd)

    exited.add_done_callback(release)
    return exited


async def pipes(proc: subprocess.Popen) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Callable[[], None]]:
    """The event loop's streams on a started process's stdout and stdin (both pipes), and what
    closes both: the streams own the pipes from here on."""
    assert proc.stdout is not None and proc.stdin is not None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    read_end, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, proc.stdin)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)

    def close() -> None:
        writer.close()
        read_end.close()

    return reader, writer, close


def spawn(launch: Launch) -> Process:
    """Start ``launch``'s process (``start``) and watch it from the running event loop."""
    return Process(start(launch), launch.pid_namespace)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped, a zombie or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"T", b"t", b"Z", b"X")


def signal_quietly(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``; a process already gone, or not ours to signal, is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: parse after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _children(pid: int) -> list[int]:
    """The live children of process ``pid``, of every thread of it (``/proc/PID/task/TID/children``:
    a few small reads instead of a look at every process of the machine)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone
    found: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += map(int, f.read().split())
        except OSError:
            continue  # a thread that ended meanwhile
    return found


#: Whether the kernel lists each task's children (CONFIG_PROC_CHILDREN); else every process is read.
_CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren, ...)."""
    tree = None if _CHILDREN_FILES else _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in _children(pid) if tree is None else tree.get(pid, ()):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(root: int, *, pid_namespace: bool, include_root: bool = True) -> None:
    """SIGKILL the process ``root`` and everything it started (see the module docstring), from a
    thread that may wait for it: the kill of every sandboxed process.  ``pid_namespace``: ``root``
    is the outer process of a PID namespace of its own (bubblewrap's); ``include_root=False``:
    only what lives below it (stragglers, after it was reaped)."""
    for _ in _kill_steps(root, pid_namespace, include_root=include_root):
        time.sleep(0.001)


def _kill_steps(root: int, pid_namespace: bool, *, include_root: bool = True, rounds: int = 50,
                patience: int = 500) -> Iterator[None]:
    """The kill, one step at a time: yields where it waits a moment for a stopped process (at most
    ``patience`` times), so that a thread sleeps and an event loop awaits between steps."""
    if pid_namespace:
        # SIGKILL to the namespace's init (bubblewrap's inner process) takes every process of the
        # namespace with it.  The outer one is killed too, and the inner one directly: it may not
        # have armed its parent-death signal yet.
        signal_quietly(root, signal.SIGSTOP)
        for _ in range(patience):
            if stopped(root):
                break
            yield
        for pid in [*descendants(root), *([root] if include_root else [])]:
            signal_quietly(pid, signal.SIGKILL)
        return
    frozen: set[int] = set()
    if include_root:
        signal_quietly(root, signal.SIGSTOP)
        frozen.add(root)
    for _ in range(rounds):
        found = set(descendants(root)) - frozen
        if not found:
            break
        for pid in found:
            signal_quietly(pid, signal.SIGSTOP)
        frozen |= found
    for pid in frozen:
        signal_quietly(pid, signal.SIGKILL)
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)  # the process's session leader group, if still there
