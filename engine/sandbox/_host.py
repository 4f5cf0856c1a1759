"""What this machine's sandbox can do for the current user: bubblewrap and its namespaces,
Landlock, seccomp, a fork server below bubblewrap's user namespace; probed once per process
(the fork server's probe, once across commands while nothing it depends on changed)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine.environment import ALLOWLIST, environment
from engine.sandbox._bwrap import beneath, probe_argv
from engine.sandbox._interpreter import python_paths, runtime_argv
from engine.sandbox._probe_cache import remembered
from worker.contract.confinement import landlock_abi, seccomp_supported
from worker.contract.start import FORK_PROBE

__all__ = ["HostSupport", "fork_server_problem", "host_support", "readable_in_view", "root_blocker"]


@dataclass(frozen=True)
class HostSupport:
    """The sandbox layers this machine supports for the current user (probed once)."""

    root: bool
    bwrap: str | None          # path of a bwrap that can build our namespaces
    bwrap_problem: str         # why not, when bwrap is None
    landlock_abi: int          # 0: unavailable
    seccomp: bool


@lru_cache(maxsize=1)
def host_support() -> HostSupport:
    """Probe bubblewrap (by running it with the namespaces we use), Landlock and seccomp."""
    root = os.geteuid() == 0
    exe = shutil.which("bwrap")
    problem = ""
    if exe is None:
        problem = "bubblewrap not found"
    else:
        true = shutil.which("true") or "/bin/true"
        argv = [*probe_argv(exe, root), true]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
                                  env=environment(ALLOWLIST))
            if done.returncode != 0:
                err = done.stderr.decode(errors="replace").strip().splitlines()
                problem = "bubblewrap cannot create namespaces here" + (f" ({err[-1]})" if err else "")
                exe = None
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem, exe = f"bubblewrap failed to run ({exc})", None
    return HostSupport(root, exe, problem, landlock_abi(), seccomp_supported())



@lru_cache(maxsize=2)
def fork_server_problem(fresh: bool = False) -> str | None:
    """Why a fork server cannot run here for this user (None: it can), in a few words.

    Root's needs bubblewrap only.  An unprivileged user's runs in bubblewrap's user namespace
    and gives each process it forks a user namespace of its own: a kernel or policy that allows
    bubblewrap its namespace may still refuse one below it (AppArmor's restriction of
    unprivileged user namespaces, a low ``user.max_user_namespaces``).  So that much is made
    once, as the server makes it (``worker.fork_server.probe``): an interpreter started in a
    sandbox of its own, once per process — and once across commands while it worked and
    bubblewrap, this interpreter, the worker's code and the kernel's settings for user
    namespaces stay the same (``_probe_cache``); a refusal is asked again each time, so that
    a fix shows at once.  ``fresh``: probe whatever was kept (``doctor``, which diagnoses)."""
    host = host_support()
    if host.bwrap is None:
        return host.bwrap_problem
    if host.root:
        return None
    bwrap = host.bwrap
    if fresh:
        return _fork_server_probe(bwrap)
    return remembered("fork server probe", sys.executable, lambda: _fork_server_probe(bwrap),
                      lambda answer: answer is None, lambda _: [bwrap, *_worker_code()], context=_userns_settings())


def _worker_code() -> list[str]:
    """The worker's modules, which the probe runs (their identities are part of a kept answer)."""
    top = Path(__file__).resolve().parents[2] / "worker"
    return sorted(str(p) for p in [*top.glob("*.py"), *top.glob("contract/*.py")])


#: The kernel's settings that decide whether a user namespace is allowed below bubblewrap's:
#: the boot (a kernel updated, or set up again), the limits, and AppArmor's restriction.
_USERNS_SETTINGS = ("kernel/random/boot_id", "user/max_user_namespaces", "kernel/unprivileged_userns_clone",
                    "kernel/apparmor_restrict_unprivileged_userns", "kernel/apparmor_restrict_unprivileged_unconfined")
_APPARMOR_PROFILES = "/sys/kernel/security/apparmor/profiles"


def _userns_settings() -> list:
    """The values of ``_USERNS_SETTINGS`` and a digest of AppArmor's loaded profiles (a profile
    for bubblewrap added or removed), where they can be read."""
    profiles = None
    with contextlib.suppress(OSError), open(_APPARMOR_PROFILES, "rb") as f:
        profiles = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return [*(_read_sysctl(name) for name in _USERNS_SETTINGS), profiles]


def _fork_server_probe(bwrap: str) -> str | None:
    argv = probe_argv(bwrap, False, server="fork") + runtime_argv(sys.executable, FORK_PROBE)
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, cwd="/",
                              env=environment(ALLOWLIST))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap failed to run ({exc})"
    if done.returncode == 0:
        return None
    said = done.stderr.decode(errors="replace").strip().splitlines()
    why = said[-1].removeprefix("agentloop fork server: worker start failed: ") if said else f"exit {done.returncode}"
    if _read_sysctl("kernel/apparmor_restrict_unprivileged_userns") == "1":
        why += "; AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1)"
    return f"the kernel refuses a user namespace inside bubblewrap's ({why})"


def _read_sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name).read_text().strip()
    except OSError:
        return None


def root_blocker(python: str, use_bwrap: bool) -> str | None:
    """For root: the first directory of the worker's Python that an unprivileged uid could
    not read (so the worker must keep uid 0), or None when it can switch uid.  Under
    bubblewrap only the bound directories' own modes count (it creates their parents 0755)."""
    needed = list(python_paths(python))
    if use_bwrap:
        return next((p for p in needed if not readable_in_view(p, needed)), None)
    return next((p for p in needed if not _readable_by_others(p)), None)


def _readable_by_others(path: str, top: str = "/") -> bool:
    """Whether an unrelated uid can reach `path`: every ancestor from `top` (a bind target,
    whose own ancestors bubblewrap creates 0755) searchable, the path itself readable (and
    searchable if a directory)."""
    p = Path(path)
    for anc in reversed(p.parents):
        if beneath(str(anc), top) and not os.stat(anc).st_mode & 0o001:
            return False
    mode = os.stat(p).st_mode
    return bool(mode & 0o004) and (not p.is_dir() or bool(mode & 0o001))


def readable_in_view(path: str, binds: list[str]) -> bool:
    """`_readable_by_others` inside bubblewrap's view, where `path` lies beneath one of `binds`."""
    top = next((b for b in binds if beneath(path, b)), "/")
    return _readable_by_others(path, top)
