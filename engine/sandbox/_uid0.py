"""What code that keeps uid 0, without any capability, must not get from that uid alone.

A file's mode lets its owner read or write it whatever the capabilities, and root owns the
kernel's files: ``/proc/kpageflags`` and ``/proc/slabinfo`` (0400), ``/proc/sysrq-trigger``
(0200: one write reboots the host), every sysctl under ``/proc/sys`` (``kernel.core_pattern``
names a program the kernel runs as root).  Code runs so when ``exec`` runs root's script as
root, under ``--write-cwd``, and where the workers' Python is closed to other users.  The
sandbox then covers the first kind and shows ``/proc/sys`` read-only (``engine.sandbox``), and
the seccomp filter refuses set-user-ID and set-group-ID modes (``worker._confine``).
"""

from __future__ import annotations

import contextlib
import os
import stat

__all__ = ["root_proc"]


def root_proc() -> tuple[str, ...]:
    """The files directly in ``/proc`` that only root may read, or that root may write: the
    sandbox's ``/proc`` holds what the host's holds."""
    found = []
    with contextlib.suppress(OSError), os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit() or entry.is_symlink():
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and (not st.st_mode & 0o004 or st.st_mode & 0o200):
                    found.append(entry.path)
    return tuple(sorted(found))
