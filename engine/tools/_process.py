"""The coordinator's handle on one tool process (``worker.tool_server``): start, ask, kill.

What it guarantees: a request never holds the coordinator longer than its deadline (the
process is SIGKILLed past it, and started afresh by the next request); a reply is read in
bounded frames (``contract.tools.MAX_REPLY``), so whatever the tools meet costs the coordinator at most one
such frame of memory; no process is left behind — ``close()``, the garbage collector and the
coordinator's exit (a ``weakref.finalize``) kill it, and its PR_SET_PDEATHSIG kills it when
the coordinator dies.

Requests are served one at a time (a lock); a caller waits for the lock at most ``queue_wait``.
The waits are on pipes with ``poll``, in the caller's thread: host functions run in a thread
(``asyncio.to_thread``), so the event loop is never blocked by a tool.
"""

from __future__ import annotations

import concurrent.futures
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from engine.environment import ALLOWLIST, environment
from engine.errors import ToolBusy, ToolClosed, ToolCrash, ToolTimeout
from engine.launch import Launch, kill_tree, start
from engine.sandbox import runtime_argv, tools_plan
from worker.contract import tools
from worker.contract.confinement import Confinement, Landlock, Seccomp, landlock_abi, seccomp_supported
from worker.contract.framing import FrameError, decode_json, encode_json, frame, read_frame_before
from worker.contract.schema import ContractError
from worker.contract.start import TOOLS

#: Seconds a fresh tool process may take to start and confine itself.
STARTUP_TIMEOUT = 20.0
#: The tool process's CPU limit (seconds, its whole life); it is replaced before its requests'
#: wall time, an upper bound of the CPU it used, could reach it.
CPU_SECONDS = 600
#: Limits of the tool process.  DATA bounds what a request can make it allocate; NOFILE
#: leaves room for a walk's descriptors; FSIZE 0: it writes no file, ever.
MEMORY_BYTES = 512 << 20
OPEN_FILES = 256


def confinement(root: str, cpu_seconds: int = CPU_SECONDS) -> Confinement:
    """What the tool process applies to itself: read-only beneath ``root``, no network, no
    privilege; Landlock and seccomp where this kernel has them."""
    return Confinement(
        rlimits=(("DATA", MEMORY_BYTES, MEMORY_BYTES), ("CPU", cpu_seconds, cpu_seconds + 1),
                 ("FSIZE", 0, 0), ("NOFILE", OPEN_FILES, OPEN_FILES), ("CORE", 0, 0)),
        drop_caps=True, no_new_privs=True,
        landlock=Landlock(ro=(root,), scope=True, deny_tcp=True) if landlock_abi() >= 1 else None,
        seccomp=Seccomp(socket_families=(), lock_session=True) if seccomp_supported() else None)


# Every tool process is started from this one thread: PR_SET_PDEATHSIG fires when the thread
# that started a process ends, and the threads calling tools (asyncio.to_thread's) may end
# long before the coordinator does.  This one ends with the interpreter.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentloop-tools")


