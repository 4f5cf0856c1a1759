"""Confinement a worker applies to itself before any user code runs.

`apply(spec)` takes the spec (`contract.confinement.Confinement`) the coordinator built and installs, in
order: resource limits, the drop to an unprivileged uid (root only), an empty capability set,
no_new_privs, a Landlock ruleset and a seccomp-BPF filter.  Either every layer the spec names is
in place when it returns, or it raises `ConfinementError` and the worker must exit: a half-applied
sandbox never runs user code.

This module imports only the standard library and nothing from `engine`, so the worker can use
it before anything else; ctypes is imported lazily.  It must run while the process has a single
thread: Landlock and no_new_privs are per thread, and threads started earlier would escape them.
"""

from __future__ import annotations

import errno
import os
import resource
import stat
import struct

from .contract.confinement import Confinement, Landlock, Seccomp, landlock_abi, seccomp_supported

__all__ = ["ConfinementError", "apply", "landlock_abi", "prepare", "seccomp_supported", "separate"]


class ConfinementError(RuntimeError):
    """A layer the spec requires could not be applied; the worker must not run user code."""


# ---------------------------------------------------------------------------------------------
# Architectures.  The seccomp program carries both tables and checks the architecture of every
# call, so a filter built on one machine is still exact on the other.
# ---------------------------------------------------------------------------------------------

_AUDIT_ARCH_X86_64 = 0xC000003E
_AUDIT_ARCH_AARCH64 = 0xC00000B7
_X32_SYSCALL_BIT = 0x40000000

# Syscalls refused with EPERM, and the threat each one carries.
_DENY = {
    # Rearranging the filesystem view: escape the bind mounts, hide or replace files.
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    # The new mount API does the same without mount(2).
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
    # Reading or writing another process's memory, stealing its file descriptors.
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440), "kcmp": (312, 272),
    # Loading kernel code, replacing the kernel, rebooting.
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142),
    # Large kernel attack surfaces that sandboxed code has no use for.
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "lookup_dcookie": (212, 18),
    # io_uring runs socket/open operations that seccomp never sees.
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    # New namespaces: a user namespace hands out a full capability set inside it.
    "unshare": (272, 97), "setns": (308, 268),
    # Opening files by handle bypasses the path walk and so the mount view.
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    # Host-wide state: swap, process accounting, quotas, the clock.
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89),
    "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "settimeofday": (164, 170), "clock_settime": (227, 112),
    # Raw I/O port access (x86 only).
    "iopl": (172, None), "ioperm": (173, None),
}
# Syscalls whose arguments are inspected.
_NR = {
    "clone": (56, 220), "clone3": (435, 435), "personality": (135, 92), "ioctl": (16, 29),
    "socket": (41, 198), "setsid": (112, 157), "setpgid": (109, 154),
    "mmap": (9, 222), "memfd_create": (319, 279), "shmget": (29, 194),
    "seccomp": (317, 277), "capget": (125, 90), "capset": (126, 91),
    "landlock_create_ruleset": (444, 444), "landlock_add_rule": (445, 445),
    "landlock_restrict_self": (446, 446),
}
# Calls that set a file's mode, with the argument holding the mode and, for the opening calls,
# the one holding the flags (a mode is read only when O_CREAT or O_TMPFILE asks for one).
_MODE_CALLS = (("chmod", (90, None), 1, None), ("fchmod", (91, 52), 1, None),
               ("fchmodat", (268, 53), 2, None), ("fchmodat2", (452, 452), 2, None),
               ("creat", (85, None), 1, None), ("open", (2, None), 2, 1), ("openat", (257, 56), 3, 2),
               ("mknod", (133, None), 1, None), ("mknodat", (259, 33), 2, None))
_OPENAT2 = (437, 437)  # its mode is in memory that BPF cannot read
_S_ISUID_ISGID = 0o6000
_O_CREAT_TMPFILE = 0o100 | 0o20000000
_ARCHES = (("x86_64", _AUDIT_ARCH_X86_64, 0), ("aarch64", _AUDIT_ARCH_AARCH64, 1))

