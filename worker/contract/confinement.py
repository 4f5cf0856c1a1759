"""The confinement spec: what a process applies to itself before it runs any code it was given.

One schema, built by the coordinator (``engine.sandbox`` for workers, slots and samples;
``engine.tool_process`` for the tool process), handed to the process through its start
(``contract.start``) or its first message, and applied by ``worker._confine.apply`` in a fixed
order: rlimits, the uid, capabilities, no_new_privs, Landlock, seccomp.  Also here: what this
kernel can apply (``landlock_abi``, ``seccomp_supported``), which the coordinator asks when it
plans and the confining process checks again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from .schema import ContractError, is_flag, is_int, is_list, is_optional, is_text

__all__ = ["Confinement", "Landlock", "Seccomp", "landlock_abi", "seccomp_supported"]

_RLIMITS = ("AS", "CORE", "CPU", "DATA", "FSIZE", "MEMLOCK", "NOFILE", "NPROC", "STACK")


@dataclass(frozen=True)
class Landlock:
    """Read-only beneath ``ro``, read-write beneath ``rw``, the device files in ``dev``; nothing
    else.  ``scope``: no signals to, and no abstract unix sockets of, processes outside (ABI 6);
    ``deny_tcp``: no TCP bind or connect (ABI 4); ``min_abi``: refuse an older kernel."""

    ro: tuple[str, ...] = ()
    rw: tuple[str, ...] = ()
    dev: tuple[str, ...] = ()
    scope: bool = True
    deny_tcp: bool = False
    min_abi: int = 1


@dataclass(frozen=True)
class Seccomp:
    """The filter's options.  ``socket_families``: what socket(2) may create (None: any; of
    netlink only routing); ``lock_session``: no setsid/setpgid, so one killpg reaches every
    descendant; ``shared_memory=False``: no memory RLIMIT_DATA cannot count (memfd_create, SysV
    shmget, shared anonymous mmap); ``set_id_modes=False``: no set-user-ID or set-group-ID
    mode (chmod, files created so), for code that keeps uid 0."""

    socket_families: tuple[int, ...] | None = None
    lock_session: bool = False
    shared_memory: bool = True
    set_id_modes: bool = True


@dataclass(frozen=True)
class Confinement:
    """Every layer, each None or empty when not applied.  ``rlimits``: name -> (soft, hard);
    ``uid``: (uid, gid) to switch to (a root start); ``umask``: set after the switch."""

    rlimits: tuple[tuple[str, int, int], ...] = ()
    drop_caps: bool = False
    no_new_privs: bool = False
    uid: tuple[int, int] | None = None
    umask: int | None = None
    landlock: Landlock | None = None
    seccomp: Seccomp | None = None

    def __bool__(self) -> bool:
        return self != _NONE

    def limit(self, name: str) -> tuple[int, int] | None:
        """The (soft, hard) rlimit ``name`` sets, if it sets one."""
        return next(((soft, hard) for n, soft, hard in self.rlimits if n == name), None)

    def replace(self, **changes: Any) -> Confinement:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Confinement:
        """The spec ``text`` holds (``to_json``'s); ContractError for anything else.  An empty
        text is the empty spec (sandbox mode ``none``)."""
        if not text:
            return _NONE
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ContractError(f"confinement: not JSON ({exc})") from None
        if type(raw) is not dict:
            raise ContractError("confinement: not a map")
        try:
            rlimits = tuple((is_text(16)(n), is_int(-1, 2**63)(s), is_int(-1, 2**63)(h))
                            for n, s, h in is_list(is_list(_scalar, 3), 16)(raw.get("rlimits", ())))
            if any(name not in _RLIMITS for name, _, _ in rlimits):
                raise ContractError("confinement: an unknown rlimit")
            uid = raw.get("uid")
            uid = None if uid is None else tuple(is_list(is_int(0, 2**32), 2)(uid))
            if uid is not None and len(uid) != 2:
                raise ContractError("confinement: uid is not (uid, gid)")
            landlock = raw.get("landlock")
            if landlock is not None:
                paths = is_list(is_text(4096), 4096)
                landlock = Landlock(paths(landlock.get("ro", ())), paths(landlock.get("rw", ())),
                                    paths(landlock.get("dev", ())), is_flag(landlock.get("scope", True)),
                                    is_flag(landlock.get("deny_tcp", False)), is_int(1, 1 << 16)(landlock.get("min_abi", 1)))
            seccomp = raw.get("seccomp")
            if seccomp is not None:
                families = is_optional(is_list(is_int(0, 64), 64))(seccomp.get("socket_families"))
                seccomp = Seccomp(families, is_flag(seccomp.get("lock_session", False)),
                                  is_flag(seccomp.get("shared_memory", True)), is_flag(seccomp.get("set_id_modes", True)))
            known = {f.name for f in dataclasses.fields(cls)}
            if set(raw) - known:
                raise ContractError(f"confinement: unknown layer {sorted(set(raw) - known)[0]!r}")
            return cls(rlimits, is_flag(raw.get("drop_caps", False)), is_flag(raw.get("no_new_privs", False)),
                       uid, is_optional(is_int(0, 0o777))(raw.get("umask")), landlock, seccomp)  # type: ignore[arg-type]
        except (AttributeError, TypeError, ValueError) as exc:
            if isinstance(exc, ContractError):
                raise
            raise ContractError(f"confinement: malformed ({exc})") from None


def _scalar(value: Any) -> Any:
    return value


_NONE = Confinement()


# -- what this kernel can apply ---------------------------------------------------------------------

_LANDLOCK_CREATE_RULESET = 444  # the same number on x86_64 and aarch64
_PR_GET_SECCOMP = 21


def _machine() -> str | None:
    m = os.uname().machine.lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(m)


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers; 0 when Landlock is absent or disabled."""
    if _machine() is None:
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # LANDLOCK_CREATE_RULESET_VERSION: the ABI, or -1 where Landlock is missing.
    abi = libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), None, ctypes.c_long(0), ctypes.c_long(1))
    return max(0, int(abi))


def seccomp_supported() -> bool:
    """Whether seccomp filters can be installed here (kernel support, known architecture)."""
    if _machine() is None:
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # PR_GET_SECCOMP fails with EINVAL where the kernel lacks CONFIG_SECCOMP.
    return libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) != -1
