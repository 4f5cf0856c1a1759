"""Sandbox policy (data) and the launch plan that applies it (a separate step).

A worker is confined by two cooperating halves:

* outside, `plan()` builds a bubblewrap command line: a fresh mount namespace holding a
  read-only system, the worker's Python, the current directory (a project directory only) and
  the run's output and socket directories read-only, the workspace read-write, a private
  size-capped /tmp; new PID, IPC, UTS, cgroup and (unless allowed) network namespaces;
* inside, the worker applies `plan.confine` (a `worker.contract.confinement.Confinement`): resource limits, drops root to the run's
  unprivileged uid, clears every capability, sets no_new_privs, installs a Landlock ruleset and
  a seccomp filter before any user code runs.

The process that applies the inside half starts with privileges (root's, or the fork server's
namespace capabilities), so it is started by `runtime_argv`: nothing a worker could have
written is on its import path.

Where bubblewrap is missing or user namespaces are refused, the inside half still runs and a
note says what is lost.  Nothing is ever weakened silently: every missing layer is one line in
`LaunchPlan.notes`, and a mode that requires a layer raises `SandboxError` when it is absent.

Environment: bwrap passes on the environment it was started with, and the coordinator builds
that from an allowlist.  `--clearenv`/`--setenv` are not used because their values would sit in
bwrap's command line, which every local user can read in /proc; `LaunchPlan.env` lists the few
variables the sandbox needs on top (HOME, TMPDIR).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from engine.errors import ConfigError, SandboxError, TreeError
from engine.sandbox import _uid0, _uids
from engine.sandbox._bwrap import Bwrap, View, beneath
from engine.sandbox._host import HostSupport, host_support, readable_in_view, root_blocker
from engine.sandbox._interpreter import python_paths
from engine.sandbox._protected import privileged_files, unkept_note
from engine.trees import disk_usage
from worker.contract.confinement import Confinement, Landlock, Seccomp

__all__ = [
    "GiB", "LaunchPlan", "MODES", "MiB", "SandboxPolicy", "plan", "server_plan", "shareable_cwd", "system_paths", "tools_plan", "workspace_excess"
]

GiB = 1024**3
MiB = 1024**2

MODES = ("auto", "bwrap", "landlock", "none")

_INSTALL_HINT = "Install it: apt-get install bubblewrap"
_FALLBACK = "running with Landlock+seccomp+rlimits only (no PID/network namespace, no private /tmp)"

# The few host files under /etc that Python, the dynamic linker and name resolution read.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "passwd", "group", "hosts",
        "host.conf", "gai.conf", "resolv.conf", "localtime", "timezone", "ssl/certs",
        "ssl/openssl.cnf", "ca-certificates",
        "ca-certificates.conf", "pki", "crypto-policies", "mime.types", "alternatives", "os-release",
        "fonts")  # (fontconfig's configuration: matplotlib and Pillow look fonts up through it)
_TOP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # merged-/usr symlinks or dirs
_DEV_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_CPU_INFO = "/sys/devices/system/cpu"  # read by os.cpu_count() and BLAS thread pools


_AF_UNIX, _AF_INET, _AF_NETLINK, _AF_INET6 = 1, 2, 16, 10


@dataclass(frozen=True)
class SandboxPolicy:
    """What a worker may do. Pure data: `plan()` turns it into a launch.

    mode: "auto" strongest available, with a note for every missing layer; "bwrap" require
    bubblewrap; "landlock" never use bubblewrap (Landlock+seccomp+rlimits, Landlock required);
    "none" unsandboxed."""

    mode: str = "auto"
    network: bool = False
    memory_bytes: int = 2 * GiB          # the worker's whole tree (cgroup), RLIMIT_DATA per process
    cpu_seconds: int | None = None       # RLIMIT_CPU, per process
    max_processes: int = 256             # per worker, threads too: pids cgroup or RLIMIT_NPROC (`_nproc`)
    max_open_files: int = 1024           # RLIMIT_NOFILE
    max_file_bytes: int = 1 * GiB        # RLIMIT_FSIZE: largest file the worker can write
    tmp_bytes: int = 512 * MiB           # size of the private /tmp (and, separately, /dev/shm)
    workspace_bytes: int | None = 8 * GiB  # checked by the coordinator: `workspace_excess`
    worker_uid: int | None = None        # root only: the uid workers run as; None derives one
    share_cwd: bool | None = None        # None: only a project directory (see `shareable_cwd`)
    hidden: tuple[str, ...] = ()         # never shown, even beneath the shown cwd (see `plan`)
    as_caller: bool = False              # code runs as the user running agentloop (see `plan`)


@dataclass
class LaunchPlan:
    """How to start one sandboxed process: its bubblewrap sandbox (None without one: the
    Landlock fallback, or no sandbox), the spec it applies to itself before running anything it
    was given (JSON-able), one-line notes (said where it starts) and details (how this machine
    bounds every worker: ``doctor`` and ``-v``).

    `env` holds variables to add to the process's environment, `cwd` the directory to start it
    in, `uid` the uid it switches to (root only; see `grant`).  Its command line is made by the
    one builder (``argv_prefix``); a variant of a plan changes its sandbox's fields
    (``for_socket_dir``, ``as_server``), never the list."""

    bwrap: Bwrap | None
    confine: Confinement = field(default_factory=Confinement)
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    uid: int | None = None
    details: list[str] = field(default_factory=list)

    @cached_property
    def argv_prefix(self) -> list[str]:
        """bubblewrap's command line, up to and including ``--`` ([] without bubblewrap)."""
        return self.bwrap.argv() if self.bwrap is not None else []

    @property
    def pid_namespace(self) -> bool:
        """Whether the process is the init of a PID namespace of its own (what the kill relies on)."""
        return self.bwrap is not None

    def for_socket_dir(self, socket_dir: Path) -> LaunchPlan:
        """This plan for a process shown ``socket_dir`` instead (another process of the run)."""
        if self.bwrap is None:
            return replace(self, notes=list(self.notes), env=dict(self.env))
        view = replace(self.bwrap.view, socket_dir=socket_dir)
        return replace(self, bwrap=replace(self.bwrap, view=view), notes=list(self.notes), env=dict(self.env))

    def as_server(self, server: str) -> LaunchPlan:
        """This plan for a fork server (``_bwrap.SERVERS``): the same sandbox, with the
        capabilities it makes each process's namespaces with."""
        assert self.bwrap is not None, "a fork server runs in bubblewrap"
        return replace(self, bwrap=replace(self.bwrap, server=server))

    def grant(self, path: Path) -> None:
        """Give the worker's uid ownership of `path` (its socket, once bound).  A unix socket
        can only be connected to by a uid with write permission on it; no-op unless the worker
        switches uid."""
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------