_CLONE_NEW_MASK = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000   # NEWNS CGROUP UTS IPC
                   | 0x10000000 | 0x20000000 | 0x40000000)              # NEWUSER NEWPID NEWNET
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C
_AF_NETLINK, _NETLINK_ROUTE = 16, 0
_MAP_SHARED_ANONYMOUS = 0x01 | 0x20
_PERSONALITY_QUERY = 0xFFFFFFFF


def _machine() -> str | None:
    m = os.uname().machine.lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(m)


def _nr(name: str) -> int:
    arch = _machine()
    if arch is None:
        raise ConfinementError(f"unsupported architecture {os.uname().machine!r}")
    return _NR[name][0 if arch == "x86_64" else 1]


# ---------------------------------------------------------------------------------------------
# libc access
# ---------------------------------------------------------------------------------------------

_libc = None


def _lib():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
        _libc.prctl.restype = ctypes.c_int
    return _libc


def _syscall(nr: int, *args) -> int:
    """Raw syscall; ints travel as C longs, bytes as pointers.  Raises OSError on -1."""
    import ctypes

    conv = [a if not isinstance(a, int) else ctypes.c_long(a) for a in args]
    ret = _lib().syscall(ctypes.c_long(nr), *conv)
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    import ctypes

    ret = _lib().prctl(option, ctypes.c_ulong(a2), ctypes.c_ulong(a3), ctypes.c_ulong(a4),
                       ctypes.c_ulong(a5))
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


# ---------------------------------------------------------------------------------------------
# Probes: ``contract.confinement`` (the coordinator asks them to plan; here they are checked)
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------

def _single_threaded() -> None:
    # Landlock, no_new_privs and seccomp (without TSYNC) bind only the calling thread: a thread
    # started before apply() would run unconfined.
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return  # no /proc: nothing to check against; seccomp still uses TSYNC
    if len(threads) > 1:
        raise ConfinementError(f"apply() must run before any thread starts ({len(threads)} running)")


def _rlimits(limits: tuple[tuple[str, int, int], ...]) -> None:
    for name, soft, hard in limits:
        kind = getattr(resource, "RLIMIT_" + name, None)
        if kind is None:
            raise ConfinementError(f"unknown resource limit {name}")
        _, cur_hard = resource.getrlimit(kind)
        # Never ask for more than the inherited hard limit: lower is stricter, and raising it
        # would need CAP_SYS_RESOURCE.
        if cur_hard != resource.RLIM_INFINITY:
            hard = cur_hard if hard in (None, -1) else min(hard, cur_hard)
        if soft in (None, -1) or (hard not in (None, -1) and soft > hard):
            soft = hard
        lim = (resource.RLIM_INFINITY if soft in (None, -1) else soft,
               resource.RLIM_INFINITY if hard in (None, -1) else hard)
        try:
            resource.setrlimit(kind, lim)
        except (OSError, ValueError) as exc:
            raise ConfinementError(f"setrlimit({name}, {lim}) failed: {exc}") from exc
        if resource.getrlimit(kind) != lim:
            raise ConfinementError(f"RLIMIT_{name} did not take")


_CAP_SETPCAP = 8
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _capabilities() -> tuple[int, int, int]:
    """(effective, permitted, inheritable) of this thread, 64-bit masks."""
    import ctypes

    hdr = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)  # this thread
    data = ctypes.create_string_buffer(24)
    _syscall(_nr("capget"), hdr, data)
    e0, p0, i0, e1, p1, i1 = struct.unpack("6I", data.raw)
    return e0 | e1 << 32, p0 | p1 << 32, i0 | i1 << 32


#: Set once this process has emptied its bounding set: a child forked after inherits it empty.
_bounding_dropped = False


def _drop_bounding_set() -> None:
    # The bounding set caps what any later exec could gain.  Dropping needs CAP_SETPCAP; without
    # it there is nothing to gain anyway once no_new_privs is set.
    global _bounding_dropped
    if _bounding_dropped:
        return
    eff, _, _ = _capabilities()
    if not eff >> _CAP_SETPCAP & 1:
        return
    for cap in range(64):
        try:
            _prctl(24, cap)  # PR_CAPBSET_DROP
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # past CAP_LAST_CAP
                break
            raise ConfinementError(f"cannot drop capability {cap} from the bounding set: {exc}") from exc
    _bounding_dropped = True


