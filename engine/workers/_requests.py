"""A worker's control requests waiting for their replies (``wire.REQUESTS``, ``wire.REPLIES``).

Each request is numbered, checked against the worker's own parser before it is sent (what the
worker would refuse is refused here, in words, not left to time out) and waited for within its
bound.  A reply is matched to its request by number: one whose request is gone is stale (it
timed out: an honest race); one of the wrong kind for its request breaks the protocol.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

from engine.errors import WorkerError
from worker.contract import wire
from worker.contract.framing import decode, encode
from worker.contract.schema import ContractError

if TYPE_CHECKING:
    from engine.workers._session import Session

__all__ = ["PendingRequests"]


class PendingRequests:
    """The requests of the worker named ``name`` that wait for a reply."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._waiting: dict[int, tuple[type[wire.Message], asyncio.Future]] = {}
        self._ids = itertools.count(1)

    async def ask(self, session: Session, request: wire.Message, timeout: float) -> wire.Message:
        """Send ``request`` (numbered here) to ``session``'s process; its reply, every field
        checked.  WorkerError when it is refused, not answered in ``timeout`` s, or unsendable."""
        rid = next(self._ids)
        request = request.replace(rid=rid)
        frame = encode(request)
        try:
            wire.TO_WORKER.parse(decode(frame))
        except ContractError as exc:
            raise WorkerError(f"this {request.kind!r} request cannot be sent to a worker: {exc}") from None
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (wire.REPLIES[type(request)], future)
        try:
            session.send_frame(frame)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as exc:
            raise WorkerError(f"worker {self.name!r} did not answer {request.kind!r} within {timeout:g} s") from exc
        finally:
            self._waiting.pop(rid, None)

    def answered(self, session: Session, msg: wire.Message) -> None:
        """A reply from ``session``'s process: its request's value (``refused``: a WorkerError
        with its words)."""
        rid = msg.rid  # type: ignore[attr-defined]
        waiting = self._waiting.get(rid)
        if waiting is None or waiting[1].done():
            session.drop("reply to no request")
            return
        expected, future = waiting
        if type(msg) is not expected and not isinstance(msg, wire.Refused):
            # (the request stays waiting: the kill ends it, saying why)
            session.violation(f"it sent {msg.kind!r} where {expected.kind!r} answers the request")
            return
        del self._waiting[rid]
        if isinstance(msg, wire.Refused):
            future.set_exception(WorkerError(msg.error or "the request failed"))
        else:
            future.set_result(msg)

    def fail_all(self, why: str) -> None:
        """The process is gone: every request waiting ends with ``why``."""
        for _, future in self._waiting.values():
            if not future.done():
                future.set_exception(WorkerError(f"worker {self.name!r} was stopped: {why}"))