def system_paths() -> tuple[list[str], list[tuple[str, str]]]:
    """(read-only directories/files, symlinks to recreate) that make up the system view."""
    ro = ["/usr"]
    links = []
    for top in _TOP:
        if os.path.islink(top):
            links.append((os.readlink(top), top))
        elif os.path.isdir(top):
            ro.append(top)
    ro += [f"/etc/{name}" for name in _ETC if os.path.lexists(f"/etc/{name}")]
    if os.path.isdir(_CPU_INFO):
        ro.append(_CPU_INFO)
    return ro, links


#: Directories whose children are home directories.
_HOME_ROOTS = ("/home", "/Users")


def _home_directories() -> set[str]:
    """Every home directory of this machine's accounts that exists, and the coordinator's."""
    homes = {os.path.expanduser("~")}
    try:
        import pwd

        homes |= {entry.pw_dir for entry in pwd.getpwall() if entry.pw_dir}
    except (ImportError, KeyError, OSError):
        pass
    return {os.path.realpath(h) for h in homes if os.path.isdir(h)} - {"/"}


def shareable_cwd(cwd: Path, force: bool | None) -> tuple[bool, str]:
    """Whether the current directory is shown to workers (read-only), and the note if not.

    Only a project directory is: never the filesystem root, a home directory (anyone's, not
    only the coordinator's), a directory that holds home directories (``/home`` itself), or
    any directory above a home — each would show other people's files wholesale.
    ``force`` (``--share-cwd``/``--no-share-cwd``) overrides the rule either way."""
    c = str(cwd)
    if not cwd.is_dir():
        return False, f"sandbox: the current directory {c} does not exist; the worker starts in its workspace"
    if force is not None:
        return force, "" if force else f"sandbox: the current directory {c} is not shown to workers (--no-share-cwd)"
    why = None
    if c == "/":
        why = "it is the filesystem root"
    elif c in _HOME_ROOTS or os.path.dirname(c) in _HOME_ROOTS:
        why = "it holds home directories" if c in _HOME_ROOTS else "it is a home directory"
    else:
        for home in sorted(_home_directories()):
            if home == c:
                why = "it is a home directory"
            elif beneath(home, c):
                why = f"it holds the home directory {home}"
            if why:
                break
    if why is None:
        return True, ""
    return False, (f"sandbox: the current directory {c} is not shown to workers ({why}); run from "
                   "a project directory, or pass --share-cwd to show it anyway")


