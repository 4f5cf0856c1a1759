"""Namespaces and mounts, as the fork server and the sample slots make them (both hold
CAP_SYS_ADMIN in their sandbox's namespaces and nowhere else: root's without a user namespace,
an unprivileged user's in a user namespace of their own).

Thin, checked wrappers over libc: each raises OSError naming what failed, so a process that
cannot build its view never runs code in a half-built one.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

__all__ = ["MS_BIND", "MS_NODEV", "MS_NOEXEC", "MS_NOSUID", "MS_PRIVATE", "MS_RDONLY", "MS_REC", "MS_REMOUNT",
           "NEWCGROUP", "NEWIPC", "NEWNET", "NEWNS", "NEWPID", "NEWUSER", "NEWUTS", "beneath", "bind", "check",
           "libc", "loopback_up", "mount_points_under", "no_user_namespaces", "own_user_namespace"]

libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWCGROUP, NEWUTS, NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18


def beneath(path: str, top: str) -> bool:
    """Whether ``path`` is ``top`` or lies below it (by path components, not by prefix)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def check(result: int, what: str) -> None:
    """Raise OSError (with ``what`` and errno's words) unless a libc call returned 0."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount_points_under(top: str) -> list[tuple[str, bool]]:
    """(mount point, read-only) of every mount strictly below ``top``, shallowest first (by
    depth: a deeper mount comes after the one it lies on)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
            if point.startswith(top.rstrip("/") + "/"):
                found.append((point, "ro" in fields[5].split(",")))
    return sorted(found, key=lambda item: item[0].count("/"))


def bind(fd: int, where: str, read_only: bool) -> None:
    """Bind the directory or file open as ``fd`` (an O_PATH descriptor) at ``where``, with the
    mounts beneath it: in a mount namespace that belongs to a user namespace below its parent's,
    the mounts copied from the parent are locked together, and one is bound only with those
    beneath it (the kernel refuses to uncover them)."""
    if not os.path.lexists(where):  # (a file kept read-only in a workspace is its own mount point)
        os.makedirs(where)
    check(libc.mount(f"/proc/self/fd/{fd}".encode(), where.encode(), None, MS_BIND | MS_REC, None), where)
    if read_only:
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
        check(libc.mount(None, where.encode(), None, flags, None), where)


def loopback_up() -> None:
    """A new network namespace starts with its loopback down: servers the code starts on
    127.0.0.1 should work, as they do in a cold-started worker."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags))  # SIOCSIFFLAGS


def own_user_namespace() -> None:
    """Move this (single-threaded) process into a user namespace of its own, keeping its uid
    and gid: the one mapping an unprivileged process may write for itself.  It holds every
    capability there, and the namespaces it makes next belong to it, not to its parent's user
    namespace: what they count (RLIMIT_NPROC's tasks) and allow is this process's tree's alone."""
    uid, gid = os.geteuid(), os.getegid()
    check(libc.unshare(NEWUSER), "unshare(user)")
    # setgroups stays denied: an unprivileged mapping of the gid requires it.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def no_user_namespaces() -> None:
    """Allow no user namespace below this process's own, for good (bubblewrap's
    ``--disable-userns`` does the same): needs CAP_SYS_RESOURCE in it and a /proc of its own."""
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
