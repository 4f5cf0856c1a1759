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

**Set-id and file-capability files, where uid 0 writes.**  Code that runs as uid 0 without
capabilities (``exec`` as root, ``run --write-cwd`` as root, a root worker that keeps uid 0)
cannot make a set-user-ID file, but it can rewrite one that is there — a root-owned 4755
binary, or one whose ``security.capability`` grants capabilities — through a shared memory
mapping, which keeps the bit and the capabilities (the kernel drops them on ``write(2)`` and
truncate only); whoever runs it next gets root.  So where uid 0 writes, ``privileged_files``
walks the directory (bounded: ``WALK_LIMIT`` entries) and every such file is bound read-only
as the names above are; without bubblewrap, or past the bound, or with more than
``BIND_LIMIT`` of them, the directory is not made writable at all (ConfigError, in words).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from engine.errors import ConfigError

__all__ = ["BIND_LIMIT", "PROTECTED_NAMES", "WALK_LIMIT", "is_privileged", "privileged_files", "protected_paths",
           "unkept_note"]

#: Entries protected by name in a writable directory.
PROTECTED_NAMES = ("agentloop.toml", ".git")
#: A directory holding this file is a virtual environment (PEP 405).
VENV_MARKER = "pyvenv.cfg"
#: Entries of the directory looked at for virtual environments: a bound on the work done before
#: every run, in a directory that may hold anything.
_SCAN_LIMIT = 4096
#: Entries of a directory uid 0 writes looked at for set-id and file-capability files (5 to 12
#: µs each here: 0.1 s for 13,000): a directory holding more is not made writable for uid 0.
WALK_LIMIT = 100_000
#: Set-id and file-capability files bound read-only in one directory at most (a mount each).
BIND_LIMIT = 256
_CAPABILITY = "security.capability"


def _kind(path: str) -> int | None:
    """The file type of ``path`` itself (a link is not followed), or None if it is not there."""
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except OSError:
        return None


def protected_paths(directory: str | Path, extra: Iterable[str] = (), *, uid0: bool = False) -> tuple[str, ...]:
    """The paths in ``directory`` (resolved) to keep read-only while workers write it, each an
    existing file or directory that is not a link, shallowest first.  ``extra``: more paths to
    keep so where they lie beneath ``directory`` (the others are ignored).  ``uid0``: code
    writes it as uid 0, so its set-id and file-capability files are kept too
    (``privileged_files``, which may refuse the directory)."""
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
    if uid0:
        found |= set(privileged_files(top, skip=found))
    kept = [p for p in found if _kind(p) in (stat.S_IFREG, stat.S_IFDIR)]
    return tuple(sorted(kept, key=lambda p: (p.count("/"), p)))


def is_privileged(path: str, st: os.stat_result | None = None) -> bool:
    """Whether ``path`` (not followed) is a regular file that running gives privileges: a
    set-user-ID or set-group-ID mode, or file capabilities (``security.capability``)."""
    try:
        st = st or os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        return True
    if not st.st_mode & 0o111:
        return False  # (nobody runs it: its capabilities give nothing)
    try:
        os.getxattr(path, _CAPABILITY, follow_symlinks=False)
    except OSError as exc:
        return exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT, errno.EOPNOTSUPP)
    return True


def privileged_files(directory: str | Path, *, skip: Iterable[str] = (), limit: int = WALK_LIMIT) -> tuple[str, ...]:
    """Every set-id or file-capability file beneath ``directory`` (resolved; links not
    followed, iteratively: any depth), for a directory uid 0 will write; ``skip``: directories
    in it kept read-only already (``protected_paths``), not looked into.  ConfigError past
    ``limit`` entries, or with more than ``BIND_LIMIT`` such files: neither can be kept
    read-only, so the directory must not be written as uid 0."""
    top = os.path.realpath(directory)
    skipped = {os.path.normpath(p) for p in skip}
    found: list[str] = []
    pending, seen = [top], 0
    while pending:
        place = pending.pop()
        try:
            with os.scandir(place) as entries:
                for entry in entries:
                    seen += 1
                    if seen > limit:
                        raise ConfigError(
                            f"{top} holds more than {limit:,} files, too many to look through for set-user-ID "
                            "files that code running as uid 0 could rewrite (keeping their bit): run from a "
                            "smaller directory, pass --read-only, or run as another user")
                    if entry.is_dir(follow_symlinks=False):
                        if entry.path not in skipped:
                            pending.append(entry.path)
                    elif entry.is_file(follow_symlinks=False) and is_privileged(entry.path, entry.stat(follow_symlinks=False)):
                        found.append(entry.path)
        except OSError:
            continue
    if len(found) > BIND_LIMIT:
        raise ConfigError(f"{top} holds {len(found)} set-user-ID, set-group-ID or file-capability files, more "
                          f"than the {BIND_LIMIT} that can be kept read-only, and code running as uid 0 could "
                          "rewrite them keeping their bit: run from another directory, pass --read-only, or run "
                          "as another user")
    return tuple(found)


def unkept_note(paths: Iterable[str], directory: str | Path) -> str:
    """The plan's note where ``paths`` cannot be kept read-only (no bubblewrap to bind them)."""
    names = ", ".join(os.path.relpath(p, directory) for p in paths)
    return (f"sandbox: without bubblewrap nothing in the workspace can be kept read-only ({names} there can be "
            "written); agentloop refuses afterwards whatever of them changed")
