"""The first process of the sandbox of ``agentloop exec FILE``: it confines itself, starts the
program (``python FILE ARGS``), and stays as its init.

Started as ``python -S -I -B -c "...; from worker.confiner import main; main()" SETUP PROGRAM...``
(``engine.sandbox.runtime_argv``; SETUP is ``contract.confiner.Setup``): while it may
still hold privileges, nothing of the directory it starts in, nor any ``.pth`` file, is on its
path.  It applies the confinement ``worker._confine.apply`` installs in a worker (rlimits, uid,
capabilities, no_new_privs, Landlock, seccomp: all of them survive ``execve``), forks, and the
child ``execve``s PROGRAM with the environment this process was given.  The program is then
``python FILE`` and nothing else: fds 0, 1 and 2 are what the coordinator passed, no module,
frame, thread or descriptor of ours is in its process.

Why a process of ours stays, outside the program: under bubblewrap it is the PID namespace's
init (``--as-pid-1``).  Python as PID 1 would ignore every signal it has no handler for
(SIGTERM among them), and bubblewrap's own init neither forwards signals nor tells a death by
signal N from ``exit(128 + N)``.  This one reaps orphans, delivers the signals the coordinator
relays, and reports the program's wait status exactly (``contract.confiner``).  When the
program ends, it reports and exits, and the kernel ends whatever the program left running with
the namespace.  Without bubblewrap it is a subreaper instead, and kills every process below it
on its way out.

The program gets a process group of its own, as a shell gives a job (the terminal's foreground
group, when there is one); this process ignores the signals it relays; the child restores
every disposition before ``execve``, but those the coordinator itself inherited as ignored
(``nohup``), as a shell would pass them.  This process's own fd 2 goes to the coordinator,
never to the program's stderr.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sys
import termios

from . import _confine
from .contract.confiner import (
    MAX_MESSAGE,
    TO_CONFINER,
    Continued,
    Exited,
    Failed,
    Killed,
    Setup,
    Signal,
    Stopped,
)
from .contract.framing import FrameBuffer, decode_json, encode_json, frame, write_all
from .contract.schema import ContractError, Message

__all__ = ["main"]

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 1, 4, 36
#: Signals the coordinator relays, and those a terminal sends to its foreground process group.
_RELAYED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGWINCH, signal.SIGCONT)


def _prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _say(fd: int, msg: Message) -> None:
    with contextlib.suppress(OSError):
        write_all(fd, frame(encode_json(msg)))


def main() -> None:
    setup = TO_CONFINER.parse(decode_json(sys.argv[1].encode("utf-8", "surrogateescape"), MAX_MESSAGE))
    program = sys.argv[2:]
    if not isinstance(setup, Setup) or not program:
        raise SystemExit("worker.confiner: started without its setup")
    for fd in (setup.status, setup.control, setup.stderr):
        os.set_inheritable(fd, False)
    try:
        _prepare(setup)
        _confine.apply(setup.confine)
        _prctl(_PR_SET_DUMPABLE, 0)  # the program, of the same uid, cannot read this process's memory
        if setup.egress:  # the sandbox's one way out (--allow-net), confined as the program is
            from .contract.egress import FORWARDER_PORT
            from .egress import start as forward

            forward(setup.egress, port=FORWARDER_PORT)
    except Exception as exc:  # noqa: BLE001 - a half-applied sandbox must not run code
        _say(setup.status, Failed(f"the sandbox could not be applied: {exc}"[:1000]))
        os._exit(71)
    if setup.lc_ctype is None:
        os.environ.pop("LC_CTYPE", None)
    else:
        os.environ["LC_CTYPE"] = setup.lc_ctype
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (set before the fork: a quick exit is not missed)
    # Blocked across the fork: one relayed before the child has its dispositions waits for them
    # (pending), instead of meeting this process's "ignore".
    signal.pthread_sigmask(signal.SIG_BLOCK, _RELAYED)
    pid = os.fork()
    if pid == 0:
        _become(program, setup)
    with contextlib.suppress(OSError):  # (the child does it too: whichever comes first)
        os.setpgid(pid, pid)
    for sig in _RELAYED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _RELAYED)
    os.close(setup.stderr)
    code = _supervise(pid, setup.status, setup.control, wake_r)
    _end()
    os._exit(code)


def _prepare(setup: Setup) -> None:
    """Session, controlling terminal, and (without a PID namespace) the ties to the coordinator."""
    if setup.parent:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        if os.getppid() != setup.parent:
            os._exit(70)  # the coordinator died before the death signal was armed
    if os.getsid(0) != os.getpid():
        os.setsid()
    if setup.tty is not None:
        fcntl.ioctl(setup.tty, termios.TIOCSCTTY, 0)


def _become(program: list[str], setup: Setup) -> None:
    """In the child (confined as this process is, in its Landlock domain, so that this process
    may signal it): a process group of its own (the terminal's foreground one), the
    dispositions a shell would give, fd 2, then ``execve``; never returns.

    Its own group, in this process's session, is what a shell gives a job: a group whose
    parent is in another group of the session is not orphaned, so the kernel stops it for a
    SIGTSTP (Ctrl-Z included) instead of dropping the signal."""
    try:
        os.setpgid(0, 0)
        if setup.tty is not None:
            os.tcsetpgrp(setup.tty, os.getpgrp())  # (SIGTTOU is blocked meanwhile)
        signal.set_wakeup_fd(-1)
        for sig in range(1, signal.NSIG):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_IGN if sig in setup.ignored else signal.SIG_DFL)
        if setup.parent:  # without a PID namespace nothing else ends the program with us
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())  # (what was relayed meanwhile lands now)
        os.dup2(setup.stderr, 2)
        os.execv(program[0], program)
    except OSError as exc:
        _say(setup.status, Failed(f"cannot run {program[0]}: {exc.strerror or exc}"[:1000]))
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the child must not go on
        _say(setup.status, Failed(f"cannot run {program[0]}: {exc}"[:1000]))
    os._exit(127)


def _supervise(pid: int, status: int, control: int, wake: int) -> int:
    """Relay commands and reap children until the program ends; report how it ended."""
    commands = FrameBuffer(MAX_MESSAGE)
    while True:
        if _reap(pid, status):
            return 0
        try:
            ready, _, _ = select.select([control, wake], [], [])
        except InterruptedError:
            continue
        if wake in ready:
            with contextlib.suppress(OSError):
                os.read(wake, 4096)
        if control in ready:
            data = os.read(control, 65536)
            if not data:  # the coordinator is gone, or wants everything gone
                return 1
            commands.feed(data)
            try:
                while (body := commands.next()) is not None:
                    command = TO_CONFINER.parse(decode_json(body, MAX_MESSAGE))
                    if isinstance(command, Signal):
                        with contextlib.suppress(OSError):
                            if command.to == "group":
                                os.killpg(pid, command.signal)  # the program's process group (its pid)
                            else:
                                os.kill(pid, command.signal)
            except ContractError:  # (only the coordinator writes there)
                return 1


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
            _say(status, Exited(os.WEXITSTATUS(how)))
            return True
        if os.WIFSIGNALED(how):
            _say(status, Killed(os.WTERMSIG(how)))
            return True
        if os.WIFSTOPPED(how):
            _say(status, Stopped(os.WSTOPSIG(how)))
        elif os.WIFCONTINUED(how):
            _say(status, Continued())


def _end() -> None:
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
