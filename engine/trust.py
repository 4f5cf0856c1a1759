"""What the coordinator obeys: files no worker could have written.

agentloop acts on a few files it reads: ``agentloop.toml`` (where requests go, which key they
carry, which Python the workers run), a results file it resumes from, a task file's list of
host files, the workers' Python itself.  Each is obeyed only when no worker could have written
it, which two witnesses tell:

* **owner and mode** (``owner_refusal``): neither the file nor a directory above it belongs to
  a workers' uid (a root coordinator runs its workers as uids of their own), and none of them
  can be written by every user or by a workers' group — except a sticky directory whose entry
  below is root's or the user's, which nobody else may replace;
* **the coordinator's record** (``open_grant``): before a run's first worker starts, agentloop
  notes in its state directory which directory the workers may write, what it keeps read-only
  there (``engine.sandbox``), and, once the last worker is gone, when the run ended.  A path
  beneath such a directory that was not kept read-only and changed — its ctime, which no
  process can set — while workers could write there may be theirs.  As an unprivileged user
  the workers are that user: ownership tells nothing, and this record is the only witness.

A refusal is one line: why, and what to do.  A file changed after the workers were gone is
the user's, so reading it and then ``touch``-ing it is how a user says "this one is mine".
Model code run with ``--sandbox none`` writes whatever the user can; such a run is not
recorded, and nothing is promised about the files it could reach.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from engine.errors import ConfigError, UntrustedFile

__all__ = ["UID_BASE", "UID_SPAN", "Grant", "check", "open_grant", "owner_refusal", "record_directory", "record_refusal", "refusal",
           "refuse_holding_record", "started_at", "state_dir", "state_home"]

#: The uids a root coordinator runs workers as (``engine.sandbox`` hands them out): a file one
#: of them owns is a worker's.
UID_BASE, UID_SPAN = 2_000_000_000, 100_000_000
#: Seconds added on each side of a window: a ctime comes from the kernel's coarse clock, which
#: lags the one the window was noted with by up to a tick; a ctime in whole seconds comes from a
#: file system that keeps no finer one, and gets a second.
MARGIN, MARGIN_COARSE = 0.05, 1.0
#: Windows kept per directory; older ones are merged (their span covers both, what stayed
#: read-only is what stayed so in both), which can only refuse more.
MAX_WINDOWS = 32
#: Seconds between two sweeps of the record for directories that are gone.
PRUNE_EVERY = 3600.0


def state_home() -> Path:
    """Where agentloop keeps what outlives one command: ``$XDG_STATE_HOME/agentloop``, by
    default ``~/.local/state/agentloop`` (the runs' directories, this record)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "agentloop"


def state_dir(*parts: str, base: str | Path | None = None) -> Path:
    """``base`` (default ``state_home()``) / ``parts``, each directory from ``base`` down made mode
    0700 where missing and brought back to 0700 where found with more: what agentloop keeps
    there (the ids of live runs, this record, a server's token) is its user's alone.  OSError
    when one of them is not a directory of this user's."""
    path = Path(base) if base is not None else state_home()
    path.parent.mkdir(parents=True, exist_ok=True)  # (the user's own ~/.local/state: its mode is theirs)
    for depth in range(len(parts) + 1):
        step = path.joinpath(*parts[:depth])
        with contextlib.suppress(FileExistsError):
            os.mkdir(step, 0o700)
        st = os.stat(step)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, f"{step} is not a directory")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{step} belongs to uid {st.st_uid}, not to this user; remove it")
        if st.st_mode & 0o077:
            os.chmod(step, 0o700)
    return path.joinpath(*parts)


def record_directory() -> Path:
    """Where the record lives (a directory of the user's state; a workspace may not hold it)."""
    return state_home() / "writable"


def refuse_holding_record(workspace: str | Path) -> None:
    """ConfigError when ``workspace`` holds the record: its workers could rewrite it."""
    ws, record = os.path.realpath(workspace), os.path.realpath(record_directory())
    if record == ws or record.startswith(ws.rstrip("/") + "/"):
        raise ConfigError(f"the workspace {ws} holds {record}, agentloop's record of what workers could "
                          "write: choose another --workspace (or set XDG_STATE_HOME elsewhere)")


