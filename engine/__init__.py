"""agentloop's coordinator: engine, workers, results, errors.

Every name below is imported when first used (PEP 562), not with the package: a command that
runs code samples never loads the agent loop and its HTTP client."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the module that defines it.
_WHERE = {
    "Agent": "agent", "RunResult": "agent", "make_agent": "agent", "run_task": "agent", "AgentloopError": "errors",
    "ConfigError": "errors", "ModelError": "errors", "ModelResponseError": "errors", "ModelUnreachable": "errors",
    "SandboxError": "errors", "WorkerClosed": "errors", "WorkerError": "errors", "WorkerStartError": "errors",
    "BlockResult": "results", "OutputChunk": "results", "SandboxPolicy": "sandbox", "Engine": "workers",
    "Worker": "workers", "WorkerState": "workers",
}

if TYPE_CHECKING:
    from .agent import Agent, RunResult, make_agent, run_task
    from .errors import (
        AgentloopError,
        ConfigError,
        ModelError,
        ModelResponseError,
        ModelUnreachable,
        SandboxError,
        WorkerClosed,
        WorkerError,
        WorkerStartError,
    )
    from .results import BlockResult, OutputChunk
    from .sandbox import SandboxPolicy
    from .workers import Engine, Worker, WorkerState


__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Agent",
    "AgentloopError",
    "BlockResult",
    "ConfigError",
    "Engine",
    "ModelError",
    "ModelResponseError",
    "ModelUnreachable",
    "OutputChunk",
    "RunResult",
    "SandboxError",
    "SandboxPolicy",
    "Worker",
    "WorkerClosed",
    "WorkerError",
    "WorkerStartError",
    "WorkerState",
    "make_agent",
    "run_task",
]
