"""What the model is told about the machine its code runs on: this worker's view of it."""

from __future__ import annotations

import os
import platform

__all__ = ["describe_environment"]

_MAX_PACKAGES = 300


def _ram() -> str:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:2]}
    except (OSError, ValueError, IndexError):
        return ""
    gib = 1024 * 1024
    if "MemTotal" not in info:
        return ""
    return f"{info.get('MemAvailable', 0) // gib} GB available of {info['MemTotal'] // gib} GB"


def _packages() -> list[str]:
    from importlib import metadata

    names = set()
    for dist in metadata.distributions():
        name = dist.metadata.get("Name") if dist.metadata else None
        if name:
            names.add(name)
    return sorted(names, key=str.lower)[:_MAX_PACKAGES]


def describe_environment() -> dict:
    """Python version, OS, cores, RAM and the installed distributions, as the worker sees them."""
    return {
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": os.cpu_count(),
        "ram": _ram(),
        "packages": _packages(),
    }
