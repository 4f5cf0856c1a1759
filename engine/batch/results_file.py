"""The results file: appended, fsynced, resumed (torn last line cut), and the runs directory's lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine import trust
from engine.errors import ConfigError
from worker.contract.bounded_json import loads as bounded_loads

__all__ = [
    "Lock", "ResultsFile", "Resumed", "STATUSES", "lock_runs_dir", "open_results", "read_all",
    "redo_selector"
]

STATUSES = ("answered", "failed", "timed_out", "cancelled")


@dataclass
class Resumed:
    """What an existing output held: finished ids (key -> status), whether a torn last line
    was cut off, and how many records were dropped to be run again."""

    done: dict[str, str] = field(default_factory=dict)
    torn_bytes: int = 0
    dropped: int = 0


class ResultsFile:
    """The output JSONL.  ``open`` repairs and reads it; ``append`` writes one whole line with
    one ``write`` and fsyncs it before returning, so a line on disk is a finished run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def open(self, redo: Callable[[dict], bool] = lambda record: False) -> Resumed:
        """Create or repair the file; drop (atomically) the records ``redo`` selects.  A file a
        worker could have written (``engine.trust``: its records would choose what is skipped)
        is refused, and so is a link a worker could have made on the way to a new one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trust.check(self.path, "the results file")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            trust.check(self.path, "the results file", same_as=os.fstat(fd))
            data = read_all(fd)
            report = Resumed()
            cut = data.rstrip(b"\0")  # a crash can leave zeros past the last write
            if cut and not cut.endswith(b"\n"):
                cut = cut[:cut.rfind(b"\n") + 1]
            if len(cut) != len(data):
                report.torn_bytes = len(data) - len(cut)
                os.ftruncate(fd, len(cut))
                os.fsync(fd)
            kept: list[bytes] = []
            for number, line in enumerate(cut.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = bounded_loads(line)
                    key = str(record["id"])
                except (ValueError, TypeError, KeyError):
                    raise ConfigError(f"{self.path}:{number}: not a result record; fix or remove that line "
                                      "and run again") from None
                if redo(record):
                    report.dropped += 1
                    report.done.pop(key, None)
                    continue
                report.done[key] = str(record.get("status"))
                kept.append(line)
            if report.dropped:
                os.close(fd)
                fd = -1
                _replace_atomically(self.path, b"".join(line + b"\n" for line in kept))
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        self._fd = fd
        _fsync_dir(self.path.parent)
        return report

    def append(self, record: dict) -> None:
        assert self._fd is not None, "open() first"
        data = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _replace_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.rewrite")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # (made anew, never through whatever was left there)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(temporary, flags, 0o644), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def redo_selector(statuses: Iterable[str]) -> Callable[[dict], bool]:
    """Which existing records to run again: always ``cancelled`` ones and those that failed for
    infrastructure reasons (neither is the model's result: the run was stopped, or never got
    its model or worker), plus the given statuses."""
    wanted = {"cancelled", *statuses}

    def select(record: dict) -> bool:
        status = record.get("status")
        return status in wanted or (status == "failed" and bool(record.get("infrastructure")))
    return select


def lock_runs_dir(runs_dir: Path) -> Lock:
    """Hold an exclusive lock on ``runs_dir`` for as long as the batch runs (one writer per batch)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    return Lock(runs_dir / ".lock", f"another agentloop batch is using {runs_dir}; wait for it or stop it")


class Lock:
    """An exclusive ``flock`` on a file of its own at ``path``, made when taken and removed
    when released, so that it leaves nothing behind; ConfigError saying ``busy`` when another
    process holds it.

    Removing a lock file is safe only with two rules: the holder removes it before it lets go
    (so nobody can take the old file's lock between the two), and a taker checks, once it holds
    the lock, that ``path`` is still the file it locked (else it locked a removed one, and
    takes the lock again on the file now there)."""

    def __init__(self, path: Path, busy: str) -> None:
        self.path = path
        for _ in range(100):  # each retry means another process took and released it meanwhile
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise ConfigError(f"cannot open the lock file {path} ({exc.strerror}); remove what is there") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(busy) from None
            held, there = os.fstat(fd), _stat(path)
            if there is not None and (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
                self._fd: int | None = fd
                return
            os.close(fd)
        raise ConfigError(busy)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def open_results(output: Path, redo: Iterable[str], what: str = "run", *,
                 lock: Lock | None = None) -> tuple[ResultsFile, Resumed]:
    """Open (create, repair, resume) the results file ``output``, dropping the records ``redo``
    selects (``redo_selector``); what was repaired or dropped is said on stderr in one line each.
    ``lock``: the lock held for it, released if the file cannot be opened."""
    results = ResultsFile(output)
    try:
        resumed = results.open(redo_selector(redo))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if resumed.torn_bytes:
        print(f"agentloop: {output}: cut off a torn last line ({resumed.torn_bytes} bytes); "
              f"that {what} will be done again", file=sys.stderr)
    if resumed.dropped:
        print(f"agentloop: {output}: {resumed.dropped} record(s) removed to be run again", file=sys.stderr)
    return results, resumed