def _worker_id(number: int) -> bool:
    return UID_BASE <= number < UID_BASE + UID_SPAN


# ---------------------------------------------------------------------------------------------
# Owner and mode
# ---------------------------------------------------------------------------------------------

def owner_refusal(path: str | Path) -> str | None:
    """Why the owner or mode of ``path`` (its links followed) or of a directory above it let a
    worker, or any user, put it there — a clause that ends with what to do; None otherwise."""
    real = os.path.realpath(path)
    below: os.stat_result | None = None  # the entry beneath the directory looked at
    for place in (real, *map(str, Path(real).parents)):
        try:
            st = os.lstat(place)
        except FileNotFoundError:
            continue  # (a file not made yet)
        if _worker_id(st.st_uid):
            return (f"{place} belongs to uid {st.st_uid}, which workers of a run write as; read it, and if "
                    f"you want it, make it yours (chown {os.geteuid()} {place})")
        everyone = bool(st.st_mode & stat.S_IWOTH)
        if everyone or (st.st_mode & stat.S_IWGRP and _worker_id(st.st_gid)):
            sticky_guard = (below is not None and st.st_mode & stat.S_ISVTX and not _worker_id(below.st_uid)
                            and below.st_uid in (0, os.geteuid()))
            if not sticky_guard:
                who = "every user" if everyone else f"the workers of a run (group {st.st_gid})"
                return (f"{place} is writable by {who}, so they could have put it there; "
                        f"chmod {'o' if everyone else 'g'}-w {place}, or keep it somewhere only you write")
        below = st
    return None


# ---------------------------------------------------------------------------------------------
# The record of directories workers could write
# ---------------------------------------------------------------------------------------------

