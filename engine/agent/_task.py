"""An agent of the right protocol, and one task run to its end.

``make_agent`` picks the class (``Agent`` for the tags protocol, ``ToolAgent`` for native tool
calls) and hands itself to the agent as its factory for sub-agents; ``run_task`` runs one task
and never raises for the model's or the endpoint's failures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.agent._display import AgentDisplay
from engine.agent._loop import Agent
from engine.agent._tool_protocol import ToolAgent
from engine.errors import AgentloopError, ConfigError, ModelError
from engine.models import Chat, ModelConfig, ModelRegistry
from engine.workers import Engine

__all__ = ["RunResult", "make_agent", "run_task"]


@dataclass
class RunResult:
    """How one agent run ended, for the CLI and batch jobs."""

    answer: str | None
    status: str  # answered | failed | timed_out | cancelled
    error: str = ""
    messages: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost: float = 0.0
    duration_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"answer": self.answer, "status": self.status, "error": self.error,
                "messages": self.messages, "tokens": {"in": self.tokens_in, "out": self.tokens_out},
                "cost": round(self.cost, 6), "duration_s": round(self.duration_s, 3)}



def make_agent(*, model: ModelConfig | str | None = None, models: ModelRegistry, protocol: str | None = None,
               **kwargs: Any) -> Agent:
    """An agent speaking ``protocol`` (default: its model's, from agentloop.toml; else tags)."""
    config = model if isinstance(model, ModelConfig) else models.get(model)
    chosen = protocol or config.protocol
    kwargs.setdefault("agent_factory", make_agent)  # its sub-agents are chosen the same way
    if chosen == "tools":
        return ToolAgent(model=config, models=models, protocol=protocol, **kwargs)
    if chosen not in ("tags", None):
        raise ConfigError(f"unknown protocol {chosen!r}: use 'tags' or 'tools'")
    return Agent(model=config, models=models, protocol=protocol, **kwargs)


async def run_task(task: str, *, models: ModelRegistry, model: str | None = None, engine: Engine | None = None,
                   functions: Mapping[str, Callable] | None = None, display: AgentDisplay | None = None,
                   max_messages: int = 200, timeout: float | None = None,
                   chat_factory: Callable[..., Chat] | None = None, protocol: str | None = None,
                   max_subagents: int | None = None) -> RunResult:
    """Run one task to its end and say how it went.  Never raises for the model's or the
    endpoint's failures: they are the result's ``status`` and ``error``.  ``max_subagents``:
    sub-agents working at once (default: ``subagent_limit``)."""
    started = time.monotonic()
    own_engine = engine is None
    engine = engine or Engine()
    agent: Agent | None = None
    answer: str | None = None
    status, error = "answered", ""
    extra: dict = {}
    try:
        if own_engine:
            engine.open()
        agent = make_agent(engine=engine, models=models, model=model, functions=functions, display=display,
                           max_messages=max_messages, chat_factory=chat_factory, protocol=protocol,
                           max_subagents=max_subagents)
        agent.display.event("run_started", name=agent.name, task=task, model=agent.model.alias)
        answer = await asyncio.wait_for(agent.run(task), timeout)
    except TimeoutError:
        status, error = "timed_out", f"no answer within {timeout:g} s"
    except asyncio.CancelledError:
        status, error = "cancelled", "cancelled"
    except (AgentloopError, ModelError) as exc:
        status, error = "failed", str(exc)
        extra["error_type"] = type(exc).__name__  # lets batch jobs tell infrastructure from the model
        if getattr(exc, "status", None) is not None:
            extra["http_status"] = exc.status
    finally:
        totals = agent.totals() if agent else {"tokens_in": 0, "tokens_out": 0, "cost": 0.0, "messages": 0}
        if agent is not None:
            await asyncio.shield(agent.close())
        if own_engine:
            await asyncio.shield(engine.shutdown())
    result = RunResult(answer=answer, status=status, error=error, messages=totals["messages"],
                       tokens_in=totals["tokens_in"], tokens_out=totals["tokens_out"], cost=totals["cost"],
                       duration_s=time.monotonic() - started, extra=extra)
    if agent is not None:
        agent.display.event("run_finished", name=agent.name, status=status, error=error,
                            error_type=extra.get("error_type", ""), tokens_in=result.tokens_in,
                            tokens_out=result.tokens_out, cost=result.cost, duration=result.duration_s)
    return result
