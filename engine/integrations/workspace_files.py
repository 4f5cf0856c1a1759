"""A session's workspace as MCP resources: listed and read through descriptors that never
follow a link, bounded in count, depth and size."""

from __future__ import annotations

import logging
import mimetypes
import os
import stat
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "MAX_LISTED_DEPTH", "MAX_LISTED_FILES", "MAX_RESOURCE_BYTES", "SCHEME", "list_files", "mime_type",
    "parse_uri", "read_file", "resource_uri"
]

log = logging.getLogger("agentloop")

#: The largest file a resource read returns.
MAX_RESOURCE_BYTES = 8 * 1024 * 1024
#: Files a resource listing shows at most, and how deep it looks.
MAX_LISTED_FILES = 1000
MAX_LISTED_DEPTH = 16
SCHEME = "agentloop"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def list_files(root: Path, limit: int = MAX_LISTED_FILES) -> list[tuple[str, int]]:
    """The regular files under ``root`` as (relative path, size), sorted, at most ``limit``,
    at most ``MAX_LISTED_DEPTH`` directories deep; links are never followed."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except OSError:
        return []
    found: list[tuple[str, int]] = []
    stack: list[tuple[int, str, int]] = [(top, "", 0)]
    try:
        while stack and len(found) < limit:
            fd, prefix, depth = stack.pop()
            try:
                with os.scandir(fd) as entries:
                    for entry in sorted(entries, key=lambda e: e.name):
                        if entry.name.startswith(".tmp") and not prefix:
                            continue  # the private /tmp of a worker without bubblewrap
                        try:
                            if entry.is_file(follow_symlinks=False):
                                found.append((prefix + entry.name, entry.stat(follow_symlinks=False).st_size))
                            elif entry.is_dir(follow_symlinks=False) and depth < MAX_LISTED_DEPTH:
                                sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                                stack.append((sub, prefix + entry.name + "/", depth + 1))
                        except OSError:
                            continue
                        if len(found) >= limit:
                            break
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return sorted(found)


def read_file(root: Path, relative: str, limit: int = MAX_RESOURCE_BYTES) -> bytes:
    """The bytes of regular file ``relative`` under ``root``, opened one component at a time
    without following links; OSError (with words) for anything else, or a file over ``limit``."""
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") for p in parts):
        raise OSError(f"not a file path inside the workspace: {relative!r}")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        info = os.fstat(file_fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{relative} is not a regular file")
        if info.st_size > limit:
            raise OSError(f"{relative} holds {info.st_size} bytes, more than the {limit} a resource read "
                          "returns; read a part of it with run_python")
        chunks, size = [], 0
        while chunk := os.read(file_fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OSError(f"{relative} grew past the {limit} bytes a resource read returns")
        return b"".join(chunks)
    finally:
        os.close(file_fd)


def resource_uri(session: str, relative: str) -> str:
    return f"{SCHEME}://{session}/{quote(relative)}"


def parse_uri(uri: str) -> tuple[str, str]:
    """(session, relative path) of an ``agentloop://SESSION/PATH`` URI; ValueError otherwise."""
    parts = urlsplit(str(uri))
    if parts.scheme != SCHEME or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"not an {SCHEME}://SESSION/PATH URI: {uri!r}")
    return parts.netloc, unquote(parts.path.lstrip("/"))


def mime_type(path: str) -> str:
    return mimetypes.guess_type(path)[0] or "application/octet-stream"