def _worker_uid(policy: SandboxPolicy, workspace: Path) -> int:
    # One uid (and gid) per workspace: every worker of the run runs as it, so a replacement
    # worker owns what its predecessor wrote; a run on another workspace alive at the same time
    # never gets it (``engine.sandbox``), so ordinary file permissions separate them too.
    if policy.worker_uid is not None:
        return policy.worker_uid
    held = _uids.uid_of(str(workspace))
    return held if held is not None else _uids.claim_uid(str(workspace))  # (a plan made outside a Launcher)


def _tasks_of(uid: int) -> int:
    """Tasks (threads included) the kernel counts against RLIMIT_NPROC for `uid` right now."""
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            n += int(fields.get("Threads", "1"))
    return n


def _with_privileged(protected: tuple[str, ...], workspace: Path, use_bwrap: bool) -> tuple[str, ...]:
    """``protected`` and the set-id and file-capability files of ``workspace``, which code
    running as uid 0 could rewrite through a shared mapping and keep their bit
    (``engine.sandbox``'s protected paths); ConfigError where none can be kept read-only (no
    bubblewrap) or the walk refuses the directory."""
    privileged = privileged_files(workspace, skip=protected if use_bwrap else ())
    if privileged and not use_bwrap:
        raise ConfigError(f"{privileged[0]} is a set-user-ID, set-group-ID or file-capability file in {workspace}, "
                          "which code running as uid 0 could rewrite keeping its bit, and without bubblewrap it "
                          "cannot be kept read-only: pass --read-only, move it elsewhere, or install bubblewrap")
    if not privileged:
        return tuple(protected)
    return tuple(sorted({*protected, *privileged}, key=lambda p: (p.count("/"), p)))


