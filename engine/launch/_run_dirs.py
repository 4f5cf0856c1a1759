"""A run's directories on the host: its workspace, held while the run uses it, and the private
directories its sockets and outputs live in, cleared of what killed runs left."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import os
import pwd
import stat
import tempfile
from pathlib import Path

from engine.errors import ConfigError
from engine.trees import remove_tree

__all__ = ["file_part", "give_back", "held_alone", "hold_workspace", "missing_dirs", "private_dir", "remove_stale_runs",
           "runtime_dir", "runtime_home"]

log = logging.getLogger("agentloop")


def file_part(block_id: str) -> str:
    """``block_id`` as a short file-name part: ASCII letters, digits, ``-`` and ``.`` as they
    are, every other character as ``_`` and its UTF-8 bytes in hex (so ``x/y`` and ``x_y``
    stay apart), cut at 48 characters."""
    out = "".join(c if c.isascii() and (c.isalnum() or c in "-.") else
                  "".join(f"_{b:02x}" for b in c.encode()) for c in block_id)
    return out.lstrip(".")[:48]


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and each of its parents that does not exist, deepest first."""
    missing = []
    for place in (path.absolute(), *path.absolute().parents):
        if os.path.lexists(place):
            break
        missing.append(place)
    return missing


def hold_workspace(workspace: Path) -> int | None:
    """``workspace``, made if missing, open with a shared ``flock`` on it: every run on a
    workspace holds one while it lives, and the run that made it removes it only when it can
    lock it alone (``Launcher.close``), so that no run removes a workspace another one (of this
    process or another) has started to use.  None when something else holds it exclusively (a
    worker may): then no run removes it while that lasts."""
    for _ in range(8):  # each turn lost to a run removing it at that moment: a few at most
        workspace.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(workspace)):
                return fd
        os.close(fd)  # removed between the look and the lock: make it again
    raise OSError(errno.EAGAIN, f"the workspace {workspace} was removed under this run again and again")


def held_alone(fd: int) -> bool:
    """Whether the lock on ``fd`` (``hold_workspace``'s) could be made exclusive: no other run holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def give_back(fd: int, found: os.stat_result) -> None:
    """The directory open as ``fd`` gets back the group and mode it had when ``found`` was taken:
    a run as root shares its workspace with its workers' group (``sandbox``, mode 3770), and the
    user's directory must not keep that after the run."""
    with contextlib.suppress(OSError):
        now = os.fstat(fd)
        if now.st_gid != found.st_gid and now.st_uid == found.st_uid:
            os.fchown(fd, -1, found.st_gid)
        if stat.S_IMODE(now.st_mode) != stat.S_IMODE(found.st_mode):
            os.fchmod(fd, stat.S_IMODE(found.st_mode))


#: The longest directory the runtime directory may be made in: an ipc:// path must fit in 107
#: bytes, and a run's socket paths take about 60 of them beneath it.
_SHORT = 40
_fallback: Path | None = None  # this process's private runtime directory, once the usual one was refused


def runtime_home() -> Path:
    """Where the runtime directory usually is: ``$XDG_RUNTIME_DIR/agentloop``, else
    ``$TMPDIR/agentloop-UID`` (``/tmp`` by default, and when ``$TMPDIR`` is too long)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and len(xdg) < _SHORT:
        return Path(xdg) / "agentloop"
    return _temp_base() / f"agentloop-{os.getuid()}"


def _temp_base() -> Path:
    tmp = os.environ.get("TMPDIR")
    return Path(tmp) if tmp and os.path.isabs(tmp) and len(tmp) < _SHORT and os.path.isdir(tmp) else Path("/tmp")


def runtime_dir() -> Path:
    """The private directory a run's sockets live in: ``runtime_home()``, made 0700 if missing.

    In a shared sticky ``/tmp`` another user can make ``agentloop-UID`` first (a directory, a
    link, a file, a fifo), and this user cannot remove it: then this process makes a directory
    of its own instead (``agentloop-UID-PID-RANDOM`` beside it, by ``mkdtemp``: a name nobody
    can make first) and says so once, naming what was in the way.  What a killed process left
    in such a directory is removed by the next one that falls back."""
    global _fallback
    home = runtime_home()
    try:
        return private_dir(home)
    except (ConfigError, OSError) as exc:
        why = str(exc) if isinstance(exc, ConfigError) else f"{home}: {exc.strerror or exc}"
    if _fallback is not None and _fallback.is_dir():
        return _fallback
    base = _temp_base()
    _remove_stale_fallbacks(base)
    _fallback = Path(tempfile.mkdtemp(prefix=f"agentloop-{os.getuid()}-{os.getpid()}-", dir=base))
    atexit.register(_remove_if_empty, _fallback)
    log.warning("%s; using %s for this process instead", why.removesuffix("; remove it and retry"), _fallback)
    return _fallback


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _remove_stale_fallbacks(base: Path) -> None:
    """Remove the fallback directories of this user's processes that no longer run."""
    prefix = f"agentloop-{os.getuid()}-"
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            pid = entry.name[len(prefix):].split("-", 1)[0]
            if not entry.name.startswith(prefix) or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
                    remove_tree(Path(entry.path))


def remove_stale_runs(parent: Path) -> None:
    """Remove what coordinators that were killed (SIGKILL, a crash) left in ``parent``: run
    directories are named ``DATE-TIME-PID-HEX``, and one whose PID no longer runs is stale.
    A PID taken again by another process keeps its directory until that one ends too; a run
    that was asked to keep its output (a ``.kept`` file) keeps it."""
    with contextlib.suppress(OSError):
        for entry in list(parent.iterdir()):
            fields = entry.name.split("-")
            if (len(fields) == 4 and fields[2].isdigit() and int(fields[2]) != os.getpid()
                    and not os.path.exists(f"/proc/{fields[2]}") and entry.is_dir()
                    and not entry.is_symlink() and entry.lstat().st_uid == os.getuid()
                    and not (entry / ".kept").exists()):
                remove_tree(entry)


def private_dir(path: Path) -> Path:
    """``path``, made mode 0700 if missing; ConfigError unless it is this user's and no one else's."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        kind = "a link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else \
            "a fifo" if stat.S_ISFIFO(st.st_mode) else "a file"
        owner = "yours" if st.st_uid == os.getuid() else f"uid {st.st_uid}'s ({_name(st.st_uid)})"
        raise ConfigError(f"{path} is not a private directory of this user (it is {kind}, {owner}, mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); remove it and retry")
    return path


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no user name"
