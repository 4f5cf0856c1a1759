"""What the model is told about the machine its code runs on: this worker's view of it.

The installed distributions are what ``importlib.metadata`` finds on ``sys.path``, each named
by its metadata's ``Name`` header.  Reading them costs tens of milliseconds, more than starting
a forked worker, so a fork server reads them once (``prepare``) for every worker it forks: a
worker then reads only the ``sys.path`` entries the server did not have (its current
directory, say).
"""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["describe_environment", "prepare"]

_MAX_PACKAGES = 300
#: Absolute ``sys.path`` entry -> the names of the distributions installed there, read once.
_installed: dict[str, frozenset[str]] = {}


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


def _names(entry: str) -> frozenset[str]:
    """The names of the distributions installed in one ``sys.path`` entry.  Only the ``Name``
    header is read (the metadata's headers end at its first empty line), not the whole message:
    an email parse per distribution is what made this slow."""
    from importlib import metadata

    names = set()
    for dist in metadata.distributions(path=[entry]):
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
        for line in text.splitlines():
            if not line.strip():
                break
            if line[:5].lower() == "name:":
                if name := line[5:].strip():
                    names.add(name)
                break
    return frozenset(names)


def prepare() -> None:
    """Read the distributions of every absolute ``sys.path`` entry now, for this process and
    every process forked from it (a fork server calls it once)."""
    for entry in sys.path:
        if os.path.isabs(entry) and entry not in _installed:
            _installed[entry] = _names(entry)


def _packages() -> list[str]:
    names: set[str] = set()
    for entry in sys.path:
        known = _installed.get(entry)
        names |= known if known is not None else _names(entry)
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
