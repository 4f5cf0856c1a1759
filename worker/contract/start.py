"""What a process the coordinator starts in the sandbox is told through its environment.

The coordinator builds a ``StartSpec`` and passes ``to_env()``: one variable, ``AGENTLOOP_START``,
holding the JSON of the spec's ``to_wire()`` (the confinement and a slot's settings are
messages held in its fields).  The process calls ``take()`` first thing, which parses it with
``START`` (every field checked, an unknown key refused at every level) and removes it from
``os.environ`` before any code it runs could see it.  Secrets never travel here: the token is
one-time, and the environment itself is built from an allowlist (``engine.launch``).

Coordinator -> any process it starts (``START``)
    start  {token, confine, parent, output, tty, slot?, preload, curve, egress}
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from .confinement import Confinement
from .limits import MAX_ID, MAX_NAME
from .sample import SlotSettings
from .schema import (
    Catalogue,
    ContractError,
    Message,
    field,
    is_int,
    is_list,
    is_message,
    is_optional,
    is_text,
    message,
)

__all__ = ["CONFINER", "ENTRIES", "FORK_PROBE", "FORK_SERVER", "NAMES", "SLOT", "START", "TOOLS", "WORKER",
           "StartSpec"]

#: What each kind of process the coordinator starts in a sandbox runs, as ``module:function`` of
#: the runtime (``engine.sandbox.runtime_argv`` makes the one command line that runs one).
WORKER = "worker.__main__:main"          # a worker: blocks over its wire channel
SLOT = "worker.slot:main"                # a sample slot: samples one after another
FORK_SERVER = "worker.fork_server:serve"  # a fork server: forks workers and slots
FORK_PROBE = "worker.fork_server:probe"  # whether a fork server's user namespaces work here
CONFINER = "worker.confiner:main"        # exec FILE's first process: confines, runs python FILE
TOOLS = "worker.tool_server:main"        # the repository tools' process
ENTRIES = (WORKER, SLOT, FORK_SERVER, FORK_PROBE, CONFINER, TOOLS)

_START = "AGENTLOOP_START"
#: Every variable of the start; none reaches the code a process runs.
NAMES = (_START,)
#: The largest start a process reads: one environment variable holds at most 128 KiB.
MAX_START = 128 * 1024


@message("start")
class StartSpec(Message):
    """``token``: the handshake's one-time secret; ``confine``: what the process applies to
    itself; ``parent``: the coordinator's pid where no PID namespace ends the process with it
    (0: one does); ``output``: the directory of its output pipes (``contract.output``);
    ``tty``: which of fds 1 and 2 are a terminal, and its size (``"1,2:ROWSxCOLS"``);
    ``slot``: a sample slot's settings; ``preload``: modules a fork server imports first;
    ``curve``: over TCP, the CurveZMQ keys (``"SERVER_PUBLIC PUBLIC SECRET"``, z85) with which
    the coordinator lets this worker in, and no one else; ``egress``: the path of the sandbox's
    egress proxy socket (``--allow-net``; empty: no network at all), to which the process's
    forwarder (``worker.egress``, on ``contract.egress.FORWARDER_PORT``) relays, started after
    the confinement and before any code runs."""

    token: str = field(is_text(MAX_NAME), "")
    confine: Confinement = field(is_message(Confinement), Confinement())
    parent: int = field(is_int(0, 2**31), 0)
    output: str = field(is_text(MAX_ID), "")
    tty: str = field(is_text(64), "")
    slot: SlotSettings | None = field(is_optional(is_message(SlotSettings)), None)
    preload: tuple[str, ...] = field(is_list(is_text(MAX_NAME), 256), ())
    curve: str = field(is_text(1024), "")
    egress: str = field(is_text(MAX_ID), "")

    def to_env(self) -> dict[str, str]:
        """The variables that tell a process this spec (none for the empty spec)."""
        if self == _EMPTY:
            return {}
        import json

        return {_START: json.dumps(self.to_wire(), separators=(",", ":"))}

    @classmethod
    def take(cls, environ: MutableMapping[str, str] | None = None) -> StartSpec:
        """The spec in ``environ`` (default ``os.environ``), its variable removed from it (the
        empty spec without one); ContractError when it is malformed (the process must not
        start then)."""
        env = os.environ if environ is None else environ
        text = env.pop(_START, "")
        if not text:
            return _EMPTY
        if len(text) > MAX_START:
            raise ContractError(f"{_START}: {len(text)} characters, at most {MAX_START}")
        import json

        try:
            raw: Any = json.loads(text)
        except ValueError as exc:
            raise ContractError(f"{_START}: not JSON ({exc})") from None
        return START.parse(raw)  # type: ignore[return-value]


START = Catalogue("the coordinator to a process it starts", (StartSpec,))
_EMPTY = StartSpec()
