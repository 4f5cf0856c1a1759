"""The Python that workers run: which one, what it holds, and how agentloop's runtime runs in it.

Which one, first found: ``--python``, ``$AGENTLOOP_PYTHON``, ``python`` in ``./agentloop.toml``
(relative to that file), the active virtual environment (``$VIRTUAL_ENV/bin/python``), else the
Python agentloop itself runs on.  So code in a worker imports what the user's own ``python``
imports, not agentloop's private packages.

The worker runtime needs two packages of its own, pyzmq and msgpack.  An interpreter that
lacks them but is the same Python as agentloop's (version and ABI) gets agentloop's copies,
found by an import hook that knows those two names only: they are neither added to that
interpreter's ``sys.path`` nor listed among its packages.  Any other interpreter must have them
installed, and the error says how.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import worker.contract
from engine import trust
from engine.config import CONFIG_FILE, read_config
from engine.errors import ConfigError, SandboxError, UntrustedFile
from engine.sandbox._bwrap import beneath, outermost

__all__ = [
    "Interpreter", "RUNTIME_INSTALL", "RUNTIME_PACKAGES", "RUNTIME_ROOT", "check_workspace",
    "choose_python", "not_importable", "probe", "python_paths", "refuse_untrusted",
    "refuse_untrusted_paths", "runtime_argv", "runtime_dirs", "runtime_packages", "which_python"
]

#: Third-party packages the worker runtime imports, by import name (distribution in brackets
#: of ``RUNTIME_INSTALL``).
RUNTIME_PACKAGES = ("zmq", "msgpack")
RUNTIME_INSTALL = "pyzmq msgpack"
#: Directories next to a package that belong to it (pyzmq's wheel keeps libzmq in ``pyzmq.libs``).
_COMPANIONS = {"zmq": ("pyzmq.libs",)}


@dataclass(frozen=True)
class Interpreter:
    """What one Python answered about itself (asked once per process)."""

    path: str  # the interpreter itself, as it names itself (a launcher script, e.g. pyenv's, resolved)
    version: str  # "3.11.7"
    abi: str  # sys.implementation.cache_tag + the extension suffix: what compiled modules must match
    paths: tuple[str, ...]  # its prefixes and the sys.path it starts with (``-I``)
    missing: tuple[str, ...]  # runtime packages it cannot import by itself


def choose_python(explicit: str | None = None, config: Path | None = None,
                  workspace: Path | None = None) -> str:
    """The interpreter workers run (see the module docstring), as an absolute path.  A name is
    looked up on PATH; one that is not there, or not executable, or one a worker could have
    written (``refuse_untrusted``), is a ConfigError; so is an invalid ``config`` file."""
    return which_python(explicit, config, workspace)[0]


def which_python(explicit: str | None = None, config: Path | None = None,
                 workspace: Path | None = None) -> tuple[str, str]:
    """``choose_python``'s interpreter and, in words, which of the five sources chose it."""
    config = config or Path(CONFIG_FILE)
    for given, where in ((explicit, "--python"), (os.environ.get("AGENTLOOP_PYTHON"), "AGENTLOOP_PYTHON"),
                         *_configured(config)):
        if given:
            return _resolve(given, where, workspace), where
    venv = os.environ.get("VIRTUAL_ENV")
    if venv and os.access(os.path.join(venv, "bin", "python"), os.X_OK):
        return os.path.join(venv, "bin", "python"), f"the active virtual environment (VIRTUAL_ENV={venv})"
    return sys.executable, ("default, agentloop's own (none of --python, AGENTLOOP_PYTHON, python in "
                            f"{config} or an active virtual environment names one)")


def _configured(config: Path) -> list[tuple[str | None, str]]:
    if not config.is_file():
        return []
    value = read_config(config).get("python")  # the whole file checked, as every command checks it
    if value is None:
        return []
    if os.sep in value and not os.path.isabs(value):
        value = str(config.resolve().parent / value)
    return [(value, f"python in {config}")]


def _resolve(given: str, where: str, workspace: Path | None) -> str:
    found = given if os.sep in given else shutil.which(given)
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise ConfigError(f"{where}: {given} is not an executable Python interpreter; give its path, "
                          "e.g. --python /usr/bin/python3 or --python .venv/bin/python")
    refuse_untrusted(os.path.abspath(found), workspace)  # before it is run at all
    refuse_untrusted_paths(os.path.abspath(found))  # before it is run with its site
    # What the interpreter calls itself: a launcher script (pyenv's shims) becomes the program it
    # runs; links are kept, as a virtual environment's python finds its packages by its own place.
    return probe(os.path.abspath(found)).path


def refuse_untrusted(python: str, workspace: Path | None) -> None:
    """ConfigError for an interpreter a worker could have written: one beneath ``workspace`` (as
    named, or once its links are followed: a virtual environment finds its packages by where its
    link lies), or one ``engine.trust`` refuses — its file, its link or a directory above it a
    workers' uid's or writable by others, or it (its whole virtual environment) changed or
    stood unprotected while workers of an earlier run could write around it.  The coordinator
    runs it to ask what it is and the fork server runs it with privileges: it must never be
    something model code planted."""
    named, real = os.path.abspath(python), os.path.realpath(python)
    if workspace is not None:
        ws = os.path.realpath(workspace)
        if any(os.path.commonpath([path, ws]) == ws for path in (named, real)):
            raise ConfigError(f"the workers' Python {python} lies in the workspace {ws}, which workers "
                              "write: choose another --workspace or an interpreter elsewhere")
    venv = next((str(top) for top in (Path(named).parent.parent, Path(real).parent.parent)
                 if (top / "pyvenv.cfg").is_file()), None)
    why = trust.owner_refusal(os.path.dirname(named)) or trust.refusal(named, tree=venv)
    if why:
        raise UntrustedFile(f"the workers' Python {python} is not used: {why}")


