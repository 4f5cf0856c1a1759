"""``agentloop batch``: thousands of agent runs over a task file, every result kept.

Input is JSONL, one task a line: ``{"id": ..., "task": ...}`` plus, optionally, ``model`` (an
alias), ``max_messages``, ``timeout`` (wall-clock cap of one attempt: seconds or ``5m``) and
``files`` (paths, relative to the task file's directory, copied into the run's workspace).
Every line is checked before anything starts; problems are reported with their line numbers.

Output is JSONL, one record a line per finished run (see ``make_record``), appended, flushed and
fsynced as the run ends.  So a crash loses no finished run, and rerunning the same command skips
every id already in the output.  A torn last line (a crash mid-write) is cut off and its run
done again.  Runs recorded as ``cancelled`` never finished and are run again too; ``--redo``
adds other statuses.

Each run gets its own directory ``<output stem>.runs/<id>/``: ``workspace/`` (its working
directory, where ``files`` are copied), ``transcript.jsonl`` (every display event, all
attempts), ``state/`` (block outputs too large to keep in memory).  Runs share nothing else.

Failures of the infrastructure (model endpoint unreachable or answering 5xx after the client's
own retries, a worker that does not start, an internal error) are retried ``--retries`` times
with exponential backoff.  What the model does (no answer within its messages, a timeout) is
its result, never retried.

``--parallel`` default: ``min(2 × usable CPUs, available memory / 1 GiB)``, between 1 and 64.
A run is a coordinator task in this process, mostly waiting on the model, plus its worker
processes; an idle worker takes ~25 MB but may grow to its 2 GiB limit, and a GiB per run
leaves room for half of them to peak at once.  Each run holds at most
``--max-workers-per-run`` workers (its agent and sub-agents), so a batch never holds more than
``parallel × max_workers_per_run``.

Ctrl-C (or SIGTERM) stops starting runs, cancels the running ones (their workers killed, their
records written as ``cancelled``) and exits 130; a second Ctrl-C exits at once — finished
records are already on disk.  ``--ray ADDRESS`` runs each run as a Ray task instead
(``engine.batch.on_ray``, imported only then).

Exit status: 0 the batch ran to its end (whatever the runs' statuses), 1 it stopped early
because the infrastructure kept failing, 125 bad input or options, 130 interrupted.

Progress lines, the bar and the summary print ids, errors and messages inert
(``engine.inert``: no escape sequence or control character of a task file, a model or an
endpoint reaches the terminal) and never as rich markup; RESULTS.jsonl keeps them exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import signal
import stat
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from .._tree import copy_tree, remove_tree, walk
from ..agent import RunResult, run_task
from ..cli import EXIT_INTERRUPTED, EXIT_OWN, Duration, _fail, _policy, apply_max_tokens, max_tokens_option
from ..display import AgentDisplay, FanoutDisplay, JsonlRecorder
from ..durations import parse_duration
from ..engine import Engine
from ..errors import AgentloopError, ConfigError, WorkerError
from ..inert import inert
from ..models import ModelRegistry, load_models
from ..repo_tools import RepoTools
from ..sandbox import GiB, SandboxPolicy
from ..worker import Worker, WorkerState

STATUSES = ("answered", "failed", "timed_out", "cancelled")
EXIT_STOPPED = 1
#: Upper bound of the default --parallel; more needs saying so.
MAX_DEFAULT_PARALLEL = 64
#: Memory budgeted per run when choosing the default --parallel.
MEMORY_PER_RUN = 1 * GiB
#: Longest wait between two attempts of a run.
BACKOFF_MAX = 60.0


# ---------------------------------------------------------------------------------------------
# The task file
# ---------------------------------------------------------------------------------------------

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

    @property
    def key(self) -> str:
        return str(self.id)


def read_tasks(path: str | Path, models: ModelRegistry | None = None) -> tuple[list[TaskSpec], list[str]]:
    """The valid tasks of ``path`` in file order, and one ``"line N: ..."`` per invalid line.

    A line is invalid when it is not a JSON object, lacks an id or a task, repeats an id (the
    first one stays valid), names a model ``models`` does not know, or names a file that does
    not exist.  Blank lines are ignored.  Raises ConfigError only if the file cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the task file {path}: {exc}") from exc
    base = path.resolve().parent
    specs: list[TaskSpec] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            spec = _task(json.loads(line), number, base, models)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        except ConfigError as exc:
            problems.append(f"line {number}: {exc}")
            continue
        if spec.key in first_line:
            problems.append(f"line {number}: duplicate id {spec.id!r} (first on line {first_line[spec.key]})")
            continue
        first_line[spec.key] = number
        specs.append(spec)
    return specs, problems


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
    return TaskSpec(id=ident, task=task, line=number, model=model, max_messages=max_messages,
                    timeout=timeout, files=_task_files(data.get("files"), where, base))