def _drop_uid(uid: int, gid: int) -> None:
    # Root is exempt from RLIMIT_NPROC and may override file permissions: the worker becomes an
    # ordinary user, so the process limit holds and DAC applies to it.
    import ctypes

    deathsig = ctypes.c_int(0)
    try:
        _prctl(2, ctypes.addressof(deathsig))  # PR_GET_PDEATHSIG
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # clears every capability set: no capability survives
        # A credential change clears the parent-death signal; the caller armed it on purpose.
        if deathsig.value:
            _prctl(1, deathsig.value)  # PR_SET_PDEATHSIG
    except OSError as exc:
        raise ConfinementError(f"cannot switch to uid {uid}: {exc}") from exc
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise ConfinementError(f"uid switch to {uid} incomplete")


def _clear_caps() -> None:
    """Empty every capability set, the ambient one included.  Threat: a capability would let
    the worker raise its limits, signal any process, or read and write files whatever their
    modes say (CAP_DAC_READ_SEARCH reads root's 0400 files, /proc/kallsyms and the like)."""
    _prctl(47, 4)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    if _capabilities() != (0, 0, 0):
        hdr = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
        try:
            _syscall(_nr("capset"), hdr, bytes(24))
        except OSError as exc:
            raise ConfinementError(f"cannot clear capabilities: {exc}") from exc
    if _capabilities() != (0, 0, 0):
        raise ConfinementError(f"capabilities {_capabilities()} remain")


def _no_new_privs() -> None:
    # Threat: exec of a setuid or file-capability binary regaining privileges.  Also the
    # precondition for unprivileged seccomp and Landlock.
    _prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
    if _prctl(39) != 1:  # PR_GET_NO_NEW_PRIVS
        raise ConfinementError("no_new_privs did not take")


# Landlock access rights (include/uapi/linux/landlock.h).
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_MAKE_CHAR, _FS_MAKE_BLOCK = 1 << 6, 1 << 11
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1


def _landlock(rules: Landlock) -> int:
    """Read-only beneath `ro`, read-write beneath `rw`, device files in `dev`; nothing else.
    Returns the ABI used.  Rights this kernel does not know are left out (graceful degradation);
    the ABI the spec requires (`min_abi`) is enforced."""
    abi = landlock_abi()
    if abi < max(1, rules.min_abi):
        raise ConfinementError(f"Landlock ABI {abi} < required {rules.min_abi}")
    handled = (1 << 13) - 1                     # ABI 1: execute .. make_sym
    if abi >= 2:
        handled |= _FS_REFER                    # rename/link across directories
    if abi >= 3:
        handled |= _FS_TRUNCATE
    if abi >= 5:
        handled |= _FS_IOCTL_DEV                # ioctls on devices opened later (TIOCSTI &c)
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 and rules.deny_tcp else 0
    # Threat (ABI 6): signalling processes outside the sandbox (the coordinator) and reaching
    # abstract unix sockets of the host (they ignore the filesystem view).
    scoped = _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX if abi >= 6 and rules.scope else 0
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = struct.pack("QQQ", handled, net, scoped)[:size]
    try:
        ruleset = _syscall(_nr("landlock_create_ruleset"), attr, size, 0)
    except OSError as exc:
        raise ConfinementError(f"landlock_create_ruleset: {exc}") from exc
    ro = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    rw = handled & ~(_FS_MAKE_CHAR | _FS_MAKE_BLOCK | _FS_IOCTL_DEV)
    dev = (_FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV) & handled
    try:
        for paths, access, required in ((rules.ro, ro, False), (rules.rw, rw, True), (rules.dev, dev, False)):
            for path in paths:
                _landlock_rule(ruleset, path, access, handled, required)
        _syscall(_nr("landlock_restrict_self"), ruleset, 0)
    except OSError as exc:
        raise ConfinementError(f"Landlock: {exc}") from exc
    finally:
        os.close(ruleset)
    return abi