def refuse_untrusted_paths(python: str) -> None:
    """UntrustedFile when a directory ``python`` imports from lies where workers of an earlier
    run could write, was there then and was not kept read-only (``engine.trust``): a module
    planted there would run in the fork server, with privileges.  The directories ``site`` would
    read are looked at first, from a run of ``python -S`` that executes no file of theirs: a
    planted ``.pth`` or ``sitecustomize`` must not run even in the probe."""
    _refuse_any(python, _site_free_paths(python))
    _refuse_any(python, probe(python).paths)  # (this one runs site: only once the above passed)


def _refuse_any(python: str, paths: Iterable[str]) -> None:
    for path in paths:
        if os.path.isabs(path) and os.path.isdir(path):
            why = trust.record_refusal(path, tree=path)
            if why:
                raise UntrustedFile(f"the workers' Python {python} imports from {path}, which is not used: {why}")


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


@lru_cache(maxsize=8)
def _site_free_paths(python: str) -> tuple[str, ...]:
    """The prefixes, the paths, the site directories of ``python`` and the directories their
    ``.pth`` files add, asked with ``-S`` (the ``.pth`` files read as text): without ``-S``,
    ``site`` executes the ``.pth`` files' import lines and a ``sitecustomize`` from any of them."""
    try:
        out = subprocess.run([python, "-I", "-S", "-c", _SITE_FREE_PROBE], capture_output=True, timeout=60,
                             cwd="/", stdin=subprocess.DEVNULL, check=True).stdout
        paths = json.loads(out)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"cannot start the worker's python {python}: {exc}") from exc
    return tuple(path for path in paths if isinstance(path, str))


@lru_cache(maxsize=8)
def probe(python: str) -> Interpreter:
    """Ask ``python`` (isolated, from ``/``) for its version, ABI, paths and which runtime
    packages it lacks.  SandboxError when it does not start or answer."""
    try:
        out = subprocess.run([python, "-I", "-c", _PROBE, ",".join(RUNTIME_PACKAGES)], capture_output=True,
                             timeout=60, cwd="/", stdin=subprocess.DEVNULL, check=True).stdout
        info = json.loads(out)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"cannot start the worker's python {python}: {exc}") from exc
    return Interpreter(info["executable"] or python, info["version"], info["abi"], tuple(info["paths"]),
                       tuple(info["missing"]))


def _our_abi() -> str:
    return sys.implementation.cache_tag + (sysconfig.get_config_var("EXT_SUFFIX") or "")


def runtime_packages(python: str) -> dict[str, str]:
    """For each runtime package ``python`` lacks, the directory of agentloop's own copy
    (empty when it has them all).  ConfigError, saying what to install, when it lacks some and
    cannot load ours (another Python version or ABI)."""
    info = probe(python)
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
    code = ("import importlib.util, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try:\n"
            "        ok = importlib.util.find_spec(n) is not None\n"
            "    except (ImportError, ValueError):\n"
            "        ok = False\n"
            "    ok or print(n)\n")
    try:
        out = subprocess.run([python, "-I", "-c", code, *modules], capture_output=True, text=True, timeout=60,
                             cwd="/", stdin=subprocess.DEVNULL, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"cannot start the worker's python {python}: {exc}") from exc
    return out.split()


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
    (``-S``): not even site-packages' ``.pth`` files run (exec's confiner, the tool process)."""
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
    info = [*probe(python).paths, *runtime_dirs(python)]
    # The worker imports `worker` (and may import `engine`) from wherever this project lives;
    # an editable install maps them to the source tree without a sys.path entry.
    info += [str(Path(RUNTIME_ROOT) / "worker"), str(Path(RUNTIME_ROOT) / "engine")]
    # (``-I`` above: the paths of the interpreter itself, not of whatever the directory adds.)
    paths = [os.path.normpath(p) for p in info
             if p and os.path.isabs(p) and os.path.exists(p) and os.path.normpath(p) != "/"]
    return outermost(paths)


def check_workspace(workspace: Path, python: str) -> None:
    """Refuse a workspace that is, or holds, a directory on the import path of the coordinator
    or of the workers' Python: workers write the workspace, and a module planted there would
    run in a process with privileges (the coordinator, a worker before it confines itself).
    Nor may it hold the record of what workers could write (``engine.trust``)."""
    ws = os.path.realpath(workspace)
    ours = (os.path.realpath(p) for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p))
    for path in sorted({*python_paths(python), *ours}):
        if beneath(path, ws):
            raise ConfigError(f"the workspace {ws} holds {path}, from which Python imports "
                              "agentloop's code: choose another --workspace")
    trust.refuse_holding_record(ws)
