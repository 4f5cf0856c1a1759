"""The files a sample asks back (``fetch`` of ``contract.sample``): put by the sample's own
confined process on a file of the slot's as its code ends, read by the slot once every process
of the sample is dead and checked as the coordinator checks a result.

A file is read one path component at a time, no link followed, from the process that ran the
code, so that nothing is sent back that the code itself could not read; what is missing, not a
regular file, or past ``fetch_bytes`` in all is left out.  Code that ends by a kill (its
deadline's grace passed, its memory limit) sends nothing back, and the result says so.
"""

from __future__ import annotations

import os
import stat

from .contract import sample
from .contract.framing import FrameError, decode, encode
from .contract.schema import ContractError

__all__ = ["FETCHED_FD", "read_fetched", "send_fetched"]

#: The descriptor on which a sample's process puts the files asked for.
FETCHED_FD = 3


def send_fetched(req: sample.RunSample, workspace: str, fd_out: int) -> None:
    """Put the files ``req.fetch`` names, as the workspace holds them now, on ``fd_out``
    (``fetch_bytes`` at most in all; a file that is missing, not a regular file, reached through
    a link or past the bound is left out).  Read by the sample's own confined process: it reads
    nothing its code could not."""
    found, left = [], req.fetch_bytes
    for path in req.fetch:
        try:
            fd = open_beneath(workspace, path)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > left:
                continue
            data = os.read(fd, left + 1)
            while len(data) <= left and (more := os.read(fd, left + 1 - len(data))):
                data += more
        except OSError:
            continue
        finally:
            os.close(fd)
        if len(data) <= left:
            found.append((path, data))
            left -= len(data)
    try:
        view = memoryview(encode(sample.Result(req.id, fetched=tuple(found))))
        while view:
            view = view[os.write(fd_out, view):]
    except OSError:
        pass


def open_beneath(root: str, path: str) -> int:
    """A descriptor of ``root/path`` opened one component at a time without following a link
    (OSError otherwise, and for ``..`` or an absolute path)."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise OSError("not a path inside the workspace")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def read_fetched(fd: int, req: sample.RunSample) -> tuple[tuple[tuple[str, bytes], ...], str]:
    """The files the sample's process put in ``fd`` (its code may have written anything there:
    they are checked as the coordinator checks them), and a note when they cannot be read."""
    try:
        size = os.fstat(fd).st_size
        limit = req.fetch_bytes + 64 * 1024 + 2 * sample.MAX_ID * len(req.fetch)
        if size == 0:
            return (), "the files to fetch were not read: the sample did not end by itself"
        if size > limit:
            return (), "the files to fetch were not read: more than asked for"
        said = sample.TO_COORDINATOR.parse(decode(os.pread(fd, size, 0), limit))
        if not isinstance(said, sample.Result):
            raise ContractError("not a result")
        return said.within(req.keep, req.fetch, req.fetch_bytes).fetched, ""
    except (OSError, ContractError, FrameError):
        return (), "the files to fetch were not read: the sample wrote over them"
    finally:
        os.close(fd)
