"""agentloop's coordinator: engine, workers, results, errors."""

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
from .sandbox import SandboxPolicy
from .worker import Worker, WorkerState

__all__ = [
    "AgentloopError",
    "BlockResult",
    "ConfigError",
    "Engine",
    "ModelError",
    "ModelResponseError",
    "ModelUnreachable",
    "OutputChunk",
    "SandboxError",
    "SandboxPolicy",
    "Worker",
    "WorkerClosed",
    "WorkerError",
    "WorkerStartError",
    "WorkerState",
]
