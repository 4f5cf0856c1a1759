"""Walking, measuring, copying and removing directory trees, however hostile their shape.

A worker writes what it likes where it may write (the workspace, its socket directory): a
tree thousands of levels deep, millions of entries, symlinks to anywhere.  Everything here
is built on one walk that

- is iterative: no recursion, so no ``RecursionError`` at any depth (``shutil.rmtree`` raises
  one at about a thousand levels on Python 3.11, ``ignore_errors`` or not);
- holds at most two directory descriptors at a time, so depth costs no file descriptors;
- works on descriptors (``openat``), never on paths below the root, so depth is not limited
  by ``PATH_MAX`` and no path is resolved through a symlink a worker planted;
- never follows a symlink (entries are ``lstat``-ed, directories opened ``O_NOFOLLOW`` and
  checked to be the inode that was listed) and stays on the root's filesystem;
- climbs back through ``..`` only after checking that it is the directory it came down
  from; if the tree was moved under it, it stops rather than wander elsewhere;
- is bounded: it lists at most ``max_entries`` entries.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.errors import TreeError

__all__ = ["MAX_ENTRIES", "Entry", "copy_tree", "disk_usage", "remove_tree", "walk"]

#: Entries one walk lists at most.  Removal of a bigger tree stops there (and says so).
MAX_ENTRIES = 5_000_000

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ENTRY, _LEAVE = 0, 1


@dataclass(frozen=True)
class Entry:
    """One entry below the root.  ``dir_fd`` is the open directory that holds ``name``; it is
    valid only until the walk moves on, and is what to act on (``os.unlink(e.name,
    dir_fd=e.dir_fd)``): ``parts`` may be too long a path for the kernel."""

    dir_fd: int
    name: str
    parts: tuple[str, ...]
    stat: os.stat_result

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.stat.st_mode)


class _Frame:
    """A directory on the walk's current path: its descriptor while it is the one being read
    (else -1), its identity, and the names in it still to visit."""

    __slots__ = ("fd", "ident", "names", "parts")

    def __init__(self, fd: int, st: os.stat_result, parts: tuple[str, ...], names: list[str]) -> None:
        self.fd = fd
        self.ident = (st.st_dev, st.st_ino)
        self.parts = parts
        self.names = names


def _names(fd: int) -> list[str]:
    """The names in the directory open at ``fd``, in reverse order (the walk pops from the end)."""
    with os.scandir(fd) as it:
        return sorted((e.name for e in it), reverse=True)


def _open_dir(root: str | os.PathLike) -> int:
    return os.open(root, _DIR_FLAGS)


def _events(fd: int, max_entries: int, one_filesystem: bool = True
            ) -> Iterator[tuple[int, _Frame, str, os.stat_result]]:
    """The walk below the directory open at ``fd`` (taken over and closed).

    Yields ``(_ENTRY, frame, name, lstat)`` for each entry, before anything below it, and
    ``(_LEAVE, parent_frame, name, stat)`` once a directory's contents have been walked; in
    both, ``frame.fd`` is the open directory holding ``name``.  Raises TreeError when the
    entries exceed ``max_entries`` or the tree moved under the walk."""
    root_st = os.fstat(fd)
    frames = [_Frame(fd, root_st, (), [])]
    try:
        frames[0].names = _names(fd)
        listed = len(frames[0].names)
        if listed > max_entries:
            raise TreeError(errno.EFBIG, f"more than {max_entries} entries")
        while frames:
            top = frames[-1]
            if top.names:
                name = top.names.pop()
                try:
                    st = os.stat(name, dir_fd=top.fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield _ENTRY, top, name, st
                if not stat.S_ISDIR(st.st_mode) or (one_filesystem and st.st_dev != root_st.st_dev):
                    continue
                try:  # what is there now: the caller may have acted on it, a worker replaced it
                    child = os.open(name, _DIR_FLAGS, dir_fd=top.fd)
                except OSError:
                    continue
                try:
                    child_st = os.fstat(child)
                    same = (child_st.st_dev, child_st.st_ino) == (st.st_dev, st.st_ino)
                    names = _names(child) if same else []
                except OSError:
                    same = False
                if not same:  # unreadable, or not the directory listed: left alone
                    os.close(child)
                    continue
                listed += len(names)
                if listed > max_entries:
                    os.close(child)
                    raise TreeError(errno.EFBIG, f"more than {max_entries} entries")
                os.close(top.fd)
                top.fd = -1
                frames.append(_Frame(child, child_st, (*top.parts, name), names))
                continue
            if len(frames) == 1:
                return  # the clean-up below closes the root
            try:
                up = os.open("..", _DIR_FLAGS, dir_fd=top.fd)
            finally:
                os.close(top.fd)
                top.fd = -1
                frames.pop()
            parent = frames[-1]
            parent.fd = up  # closed by the clean-up below if it is not the right one
            up_st = os.fstat(up)
            if (up_st.st_dev, up_st.st_ino) != parent.ident:
                raise TreeError(errno.ESTALE, f"{'/'.join(top.parts)!r} was moved during the walk")
            yield _LEAVE, parent, top.parts[-1], up_st
    finally:
        for frame in frames:
            if frame.fd >= 0:
                os.close(frame.fd)
                frame.fd = -1


def walk(root: str | os.PathLike, *, max_entries: int = MAX_ENTRIES, one_filesystem: bool = True
         ) -> Iterator[Entry]:
    """Every entry below ``root`` (not ``root`` itself), each directory before its contents,
    in name order.  Raises OSError when ``root`` is not a directory (a symlink to one is not),
    TreeError when the tree has more than ``max_entries`` entries or moved under the walk."""
    fd = _open_dir(root)
    events = _events(fd, max_entries, one_filesystem)
    with contextlib.closing(events):
        for kind, frame, name, st in events:
            if kind == _ENTRY:
                yield Entry(frame.fd, name, (*frame.parts, name), st)


def disk_usage(root: str | os.PathLike, *, max_entries: int = MAX_ENTRIES) -> int:
    """Bytes of disk the entries below ``root`` occupy (allocated blocks, as ``du``)."""
    return sum(e.stat.st_blocks * 512 for e in walk(root, max_entries=max_entries))


def remove_tree(path: str | os.PathLike, *, max_entries: int = MAX_ENTRIES) -> bool:
    """Remove ``path`` and everything below it, as ``rm -rf`` would, never following a
    symlink (a symlink is removed, not what it points to).  Never raises: True when nothing is
    left (or nothing was there), False when something could not be removed."""
    try:
        fd = _open_dir(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            return False
        try:  # a file or a symlink: the entry itself
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True
    complete = True
    try:
        root_dev = os.fstat(fd).st_dev
        events = _events(fd, max_entries)
        with contextlib.closing(events):
            for kind, frame, name, st in events:
                if kind == _ENTRY and stat.S_ISDIR(st.st_mode) and st.st_dev == root_dev:
                    continue  # emptied first, removed on the way back up
                try:
                    if kind == _LEAVE or stat.S_ISDIR(st.st_mode):
                        os.rmdir(name, dir_fd=frame.fd)
                    else:
                        os.unlink(name, dir_fd=frame.fd)
                except FileNotFoundError:
                    pass
                except OSError:
                    complete = False
    except OSError:
        complete = False
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return complete


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike, *, max_entries: int = MAX_ENTRIES) -> None:
    """Copy directory ``src`` to ``dst`` (which must not exist), as ``shutil.copytree(src, dst,
    symlinks=True)`` does: directories, regular files with their mode and times, symlinks as
    symlinks; other kinds of file (fifos, devices) are left out.  Raises OSError."""
    dst = Path(dst)
    src_st = os.stat(src, follow_symlinks=False)
    os.mkdir(dst)
    dirs: list[tuple[Path, os.stat_result]] = [(dst, src_st)]
    for entry in walk(src, max_entries=max_entries, one_filesystem=False):
        target = dst.joinpath(*entry.parts)
        mode = entry.stat.st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(target)
            dirs.append((target, entry.stat))
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(entry.name, dir_fd=entry.dir_fd), target)
        elif stat.S_ISREG(mode):
            source = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=entry.dir_fd)
            with open(source, "rb") as fin, open(target, "xb") as fout:
                shutil.copyfileobj(fin, fout)
            _copy_stat(target, entry.stat)
    for target, st in reversed(dirs):  # deepest first: setting a directory's times is the last touch
        _copy_stat(target, st)


def _copy_stat(target: Path, st: os.stat_result) -> None:
    os.chmod(target, stat.S_IMODE(st.st_mode))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