def _record_file(directory: str, record: str | None = None) -> Path:
    """The file of the record that holds ``directory``'s windows (``record``: the record's
    directory, when the caller has it already)."""
    name = hashlib.sha256(directory.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return Path(os.path.join(record or str(record_directory()), f"{name}.json"))


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The record's lock (one for the whole record: every change to it is a few small writes)."""
    where = state_dir(record_directory().name)
    st = where.lstat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o077 or stat.S_ISLNK(st.st_mode):
        raise OSError(errno.EPERM, f"{where} is not a private directory of this user; remove it")
    fd = os.open(where / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(file: Path) -> dict | None:
    """The entry in ``file``: {"directory": ..., "windows": [...]}; None when there is none."""
    try:
        return json.loads(file.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        # Written atomically by this module alone: damage is a disk's or a person's.  It may
        # have held windows, so it stands for one that never ended.
        return {"directory": None, "damaged": True, "windows": [{"start": 0.0, "end": None, "pid": 0}]}


def _write(file: Path, entry: dict) -> None:
    temporary = file.with_name(f".{file.name}.{os.getpid()}")
    temporary.write_text(json.dumps(entry))
    os.replace(temporary, file)


_BOOT: str | None = None


def _boot_id() -> str:
    global _BOOT
    if _BOOT is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT = f.read().strip()
        except OSError:
            _BOOT = ""
    return _BOOT


def started_at(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), to tell it from a later one with
    the same pid (None: gone, or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(window: dict) -> bool:
    """Whether the run that opened ``window`` still runs (the same process, this boot)."""
    pid = window.get("pid") or 0
    return window.get("boot") == _boot_id() and pid > 0 and started_at(pid) == window.get("since")


def _compact(windows: list[dict]) -> list[dict]:
    """At most MAX_WINDOWS windows: the two oldest ended ones become one that spans both and
    keeps read-only only what both kept (so it refuses whatever either would)."""
    while len(windows) > MAX_WINDOWS:
        ended = [i for i, w in enumerate(windows) if w.get("end") is not None]
        if len(ended) < 2:
            break
        a, b = windows[ended[0]], windows[ended[1]]
        kept = [k for k in a.get("kept", []) if k in b.get("kept", [])]
        merged = {"start": min(a["start"], b["start"]), "end": max(a["end"], b["end"]), "pid": b.get("pid", 0),
                  "kept": kept}
        windows[ended[0]] = merged
        del windows[ended[1]]
    return windows


class Grant:
    """One directory its workers may write, as the record holds it until ``end``."""

    def __init__(self, directory: str, start: float) -> None:
        self.directory = directory
        self.start = start
        self.ended = False

    def end(self) -> None:
        """Note that no worker writes the directory any more: every one is gone.  Called once
        the run's workers were killed and reaped; a run that dies first leaves its window
        open, and the next look at the record closes it (``_windows_above``)."""
        if self.ended:
            return
        self.ended = True
        file = _record_file(self.directory)
        with contextlib.suppress(OSError), _locked():
            entry = _read(file)
            if not entry or entry.get("damaged"):
                return
            for window in entry["windows"]:
                if window.get("start") == self.start and window.get("pid") == os.getpid():
                    window["end"] = time.time()
            _write(file, entry)


def _prune() -> None:
    """Forget directories that are gone and whose runs all ended (at most every PRUNE_EVERY
    seconds: a batch notes a directory per run).  Called with the lock held."""
    marker = record_directory() / ".pruned"
    with contextlib.suppress(OSError):
        if time.time() - marker.stat().st_mtime < PRUNE_EVERY:
            return
    marker.touch()
    for file in record_directory().glob("*.json"):
        entry = _read(file)
        if (entry and not entry.get("damaged") and not os.path.lexists(entry.get("directory") or "")
                and all(w.get("end") is not None or not _alive(w) for w in entry["windows"])):
            with contextlib.suppress(OSError):
                file.unlink()


def open_grant(directory: str | Path, kept: Iterable[str] = ()) -> Grant:
    """Record, before any worker may write ``directory``, that from now on they may, and which
    paths beneath it stay read-only (``kept``: bound read-only in every worker's view).
    ConfigError when the record cannot be written: a run whose writes could not be told apart
    later does not start."""
    directory = os.path.realpath(directory)
    kept_now = []
    for path in kept:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            kept_now.append([os.path.realpath(path), st.st_dev, st.st_ino])
    start = time.time()
    window = {"start": start, "end": None, "pid": os.getpid(), "since": started_at(os.getpid()), "boot": _boot_id(),
              "kept": kept_now}
    file = _record_file(directory)
    try:
        with _locked():
            entry = _read(file)
            if not entry or entry.get("damaged") or entry.get("directory") != directory:
                entry = {"directory": directory, "windows": []}
                _prune()
            entry["windows"] = _compact([*entry["windows"], window])
            _write(file, entry)
    except OSError as exc:
        raise ConfigError(f"cannot note in {record_directory()} that workers may write {directory} ({exc}); "
                          "agentloop needs that note to tell their files from yours later: make that "
                          "directory writable, or set XDG_STATE_HOME to one that is") from None
    return Grant(directory, start)


def _windows_above(path: str) -> list[tuple[str, dict]]:
    """(directory, window) of every recorded directory that is ``path`` or lies above it.
    A window whose run died without ending it is ended now, at the time it was noticed."""
    places = [path, *map(str, Path(path).parents)]
    record = str(record_directory())  # (once: every command asks this of many paths)
    files = [(place, _record_file(place, record)) for place in places]
    files = [(place, file) for place, file in files if os.path.lexists(file)]
    if not files:
        return []
    found: list[tuple[str, dict]] = []
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError):
            stack.enter_context(_locked())  # (a reader that cannot lock still reads)
        for place, file in files:
            entry = _read(file)
            if entry is None or not (entry.get("damaged") or entry.get("directory") == place):
                continue
            stale = [w for w in entry["windows"] if w.get("end") is None and not entry.get("damaged")
                     and not _alive(w)]
            for window in stale:
                window["end"] = time.time()
            if stale:
                with contextlib.suppress(OSError):
                    _write(file, entry)
            found += [(place, {**w, "damaged": file} if entry.get("damaged") else w) for w in entry["windows"]]
    return found


def _kept(window: dict, path: str) -> bool:
    """Whether ``window`` kept ``path`` read-only: it lies at or beneath a path bound read-only
    then that is still the same file or directory (one replaced since, by whoever, is not)."""
    for where, dev, ino in window.get("kept", []):
        if path == where or path.startswith(where.rstrip("/") + "/"):
            with contextlib.suppress(OSError):
                st = os.lstat(where)
                if (st.st_dev, st.st_ino) == (dev, ino) and not stat.S_ISLNK(st.st_mode):
                    return True
    return False


def _clock(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def _said(directory: str, window: dict) -> str:
    if window.get("damaged"):
        return f"the record {window['damaged']} of what workers wrote in {directory} is damaged"
    if window.get("end") is None:
        return (f"the workers of a run that is still going (pid {window.get('pid')}, since "
                f"{_clock(window['start'])}) can write {directory}")
    return (f"the workers of a run (pid {window.get('pid')}, {_clock(window['start'])} to "
            f"{_clock(window['end'])}) could write {directory}")


def record_refusal(path: str | Path, *, tree: str | Path | None = None, links_only: bool = False) -> str | None:
    """Why the record says a worker may have written ``path`` — a clause that ends with what
    to do — or None.

    ``path`` is looked at as named (each link on the way is an entry a worker could have made)
    and resolved (unless ``links_only``: a file agentloop is about to write, not read, where
    only a link would send its writes elsewhere).  ``tree``: a directory whose whole content
    counts (a virtual environment, whose files nobody can check one by one): it is refused if
    it was there, not kept read-only, while workers could write around it."""
    named = os.path.abspath(path)
    looked: list[tuple[str, os.stat_result, str]] = []  # (path, its status, kind)
    parts = Path(named).parts
    for depth in range(2, len(parts) + 1):
        place = os.path.join(*parts[:depth])
        with contextlib.suppress(OSError):
            st = os.lstat(place)
            if stat.S_ISLNK(st.st_mode):
                looked.append((place, st, "link"))
    with contextlib.suppress(OSError):
        if not links_only:
            looked.append((os.path.realpath(named), os.stat(named), "file"))
    if tree is not None:
        tree = os.path.realpath(tree)
        with contextlib.suppress(OSError):
            birth = os.path.join(tree, "pyvenv.cfg")  # written once, when the environment is made
            looked.append((tree, os.stat(birth if os.path.exists(birth) else tree), "tree"))
    for place, st, kind in looked:
        when = st.st_ctime
        margin = MARGIN_COARSE if st.st_ctime_ns % 1_000_000_000 == 0 else MARGIN
        for directory, window in _windows_above(place):
            if _kept(window, place):
                continue
            low = window["start"] - margin
            high = math.inf if window.get("end") is None else window["end"] + margin
            if not (when <= high if kind == "tree" else low <= when <= high):
                continue
            why = _said(directory, window)
            if window.get("damaged"):
                return f"{why}; check {directory}, then remove {window['damaged']}"
            if kind == "tree":
                return (f"it was there, not kept read-only, while {why}; recreate it "
                        f"(python3 -m venv --clear {place}) or choose one elsewhere")
            changed = f"{'the link ' if kind == 'link' else ''}{place} changed at {_clock(when)}, while {why}"
            if window.get("end") is None:
                return f"{changed}; once that run has ended, read it, and if it is yours, touch it"
            if kind == "link":
                return (f"{changed}; if it points where you want ({os.readlink(place)}), "
                        f"make it again: ln -sfn {os.readlink(place)} {place}")
            return f"{changed}; read it, and if it is yours, mark it so: touch {place}"
    return None


def refusal(path: str | Path, *, tree: str | Path | None = None) -> str | None:
    """Why a worker could have written ``path`` (by its owner and mode, or by the record), as
    a clause that ends with what to do; None when no worker could have.  A path that does not
    exist yet is judged by the links on its way only."""
    return owner_refusal(path) or record_refusal(path, tree=tree)


def check(path: str | Path, what: str, *, same_as: os.stat_result | None = None, writing: bool = False) -> None:
    """UntrustedFile, in one line (``"<what> <path> is not used: <why>"``), when a worker could
    have written ``path``.  ``same_as``: the ``fstat`` of the descriptor the caller reads it
    from, which must be the file judged (one swapped in meanwhile is refused too).
    ``writing``: ``path`` is only written (a recording), so only a link a worker could have
    made on its way counts."""
    why = record_refusal(path, links_only=True) if writing else refusal(path)
    if not why and same_as is not None:
        with contextlib.suppress(OSError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (same_as.st_dev, same_as.st_ino):
                return
        why = "it was replaced while it was read; run again"
    if why:
        raise UntrustedFile(f"{what} {path} is not used: {why}")