class ToolProcess:
    """One tool process serving ``root`` (resolved), with ``exclude`` (component lists below
    the root) never shown; started on the first request."""

    def __init__(self, root: str, exclude: list[list[str]], queue_wait: float = 60.0) -> None:
        self.root = root
        self.exclude = exclude
        self.queue_wait = queue_wait
        self.layers: list[str] = []  # the confinement layers the running process applied
        self._plan = tools_plan(root, sys.executable, confinement(root))  # a view of root alone, if usable
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._busy = 0.0  # seconds of requests served by the current process
        self._closed = False
        # Kills the process when this handle is collected, and at the coordinator's exit
        # (finalizers run then too).
        self._finalizer = weakref.finalize(self, _kill_quietly, [None, False])

    @property
    def pid(self) -> int | None:
        """The running tool process's pid, or None when none runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def request(self, msg: tools.Request, timeout: float) -> tools.Message:
        """Send ``msg`` and return the reply.  Raises ToolTimeout past ``timeout`` seconds (the
        process is then killed), ToolCrash when the process dies or misbehaves, ToolBusy when
        the lock was not free within ``queue_wait``, ToolClosed after ``close()``."""
        if not self._lock.acquire(timeout=self.queue_wait):
            raise ToolBusy
        try:
            if self._closed:
                raise ToolClosed
            if self._proc is not None and (self._proc.poll() is not None
                                           or self._busy + timeout > CPU_SECONDS * 0.8):
                self._stop()
            if self._proc is None:
                self._start()
            started = time.monotonic()
            try:
                self._send(frame(encode_json(msg)), started + timeout)
                return self._receive(started + timeout)
            except ToolTimeout:
                self._stop()
                raise
            except ToolCrash as exc:
                why = self._stop()
                raise ToolCrash(f"{exc}{why}") from None
            finally:
                self._busy += time.monotonic() - started
        finally:
            self._lock.release()

    def close(self) -> None:
        """Kill the process (if any) and refuse further requests.  Idempotent and quick: a
        request in flight is ended by the kill (its caller reads a ToolCrash)."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:  # without the lock: it may be held by that request
            kill_tree(proc.pid, pid_namespace=self._plan.pid_namespace)
        got = self._lock.acquire(timeout=self.queue_wait)
        try:
            self._stop()
        finally:
            if got:
                self._lock.release()

    # -- the process ----------------------------------------------------------------------

    def _start(self) -> None:
        # The allowlist alone (no run's env_allow: its code is ours), and -I ignores PYTHON*.
        env = environment(ALLOWLIST)
        # Isolated, without site-packages (not even their .pth files), the runtime by its absolute
        # path; in a session of its own: Ctrl-C at the terminal is the coordinator's business.
        launch = Launch(self._plan.argv_prefix, runtime_argv(sys.executable, TOOLS, site=False), "", env,
                        Path("/"), self._plan.pid_namespace, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            proc = _spawner.submit(start, launch).result(timeout=STARTUP_TIMEOUT)
        except (OSError, RuntimeError, concurrent.futures.TimeoutError) as exc:
            raise ToolCrash(f"the tool process could not start: {exc}") from None
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdin.fileno(), False)
        self._proc = proc
        self._busy = 0.0
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill_quietly, [proc, launch.pid_namespace])
        deadline = time.monotonic() + STARTUP_TIMEOUT
        try:
            # Inside bubblewrap's PID namespace the parent is its init; bwrap dies with us.
            init = tools.Init(self.root, tuple(tuple(e) for e in self.exclude),
                              0 if self._plan.pid_namespace else os.getpid(), self._plan.confine)
            self._send(frame(encode_json(init)), deadline)
            reply = self._receive(deadline)
        except (ToolTimeout, ToolCrash) as exc:
            why = self._stop()
            raise ToolCrash(f"the tool process could not start: {exc}{why}") from None
        if not isinstance(reply, tools.Ready):
            self._stop()
            said = reply.error if isinstance(reply, tools.Fatal) else f"it said {reply.kind!r}"
            raise ToolCrash(f"the tool process could not confine itself: {said}")
        self.layers = list(reply.layers)

    def _stop(self) -> str:
        """Kill and reap the process; returns what it said on stderr, as '' or ' (how: text)'."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        _kill(proc, self._plan.pid_namespace)
        said = ""
        if proc.stderr is not None and proc.returncode is not None:  # dead: all it said is in the pipe
            try:
                os.set_blocking(proc.stderr.fileno(), False)
                said = (proc.stderr.read(4000) or b"").decode(errors="replace").strip()
            except (OSError, ValueError):
                pass
        _kill_quietly([proc, self._plan.pid_namespace])  # closes the pipes
        code = proc.returncode
        status = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return f" ({status}{': ' + said.splitlines()[-1] if said else ''})"

    # -- frames ---------------------------------------------------------------------------

    def _send(self, data: bytes, deadline: float) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        fd = proc.stdin.fileno()
        view = memoryview(data)
        while view:
            _wait(fd, select.POLLOUT, deadline)
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError as exc:  # EPIPE: it died
                raise ToolCrash(f"the tool process is gone ({exc.strerror})") from None

    def _receive(self, deadline: float) -> tools.Message:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        try:
            body = read_frame_before(proc.stdout.fileno(), tools.MAX_REPLY, deadline)
            if body is None:
                raise ToolCrash("the tool process died")
            return tools.TO_COORDINATOR.parse(decode_json(body, tools.MAX_REPLY))
        except TimeoutError:
            raise ToolTimeout from None
        except (ContractError, FrameError) as exc:
            raise ToolCrash(f"the tool process sent a malformed reply: {exc}") from None


def _wait(fd: int, event: int, deadline: float) -> None:
    poller = select.poll()
    poller.register(fd, event)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ToolTimeout
        if poller.poll(max(1, int(left * 1000 + 0.999))):  # rounds up: never a busy loop
            return


def _kill(proc: subprocess.Popen[bytes], pid_namespace: bool) -> None:
    """SIGKILL ``proc`` with its tree and reap it (bounded: SIGKILL cannot be caught)."""
    if proc.poll() is None:
        kill_tree(proc.pid, pid_namespace=pid_namespace)
        try:
            proc.wait(timeout=10)  # only a sleep in the kernel (a hung file system) delays it
        except subprocess.TimeoutExpired:
            pass


def _kill_quietly(box: list) -> None:
    """Kill and reap the process in ``box`` (a list of it and whether it has a PID namespace, so
    a finalizer need not hold the handle's owner) and close its pipes."""
    proc, pid_namespace = box
    if proc is None:
        return
    _kill(proc, pid_namespace)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
