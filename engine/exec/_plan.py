"""The sandbox of ``agentloop exec FILE``: what the script is shown, where it may write, as
whom it runs and with which environment.  Pure planning; ``engine.exec`` runs it.

The script is the user's own, so it runs as the user (root: uid 0 without any capability),
writes files that are theirs, and changes no directory's owner or mode.  Where it may write:

=================  ==========================================  ===================================
mode               the current directory                       also writable
=================  ==========================================  ===================================
``--write-cwd``    writable, except what stays read-only:      a private ``$TMPDIR`` (``/tmp``)
(``exec``)         ``.git``, ``agentloop.toml``, every virtual
                   environment in it (a directory holding
                   ``pyvenv.cfg``), the interpreter and its
                   packages, agentloop's own code
``--read-only``    read-only                                   the workspace (``./files``, made
(``run``, ``chat``)                                            when needed and removed if left
                                                               empty, or ``--workspace DIR``) and
                                                               ``$TMPDIR``
=================  ==========================================  ===================================

Shown read-only besides the system and the interpreter: the script's own directory (its file
alone where that directory is ``/`` or a home directory), and the directories of ``PATH``,
``PYTHONPATH`` and the interpreter's user site that exist, so that what ``python FILE`` finds
there it finds here too.

The environment is the caller's minus what looks like a secret: ``engine.environment``
under its ``CALLER`` policy (``engine.secrets`` decides what a secret is).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine import trust
from engine.errors import ConfigError
from engine.launch import missing_dirs
from engine.sandbox import (
    RUNTIME_ROOT,
    SandboxPolicy,
    beneath,
    plan,
    protected_paths,
    python_paths,
    runtime_dirs,
    shareable_cwd,
)
from engine.sandbox import probe as probe_python
from worker.contract.confinement import Confinement

__all__ = ["ScriptPlan", "kept_read_only", "plan_script"]


@dataclass(frozen=True)
class ScriptPlan:
    """How to start the sandbox of one script: the sandbox's command line up to its first
    process (``[]`` without bubblewrap), the spec that process applies to itself, where it
    starts, one-line notes, and ``tmpdir``: a ``$TMPDIR`` to give the script where the
    sandbox has no private ``/tmp`` (None: ``/tmp`` is its own).  ``made``: the directories
    this plan created (the workspace with the parents it needed, that ``$TMPDIR``), deepest
    first, to remove again when the script left them empty.  ``kept``: what stays read-only in
    ``writable`` (``kept_read_only``), bound so where there is a PID namespace."""

    argv_prefix: list[str]
    pid_namespace: bool
    confine: Confinement
    cwd: str
    notes: list[str]
    tmpdir: str | None
    writable: str
    made: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    #: The path of the egress gate's socket the script's forwarder relays to (``--allow-net``;
    #: empty: no network at all).
    egress: str = ""


def plan_script(policy: SandboxPolicy, *, python: str, cwd: Path, script: str | None, write_cwd: bool,
                workspace: Path | None, environ: Mapping[str, str], memory_cgroup: bool = False,
                pids_cgroup: bool = False, egress: str = "") -> ScriptPlan:
    """The plan for ``python SCRIPT`` (None: the program read from stdin) run from ``cwd``,
    writing the current directory (``write_cwd``) or only the workspace.  ConfigError when
    the current directory cannot be written safely: ``/``, a home directory or a directory
    above one (unless ``share_cwd``), one that lies inside an interpreter's installation or
    holds agentloop's record of what code could write (``engine.trust``), or, without
    bubblewrap, one holding the interpreter or agentloop's code (nothing could keep them
    read-only).  ``egress``: the socket of the script's egress gate (``--allow-net``), whose
    directory the sandbox shows read-only; ConfigError without bubblewrap (no empty network
    namespace to give it)."""
    cwd = Path(os.path.realpath(cwd))
    if write_cwd:
        if workspace is not None:
            raise ConfigError("--workspace DIR goes with --read-only: with --write-cwd the script writes the "
                              "current directory")
        if policy.share_cwd is False:
            raise ConfigError("--no-share-cwd goes with --read-only: with --write-cwd the script writes the "
                              "current directory")
        shown, why = shareable_cwd(cwd, policy.share_cwd)
        if not shown:
            raise ConfigError(why.removeprefix("sandbox: ").replace("is not shown to workers", "is not shown to scripts")
                              + ", or --read-only")
        target = cwd
    else:
        target = Path(os.path.realpath(workspace or cwd / "files"))
    made = tuple(str(d) for d in (target / ".tmp", *missing_dirs(target)))  # (.tmp: TMPDIR without bubblewrap)
    _refuse_inside_installation(target, python)
    try:
        trust.refuse_holding_record(target)
    except ConfigError:
        if not write_cwd:
            raise
        raise ConfigError(f"the current directory {target} holds {trust.record_directory()}, agentloop's record of "
                          "what code could write: run from another directory, pass --read-only, or set "
                          "XDG_STATE_HOME elsewhere") from None
    kept = kept_read_only(target, python)
    policy = dataclasses.replace(policy, as_caller=True)
    socket_dir = Path(egress).parent if egress else None
    planned = plan(policy, socket_dir=socket_dir, workspace=target, cwd=cwd, output_dir=None, python=python,
                   memory_cgroup=memory_cgroup, pids_cgroup=pids_cgroup, protected=kept,
                   shown=tuple(_shown(script, python, environ)), script=True)
    if kept and not planned.pid_namespace:
        _refuse_unkept_code(kept, target, python)
    if egress and not planned.pid_namespace:
        raise ConfigError("--allow-net needs the bubblewrap sandbox (an empty network namespace with one way out), "
                          "and this machine runs scripts without it (agentloop doctor says why)")
    confine = planned.confine
    if confine.landlock is not None:  # (getpass and curses open the terminal by name)
        confine = confine.replace(landlock=confine.landlock.replace(dev=(*confine.landlock.dev, "/dev/tty")))
    if confine.seccomp is not None:
        # Sessions and process groups as under python (a child with start_new_session): without a
        # PID namespace the confiner, a subreaper, and the runner find what is left by its tree.
        confine = confine.replace(seccomp=confine.seccomp.replace(lock_session=False))
    tmpdir = None if planned.pid_namespace else planned.env.get("TMPDIR")
    return ScriptPlan(planned.argv_prefix, planned.pid_namespace, confine, planned.cwd or str(cwd), list(planned.notes), tmpdir,
                      str(target), tuple(d for d in made if os.path.isdir(d)), kept, egress)


def kept_read_only(directory: Path, python: str) -> tuple[str, ...]:
    """What stays read-only in ``directory`` while a script writes it: what
    ``engine.sandbox`` keeps in any directory workers write (``agentloop.toml``, ``.git``,
    virtual environments), and the interpreter's directories and agentloop's own code where
    they lie there."""
    return protected_paths(directory, _installation(python))


def _installation(python: str) -> list[str]:
    """The directories of the interpreter (its prefixes too) and of agentloop's own code, resolved."""
    return [*(os.path.realpath(p) for p in python_paths(python)), *_import_path(python)]


