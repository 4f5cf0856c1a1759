"""The three read-only repository tools (``list_dir``, ``read_file``, ``search``) on descriptors.

This code runs in the tool process (``worker.tool_server``), never in the coordinator, so a
pattern that backtracks for hours or a tree built to exhaust it costs a process that can be
killed.  What it guarantees whatever a worker writes under the root:

- No path leaves the root and none enters an excluded path.  Every path is walked one
  component at a time from the root's descriptor with ``O_NOFOLLOW``; links are read and
  followed by this code, never by the kernel, and refused when they lead outside or into an
  excluded path.  A directory swapped for a link mid-call therefore makes a call fail, not
  stat or read what the link points at.  Excluded paths are matched by their components and,
  as a second check, by device and inode (a bind mount or a hard link of them is hidden too).
- Bounded work: walks are iterative (no recursion, whatever the depth), descend at most
  ``MAX_DEPTH`` levels, read at most ``MAX_DIR_ENTRIES`` names of one directory and
  ``MAX_WALK_ENTRIES`` in all; reads go in ``CHUNK``-sized pieces, ``read_file`` keeps only
  the lines it shows and at most ``MAX_LINE_BYTES`` of each, ``search`` skips files over
  ``MAX_SEARCH_FILE``.  Time is bounded by the caller's deadline.

Standard library only, and nothing from ``engine``.
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass

from .contract.tools import (  # noqa: F401 - the channel's bounds, and the note of a cut result
    MAX_MATCHES,
    MAX_READ_LIMIT,
    MAX_RESULT,
    MAX_SEARCH_FILE,
    MAX_TEXT,
    SKIP_DIRS,
    truncate,
)
from .file_lines import read_at_most, scan_lines

__all__ = [
    "MATCH_LINE_CHARS", "MAX_DEPTH", "MAX_DIR_ENTRIES", "MAX_LINE_BYTES", "MAX_LINK_HOPS",
    "MAX_WALK_ENTRIES", "Refusal", "Tree"
]

MATCH_LINE_CHARS = 200  # chars of a matching line shown by search
MAX_LINE_BYTES = 4_000  # bytes of one line read_file shows; the rest is counted, not kept
MAX_DEPTH = 128  # directory levels search descends (each holds a descriptor)
MAX_DIR_ENTRIES = 20_000  # names read from one directory
MAX_WALK_ENTRIES = 1_000_000  # names one search reads in all
MAX_LINK_HOPS = 40  # as the kernel's own limit

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # FIFOs must not block


class Refusal(Exception):
    """A request the tools refuse; the message is the text the model reads."""


class _Escape(Exception):
    """The path (or a link on it) leads outside the root."""


class _Hidden(Exception):
    """The path reaches an excluded path; reported exactly as a missing one."""


class _Changed(Exception):
    """A directory on the path stopped being one while it was walked (a swap for a link)."""


@dataclass
class _Place:
    """Where a path led: ``comps`` below the root; ``fd`` is the directory itself for a
    directory, else the directory holding ``name`` (None when missing).  Owns ``fd``."""

    comps: tuple[str, ...]
    kind: str  # "dir" | "file" | "other" | "missing"
    fd: int | None = None
    name: str = ""
    st: os.stat_result | None = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _descend(fd: int, name: str) -> int:
    """The directory ``name`` in ``fd``, opened without following a link; ``fd`` is closed.
    Raises _Changed when ``name`` is (no longer) a directory there.  On any other error ``fd``
    stays open, for the caller to close."""
    try:
        nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            raise _Changed from None
        raise
    os.close(fd)
    return nfd


def _id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class Tree:
    """The files under one root, seen through its descriptor ``root_fd`` (kept open).

    ``root`` is the root's path (resolved), used only to read absolute paths and absolute link
    targets; ``exclude`` lists excluded paths as components below the root.
    """

    def __init__(self, root_fd: int, root: str, exclude: Iterable[Sequence[str]] = ()) -> None:
        self.root_fd = root_fd
        self.root = root
        self.exclude = frozenset(tuple(e) for e in exclude if e)
        self._hidden_ids: frozenset[tuple[int, int]] = frozenset()

    # -- exclusion ------------------------------------------------------------------------

    def refresh(self) -> None:
        """Record the device and inode of every excluded path that exists now (they may be
        created after the tools start); called before each request."""
        ids: set[tuple[int, int]] = set()
        for comps in self.exclude:
            try:
                fd = self._open_dir(comps[:-1])
            except (OSError, _Changed, _Hidden):
                continue
            try:
                st = os.stat(comps[-1], dir_fd=fd, follow_symlinks=False)
                ids.add(_id(st))
                if stat.S_ISDIR(st.st_mode):  # a mount point: the mounted root's identity too
                    sub = os.open(comps[-1], _DIR_FLAGS, dir_fd=fd)
                    ids.add(_id(os.fstat(sub)))
                    os.close(sub)
            except OSError:
                pass
            finally:
                os.close(fd)
        self._hidden_ids = frozenset(ids)

    def _excluded(self, comps: tuple[str, ...]) -> bool:
        return any(comps[:len(e)] == e for e in self.exclude)

    def _hidden(self, st: os.stat_result) -> bool:
        return _id(st) in self._hidden_ids

    # -- walking paths --------------------------------------------------------------------

    def _open_dir(self, comps: Sequence[str]) -> int:
        """A descriptor of the directory at ``comps``, opened from the root without following
        links.  Raises _Changed when a component is no longer a directory."""
        return self._walk_dirs(comps)[0]

    def _walk_dirs(self, comps: Sequence[str]) -> tuple[int, list[tuple[int, int] | None]]:
        """``_open_dir``, and the identity of each directory passed, the root's first."""
        fd = os.dup(self.root_fd)
        ids: list[tuple[int, int] | None] = [_id(os.fstat(fd))]
        try:
            for i, name in enumerate(comps):
                fd = _descend(fd, name)
                st = os.fstat(fd)
                if self._hidden(st) or self._excluded(tuple(comps[:i + 1])):
                    raise _Hidden
                ids.append(_id(st))
        except BaseException:
            os.close(fd)
            raise
        return fd, ids

    def _up(self, fd: int, want: tuple[int, int] | None, comps: list[str]) -> tuple[int, list | None]:
        """The parent of directory ``fd`` (whose path is now ``comps``): its ``..`` when that
        is the directory walked through (same identity), else _Changed.  Closes ``fd``.  With
        no identity known, the parent is walked to from the root (then its identities come
        back too)."""
        if want is None:
            os.close(fd)
            return self._walk_dirs(comps)
        try:
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise _Changed from None
            raise
        os.close(fd)
        if _id(os.fstat(parent)) != want:  # moved since it was walked through
            os.close(parent)
            raise _Changed
        return parent, None

    def _relative(self, path: str) -> str:
        """An absolute path as a path relative to the root; _Escape when it is not below it."""
        if self.root == "/":
            return path
        if path == self.root or path.startswith(self.root + "/"):
            return path[len(self.root):]
        raise _Escape

    def resolve(self, path: str, base: tuple[str, ...] = (), base_fd: int | None = None) -> _Place:
        """Where ``path`` (relative to ``base``, or absolute) leads, as ``os.path.realpath``
        would say but walked by descriptors: links followed here, within the root only.

        Raises _Escape, _Hidden or _Changed.  Like realpath, what follows a missing component
        is taken literally (``nowhere/../a.txt`` is ``a.txt``).  ``..`` costs one open: the
        parent is checked to be the very directory walked through, by identity.
        """
        if path.startswith("/"):
            path, base, base_fd = self._relative(path), (), None
        todo = deque(path.split("/"))
        comps = list(base)
        # ids[i]: identity of the directory at comps[:i] (None: not known); existing levels only.
        ids: list[tuple[int, int] | None]
        if base_fd is not None:
            fd = os.dup(base_fd)
            ids = [_id(os.fstat(self.root_fd))] + [None] * len(comps)
            if comps:
                ids[-1] = _id(os.fstat(fd))
        else:
            fd, ids = self._walk_dirs(comps)
        missing = 0  # trailing components of comps that do not exist
        hops = 0
        try:
            while todo:
                name = todo.popleft()
                if name in ("", "."):
                    continue
                if name == "..":
                    if not comps:
                        raise _Escape
                    comps.pop()
                    if missing:
                        missing -= 1
                        continue
                    ids.pop()
                    old, fd = fd, -1
                    fd, walked = self._up(old, ids[-1], comps)
                    if walked is not None:
                        ids = walked
                    continue
                if missing:
                    comps.append(name)
                    missing += 1
                    continue
                if self._excluded((*comps, name)):
                    raise _Hidden
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError):
                    comps.append(name)
                    missing = 1
                    continue
                if self._hidden(st):
                    raise _Hidden
                if stat.S_ISLNK(st.st_mode):
                    hops += 1
                    if hops > MAX_LINK_HOPS:  # a loop: realpath gives up on it, as missing
                        comps.append(name)
                        missing = 1
                        continue
                    try:
                        target = os.readlink(name, dir_fd=fd)
                    except OSError as exc:  # EINVAL: no longer a link; ENOENT: gone
                        if exc.errno in (errno.EINVAL, errno.ENOENT):
                            raise _Changed from None
                        raise
                    if target.startswith("/"):
                        target = self._relative(target)
                        comps = []
                        ids = ids[:1]
                        os.close(fd)
                        fd = -1
                        fd = os.dup(self.root_fd)
                    todo.extendleft(reversed(target.split("/")))
                    continue
                if stat.S_ISDIR(st.st_mode):
                    fd = _descend(fd, name)
                    dst = os.fstat(fd)
                    if self._hidden(dst):
                        raise _Hidden
                    comps.append(name)
                    ids.append(_id(dst))
                    continue
                if any(p not in ("", ".") for p in todo):  # "file/x": not a directory, so missing
                    comps.append(name)
                    missing = 1
                    continue
                kind = "file" if stat.S_ISREG(st.st_mode) else "other"
                return _Place((*comps, name), kind, fd, name, st)
            if missing:
                os.close(fd)
                return _Place(tuple(comps), "missing")
            return _Place(tuple(comps), "dir", fd, "", os.fstat(fd))
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

    def _place(self, path: str, shown: str) -> _Place:
        """``resolve`` with its failures in words; a hidden path reads as a missing one.  A
        path that changed while walked is tried again before the call gives up."""
        for _ in range(3):
            try:
                return self.resolve(path)
            except _Escape:
                raise Refusal(f"path escapes the project root: {shown}") from None
            except _Hidden:
                return _Place((), "missing")
            except _Changed:
                continue
        raise Refusal(f"{shown} changed while being read (a link appeared in its path)")

    def _open_file(self, place: _Place, shown: str) -> int | None:
        """The regular file at ``place`` opened for reading (blocking), or None when it is
        gone or hidden.  Opened without following links and checked once open."""
        assert place.fd is not None
        try:
            fd = os.open(place.name, _FILE_FLAGS, dir_fd=place.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refusal(f"{shown} changed while being read (a link appeared in its path)") from None
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            raise
        st = os.fstat(fd)
        if self._hidden(st):
            os.close(fd)
            return None
        if not stat.S_ISREG(st.st_mode):  # swapped for a FIFO or device meanwhile
            os.close(fd)
            raise Refusal(f"not a regular file: {shown}")
        os.set_blocking(fd, True)
        return fd

    # -- list_dir -------------------------------------------------------------------------

    def list_dir(self, path: str) -> str:
        """Entries sorted, a trailing / for directories and a size for the rest; a link is
        shown as what it points at when that is inside the root, else as unreadable."""
        place = self._place(path, path)
        try:
            if place.kind != "dir":
                raise Refusal(f"not a directory: {path}")
            assert place.fd is not None
            names, more = _names(place.fd, MAX_DIR_ENTRIES)
            rows = []
            for name in sorted(names):
                row = self._entry(place, name)
                if row is not None:
                    rows.append(row)
        finally:
            place.close()
        if more:
            rows.append(f"[agent] listing stopped at {MAX_DIR_ENTRIES} entries")
        return "\n".join(rows) or "(empty directory)"

    def _entry(self, place: _Place, name: str) -> str | None:
        """One row of a listing; None for an excluded entry (never shown)."""
        if self._excluded((*place.comps, name)):
            return None
        try:
            st = os.stat(name, dir_fd=place.fd, follow_symlinks=False)
        except OSError:
            return f"{name} (unreadable)"
        if self._hidden(st):
            return None
        if stat.S_ISLNK(st.st_mode):
            try:
                target = self.resolve(name, place.comps, place.fd)
            except (_Escape, _Hidden, _Changed, OSError):
                return f"{name} (unreadable)"  # says nothing of what lies outside the root
            target.close()
            if target.st is None:  # dangling
                return f"{name} (unreadable)"
            st = target.st
        return f"{name}/" if stat.S_ISDIR(st.st_mode) else f"{name} ({st.st_size} bytes)"

    # -- read_file ------------------------------------------------------------------------

    def read_file(self, path: str, offset: int, limit: int) -> str:
        """Lines ``offset`` .. ``offset + limit - 1`` numbered, with a note saying how to page
        on; only those lines are kept, each at most MAX_LINE_BYTES."""
        offset = max(1, offset)
        limit = max(1, min(limit, MAX_READ_LIMIT))
        place = self._place(path, path)
        try:
            if place.kind == "dir":
                raise Refusal(f"{path} is a directory — use list_dir")
            if place.kind == "missing":
                raise Refusal(f"no such file: {path}")
            if place.kind != "file":  # a FIFO or device would block or never end
                raise Refusal(f"not a regular file: {path}")
            fd = self._open_file(place, path)
        finally:
            place.close()
        if fd is None:
            raise Refusal(f"no such file: {path}")
        try:
            window, total, exact = scan_lines(fd, offset, limit, MAX_LINE_BYTES)
        finally:
            os.close(fd)
        if total == 0:
            return "(empty file)"
        if not window:
            raise Refusal(f"{path} has only {total} lines; offset {offset} is past the end")
        out = "".join(f"{i}\t{line}" for i, line in enumerate(window, offset))
        last = offset + len(window) - 1
        if last < total:
            of = str(total) if exact else f"at least {total}"
            out += (f"\n[agent] showing lines {offset}-{last} of {of} — "
                    f"call again with offset={last + 1} for more")
        return out

    # -- search ---------------------------------------------------------------------------

    def search(self, pattern: str, path: str) -> str:
        """``path:line: text`` for each line matching ``pattern`` in the text files under
        ``path`` (or in the one file it names), in sorted walk order, at most MAX_MATCHES."""
        try:
            rx = re.compile(pattern)
        except (re.error, RecursionError, OverflowError, ValueError) as exc:
            raise Refusal(f"bad regex {pattern!r}: {exc}") from None
        place = self._place(path, path)
        notes: list[str] = []
        try:
            if place.kind == "file":  # one file named: search just it, rather than report nothing
                files = _one(place)
            elif place.kind == "dir":
                assert place.fd is not None
                files = self._walk(place.fd, place.comps, notes)
            else:
                raise Refusal(f"not a directory: {path}")
            try:
                hits = self._hits(files, rx)
            finally:
                files.close()  # the walk's descriptors, at once
        finally:
            place.close()
        return "\n".join((hits or [f"no matches for {pattern!r} under {path}"]) + notes)

    def _hits(self, files: Iterator[tuple[int, str, tuple[str, ...]]], rx: re.Pattern[str]) -> list[str]:
        hits: list[str] = []
        for dir_fd, name, comps in files:
            for lineno, line in self._matching_lines(dir_fd, name, rx):
                hits.append(f"{'/'.join(comps)}:{lineno}: {line.rstrip()[:MATCH_LINE_CHARS]}")
                if len(hits) >= MAX_MATCHES:
                    hits.append(f"[agent] {MAX_MATCHES}-match cap hit — tighten the pattern or narrow the path")
                    return hits
        return hits

    def _walk(self, start_fd: int, start: tuple[str, ...],
              notes: list[str]) -> Generator[tuple[int, str, tuple[str, ...]], None, None]:
        """(directory fd, name, components) of the regular files under ``start``: each
        directory's files sorted, then its subdirectories in sorted order.  SKIP_DIRS, links
        and excluded paths are never entered.  Iterative: one descriptor per level held, at
        most MAX_DEPTH levels; notes say what the bounds left out."""
        budget = [MAX_WALK_ENTRIES]
        too_deep = too_wide = False
        stack: list[tuple[int, tuple[str, ...], Iterator[str]]] = []
        try:
            files, subdirs, wide = self._split(start_fd, start, budget)
            too_wide |= wide
            stack.append((-1, start, iter(subdirs)))  # -1: start_fd belongs to the caller
            for name in files:
                yield start_fd, name, (*start, name)
            while stack and budget[0] > 0:
                fd, comps, pending = stack[-1]
                name = next(pending, None)
                if name is None:
                    stack.pop()
                    if fd >= 0:
                        os.close(fd)
                    continue
                if len(stack) > MAX_DEPTH:
                    too_deep = True
                    continue
                parent = fd if fd >= 0 else start_fd
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=parent)
                except OSError:  # swapped for a link (ELOOP), or gone: not entered
                    continue
                if self._hidden(os.fstat(sub)):
                    os.close(sub)
                    continue
                sub_comps = (*comps, name)
                stack.append((sub, sub_comps, iter(())))  # owned by the stack before anything can raise
                files, subdirs, wide = self._split(sub, sub_comps, budget)
                too_wide |= wide
                stack[-1] = (sub, sub_comps, iter(subdirs))
                for fname in files:
                    yield sub, fname, (*sub_comps, fname)
        finally:
            for fd, _, _ in stack:
                if fd >= 0:
                    os.close(fd)
            if budget[0] <= 0:
                notes.append(f"[agent] search stopped after {MAX_WALK_ENTRIES} entries — narrow the path")
            if too_deep:
                notes.append(f"[agent] directories more than {MAX_DEPTH} levels down were not searched")
            if too_wide:
                notes.append(f"[agent] only the first {MAX_DIR_ENTRIES} entries of a directory were searched")

    def _split(self, fd: int, comps: tuple[str, ...], budget: list[int]) -> tuple[list[str], list[str], bool]:
        """(regular files, subdirectories to enter, whether the listing was cut) of one
        directory, each sorted; links, excluded and hidden entries left out."""
        try:
            names, more = _names(fd, min(MAX_DIR_ENTRIES, max(0, budget[0])))
        except OSError:  # unreadable, or removed while walked: nothing to search in it
            return [], [], False
        budget[0] -= len(names) + more
        files, subdirs = [], []
        for name in sorted(names):
            if self._excluded((*comps, name)):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if self._hidden(st):
                continue
            if stat.S_ISDIR(st.st_mode):
                if name not in SKIP_DIRS:
                    subdirs.append(name)
            elif stat.S_ISREG(st.st_mode):
                files.append(name)
        return files, subdirs, more and len(names) >= MAX_DIR_ENTRIES

    def _matching_lines(self, dir_fd: int, name: str, rx: re.Pattern[str]) -> Iterator[tuple[int, str]]:
        """(line number, line) of each match in one file; links, non-regular, big, binary and
        hidden files yield nothing.  Opened without following links, checked once open."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError:  # a link (ELOOP), unreadable, or gone since the walk: skip it like the rest
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SEARCH_FILE or self._hidden(st):
                return
            os.set_blocking(fd, True)
            data = read_at_most(fd, MAX_SEARCH_FILE + 1)
        except OSError:
            return
        finally:
            os.close(fd)
        if len(data) > MAX_SEARCH_FILE or b"\0" in data[:1024]:  # grew meanwhile, or binary
            return
        text = io.StringIO(data.decode("utf-8", "replace"), newline=None)  # universal newlines
        del data
        for lineno, line in enumerate(text, 1):
            if rx.search(line):
                yield lineno, line


def _one(place: _Place) -> Generator[tuple[int, str, tuple[str, ...]], None, None]:
    assert place.fd is not None
    yield place.fd, place.name, place.comps


def _names(fd: int, cap: int) -> tuple[list[str], bool]:
    """Up to ``cap`` names of the directory ``fd`` (in directory order) and whether there
    were more."""
    names: list[str] = []
    with os.scandir(fd) as it:  # scandir works on a duplicate: fd stays ours
        for entry in it:
            if len(names) >= cap:
                return names, True
            names.append(entry.name)
    return names, False