def plan(policy: SandboxPolicy, *, socket_dir: Path | None, workspace: Path, cwd: Path,
         output_dir: Path | None, python: str, memory_cgroup: bool = False, pids_cgroup: bool = False,
         protected: tuple[str, ...] = (), shown: tuple[Path, ...] = (), script: bool = False) -> LaunchPlan:
    """The launch plan for one worker under `policy` on this machine.

    `memory_cgroup`: the coordinator puts the worker in a memory cgroup of its own (see
    `engine.launch`); without one, the shared memory that escapes RLIMIT_DATA is refused.
    `pids_cgroup`: its process count is bounded by a cgroup of its own (``pids.max``), so a
    root coordinator's workers, who share the run's uid, need no RLIMIT_NPROC on that uid.
    `protected`: paths in the workspace to keep read-only (``engine.sandbox``): bound so
    under bubblewrap (the plan then has a PID namespace), else a note says they are not.
    Where code writes the workspace as uid 0 (root, as the caller or keeping uid 0) its
    set-id and file-capability files are added, and without bubblewrap a workspace holding
    one is refused (``_with_privileged``).
    `shown`: more paths shown read-only.
    `script`: the plan of ``exec FILE``'s sandbox, whose first process (the confiner) is the PID
    namespace's init and which keeps the host's name, as python sees it.
    `policy.as_caller`: code runs as the user running agentloop (root: uid 0 without any
    capability, ``engine.sandbox``), no owner or mode changes, `socket_dir` and `output_dir` may be None.

    Four steps: choose the layers (`_layers`), decide the view and, for root, set the run's
    directories up for its uid (the only side effects, with creating `workspace`, `socket_dir`
    and `output_dir`), build the spec the worker applies to itself (`_confinement`) and the
    bubblewrap command line (`bwrap_argv`, a pure function).  Raises SandboxError when the
    policy's mode requires a layer this host lacks."""
    if policy.mode not in MODES:
        raise ConfigError(f"sandbox mode {policy.mode!r} is not one of {', '.join(MODES)}")
    if policy.mode == "none":
        return LaunchPlan(None, Confinement(), ["sandbox: none — worker code runs with your privileges"])

    workspace, socket_dir, output_dir, cwd = (p and Path(os.path.realpath(p))
                                              for p in (workspace, socket_dir, output_dir, cwd))
    for d in filter(None, (workspace, socket_dir, output_dir)):
        d.mkdir(parents=True, exist_ok=True)
    host = host_support()
    use_bwrap, notes = _layers(policy, host)
    if host.root and policy.as_caller and not use_bwrap and host.landlock_abi < 1:  # (uid 0 would write anything)
        raise SandboxError(f"code run as root needs bubblewrap or Landlock, and this machine has neither. {_INSTALL_HINT}")
    # A current directory that is the workspace (a batch run's) is shown as such, read-write.
    in_workspace = cwd == workspace and policy.share_cwd is not False
    share_cwd, why = (True, "") if in_workspace else shareable_cwd(cwd, policy.share_cwd)
    # Hidden (another MCP client's): bubblewrap covers it beneath the cwd; Landlock cannot, so no cwd then.
    hidden = sorted({os.path.realpath(h) for h in policy.hidden})
    for h in hidden if share_cwd and not in_workspace else ():
        if beneath(str(cwd), h) or (not use_bwrap and beneath(h, str(cwd))):
            share_cwd, why = False, f"sandbox: the current directory {cwd} is not shown to workers ({h} is hidden from them)"
    tmp = "/tmp" if use_bwrap else str(workspace / ".tmp")
    if not use_bwrap and not os.path.lexists(tmp):
        os.mkdir(tmp)  # (a link a worker put in its place is replaced in `_share_with_run`)

    uid = None
    if host.root and not policy.as_caller:
        uid, note = _root_worker(policy, host, use_bwrap, python, workspace, socket_dir)
        notes += [note] if note else []
        if uid is not None:
            _share_with_run(uid, [workspace, *([Path(tmp)] if not use_bwrap else [])], output_dir, socket_dir)
            if share_cwd and not in_workspace and not readable_in_view(str(cwd), [str(cwd)] if use_bwrap else ["/"]):
                share_cwd, why = False, (f"sandbox: the current directory {cwd} is not shown to workers "
                                         "(other users may not read it, and workers run as one); "
                                         "chmod o+rx it to share it")
    notes += [why] if why else []
    if host.root and uid is None:  # uid 0 writes the workspace: its set-id files stay read-only, or it is not written
        protected = _with_privileged(protected, workspace, use_bwrap)
    notes += [unkept_note(protected, workspace)] if protected and not use_bwrap else []
    system, links = system_paths()
    view = View(tuple(system), tuple(links), python_paths(python), workspace, socket_dir, output_dir,
                cwd if share_cwd else None, tuple(protected) if use_bwrap else (),
                tuple(h for h in hidden if share_cwd and beneath(h, str(cwd))), tuple(shown),
                _uid0.root_proc() if host.root and uid is None and use_bwrap else ())  # (uid 0 kept)
    start_dir = str(view.cwd or workspace)
    confine, more, details = _confinement(policy, host, use_bwrap, uid, view, memory_cgroup, pids_cgroup)
    notes += more
    env = {"HOME": tmp, "TMPDIR": tmp}
    if not use_bwrap:
        return LaunchPlan(None, confine, notes, env, start_dir, uid, details)
    box = Bwrap(host.bwrap, host.root, policy.network, policy.tmp_bytes, view, start_dir,
                hostname=None if script else "agentloop", init=script)
    return LaunchPlan(box, confine, notes, env, start_dir, uid, details)


