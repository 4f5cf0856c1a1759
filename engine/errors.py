"""The one exception tree of the coordinator.

    AgentloopError                  every error agentloop itself raises
    ├── ConfigError                 bad option, duration, config file; fix the input
    │   └── UntrustedFile           a file to obey that a worker could have written
    │       └── UntrustedPython     an interpreter (or what its start reads) a worker could have written
    ├── WorkerError                 a worker could not be started or talked to
    │   ├── WorkerStartError        the process did not come up / handshake failed
    │   └── WorkerClosed            the handle was closed; start a new worker
    ├── SandboxError                the requested sandbox cannot be applied here
    ├── AgentError                  a model's request the agent refuses (said to the model)
    └── ModelError                  the model endpoint failed us
        ├── ModelUnreachable        connection refused / DNS / timeout, after retries
        └── ModelResponseError      HTTP error status or a body we cannot read

Faults of the *model's code* (exceptions, timeouts, kills, sandbox denials) are not
exceptions here: they are results, reported to the model as words.  Errors of the
libraries below (zmq, msgpack, httpx) are translated once, at the edge, with
``raise ... from exc``.
"""

from __future__ import annotations

import signal

__all__ = [
    "AgentError", "AgentloopError", "ConfigError", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OWN",
    "EXIT_TIMEOUT", "ModelError", "ModelResponseError", "ModelUnreachable", "SandboxError", "UntrustedFile",
    "UntrustedPython", "WorkerClosed", "WorkerError", "WorkerStartError"
]

#: Exit statuses of the command line (``exec`` adds 128+N for a worker killed by signal N).
EXIT_ERROR = 1
EXIT_TIMEOUT = 124  # as timeout(1)
EXIT_OWN = 125  # agentloop's own errors: bad input, options, set-up
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C (and SIGTERM, which stops a command the same way)


class AgentloopError(Exception):
    """Base of every error agentloop raises; the message says what to do next."""


class ConfigError(AgentloopError):
    """An option, duration or configuration file is invalid."""


class UntrustedFile(ConfigError):
    """A file agentloop would obey (a configuration, a results file, the workers' Python)
    could have been written by a worker; it is not used (``engine.trust``)."""


class UntrustedPython(UntrustedFile):
    """An interpreter, or a file or directory it reads as it starts or imports from, could have
    been written by a worker: it is not run, not even to ask what it is
    (``engine.sandbox.trusted_python``)."""


class WorkerError(AgentloopError):
    """A worker process could not be started or talked to."""


class WorkerStartError(WorkerError):
    """The worker did not start or did not complete the handshake in time."""


class WorkerClosed(WorkerError):
    """The worker handle was closed; start a new worker to run more code."""


class SandboxError(AgentloopError):
    """The requested sandbox cannot be applied on this machine."""


class AgentError(AgentloopError):
    """What the agent refuses or cannot do for its model: no answer within the message budget,
    a sub-agent over the limit, an unknown host function.  Said to the model in words, or the
    run's failure."""


class ModelError(AgentloopError):
    """The model endpoint failed."""


class ModelUnreachable(ModelError):
    """The model endpoint could not be reached, even after retries."""


class ModelResponseError(ModelError):
    """The model endpoint answered with an error status (``status``) or an unreadable body."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
