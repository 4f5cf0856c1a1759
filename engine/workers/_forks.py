"""The processes of a fork of a worker (``Worker.fork``): a session per copy, listening beside
its parent's socket, the ``fork`` request, and each copy found and taken once it is made.
Nothing is left running when any of it fails."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import ForkRefused, WorkerError, WorkerStartError
from engine.workers._session import Session
from worker.contract import wire

if TYPE_CHECKING:
    from engine.workers._requests import PendingRequests

__all__ = ["Roster", "fork_sessions"]


class Roster(Protocol):
    """Who counts a run's workers (its ``Engine``): a fork asks it for room, then adds its copies."""

    def admit(self, n: int) -> None: ...

    def add(self, worker: Any) -> None: ...  # (a ``Worker``)


async def fork_sessions(parent: Session, requests: PendingRequests, n: int, caller: str | None,
                        timeout: float) -> list[Session]:
    """``n`` sessions, each holding a copy of ``parent``'s process that has said hello.
    ForkRefused in the worker's words when it cannot fork now or here."""
    name = requests.name
    try:
        sessions = [Session.fork_of(parent) for _ in range(n)]
    except WorkerStartError as exc:
        raise ForkRefused(f"worker {name!r} cannot be forked: {exc}") from None
    try:
        request = wire.Fork(tuple(wire.ForkChild(s.endpoint, s.token) for s in sessions), caller)
        try:
            reply = await requests.ask(parent, request, timeout)
        except WorkerError as exc:
            raise ForkRefused(f"worker {name!r}: {exc}") from None
        if len(reply.pids) != n:  # type: ignore[attr-defined]
            parent.violation(f"it answered a fork of {n} with {len(reply.pids)} pids")  # type: ignore[attr-defined]
            raise WorkerStartError(f"worker {name!r} did not fork as asked")
        taken = await asyncio.gather(*(s.adopt(parent, pid) for s, pid in zip(sessions, reply.pids, strict=True)),  # type: ignore[attr-defined]
                                     return_exceptions=True)
        failed = next((e for e in taken if isinstance(e, BaseException)), None)
        if failed is not None:
            raise failed
    except BaseException:
        await asyncio.shield(asyncio.gather(*(s.kill() for s in sessions), return_exceptions=True))
        raise
    return sessions
