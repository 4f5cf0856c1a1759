"""Taking a fork of a worker as a process of the run (``Worker.fork``): the counterpart, for a
process the worker made itself, of ``Launcher.start_process``.

The copy stops itself as it is born (in its parent's cgroups, whose limits would count its
threads): it is found below its parent by its pid in the parent's namespace, put in cgroups of
its own, let go, and waited for until it says hello.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from engine.errors import WorkerStartError
from engine.launch._process import Descendant, Process, find_below, signal_quietly, stopped
from engine.results import describe_exit
from worker.contract.limits import COPY_NOT_APART

if TYPE_CHECKING:
    from engine.launch._launcher import Launcher

__all__ = ["grant_socket", "start_fork"]

T = TypeVar("T")

_NOT_APART = ("the copy could not be given a Landlock domain of its own, which keeps it apart from its parent "
              "and siblings: the kernel stacks at most 16, and each copy of a copy adds one; fork from a worker "
              "fewer forks deep")


def grant_socket(launcher: Launcher, sock_dir: Path, endpoint: str) -> None:
    """Let the workers of ``sock_dir`` dial ``endpoint``, a socket bound there after they
    started (a fork's)."""
    if endpoint.startswith("ipc://"):
        launcher.plan(sock_dir).grant(Path(endpoint[len("ipc://"):]))


async def start_fork(launcher: Launcher, parent: Process, nspid: int, number: int,
                     greeting: Awaitable[T]) -> tuple[Process, list[Path], T]:
    """Take the fork ``nspid`` of a worker (numbered in the worker's PID namespace) as process
    ``number`` of ``launcher``'s run: found below ``parent`` (the worker's process), given
    cgroups of its own and waited for until ``greeting`` comes, within ``start_timeout``.  On
    failure it is killed, its cgroups released, and WorkerStartError says why."""
    settings = launcher.settings
    greeted = asyncio.ensure_future(greeting)
    host = find_below(parent.pid, nspid)
    if host is None:
        greeted.cancel()
        raise WorkerStartError(f"the fork (pid {nspid} in its worker) is not to be found below its worker")
    proc = Descendant(host)
    groups: list[Path] = []
    try:
        for _ in range(int(settings.start_timeout * 1000)):  # (it stops itself at once)
            if stopped(host) or proc.returncode is not None:
                break
            await asyncio.sleep(0.001)
        groups.extend(await asyncio.to_thread(launcher.worker_groups, number))
        await asyncio.to_thread(launcher.adopt, groups, host, {})
        signal_quietly(host, signal.SIGCONT)
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({greeted, exited}, timeout=settings.start_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if greeted not in done or greeted.exception():
            reason = str(greeted.exception()) if greeted.done() and greeted.exception() else \
                _NOT_APART if exited in done and proc.returncode == COPY_NOT_APART else \
                describe_exit(proc.returncode or 0, via_namespace=False)[0] if exited in done else \
                f"no handshake within {settings.start_timeout:g} s"
            raise WorkerStartError(f"a fork of the worker failed to start: {reason}")
        return proc, groups, greeted.result()
    except BaseException:
        greeted.cancel()
        await asyncio.shield(proc.kill())
        launcher.release_groups(groups)
        raise
