"""What stays read-only in a directory workers may write: whatever a later agentloop process,
or the user's own tools, would trust or run from there.

``protected_paths(directory)`` lists it: ``agentloop.toml`` (where requests go and with which
key, which Python runs), ``.git`` (its hooks and config run commands), every virtual
environment directly in it (a directory holding ``pyvenv.cfg``: an interpreter and packages
that a fork server imports with privileges), and whatever else the caller names (``exec``'s
script: the interpreter and agentloop's code where they lie there, ``engine.exec``).
The sandbox binds each over itself read-only, after the directory itself (``engine.sandbox``),
in every view code gets of it: a cold start, the fork server's, the batch's shared one
(``worker.fork_server``), ``exec``'s; the coordinator's record (``engine.trust``) notes what was
kept so.

Only what exists is listed, and never a link:

* a bind needs a mount point, and one made for a path that does not exist yet is an empty
  file or directory in the user's directory.  Codex and Anthropic's sandbox-runtime mount
  ``/dev/null`` there and delete the empty file after the command; a crash leaves it behind,
  and deleting it while another sandbox on the same directory still runs unhooks that
  sandbox's mount.  Here nothing is made: a path that appears while workers could write
  there has a ctime within that time, and ``engine.trust`` refuses it (an ``agentloop.toml``,
  a Python); agentloop itself never runs git;
* a bind over a link lands on the link's target, and the link itself stays replaceable; a
  replaced link is a new one, with a new ctime, which ``engine.trust`` refuses.

Under Landlock alone (no bubblewrap) nothing can be bound: every path listed is writable, the
plan says so in a note, and ``engine.trust`` refuses afterwards what changed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PROTECTED_NAMES", "protected_paths", "unkept_note"]

#: Entries protected by name in a writable directory.
PROTECTED_NAMES = ("agentloop.toml", ".git")
#: A directory holding this file is a virtual environment (PEP 405).
VENV_MARKER = "pyvenv.cfg"
#: Entries of the directory looked at for virtual environments: a bound on the work done before
#: every run, in a directory that may hold anything.
_SCAN_LIMIT = 4096


def _kind(path: str) -> int | None:
    """The file type of ``path`` itself (a link is not followed), or None if it is not there."""
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except OSError:
        return None


def protected_paths(directory: str | Path, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The paths in ``directory`` (resolved) to keep read-only while workers write it, each an
    existing file or directory that is not a link, shallowest first.  ``extra``: more paths to
    keep so where they lie beneath ``directory`` (the others are ignored)."""
    top = os.path.realpath(directory)
    found = {os.path.join(top, name) for name in PROTECTED_NAMES}
    try:
        with os.scandir(top) as entries:
            for number, entry in enumerate(entries):
                if number >= _SCAN_LIMIT:
                    break
                if entry.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(entry.path, VENV_MARKER)):
                    found.add(entry.path)
    except OSError:
        pass
    found |= {os.path.normpath(p) for p in extra if os.path.normpath(p).startswith(top.rstrip("/") + "/")}
    kept = [p for p in found if _kind(p) in (stat.S_IFREG, stat.S_IFDIR)]
    return tuple(sorted(kept, key=lambda p: (p.count("/"), p)))


def unkept_note(paths: Iterable[str], directory: str | Path) -> str:
    """The plan's note where ``paths`` cannot be kept read-only (no bubblewrap to bind them)."""
    names = ", ".join(os.path.relpath(p, directory) for p in paths)
    return (f"sandbox: without bubblewrap nothing in the workspace can be kept read-only ({names} there can be "
            "written); agentloop refuses afterwards whatever of them changed")