def separate() -> bool:
    """Give this process a Landlock domain of its own, nested in the one it has, that scopes
    signals and abstract unix sockets (ABI 6): from then on it cannot signal, ptrace (nor so read
    /proc/PID/mem, environ or fd of) or reach the abstract sockets of any process outside it — for
    a fork's copy, its parent worker and the other copies (what a copy starts stays inside).
    Only for a process confined already (no_new_privs set): returns False, applying nothing,
    where it is not or the kernel does not scope.  Raises ConfinementError when it cannot be
    applied (the kernel's 16 layers used up by copies of copies): the copy must not run then."""
    if _prctl(39) != 1 or landlock_abi() < 6:  # PR_GET_NO_NEW_PRIVS
        return False
    _single_threaded()
    attr = struct.pack("QQQ", 0, 0, _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX)
    try:
        ruleset = _syscall(_nr("landlock_create_ruleset"), attr, len(attr), 0)
        try:
            _syscall(_nr("landlock_restrict_self"), ruleset, 0)
        finally:
            os.close(ruleset)
    except OSError as exc:  # (E2BIG: every layer used)
        raise ConfinementError(f"Landlock scope of its own: {exc}") from exc
    return True


def _landlock_rule(ruleset: int, path: str, access: int, handled: int, required: bool) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        if required:
            raise ConfinementError(f"Landlock: writable path {path} does not exist") from None
        return  # an optional read-only path this host lacks
    try:
        access &= handled
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= _FS_FILE_RIGHTS
        attr = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr, packed
        _syscall(_nr("landlock_add_rule"), ruleset, 1, attr, 0)  # LANDLOCK_RULE_PATH_BENEATH
    finally:
        os.close(fd)


# Classic BPF opcodes and seccomp return values.
_LD_ABS = 0x20          # BPF_LD | BPF_W | BPF_ABS
_AND = 0x54             # BPF_ALU | BPF_AND | BPF_K
_JEQ, _JGE, _JSET = 0x15, 0x35, 0x45
_RET = 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_OFF_NR, _OFF_ARCH = 0, 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i  # low 32 bits of seccomp_data.args[i] (little endian on both arches)


#: Per set of options: the program and the ``struct sock_fprog`` (with the buffer it points
#: to) that ``seccomp(2)`` takes, built once per process (``prepare``).
_PROGRAMS: dict[Seccomp, tuple[bytes, object, object]] = {}


def seccomp_program(opts: Seccomp) -> bytes:
    """The filter for ``opts``, packed ``struct sock_filter`` entries, built once per process."""
    _seccomp_fprog(opts)
    return _PROGRAMS[opts][0]


def _seccomp_fprog(opts: Seccomp):
    """``_program`` as a ``struct sock_fprog``, built once per set of options."""
    built = _PROGRAMS.get(opts)
    if built is None:
        import ctypes

        class _Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        families = None if opts.socket_families is None else list(opts.socket_families)
        program = _program(families, opts.lock_session, opts.shared_memory, opts.set_id_modes)
        buf = ctypes.create_string_buffer(program, len(program))
        built = _PROGRAMS[opts] = (program, buf, _Fprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p)))
    return built[2]


def prepare(spec: Confinement) -> None:
    """Do once, in a process that forks many confined children (a sample slot), what each child
    would otherwise repeat: build the seccomp program, and empty the bounding set (which a fork
    inherits; the process keeps its effective and permitted capabilities, and never execs).
    ``apply`` in a child then installs the prepared program and skips the bounding set."""
    if spec.seccomp is not None:
        _seccomp_fprog(spec.seccomp)
    if spec.drop_caps:
        _drop_bounding_set()


