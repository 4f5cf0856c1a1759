"""The uids a root coordinator runs workers as: one per workspace, never handed to a new
workspace while anything of an earlier holder could use it.

Each uid has a file in a root-only registry that names the workspace it was last given to; a
claim is a shared ``flock`` on that file.  Every holder holds its own: each process that runs
workers on a workspace (a second run on it included) locks the uid's file, so the uid stays
claimed until the last of them ends, however it ends (a lock lives as long as its descriptor:
SIGKILL frees it).  A uid nobody holds goes to another workspace only when

- no process runs with it (``/proc``): the workers of a coordinator killed by SIGKILL die a
  moment after it (with their PID namespace), and what they started without one may live on;
- the workspace it served no longer carries it (is gone, or in another group): its files
  still belong to the uid, and whoever gets it next could read them where it sees them.

The first uid a workspace tries is a keyed hash of its path (the key: random, made once, in
the registry), then the next ones: so whoever names a workspace cannot choose one that
collides with another's, and a workspace keeps its uid from run to run.  The registry is
persistent where it can be (``/var/lib``), so that holds across reboots too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# Root workers switch to a uid in UID_BASE + [0, UID_SPAN): engine.trust defines the range, as it
# judges files by their owner.
from engine.trust import UID_BASE, UID_SPAN

__all__ = ["UID_BASE", "UID_SPAN", "claim_uid", "first_uid", "release_uid", "uid_of"]

_PLACES = (Path("/var/lib/agentloop/uids"), Path("/run/agentloop-uids"), Path("/tmp/agentloop-0/uids"))
_KEY = "key"
_MUTEX = ".lock"
_MUTEX_WAIT = 10.0  # seconds: the registry is locked for milliseconds at a time
_lock = threading.Lock()
_held: dict[str, list] = {}  # workspace -> [uid, fd, claims by this process]
_keys: dict[Path, bytes] = {}  # registry -> its key, once read


def _registry() -> Path:
    for place in _PLACES:
        try:
            place.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = place.lstat()
            if st.st_uid == os.getuid() and not st.st_mode & 0o077 and not place.is_symlink():
                return place
        except OSError:
            continue
    raise OSError(errno.EACCES, "no private directory for the workers' uid claims")


@contextlib.contextmanager
def _exclusive(registry: Path) -> Iterator[None]:
    """The registry to this process alone, across processes: every claim is decided under
    it, so a uid's file changes hands with nobody else looking."""
    fd = os.open(registry / _MUTEX, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + _MUTEX_WAIT
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(errno.EAGAIN, f"the uid registry {registry} stayed locked for "
                                                f"{_MUTEX_WAIT:.0f} s (a stopped agentloop?)") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        yield
    finally:
        os.close(fd)  # (the lock goes with it)


def _key(registry: Path) -> bytes:
    """The registry's hash key, made on first use (under ``_exclusive``)."""
    if registry not in _keys:
        _keys[registry] = _read_key(registry)
    return _keys[registry]


def _read_key(registry: Path) -> bytes:
    path = registry / _KEY
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            key = os.read(fd, 64)
        finally:
            os.close(fd)
        if len(key) == 32:
            return key
        os.unlink(path)  # torn by a crash while it was made: nothing was handed out with it
        return _read_key(registry)
    try:
        key = os.urandom(32)
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def first_uid(workspace: str) -> int:
    """The uid ``workspace`` tries first (it gets it unless another workspace holds it)."""
    with _lock:
        registry = _registry()
        if registry not in _keys:
            with _exclusive(registry):
                _key(registry)
        return _first(_keys[registry], workspace)


def _first(key: bytes, workspace: str) -> int:
    digest = hmac.new(key, workspace.encode("utf-8", "surrogateescape"), hashlib.sha256).digest()
    return UID_BASE + int.from_bytes(digest[:8], "big") % UID_SPAN


def claim_uid(workspace: str) -> int:
    """The uid of ``workspace``'s workers, claimed until as many ``release`` calls as claims
    (or until this process ends).  Raises OSError when no uid can be claimed."""
    with _lock:
        held = _held.get(workspace)
        if held is not None:
            held[2] += 1
            return held[0]
        registry = _registry()
        with _exclusive(registry):
            start = _first(_key(registry), workspace) - UID_BASE
            for step in range(UID_SPAN):
                uid = UID_BASE + (start + step) % UID_SPAN
                fd = _take(registry, uid, workspace)
                if fd is not None:
                    _held[workspace] = [uid, fd, 1]
                    return uid
    raise OSError(errno.EAGAIN, "every worker uid is claimed")


def _take(registry: Path, uid: int, workspace: str) -> int | None:
    """A descriptor holding a claim on ``uid`` for ``workspace``, or None when the uid is not
    this workspace's to have (see the module docstring)."""
    fd = os.open(registry / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        served = os.pread(fd, 4096, 0).decode("utf-8", "surrogateescape")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: to share only if it is this workspace's
            if served != workspace:
                raise
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (its holders' locks are all shared)
            return fd
        if served and served != workspace:
            if _carries(served, uid) or _running(uid):
                raise BlockingIOError
            os.ftruncate(fd, 0)
        if served != workspace:
            os.pwrite(fd, workspace.encode("utf-8", "surrogateescape"), 0)
        fcntl.flock(fd, fcntl.LOCK_SH)  # not atomic, but nobody claims meanwhile: ``_exclusive``
        return fd
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise


def _carries(workspace: str, uid: int) -> bool:
    """Whether directory ``workspace`` still belongs to ``uid``'s group (as the sandbox left
    it for the run: ``engine.sandbox._share_with_run``)."""
    try:
        return os.lstat(workspace).st_gid == uid
    except OSError:
        return False


def _running(uid: int) -> bool:
    """Whether a process runs with ``uid`` (or its group) as any of its ids.  A second look
    at the processes that appeared during the first catches a chain of forks that moved on."""
    seen: set[str] = set()
    for _ in range(2):
        names = {name for name in os.listdir("/proc") if name.isdigit()} - seen
        for name in names:
            if _has_id(name, uid):
                return True
        seen |= names
    return False


def _has_id(pid: str, uid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:  # gone meanwhile
        return False
    wanted = str(uid).encode()
    for field in (b"\nUid:", b"\nGid:"):
        at = status.find(field)
        if at >= 0 and wanted in status[at + len(field):status.find(b"\n", at + 1)].split():
            return True
    return False


def uid_of(workspace: str) -> int | None:
    """The uid this process holds for ``workspace``, if it holds one."""
    with _lock:
        held = _held.get(workspace)
        return held[0] if held is not None else None


def release_uid(workspace: str) -> None:
    """Give back one claim of ``workspace``'s uid; the last one of this process lets it go."""
    with _lock:
        held = _held.get(workspace)
        if held is None:
            return
        held[2] -= 1
        if held[2] <= 0:
            del _held[workspace]
            os.close(held[1])
