"""How many sub-agents a run may have: the limit, and the slots its agents share."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from engine.errors import AgentError

__all__ = ["MAX_SUBAGENTS", "SubagentBudget", "subagent_limit"]

#: Sub-agents one run may have working at once, unless ``max_subagents`` says otherwise.
MAX_SUBAGENTS = 8

#: Sub-agents one run may start in all: each is kept (its handle, its result, its costs) until
#: the run ends, so a loop of starts and cancels must not grow the coordinator without end.
MAX_STARTED = 1000

#: The sub-agent limit of runs whose agent is made without ``max_subagents``: the command line
#: sets it for the command it runs (``--max-subagents``), others get ``MAX_SUBAGENTS``.
subagent_limit: contextvars.ContextVar[int] = contextvars.ContextVar("agentloop_max_subagents",
                                                                     default=MAX_SUBAGENTS)


class SubagentBudget:
    """The sub-agents of one run: the agent a run starts and every agent below it share one, so
    the limit holds for the whole tree.  At most ``limit`` work at once, and at most ``limit``
    hold a worker, working or finished: a finished one keeps its worker (and namespace) for a
    follow-up until a newer sub-agent needs the room, so processes stay bounded too.  At most
    ``max_started`` are started in all (``count_start``)."""

    def __init__(self, limit: int, max_started: int | None = None) -> None:
        self.limit = limit
        self.max_started = MAX_STARTED if max_started is None else max_started
        self.started = 0
        self.live: set[Any] = set()  # engine.agent.Agent
        self.idle: list[Any] = []  # finished, still holding a worker; the oldest first

    def check(self) -> None:
        """Raise AgentError, in words for the model, when no other sub-agent may start now."""
        if len(self.live) >= self.limit:
            raise AgentError(
                f"this run already has {len(self.live)} sub-agents working, its limit (max_subagents="
                f"{self.limit}): wait for one to finish (its <agent_result> arrives by itself) or cancel "
                "some (self.cancel_subagents(), handle.cancel()) before starting another, or do this part "
                "yourself")

    def count_start(self) -> None:
        """Count a new sub-agent; AgentError, in words for the model, once the run has started
        as many as it may (a follow-up task for a finished one is not a new sub-agent)."""
        if self.started >= self.max_started:
            raise AgentError(f"this run has started {self.started} sub-agents, the most one run may: reuse "
                             "a finished one (handle.new_task(...)) or do this part yourself")
        self.started += 1

    def take(self, agent: Any, task: asyncio.Future) -> None:
        """Count ``agent`` as working until ``task`` ends (``check`` first: this does not)."""
        if agent in self.idle:
            self.idle.remove(agent)
        self.live.add(agent)
        task.add_done_callback(lambda _: self._finished(agent))

    def _finished(self, agent: Any) -> None:
        self.live.discard(agent)
        if agent.worker is not None and not agent.released:
            self.idle.append(agent)

    async def make_room(self) -> None:
        """Close the workers of finished sub-agents, the oldest first, until one more fits."""
        while self.idle and len(self.live) + len(self.idle) >= self.limit:
            await self.idle.pop(0).release()
