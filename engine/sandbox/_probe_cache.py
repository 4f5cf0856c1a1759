"""What an interpreter answered about itself, kept between commands while nothing it read changed.

Asking the workers' Python what it is (``engine.sandbox._interpreter``'s two probes) starts it
twice, about 70 ms of every command's start.  The answers are a function of files: the
interpreter, the ``pyvenv.cfg`` and ``._pth`` files its start reads, and the directories it
imports from (their entries, and the ``.pth`` and ``*customize`` files that ``site`` runs).
So each answer is kept with the identity of each of those (device, inode, mode, owner, size,
mtime and ctime, which no process can set back) and given again only while every one of them
is the same; any change, a package installed or removed among them, asks again.  Only an
interpreter's own answers are kept: a launcher script (pyenv's shim) picks its interpreter by
files and variables of its own, and is asked every time.

A kept answer only stands in for running the probe: every judgement ``trusted_python`` makes
of the paths it names is made again on each use.  The file is the user's (mode 0600 in a
directory of the state that is 0700), obeyed only as ``engine.trust`` obeys a file, read
bounded, and anything unexpected in it means asking again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterable
from typing import Any

from engine import trust

__all__ = ["remembered"]

#: Bytes of a kept answer read at most (a few kB in practice).
_LIMIT = 1 << 20
#: Files in an import directory that decide what an interpreter's start does, besides ``.pth``.
_STARTUP = frozenset({"site.py", "sitecustomize.py", "usercustomize.py", "sitecustomize", "usercustomize"})
_FORMAT = 1
#: An answer is kept only once everything it depends on has been unchanged this long: a file
#: changed again within the same tick of the kernel's clock keeps its times (git's "racy" entries).
SETTLE_NS = 2_000_000_000


def _identity(path: str) -> list:
    try:
        st = os.stat(path)
    except OSError:
        return [path]
    return [path, st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _fingerprint(python: str, paths: Iterable[str]) -> list:
    """The identities of what the answer about ``python`` was made from (see the module)."""
    named, real = os.path.abspath(python), os.path.realpath(python)
    files = [named, real]
    for exe in (named, real):
        files.append(os.path.splitext(exe)[0] + "._pth")
        here = os.path.dirname(exe)
        files += [os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")]
    found = [_identity(f) for f in dict.fromkeys(files)]
    for directory in dict.fromkeys(os.path.normpath(p) for p in paths if isinstance(p, str) and os.path.isabs(p)):
        found.append(_identity(directory))
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        found += [_identity(os.path.join(directory, n)) for n in names if n.endswith(".pth") or n in _STARTUP]
    return found


def _compiled(python: str) -> bool:
    """Whether ``python`` is the interpreter itself (an ELF file), not a launcher script such as
    pyenv's shim, whose choice of interpreter follows files and variables of its own that no
    fingerprint here covers: what a script answers is never kept."""
    try:
        fd = os.open(os.path.realpath(python), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.pread(fd, 4, 0) == b"\x7fELF"
    except OSError:
        return False
    finally:
        os.close(fd)


def _file(kind: str, python: str) -> str:
    key = hashlib.sha256(f"{_FORMAT}\0{kind}\0{os.path.abspath(python)}\0{os.geteuid()}".encode()).hexdigest()
    return str(trust.state_home() / "probes" / f"{key[:32]}.json")


def _read(path: str) -> dict | None:
    """The kept record at ``path``, or None when there is none or it is not one to obey."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size > _LIMIT:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(_LIMIT + 1)
    finally:
        os.close(fd)
    if trust.refusal(path):
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _write(path: str, record: dict) -> None:
    """Keep ``record`` (atomically; a failure only means asking again next time)."""
    with contextlib.suppress(OSError):
        trust.state_dir("probes")
        temporary = f"{path}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w", closefd=False) as f:
                json.dump(record, f)
        finally:
            os.close(fd)
        os.replace(temporary, path)


def remembered(kind: str, python: str, ask: Callable[[], Any], valid: Callable[[Any], bool],
               paths: Callable[[Any], Iterable[str]], *, settle_ns: int = SETTLE_NS, context: Any = None) -> Any:
    """The answer ``ask()`` gives about ``python`` (``kind`` names the question, and must change
    when the question does), taken from the last time it was asked while what the answer
    depends on — ``python``'s files and the directories ``paths(answer)`` names — is unchanged.
    ``valid``: whether a kept answer is one to give (a kept one that is not is asked again).
    ``context``: what else the answer depends on that no file's identity shows (the kernel's
    settings, as JSON values), given again only while equal.  ``settle_ns``: see ``SETTLE_NS``."""
    if not _compiled(python):
        return ask()
    file = _file(kind, python)
    record = _read(file)
    if (record is not None and record.get("kind") == kind and record.get("python") == os.path.abspath(python)
            and record.get("context") == context and valid(record.get("answer"))):
        with contextlib.suppress(TypeError, ValueError):
            if record.get("fingerprint") == _fingerprint(python, paths(record["answer"])):
                return record["answer"]
    answer = ask()
    fingerprint = _fingerprint(python, paths(answer))
    if max((entry[-1] for entry in fingerprint if len(entry) > 1), default=0) < time.time_ns() - settle_ns:
        _write(file, {"kind": kind, "python": os.path.abspath(python), "answer": answer, "fingerprint": fingerprint,
                      "context": context})
    return answer
