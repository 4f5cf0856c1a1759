"""``agentloop exec FILE``: run ``python FILE ARGS`` in its sandbox, and be it for whoever started us.

The program's standard streams are ours, passed straight through: a pipe, a file or
``/dev/null`` reaches it as the very descriptor we were given, so ``| head``, ``2>&1``,
buffering, binary streams and the order of a child's output against the script's own are
python's, and agentloop itself never writes to stdout.  A stream that is a terminal is a pty
of the script's own instead (``engine.exec``).  What the sandbox and its first process
(``worker.confiner``) say goes to pipes of ours (``worker.contract.confiner``), never to the
script's stderr.

How it ends is python's: the confiner reports the program's wait status exactly, and this
process exits with the same code, or dies of the same signal (core dumps off, as ``timeout(1)``
does), so a shell shows 128+N and a parent sees -N.  Signals sent to this process reach the
program: those a terminal sends to its foreground group (SIGINT, SIGQUIT, SIGHUP) go to the
program's process group, the others (SIGTERM, SIGUSR1, ...) to the program alone; Ctrl-Z
stops the program and then this process, and ``fg`` continues both.  A deadline
(``--timeout``) is kept here as ``timeout(1)`` keeps it: SIGTERM to the program's group, the
sandbox killed after the grace, exit 124.  A program the kernel killed for its memory limit is
said to be so.
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.exec._plan import ScriptPlan
from engine.exec._terminal import TerminalRelay
from engine.launch import Launch, WorkerCgroups, kill_tree, start
from engine.sandbox import SandboxPolicy, runtime_argv
from worker.contract.confiner import (
    MAX_MESSAGE,
    TO_COORDINATOR,
    Exited,
    Failed,
    Killed,
    Setup,
    Signal,
    Stopped,
)
from worker.contract.framing import FrameBuffer, decode_json, encode_json, frame, write_all
from worker.contract.schema import ContractError
from worker.contract.start import CONFINER

__all__ = ["ScriptCgroups", "ScriptResult", "inherited_ignored", "run_script"]

#: Signals relayed to the program's process group, as a terminal sends them to its foreground job.
_TO_GROUP = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
#: Signals relayed to the program alone, as ``kill PID`` sends them.
_TO_PROGRAM = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
#: Job control and the terminal's size.
_OTHERS = (signal.SIGTSTP, signal.SIGCONT, signal.SIGWINCH)
#: Inherited dispositions worth passing on: those a shell or ``nohup`` may have set to ignore.
_IGNORABLE = (*_TO_GROUP, *_TO_PROGRAM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_DIAGNOSTICS_LIMIT = 16 * 1024  # bytes kept of what the sandbox itself says


def inherited_ignored() -> list[int]:
    """The signals this process inherited as ignored (``nohup``, a background job of a
    non-interactive shell): the program gets them ignored too, as from a shell.  Call before
    installing handlers (SIGPIPE cannot be told: Python ignores it at start, as the program will)."""
    return [int(s) for s in _IGNORABLE if signal.getsignal(s) == signal.SIG_IGN]


@dataclass
class ScriptResult:
    """How the script ended.  ``status``: ``ok`` (exit 0), ``error`` (another exit status),
    ``timeout``, ``killed`` (over its memory limit), ``died`` (a signal), or ``failed``: the
    sandbox could not run it (agentloop's own error, 125); ``exit_code``: what a shell shows
    (N, 128+N, 124); ``message``: agentloop's one line, "" when the script's own ending says
    it all."""

    status: str
    exit_code: int
    signal: int | None
    duration_s: float
    message: str = ""


class ScriptCgroups:
    """A memory and a pids cgroup for one script, where this process may make them (root, or
    a delegated subtree): its limits then bound the whole sandbox, shared memory included."""

    def __init__(self, policy: SandboxPolicy) -> None:
        self._parents: list[WorkerCgroups] = []
        self.groups: list[Path] = []
        self.memory: Path | None = None
        self._memory_parent: WorkerCgroups | None = None
        if policy.mode == "none":
            return
        for controller, limit in (("memory", policy.memory_bytes), ("pids", policy.max_processes)):
            parent = WorkerCgroups.find("exec", controller)
            group = parent.make("script", limit) if parent is not None else None
            if group is None:
                if parent is not None:
                    parent.close()
                continue
            self._parents.append(parent)
            self.groups.append(group)
            if controller == "memory":
                self.memory, self._memory_parent = group, parent

    @property
    def pids(self) -> bool:
        return len(self.groups) > (self.memory is not None)

    def join(self) -> None:
        """In the sandbox's first process, before it runs anything: everything it starts is
        born inside."""
        for group in self.groups:
            (group / "cgroup.procs").write_text("0")

    def oom_killed(self) -> bool:
        return self.memory is not None and self._memory_parent.oom_killed(self.memory)

    def close(self) -> None:
        for parent in self._parents:
            parent.close()


@dataclass
class _Run:
    """The state of one run, as the loop sees it."""

    ended: tuple[str, int] | None = None  # ("exit", N) or ("signal", N), as the confiner reported
    error: str = ""  # the confiner could not start the program
    stopped: bool = False
    timed_out: bool = False
    killed: bool = False  # by us, after the grace
    gone: bool = False  # the sandbox's first process was reaped
    diagnostics: bytearray = field(default_factory=bytearray)
    status: FrameBuffer = field(default_factory=lambda: FrameBuffer(MAX_MESSAGE))


def run_script(plan: ScriptPlan, program: list[str], env: dict[str, str], *, python: str,
               timeout: float | None = None, grace: float = 5.0, allow_sgr: bool = False,
               stdout: int = 1, ignored: list[int] | tuple[int, ...] = (),
               cgroups: ScriptCgroups | None = None) -> ScriptResult:
    """Run ``program`` (``[python, FILE, *ARGS]``) as ``plan`` says and wait for its end.

    ``stdout``: our descriptor the program's fd 1 is (``--json`` gives it our stderr);
    ``ignored``: the signals the program starts with ignored (``inherited_ignored``)."""
    started = time.monotonic()
    sources = {0: 0, 1: stdout, 2: 2}
    relays = _relays(sources, allow_sgr)
    given = {fd: (relays[fd].slave if fd in relays else _usable(src)) for fd, src in sources.items()}
    status_r, status_w = os.pipe()
    control_r, control_w = os.pipe()
    diag_r, diag_w = os.pipe()
    program_err = os.dup(given[2]) if given[2] is not None else os.open(os.devnull, os.O_WRONLY)
    setup = Setup(plan.confine, status_w, control_r, program_err,
                  next((fd for fd in (0, 1) if fd in relays), program_err) if relays else None,
                  tuple(ignored), 0 if plan.pid_namespace else os.getpid(), env.get("LC_CTYPE"), plan.egress)
    # site=False: not even site-packages' .pth files run before the program's own interpreter.
    boot = runtime_argv(python, CONFINER, encode_json(setup).decode("ascii"), *program, site=False)
    if plan.tmpdir:  # no private /tmp (no bubblewrap): one in the workspace
        env = {**env, "TMPDIR": plan.tmpdir}
    handled = (*_TO_GROUP, *_TO_PROGRAM, *_OTHERS)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    previous = {sig: signal.signal(sig, _noted) for sig in handled if sig not in ignored}
    old_wakeup = signal.set_wakeup_fd(wake_w)
    run = _Run()
    try:
        launch = Launch(plan.argv_prefix, boot, "", env, Path(plan.cwd), plan.pid_namespace, list(plan.notes),
                        stdin=given[0], stdout=given[1], stderr=diag_w, pass_fds=(status_w, control_r, program_err),
                        preexec=cgroups.join if cgroups is not None and cgroups.groups else None)
        try:
            proc = start(launch)
        except OSError as exc:
            return ScriptResult("failed", 125, None, 0.0, f"cannot start the sandbox: {exc.strerror or exc}")
        finally:
            for fd in (status_w, control_r, diag_w, program_err):
                os.close(fd)
            for relay in set(relays.values()):
                relay.close_slave()
        _loop(proc, plan.pid_namespace, run, list(dict.fromkeys(relays.values())), status_r, control_w, diag_r,
              wake_r, timeout, grace)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for relay in dict.fromkeys(relays.values()):
            relay.drain()
            relay.close()
        for fd in (status_r, control_w, diag_r, wake_r, wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
    return _result(run, time.monotonic() - started, timeout, grace, cgroups)


def _relays(sources: dict[int, int], allow_sgr: bool) -> dict[int, TerminalRelay]:
    """A pty for each terminal among the program's streams (one for the streams that share a
    terminal, as stdout and stderr at a shell do), by the program's fd."""
    by_device: dict[int, TerminalRelay] = {}
    relays = {}
    for fd in (1, 2, 0):  # (the first stream on a terminal is where that pty's output goes)
        source = sources[fd]
        if not _isatty(source):
            continue
        device = os.fstat(source).st_rdev
        if device not in by_device:
            by_device[device] = TerminalRelay(source, source, None, allow_sgr=allow_sgr, encoding=_encoding())
        relays[fd] = by_device[device]
    if 0 in relays:
        relays[0].keyboard = sources[0]
        relays[0].raw()  # early: what is typed from now on is echoed once, by the script's pty
    return relays


