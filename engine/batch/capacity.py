"""How many runs at once by default: CPUs and available memory."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from engine.sandbox import GiB

__all__ = ["MAX_DEFAULT_PARALLEL", "MEMORY_PER_RUN", "available_memory", "default_parallel", "usable_cpus"]

#: Upper bound of the default --parallel; more needs saying so.
MAX_DEFAULT_PARALLEL = 64
#: Memory budgeted per run when choosing the default --parallel.
MEMORY_PER_RUN = 1 * GiB


def usable_cpus() -> int:
    """CPUs this process may run on, after affinity and a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.floor(int(quota) / int(period))))
    return max(1, cpus)


def available_memory() -> int:
    """Bytes that can be used without swapping: MemAvailable, or less under a cgroup limit."""
    available = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    return available


def default_parallel(cpus: int | None = None, memory: int | None = None) -> int:
    """``min(2 × cpus, memory / 1 GiB)``, between 1 and 64 (see the module docstring)."""
    cpus = usable_cpus() if cpus is None else cpus
    memory = available_memory() if memory is None else memory
    return max(1, min(2 * cpus, memory // MEMORY_PER_RUN, MAX_DEFAULT_PARALLEL))
