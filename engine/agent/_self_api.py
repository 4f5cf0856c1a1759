"""What ``self`` does for code in an agent's worker: the host calls named ``self.OP`` (see
``worker.proxy.AgentSelf``), each done on the agent that owns the worker, and an AgentError in
words for anything it cannot do."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.durations import parse_duration
from engine.errors import AgentError
from worker.contract import wire
from worker.contract.schema import ContractError

__all__ = ["self_call"]


async def self_call(agent: Any, op: str, args: list, kwargs: dict, block: str | None = None) -> Any:
    """``self.OP(*args, **kwargs)`` called by block ``block`` of the worker of ``agent`` (an
    ``engine.agent.Agent``: not imported, which imports this); its value."""
    if op == "compact_knowledge":
        assert agent.chat is not None
        agent.chat.compact(str(args[0] if args else kwargs.get("summary", "")))
        return None
    if op == "cancel_subagents":
        agent.cancel_subagents()
        return None
    if op == "cost":
        return agent.cost()
    if op == "status":
        return agent.status()
    if op == "run_agent":
        heartbeat = parse_duration(kwargs.get("heartbeat") or None)
        try:  # (what the worker's ``agent.run_agent`` exported there: checked as an ``inject``'s)
            items = wire.handed_items(kwargs.get("items") or {})
        except ContractError as exc:
            raise AgentError(f"the namespace handed over is malformed: {exc}") from None
        child = await agent.start_agent(str(args[0]), name=kwargs.get("name") or "sub",
                                       context=kwargs.get("context", ""), items=items,
                                       heartbeat=heartbeat, model=kwargs.get("model", ""),
                                       fork=kwargs.get("fork") is True, caller=block)
        return child.name
    child = agent.child(args[0] if args else None)
    if op == "agent_done":
        return child.done()
    if op == "agent_result":
        if not child.done():
            raise AgentError(f"sub-agent '{child.name}' is still working; await the handle or wait for "
                             "its <agent_result>")
        return child.result_value
    if op == "agent_cancel":
        child.cancel()
        return None
    if op == "agent_new_task":
        child.new_task(str(args[1]))
        return None
    if op == "agent_cost":
        return child.cost()
    if op == "agent_status":
        return child.status()
    if op == "agent_wait":
        if child.task is not None:
            await asyncio.wait([child.task])
        return child.result_value
    raise AgentError(f"self has no method {op!r}")
