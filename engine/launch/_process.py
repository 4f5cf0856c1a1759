"""Starting a worker process and killing it with everything it started.

Killing is one small function, run shielded from cancellation, that always reaps.  With a
PID namespace (bubblewrap) the kill is atomic: SIGKILL to the namespace's outer process
takes its init down, and the kernel kills every process in the namespace, daemons that
double-forked or called ``setsid`` included.  Without one, the worker is a child subreaper
(orphans stay below it), and we freeze the whole tree with SIGSTOP until it stops growing,
then SIGKILL all of it: a fork loop cannot outrun a stopped parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
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
    ``command`` is executed (a sample slot)."""

    prefix: list[str]
    command: list[str]
    endpoint: str
    env: dict[str, str]
    cwd: Path
    pid_namespace: bool
    notes: list[str]
    serves_blocks: bool = True

    @property
    def argv(self) -> list[str]:
        return [*self.prefix, *self.command]


class Process:
    """A started worker process; ``stderr_tail`` holds the end of what it said on its own.

    Exit is watched through a pidfd, not ``asyncio.subprocess.Process.wait()``: on Python 3.11
    that waits for the stderr pipe to close too, which a surviving grandchild can hold open.
    """

    def __init__(self, proc: asyncio.subprocess.Process, pid_namespace: bool) -> None:
        self.proc = proc
        self._stderr_task = asyncio.get_running_loop().create_task(self._read_stderr())
        self._init_watch(proc.pid, pid_namespace)

    def _init_watch(self, pid: int, pid_namespace: bool) -> None:
        self.pid = pid
        self.pid_namespace = pid_namespace
        self.stderr_tail = b""
        self._exited = watch_exit(pid)
        self._killing: asyncio.Future[None] | None = None

    def _on_exit(self) -> None:
        if not self._exited.done():
            self._exited.set_result(None)

    async def _read_stderr(self) -> None:
        stream = self.proc.stderr
        if stream is None:
            return
        with contextlib.suppress(Exception):
            while chunk := await stream.read(65536):
                self.stderr_tail = (self.stderr_tail + chunk)[-STDERR_TAIL:]

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

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
        if self._gone():
            pass  # nothing left to signal, and its pid is not ours any more
        elif self.pid_namespace:
            # SIGKILL to the namespace's init (bubblewrap's inner process) takes every process
            # of the namespace with it.  The outer one is killed too, and the inner one
            # directly: it may not have armed its parent-death signal yet.  The outer one is
            # stopped first and its children read once it is, so that it cannot make the inner
            # one between the look and the kill (which would leave that one running for good).
            signal_quietly(self.pid, signal.SIGSTOP)
            await _stopped(self.pid)
            for pid in [*descendants(self.pid), self.pid]:
                signal_quietly(pid, signal.SIGKILL)
        else:
            kill_tree(self.pid)
        try:
            await asyncio.wait_for(self.wait(), timeout)
        except TimeoutError:
            log.error("worker %d did not exit %.0f s after SIGKILL", self.pid, timeout)
        if not self.pid_namespace:
            kill_tree(self.pid, include_root=False)  # stragglers reparented while we waited
        self._on_exit()
        await self._close_pipes()

    async def _close_pipes(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._stderr_task), 0.2)
        self._stderr_task.cancel()
        # A descendant may still hold the stderr pipe open; don't leave the transport to the GC.
        transport = getattr(self.proc, "_transport", None)
        if transport is not None:
            transport.close()


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


async def spawn(argv: Sequence[str], *, env: dict[str, str], cwd: Path,
                pid_namespace: bool) -> Process:
    """Start a worker in its own session, stdin empty, stderr kept for diagnostics."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=str(cwd),
        start_new_session=True,
        close_fds=True,
    )
    return Process(proc, pid_namespace)


async def _stopped(pid: int, timeout: float = 0.5) -> None:
    """Wait, ``timeout`` seconds at most, until process ``pid`` is stopped, a zombie or gone."""
    for _ in range(int(timeout / 0.001)):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in (b"T", b"t", b"Z", b"X"):
            return
        await asyncio.sleep(0.001)


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


def kill_tree(root: int, *, include_root: bool = True, rounds: int = 50) -> None:
    """Freeze the tree below ``root`` until it stops changing, then SIGKILL all of it."""
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
            os.killpg(root, signal.SIGKILL)  # the worker's session leader group, if still there
