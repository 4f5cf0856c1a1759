"""The task file: JSONL lines checked, every problem reported with its line number; a line's
``files``, checked (``task_files``) and packed for another machine (``pack_files``)."""

from __future__ import annotations

import functools
import json
import os
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import trust
from engine.batch.results_file import read_all
from engine.durations import parse_duration
from engine.errors import ConfigError
from engine.inert import inert
from engine.models import ModelRegistry
from engine.net import Allowlist
from engine.trees import walk
from worker.contract.bounded_json import loads as bounded_loads

__all__ = ["TaskSpec", "pack_files", "read_lines", "read_tasks", "refuse_invalid", "task_files"]


@dataclass(frozen=True)
class TaskSpec:
    """One valid task line.  ``files`` are absolute paths; ``key`` is the id as a string, which
    is how ids are compared (so ``7`` and ``"7"`` are the same id)."""

    id: str | int
    task: str
    line: int
    model: str | None = None
    max_messages: int | None = None
    timeout: float | None = None
    files: tuple[str, ...] = ()
    #: The hosts the run's workers may reach (``--allow-net`` entries), in place of the batch's.
    allow_net: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return str(self.id)


def read_tasks(path: str | Path, models: ModelRegistry | None = None) -> tuple[list[TaskSpec], list[str]]:
    """The valid tasks of ``path`` in file order, and one ``"line N: ..."`` per invalid line.

    A line is invalid when it is not a JSON object, lacks an id or a task, repeats an id (the
    first one stays valid), names a model ``models`` does not know, or names a file that does
    not exist.  Blank lines are ignored.  Raises ConfigError only if the file cannot be read."""
    return read_lines(path, "task file", lambda data, number, base: _task(data, number, base, models))


def read_lines(path: str | Path, what: str, parse: Callable[[Any, int, Path], Any]) -> tuple[list, list[str]]:
    """Each line of the JSONL file ``path`` made a spec by ``parse(data, line number, the
    file's directory)``, which raises ConfigError for an invalid one: the valid specs in file
    order (the first of a repeated ``key`` stays), and one ``"line N: ..."`` per invalid line.
    Blank lines are ignored; ConfigError only when the file (``what``) cannot be read.

    A spec's ``files`` are read with the user's rights and shown to a run: a file a worker
    could have written (``engine.trust``) may name only files beneath its own directory, which
    that worker could write anyway — never a key or a secret elsewhere."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc}") from exc
    base = path.resolve().parent
    untrusted = functools.cache(trust.refusal)
    specs: list = []
    problems: list[str] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            spec = parse(bounded_loads(line), number, base)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        except ValueError as exc:  # JSON beyond the bounds (nested too deep, a number too long)
            problems.append(f"line {number}: not a task ({exc})")
            continue
        except ConfigError as exc:
            problems.append(f"line {number}: {exc}")
            continue
        if spec.key in first_line:
            problems.append(f"line {number}: duplicate id {spec.id!r} (first on line {first_line[spec.key]})")
            continue
        if any(not _beneath(f, base) for f in spec.files) and (why := untrusted(path)):
            problems.append(f"line {number}: files outside {base} are not read: the {what} is not trusted, "
                            f"as {why}")
            continue
        first_line[spec.key] = number
        specs.append(spec)
    return specs, problems


def _beneath(path: str, top: Path) -> bool:
    return path.startswith(str(top).rstrip("/") + "/")


def refuse_invalid(path: str | Path, problems: list[str], skip_invalid: bool) -> None:
    """ConfigError listing ``problems`` (nothing starts), or with ``skip_invalid`` the same list
    on stderr and the run goes on without those lines."""
    if not problems:
        return
    listing = "\n".join(f"  {p}" for p in problems)
    if not skip_invalid:
        raise ConfigError(f"{path}: {len(problems)} invalid line(s), nothing started "
                          f"(--skip-invalid to go on without them):\n{listing}")
    print(inert(f"agentloop: {path}: skipping {len(problems)} invalid line(s):\n{listing}"), file=sys.stderr)


def _task(data: Any, number: int, base: Path, models: ModelRegistry | None) -> TaskSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"not a JSON object but {type(data).__name__}")
    if "id" not in data:
        raise ConfigError("no id")
    ident = data["id"]
    if isinstance(ident, bool) or not (isinstance(ident, int) or (isinstance(ident, str) and ident.strip())):
        raise ConfigError(f"id must be a non-empty string or an integer, not {ident!r}")
    where = f"id {ident!r}"
    task = data.get("task")
    if not isinstance(task, str) or not task.strip():
        raise ConfigError(f"{where}: task must be a non-empty string")
    model = data.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}: model must be an alias (a string)")
        if models is not None:
            try:
                models.get(model)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
    max_messages = data.get("max_messages")
    if max_messages is not None and (isinstance(max_messages, bool) or not isinstance(max_messages, int)
                                     or max_messages < 1):
        raise ConfigError(f"{where}: max_messages must be a whole number >= 1, not {max_messages!r}")
    try:
        timeout = parse_duration(data.get("timeout"))
    except ConfigError as exc:
        raise ConfigError(f"{where}: timeout: {exc}") from None
    allow_net = data.get("allow_net", [])
    if not isinstance(allow_net, list):
        raise ConfigError(f"{where}: allow_net must be a list of \"HOST[:PORT]\" strings")
    Allowlist.parse(allow_net, f"{where}: allow_net")  # (refused in its words, before anything runs)
    return TaskSpec(id=ident, task=task, line=number, model=model, max_messages=max_messages,
                    timeout=timeout, files=task_files(data.get("files"), where, base), allow_net=tuple(allow_net))


def task_files(value: Any, where: str, base: Path) -> tuple[str, ...]:
    """A line's ``files`` (a path or a list of them, relative to ``base``) as absolute paths;
    ConfigError for one that does not exist or two that would land on one name."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: files must be a list of paths")
    paths: list[str] = []
    names: dict[str, str] = {}
    for entry in value:
        resolved = (base / entry).resolve()
        if not resolved.exists():
            raise ConfigError(f"{where}: file {entry!r} does not exist ({resolved})")
        if resolved.name in names:
            raise ConfigError(f"{where}: files {names[resolved.name]!r} and {entry!r} would both be "
                              f"{resolved.name!r} in the workspace")
        names[resolved.name] = entry
        paths.append(str(resolved))
    return tuple(paths)


def pack_files(paths: Iterable[str]) -> list[tuple[str, bytes, int]]:
    """The files (directories walked) as (relative path, bytes, mode): what a run on another
    machine needs to rebuild them in its workspace."""
    packed = []
    for path in map(Path, paths):
        if path.is_dir():
            found = []
            for entry in walk(path, one_filesystem=False):
                if not entry.is_dir and (content := _regular_file(entry.name, entry.dir_fd)) is not None:
                    found.append((entry.parts, *content))
            packed += [(str(Path(path.name, *parts)), data, mode) for parts, data, mode in sorted(found)]
        else:
            packed.append((path.name, path.read_bytes(), path.stat().st_mode & 0o777))
    return packed


def _regular_file(name: str, dir_fd: int) -> tuple[bytes, int] | None:
    """(content, permission bits) of ``name`` if it is a regular file or a symlink to one (as
    ``Path.is_file()`` has it), else None; a fifo or a device is never read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        mode = os.fstat(fd).st_mode
        return (read_all(fd), mode & 0o777) if stat.S_ISREG(mode) else None
    finally:
        os.close(fd)
