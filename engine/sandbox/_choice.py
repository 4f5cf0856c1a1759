"""Which Python the workers run: the first source that names one, checked before it runs.

The sources, first found: ``--python``, ``$AGENTLOOP_PYTHON``, ``python`` in
``./agentloop.toml`` (relative to that file), the active virtual environment
(``$VIRTUAL_ENV/bin/python``), else the Python agentloop itself runs on.  So code in a worker
imports what the user's own ``python`` imports, not agentloop's private packages.  Whichever
source names it, the interpreter passes the same check (``trusted_python``) before anything
runs it, and a refusal names the source.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from engine.config import CONFIG_FILE, read_config
from engine.errors import ConfigError
from engine.sandbox._interpreter import TrustedPython, trusted_python

__all__ = ["choose_python", "which_python"]


def choose_python(explicit: str | None = None, config: Path | None = None,
                  workspace: Path | None = None) -> TrustedPython:
    """The interpreter workers run (see the module docstring), checked, as an absolute path.
    A name is looked up on PATH; one that is not there, or not executable, is a ConfigError,
    and so is an invalid ``config`` file; one a worker could have written (``trusted_python``)
    is an UntrustedPython."""
    return which_python(explicit, config, workspace)[0]


def which_python(explicit: str | None = None, config: Path | None = None,
                 workspace: Path | None = None) -> tuple[TrustedPython, str]:
    """``choose_python``'s interpreter and, in words, which of the five sources chose it."""
    config = config or Path(CONFIG_FILE)
    for given, where in ((explicit, "--python"), (os.environ.get("AGENTLOOP_PYTHON"), "AGENTLOOP_PYTHON"),
                         *_configured(config)):
        if given:
            return _resolve(given, where, workspace), where
    venv = os.environ.get("VIRTUAL_ENV")
    if venv and os.access(os.path.join(venv, "bin", "python"), os.X_OK):
        where = f"the active virtual environment (VIRTUAL_ENV={venv})"
        return _resolve(os.path.join(venv, "bin", "python"), where, workspace), where
    where = ("default, agentloop's own (none of --python, AGENTLOOP_PYTHON, python in "
             f"{config} or an active virtual environment names one)")
    return trusted_python(sys.executable, workspace, source="agentloop's own"), where


def _configured(config: Path) -> list[tuple[str | None, str]]:
    if not config.is_file():
        return []
    value = read_config(config).get("python")  # the whole file checked, as every command checks it
    if value is None:
        return []
    if os.sep in value and not os.path.isabs(value):
        value = str(config.resolve().parent / value)
    return [(value, f"python in {config}")]


def _resolve(given: str, where: str, workspace: Path | None) -> TrustedPython:
    found = given if os.sep in given else shutil.which(given)
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise ConfigError(f"{where}: {given} is not an executable Python interpreter; give its path, "
                          "e.g. --python /usr/bin/python3 or --python .venv/bin/python")
    # What the interpreter calls itself: a launcher script (pyenv's shims) becomes the program it
    # runs; links are kept, as a virtual environment's python finds its packages by its own place.
    return trusted_python(os.path.abspath(found), workspace, source=f"chosen by {where}", resolve=True)
