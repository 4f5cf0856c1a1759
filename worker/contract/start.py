"""What a process the coordinator starts in the sandbox is told through its environment.

The coordinator builds a ``StartSpec`` and passes ``to_env()``; the process calls ``take()``
first thing, which reads the variables and removes them from ``os.environ`` before any code it
runs could see them.  Secrets never travel here: the token is one-time, and the environment
itself is built from an allowlist (``engine.launch``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from .confinement import Confinement
from .sample import SlotSettings
from .schema import ContractError

__all__ = ["CONFINER", "ENTRIES", "FORK_PROBE", "FORK_SERVER", "NAMES", "SLOT", "TOOLS", "WORKER", "StartSpec"]

#: What each kind of process the coordinator starts in a sandbox runs, as ``module:function`` of
#: the runtime (``engine.sandbox.runtime_argv`` makes the one command line that runs one).
WORKER = "worker.__main__:main"          # a worker: blocks over its wire channel
SLOT = "worker.slot:main"                # a sample slot: samples one after another
FORK_SERVER = "worker.fork_server:serve"  # a fork server: forks workers and slots
FORK_PROBE = "worker.fork_server:probe"  # whether a fork server's user namespaces work here
CONFINER = "worker.confiner:main"        # exec FILE's first process: confines, runs python FILE
TOOLS = "worker.tool_server:main"        # the repository tools' process
ENTRIES = (WORKER, SLOT, FORK_SERVER, FORK_PROBE, CONFINER, TOOLS)

_TOKEN, _CONFINE, _PARENT = "AGENTLOOP_TOKEN", "AGENTLOOP_CONFINE", "AGENTLOOP_PARENT"
_OUTPUT, _TTY, _SLOT, _PRELOAD = "AGENTLOOP_OUTPUT", "AGENTLOOP_TTY", "AGENTLOOP_SLOT", "AGENTLOOP_PRELOAD"
_CURVE = "AGENTLOOP_CURVE"
#: Every variable of the start; none reaches the code a process runs.
NAMES = (_TOKEN, _CONFINE, _PARENT, _OUTPUT, _TTY, _SLOT, _PRELOAD, _CURVE)


@dataclass(frozen=True)
class StartSpec:
    """``token``: the handshake's one-time secret; ``confine``: what the process applies to
    itself; ``parent``: the coordinator's pid where no PID namespace ends the process with it
    (0: one does); ``output``: the directory of its output pipes (``contract.output``);
    ``tty``: which of fds 1 and 2 are a terminal, and its size (``"1,2:ROWSxCOLS"``);
    ``slot``: a sample slot's settings; ``preload``: modules a fork server imports first;
    ``curve``: over TCP, the CurveZMQ keys (``"SERVER_PUBLIC PUBLIC SECRET"``, z85) with which
    the coordinator lets this worker in, and no one else."""

    token: str = ""
    confine: Confinement = field(default_factory=Confinement)
    parent: int = 0
    output: str = ""
    tty: str = ""
    slot: SlotSettings | None = None
    preload: tuple[str, ...] = ()
    curve: str = ""

    def to_env(self) -> dict[str, str]:
        env = {}
        if self.token:
            env[_TOKEN] = self.token
        if self.confine:
            env[_CONFINE] = self.confine.to_json()
        if self.parent:
            env[_PARENT] = str(self.parent)
        if self.output:
            env[_OUTPUT] = self.output
        if self.tty:
            env[_TTY] = self.tty
        if self.slot is not None:
            import json

            env[_SLOT] = json.dumps(self.slot.to_wire())
        if self.preload:
            env[_PRELOAD] = ",".join(self.preload)
        if self.curve:
            env[_CURVE] = self.curve
        return env

    @classmethod
    def take(cls, environ: MutableMapping[str, str] | None = None) -> StartSpec:
        """The spec in ``environ`` (default ``os.environ``), its variables removed from it;
        ContractError when one is malformed (the process must not start then)."""
        env = os.environ if environ is None else environ
        got = {name: env.pop(name, "") for name in NAMES}
        slot = None
        if got[_SLOT]:
            import json

            try:
                slot = SlotSettings.from_wire(json.loads(got[_SLOT]))
            except ValueError as exc:
                raise ContractError(f"slot settings: {exc}") from None
        try:
            parent = int(got[_PARENT] or 0)
        except ValueError:
            raise ContractError(f"{_PARENT} is not a pid") from None
        return cls(got[_TOKEN], Confinement.from_json(got[_CONFINE]), parent, got[_OUTPUT], got[_TTY], slot,
                   tuple(n.strip() for n in got[_PRELOAD].split(",") if n.strip()), got[_CURVE])
