"""The bubblewrap command line: pure functions of their arguments, tested argument for argument.

The one place bubblewrap's arguments are written: ``View`` is what a sandboxed process is shown,
``bwrap_argv`` turns it (and how the sandbox starts: its hostname, its init, a fork server's
capabilities) into bubblewrap's options; ``probe_argv`` is the smallest sandbox, for probes.
Nothing edits a command line these return.  The
choice of layers and every side effect (directories handed to the run, the confinement spec)
are ``engine.sandbox``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["SERVERS", "Bwrap", "View", "beneath", "bwrap_argv", "make_parents", "namespace_flags", "outermost", "probe_argv"]


#: What a fork server may hold on top of a sandbox's own: its capabilities make each forked
#: process's namespaces and mounts (``"fork"``), and for a server of code samples that run as
#: another uid, kill what they leave (``"fork+kill"``).
SERVERS = (None, "fork", "fork+kill")


def namespace_flags(root: bool, network: bool, server: str | None = None) -> list[str]:
    """The namespaces and capabilities of a sandbox.  ``server`` (``SERVERS``): the sandbox is a
    fork server's, with the capabilities it makes each process's namespaces with, which every
    process drops before it runs code.  Root's server holds them without a user namespace; an
    unprivileged one in bubblewrap's user namespace, where it may make user namespaces: it
    gives each process one of its own, which then allows none below it (``worker.fork_server``)."""
    if server not in SERVERS:
        raise ValueError(f"not a kind of server: {server!r}")
    flags = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        flags.append("--unshare-net")
    caps = [] if server is None else ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN"]
    if root:
        # Real root needs no user namespace; keep only what apply() needs to switch uid and
        # empty the bounding set.  The worker keeps none of them (see `_root_worker`).
        kill = ["--cap-add", "CAP_KILL"] if server == "fork+kill" else []
        flags += ["--cap-drop", "ALL", *kill, *caps, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                  "--cap-add", "CAP_SETPCAP"]
    else:
        # Unprivileged: a user namespace, and no further ones inside it (but in a server's).
        flags += ["--unshare-user", *caps, *(["--disable-userns"] if server is None else [])]
    return flags + ["--die-with-parent", "--new-session"]


def probe_argv(bwrap: str, root: bool, server: str | None = None) -> list[str]:
    """The smallest sandbox of our namespaces (the host's files, read-only): what a probe runs
    in, to learn whether bubblewrap (and a server's user namespaces below it) work here."""
    return [bwrap, *namespace_flags(root, network=False, server=server), "--ro-bind", "/", "/",
            "--proc", "/proc", "--dev", "/dev", "--"]


def outermost(paths: list[str]) -> tuple[str, ...]:
    """Drop paths that lie beneath another path of the list."""
    out: list[str] = []
    for p in sorted(set(paths), key=lambda s: (s.count("/"), s)):
        if not any(beneath(p, q) for q in out):
            out.append(p)
    return tuple(out)


def beneath(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def make_parents(path: str, made: set[str]) -> list[str]:
    """bwrap options creating the missing ancestors of a bind target as mode 0755: bwrap would
    make them 0700, which the worker's uid could not traverse (/root/.pyenv/... for one)."""
    out: list[str] = []
    parts = path.rstrip("/").split("/")
    for depth in range(1, len(parts)):  # every ancestor, shallowest first (strings: plans are made often)
        a = "/".join(parts[:depth]) or "/"
        if a not in made:
            made.add(a)
            out += ["--perms", "0755", "--dir", a]
    made.add(path)
    return out


@dataclass(frozen=True)
class View:
    """What a worker is shown, every path resolved: the system (read-only, with the symlinks
    of a merged /usr), its Python, the current directory when shown, the run's output and
    socket directories (read-only) and the workspace (read-write), in which ``protected``
    (``engine.sandbox``) stay read-only; ``hidden`` directories beneath the current directory
    are covered by an empty, read-only tmpfs (the workspace may lie beneath one: it is bound
    back on top).  A fork server shared by the runs of a batch is shown the batch's runs
    directory as its workspace and no output directory (``engine.launch``); a
    script run by ``exec`` has no socket or output directory, and ``shown`` holds its own
    directory; the tool process has no workspace at all (``workspace`` None: nothing is
    writable but its private /tmp) and is shown its root.

    ``shown``: more paths shown read-only where nothing above them is shown already.
    ``root_proc``: for code that keeps uid 0 (without capabilities), the files of ``/proc``
    that only their owner may read or write, covered so that opening them fails as it does for
    any other user; ``/proc/sys`` is then shown read-only, as it is to other users by its modes."""

    system: tuple[str, ...]
    links: tuple[tuple[str, str], ...]
    python: tuple[str, ...]
    workspace: Path | None
    socket_dir: Path | None
    output_dir: Path | None
    cwd: Path | None
    protected: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    shown: tuple[Path, ...] = ()
    root_proc: tuple[str, ...] = ()


def bwrap_argv(bwrap: str, *, root: bool, network: bool, tmp_bytes: int, view: View, start_dir: str,
               hostname: str | None = "agentloop", init: bool = False, server: str | None = None) -> list[str]:
    """The bubblewrap command line (up to and including ``--``) that builds `view`.  Pure: the
    same arguments give the same list, which the tests compare argument for argument.

    ``hostname``: the sandbox's (None keeps the host's, as python sees it); ``init``: its first
    process is the PID namespace's init (``--as-pid-1``: exec's confiner relays signals and
    reports the exact status); ``server``: a fork server's capabilities (``namespace_flags``)."""
    argv = [bwrap, *(["--as-pid-1"] if init else []), *namespace_flags(root, network, server),
            *(["--hostname", hostname] if hostname else [])]
    made = {"/", "/tmp", "/dev", "/proc"}
    size = str(tmp_bytes)
    # The private /tmp first: a Python installed beneath /tmp (a checkout there) is bound on top
    # of it, not hidden by it.
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    if view.root_proc:
        # The host's /proc/sys (sysctls are read through the reader's own namespaces), read-only;
        # a character device on a nodev mount cannot be opened: EACCES, as for any user.
        argv += ["--ro-bind", "/proc/sys", "/proc/sys"]
        for path in view.root_proc:
            argv += ["--ro-bind", "/dev/null", path]
    for path in outermost([*view.system, *view.python]):
        argv += [*make_parents(path, made), "--ro-bind", path, path]
    for target, link in view.links:
        argv += ["--symlink", target, link]
    # Host directories last, shallowest first, so a deeper (more specific) bind wins and none
    # is hidden by the /tmp tmpfs.  The socket directory is read-only: connecting to a socket
    # needs no write access to its directory, and nothing else belongs there.
    ws = view.workspace
    binds = [("--bind", ws)] if ws is not None else []
    binds += [("--ro-bind", d) for d in (view.socket_dir, view.output_dir) if d is not None]
    if view.cwd is not None and not (ws is not None and beneath(str(view.cwd), str(ws))):
        binds.append(("--ro-bind", view.cwd))  # (beneath the workspace it is visible, writable)
    seen = [*view.system, *view.python, *([str(ws)] if ws is not None else []),
            *([str(view.cwd)] if view.cwd is not None else [])]
    binds += [("--ro-bind", p) for p in view.shown if not any(beneath(str(p), s) for s in seen)]
    binds += [("--tmpfs", Path(h)) for h in view.hidden]  # over the current directory, under the workspace
    for kind, path in sorted(binds, key=lambda b: (len(b[1].parts), b[0] == "--bind")):
        if kind == "--tmpfs":
            argv += [*make_parents(str(path), made), "--perms", "0755", "--size", "65536", kind, str(path)]
        else:
            argv += [*make_parents(str(path), made), kind, str(path), str(path)]
    # Last, over the workspace: what stays read-only in it.  Each exists there (its parents
    # with it), so no directory is made for it.
    for path in view.protected:
        argv += ["--ro-bind", path, path]
    # The root, /dev and the covers are tmpfs that bwrap builds; nothing may be written to them.
    covers = [a for h in view.hidden for a in ("--remount-ro", h)]
    return argv + ["--remount-ro", "/dev", *covers, "--remount-ro", "/", "--chdir", start_dir, "--"]


@dataclass(frozen=True)
class Bwrap:
    """One bubblewrap sandbox as data: ``argv()`` is its command line (``bwrap_argv``).  A plan
    keeps this, not the list, so that a variant of it (another socket directory, a fork server's
    capabilities) is made by changing a field and building again, never by editing a list."""

    bwrap: str
    root: bool
    network: bool
    tmp_bytes: int
    view: View
    start_dir: str
    hostname: str | None = "agentloop"
    init: bool = False
    server: str | None = None

    def argv(self) -> list[str]:
        return bwrap_argv(self.bwrap, root=self.root, network=self.network, tmp_bytes=self.tmp_bytes,
                          view=self.view, start_dir=self.start_dir, hostname=self.hostname, init=self.init,
                          server=self.server)