def _import_path(python: str) -> list[str]:
    """Where the interpreter and agentloop import from: the interpreter's ``sys.path`` and
    virtual environment, agentloop's packages, and the coordinator's own ``sys.path`` (but
    the current directory that ``python -m engine.cli`` puts first on it: files there are the
    user's anyway), resolved."""
    info = probe_python(python)
    here = os.path.realpath(os.getcwd())
    venvs = [p for p in info.paths[:4] if os.path.isfile(os.path.join(p, "pyvenv.cfg"))]
    ours = [p for p in sys.path if p and os.path.isabs(p) and os.path.realpath(p) != here]
    places = [*info.paths[4:], *venvs, *runtime_dirs(python), *ours,
              os.path.join(RUNTIME_ROOT, "worker"), os.path.join(RUNTIME_ROOT, "engine")]
    return [os.path.realpath(p) for p in places if os.path.isdir(p)]


def _refuse_inside_installation(target: Path, python: str) -> None:
    """A directory inside a Python installation or agentloop's code is never written: a module
    put there would be imported by whoever runs that Python next."""
    for place in _import_path(python):
        if place != "/" and beneath(str(target), place):
            raise ConfigError(f"{target} lies inside {place}, from which Python imports modules: run from "
                              "another directory, or pass --read-only")


def _refuse_unkept_code(kept: tuple[str, ...], target: Path, python: str) -> None:
    """Without bubblewrap nothing can be bound read-only (``sandbox.plan`` notes what stays
    writable): refuse where the interpreter or agentloop's code would be writable."""
    code = [p for p in kept if any(beneath(p, i) or beneath(i, p) for i in _installation(python))]
    if code:
        raise ConfigError(f"without bubblewrap {code[0]} could not be kept read-only in {target}, and Python runs "
                          "code from there: pass --read-only, or install bubblewrap")


def _shown(script: str | None, python: str, environ: Mapping[str, str]) -> list[Path]:
    """What ``python SCRIPT`` reads besides the system and the interpreter: the script's
    directory (sys.path[0]; its file alone where that directory may not be shown whole), the
    directories of PATH and PYTHONPATH and the user site, where they exist."""
    shown: list[Path] = []
    if script is not None:
        path = os.path.abspath(script)
        for place in dict.fromkeys((os.path.dirname(path), os.path.dirname(os.path.realpath(path)))):
            real = Path(os.path.realpath(place))
            if _showable(real):
                shown.append(real)
            elif os.path.exists(path):
                shown.append(Path(os.path.realpath(path)))
    dirs = [*environ.get("PATH", "").split(":"), *environ.get("PYTHONPATH", "").split(":")]
    home = environ.get("HOME")
    info = probe_python(python)
    if home and info.paths[0] == info.paths[1] and not environ.get("PYTHONNOUSERSITE"):
        major_minor = ".".join(info.version.split(".")[:2])
        dirs.append(os.path.join(home, ".local", "lib", f"python{major_minor}", "site-packages"))
    for place in dirs:
        if os.path.isabs(place) and os.path.isdir(place):
            real = Path(os.path.realpath(place))
            if _showable(real) and real not in shown:
                shown.append(real)
    return shown


def _showable(directory: Path) -> bool:
    """Whether ``directory`` may be shown whole: not ``/``, a home directory or one above a home."""
    return shareable_cwd(directory, None)[0]
