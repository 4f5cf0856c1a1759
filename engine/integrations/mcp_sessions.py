"""The open sessions of ``agentloop mcp``, by client and name: each an engine of its own with
one worker, started on first use, closed when idle, when reset or when its client's MCP session
ends, and bounded in number for the whole server (see ``engine.integrations.mcp``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.durations import format_duration
from engine.errors import AgentloopError, CallRefused
from engine.integrations.mcp_clients import Client, session_directories
from engine.launch import WorkerSettings
from engine.workers import Engine, Worker

__all__ = ["CLOSE_TIMEOUT", "SESSION_NAME", "ServerConfig", "McpSession", "Sessions", "check_name"]

log = logging.getLogger("agentloop")

#: Seconds shutting all sessions down may take before the server stops waiting.
CLOSE_TIMEOUT = 15.0
#: A session name: also a directory name, so no path separator, no dot first.
SESSION_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclass
class ServerConfig:
    """What the command line decided for every session of one server."""

    workspace: Path  # a session's files are workspace/SESSION (stdio) or workspace/client-ID/SESSION (HTTP)
    settings: WorkerSettings = field(default_factory=WorkerSettings)  # every session's workers'
    cwd: Path = field(default_factory=Path.cwd)
    idle_timeout: float = 30 * 60.0
    max_sessions: int = 8


class McpSession:
    """One named, persistent namespace: an engine of its own with one worker."""

    def __init__(self, client: Client, name: str, engine: Engine, worker: Worker,
                 parent: McpSession | None = None) -> None:
        self.client = client
        self.name = name
        self.engine = engine
        self.worker = worker
        self.workspace = engine.workspace
        #: The session this one is a fork of (``fork_session``): its engine, sandbox and files are
        #: that one's, and it closes with it.  Its own forks, likewise.
        self.parent = parent
        self.forks: list[McpSession] = []
        self.started = time.monotonic()
        self.last_used = self.started
        self.running = 0  # tool calls using it now
        self.blocks = 0  # blocks run so far
        self.idle_timer: asyncio.TimerHandle | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.client.id, self.name

    def describe(self) -> dict[str, Any]:
        """What ``list_sessions`` says about this session."""
        return {"session": self.name, "workspace": str(self.workspace), "running": self.running,
                "blocks_run": self.blocks, "variables": list(self.worker.vars),
                "idle_s": 0.0 if self.running else round(time.monotonic() - self.last_used, 1),
                "pid": self.worker.pid, **({"forked_from": self.parent.name} if self.parent else {})}


class Sessions:
    """The open sessions of one server, by client and name.

    A session starts on first use, is closed after ``idle_timeout`` seconds without a running
    call, and counts against ``max_sessions`` (the server's, all clients together) from the
    moment it starts starting.  Two calls naming a new session at once share one start.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._open: dict[tuple[str, str], McpSession] = {}
        self._starting: dict[tuple[str, str], asyncio.Task[McpSession]] = {}
        # The sessions this server started for a client whose root is shared (stdio's, the
        # workspace itself): their files stay readable.  A private root holds nothing else.
        self._seen: set[tuple[str, str]] = set()
        # Shutdowns under way (idle, reset, client gone), by session: one of the same name
        # starts after it ends, so that the old engine's cleanup (its workspace's uid, its
        # workers' processes) cannot take what the new one starts.
        self._closing: dict[tuple[str, str], asyncio.Task] = {}
        self._noted: set[str] = set()  # the sandbox's notes said on stderr (once each)
        self._closed = False

    def names(self, client: Client) -> list[str]:
        """The names of ``client``'s open sessions."""
        return sorted(name for owner, name in self._open if owner == client.id)

    def owned(self, client: Client) -> list[str]:
        """The sessions ``client`` started, open or closed since: those whose files it may read."""
        if client.private:
            return [n for n in session_directories(client.root) if SESSION_NAME.fullmatch(n)]
        return sorted(name for owner, name in self._seen if owner == client.id)

    def workspace_of(self, client: Client, name: str) -> Path:
        return client.root / check_name(name)

    @contextlib.asynccontextmanager
    async def use(self, client: Client, name: str) -> AsyncIterator[tuple[McpSession, bool]]:
        """``client``'s session ``name``, started if need be (True with it when this call
        started it), held open for the duration: it is not closed for idleness while a call
        uses it."""
        session, started = await self._acquire(client, name)
        try:
            yield session, started
        finally:
            session.running -= 1
            session.last_used = time.monotonic()
            if session.running == 0 and self._open.get(session.key) is session:
                self._arm_idle(session)

    async def _acquire(self, client: Client, name: str) -> tuple[McpSession, bool]:
        check_name(name)
        if self._closed:
            raise CallRefused("the server is shutting down")
        key = (client.id, name)
        session = self._open.get(key)
        started = False
        if session is None:
            task = self._starting.get(key)
            if task is None:
                if len(self._open) + len(self._starting) >= self.config.max_sessions:
                    yours = ", ".join(self.names(client)) or "none"
                    raise CallRefused(
                        f"{self.config.max_sessions} sessions are open on this server, the most it allows "
                        f"(--max-sessions); yours: {yours}. Use one of yours, or end one with reset_session; "
                        f"sessions idle for {format_duration(self.config.idle_timeout)} close by themselves")
                task = asyncio.ensure_future(self._start(client, name))
                self._starting[key] = task
                task.add_done_callback(self._started)
                started = True
            # Shielded: a caller that gives up does not abandon a half-started engine.
            session = await asyncio.shield(task)
        if session.idle_timer is not None:
            session.idle_timer.cancel()
            session.idle_timer = None
        session.running += 1
        return session, started

    def _started(self, task: asyncio.Task[McpSession]) -> None:
        for key, starting in list(self._starting.items()):
            if starting is task:
                del self._starting[key]
        if not task.cancelled():
            task.exception()  # read here: every caller waiting for it may have given up

    async def _start(self, client: Client, name: str) -> McpSession:
        closing = self._closing.get((client.id, name))
        if closing is not None:
            await asyncio.wait([closing])
        config = self.config
        settings = config.settings
        if client.private:  # the other clients' directories are never in its view
            policy = settings.sandbox
            settings = settings.replace(sandbox=dataclasses.replace(policy, hidden=(*policy.hidden, str(config.workspace))))
        engine = Engine(settings, cwd=config.cwd, workspace=client.root / name, pool=0)
        try:
            worker = await engine.start_worker(name)
        except AgentloopError as exc:
            await engine.shutdown()
            raise CallRefused(f"session {name!r} could not start: {exc}") from exc
        except BaseException:
            await asyncio.shield(engine.shutdown())
            raise
        session = McpSession(client, name, engine, worker)
        if self._closed:  # the server began to stop while this one started
            await engine.shutdown()
            raise CallRefused("the server is shutting down")
        self._open[session.key] = session
        if not client.private:
            self._seen.add(session.key)
        log.info("session %s of %s started (workspace %s)", name, client.id, session.workspace)
        for note in worker.notes:  # the sandbox's, for whoever runs the server, not its client's model
            if note not in self._noted:
                self._noted.add(note)
                log.warning("%s", note)
        return session

    async def fork(self, client: Client, source: str, name: str) -> McpSession:
        """A new session ``name`` of ``client`` holding a copy of its session ``source`` as it is
        now (``Worker.fork``): every variable, import and loaded byte, copied in milliseconds.  It
        runs in ``source``'s sandbox, sharing its files, and closes when ``source`` does.
        CallRefused in words when ``name`` is taken, the server is full, or ``source`` cannot
        fork now (what to stop first)."""
        check_name(name)
        key = (client.id, name)
        if key in self._open or key in self._starting:
            raise CallRefused(f"session {name!r} is open already; fork into a new name, or reset it first")
        if (client.id, source) not in self._open:
            open_ = ", ".join(self.names(client)) or "none"
            raise CallRefused(f"session {source!r} is not open (open: {open_}); run_python starts one")
        if len(self._open) + len(self._starting) >= self.config.max_sessions:
            raise CallRefused(f"{self.config.max_sessions} sessions are open on this server, the most it allows "
                              f"(--max-sessions); yours: {', '.join(self.names(client))}. End one with "
                              "reset_session first")
        async with self.use(client, source) as (parent, _):
            try:
                (copy,) = await parent.worker.fork(1)
            except AgentloopError as exc:
                raise CallRefused(f"session {source!r} cannot be forked now: {exc}") from exc
        if key in self._open or self._open.get(parent.key) is not parent:  # (changed while it forked)
            await copy.close()
            raise CallRefused(f"session {name!r} was opened, or {source!r} closed, while it forked")
        session = McpSession(client, name, parent.engine, copy, parent=parent)
        parent.forks.append(session)
        self._open[key] = session
        if not client.private:
            self._seen.add(key)
        self._arm_idle(session)
        log.info("session %s of %s forked from %s", name, client.id, source)
        return session

    def _arm_idle(self, session: McpSession) -> None:
        if session.idle_timer is not None:
            session.idle_timer.cancel()
        loop = asyncio.get_running_loop()
        session.idle_timer = loop.call_later(self.config.idle_timeout, self._expire, session)

    def _expire(self, session: McpSession) -> None:
        session.idle_timer = None
        if session.running == 0 and self._open.get(session.key) is session:
            log.info("session %s of %s closed after %s idle", session.name, session.client.id,
                     format_duration(self.config.idle_timeout))
            self._close_later(session)

    def _close_later(self, session: McpSession) -> asyncio.Task:
        """Take ``session`` out of the open ones and shut it down in the background; a session
        of its name starts only once that ends."""
        del self._open[session.key]
        if session.idle_timer is not None:
            session.idle_timer.cancel()
            session.idle_timer = None
        for fork in list(session.forks):  # (their processes end with this one's)
            if self._open.get(fork.key) is fork:
                self._close_later(fork)
        if session.parent is not None:
            with contextlib.suppress(ValueError):
                session.parent.forks.remove(session)
        ending = session.worker.close() if session.parent is not None else session.engine.shutdown()
        key, task = session.key, asyncio.ensure_future(ending)
        self._closing[key] = task
        task.add_done_callback(lambda done: self._closing.pop(key) if self._closing.get(key) is done else None)
        return task

    async def reset(self, client: Client, name: str) -> tuple[McpSession, list[str]] | None:
        """End ``client``'s session ``name``: its worker is killed (running blocks end, saying
        so) and its namespace is gone; its files stay.  Returns the session and the variables it
        held, or None when it was not open."""
        check_name(name)
        key = (client.id, name)
        task = self._starting.get(key)
        if task is not None:
            with contextlib.suppress(CallRefused):
                await asyncio.shield(task)
        session = self._open.get(key)
        if session is None:
            return None
        held = list(session.worker.vars)
        await asyncio.shield(self._close_later(session))  # (a caller that gives up leaves it to end)
        log.info("session %s of %s reset", name, client.id)
        return session, held

    def end_client(self, client: Client) -> int:
        """Close every session of ``client`` (its MCP session ended): their workers are killed,
        in the background, and their files stay.  Returns how many were open."""
        sessions = [s for s in self._open.values() if s.client.id == client.id]
        for session in sessions:
            self._close_later(session)
        return len(sessions)

    def describe(self, client: Client) -> list[dict[str, Any]]:
        return [self._open[client.id, name].describe() for name in self.names(client)]

    async def close_all(self) -> int:
        """Close every session (killing what runs); returns how many were open.  Idempotent."""
        self._closed = True
        starting = list(self._starting.values())
        if starting:
            await asyncio.wait(starting)  # each either registers (and is closed below) or fails
        sessions, self._open = list(self._open.values()), {}
        for session in sessions:
            if session.idle_timer is not None:
                session.idle_timer.cancel()
        tasks = [asyncio.ensure_future(s.engine.shutdown()) for s in sessions] + list(self._closing.values())
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
            for task in pending:
                log.warning("a session did not shut down within %s s", CLOSE_TIMEOUT)
                task.cancel()
        return len(sessions)


def check_name(name: Any) -> str:
    """``name`` if it can name a session (and its workspace directory), else a CallRefused."""
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
        raise CallRefused(f"a session name is 1 to 64 letters, digits, '_', '-' or '.', not starting with "
                        f"'.' or '-'; got {name!r}")
    return name
