"""How a sandboxed process is started: one interface, its implementations, one choice, one start.

A ``Provisioner`` starts the processes of one run (workers and sample slots) from their
``Launch`` and closes whatever it keeps for them:

    ColdStart          a sandbox (bubblewrap, or the Landlock fallback) and a fresh interpreter
                       per process (~100 ms)
    ForkServer         the run's own fork server forks it (``engine.launch``, ~15 ms)
    RunView            a batch's shared fork server forks it, showing it this run's
                       directories only (``engine.launch``)

``Launcher.provisioner`` is the one place that decides which a run gets;
``fork_server_refusal`` says why a fork server cannot give a run the isolation of a cold
start, wherever that is asked.  The life of a process, and where each step lives:

    start     Provisioner.spawn (a Launch in, a Process out)
    greet     Launcher.start_process: spawn, its cgroups entered while it starts, its hello
              awaited (a worker's over ZeroMQ, a slot's over a unix socket), undone on failure
    signal    the Process: ``kill`` is one small function, shielded, that kills the whole tree
    kill      (its PID namespace's init, or a frozen process group without one) and always
    reap      reaps; ``wait`` and ``returncode`` read the exit status, wherever it comes from
    release   Launcher.release: the process's cgroups and socket directory, once it is dead

The engine decides; the provisioners touch the OS; nothing here calls back up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

from engine.errors import ConfigError
from engine.launch._process import Launch, Process, spawn
from engine.launch._settings import WorkerSettings
from engine.sandbox import fork_server_problem, host_support

__all__ = ["ColdStart", "Provisioner", "cold_note", "fork_server_refusal", "insisted"]


class Provisioner(Protocol):
    """Starts sandboxed processes for one run."""

    #: What kind it is, as logs and ``doctor`` say it: "cold", "fork server", "shared fork server".
    kind: str

    async def spawn(self, launch: Launch, on_root: Callable[[int], None] | None = None) -> Process:
        """Start ``launch``'s process.  ``on_root`` is told the host pid of the root of its tree
        as soon as it exists (before the process itself does, where a fork server makes the
        namespace first), so its cgroups can be entered meanwhile."""
        ...

    async def close(self) -> None:
        """Release what the provisioner keeps (a fork server and every process it forked)."""
        ...


class ColdStart:
    """A sandbox and a fresh interpreter for every process."""

    kind = "cold"

    async def spawn(self, launch: Launch, on_root: Callable[[int], None] | None = None) -> Process:
        proc = spawn(launch)
        if on_root is not None:
            on_root(proc.pid)
        return proc

    async def close(self) -> None:
        pass


def fork_server_refusal(settings: WorkerSettings) -> str | None:
    """Why no fork server can give workers with ``settings`` the isolation a cold start gives
    them here (None: one can).  That takes bubblewrap: the server makes each worker's
    namespaces with capabilities it holds in the sandbox's (root's; an unprivileged user's in
    bubblewrap's user namespace, which takes a kernel that allows a user namespace per worker
    below it: ``fork_server_problem``)."""
    if settings.fork_server is False:
        return "workers start cold (fork_server=False)"
    if settings.sandbox.mode not in ("auto", "bwrap"):
        return f"the fork server runs inside bubblewrap, and the sandbox mode is {settings.sandbox.mode!r}"
    if sys.platform != "linux":
        return "the fork server needs Linux"
    problem = fork_server_problem()
    if problem is not None:
        return f"no fork server: {problem}"
    return None


def cold_note(settings: WorkerSettings) -> str | None:
    """One line for a run's start notes where its processes start cold although bubblewrap
    works here and nothing in ``settings`` asked for that (a kernel that refuses an unprivileged
    fork server the user namespaces it makes); None otherwise."""
    if settings.fork_server is not None or settings.sandbox.mode not in ("auto", "bwrap"):
        return None
    host = host_support()
    problem = fork_server_problem() if host.bwrap is not None else None
    if problem is None:
        return None
    return f"sandbox: no fork server: {problem} — workers and code samples start cold (~100 ms each)"


def insisted(settings: WorkerSettings, own_workspaces: bool, why: str) -> None:
    """Raise ConfigError when a run cannot do without a fork server (``fork_server=True``, or
    code samples, whose empty workspaces it mounts) and ``why`` says there is none."""
    if settings.fork_server or own_workspaces:
        raise ConfigError(why)
