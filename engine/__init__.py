"""agentloop's coordinator: engine, workers, results, errors.

Each name loads with the module that defines it, on first use (PEP 562): ``from engine import
Engine`` works as ever, and a command that needs none of them (``agentloop exec FILE``,
``--help``) does not pay for the agent loop, httpx, rich and asyncio at its start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Every public name, with the module that defines it.
_WHERE = {
    "Agent": "agent",
    "AgentloopError": "errors",
    "BlockResult": "results",
    "ConfigError": "errors",
    "Engine": "engine",
    "ModelError": "errors",
    "ModelResponseError": "errors",
    "ModelUnreachable": "errors",
    "OutputChunk": "results",
    "RunResult": "runner",
    "SandboxError": "errors",
    "SandboxPolicy": "sandbox",
    "Worker": "worker",
    "WorkerClosed": "errors",
    "WorkerError": "errors",
    "WorkerStartError": "errors",
    "WorkerState": "worker",
    "make_agent": "runner",
    "run_task": "runner",
}

__all__ = [
    "Agent", "AgentloopError", "BlockResult", "ConfigError", "Engine", "ModelError", "ModelResponseError",
    "ModelUnreachable", "OutputChunk", "RunResult", "SandboxError", "SandboxPolicy", "Worker", "WorkerClosed",
    "WorkerError", "WorkerStartError", "WorkerState", "make_agent", "run_task",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # (once loaded, a plain attribute)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from .agent import Agent
    from .engine import Engine
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
    from .runner import RunResult, make_agent, run_task
    from .sandbox import SandboxPolicy
    from .worker import Worker, WorkerState
