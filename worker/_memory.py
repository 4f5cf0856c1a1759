"""The C allocator's settings for a worker (glibc; elsewhere these do nothing).

Output is framed in pieces of up to 256 KiB.  glibc serves allocations that size with a
fresh ``mmap`` each and trims its heap after each free, so every batch paid page faults:
streaming ran at half speed.  A worker keeps such pieces on its heap instead
(``M_MMAP_THRESHOLD`` 1 MiB, ``M_TRIM_THRESHOLD`` 4 MiB), and gives what it freed back to
the kernel once it has been idle for a while (``trim``), so an idle worker stays small.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1024 * 1024
TRIM_THRESHOLD = 4 * 1024 * 1024

try:
    _libc = ctypes.CDLL(None)
    _mallopt = _libc.mallopt
    _malloc_trim = _libc.malloc_trim
except (OSError, AttributeError):  # not glibc
    _mallopt = _malloc_trim = None


def tune() -> None:
    """Keep output-sized allocations on the heap.  Call once, early."""
    if _mallopt is not None:
        _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def trim() -> None:
    """Return freed memory to the kernel (a few milliseconds at most; call when idle)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
