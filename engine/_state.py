"""Where agentloop keeps what outlives one command: ``$XDG_STATE_HOME/agentloop``, by default
``~/.local/state/agentloop`` (the runs' directories, the record of directories workers wrote)."""

from __future__ import annotations

import os
from pathlib import Path


def state_home() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "agentloop"
