"""How a sandboxed process is started: one interface, its implementations, one choice, one start.

A ``Provisioner`` starts the processes of one run (workers and sample slots) from their
``Launch`` and closes whatever it keeps for them:

    ColdStart          a sandbox (bubblewrap, or the Landlock fallback) and a fresh interpreter
                       per process (~100 ms)
    ForkServer         the run's own fork server forks it (``engine.fork_server``, ~15 ms)
    RunView            a batch's shared fork server forks it, showing it this run's
                       directories only (``engine.shared_fork_server``)

``choose`` is the one place that decides which a run gets; ``fork_server_refusal`` says why a
fork server cannot give a run the isolation of a cold start, wherever that is asked.
``start_process`` is the one start-and-greet every process goes through, a worker (its hello
over ZeroMQ) or a slot (its hello over a unix socket) alike.  The engine decides; the
provisioners touch the OS; nothing here calls back up: what a start needs comes in as values
and awaitables.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from ._process import Launch, Process, descendants, spawn
from .errors import ConfigError, WorkerStartError
from .results import describe_exit
from .sandbox import host_support
from .settings import WorkerSettings

if TYPE_CHECKING:
    from .launcher import Launcher

__all__ = ["ColdStart", "Provisioner", "fork_server_refusal", "start_process"]

T = TypeVar("T")


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
        proc = await spawn(launch.argv, env=launch.env, cwd=launch.cwd, pid_namespace=launch.pid_namespace)
        if on_root is not None:
            on_root(proc.pid)
        return proc

    async def close(self) -> None:
        pass


def fork_server_refusal(settings: WorkerSettings) -> str | None:
    """Why no fork server can give workers with ``settings`` the isolation a cold start gives
    them here (None: one can).  Today that takes bubblewrap and a coordinator running as root:
    the server makes each worker's namespaces with capabilities it holds in the sandbox's."""
    if settings.fork_server is False:
        return "workers start cold (fork_server=False)"
    if settings.sandbox.mode not in ("auto", "bwrap"):
        return f"the fork server runs inside bubblewrap, and the sandbox mode is {settings.sandbox.mode!r}"
    host = host_support()
    if host.bwrap is None:
        return f"the fork server needs bubblewrap ({host.bwrap_problem})"
    if os.geteuid() != 0 or sys.platform != "linux":
        return "the fork server needs a coordinator running as root"
    return None


def insisted(settings: WorkerSettings, own_workspaces: bool, why: str) -> None:
    """Raise ConfigError when a run cannot do without a fork server (``fork_server=True``, or
    code samples, whose empty workspaces it mounts) and ``why`` says there is none."""
    if settings.fork_server or own_workspaces:
        raise ConfigError(why)


async def start_process(launcher: Launcher, launch: Launch, number: int, greeting: Awaitable[T],
                        what: str = "worker") -> tuple[Process, list[Path], T]:
    """Start ``launch`` (process ``number`` of the launcher's run, a ``what``) and wait for
    ``greeting``: the process, the cgroups it is in, and what the greeting gave.

    Its memory and process cgroups are made and entered while it starts, from the moment its
    tree has a root (for a forked process, the namespace's init, whose children are then born
    inside), and checked again once it has said hello: before it runs any code.  On failure —
    the greeting raising, the process exiting, ``start_timeout`` passing, a cgroup refused —
    the process is killed, its cgroups released and WorkerStartError says why, with the end of
    what it wrote on stderr.  Cancelled half-way, it leaves nothing running."""
    provisioner = launcher.provisioner()
    moved: dict[Path, set[int]] = {}
    groups: list[Path] = []
    adopting: asyncio.Future | None = None

    def enter(root: int) -> None:
        groups.extend(launcher.worker_groups(number, root))
        launcher.adopt(groups, root, moved)

    def on_root(root: int) -> None:
        nonlocal adopting
        if adopting is None:
            adopting = asyncio.ensure_future(asyncio.to_thread(enter, root))

    greeted = asyncio.ensure_future(greeting)
    proc: Process | None = None
    try:
        try:
            proc = await provisioner.spawn(launch, on_root)
        except OSError as exc:
            raise WorkerStartError(f"could not start a process ({launch.argv[0]}): {exc}") from exc
        on_root(proc.pid)
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({greeted, exited}, timeout=launcher.settings.start_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        assert adopting is not None
        await adopting
        if greeted in done and not greeted.exception() and groups:
            tree = {proc.pid, *descendants(proc.pid)}
            if any(not tree <= moved.get(group, set()) for group in groups):  # (a move waits)
                await asyncio.to_thread(launcher.adopt, groups, proc.pid, moved)
        if greeted not in done or greeted.exception():
            died = exited in done
            await proc.kill()  # waits for the exit status too, wherever it comes from
            if greeted.done() and greeted.exception():
                reason = str(greeted.exception())
            elif died:
                reason = describe_exit(proc.returncode or 0, via_namespace=launch.pid_namespace)[0]
            else:
                reason = f"no handshake within {launcher.settings.start_timeout:g} s"
            said = proc.stderr_tail.decode("utf-8", "replace").strip()
            raise WorkerStartError(f"{what} failed to start: {reason}" + (f"\n{said}" if said else ""))
        return proc, groups, greeted.result()
    except BaseException:
        greeted.cancel()
        if adopting is not None:  # its thread is done with the cgroups before they go
            with contextlib.suppress(BaseException):
                await asyncio.shield(asyncio.gather(adopting, return_exceptions=True))
        if proc is not None:
            await asyncio.shield(proc.kill())
        launcher.release_groups(groups)
        raise