def _program(socket_families: list[int] | None, lock_session: bool, shared_memory: bool,
             set_id_modes: bool = True) -> bytes:
    """The filter as packed `struct sock_filter`s.  `socket_families`: the address families
    socket(2) may create (None: any); of netlink, only NETLINK_ROUTE.  `lock_session`: refuse
    setsid/setpgid, so every descendant stays in the worker's process group and one killpg
    reaches it.  `shared_memory=False`: refuse the memory that RLIMIT_DATA does not count
    (memfd_create, SysV shmget, shared anonymous mmap), for workers without a memory cgroup.
    `set_id_modes=False`: refuse a mode with the set-user-ID or set-group-ID bit (chmod and
    its kin, and files created with one), for code that keeps uid 0: in a directory it may
    write, a root-owned set-user-ID copy of a shell would be anyone's root shell on the host."""
    prog: list[list] = []
    labels: dict[str, int] = {}

    def op(code: int, k: int = 0, jt: int | str = 0, jf: int | str = 0) -> None:
        prog.append([code, jt, jf, k])

    def label(name: str) -> None:
        labels[name] = len(prog)

    # Threat: a foreign calling convention (i386 int 0x80, arm32 compat) uses different numbers
    # and would walk past every rule below.  Anything but the two known arches is killed.
    op(_LD_ABS, _OFF_ARCH)
    for name, audit, col in _ARCHES:
        label(f"{name}")
        op(_JEQ, audit, 0, f"{name}_next")
        op(_LD_ABS, _OFF_NR)
        if name == "x86_64":
            op(_JGE, _X32_SYSCALL_BIT, "kill", 0)  # x32 syscalls reuse the x86_64 arch value
        for nrs in _DENY.values():
            if nrs[col] is not None:
                op(_JEQ, nrs[col], f"{name}_eperm", 0)
        # clone3 passes its flags in memory that BPF cannot read: ENOSYS makes libc fall back
        # to clone, whose flags can be checked.
        op(_JEQ, _NR["clone3"][col], f"{name}_enosys", 0)
        op(_JEQ, _NR["clone"][col], f"{name}_clone", 0)
        op(_JEQ, _NR["personality"][col], f"{name}_personality", 0)
        op(_JEQ, _NR["ioctl"][col], f"{name}_ioctl", 0)
        if socket_families is not None:
            op(_JEQ, _NR["socket"][col], f"{name}_socket", 0)
        if lock_session:
            op(_JEQ, _NR["setsid"][col], f"{name}_eperm", 0)
            op(_JEQ, _NR["setpgid"][col], f"{name}_eperm", 0)
        if not shared_memory:
            op(_JEQ, _NR["memfd_create"][col], f"{name}_eperm", 0)
            op(_JEQ, _NR["shmget"][col], f"{name}_eperm", 0)
            op(_JEQ, _NR["mmap"][col], f"{name}_mmap", 0)
        mode_calls = [(call, nrs[col], mode, flags) for call, nrs, mode, flags in _MODE_CALLS
                      if not set_id_modes and nrs[col] is not None]
        for call, nr, _, _ in mode_calls:
            op(_JEQ, nr, f"{name}_{call}", 0)
        if not set_id_modes:
            op(_JEQ, _OPENAT2[col], f"{name}_enosys", 0)  # (libc falls back to openat)
        op(_RET, _RET_ALLOW)
        for call, _, mode, flags in mode_calls:
            label(f"{name}_{call}")
            if flags is not None:
                op(_LD_ABS, _arg_lo(flags))
                op(_JSET, _O_CREAT_TMPFILE, 0, f"{name}_allow")
            op(_LD_ABS, _arg_lo(mode))
            op(_JSET, _S_ISUID_ISGID, f"{name}_eperm", f"{name}_allow")
        if not shared_memory:
            # Threat: MAP_SHARED | MAP_ANONYMOUS memory is shmem, which RLIMIT_DATA ignores.
            label(f"{name}_mmap")
            op(_LD_ABS, _arg_lo(3))
            op(_AND, _MAP_SHARED_ANONYMOUS)
            op(_JEQ, _MAP_SHARED_ANONYMOUS, f"{name}_eperm", f"{name}_allow")
        # Threat: clone(CLONE_NEW*) creates namespaces just like unshare(2).
        label(f"{name}_clone")
        op(_LD_ABS, _arg_lo(0))
        op(_JSET, _CLONE_NEW_MASK, f"{name}_eperm", f"{name}_allow")
        # Threat: personality(ADDR_NO_RANDOMIZE | READ_IMPLIES_EXEC) weakens ASLR/NX for what
        # is exec'd next.  Only the query (0xffffffff) and plain PER_LINUX (0) pass.
        label(f"{name}_personality")
        op(_LD_ABS, _arg_lo(0))
        op(_JEQ, 0, f"{name}_allow", 0)
        op(_JEQ, _PERSONALITY_QUERY, f"{name}_allow", f"{name}_eperm")
        # Threat: TIOCSTI / TIOCLINUX push keystrokes into a terminal the worker inherited.
        label(f"{name}_ioctl")
        op(_LD_ABS, _arg_lo(1))
        op(_JEQ, _TIOCSTI, f"{name}_eperm", 0)
        op(_JEQ, _TIOCLINUX, f"{name}_eperm", f"{name}_allow")
        if socket_families is not None:
            # Threat: the network (no namespace to cut it) and exotic families such as
            # AF_VSOCK, which reach the hypervisor whatever the network namespace.
            label(f"{name}_socket")
            op(_LD_ABS, _arg_lo(0))
            for fam in socket_families:
                op(_JEQ, fam, f"{name}_netlink" if fam == _AF_NETLINK else f"{name}_allow", 0)
            op(_RET, _RET_ERRNO | errno.EPERM)
            # Threat: netlink families beyond routing read host state, such as device events
            # (NETLINK_KOBJECT_UEVENT) or audit; NETLINK_ROUTE is what getaddrinfo and
            # interface listings use.
            label(f"{name}_netlink")
            op(_LD_ABS, _arg_lo(2))
            op(_JEQ, _NETLINK_ROUTE, f"{name}_allow", f"{name}_eperm")
        label(f"{name}_allow")
        op(_RET, _RET_ALLOW)
        label(f"{name}_eperm")
        op(_RET, _RET_ERRNO | errno.EPERM)
        label(f"{name}_enosys")
        op(_RET, _RET_ERRNO | errno.ENOSYS)
        label(f"{name}_next")
    label("kill")
    op(_RET, _RET_KILL_PROCESS)

    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        offs = []
        for j in (jt, jf):
            off = labels[j] - i - 1 if isinstance(j, str) else j
            if not 0 <= off <= 255:
                raise ConfinementError(f"BPF jump out of range at {i}")
            offs.append(off)
        out += struct.pack("HBBI", code, offs[0], offs[1], k)
    return bytes(out)