def server_plan(policy: SandboxPolicy, python: str, root: Path, socket_root: Path) -> LaunchPlan:
    """The plan of a fork server shared by the runs beneath ``root`` (a batch's runs directory:
    ``engine.launch``): a worker's view, with ``root`` as its workspace and
    ``socket_root`` as its socket directory, started in ``/``; bubblewrap only (the server
    exists only where it is).  Each process it forks narrows this view to its run's own."""
    host = host_support()
    assert host.bwrap is not None
    system, links = system_paths()
    view = View(tuple(system), tuple(links), python_paths(python), root, socket_root, None, None)
    return LaunchPlan(Bwrap(host.bwrap, host.root, policy.network, policy.tmp_bytes, view, "/"), cwd="/")


def _layers(policy: SandboxPolicy, host: HostSupport) -> tuple[bool, list[str]]:
    """(whether bubblewrap is used, a note for each layer it costs not to); SandboxError when
    the mode requires what this host lacks."""
    use_bwrap = policy.mode in ("auto", "bwrap") and host.bwrap is not None
    if policy.mode == "bwrap" and not use_bwrap:
        raise SandboxError(f"sandbox mode 'bwrap': {host.bwrap_problem}. {_INSTALL_HINT}")
    if policy.mode == "landlock":
        if host.landlock_abi < 1:
            raise SandboxError("sandbox mode 'landlock': Landlock is not available on this kernel "
                               "(needs Linux 5.13+ with landlock in the lsm= list)")
        return False, [f"sandbox: bubblewrap not used (mode landlock) — {_FALLBACK}"]
    if not use_bwrap:
        hint = f" {_INSTALL_HINT}" if host.bwrap_problem == "bubblewrap not found" else ""
        return False, [f"sandbox: {host.bwrap_problem} — {_FALLBACK}.{hint}"]
    return True, []


