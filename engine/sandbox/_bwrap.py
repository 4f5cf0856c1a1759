"""The bubblewrap command line: pure functions of their arguments, tested argument for argument.

``View`` is what a worker is shown; ``bwrap_argv`` turns it into bubblewrap's options.  The
choice of layers and every side effect (directories handed to the run, the confinement spec)
are ``engine.sandbox``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["View", "beneath", "bwrap_argv", "fork_server_argv", "make_parents", "namespace_flags", "outermost"]


def namespace_flags(root: bool, network: bool) -> list[str]:
    flags = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        flags.append("--unshare-net")
    if root:
        # Real root needs no user namespace; keep only what apply() needs to switch uid and
        # empty the bounding set.  The worker keeps none of them (see `_root_worker`).
        flags += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                  "--cap-add", "CAP_SETPCAP"]
    else:
        # Unprivileged: a user namespace, and no further ones inside it.
        flags += ["--unshare-user", "--disable-userns"]
    return flags + ["--die-with-parent", "--new-session"]


def fork_server_argv(argv: list[str], *, root: bool, kill: bool = False) -> list[str]:
    """A sandbox's command line (``bwrap_argv``'s) made a fork server's: with the capabilities
    it makes each process's namespaces and mounts with, which every process drops before it
    runs code.  Root's server holds them without a user namespace (``kill``: CAP_KILL too, for
    a slot whose samples run as another uid).  An unprivileged server holds them in bubblewrap's
    user namespace, and may make user namespaces: it gives each process one of its own, which
    then allows none below it (``worker.fork_server``)."""
    caps = ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN"]
    if root:
        at = argv.index("--cap-drop") + 2
        caps = ["--cap-add", "CAP_KILL", *caps] if kill else caps
    else:
        argv = [a for a in argv if a != "--disable-userns"]
        at = argv.index("--unshare-user") + 1
    return [*argv[:at], *caps, *argv[at:]]


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
    directory.

    ``shown``: more paths shown read-only where nothing above them is shown already.
    ``root_proc``: for code that keeps uid 0 (without capabilities), the files of ``/proc``
    that only their owner may read or write, covered so that opening them fails as it does for
    any other user; ``/proc/sys`` is then shown read-only, as it is to other users by its modes."""

    system: tuple[str, ...]
    links: tuple[tuple[str, str], ...]
    python: tuple[str, ...]
    workspace: Path
    socket_dir: Path | None
    output_dir: Path | None
    cwd: Path | None
    protected: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    shown: tuple[Path, ...] = ()
    root_proc: tuple[str, ...] = ()


def bwrap_argv(bwrap: str, *, root: bool, network: bool, tmp_bytes: int, view: View,
               start_dir: str) -> list[str]:
    """The bubblewrap command line (up to and including ``--``) that builds `view`.  Pure: the
    same arguments give the same list, which the tests compare argument for argument."""
    argv = [bwrap, *namespace_flags(root, network), "--hostname", "agentloop"]
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
    binds = [("--bind", view.workspace)]
    binds += [("--ro-bind", d) for d in (view.socket_dir, view.output_dir) if d is not None]
    if view.cwd is not None and not beneath(str(view.cwd), str(view.workspace)):
        binds.append(("--ro-bind", view.cwd))  # (beneath the workspace it is visible, writable)
    seen = [*view.system, *view.python, str(view.workspace), *([str(view.cwd)] if view.cwd is not None else [])]
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