def _noted(signum, frame) -> None:
    """The handler of a relayed signal: the wakeup descriptor carries it to the loop."""


def _loop(proc: subprocess.Popen, pid_namespace: bool, run: _Run, relays: list[TerminalRelay], status: int,
          control: int, diagnostics: int, wake: int, timeout: float | None, grace: float) -> None:
    """Until the sandbox has ended and said all it had to: relay, keep the deadline."""
    sel = selectors.DefaultSelector()
    pidfd = os.pidfd_open(proc.pid)
    for fd in (status, diagnostics, wake, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    masters = {relay.master: relay for relay in relays}
    keyboards = {relay.keyboard: relay for relay in relays if relay.keyboard is not None}
    for fd in (*masters, *keyboards):
        sel.register(fd, selectors.EVENT_READ)
    open_pipes = {status, diagnostics}
    deadline = None if timeout is None else time.monotonic() + timeout
    kill_at = None

    def tell(to: str, sig: int) -> None:
        with contextlib.suppress(OSError):
            write_all(control, frame(encode_json(Signal(to, int(sig)))))

    try:
        while not run.gone or open_pipes:
            now = time.monotonic()
            if deadline is not None and now >= deadline and not run.timed_out and run.ended is None:
                run.timed_out, kill_at = True, now + grace
                tell("group", signal.SIGTERM)
                tell("group", signal.SIGCONT)  # (a stopped script takes its SIGTERM too)
            if kill_at is not None and now >= kill_at and not run.gone:
                run.killed, kill_at = True, None
                _kill(proc, pid_namespace)
            wait = [t - now for t in (deadline if not run.timed_out else None, kill_at) if t is not None]
            for key, events in sel.select(max(0.0, min(wait)) if wait else None):
                fd = key.fd
                if fd == pidfd:
                    proc.wait()
                    run.gone = True
                    sel.unregister(pidfd)
                elif fd == status:
                    if not _read_status(status, run):
                        open_pipes.discard(status)
                        sel.unregister(status)
                    if run.stopped:
                        _stop_here(relays)
                        run.stopped = False
                elif fd == diagnostics:
                    data = os.read(diagnostics, 4096)
                    if not data:
                        open_pipes.discard(diagnostics)
                        sel.unregister(diagnostics)
                    run.diagnostics += data
                    del run.diagnostics[:-_DIAGNOSTICS_LIMIT]
                elif fd == wake:
                    _signals(os.read(wake, 256), relays, tell)
                elif fd in masters:
                    relay = masters[fd]
                    if events & selectors.EVENT_WRITE:
                        relay.write_input()
                    if events & selectors.EVENT_READ and not relay.read_output():
                        sel.unregister(fd)
                        del masters[fd]
                        continue
                    sel.modify(fd, selectors.EVENT_READ | (selectors.EVENT_WRITE if relay.input_pending else 0))
                elif fd in keyboards:
                    relay = keyboards[fd]
                    if not relay.read_keyboard():
                        sel.unregister(fd)
                    elif relay.input_pending and relay.master in masters:
                        sel.modify(relay.master, selectors.EVENT_READ | selectors.EVENT_WRITE)
    except BaseException:
        _kill(proc, pid_namespace)
        raise
    finally:
        sel.close()
        os.close(pidfd)


def _read_status(fd: int, run: _Run) -> bool:
    """Read the confiner's report (``contract.confiner``); False at its end."""
    data = os.read(fd, 65536)
    if not data:
        return False
    run.status.feed(data)
    try:
        while (body := run.status.next()) is not None:
            msg = TO_COORDINATOR.parse(decode_json(body, MAX_MESSAGE))
            if isinstance(msg, Exited):
                run.ended = ("exit", msg.code)
            elif isinstance(msg, Killed):
                run.ended = ("signal", msg.signal)
            elif isinstance(msg, Stopped):
                run.stopped = True
            elif isinstance(msg, Failed):
                run.error = msg.error
    except ContractError as exc:
        run.error = f"the sandbox's first process broke its protocol ({exc})"
        return False
    return True


def _signals(received: bytes, relays: list[TerminalRelay], tell) -> None:
    for sig in received:
        if sig in _TO_GROUP:
            tell("group", sig)
        elif sig in _TO_PROGRAM:
            tell("program", sig)
        elif sig == signal.SIGWINCH:
            for relay in relays:
                relay.resize()  # (the kernel signals the pty's foreground group)
            if not relays:
                tell("group", sig)
        elif sig == signal.SIGTSTP:
            tell("group", sig)  # the program stops, then so do we (see ``_stop_here``)
        elif sig == signal.SIGCONT:
            for relay in relays:
                relay.raw()
                relay.resize()
            tell("group", sig)


def _stop_here(relays: list[TerminalRelay]) -> None:
    """The program stopped (Ctrl-Z, a SIGTSTP relayed, SIGSTOP): stop as it did, so the shell
    takes the terminal back; when continued (``fg``), continue the program too."""
    for relay in relays:
        relay.restore()
    os.kill(os.getpid(), signal.SIGSTOP)
    # Continued: the SIGCONT that woke us is also on its way to the loop, which relays it.


def _kill(proc: subprocess.Popen, pid_namespace: bool) -> None:
    """The sandbox and everything in it: bubblewrap's namespace, or without it the confiner and
    every process below it."""
    kill_tree(proc.pid, pid_namespace=pid_namespace)  # (the root too: bubblewrap, or the confiner)


def _result(run: _Run, duration: float, timeout: float | None, grace: float,
            cgroups: ScriptCgroups | None) -> ScriptResult:
    memory = cgroups is not None and cgroups.oom_killed()
    if run.error:
        return ScriptResult("failed", 125, None, duration, run.error)
    if run.timed_out:
        how = (f"killed after the {grace:g} s grace" if run.killed else "stopped by SIGTERM")
        return ScriptResult("timeout", 124, None, duration,
                            f"the script ran past its --timeout of {timeout:g} s: {how}")
    if run.ended is None:
        said = bytes(run.diagnostics).decode("utf-8", "replace").strip().splitlines()
        if memory:
            return ScriptResult("killed", 128 + signal.SIGKILL, signal.SIGKILL, duration,
                                "the sandbox was killed: over its memory limit (--memory)")
        return ScriptResult("failed", 125, None, duration,
                            "the sandbox failed to run the script" + (f": {said[-1]}" if said else ""))
    kind, number = run.ended
    if kind == "exit":
        return ScriptResult("ok" if number == 0 else "error", number, None, duration)
    if memory and number == signal.SIGKILL:
        return ScriptResult("killed", 128 + number, number, duration,
                            "the script was killed: over its memory limit (--memory)")
    return ScriptResult("died", 128 + number, number, duration)


def exit_as(result: ScriptResult) -> None:
    """End this process as the script ended: its exit status, or death by its signal (core
    dumps off); never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    if result.status in ("died", "killed") and result.signal is not None:
        sig = result.signal
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL has no disposition to reset)
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(result.exit_code & 0xFF)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _usable(fd: int) -> int | None:
    """``fd`` if it is open (a closed stdin is passed on closed, as python would have it)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


def _encoding() -> str:
    import locale

    return locale.getpreferredencoding(False) or "utf-8"