def _confinement(policy: SandboxPolicy, host: HostSupport, use_bwrap: bool, uid: int | None,
                 view: View, memory_cgroup: bool, pids_cgroup: bool = False
                 ) -> tuple[Confinement, list[str], list[str]]:
    """The spec the worker installs on itself, a note for each layer missing, and the details
    of how this machine bounds the worker (see `LaunchPlan`)."""
    notes: list[str] = []
    details: list[str] = []
    rw = (str(view.workspace), *(("/tmp", "/dev/shm") if use_bwrap else ()))
    landlock = None
    if host.landlock_abi >= 1:
        if use_bwrap:
            # The mount namespace already shows only what may be seen: read all of it.
            ro, dev = ("/",), (*_DEV_FILES, "/dev/pts")
        else:
            ro = (*view.system, *view.python, *(str(p) for p in (view.cwd, view.output_dir, view.socket_dir, *view.shown) if p))
            dev = _DEV_FILES
        landlock = Landlock(ro=tuple(ro), rw=rw, dev=tuple(dev), scope=True,
                            deny_tcp=not use_bwrap and not policy.network)
    elif not use_bwrap:
        notes.append("sandbox: Landlock is unavailable on this kernel and bubblewrap is not used "
                     "— the worker can read and write whatever its user can")
    else:
        notes.append("sandbox: Landlock is unavailable on this kernel — files are confined by "
                     "the mount namespace alone")

    seccomp = None
    if host.seccomp:
        families = [_AF_UNIX, _AF_NETLINK]
        if use_bwrap or policy.network:
            families += [_AF_INET, _AF_INET6]  # in a network namespace: its own loopback only
        # Without a PID namespace the coordinator kills the process group: keep everyone in it.
        seccomp = Seccomp(socket_families=tuple(families), lock_session=not use_bwrap, shared_memory=memory_cgroup,
                          set_id_modes=not (host.root and uid is None))  # (uid 0 kept: engine.sandbox)
        if not memory_cgroup:
            why = "it needs root or a delegated cgroup" if host.root else "none is delegated to you: `agentloop doctor` says how to get one"
            details.append(f"sandbox: no memory cgroup here ({why}) — "
                           "the memory limit is per process, and memfd_create, SysV shared memory "
                           "and shared anonymous mmap are refused so that it holds")
    else:
        notes.append("sandbox: seccomp filters are unavailable here (kernel or architecture) — "
                     "dangerous system calls are not filtered")
        if not use_bwrap and not policy.network:
            notes.append("sandbox: without seccomp or a network namespace the worker has network access")
    rlimits = tuple((name, soft, hard) for name, (soft, hard) in _rlimits(policy, host, use_bwrap, uid, pids_cgroup).items())
    return Confinement(rlimits=rlimits, drop_caps=True, no_new_privs=True,
                       uid=(uid, uid) if uid is not None else None, umask=0o002 if uid is not None else None,
                       landlock=landlock, seccomp=seccomp), notes, details


def tools_plan(root: str, python: str, confine: Confinement) -> LaunchPlan:
    """The plan of the repository tools' process: a view of the system, its Python and `root`,
    all read-only, with no network and PID namespace of its own, started in ``/``; without a
    sandbox where bubblewrap is not usable (the process then relies on ``confine``, its own
    Landlock and seccomp).  A bug in the tools' own confinement to `root` then still cannot
    reach beyond it."""
    host = host_support()
    if host.bwrap is None:
        return LaunchPlan(None, confine, cwd="/")
    system, links = system_paths()
    view = View(tuple(system), tuple(links), python_paths(python), None, None, None, None,
                shown=(Path(os.path.realpath(root)),))
    return LaunchPlan(Bwrap(host.bwrap, host.root, False, 16 * MiB, view, "/"), confine, cwd="/")


def _share_with_run(uid: int, workspaces: list[Path], output_dir: Path, socket_dir: Path) -> None:
    """Root only: make the run's directories usable by its workers' uid (and group), without
    handing them over.

    The workspace stays the coordinator's, group-writable for the run, setgid (what a worker
    creates stays the run's) and sticky, as /tmp is: a worker deletes or renames only what a
    worker wrote, and a file the user put there keeps its owner's protection (its mode says
    whether the run may change it).  Others may not enter it: another run's workers have
    another group.  The output directory is readable by the run; the socket directory only
    searchable (the socket itself is the worker's, see `LaunchPlan.grant`)."""
    for d in workspaces:
        _set_dir(d, uid, 0o3770)
    _set_dir(output_dir, uid, 0o750)
    _set_dir(socket_dir, None, 0o711)


