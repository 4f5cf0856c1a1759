"""What an ``exec`` script left in the directory it wrote that other tools obey.

What already stood there and must not change is kept read-only while the script runs
(``.git``, ``agentloop.toml``, virtual environments: ``engine.sandbox``), but nothing can be
bound where nothing is: a ``.git`` the script *creates* is obeyed by the next ``git`` run there
(its ``core.fsmonitor`` runs on ``git status``, which many shell prompts run on entering the
directory), an ``.envrc`` by direnv, a ``.vscode/`` by the editor.  agentloop refuses such
files for itself (``engine.trust``), not for other tools; so at exit ``exec`` names, in one
line, each of ``OBEYED`` (and each new virtual environment) that appeared directly in the
directory, or was replaced by another file, while the script ran.  What it changed inside
an ``OBEYED`` directory that was there before is not looked into.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["OBEYED", "appeared", "snapshot"]

#: Names that tools run or obey on entering (or working in) a directory, and who obeys them.
OBEYED = {
    ".git": "git", ".hg": "Mercurial", ".envrc": "direnv", ".vscode": "VS Code", ".idea": "JetBrains IDEs",
    ".pre-commit-config.yaml": "pre-commit", ".python-version": "pyenv", ".tool-versions": "asdf",
    "mise.toml": "mise", ".mise.toml": "mise", ".nvmrc": "nvm", ".npmrc": "npm", ".yarnrc.yml": "yarn",
    ".cargo": "cargo", "pyvenv.cfg": "Python (a virtual environment)",
}
_VENV_MARKER = "pyvenv.cfg"
#: Entries of the directory looked at for new virtual environments (a bound on the walk).
_SCAN_LIMIT = 4096

Snapshot = dict[str, tuple[int, int, int]]


def _identity(path: str) -> tuple[int, int, int] | None:
    """What tells one file from another that took its name: device, inode, type (links not followed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)


def _venvs(directory: str) -> list[str]:
    """The entries of ``directory`` that are virtual environments (a directory holding pyvenv.cfg)."""
    found = []
    try:
        with os.scandir(directory) as entries:
            for number, entry in enumerate(entries):
                if number >= _SCAN_LIMIT:
                    break
                if entry.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(entry.path, _VENV_MARKER)):
                    found.append(entry.name)
    except OSError:
        pass
    return found


def snapshot(directory: str | Path) -> Snapshot:
    """What of ``OBEYED`` (and which virtual environments) ``directory`` holds now, by identity."""
    top = str(directory)
    names = [*OBEYED, *(f"{name}/{_VENV_MARKER}" for name in _venvs(top))]
    return {name: ident for name in names if (ident := _identity(os.path.join(top, name))) is not None}


def appeared(directory: str | Path, before: Snapshot) -> list[str]:
    """The names of ``OBEYED`` (``NAME/`` for a new virtual environment) in ``directory`` that
    were not there at ``before``, or are another file now; each with who obeys it."""
    now = snapshot(directory)
    found = []
    for name, ident in now.items():
        if before.get(name) == ident:
            continue
        if name.endswith(f"/{_VENV_MARKER}"):
            found.append(f"{name.split('/')[0]}/ (a virtual environment)")
        else:
            found.append(f"{name} ({OBEYED[name]})")
    return found
