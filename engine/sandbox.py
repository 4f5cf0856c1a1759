"""Sandbox policy (data) and the launch plan that applies it (a separate step).

STUB: only the PID namespace part is implemented here; the full policy (filesystem view,
network namespace, Landlock, seccomp, rlimits) is being built against this interface.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True)
class SandboxPolicy:
    """What a worker may do. Pure data: `plan()` turns it into a launch."""

    mode: str = "auto"  # "auto": strongest available; "bwrap": require it; "none": unsandboxed
    network: bool = False
    memory_bytes: int = 2 * GiB
    cpu_seconds: int | None = None
    max_processes: int = 256
    max_open_files: int = 1024
    max_file_bytes: int = 1 * GiB
    tmp_bytes: int = 512 * 1024**2


@dataclass
class LaunchPlan:
    """How to start one worker: argv prefix, whether the kill can rely on a PID namespace,
    the spec the worker applies to itself before user code (JSON-able), one-line notes."""

    argv_prefix: list[str]
    pid_namespace: bool
    confine: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@lru_cache(maxsize=1)
def _bwrap_works() -> str | None:
    exe = shutil.which("bwrap")
    if not exe:
        return None
    try:
        ok = subprocess.run([exe, "--unshare-pid", "--dev-bind", "/", "/", "true"],
                            capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return exe if ok else None


def plan(policy: SandboxPolicy, *, socket_dir: Path, workspace: Path, cwd: Path,
         output_dir: Path, python: str) -> LaunchPlan:
    """The launch plan for one worker under `policy` on this machine."""
    if policy.mode == "none":
        return LaunchPlan([], False, {}, ["sandbox: none — worker code runs with your privileges"])
    exe = _bwrap_works()
    if exe is None:
        return LaunchPlan([], False, {}, ["sandbox: bubblewrap unavailable — process-group kill only"])
    return LaunchPlan([exe, "--dev-bind", "/", "/", "--proc", "/proc", "--unshare-pid",
                       "--die-with-parent", "--"], True, {}, [])
