"""A memory cgroup and a pids cgroup per worker: its limits bound the whole tree.

RLIMIT_DATA counts a process's private writable memory and nothing else, so shared memory
escapes it: ``memfd_create``, files in /dev/shm or /tmp (tmpfs), SysV segments and
``mmap(MAP_SHARED | MAP_ANONYMOUS)`` — one worker held 3 GiB under a 2 GiB RLIMIT_DATA.  A
memory cgroup charges every page a process faults in, shared or not, to the cgroup, so the
limit holds for the worker and everything it starts, together.  RLIMIT_NPROC counts the tasks
of a uid, which all the workers of a run share: a pids cgroup is each worker's own count.

The coordinator makes ``agentloop-<pid>-<run>/w<N>`` beneath its own cgroup in each hierarchy
(cgroup v2, or the v1 hierarchy of the controller, where it may write there: root, or a
delegated subtree) and moves a worker's processes in while it starts, checking again after its
handshake, before it has run any code.  An unprivileged user may write a cgroup that was
delegated to them: systemd's (``systemd-run --user --scope -p Delegate=yes agentloop ...``,
cgroup v2) or a subtree an administrator handed over.  cgroup v2 hands a controller only to the
children of a cgroup that holds no process, so in a delegated one the coordinator first moves
itself into a leaf of its own (``agentloop-<pid>-self``), as systemd's documentation asks.  A
fork server makes each worker's namespace init ahead of its request; ``SpareGroups`` puts that
init in cgroups of its own ahead too, so the worker is born in them and its start waits for no
move.  Where no memory cgroup can be made the sandbox refuses
the shared-memory calls instead (see ``engine.sandbox``), and says so; where no pids cgroup can
be made, RLIMIT_NPROC bounds the processes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from engine.launch._process import descendants

log = logging.getLogger("agentloop")

_PREFIX = "agentloop-"


def _mounts(controller: str) -> tuple[Path | None, Path | None]:
    """(v1 hierarchy of ``controller``, v2 hierarchy) as (mount point, the mount's own root)."""
    v1 = v2 = None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            root, point = fields[3], fields[4].encode().decode("unicode_escape")
            if tail[0] == "cgroup" and controller in tail[2].split(","):
                v1 = (Path(point), root)
            elif tail[0] == "cgroup2" and v2 is None:
                v2 = (Path(point), root)
    return v1, v2  # type: ignore[return-value]


def _own_dir(mount: tuple[Path, str] | None, v1: bool, controller: str) -> Path | None:
    """This process's cgroup directory in the hierarchy mounted at ``mount``."""
    if mount is None:
        return None
    point, root = mount
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (v1 and controller in controllers.split(",")) or (not v1 and controllers == ""):
                if not (path == root or path.startswith(root.rstrip("/") + "/")):
                    return None  # our cgroup lies outside what this mount shows
                return point / path[len(root.rstrip("/")):].lstrip("/")
    return None


class WorkerCgroups:
    """The coordinator's cgroups of one controller (``memory``, or ``pids``: the process limit
    of each worker): one parent for an engine, one child per worker."""

    def __init__(self, base: Path, v1: bool, controller: str = "memory") -> None:
        self.base = base
        self.v1 = v1
        self.controller = controller

    @classmethod
    def find(cls, name: str = "", controller: str = "memory") -> WorkerCgroups | None:
        """A parent cgroup for one engine's workers (``agentloop-PID-NAME``: a process may run
        several engines, a batch does), or None where this process may not make one (most
        unprivileged users, a hierarchy without the controller)."""
        v1_mount, v2_mount = _mounts(controller)
        for v1, mount in ((True, v1_mount), (False, v2_mount)):
            own = _own_dir(mount, v1, controller)
            if own is None or not os.access(own, os.W_OK):
                continue
            if not v1:
                own = _v2_parent(own, controller)
                if own is None:
                    continue
            _remove_stale(own)
            base = own / f"{_PREFIX}{os.getpid()}-{name}"
            try:
                base.mkdir(exist_ok=True)
                if not v1:
                    (base / "cgroup.subtree_control").write_text(f"+{controller}")
            except OSError as exc:
                log.info("no %s cgroup in %s: %s", controller, own, exc)
                _rmdir(base)
                continue
            return cls(base, v1, controller)
        return None

    def make(self, name: str, limit: int) -> Path | None:
        """A cgroup limited to ``limit``: bytes of memory (swap included, where the kernel
        accounts it), or processes and threads for ``pids``."""
        group = self.base / name
        try:
            group.mkdir(exist_ok=True)
            if self.controller == "pids":
                (group / "pids.max").write_text(str(limit))
            elif self.v1:
                (group / "memory.limit_in_bytes").write_text(str(limit))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
            else:
                (group / "memory.max").write_text(str(limit))
                with contextlib.suppress(OSError):
                    (group / "memory.swap.max").write_text("0")
        except OSError as exc:
            log.warning("could not make the %s cgroup %s: %s", self.controller, group, exc)
            _rmdir(group)
            return None
        return group

    @staticmethod
    def adopt_tree(group: Path, root: int, moved: set[int], rounds: int = 50) -> bool:
        """Move process ``root`` and everything below it (threads and all) into ``group``,
        top-down until no process of the tree is left outside (a child forked after its parent
        moved is born inside); ``moved`` records what was moved, so a second call only moves
        what appeared since.  False if a live process could not be moved.  A move costs a
        few milliseconds (the kernel waits out an RCU grace period): callers run this while
        the worker starts, off the event loop."""
        for _ in range(rounds):
            todo = [pid for pid in (root, *descendants(root)) if pid not in moved]
            if todo:  # born inside (a child of a process moved before), or put there ahead: no move
                with contextlib.suppress(OSError, ValueError):
                    inside = set(map(int, (group / "cgroup.procs").read_text().split()))
                    moved.update(pid for pid in todo if pid in inside)
                    todo = [pid for pid in todo if pid not in inside]
            if not todo:
                return True
            for pid in todo:
                try:
                    (group / "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:
                    pass
                except OSError as exc:
                    if os.path.exists(f"/proc/{pid}"):
                        log.warning("could not move process %d into %s: %s", pid, group, exc)
                        return False
                moved.add(pid)
        return False

    def oom_killed(self, group: Path) -> bool:
        """Whether the kernel killed a process of ``group`` for going over its limit."""
        return self.oom_kills(group) > 0

    def oom_kills(self, group: Path) -> int:
        """How many processes of ``group`` the kernel killed for going over its limit."""
        name = "memory.oom_control" if self.v1 else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            for line in (group / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def held(self, group: Path, within: int = 0) -> int | None:
        """Bytes of memory charged to ``group`` that reclaim cannot free (all of it but the
        page cache of files: anonymous and shared memory, tmpfs, socket buffers, kernel
        objects); None for a ``pids`` group or where it cannot be read.  A charge of at most
        ``within`` bytes in all is returned as it is, without reading what of it is cache (read
        after every code sample: one small read, most times)."""
        if self.controller != "memory":
            return None
        try:
            used = int(_read(group / ("memory.usage_in_bytes" if self.v1 else "memory.current")))
            if used <= within:
                return used
            for line in _read(group / "memory.stat").splitlines():
                key, _, value = line.partition(b" ")
                if key in (b"active_file", b"inactive_file"):
                    used -= int(value)
        except (OSError, ValueError):
            return None
        return used

    @staticmethod
    def remove(group: Path) -> None:
        _rmdir(group)

    def close(self) -> None:
        """Remove every worker cgroup left, then the parent (only empty ones can go)."""
        with contextlib.suppress(OSError):
            for child in self.base.iterdir():
                if child.is_dir():
                    _rmdir(child)
        _rmdir(self.base)


def _v2_parent(own: Path, controller: str) -> Path | None:
    """Where this process makes worker cgroups in the v2 hierarchy: its own cgroup where that
    can hand ``controller`` to children; else, where its own is delegated to it but holds
    processes (this one), that cgroup, once this process has moved into a leaf of its own there
    (only itself: another process left there keeps the controller from the children, and then
    there is no cgroup here).  None: no worker cgroups."""
    leaf = f"{_PREFIX}{os.getpid()}-self"
    if own.name == leaf:  # moved there by an earlier call
        own = own.parent
    if _v2_controller_for_children(own, controller):
        return own
    if not _delegated(own):  # (root may write any cgroup: only one handed over is rearranged)
        return None
    try:
        (own / leaf).mkdir(exist_ok=True)
        (own / leaf / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        log.info("cannot leave the cgroup %s for a leaf: %s", own, exc)
        _rmdir(own / leaf)
        return None
    return own if _v2_controller_for_children(own, controller) else None


def _delegated(group: Path) -> bool:
    """Whether ``group`` was handed to this process's user to arrange: it is theirs (not
    root's), or systemd marked it delegated (``Delegate=yes``: the ``user.delegate`` or
    ``trusted.delegate`` attribute)."""
    try:
        if os.geteuid() != 0 and group.stat().st_uid == os.geteuid():
            return True
    except OSError:
        return False
    for name in ("user.delegate", "trusted.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(group, name).strip(b"\0") == b"1":
                return True
    return False


def _v2_controller_for_children(own: Path, controller: str) -> bool:
    """cgroup v2 hands a controller to children only through ``subtree_control``, and only
    where the parent holds no process (the root excepted)."""
    try:
        if controller in (own / "cgroup.subtree_control").read_text().split():
            return True
        if controller not in (own / "cgroup.controllers").read_text().split():
            return False
        (own / "cgroup.subtree_control").write_text(f"+{controller}")
        return True
    except OSError:
        return False


def _remove_stale(own: Path) -> None:
    """Remove the cgroups of coordinators that died without cleaning up (SIGKILL)."""
    with contextlib.suppress(OSError):
        for entry in own.iterdir():
            pid = entry.name[len(_PREFIX):].split("-")[0]
            if entry.name.startswith(_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                for child in list(entry.iterdir()):
                    if child.is_dir():
                        _rmdir(child)
                _rmdir(entry)


def delegation_hint() -> str:
    """How an unprivileged user gets a cgroup of their own here, in a sentence."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    run = "systemd-run --user --scope -p Delegate=yes agentloop ..."
    if os.path.exists(os.path.join(runtime, "systemd", "private")):  # a user manager runs
        return f"run agentloop as `{run}`"
    if os.path.isdir("/run/systemd/system"):
        return (f"you have no systemd user manager: `loginctl enable-linger {_user()}` (as root) starts one, "
                f"then run agentloop as `{run}`")
    return ("ask an administrator to delegate a cgroup subtree to you (make it, chown it and its "
            "cgroup.procs to you, start your shell in it)")


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return "$USER"


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


class SpareGroups:
    """Cgroups made and entered ahead, for a fork server's spare namespace inits (made before
    the request they serve: ``worker.fork_server._Init``).  The worker forked from one is born in
    its cgroups, so its start waits for no move (each waits out an RCU grace period: from 1 to
    over 10 ms on a busy machine).  ``cgroups``: the parents to make them in, each with the
    limit a worker gets there."""

    def __init__(self, cgroups: list[tuple[WorkerCgroups, int]]) -> None:
        self.cgroups = cgroups
        self._made: dict[int, Future] = {}  # a spare init's host pid -> its groups, once entered
        self._names = itertools.count(1)
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="agentloop-cgroups")

    def prepare(self, pid: int) -> None:
        """Make and enter cgroups for spare init ``pid``, in a thread; returns at once."""
        if self.cgroups:
            with contextlib.suppress(RuntimeError):  # (closed: none are made any more)
                self._made[pid] = self._threads.submit(self._enter, pid, next(self._names))

    def _enter(self, pid: int, number: int) -> list[Path] | None:
        groups: list[Path] = []
        for cgroups, limit in self.cgroups:
            group = cgroups.make(f"spare{number}", limit)
            if group is not None:
                groups.append(group)
            if group is None or not WorkerCgroups.adopt_tree(group, pid, set()):
                for made in groups:
                    _rmdir(made)
                return None
        return groups

    def take(self, pid: int, timeout: float = 30.0) -> list[Path] | None:
        """(In a thread.) The cgroups made for spare init ``pid`` — it is inside them — or None
        when there are none (not a spare, or they could not be made)."""
        made = self._made.pop(pid, None)
        if made is None:
            return None
        with contextlib.suppress(Exception):
            return made.result(timeout)
        return None

    def close(self) -> None:
        """Remove the cgroups no worker took (once their inits are gone: a little patience)."""
        self._threads.shutdown(wait=True)
        left = [g for made in self._made.values() if made.done() and not made.exception()
                for g in (made.result() or [])]
        self._made.clear()
        for _ in range(100):  # (an init killed a moment ago may still be leaving its group)
            for group in list(left):
                with contextlib.suppress(OSError):
                    group.rmdir()
                    left.remove(group)
            if not left:
                return
            time.sleep(0.02)
