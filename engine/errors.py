"""The one exception tree of the coordinator.

    AgentloopError                  every error agentloop itself raises
    ├── ConfigError                 bad option, duration, config file; fix the input
    │   └── UntrustedFile           a file to obey that a worker could have written
    │       └── UntrustedPython     an interpreter (or what its start reads) a worker could have written
    ├── WorkerError                 a sandboxed process could not be started or talked to
    │   ├── WorkerStartError        the process did not come up / handshake failed
    │   ├── WorkerClosed            the handle was closed; start a new worker
    │   ├── ForkRefused             a worker cannot be forked now: what to stop first
    │   ├── OutputError             what a worker wrote on its output pipe breaks the protocol
    │   ├── SlotError               a sample slot broke or misspoke: it is not used again
    │   └── ToolProcessError        the tool process did not serve a request
    │       ├── ToolTimeout         past its deadline (the process was killed)
    │       ├── ToolCrash           it died, could not start, or broke the protocol
    │       ├── ToolBusy            other requests held it longer than the caller may wait
    │       └── ToolClosed          its handle was closed
    ├── SandboxError                the requested sandbox cannot be applied here
    ├── AlreadyOwned                an object that serves one owner was offered a second
    ├── TreeError                   a walk of a directory tree stopped (too big, moved); an OSError
    ├── Refused                     a request refused in words, for whoever made it; never fatal
    │   ├── AgentError              a model's request the agent refuses
    │   ├── ToolError               a tool call the repository tools refuse
    │   ├── CallRefused             an MCP client's tool call that cannot be done as asked
    │   ├── NoClient                an MCP request that belongs to no client
    │   ├── InvalidRequest          a request to agentloop serve not of SandboxFusion's shape (HTTP 422)
    │   └── ServiceBusy             more samples than agentloop serve lets run and wait (HTTP 429)
    ├── CodeFailed                  smolagents: a step's code failed (its words, for CodeAgent)
    └── ModelError                  the model endpoint failed us
        ├── ModelUnreachable        connection refused / DNS / timeout, after retries
        │   └── ForeignServer       a server on this machine that another user runs: sent nothing
        └── ModelResponseError      HTTP error status or a body we cannot read

Faults of the *model's code* (exceptions, timeouts, kills, sandbox denials) are not
exceptions here: they are results, reported to the model as words.  Errors of the
libraries below (zmq, msgpack, httpx) are translated once, at the edge, with
``raise ... from exc``.
"""

from __future__ import annotations

import signal

__all__ = [
    "AgentError", "AgentloopError", "AlreadyOwned", "InvalidRequest", "CallRefused", "CodeFailed", "ConfigError",
    "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OWN", "EXIT_TIMEOUT", "ForeignServer", "ForkRefused", "ModelError", "ModelResponseError",
    "ModelUnreachable", "NoClient", "OutputError", "Refused", "SandboxError", "ServiceBusy", "SlotError", "ToolBusy",
    "ToolClosed", "ToolCrash", "ToolError", "ToolProcessError", "ToolTimeout", "TreeError", "UntrustedFile",
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


class ForkRefused(WorkerError):
    """A worker cannot be forked now (a block, a thread, a task or a process of its code runs)
    or here; the message says what to stop first, or why it never can."""


class OutputError(WorkerError):
    """What a worker wrote on its output pipe breaks the protocol (the session ends the worker)."""


class SlotError(WorkerError):
    """A sample slot broke, stopped answering or said something it may not: it is not used again."""


class ToolProcessError(WorkerError):
    """The tool process (``engine.tools``) did not serve a request."""


class ToolTimeout(ToolProcessError):
    """The request ran past its deadline; the process was killed."""


class ToolCrash(ToolProcessError):
    """The process died, could not start, or broke the protocol; the message says how."""


class ToolBusy(ToolProcessError):
    """Other requests held the process for longer than the caller may wait."""


class ToolClosed(ToolProcessError):
    """The handle was closed: no process is started any more."""


class SandboxError(AgentloopError):
    """The requested sandbox cannot be applied on this machine."""


class AlreadyOwned(AgentloopError):
    """An object whose events go to one owner (a worker's host calls, a stopper's interrupt)
    already has one: a second would silently take them from the first.  Make a new object for
    the second owner."""


class TreeError(AgentloopError, OSError):
    """A walk of a directory tree stopped: the tree has more entries than allowed, or it moved
    under the walk (``engine.trees``; an OSError, as the walk's other failures are)."""


class Refused(AgentloopError):
    """A request refused, in words for whoever made it (a model, a client): never fatal."""


class AgentError(Refused):
    """What the agent refuses or cannot do for its model: no answer within the message budget,
    a sub-agent over the limit, an unknown host function.  Said to the model in words, or the
    run's failure."""


class ToolError(Refused):
    """A repository tool refusing a request the model made; the message is what the model reads."""


class CallRefused(Refused):
    """An MCP client's tool call that cannot be done as asked; its message goes back to the client
    as the tool's result, with ``is_error`` set."""


class NoClient(Refused):
    """An MCP request that belongs to no client: its message says why, for the client to read."""


class InvalidRequest(Refused):
    """A request to ``agentloop serve`` that is not of SandboxFusion's shape; the words say
    which field (answered 422)."""


class ServiceBusy(Refused):
    """More samples than ``agentloop serve`` lets run and wait at once (answered 429, with
    Retry-After)."""


class CodeFailed(AgentloopError):
    """A smolagents step's code raised, hit its deadline or was killed.  The message says it all
    (output first, then what went wrong), for ``CodeAgent`` to hand to the model."""


class ModelError(AgentloopError):
    """The model endpoint failed."""


class ModelUnreachable(ModelError):
    """The model endpoint could not be reached, even after retries."""


class ForeignServer(ModelUnreachable):
    """The server at an endpoint on this machine belongs to another user (not the caller, not
    root): any local account can listen on a loopback port, so nothing is sent to it — no key,
    no prompt, no trace (``engine.models._endpoint``)."""


class ModelResponseError(ModelError):
    """The model endpoint answered with an error status (``status``) or an unreadable body."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
