"""One run of a batch: its directory, workspace and files, its engine, its attempts and its record."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine.agent import AgentDisplay, FanoutDisplay, JsonlRecorder, RunResult, run_task
from engine.batch.tasks import TaskSpec
from engine.errors import ConfigError
from engine.launch import SharedForkServer, WorkerSettings
from engine.models import ClientPool, ModelRegistry
from engine.observe import trace_observer
from engine.results import BATCH_OUTPUT_CAP, OutputBudget
from engine.tools import RepoTools
from engine.trees import copy_tree, remove_tree, walk
from engine.workers import Engine

__all__ = ["BACKOFF_MAX", "RunSettings", "execute", "is_infrastructure", "make_record", "run_slug"]

#: Longest wait between two attempts of a run.
BACKOFF_MAX = 60.0


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
    #: How every run's workers are started and contained.  Its ``fork_server``: None forks the
    #: runs' workers from one fork server for the batch where it gives the isolation of a cold
    #: start (see ``shared_fork_server``); False: every worker starts cold; True: insist (a run
    #: fails, as for its infrastructure, without).
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    #: What the output files of every run of the batch on one machine may hold in all (None:
    #: no cap); each run's own is ``worker.max_output``.  A batch keeps them, in each run's directory.
    max_batch_output: int | None = BATCH_OUTPUT_CAP
    retries: int = 0
    retry_backoff: float = 2.0
    max_workers: int = 16
    #: What the repository tools never show a run: the batch's runs directory and results file.
    exclude: tuple[Path, ...] = ()

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): doubling, capped."""
        return min(self.retry_backoff * 2 ** (attempt - 1), BACKOFF_MAX)

    def shared_fork_server(self) -> SharedForkServer | None:
        """The fork server the runs of one batch (one machine) share, or None when the
        workers start cold.  Nothing starts until a run needs a worker; the caller closes it
        once the batch's runs are over."""
        if self.worker.fork_server is False:
            return None
        return SharedForkServer(self.runs_dir, self.worker)

    def output_budget(self) -> OutputBudget | None:
        """The budget the runs of one batch on one machine share for their output files
        (None: no cap of the batch's); each run's own cap draws from it."""
        if self.max_batch_output is None:
            return None
        return OutputBudget(self.max_batch_output, owner="the batch's")

    def deadline(self, spec: TaskSpec) -> float | None:
        """Seconds after which a run, all attempts included, is surely hung (None: no cap)."""
        timeout = spec.timeout or self.timeout
        if timeout is None:
            return None
        waits = sum(self.backoff(a) for a in range(1, self.retries + 1))
        return (timeout + 60.0) * (self.retries + 1) + waits


def _give_to_run(paths: list[Path], run: int | None) -> None:
    """Give ``paths`` to the run's workers, whose uid (and gid: one number) is ``run`` (None:
    they keep the coordinator's).  A root coordinator runs them as the run's uid and keeps the
    workspace its own (in the run's group, sticky: see ``engine.sandbox``), so files it placed
    there would be read-only to them; the task's files are the run's copies, not the user's
    originals, so they become the run's uid's and group-writable."""
    if run is None or os.geteuid() != 0:
        return

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


#: Exceptions that end a run for reasons outside the model (``RunResult.extra["error_type"]``).
_INFRA_TYPES = {"ModelUnreachable", "WorkerStartError", "WorkerError", "WorkerClosed"}