def _task_files(value: Any, where: str, base: Path) -> tuple[str, ...]:
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


# ---------------------------------------------------------------------------------------------
# The results file
# ---------------------------------------------------------------------------------------------

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
        """Create or repair the file; drop (atomically) the records ``redo`` selects."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            data = _read_all(fd)
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
                    record = json.loads(line)
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


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _replace_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.rewrite")
    with open(temporary, "wb") as f:
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
    """Which existing records to run again: always ``cancelled`` ones (they never finished),
    plus the given statuses; ``infrastructure`` means failed for infrastructure reasons."""
    wanted = {"cancelled", *statuses}

    def select(record: dict) -> bool:
        status = record.get("status")
        return status in wanted or ("infrastructure" in wanted and status == "failed"
                                    and bool(record.get("infrastructure")))
    return select


def lock_runs_dir(runs_dir: Path) -> int:
    """Hold an exclusive lock on ``runs_dir`` for this process's life (one writer per batch)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(runs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"another agentloop batch is using {runs_dir}; wait for it or stop it") from None
    return fd


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSettings:
    """What every run of a batch shares (picklable: Ray ships it to the nodes)."""

    models: ModelRegistry
    runs_dir: Path
    model: str | None = None
    protocol: str | None = None
    max_messages: int = 200
    timeout: float | None = 3600.0
    tools: str = "none"
    root: str = "."
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)
    retries: int = 0
    retry_backoff: float = 2.0
    max_workers: int = 16
    #: What the repository tools never show a run: the batch's runs directory and results file.
    exclude: tuple[Path, ...] = ()

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): doubling, capped."""
        return min(self.retry_backoff * 2 ** (attempt - 1), BACKOFF_MAX)

    def deadline(self, spec: TaskSpec) -> float | None:
        """Seconds after which a run, all attempts included, is surely hung (None: no cap)."""
        timeout = spec.timeout or self.timeout
        if timeout is None:
            return None
        waits = sum(self.backoff(a) for a in range(1, self.retries + 1))
        return (timeout + 60.0) * (self.retries + 1) + waits


class RunEngine(Engine):
    """The Engine of one batch run.

    It refuses a worker beyond ``max_workers`` live ones: the per-run cap that bounds the
    workers of a whole batch (the refusal reaches the model as words; it only happens when
    starting a sub-agent).  And it hands the files placed in the workspace (``placed``) to the
    run once a worker has started (see ``_give_to_run``), so the model can change them, not only
    read them."""

    def __init__(self, *, max_workers: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_workers = max_workers
        self.placed: list[Path] = []

    async def start_worker(self, name: str = "worker") -> Worker:
        live = sum(1 for w in self.workers if w.state is not WorkerState.CLOSED)
        if live >= self.max_workers:
            raise WorkerError(f"this run already holds {live} workers, its limit; wait for a sub-agent "
                              "to finish, or do the work yourself, before starting another")
        worker = await super().start_worker(name)
        placed, self.placed = self.placed, []
        if placed:
            await asyncio.to_thread(_give_to_run, self.workspace, placed)
        return worker


def _give_to_run(workspace: Path, paths: list[Path]) -> None:
    """Give ``paths`` to the run's workers.  A root coordinator runs them as the run's uid and
    keeps the workspace its own (in the run's group, sticky: see ``engine.sandbox``), so files
    it placed there would be read-only to them; the task's files are the run's copies, not the
    user's originals, so they become the run's uid's and group-writable."""
    ws = workspace.stat()
    if os.geteuid() != 0 or not ws.st_mode & stat.S_ISVTX or ws.st_gid == 0:
        return
    run = ws.st_gid  # the run's uid and gid are one number

    def give(name: str | Path, mode: int, dir_fd: int | None = None) -> None:
        os.chown(name, run, run, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISLNK(mode):
            extra = stat.S_ISGID | stat.S_IRWXG if stat.S_ISDIR(mode) else stat.S_IRGRP | stat.S_IWGRP
            os.chmod(name, stat.S_IMODE(mode) | extra, dir_fd=dir_fd)

    for path in paths:
        mode = path.lstat().st_mode
        give(path, mode)
        if stat.S_ISDIR(mode):  # the walk never follows a symlink out of the workspace
            for entry in walk(path):
                give(entry.name, entry.stat.st_mode, entry.dir_fd)


def run_slug(key: str) -> str:
    """A directory name for an id: the id itself when it is tame, else a cleaned prefix plus a
    hash (so distinct ids never share a directory)."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}", key):
        return key
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._")[:60]
    return f"{clean or 'id'}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


#: Stopgap until RunResult says which exception ended a run: the first words of what
#: ModelUnreachable, a retryable ModelResponseError (5xx, 408, 429 after the client's own
#: retries) and WorkerStartError / WorkerError raise.  ``cannot use the model URL`` (also a
#: ModelUnreachable) is a configuration mistake and deliberately not matched.
_INFRA_TEXT = re.compile(
    r"(cannot reach the model at |the model at \S+ did not answer within "
    r"|the model endpoint \S+ answered HTTP (5\d\d|408|429)\b"
    r"|(worker '[^']*': )?(could not start a worker|worker failed to start)\b"
    r"|worker '[^']*' (failed to start|did not answer)\b)")
_INFRA_TYPES = {"ModelUnreachable", "WorkerStartError", "WorkerError", "WorkerClosed"}


def is_infrastructure(result: RunResult) -> bool:
    """Whether a failed run failed for reasons outside the model (worth another attempt)."""
    if result.status != "failed":
        return False
    kind = result.extra.get("error_type") if result.extra else None
    if kind == "ModelResponseError":
        return bool(_INFRA_TEXT.match(result.error))
    if kind:
        return kind in _INFRA_TYPES and not result.error.startswith("cannot use the model URL")
    return bool(_INFRA_TEXT.match(result.error))


def make_record(spec: TaskSpec, settings: RunSettings, *, status: str, answer: str | None = None,
                error: str = "", messages: int = 0, tokens_in: int = 0, tokens_out: int = 0,
                cost: float = 0.0, duration_s: float = 0.0, attempts: int = 0,
                infrastructure: bool = False, **extra: Any) -> dict:
    """One output line.  Counts are totals over all attempts; ``transcript`` and ``workspace``
    are paths on the machine that ran the run."""
    run_dir = settings.runs_dir / run_slug(spec.key)
    return {"id": spec.id, "status": status, "answer": answer, "error": error,
            "messages": messages, "tokens": {"in": tokens_in, "out": tokens_out},
            "cost": round(cost, 6), "duration_s": round(duration_s, 3), "attempts": attempts,
            "infrastructure": infrastructure, "model": settings.models.get(spec.model or settings.model).alias,
            "transcript": str(run_dir / "transcript.jsonl"), "workspace": str(run_dir / "workspace"),
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"), **extra}


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
        return (_read_all(fd), mode & 0o777) if stat.S_ISREG(mode) else None
    finally:
        os.close(fd)


def _clear(run_dir: Path, first: bool) -> None:
    """Remove what an earlier attempt left.  The first attempt also clears what an earlier,
    interrupted batch left; later ones keep the transcript (it records every attempt).  A
    worker wrote the workspace: it is removed whatever its shape (``_tree.remove_tree``), and
    what cannot be removed is an OSError, not a run on top of an old workspace."""
    for path in [run_dir] if first else [run_dir / "workspace", run_dir / "state"]:
        if not remove_tree(path):
            raise OSError(f"could not remove all of {path}")
    run_dir.mkdir(parents=True, exist_ok=True)


def _place_files(workspace: Path, spec: TaskSpec, packed: list[tuple[str, bytes, int]] | None) -> list[Path]:
    """Copy the task's files into the workspace; the paths placed there (top level)."""
    workspace.mkdir(parents=True, exist_ok=True)
    placed: list[Path] = []
    if packed is not None:
        for relative, data, mode in packed:
            target = workspace / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(mode)
            placed.append(target)
    else:
        for source in map(Path, spec.files):
            target = workspace / source.name
            if source.is_dir():
                copy_tree(source, target)
            else:
                shutil.copy2(source, target)
            placed.append(target)
    return placed


async def _to_the_end(awaitable: Any) -> None:
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile (cleanup must
    finish: it kills workers); the cancellation is re-raised afterwards."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


async def _attempt(spec: TaskSpec, settings: RunSettings, attempt: int, display: AgentDisplay | None,
                   packed: list[tuple[str, bytes, int]] | None) -> tuple[RunResult, bool]:
    """One attempt of a run: (its result, whether it failed for infrastructure reasons)."""
    run_dir = settings.runs_dir / run_slug(spec.key)
    workspace = run_dir / "workspace"
    try:
        await asyncio.to_thread(_clear, run_dir, attempt == 1)
    except OSError as exc:
        return RunResult(None, "failed", f"cannot prepare the run's directory {run_dir}: {exc}"), True
    recorder = JsonlRecorder(run_dir / "transcript.jsonl")
    recorder.event("note", name="batch", message=f"run {spec.key!r}, attempt {attempt}")
    shown: AgentDisplay = FanoutDisplay([recorder, display]) if display is not None else recorder
    # No warm pool: an idle spare worker per run would double a batch's processes for the rare
    # run that starts a sub-agent.  No fork server either: each run has a sandbox (and so a
    # server) of its own, and starting one costs more than the one or two workers a run starts.
    engine = RunEngine(max_workers=settings.max_workers, cwd=workspace, workspace=workspace,
                       sandbox=settings.sandbox, state_dir=run_dir / "state", pool=0, zygote=False)
    infrastructure = False
    tools = None
    try:
        engine.placed = await asyncio.to_thread(_place_files, workspace, spec, packed)
        if settings.tools == "repo":  # other runs' directories and results are not this run's to read
            tools = RepoTools(settings.root, exclude=settings.exclude)
        result = await run_task(spec.task, models=settings.models, model=spec.model or settings.model,
                                engine=engine, functions=tools.functions() if tools else {},
                                display=shown, max_messages=spec.max_messages or settings.max_messages,
                                timeout=spec.timeout or settings.timeout, protocol=settings.protocol)
    except (OSError, ConfigError) as exc:  # placing files; the run's directories
        result = RunResult(None, "failed", f"cannot prepare the run's workspace {workspace}: {exc}")
        infrastructure = True
    except Exception as exc:  # noqa: BLE001 - a bug or an OS failure costs one attempt, not the batch
        result = RunResult(None, "failed", f"internal error: {type(exc).__name__}: {exc}")
        infrastructure = True
    finally:
        try:
            if tools is not None:
                tools.close()
            await _to_the_end(engine.shutdown())
        finally:
            recorder.close()
            with contextlib.suppress(OSError):  # the engine removed its empty run directory
                (run_dir / "state" / "runs").rmdir()
                (run_dir / "state").rmdir()
    return result, infrastructure or is_infrastructure(result)


async def execute(spec: TaskSpec, settings: RunSettings, *, display: AgentDisplay | None = None,
                  packed: list[tuple[str, bytes, int]] | None = None) -> dict:
    """Run one task, with up to ``settings.retries`` more attempts after infrastructure
    failures, and return its record.  Never raises: cancelling it yields a ``cancelled`` record
    once its workers are gone.  ``packed`` (from ``pack_files``) replaces copying ``spec.files``
    when the run happens on another machine."""
    started = time.monotonic()
    sums = Counter()
    attempts, infrastructure = 0, False
    result = RunResult(None, "cancelled", "cancelled before it started")
    try:
        while True:
            attempts += 1
            result, infrastructure = await _attempt(spec, settings, attempts, display, packed)
            sums.update(messages=result.messages, tokens_in=result.tokens_in, tokens_out=result.tokens_out)
            sums["cost"] += result.cost
            if not infrastructure or attempts > settings.retries or result.status == "cancelled":
                break
            await asyncio.sleep(settings.backoff(attempts))
    except asyncio.CancelledError:  # during a backoff or a cleanup: the run ends here
        result, infrastructure = RunResult(result.answer, "cancelled", "cancelled"), False
    return make_record(spec, settings, status=result.status, answer=result.answer, error=result.error,
                       messages=sums["messages"], tokens_in=sums["tokens_in"], tokens_out=sums["tokens_out"],
                       cost=sums["cost"], duration_s=time.monotonic() - started, attempts=attempts,
                       infrastructure=infrastructure)


# ---------------------------------------------------------------------------------------------
# How many at once
# ---------------------------------------------------------------------------------------------

def usable_cpus() -> int:
    """CPUs this process may run on, after affinity and a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.floor(int(quota) / int(period))))
    return max(1, cpus)


def available_memory() -> int:
    """Bytes that can be used without swapping: MemAvailable, or less under a cgroup limit."""
    available = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    return available


def default_parallel(cpus: int | None = None, memory: int | None = None) -> int:
    """``min(2 × cpus, memory / 1 GiB)``, between 1 and 64 (see the module docstring)."""
    cpus = usable_cpus() if cpus is None else cpus
    memory = available_memory() if memory is None else memory
    return max(1, min(2 * cpus, memory // MEMORY_PER_RUN, MAX_DEFAULT_PARALLEL))


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------

class Meter(AgentDisplay):
    """Tokens and cost of one running run, from its agents' ``replied`` events."""

    def __init__(self) -> None:
        self.by_agent: dict[str, dict] = {}

    def event(self, type: str, **fields: Any) -> None:
        if type == "replied" and isinstance(fields.get("stats"), dict):
            self.by_agent[str(fields.get("name"))] = fields["stats"]

    def totals(self) -> tuple[int, int, float]:
        stats = self.by_agent.values()
        return (sum(s.get("tokens_in", 0) for s in stats), sum(s.get("tokens_out", 0) for s in stats),
                sum(s.get("cost", 0.0) for s in stats))


class Tally:
    """Counts of the batch so far: what finished (by status), what runs, tokens and cost."""

    def __init__(self, total: int, before: int) -> None:
        self.total = total
        self.before = before  # finished by an earlier invocation
        self.counts: Counter[str] = Counter()
        self.infrastructure = 0
        self.tokens_in = self.tokens_out = 0
        self.cost = 0.0
        self.running: dict[str, Meter | None] = {}
        self.started = time.monotonic()
        self.consecutive_infra = 0

    @property
    def finished(self) -> int:
        return sum(self.counts.values())

    def start(self, key: str, meter: Meter | None = None) -> None:
        self.running[key] = meter

    def finish(self, key: str, record: dict) -> None:
        self.running.pop(key, None)
        self.counts[record["status"]] += 1
        self.tokens_in += record["tokens"]["in"]
        self.tokens_out += record["tokens"]["out"]
        self.cost += record["cost"]
        if record.get("infrastructure"):
            self.infrastructure += 1
            self.consecutive_infra += 1
        elif record["status"] != "cancelled":
            self.consecutive_infra = 0

    def usage(self) -> tuple[int, int, float]:
        """Tokens in, out and cost: finished runs plus what running ones have used so far."""
        tin, tout, cost = self.tokens_in, self.tokens_out, self.cost
        for meter in self.running.values():
            if meter is not None:
                a, b, c = meter.totals()
                tin, tout, cost = tin + a, tout + b, cost + c
        return tin, tout, cost

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def rate(self) -> float:
        """Runs finished per minute in this invocation."""
        elapsed = self.elapsed()
        return self.finished / elapsed * 60 if elapsed > 0 else 0.0

    def eta(self) -> float | None:
        left = self.total - self.before - self.finished
        if not self.finished:
            return None
        return left * self.elapsed() / self.finished


def _short(text: str, limit: int = 120) -> str:
    """``text`` on one line, inert, at most ``limit`` characters."""
    text = " ".join(inert(str(text)).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


class LinesView:
    """One plain line per finished run, for logs: ``[12/100] id=t7 answered 3.2s``."""

    def __init__(self, tally: Tally, stream: Any = None) -> None:
        self.tally = tally
        self.stream = stream or sys.stderr

    def start(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def finished(self, record: dict) -> None:
        t = self.tally
        line = (f"[{t.before + t.finished}/{t.total}] id={inert(str(record['id']))} {record['status']} "
                f"{record['duration_s']:.1f}s")
        if record.get("attempts", 1) > 1:
            line += f" after {record['attempts']} attempts"
        if record["status"] != "answered" and record.get("error"):
            line += f": {_short(record['error'])}"
        print(line, file=self.stream, flush=True)

    def stop(self) -> None:
        pass


class QuietView(LinesView):
    def finished(self, record: dict) -> None:
        pass


class BarView(LinesView):
    """A rich progress bar on stderr (done/total, ETA) over a line of counts: by status, running,
    rate, tokens and cost so far.  Failures are printed above it as they happen."""

    def __init__(self, tally: Tally, force_terminal: bool = False) -> None:
        super().__init__(tally)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.text import Text

        view = self

        class _Progress(Progress):
            def get_renderables(self):
                yield self.make_tasks_table(self.tasks)
                yield Text.from_markup(view.status)

        self.status = ""
        self.console = Console(stderr=True, force_terminal=force_terminal or None)
        self.progress = _Progress(TextColumn("[bold]batch"), BarColumn(bar_width=None), MofNCompleteColumn(),
                                  TextColumn("ETA {task.fields[eta]}"), console=self.console,
                                  refresh_per_second=4, expand=True)
        self.task = self.progress.add_task("batch", total=tally.total, completed=tally.before, eta="-:--")

    def start(self) -> None:
        self.progress.start()
        self.tick()

    def tick(self) -> None:
        t = self.tally
        tin, tout, cost = t.usage()
        self.status = (f"[green]answered {t.counts['answered']}[/] · [red]failed {t.counts['failed']}[/] · "
                       f"timed out {t.counts['timed_out']} · running {len(t.running)} · "
                       f"{t.rate():.1f} runs/min · {_tokens(tin)}/{_tokens(tout)} tokens in/out · ${cost:.4f}")
        self.progress.update(self.task, completed=t.before + t.finished, eta=_clock(t.eta()))

    def finished(self, record: dict) -> None:
        if record["status"] not in ("answered", "cancelled"):
            error = f": {_short(record['error'], 100)}" if record.get("error") else ""
            self.progress.console.print(f"id={inert(str(record['id']))} {record['status']}{error}", markup=False,
                                        highlight=False)
        self.tick()

    def stop(self) -> None:
        self.tick()
        self.progress.stop()


def make_view(mode: str, tally: Tally) -> LinesView:
    """``auto``: a bar when stderr is a terminal, else lines; ``bar``, ``lines``, ``none``."""
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "lines"
    if mode == "bar":
        return BarView(tally, force_terminal=True)
    return QuietView(tally) if mode == "none" else LinesView(tally)


def print_summary(tally: Tally, results: Path, runs_dir: Path, stopped: str | None) -> None:
    """The closing table on stderr: runs by status, tokens, cost, wall time, rate."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    tin, tout, cost = tally.usage()
    table = Table(title="batch summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for status in STATUSES:
        label = status.replace("_", " ")
        value = str(tally.counts[status])
        if status == "failed" and tally.infrastructure:
            value += f" ({tally.infrastructure} infrastructure)"
        table.add_row(label, value)
    table.add_row("done before", str(tally.before))
    left = tally.total - tally.before - tally.finished
    if left:
        table.add_row("not run", str(left))
    table.add_row("tokens in / out", f"{tin:,} / {tout:,}")
    table.add_row("cost", f"${cost:.4f}")
    table.add_row("wall time", _clock(tally.elapsed()))
    table.add_row("runs / minute", f"{tally.rate():.1f}")
    # Text, not str: a cell given as str is read as markup
    table.add_row("results", Text(inert(str(results))))
    table.add_row("runs", Text(inert(str(runs_dir))))
    if stopped:
        table.add_row("stopped", Text(inert(stopped)))
    Console(stderr=True).print(table)


# ---------------------------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------------------------

class Stopper:
    """Interrupts: the first stops starting runs and calls ``on_stop`` (cancel the running
    ones); the second leaves at once — every finished record is already fsynced."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.interrupted = False
        self.on_stop: Callable[[], None] = lambda: None

    @property
    def stopping(self) -> bool:
        return self.reason is not None

    def interrupt(self) -> None:
        if self.interrupted:
            _leave_now()
        self.interrupted = True
        self.reason = "interrupted"
        print("\nagentloop: interrupted — cancelling the running runs (Ctrl-C again to leave at once)",
              file=sys.stderr, flush=True)
        self.on_stop()

    def abort(self, reason: str) -> None:
        """Stop starting runs, letting the running ones finish."""
        if self.reason is None:
            self.reason = reason


def _leave_now() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\x1b[?25h\n")  # the progress bar hid the cursor
    sys.stderr.write("agentloop: left at once; finished results are on disk\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


@dataclass
class BatchOutcome:
    """How an invocation ended: its tally and why it stopped early (None: it did not)."""

    tally: Tally
    stopped: str | None

    @property
    def exit_code(self) -> int:
        if self.stopped == "interrupted":
            return EXIT_INTERRUPTED
        return EXIT_STOPPED if self.stopped else 0


def infra_threshold(parallel: int) -> int:
    """Infrastructure failures in a row after which the batch stops starting runs."""
    return max(5, 2 * parallel)


async def _run_local(pending: list[TaskSpec], settings: RunSettings, results: ResultsFile, tally: Tally,
                     view: LinesView, parallel: int, stopper: Stopper) -> None:
    loop = asyncio.get_running_loop()
    running: dict[asyncio.Task, TaskSpec] = {}

    def cancel_all() -> None:
        for task in running:
            task.cancel()

    stopper.on_stop = cancel_all
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopper.interrupt)

    async def one(spec: TaskSpec) -> None:
        meter = Meter()
        tally.start(spec.key, meter)
        record = await execute(spec, settings, display=meter)
        try:
            results.append(record)
        except OSError as exc:
            raise AgentloopError(f"cannot write to {results.path}: {exc}; the batch stops (rerun to resume)") from exc
        tally.finish(spec.key, record)
        view.finished(record)
        if tally.consecutive_infra >= infra_threshold(parallel):
            stopper.abort(f"{tally.consecutive_infra} runs in a row failed for infrastructure reasons "
                          f"(last: {_short(record['error'], 200)}); fix it and run the same command again")

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.5)
            view.tick()

    ticking = asyncio.ensure_future(ticker())
    queue = iter(pending)
    try:
        while True:
            while not stopper.stopping and len(running) < parallel:
                spec = next(queue, None)
                if spec is None:
                    break
                running[asyncio.ensure_future(one(spec))] = spec
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                running.pop(task)
                task.result()  # a failure to write the output ends the batch, loudly
    finally:
        ticking.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if running:  # the output failed: stop the rest before leaving
            cancel_all()
            await asyncio.gather(*running, return_exceptions=True)


def run_batch(tasks_path: str | Path, output: str | Path, settings: RunSettings, *,
              parallel: int | None = None, progress: str = "auto", skip_invalid: bool = False,
              redo: Iterable[str] = (), ray_address: str | None = None) -> BatchOutcome:
    """Run every task of ``tasks_path`` not yet in ``output``; see the module docstring.

    Raises ConfigError, before anything starts, for invalid task lines (unless
    ``skip_invalid``: then they are reported and left out), a damaged output or a runs
    directory another batch holds."""
    output = Path(output)
    specs, problems = read_tasks(tasks_path, settings.models)
    if problems:
        listing = "\n".join(f"  {p}" for p in problems)
        if not skip_invalid:
            raise ConfigError(f"{tasks_path}: {len(problems)} invalid line(s), nothing started "
                              f"(--skip-invalid to go on without them):\n{listing}")
        print(inert(f"agentloop: {tasks_path}: skipping {len(problems)} invalid line(s):\n{listing}"),
              file=sys.stderr)
    lock = lock_runs_dir(settings.runs_dir)
    results = ResultsFile(output)
    try:
        resumed = results.open(redo_selector(redo))
        if resumed.torn_bytes:
            print(f"agentloop: {output}: cut off a torn last line ({resumed.torn_bytes} bytes); "
                  "that run will be done again", file=sys.stderr)
        if resumed.dropped:
            print(f"agentloop: {output}: {resumed.dropped} record(s) removed to be run again", file=sys.stderr)
        pending = [s for s in specs if s.key not in resumed.done]
        before = len(specs) - len(pending)
        if ray_address is None:
            parallel = parallel or default_parallel()
        where = f"on Ray at {ray_address}" if ray_address else f"{parallel} at once"
        print(f"agentloop: {len(specs)} tasks, {before} done before, {len(pending)} to run, {where}; "
              f"results in {output}, runs in {settings.runs_dir}", file=sys.stderr, flush=True)
        tally = Tally(len(specs), before)
        view = make_view(progress, tally)
        stopper = Stopper()
        view.start()
        try:
            if ray_address is not None and pending:
                from . import on_ray

                on_ray.run_on_ray(ray_address, pending, settings, results=results, tally=tally, view=view,
                                      parallel=parallel, stopper=stopper)
            elif pending:
                asyncio.run(_run_local(pending, settings, results, tally, view, parallel, stopper))
        finally:
            view.stop()
        return BatchOutcome(tally, stopper.reason)
    finally:
        results.close()
        os.close(lock)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

@click.command("batch")
@click.argument("tasks_file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Results JSONL: one record per finished run, appended as runs end; rerun to resume.")
@click.option("--parallel", type=click.IntRange(1), default=None,
              help="Runs at once.  Default: min(2 x CPUs, available GiB of memory), 1 to 64.")
@click.option("--retries", type=click.IntRange(0), default=0, show_default=True,
              help="More attempts for runs that failed for infrastructure reasons (endpoint down, "
                   "worker start); never for the model's own failures.")
@click.option("--retry-backoff", type=Duration(), default="2s", show_default=True,
              help="Wait before the first retry; doubles for each further one (at most 60s).")
@click.option("--timeout", type=Duration(), default="1h", show_default=True,
              help="Wall-clock cap of each attempt of a run (a task's own `timeout` wins).")
@click.option("--skip-invalid", is_flag=True, help="Report invalid task lines and go on without them.")
@click.option("--redo", multiple=True, type=click.Choice(["failed", "timed_out", "infrastructure"]),
              help="Also run again the ids recorded with this status (cancelled ones always are); "
                   "'infrastructure': failed for infrastructure reasons.  Repeatable.")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where each run's workspace and transcript go (default: OUTPUT's stem + .runs).")
@click.option("--max-workers-per-run", type=click.IntRange(1), default=16, show_default=True,
              help="Worker processes one run may hold (its agent and sub-agents).")
@click.option("--progress", type=click.Choice(["auto", "bar", "lines", "none"]), default="auto",
              show_default=True, help="A live bar (auto: when stderr is a terminal) or one line per run.")
@click.option("--ray", "ray_address", metavar="ADDRESS", default=None,
              help="Run on a Ray cluster (pip install 'agentloop[ray]'): its GCS host:port, 'auto', or "
                   "ray://host:10001.  Nodes offer the agent_slot resource (runs per node).  If the cluster "
                   "uses token authentication (Ray 2.60's default), set RAY_AUTH_MODE=token and "
                   "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH).")
@click.option("--model", default=None, help="Model alias for tasks that name none.")
@click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Model aliases file (default ./agentloop.toml, else LLM_URL/LLM_MODEL).")
@click.option("--max-messages", type=click.IntRange(1), default=200, show_default=True,
              help="Messages to the model before a run gives up (a task's own value wins).")
@max_tokens_option
@click.option("--protocol", type=click.Choice(["tags", "tools"]), default=None,
              help="How the model acts: <run_code> tags or native tool calls (default: per model alias).")
@click.option("--tools", type=click.Choice(["none", "repo"]), default="none", show_default=True,
              help="Host functions to offer: repo = list_dir, read_file, search (read-only).")
@click.option("--root", type=click.Path(file_okay=False, exists=True, path_type=Path), default=".",
              help="Directory the repo tools may read (default: current directory).")
@click.option("--sandbox", type=click.Choice(["auto", "bwrap", "landlock", "none"]), default="auto",
              show_default=True, help="How workers are contained; 'none' runs them unsandboxed.")
@click.option("--network", is_flag=True, help="Give workers the host's network.")
def batch(tasks_file: Path, output: Path, parallel: int | None, retries: int, retry_backoff: float,
          timeout: float, skip_invalid: bool, redo: tuple[str, ...], runs_dir: Path | None,
          max_workers_per_run: int, progress: str, ray_address: str | None, model: str | None,
          models_file: Path | None, max_messages: int, protocol: str | None, tools: str, root: Path,
          sandbox: str, network: bool) -> None:
    """Run every task of TASKS_FILE and append one result line per finished run to OUTPUT.

    TASKS_FILE is JSONL, one task a line: id, task; optional model, max_messages, timeout,
    files.  Each result line is fsynced as its run ends; run the same command again to resume
    (ids already in OUTPUT are skipped, cancelled ones run again).  Ctrl-C cancels the running
    runs and exits 130; a second Ctrl-C leaves at once.  Exit 0 when the batch ran to its end,
    1 when it stopped because the infrastructure kept failing, 125 for bad input."""
    try:
        registry = apply_max_tokens(load_models(models_file))
        registry.get(model)
    except AgentloopError as exc:
        _fail(str(exc))
    output = output.absolute()
    runs_dir = (runs_dir or output.with_name(output.stem + ".runs")).absolute()
    settings = RunSettings(
        models=registry, runs_dir=runs_dir, exclude=(runs_dir, output),
        model=model, protocol=protocol, max_messages=max_messages, timeout=timeout, tools=tools,
        root=str(root.resolve()), sandbox=_policy(sandbox, network), retries=retries,
        retry_backoff=retry_backoff, max_workers=max_workers_per_run)
    try:
        outcome = run_batch(tasks_file, output, settings, parallel=parallel, progress=progress,
                            skip_invalid=skip_invalid, redo=redo, ray_address=ray_address)
    except AgentloopError as exc:
        click.echo(inert(f"agentloop: {exc}"), err=True)
        sys.exit(EXIT_OWN)
    except KeyboardInterrupt:  # before the batch's own handlers were in place
        click.echo("agentloop: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    print_summary(outcome.tally, output, settings.runs_dir, outcome.stopped)
    if outcome.stopped and outcome.stopped != "interrupted":
        click.echo(inert(f"agentloop: stopped early: {outcome.stopped}"), err=True)
    sys.exit(outcome.exit_code)


__all__ = ["BatchOutcome", "ResultsFile", "RunSettings", "TaskSpec", "batch", "default_parallel", "execute",
           "is_infrastructure", "make_record", "read_tasks", "run_batch"]