def _seccomp(opts: Seccomp) -> None:
    import ctypes

    fprog = _seccomp_fprog(opts)
    try:
        # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_TSYNC: every thread, or failure.
        ret = _syscall(_nr("seccomp"), 1, 1, ctypes.addressof(fprog))
    except OSError as exc:
        raise ConfinementError(f"seccomp: {exc}") from exc
    if ret != 0:
        raise ConfinementError(f"seccomp: thread {ret} could not be synchronised")
    if _prctl(21) != 2:  # PR_GET_SECCOMP -> SECCOMP_MODE_FILTER
        raise ConfinementError("seccomp filter not active")


def apply(spec: Confinement) -> list[str]:
    """Install every layer `spec` names, strongest last; return the names applied.

    Raises ConfinementError when any of them fails: the caller must exit without running
    user code.  An empty spec (sandbox mode "none") applies nothing."""
    applied: list[str] = []
    if not spec:
        return applied
    _single_threaded()
    try:
        if spec.rlimits:
            _rlimits(spec.rlimits)
            applied.append("rlimits")
        if spec.drop_caps:
            _drop_bounding_set()
        if spec.uid is not None:
            _drop_uid(*spec.uid)
            applied.append("uid")
        if spec.umask is not None:
            os.umask(spec.umask)  # files in the shared workspace stay group-writable
        if spec.drop_caps or spec.uid is not None:
            _clear_caps()
            applied.append("caps")
        if spec.no_new_privs or spec.landlock or spec.seccomp:
            _no_new_privs()
            applied.append("no_new_privs")
        if spec.landlock is not None:
            abi = _landlock(spec.landlock)
            applied.append(f"landlock(abi {abi})")
        if spec.seccomp is not None:
            _seccomp(spec.seccomp)
            applied.append("seccomp")
    except ConfinementError:
        raise
    except OSError as exc:
        raise ConfinementError(f"sandbox layer failed after {applied or 'none'}: {exc}") from exc
    return applied