def is_infrastructure(result: RunResult) -> bool:
    """Whether a failed run failed for reasons outside the model (worth another attempt): the
    endpoint unreachable or answering 5xx, 408 or 429 after the client's own retries, a worker
    that does not start or answer.  ``cannot use the model URL`` (a ModelUnreachable too) is a
    configuration mistake and never retried."""
    if result.status != "failed":
        return False
    extra = result.extra or {}
    kind = extra.get("error_type")
    if kind == "ModelResponseError":
        status = extra.get("http_status")
        return isinstance(status, int) and (status >= 500 or status in (408, 429))
    return kind in _INFRA_TYPES and not result.error.startswith("cannot use the model URL")


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
    """Copy the task's files into the workspace, and make its ``files`` directory; the paths
    placed there (top level)."""
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
    # ./files, as under run and exec: the place the system prompt names for the run's output.
    files = workspace / "files"
    if not files.is_dir() or files.is_symlink():
        files.mkdir(mode=0o755)
        placed.append(files)
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
                   packed: list[tuple[str, bytes, int]] | None,
                   fork_server: SharedForkServer | None,
                   output_budget: OutputBudget | None, clients: ClientPool | None) -> tuple[RunResult, bool]:
    """One attempt of a run: (its result, whether it failed for infrastructure reasons)."""
    run_dir = settings.runs_dir / run_slug(spec.key)
    workspace = run_dir / "workspace"
    try:
        await asyncio.to_thread(_clear, run_dir, attempt == 1)
    except OSError as exc:
        return RunResult(None, "failed", f"cannot prepare the run's directory {run_dir}: {exc}"), True
    recorder = JsonlRecorder(run_dir / "transcript.jsonl")
    recorder.event("note", name="batch", message=f"run {spec.key!r}, attempt {attempt}")
    spans = trace_observer(settings.models, {"agentloop.task.id": spec.key, "agentloop.run.attempt": attempt})
    shown: AgentDisplay = FanoutDisplay([d for d in (recorder, display, spans) if d is not None])
    # No warm pool: an idle spare worker per run would double a batch's processes for the rare
    # run that starts a sub-agent.  No fork server of the run's own either (starting one costs
    # more than the one or two workers a run starts): the batch's, shared by its runs, forks
    # them (~10 ms instead of ~120 ms cold), each worker shown its own run's workspace, outputs
    # and socket only, with its run's uid, confinement and cgroups.  Without one (non-root, no
    # bubblewrap, Ray, ``fork_server=False``) they start cold.
    worker = settings.worker.replace(state_dir=run_dir / "state", keep_output=True,
                                     fork_server=settings.worker.fork_server if fork_server is not None else False,
                                     **({"allow_net": spec.allow_net} if spec.allow_net else {}))
    engine = Engine(worker, cwd=workspace, workspace=workspace, pool=0, max_workers=settings.max_workers,
                    shared_fork_server=fork_server, output_budget=output_budget)
    infrastructure = False
    tools = None
    try:
        placed = await asyncio.to_thread(_place_files, workspace, spec, packed)
        engine.open()
        await asyncio.to_thread(_give_to_run, placed, engine.launcher.run_uid())
        if settings.tools == "repo":  # other runs' directories and results are not this run's to read
            tools = RepoTools(settings.root, exclude=settings.exclude)
        with ClientPool.shared(clients):
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
            if spans is not None:
                spans.close()
            with contextlib.suppress(OSError):  # the engine removed its empty run directory
                (run_dir / "state" / "runs").rmdir()
                (run_dir / "state").rmdir()
    return result, infrastructure or is_infrastructure(result)


async def execute(spec: TaskSpec, settings: RunSettings, *, display: AgentDisplay | None = None,
                  packed: list[tuple[str, bytes, int]] | None = None,
                  fork_server: SharedForkServer | None = None, output_budget: OutputBudget | None = None,
                  clients: ClientPool | None = None) -> dict:
    """Run one task, with up to ``settings.retries`` more attempts after infrastructure
    failures, and return its record.  Never raises: cancelling it yields a ``cancelled`` record
    once its workers are gone.  ``packed`` (from ``pack_files``) replaces copying ``spec.files``
    when the run happens on another machine.  ``fork_server``: the batch's
    (``settings.shared_fork_server()``), which forks the run's workers; without one they start
    cold.  ``output_budget``: the batch's (``settings.output_budget()``), which the run's output
    files draw from besides its own cap.  ``clients``: the batch's (one HTTP client per endpoint,
    its connections kept for the next run; ``engine.models.ClientPool``), else each conversation
    its own."""
    started = time.monotonic()
    sums = Counter()
    attempts, infrastructure = 0, False
    result = RunResult(None, "cancelled", "cancelled before it started")
    try:
        while True:
            attempts += 1
            result, infrastructure = await _attempt(spec, settings, attempts, display, packed, fork_server,
                                                    output_budget, clients)
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
