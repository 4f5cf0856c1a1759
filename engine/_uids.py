"""The uids a root coordinator runs workers as: one per workspace, never shared by two
workspaces whose runs are alive at the same time, in this process or any other.

A uid is claimed with a lock file (``flock``) in a root-only directory, naming the workspace
that holds it; a claim lives as long as its descriptor, so a coordinator that dies (SIGKILL
included) frees its uids at once.  Two runs on one workspace share its uid (so each owns what
the other wrote: the later one relies on the first one's claim); a workspace whose first
choice (a hash of its path) is held for another gets the next free one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import zlib
from pathlib import Path

#: Root workers switch to a uid in this range.
UID_BASE, UID_SPAN = 2_000_000_000, 100_000_000
_REGISTRY = Path("/run/agentloop-uids")
_FALLBACK = Path("/tmp/agentloop-0/uids")
_lock = threading.Lock()
_held: dict[str, list] = {}  # workspace -> [uid, fd, claims by this process]


def _registry() -> Path:
    for place in (_REGISTRY, _FALLBACK):
        try:
            place.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = place.lstat()
            if st.st_uid == os.getuid() and not st.st_mode & 0o077 and not place.is_symlink():
                return place
        except OSError:
            continue
    raise OSError(errno.EACCES, "no private directory for the workers' uid claims")


def claim(workspace: str) -> int:
    """The uid of ``workspace``'s workers, claimed until as many ``release`` calls as claims."""
    with _lock:
        held = _held.get(workspace)
        if held is not None:
            held[2] += 1
            return held[0]
        registry = _registry()
        start = zlib.crc32(workspace.encode()) % UID_SPAN
        for step in range(UID_SPAN):
            uid = UID_BASE + (start + step) % UID_SPAN
            fd = os.open(registry / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # alive elsewhere: to share only if it is this workspace's
                mine = os.pread(fd, 4096, 0).decode("utf-8", "replace") == workspace
                os.close(fd)
                if mine:
                    _held[workspace] = [uid, None, 1]
                    return uid
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, workspace.encode(), 0)
            _held[workspace] = [uid, fd, 1]
            return uid
    raise OSError(errno.EAGAIN, "every worker uid is claimed")


def of(workspace: str) -> int | None:
    """The uid this process holds for ``workspace``, if it holds one."""
    with _lock:
        held = _held.get(workspace)
        return held[0] if held is not None else None


def release(workspace: str) -> None:
    """Give back one claim of ``workspace``'s uid; the last one frees it for other workspaces."""
    with _lock:
        held = _held.get(workspace)
        if held is None:
            return
        held[2] -= 1
        if held[2] <= 0:
            del _held[workspace]
            if held[1] is not None:
                os.close(held[1])
