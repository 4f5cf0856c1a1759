"""What the sandbox can do on this machine, layer by layer, for `agentloop doctor`.

`report(policy)` never starts a worker and changes nothing on disk: it reads the same host probe
`plan()` uses and says, for each layer, whether the kernel and the installation offer it
(`available`), whether a worker under `policy` would get it (`active`), and why.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.launch._cgroup import WorkerCgroups, delegation_hint
from engine.sandbox import HostSupport, SandboxPolicy, fork_server_problem, host_support, root_blocker

__all__ = ["Layer", "report"]


@dataclass(frozen=True)
class Layer:
    """One sandbox layer: offered here (`available`), used by the policy (`active`), and why."""

    name: str
    available: bool
    active: bool
    reason: str


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _userns_reason(host: HostSupport) -> tuple[bool, str]:
    if host.root:
        return True, "not needed: running as root, bubblewrap needs no user namespace"
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return False, "disabled: sysctl kernel.unprivileged_userns_clone=0"
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return False, "disabled: sysctl user.max_user_namespaces=0"
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1" and host.bwrap is None:
        return False, ("restricted by AppArmor (kernel.apparmor_restrict_unprivileged_userns=1); "
                       "the distribution's bwrap profile lifts it")
    if host.bwrap is None and "namespace" in host.bwrap_problem:
        return False, host.bwrap_problem
    return True, "unprivileged user namespaces allowed"


def report(policy: SandboxPolicy) -> list[Layer]:
    """The sandbox layers, in the order they are applied, for a worker under `policy`."""
    host = host_support()
    on = policy.mode != "none"
    bw = on and policy.mode in ("auto", "bwrap") and host.bwrap is not None
    arch = platform.machine()
    layers: list[Layer] = []

    if host.bwrap:
        bw_reason = f"{host.bwrap} builds the namespaces"
    elif host.bwrap_problem == "bubblewrap not found":
        bw_reason = "not found — install it: apt-get install bubblewrap"
    else:
        bw_reason = host.bwrap_problem
    if on and not bw and host.bwrap and policy.mode == "landlock":
        bw_reason += " (not used: mode landlock)"
    layers.append(Layer("bubblewrap", host.bwrap is not None, bw, bw_reason))
    ok, why = _userns_reason(host)
    layers.append(Layer("user namespace", ok, bw and not host.root, why))
    ns_why = "needs bubblewrap" if host.bwrap is None else "via bubblewrap"
    layers.append(Layer("mount namespace (read-only system, private /tmp)", host.bwrap is not None,
                        bw, ns_why))
    layers.append(Layer("pid namespace", host.bwrap is not None, bw, ns_why))
    net_why = ns_why if not policy.network else "policy allows the network"
    layers.append(Layer("network namespace", host.bwrap is not None, bw and not policy.network, net_why))

    layers.append(Layer("rlimits", True, on, "memory (RLIMIT_DATA), open files, file size, core, cpu"))
    cgroups = WorkerCgroups.find()
    if cgroups is not None:
        cgroups.close()
    if cgroups is not None:
        where = "" if host.root else f", beneath {cgroups.base.parent}, delegated to you"
        cg_why = f"a cgroup per worker{where}: the limit bounds its whole tree, shared memory included"
    elif host.root:
        cg_why = "no writable cgroup hierarchy with the memory controller: shared memory is refused instead"
    else:
        cg_why = ("no cgroup delegated to you: the limit is per process (RLIMIT_DATA) and shared memory "
                  f"is refused; to get one, {delegation_hint()}")
    layers.append(Layer("memory cgroup", cgroups is not None, on and cgroups is not None, cg_why))
    switches = True
    if host.root:
        blocked = root_blocker(sys.executable, bw)
        if blocked:
            why = f"root workers keep uid 0 (without capabilities): {blocked} is not readable by other users"
        else:
            why = "root workers switch to the run's own uid and keep no capability"
        switches = not blocked
        layers.append(Layer("unprivileged uid", True, on and switches, why))
    else:
        layers.append(Layer("unprivileged uid", True, on, f"already uid {os.getuid()}"))
    pids = WorkerCgroups.find(controller="pids")
    if pids is not None:
        pids.close()
    if pids is not None:
        nproc = "a pids cgroup per worker"
    elif not switches:
        nproc = "not bounded: uid 0 is exempt"
    elif host.root:
        nproc = "RLIMIT_NPROC on the run's own uid (all its workers together)"
    elif bw:
        nproc = "RLIMIT_NPROC, counted inside the worker's user namespace"
    else:
        nproc = "RLIMIT_NPROC, counted against all of your processes (budget added to your current count)"
    layers.append(Layer("process limit", True, on and "not bounded" not in nproc, nproc))
    layers.append(Layer("no_new_privs", True, on, "blocks privilege gain through setuid binaries"))

    abi = host.landlock_abi
    if abi:
        ll_why = f"ABI {abi}" + ("" if abi >= 6 else " (signal/abstract-socket scoping needs ABI 6)")
    else:
        ll_why = "unavailable: needs Linux 5.13+ with landlock in the lsm= boot list"
    layers.append(Layer("landlock", abi > 0, on and abi > 0, ll_why))
    sc_why = f"BPF filter for {arch}" if host.seccomp else f"unavailable (kernel or architecture {arch})"
    layers.append(Layer("seccomp", host.seccomp, on and host.seccomp, sc_why))
    # Not a layer: how each worker's layers are made (forked, or started cold).
    problem = fork_server_problem(fresh=True)
    if problem is not None:
        fs_why = f"{problem}: workers and code samples start cold (~100 ms each)"
    elif not bw:
        fs_why = "runs inside bubblewrap, which this sandbox mode does not use: workers start cold"
    else:
        fs_why = ("forks workers, sample slots and a batch's workers (~10 ms a worker instead of ~100)"
                  + ("" if host.root else ", in bubblewrap's user namespace, each in a user namespace of its own"))
    layers.append(Layer("fork server", problem is None, on and bw and problem is None, fs_why))
    return layers
