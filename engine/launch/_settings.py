"""The settings of a run's workers, typed once.

``WorkerSettings`` is built once — by the command line (``engine.cli.options``) or by the
caller of ``Engine`` — and handed unchanged to the launcher, which starts every worker, fork
server and sample slot of the run from it; a batch hands the same object to each of its runs.
Where a worker's setting comes from is therefore one question with one answer: the object
its engine was given.

What is not a worker setting stays with whoever owns it: the directories of one run (``cwd``,
``workspace``) and the warm pool belong to the ``Engine``, the batch's shared fork server to
the batch.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.net import Allowlist
from engine.results import FILE_CAP, OUTPUT_CAP
from engine.sandbox import SandboxPolicy

__all__ = ["WorkerSettings"]


@dataclass(frozen=True)
class WorkerSettings:
    """How the workers of a run are started and contained.

    ``sandbox``: the policy (mode, network, limits).  ``python``: the interpreter workers run
    (default: agentloop's own).  ``preload``: modules the fork server imports once for every
    worker.  ``fork_server``: None forks workers from a fork server where it gives the
    isolation of a cold start, False always starts them cold, True insists (a start fails
    without one).  ``transport``: ``ipc`` (a worker on this machine) or ``tcp`` (bound at
    ``tcp_bind``; ``connect_host`` is the address the worker dials).  ``start_timeout``:
    seconds a process may take to say hello.  ``grace``: seconds between a block's interrupt
    and the hard kill.  ``env_allow``: variables passed to workers beyond the allowlist.
    ``output_file_cap``: bytes of one block's output kept on disk; ``max_output``: bytes of
    all the run's block outputs kept on disk (None: no cap of the run's own).  ``keep_output``: keep the
    run's directory of block outputs after the run.  ``tty``: which of fds 1 and 2 are a
    terminal of the worker's own (``exec`` at a terminal).  ``state_dir``: where the run's
    directory goes (default ``~/.local/state/agentloop``).  ``allow_net``: the hosts workers
    may reach by name (``--allow-net HOST[:PORT]``, ``engine.net.Allowlist``; any iterable of
    entries is parsed), through a proxy outside each sandbox; empty, they reach nothing."""

    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)
    python: str = field(default_factory=lambda: sys.executable)
    preload: tuple[str, ...] = ()
    fork_server: bool | None = None
    transport: str = "ipc"
    tcp_bind: str = "127.0.0.1"
    connect_host: str | None = None
    start_timeout: float = 30.0
    grace: float = 0.5
    env_allow: tuple[str, ...] = ()
    output_file_cap: int = FILE_CAP
    max_output: int | None = OUTPUT_CAP
    keep_output: bool = False
    tty: tuple[int, ...] = ()
    state_dir: Path | None = None
    allow_net: Allowlist = field(default_factory=Allowlist)

    def __post_init__(self) -> None:
        if self.python is None:  # (None: the default, as an API caller may pass it)
            object.__setattr__(self, "python", sys.executable)
        if self.sandbox is None:
            object.__setattr__(self, "sandbox", SandboxPolicy())
        if self.transport not in ("ipc", "tcp"):
            raise ConfigError(f"transport must be 'ipc' or 'tcp', not {self.transport!r}")
        if not 0 < self.grace <= 1.0:
            raise ConfigError("grace must be in (0, 1] seconds")
        for name in ("preload", "env_allow", "tty"):  # any iterable given; a tuple kept
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "tty", tuple(fd for fd in self.tty if fd in (1, 2)))
        if self.state_dir is not None:
            object.__setattr__(self, "state_dir", Path(self.state_dir))
        if not isinstance(self.allow_net, Allowlist):
            object.__setattr__(self, "allow_net", Allowlist.parse(self.allow_net or (), "allow_net"))
        if self.allow_net and self.sandbox.network:
            raise ConfigError("--allow-net and --network together: --network gives workers the host's whole "
                              "network, --allow-net only the hosts it names; choose one")
        if self.allow_net and self.sandbox.mode in ("none", "landlock"):
            raise ConfigError(f"--allow-net needs the bubblewrap sandbox (an empty network namespace with one way "
                              f"out), not --sandbox {self.sandbox.mode}; use --sandbox auto or bwrap")

    def replace(self, **changes: Any) -> WorkerSettings:
        """These settings with ``changes`` (names of the fields above; a misspelt one is a
        ConfigError, not a silent default)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"not a worker setting: {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)
