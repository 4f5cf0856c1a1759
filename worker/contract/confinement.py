"""The confinement spec: what a process applies to itself before it runs any code it was given.

One schema, built by the coordinator (``engine.sandbox`` for workers, slots and samples;
``engine.tool_process`` for the tool process), handed to the process through its start
(``contract.start``) or its first message, and applied by ``worker._confine.apply`` in a fixed
order: rlimits, the uid, capabilities, no_new_privs, Landlock, seccomp.  Also here: what this
kernel can apply (``landlock_abi``, ``seccomp_supported``), which the coordinator asks when it
plans and the confining process checks again.
"""

from __future__ import annotations

import os
from typing import Any

from .schema import (
    Catalogue,
    ContractError,
    Message,
    field,
    is_choice,
    is_flag,
    is_int,
    is_list,
    is_message,
    is_optional,
    is_text,
    is_tuple,
    message,
)

__all__ = ["CONFINEMENT", "Confinement", "Landlock", "Seccomp", "landlock_abi", "seccomp_supported"]

_RLIMITS = ("AS", "CORE", "CPU", "DATA", "FSIZE", "MEMLOCK", "NOFILE", "NPROC", "STACK")
_paths = is_list(is_text(4096), 4096)
_limit = is_int(-1, 2**63)


@message("landlock")
class Landlock(Message):
    """Read-only beneath ``ro``, read-write beneath ``rw``, the device files in ``dev``; nothing
    else.  ``scope``: no signals to, and no abstract unix sockets of, processes outside (ABI 6);
    ``deny_tcp``: no TCP bind or connect (ABI 4); ``min_abi``: refuse an older kernel."""

    ro: tuple[str, ...] = field(_paths, ())
    rw: tuple[str, ...] = field(_paths, ())
    dev: tuple[str, ...] = field(_paths, ())
    scope: bool = field(is_flag, True)
    deny_tcp: bool = field(is_flag, False)
    min_abi: int = field(is_int(1, 1 << 16), 1)


@message("seccomp")
class Seccomp(Message):
    """The filter's options.  ``socket_families``: what socket(2) may create (None: any; of
    netlink only routing); ``lock_session``: no setsid/setpgid, so one killpg reaches every
    descendant; ``shared_memory=False``: no memory RLIMIT_DATA cannot count (memfd_create, SysV
    shmget, shared anonymous mmap); ``set_id_modes=False``: no set-user-ID or set-group-ID
    mode (chmod, files created so), for code that keeps uid 0."""

    socket_families: tuple[int, ...] | None = field(is_optional(is_list(is_int(0, 64), 64)), None)
    lock_session: bool = field(is_flag, False)
    shared_memory: bool = field(is_flag, True)
    set_id_modes: bool = field(is_flag, True)


@message("confinement")
class Confinement(Message):
    """Every layer, each None or empty when not applied.  ``rlimits``: name -> (soft, hard);
    ``uid``: (uid, gid) to switch to (a root start); ``umask``: set after the switch.

    A message like every other (``CONFINEMENT`` parses it): it travels as the JSON of its
    ``to_wire()`` (``to_json``), in a process's start (``contract.start``) or held in another
    message's field, and every layer is checked, unknown keys refused, wherever it is read."""

    rlimits: tuple[tuple[str, int, int], ...] = field(is_list(is_tuple(is_choice(*_RLIMITS), _limit, _limit), 16), ())
    drop_caps: bool = field(is_flag, False)
    no_new_privs: bool = field(is_flag, False)
    uid: tuple[int, int] | None = field(is_optional(is_tuple(is_int(0, 2**32), is_int(0, 2**32))), None)
    umask: int | None = field(is_optional(is_int(0, 0o777)), None)
    landlock: Landlock | None = field(is_optional(is_message(Landlock)), None)
    seccomp: Seccomp | None = field(is_optional(is_message(Seccomp)), None)

    def __bool__(self) -> bool:
        return self != _NONE

    def limit(self, name: str) -> tuple[int, int] | None:
        """The (soft, hard) rlimit ``name`` sets, if it sets one."""
        return next(((soft, hard) for n, soft, hard in self.rlimits if n == name), None)

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_wire(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Confinement:
        """The spec ``text`` holds (``to_json``'s); ContractError for anything else.  An empty
        text is the empty spec (sandbox mode ``none``)."""
        if not text:
            return _NONE
        import json

        try:
            raw: Any = json.loads(text)
        except ValueError as exc:
            raise ContractError(f"confinement: not JSON ({exc})") from None
        return CONFINEMENT.parse(raw)  # type: ignore[return-value]


#: The one parser of a confinement on its own (in a message's field, ``is_message`` parses it).
CONFINEMENT = Catalogue("confinement", (Confinement,))
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
