"""agentloop's coordinator: engine, workers, results, errors."""

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