def _set_dir(path: Path, gid: int | None, mode: int) -> None:
    """Make directory `path` the coordinator's, in group `gid`, with `mode` — through a
    descriptor opened without following a link: a worker may have replaced a directory it can
    write (the fallback's `files/.tmp`) with a link to a host file, which root must not chmod."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(path)  # a link or a file where the directory belongs: the directory comes back
        os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if gid is not None and (st.st_uid, st.st_gid) != (os.getuid(), gid):
            os.fchown(fd, os.getuid(), gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _root_worker(policy: SandboxPolicy, host: HostSupport, use_bwrap: bool, python: str,
                 workspace: Path, socket_dir: Path) -> tuple[int | None, str]:
    """(uid, note) for a worker started by root.

    Root is exempt from RLIMIT_NPROC and reads whatever its files' owner may (root owns
    /proc/kallsyms, /etc/shadow, ...), so the worker switches to the run's uid and keeps no
    capability: what it reads is what the sandbox shows it *and* what the files' modes allow
    any user.  Where a path it needs to run (its Python) is closed to other users, it keeps
    uid 0 — still without capabilities — and a note says so."""
    uid = _worker_uid(policy, workspace)
    blocked = root_blocker(python, use_bwrap)
    if not use_bwrap:
        for d in (workspace, socket_dir):  # reachable through their parents?
            if blocked is None and not all(os.stat(a).st_mode & 0o001 for a in d.parents):
                blocked = f"a parent of {d}"
    if blocked is None:
        return uid, ""
    return None, (f"sandbox: {blocked} is not readable by other users — the worker keeps uid 0 "
                  "(without capabilities) and its process count is not bounded; make it "
                  "readable (chmod o+rX) or use a Python installed elsewhere")


def _rlimits(policy: SandboxPolicy, host: HostSupport, use_bwrap: bool, uid: int | None,
             pids_cgroup: bool = False) -> dict:
    """Resource limits as [soft, hard] by name.

    Memory is RLIMIT_DATA, not RLIMIT_AS: glibc reserves 64 MiB of address space per malloc
    arena and threads multiply arenas, so an address-space cap fails multi-threaded Python long
    before it uses the memory; RLIMIT_DATA counts only writable private memory."""
    limits: dict[str, list[int]] = {
        "DATA": [policy.memory_bytes] * 2,
        "NOFILE": [policy.max_open_files] * 2,
        "FSIZE": [policy.max_file_bytes] * 2,
        "CORE": [0, 0],  # a core dump would write the worker's memory into its cwd
    }
    if policy.cpu_seconds is not None:
        limits["CPU"] = [policy.cpu_seconds, policy.cpu_seconds + 1]  # SIGXCPU, then SIGKILL
    nproc = _nproc(policy, host, use_bwrap, uid, pids_cgroup)
    if nproc is not None:
        limits["NPROC"] = [nproc, nproc]
    return limits


def _nproc(policy: SandboxPolicy, host: HostSupport, use_bwrap: bool, uid: int | None,
           pids_cgroup: bool = False) -> int | None:
    # RLIMIT_NPROC compares the count of tasks of the *real uid* with the limit, and uid 0 is
    # exempt.  So:
    # - non-root under bwrap: the user namespace has its own count (Linux 5.14+ ucounts), so
    #   the limit is the sandbox's own budget;
    # - root: the worker switches to the run's uid (`_worker_uid`), whose count holds every
    #   worker of that workspace, so each worker's own budget is its pids cgroup where it has
    #   one, and the uid's count (all the run's workers together) only where it has none; where
    #   it keeps uid 0, only the cgroup bounds it;
    # - non-root without bwrap: the count is every task of the user on the host, so the budget
    #   is added to what the user runs now.
    if host.root:
        return policy.max_processes if uid is not None and not pids_cgroup else None
    if use_bwrap:
        return policy.max_processes
    return _tasks_of(os.getuid()) + policy.max_processes


def workspace_excess(policy: SandboxPolicy, workspace: Path) -> str | None:
    """Words for the model when the workspace holds more than `policy.workspace_bytes`, else
    None.  A bind-mounted directory cannot be size-capped without filesystem quotas, so the
    coordinator calls this between blocks; RLIMIT_FSIZE bounds each file meanwhile."""
    if policy.workspace_bytes is None:
        return None
    try:
        used = disk_usage(workspace)
    except TreeError as exc:  # larger than any walk should go, or moving under it
        return (f"the workspace cannot be measured ({exc}): delete files and directories "
                "before writing more")
    except OSError:  # no workspace (yet): nothing in it
        return None
    if used <= policy.workspace_bytes:
        return None
    return (f"the workspace holds {used / MiB:.0f} MiB, over its {policy.workspace_bytes / MiB:.0f} MiB "
            "limit: delete files before writing more")
