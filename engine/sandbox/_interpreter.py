"""The Python that workers run: the one trust check every interpreter passes before it runs,
what it holds, and how agentloop's runtime runs in it.

**Trust.**  Running an interpreter runs code of its installation before any of ours: its
start reads ``pyvenv.cfg`` and ``._pth`` files and imports the standard library of the
installation they name, and ``site`` executes the ``.pth`` files of its site-packages, even
under ``-I``.  So an interpreter a worker could have written (``engine.trust``) must not run at
all, not even to be asked what it is.  ``trusted_python`` is the one check, for every source
(``--python``, ``$AGENTLOOP_PYTHON``, ``python`` in agentloop.toml, ``$VIRTUAL_ENV``,
agentloop's own), and it alone makes a ``TrustedPython``; every function here that runs an
interpreter or builds the command line that will (``probe``, ``runtime_packages``,
``not_importable``, ``python_paths``, ``runtime_argv``) takes one, and checks a plain path
itself first, so no start path (a worker, the fork server and its probe, exec's confiner, a
tool process, ``doctor``) can run an interpreter the check refused.

The worker runtime needs two packages of its own, pyzmq and msgpack.  An interpreter that
lacks them but is the same Python as agentloop's (version and ABI) gets agentloop's copies,
found by an import hook that knows those two names only: they are neither added to that
interpreter's ``sys.path`` nor listed among its packages.  Any other interpreter must have them
installed, and the error says how.  Which interpreter workers run is ``engine.sandbox``'s
``which_python``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import worker.contract
from engine import trust
from engine.errors import ConfigError, SandboxError, UntrustedPython
from engine.sandbox._bwrap import beneath, outermost
from engine.sandbox._probe_cache import remembered

__all__ = [
    "Interpreter", "RUNTIME_INSTALL", "RUNTIME_PACKAGES", "RUNTIME_ROOT", "TrustedPython", "check_workspace",
    "not_importable", "probe", "python_paths", "runtime_argv", "runtime_dirs", "runtime_packages",
    "trusted_python"
]

#: Third-party packages the worker runtime imports, by import name (distribution in brackets
#: of ``RUNTIME_INSTALL``).
RUNTIME_PACKAGES = ("zmq", "msgpack")
RUNTIME_INSTALL = "pyzmq msgpack"
#: Directories next to a package that belong to it (pyzmq's wheel keeps libzmq in ``pyzmq.libs``).
_COMPANIONS = {"zmq": ("pyzmq.libs",)}
#: Bytes of a ``pyvenv.cfg`` read for its ``home`` (the file is a few lines).
_VENV_CFG_LIMIT = 64 * 1024


@dataclass(frozen=True)
class Interpreter:
    """What one Python answered about itself (asked once per process)."""

    path: str  # the interpreter itself, as it names itself (a launcher script, e.g. pyenv's, resolved)
    version: str  # "3.11.7"
    abi: str  # sys.implementation.cache_tag + the extension suffix: what compiled modules must match
    paths: tuple[str, ...]  # its prefixes and the sys.path it starts with (``-I``)
    missing: tuple[str, ...]  # runtime packages it cannot import by itself


# -- the one trust check -------------------------------------------------------------------------

_KEY = object()  # what only ``trusted_python`` holds


class TrustedPython(str):
    """The path of an interpreter that passed ``trusted_python``.  Only that function makes
    one (anyone else gets a TypeError), so a value of this type is proof of the check; it is
    still a ``str``, for ``subprocess`` and for ``WorkerSettings.python``.  Pickled to another
    process (a Ray task) it arrives as a plain path, which is checked there again."""

    __slots__ = ()

    def __new__(cls, path: str, key: object = None) -> TrustedPython:
        if key is not _KEY:
            raise TypeError("a TrustedPython is made by engine.sandbox.trusted_python alone: it is the trust check")
        return super().__new__(cls, path)

    def __reduce__(self):
        return (str, (str(self),))


def trusted_python(python: str, workspace: Path | None = None, *, source: str = "",
                   resolve: bool = False) -> TrustedPython:
    """``python`` (a path) as a TrustedPython, or UntrustedPython in one line (what, which
    ``source`` chose it, why, what to do) when a worker could have written it or what it runs
    at its start.  In order, each step only once the one before passed:

    1. without running anything: the file, its links, its directory and those above it, the
       ``._pth`` and ``pyvenv.cfg`` files its start reads, its virtual environment as a whole,
       and the installation it starts from (the ``home`` of ``pyvenv.cfg``, else the one its
       real file lies in) — none a workers' uid's or writable by others, none changed or
       standing unprotected where workers of a run could write (``engine.trust``), none in
       ``workspace`` (the one this run's workers will write);
    2. ``python -I -S`` (no ``site``: no ``.pth`` file runs) for the directories ``site`` would
       read and those its ``.pth`` files add, each judged the same way;
    3. the full probe (``site`` runs), whose paths are judged again.

    A TrustedPython (it passed all three in this process) is judged again only against
    ``workspace``, the one fact a new run adds.

    The result is ``python`` as given, or with ``resolve`` the interpreter as it names itself (a
    launcher script such as pyenv's shim becomes the program it runs, which is checked too:
    trusted as the script that chose it is)."""
    said = f"the workers' Python {python}" + (f", {source}," if source else "")
    if isinstance(python, TrustedPython):  # judged already: only where this run's workers write is new
        if workspace is not None:
            _refuse_in_workspace(python, workspace, said)
        return python
    named = os.path.abspath(python)
    _refuse_start(named, workspace, said)
    _refuse_any(said, _site_free_paths(named))
    info = _probe(named)
    _refuse_any(said, info.paths)
    real = os.path.abspath(info.path)
    if real != named:
        _refuse_start(real, workspace, said)
    return TrustedPython(real if resolve else named, _KEY)


def _checked(python: str) -> TrustedPython:
    """``python`` once it passed the check (a TrustedPython passed it already)."""
    return python if isinstance(python, TrustedPython) else trusted_python(python)


def _venv_of(named: str, real: str) -> str | None:
    """The virtual environment ``python`` starts in: the directory holding the ``pyvenv.cfg``
    its start finds (beside the file as named or resolved, or one level up), if any."""
    for place in dict.fromkeys((os.path.dirname(named), os.path.dirname(os.path.dirname(named)),
                                os.path.dirname(real), os.path.dirname(os.path.dirname(real)))):
        if os.path.isfile(os.path.join(place, "pyvenv.cfg")):
            return place
    return None


def _venv_home(venv: str) -> str | None:
    """The ``home`` a ``pyvenv.cfg`` names (the base installation's directory), read as the
    interpreter's start reads it; None when it names none."""
    try:
        with open(os.path.join(venv, "pyvenv.cfg"), "rb") as f:
            text = f.read(_VENV_CFG_LIMIT).decode("utf-8", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() == "home" and value.strip():
            return os.path.abspath(os.path.join(venv, value.strip()))
    return None


def _installation(named: str) -> tuple[str, str | None, list[str]]:
    """The interpreter's real file, its virtual environment (if any) and the directories its
    installation lies in (its prefix lies at or above the last)."""
    real = os.path.realpath(named)
    venv = _venv_of(named, real)
    home = _venv_home(venv) if venv else None
    base = home or os.path.dirname(real)  # the directory the installation is searched from
    return real, venv, [*([venv] if venv else []), base, os.path.dirname(base)]


def _refuse_in_workspace(named: str, workspace: Path, said: str) -> None:
    """UntrustedPython when the interpreter or its installation lies in ``workspace``."""
    real, _, trees = _installation(named)
    ws = os.path.realpath(workspace)
    for path in (named, real, *trees):
        if beneath(os.path.realpath(path), ws) or beneath(path, ws):
            raise UntrustedPython(f"{said} lies in the workspace {ws}, which workers write: choose another "
                                  "--workspace or an interpreter elsewhere")


def _refuse_start(named: str, workspace: Path | None, said: str) -> None:
    """Step 1 of ``trusted_python``: what the interpreter's start reads, judged before it runs."""
    real, venv, trees = _installation(named)
    files = [named, *(os.path.splitext(p)[0] + "._pth" for p in dict.fromkeys((named, real)))]
    files += [os.path.join(venv, "pyvenv.cfg")] if venv else []
    if workspace is not None:
        _refuse_in_workspace(named, workspace, said)
    why = trust.owner_refusal(os.path.dirname(named))
    why = why or trust.refusal(named, tree=venv)
    for file in files[1:]:
        why = why or (trust.refusal(file) if os.path.lexists(file) else None)
    for tree in trees:
        if not why and os.path.isdir(tree) and os.path.realpath(tree) != "/":
            why = trust.refusal(tree, tree=tree)
    if why:
        raise UntrustedPython(f"{said} is not used: {why}")


def _refuse_any(said: str, paths: Iterable[str]) -> None:
    """UntrustedPython when a directory the interpreter imports from was a worker's to write
    (its owner or mode, or the record: there, not kept read-only, while workers could write)."""
    for path in dict.fromkeys(os.path.normpath(p) for p in paths if os.path.isabs(p)):
        if os.path.isdir(path) and os.path.realpath(path) != "/":
            why = trust.refusal(path, tree=path)
            if why:
                raise UntrustedPython(f"{said} imports from {path}, which is not used: {why}")


_PROBE = """
import importlib.util, json, sys, sysconfig
missing = [n for n in sys.argv[1].split(",") if importlib.util.find_spec(n) is None]
print(json.dumps({"version": sys.version.split()[0], "executable": sys.executable,
    "abi": sys.implementation.cache_tag + (sysconfig.get_config_var("EXT_SUFFIX") or ""),
    "paths": [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path[1:]],
    "missing": missing}))
"""


_SITE_FREE_PROBE = """
import json, os, site, sys
paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path[1:]]
here = os.path.dirname(sys.executable)
tops = site.getsitepackages()
for venv in (here, os.path.dirname(here)):  # what site.venv() would do, but for executing .pth files
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        sys.prefix = sys.exec_prefix = venv
        paths.append(venv)
        tops = site.getsitepackages([venv]) + tops
        break
for top in tops:
    paths.append(top)
    try:
        names = sorted(name for name in os.listdir(top) if name.endswith(".pth"))
    except OSError:
        continue
    for name in names:
        try:
            with open(os.path.join(top, name), encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        paths += [os.path.join(top, line.rstrip()) for line in lines
                  if line.strip() and not line.startswith(("#", "import ", "import\t"))]
print(json.dumps(paths))
"""


def _run(python: str, *args: str) -> bytes:
    """Run ``python`` with ``args`` (isolated, from ``/``, no stdin) and return its stdout;
    SandboxError when it does not start or fails.  Only for ``trusted_python`` and the
    functions below, each of which passed ``python`` through it first."""
    try:
        return subprocess.run([python, *args], capture_output=True, timeout=60, cwd="/",
                              stdin=subprocess.DEVNULL, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"cannot start the worker's python {python}: {exc}") from exc


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _answer(value: object) -> bool:
    """Whether ``value`` has the shape of the probe's answer."""
    return (isinstance(value, dict) and all(isinstance(value.get(k), str) for k in ("version", "abi"))
            and isinstance(value.get("executable"), str) and _strings(value.get("paths"))
            and _strings(value.get("missing")))


@lru_cache(maxsize=8)
def _site_free_paths(python: str) -> tuple[str, ...]:
    """The prefixes, the paths, the site directories of ``python`` and the directories their
    ``.pth`` files add, asked with ``-S`` (the ``.pth`` files read as text): without ``-S``,
    ``site`` executes the ``.pth`` files' import lines and a ``sitecustomize`` from any of them."""
    def ask() -> list[str]:
        try:
            paths = json.loads(_run(python, "-I", "-S", "-c", _SITE_FREE_PROBE))
        except ValueError as exc:
            raise SandboxError(f"cannot start the worker's python {python}: {exc}") from exc
        return [path for path in paths if isinstance(path, str)] if isinstance(paths, list) else []

    paths = remembered("site-free " + _digest(_SITE_FREE_PROBE), python, ask, _strings, lambda answer: answer)
    return tuple(paths)


def _probe(python: str) -> Interpreter:
    """The probe's answer, asked once per interpreter a process: keyed by the plain path, since
    ``lru_cache`` keys a ``str`` and a ``TrustedPython`` of the same path apart, and every start
    would ask twice (the trust check, then ``runtime_packages``)."""
    return _probe_path(str(python))


@lru_cache(maxsize=8)
def _probe_path(python: str) -> Interpreter:
    def ask() -> dict:
        try:
            info = json.loads(_run(python, "-I", "-c", _PROBE, ",".join(RUNTIME_PACKAGES)))
        except ValueError as exc:
            raise SandboxError(f"cannot start the worker's python {python}: {exc}") from exc
        if not _answer(info):
            raise SandboxError(f"cannot start the worker's python {python}: it answered {str(info)[:200]}")
        return info

    question = f"probe {_digest(_PROBE)} {','.join(RUNTIME_PACKAGES)}"
    info = remembered(question, python, ask, _answer, lambda answer: answer["paths"])
    return Interpreter(info["executable"] or python, info["version"], info["abi"], tuple(info["paths"]),
                       tuple(info["missing"]))


def probe(python: str) -> Interpreter:
    """Ask ``python`` (isolated, from ``/``; checked first unless a TrustedPython) for its
    version, ABI, paths and which runtime packages it lacks.  SandboxError when it does not
    start or answer."""
    return _probe(_checked(python))


def _our_abi() -> str:
    return sys.implementation.cache_tag + (sysconfig.get_config_var("EXT_SUFFIX") or "")


def runtime_packages(python: str) -> dict[str, str]:
    """For each runtime package ``python`` lacks, the directory of agentloop's own copy
    (empty when it has them all).  ConfigError, saying what to install, when it lacks some and
    cannot load ours (another Python version or ABI)."""
    python = _checked(python)
    info = _probe(python)
    if not info.missing:
        return {}
    if info.abi != _our_abi():
        raise ConfigError(
            f"the worker's Python {python} ({info.version}) cannot import {', '.join(info.missing)}, which "
            f"agentloop's runtime needs, and agentloop's own copies are built for Python "
            f"{sys.version.split()[0]}: install them there with `{python} -m pip install {RUNTIME_INSTALL}`, "
            "or choose an interpreter of that version with --python")
    found = {}
    for name in info.missing:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"agentloop's own {name} is not installed; run scripts/agentloop once to set it up")
        found[name] = str(Path(next(iter(spec.submodule_search_locations))).resolve())
    return found


def runtime_dirs(python: str) -> tuple[str, ...]:
    """The directories of agentloop's copies that ``python``'s workers load (to be shown to
    them read-only): each package and its companions, never the rest of their site-packages."""
    dirs = []
    for name, package in runtime_packages(python).items():
        dirs.append(package)
        site = os.path.dirname(package)
        dirs += [os.path.join(site, c) for c in _COMPANIONS.get(name, ()) if os.path.isdir(os.path.join(site, c))]
    return tuple(dirs)


def not_importable(python: str, modules: tuple[str, ...]) -> list[str]:
    """The names among ``modules`` that ``python`` cannot import (found without importing them)."""
    if not modules:
        return []
    python = _checked(python)
    code = ("import importlib.util, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try:\n"
            "        ok = importlib.util.find_spec(n) is not None\n"
            "    except (ImportError, ValueError):\n"
            "        ok = False\n"
            "    ok or print(n)\n")
    return _run(python, "-I", "-c", code, *modules).decode("utf-8", "replace").split()


# -- how agentloop's runtime starts in it ----------------------------------------------------------

#: The directory holding the ``worker`` package (and ``engine``): put on a runtime's path by
#: its absolute name, never found through the directory a process starts in.
RUNTIME_ROOT = str(Path(worker.contract.__file__).resolve().parent.parent.parent)


def runtime_argv(python: str, entry: str, *args: str, packages: dict[str, str] | None = None,
                 site: bool = True) -> list[str]:
    """The command line that runs ``entry`` (``"module:function"``, one of
    ``contract.start.ENTRIES``) of agentloop's runtime: the one launch command of every process
    the coordinator starts in a sandbox.

    ``-I`` (isolated mode) leaves the current directory, ``PYTHON*`` variables and the user's
    site directory off ``sys.path``, and the runtime is found by its absolute path: a process
    that starts with privileges (a worker before it confines itself, the fork server) imports
    nothing from a directory a worker can write, whatever directory it starts in.  ``-B``: the
    runtime never writes bytecode next to its sources.  ``packages`` (``interpreter.
    runtime_packages``): runtime packages that ``python`` lacks, by name, with the directory
    of agentloop's copy; an import hook finds those names, and only those, there.  ``site=False``
    (``-S``): not even site-packages' ``.pth`` files run (exec's confiner, the tool process).
    ``python`` is checked first unless it is a TrustedPython: what it builds is run."""
    python = _checked(python)
    module, _, function = entry.partition(":")
    if not (module.replace(".", "").replace("_", "").isalnum() and function.isidentifier()):
        raise ValueError(f"not a runtime entry point: {entry!r}")
    boot = f"import sys; sys.path.insert(0, {RUNTIME_ROOT!r}); "
    if packages:
        # The package's own directory, not its parent's: under Landlock alone a worker may
        # read the package but not list the site-packages around it.
        boot += ("import importlib.util\n"
                 "class _RuntimePackages:\n"
                 f"    at = {dict(packages)!r}\n"
                 "    spec = staticmethod(importlib.util.spec_from_file_location)\n"
                 "    @classmethod\n"
                 "    def find_spec(cls, name, path=None, target=None):\n"
                 "        where = cls.at.get(name)\n"
                 "        return cls.spec(name, where + '/__init__.py', submodule_search_locations=[where]) "
                 "if where else None\n"
                 "sys.meta_path.append(_RuntimePackages)\n")
    boot += f"from {module} import {function}; {function}()"
    return [python, "-I", *([] if site else ["-S"]), "-B", "-c", boot, *args]


@lru_cache(maxsize=8)
def python_paths(python: str) -> tuple[str, ...]:
    """Directories the interpreter `python` needs read-only: its prefixes and every sys.path
    entry it starts with (site-packages, editable installs, PYTHONPATH), agentloop's copies of
    the runtime packages it lacks, plus this project's packages.  Asked of the interpreter
    itself (once), not taken from ours: the coordinator's own sys.path[0] may be any directory,
    a home among them."""
    python = _checked(python)
    info = [*_probe(python).paths, *runtime_dirs(python)]
    # The worker imports `worker` (and may import `engine`) from wherever this project lives;
    # an editable install maps them to the source tree without a sys.path entry.
    info += [str(Path(RUNTIME_ROOT) / "worker"), str(Path(RUNTIME_ROOT) / "engine")]
    # (``-I`` above: the paths of the interpreter itself, not of whatever the directory adds.)
    paths = [os.path.normpath(p) for p in info
             if p and os.path.isabs(p) and os.path.exists(p) and os.path.normpath(p) != "/"]
    return outermost(paths)


def check_workspace(workspace: Path, python: str) -> None:
    """Refuse a workspace that is or holds a directory on the import path of the coordinator or
    of the workers' Python, or lies inside one of the latter's: workers write the workspace, and
    a module planted there would run in a process with privileges (the coordinator, a worker
    before it confines itself, the next probe of that Python).  Nor may it hold the record of what workers could
    write (``engine.trust``)."""
    python = _checked(python)
    ws = os.path.realpath(workspace)
    ours = {os.path.realpath(p) for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p)}
    for path in sorted({*python_paths(python), *ours}):
        if beneath(path, ws):
            raise ConfigError(f"the workspace {ws} holds {path}, from which Python imports "
                              "agentloop's code: choose another --workspace")
    imported = [*_probe(python).paths[4:], *runtime_dirs(python)]  # (the workers' sys.path, not ours)
    for path in sorted({os.path.realpath(p) for p in imported if os.path.isabs(p) and os.path.isdir(p)}):
        if path != "/" and beneath(ws, path):
            raise ConfigError(f"the workspace {ws} lies inside {path}, from which Python imports modules: "
                              "choose another --workspace")
    trust.refuse_holding_record(ws)
