"""What a code sample's status means: one classification for every way a sample runs.

A sample (``engine.samples``) ends in exactly one status, with the exit code ``agentloop exec``
would exit with for it and, where the code alone does not say what happened, words:

    status     exit code   when
    ok         0           it exited with status 0
    error      N, 1, 125   it raised (1), exited with another status (``sys.exit(N)``,
                           ``os._exit(N)``), or could not be started (125, words say why)
    timeout    124         its deadline passed; the words say whether the interrupt (a
                           ``TimeoutError`` where it waited) stopped it or a kill did
    oom        137         it went over its memory limit and was killed
    died       128+N       signal N ended it (one it sent itself included)
    cancelled  130         the caller stopped it (Ctrl-C, or leaving ``Engine.map`` early)

Whichever way a sample ran — forked by a slot, or in a worker of its own started cold — its
runner describes how its process ended as an ``Ending`` and ``classify`` decides; nothing
else does.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EXIT_INTERRUPTED, EXIT_OWN, EXIT_TIMEOUT

__all__ = ["STATUSES", "Ending", "classify", "cancelled_outcome"]

STATUSES = ("ok", "error", "timeout", "oom", "died", "cancelled")
_SIGKILL = 9


@dataclass(frozen=True)
class Ending:
    """How a sample's process ended, as its runner saw it.  ``code``: its exit status, where it
    exited; ``signal``: the signal that ended it; ``timed_out``: its deadline passed, and
    ``killed`` a kill (not the interrupt) ended it then; ``over_memory``: the kernel killed it
    for its memory limit; ``not_started``: why it never ran; ``lost``: words for a sandbox
    that stopped under it (nothing else is known then)."""

    code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    killed: bool = False
    over_memory: bool = False
    not_started: str = ""
    lost: str = ""


def classify(ending: Ending, timeout: float, memory_bytes: int | None) -> tuple[str, int, str]:
    """(status, exit code, words) of ``ending``; the table in this module's docstring."""
    if ending.not_started:
        return "error", EXIT_OWN, f"it could not be started: {ending.not_started[:500]}"
    if ending.timed_out:
        return "timeout", EXIT_TIMEOUT, f"its deadline ({timeout:g} s) passed" + (
            ", and it was killed: the interrupt did not stop it" if ending.killed else "")
    if ending.over_memory:
        limit = f" ({memory_bytes / 2**20:.0f} MiB)" if memory_bytes else ""
        return "oom", 128 + (ending.signal or _SIGKILL), f"it went over its memory limit{limit} and was killed"
    if ending.lost:
        return "died", 128 + _SIGKILL, f"its sandbox stopped: {ending.lost}"
    if ending.signal:
        return "died", 128 + ending.signal, f"it died of signal {ending.signal}"
    code = ending.code or 0
    return ("ok" if code == 0 else "error"), code, ""


def cancelled_outcome() -> tuple[str, int, str]:
    """The caller stopped the sample."""
    return "cancelled", EXIT_INTERRUPTED, "cancelled"
