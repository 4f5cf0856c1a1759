"""The first process of the sandbox of ``agentloop exec FILE``: it confines itself, starts the
program (``python FILE ARGS``), and stays as its init.

Started as ``python -I -B -c "...; from worker.confiner import main; main()" SETTINGS PROGRAM...``
(``engine.sandbox.runtime_argv``): while it may still hold privileges, nothing of the directory
it starts in is on its path.  It applies the confinement ``worker._confine.apply`` installs in a
worker (rlimits, uid, capabilities, no_new_privs, Landlock, seccomp: all of them survive
``execve``), forks, and the child ``execve``s PROGRAM with the environment this process was
given.  The program is then ``python FILE`` and nothing else: fds 0, 1 and 2 are what the
coordinator passed, no module, frame, thread or descriptor of ours is in its process.

Why a process of ours stays, outside the program: under bubblewrap it is the PID namespace's
init (``--as-pid-1``).  Python as PID 1 would ignore every signal it has no handler for
(SIGTERM among them), and bubblewrap's own init neither forwards signals nor tells a death by
signal N from ``exit(128 + N)``.  This one reaps orphans, delivers the signals the coordinator
relays, and reports the program's wait status exactly.  When the program ends, it reports and
exits, and the kernel ends whatever the program left running with the namespace.  Without
bubblewrap it is a subreaper instead, and kills every process below it on its way out.

The program gets a process group of its own, as a shell gives a job (the terminal's foreground
group, when there is one); this process ignores the signals it relays; the child restores
every disposition before ``execve``, but those the coordinator itself inherited as ignored
(``nohup``), as a shell would pass them.

The settings (JSON, one argument): ``confine`` (the spec), the descriptors ``status``,
``control`` and ``stderr`` (the program's fd 2; this process's own fd 2 goes to the
coordinator), ``tty`` (a pty slave to make the controlling terminal, or null), ``ignored``
(signal numbers), ``parent`` (the coordinator's pid when there is no PID namespace, else 0),
``lc_ctype`` (the program's LC_CTYPE: Python sets one at start in the C locale).

The two pipes carry ASCII lines.  ``control`` (from the coordinator): ``g N`` sends signal N
to the program's process group, ``p N`` to the program alone; its end of file kills
everything.  ``status`` (to the coordinator): ``exit N``, ``signal N``, ``stop N``, ``cont``,
or ``error TEXT`` when the program could not be started.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import sys
import termios

from . import _confine
from .contract.confinement import Confinement

__all__ = ["main"]

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 1, 4, 36
#: Signals the coordinator relays, and those a terminal sends to its foreground process group.
_RELAYED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGWINCH, signal.SIGCONT)
_CONTROL_LIMIT = 4096  # bytes of a pending command line


def _prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _say(fd: int, line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (line.replace("\n", " ")[:1000] + "\n").encode("utf-8", "replace"))


def main() -> None:
    settings = json.loads(sys.argv[1])
    program = sys.argv[2:]
    status, control, stderr = settings["status"], settings["control"], settings["stderr"]
    for fd in (status, control, stderr):
        os.set_inheritable(fd, False)
    try:
        _prepare(settings)
        _confine.apply(Confinement.from_json(settings.get("confine") or ""))
        _prctl(_PR_SET_DUMPABLE, 0)  # the program, of the same uid, cannot read this process's memory
    except Exception as exc:  # noqa: BLE001 - a half-applied sandbox must not run code
        _say(status, f"error the sandbox could not be applied: {exc}")
        os._exit(71)
    if settings.get("lc_ctype") is None:
        os.environ.pop("LC_CTYPE", None)
    else:
        os.environ["LC_CTYPE"] = settings["lc_ctype"]
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (set before the fork: a quick exit is not missed)
    # Blocked across the fork: one relayed before the child has its dispositions waits for them
    # (pending), instead of meeting this process's "ignore".
    signal.pthread_sigmask(signal.SIG_BLOCK, _RELAYED)
    pid = os.fork()
    if pid == 0:
        _become(program, settings)
    with contextlib.suppress(OSError):  # (the child does it too: whichever comes first)
        os.setpgid(pid, pid)
    for sig in _RELAYED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _RELAYED)
    os.close(stderr)
    code = _supervise(pid, status, control, wake_r)
    _end(pid)
    os._exit(code)


def _prepare(settings: dict) -> None:
    """Session, controlling terminal, and (without a PID namespace) the ties to the coordinator."""
    parent = int(settings.get("parent") or 0)
    if parent:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        if os.getppid() != parent:
            os._exit(70)  # the coordinator died before the death signal was armed
    if os.getsid(0) != os.getpid():
        os.setsid()
    if settings.get("tty") is not None:
        fcntl.ioctl(int(settings["tty"]), termios.TIOCSCTTY, 0)


def _become(program: list[str], settings: dict) -> None:
    """In the child (confined as this process is: in its Landlock domain, so that this process
    may signal it): a process group of its own (the terminal's foreground one), the
    dispositions a shell would give, fd 2, then ``execve``; never returns.

    Its own group, in this process's session, is what a shell gives a job: a group whose
    parent is in another group of the session is not orphaned, so the kernel stops it for a
    SIGTSTP (Ctrl-Z included) instead of dropping the signal."""
    status = settings["status"]
    try:
        os.setpgid(0, 0)
        if settings.get("tty") is not None:
            os.tcsetpgrp(int(settings["tty"]), os.getpgrp())  # (SIGTTOU is blocked meanwhile)
        signal.set_wakeup_fd(-1)
        ignored = {int(n) for n in settings.get("ignored", ())}
        for sig in range(1, signal.NSIG):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        if settings.get("parent"):  # without a PID namespace nothing else ends the program with us
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())  # (what was relayed meanwhile lands now)
        os.dup2(settings["stderr"], 2)
        os.execv(program[0], program)
    except OSError as exc:
        _say(status, f"error cannot run {program[0]}: {exc.strerror or exc}")
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the child must not go on
        _say(status, f"error cannot run {program[0]}: {exc}")
    os._exit(127)


def _supervise(pid: int, status: int, control: int, wake: int) -> int:
    """Relay commands and reap children until the program ends; report how it ended."""
    pending = b""
    while True:
        ended = _reap(pid, status)
        if ended:
            return 0
        try:
            ready, _, _ = select.select([control, wake], [], [])
        except InterruptedError:
            continue
        if wake in ready:
            with contextlib.suppress(OSError):
                os.read(wake, 4096)
        if control in ready:
            data = os.read(control, 4096)
            if not data:  # the coordinator is gone, or wants everything gone
                return 1
            pending = (pending + data)[-_CONTROL_LIMIT:]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                _command(line, pid)


def _reap(pid: int, status: int) -> bool:
    """Collect every child that changed state; report the program's.  True once it ended."""
    while True:
        try:
            child, how = os.waitpid(-1, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
        except ChildProcessError:
            return True
        if child == 0:
            return False
        if child != pid:
            continue  # an orphan that ended: reaped
        if os.WIFEXITED(how):
            _say(status, f"exit {os.WEXITSTATUS(how)}")
            return True
        if os.WIFSIGNALED(how):
            _say(status, f"signal {os.WTERMSIG(how)}")
            return True
        if os.WIFSTOPPED(how):
            _say(status, f"stop {os.WSTOPSIG(how)}")
        elif os.WIFCONTINUED(how):
            _say(status, "cont")


def _command(line: bytes, pid: int) -> None:
    try:
        target, number = line.decode("ascii").split()
        sig = int(number)
    except (UnicodeDecodeError, ValueError):
        return
    with contextlib.suppress(OSError):
        if target == "g":
            os.killpg(pid, sig)  # the program's process group (its pid)
        elif target == "p":
            os.kill(pid, sig)


def _end(pid: int) -> None:
    """What the program left running ends here: as PID 1 by exiting (the kernel kills the rest
    of the namespace); otherwise every process below this one, which, a subreaper, inherits
    whatever the program's descendants orphaned."""
    if os.getpid() == 1:
        return
    for _ in range(50):  # (a process forking as it is killed shows up in the next round)
        below = _descendants(os.getpid())
        if not below:
            return
        for child in below:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def _descendants(root: int) -> list[int]:
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found
