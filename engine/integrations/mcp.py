"""agentloop's workers as an MCP server: what ``agentloop mcp`` serves.

Tools: ``run_python(code, session="default", timeout="30s")`` runs one block in the session's
worker (started on first use, its namespace kept between calls), ``reset_session(session)``
and ``list_sessions()``.  Resources: the files of each session's workspace, as
``agentloop://SESSION/PATH``.

What it guarantees:

- **Sessions are sandboxes of their own.**  Each has an ``Engine`` of its own: its worker, its
  workspace (``WORKSPACE/SESSION``, which also derives its uid for a root coordinator), the
  sandbox and limits of the command line.  A session idle for ``idle_timeout`` is closed
  (its files stay); at most ``max_sessions`` are open, and one more is refused in words.
- **The model reads what it can act on.**  A result carries the code's output, the session's
  start (where its files go) and, after a refused write, where the code may write; the
  sandbox's notes (the current directory not shown, a layer this machine lacks) are for whoever
  runs the server and go to its stderr, once each.
- **Every fault is a tool result, never a crash.**  An exception, a deadline, a kill, a worker
  that died, a session that could not start, arguments that cannot be used: the result says so
  in words (``is_error`` set), with the output so far.  Only a resource that cannot be read is
  refused as a request error, since a resource read has no error result.
- **Deadlines kill.**  ``timeout`` is the worker's deadline (``Worker.run``): the block is
  cancelled, and the worker's whole process tree killed when that does not stop it; the result
  says what was lost (``lost_vars``).  A client that
  cancels the request stops the block the same way.
- **Output streams** as progress notifications (``notifications/progress``, ``message`` = the
  output new since the last one, ``progress`` = bytes so far) while the block runs, when the
  request carried a progress token; at most one every ``PROGRESS_INTERVAL`` seconds.
- **Nothing is left behind.**  When the client closes the connection or the server gets
  SIGTERM, every session's workers are killed and their run directories removed before the
  process exits.  stdin is read without a thread, so a signal is never stuck behind a read.
- **Files are read without trusting the worker.**  A workspace is written by sandboxed code:
  listing and reading walk it by file descriptor and never follow a link, so no link a worker
  made can expose a file outside the workspace.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import errno
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

try:
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError
except ImportError as exc:  # the optional extra: say how to get it
    from ..extras import install_hint

    raise ImportError(f"the MCP server needs the MCP SDK ({exc}): {install_hint('mcp')}") from exc

from ..code_task import OUTPUT_BUDGET  # what a block's result carries, as an agent sees it
from ..durations import format_duration, parse_duration
from ..engine import Engine
from ..errors import AgentloopError
from ..results import BlockResult, OutputChunk, writable_note
from ..settings import WorkerSettings
from ..worker import Worker
from .workspace_files import MAX_LISTED_FILES, list_files, mime_type, parse_uri, read_file, resource_uri

__all__ = [
    "AgentloopMCP", "CLOSE_TIMEOUT", "DEFAULT_SESSION", "DEFAULT_TIMEOUT", "PROGRESS_INTERVAL",
    "PROGRESS_TEXT", "Progress", "SCHEME", "SESSION_NAME", "ServerConfig", "Session", "Sessions",
    "CallRefused", "check_name", "result_data", "result_text", "tool_definitions"
]

log = logging.getLogger("agentloop")

#: Seconds between two progress notifications of one block, at least.
PROGRESS_INTERVAL = 0.1
#: Characters of output one progress notification carries at most (the rest is counted).
PROGRESS_TEXT = 8_000
#: Seconds shutting all sessions down may take before the server stops waiting.
CLOSE_TIMEOUT = 15.0
#: A session name: also a directory name, so no path separator, no dot first.
SESSION_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
DEFAULT_SESSION = "default"
DEFAULT_TIMEOUT = "30s"
SCHEME = "agentloop"


class CallRefused(Exception):
    """A tool call that cannot be done as asked; its message goes back to the client as the
    tool's result, with ``is_error`` set."""


@dataclass
class ServerConfig:
    """What the command line decided for every session of one server."""

    workspace: Path  # a session's files are workspace/SESSION
    settings: WorkerSettings = field(default_factory=WorkerSettings)  # every session's workers'
    cwd: Path = field(default_factory=Path.cwd)
    idle_timeout: float = 30 * 60.0
    max_sessions: int = 8


class Session:
    """One named, persistent namespace: an engine of its own with one worker."""

    def __init__(self, name: str, engine: Engine, worker: Worker) -> None:
        self.name = name
        self.engine = engine
        self.worker = worker
        self.workspace = engine.workspace
        self.started = time.monotonic()
        self.last_used = self.started
        self.running = 0  # tool calls using it now
        self.blocks = 0  # blocks run so far
        self.idle_timer: asyncio.TimerHandle | None = None

    def describe(self) -> dict[str, Any]:
        """What ``list_sessions`` says about this session."""
        return {"session": self.name, "workspace": str(self.workspace), "running": self.running,
                "blocks_run": self.blocks, "variables": list(self.worker.vars),
                "idle_s": 0.0 if self.running else round(time.monotonic() - self.last_used, 1),
                "pid": self.worker.pid}


class Sessions:
    """The open sessions of one server, by name.

    A session starts on first use, is closed after ``idle_timeout`` seconds without a running
    call, and counts against ``max_sessions`` from the moment it starts starting.  Two calls
    naming a new session at once share one start.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._open: dict[str, Session] = {}
        self._starting: dict[str, asyncio.Task[Session]] = {}
        self._seen: set[str] = set()  # every session this server started: their files stay readable
        self._noted: set[str] = set()  # the sandbox's notes said on stderr (once each)
        self._closing: set[asyncio.Task] = set()
        self._closed = False

    @property
    def names(self) -> list[str]:
        return sorted(self._open)

    def seen(self) -> list[str]:
        return sorted(self._seen)

    def workspace_of(self, name: str) -> Path:
        return self.config.workspace / check_name(name)

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[tuple[Session, bool]]:
        """The session ``name``, started if need be (True with it when this call started it),
        held open for the duration: it is not closed for idleness while a call uses it."""
        session, started = await self._acquire(name)
        try:
            yield session, started
        finally:
            session.running -= 1
            session.last_used = time.monotonic()
            if session.running == 0 and self._open.get(name) is session:
                self._arm_idle(session)

    async def _acquire(self, name: str) -> tuple[Session, bool]:
        check_name(name)
        if self._closed:
            raise CallRefused("the server is shutting down")
        session = self._open.get(name)
        started = False
        if session is None:
            task = self._starting.get(name)
            if task is None:
                if len(self._open) + len(self._starting) >= self.config.max_sessions:
                    raise CallRefused(
                        f"{self.config.max_sessions} sessions are open ({', '.join(self.names)}), the most this "
                        f"server allows (--max-sessions); use one of them, or end one with reset_session; "
                        f"sessions idle for {format_duration(self.config.idle_timeout)} close by themselves")
                task = asyncio.ensure_future(self._start(name))
                self._starting[name] = task
                task.add_done_callback(self._started)
                started = True
            # Shielded: a caller that gives up does not abandon a half-started engine.
            session = await asyncio.shield(task)
        if session.idle_timer is not None:
            session.idle_timer.cancel()
            session.idle_timer = None
        session.running += 1
        return session, started

    def _started(self, task: asyncio.Task[Session]) -> None:
        for name, starting in list(self._starting.items()):
            if starting is task:
                del self._starting[name]
        if not task.cancelled():
            task.exception()  # read here: every caller waiting for it may have given up

    async def _start(self, name: str) -> Session:
        config = self.config
        engine = Engine(config.settings, cwd=config.cwd, workspace=config.workspace / name, pool=0)
        try:
            worker = await engine.start_worker(name)
        except AgentloopError as exc:
            await engine.shutdown()
            raise CallRefused(f"session {name!r} could not start: {exc}") from exc
        except BaseException:
            await asyncio.shield(engine.shutdown())
            raise
        session = Session(name, engine, worker)
        if self._closed:  # the server began to stop while this one started
            await engine.shutdown()
            raise CallRefused("the server is shutting down")
        self._open[name] = session
        self._seen.add(name)
        log.info("session %s started (workspace %s)", name, session.workspace)
        for note in worker.notes:  # the sandbox's, for whoever runs the server, not its client's model
            if note not in self._noted:
                self._noted.add(note)
                log.warning("%s", note)
        return session

    def _arm_idle(self, session: Session) -> None:
        if session.idle_timer is not None:
            session.idle_timer.cancel()
        loop = asyncio.get_running_loop()
        session.idle_timer = loop.call_later(self.config.idle_timeout, self._expire, session)

    def _expire(self, session: Session) -> None:
        session.idle_timer = None
        if session.running == 0 and self._open.get(session.name) is session:
            log.info("session %s closed after %s idle", session.name, format_duration(self.config.idle_timeout))
            self._close_later(session)

    def _close_later(self, session: Session) -> None:
        del self._open[session.name]
        task = asyncio.ensure_future(session.engine.shutdown())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def reset(self, name: str) -> tuple[Session, list[str]] | None:
        """End session ``name``: its worker is killed (running blocks end, saying so) and its
        namespace is gone; its files stay.  Returns the session and the variables it held, or
        None when it was not open."""
        check_name(name)
        task = self._starting.get(name)
        if task is not None:
            with contextlib.suppress(CallRefused):
                await asyncio.shield(task)
        session = self._open.pop(name, None)
        if session is None:
            return None
        if session.idle_timer is not None:
            session.idle_timer.cancel()
        held = list(session.worker.vars)
        await asyncio.shield(session.engine.shutdown())
        log.info("session %s reset", name)
        return session, held

    def describe(self) -> list[dict[str, Any]]:
        return [self._open[name].describe() for name in self.names]

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
        tasks = [asyncio.ensure_future(s.engine.shutdown()) for s in sessions] + list(self._closing)
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


# -- results ------------------------------------------------------------------------------------

def result_text(result: BlockResult, session: str, notes: list[str] = ()) -> str:
    """A block's result as the client's model reads it: the output (head and tail, the cut
    counted), the traceback, any notes, then one line with the status, the duration and what
    happened."""
    body = result.output + result.error
    if body and not body.endswith("\n"):
        body += "\n"
    line = f"status: {result.status}, {format_duration(result.duration_s)}, session {session}"
    if result.message:
        line += f"; {result.message}"
    return body + "".join(f"[note: {note}]\n" for note in notes) + f"[{line}]"


def result_data(result: BlockResult, session: str) -> dict[str, Any]:
    """The same result as structured content."""
    return {"status": result.status, "session": session, "output": result.output, "error": result.error,
            "message": result.message, "duration_s": round(result.duration_s, 4),
            "output_bytes": result.output_bytes, "truncated": result.truncated,
            "output_file": result.output_file, "lost_vars": list(result.lost_vars),
            "exit_code": result.exit_code}


class Progress:
    """Streams one block's output as progress notifications while it runs.

    ``send(progress, message)`` is called with the count of output bytes so far and the text
    that is new since the last call (its last ``PROGRESS_TEXT`` characters, with a note of what
    was skipped), at most once every ``PROGRESS_INTERVAL`` seconds; a send that fails stops
    the stream, never the block.
    """

    def __init__(self, send: Callable[[float, str], Awaitable[None]]) -> None:
        self._send = send
        self._fresh: list[str] = []
        self._fresh_chars = 0
        self._skipped = 0
        self._total = 0
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._broken = False

    def add(self, chunk: OutputChunk) -> None:
        if self._broken:
            return
        self._total += len(chunk.data)
        text = self._decoders.get(chunk.stream, self._decoders["stdout"]).decode(chunk.data)
        self._fresh.append(text)
        self._fresh_chars += len(text)
        while self._fresh_chars > 2 * PROGRESS_TEXT and len(self._fresh) > 1:
            dropped = self._fresh.pop(0)
            self._fresh_chars -= len(dropped)
            self._skipped += len(dropped)
        self._ready.set()
        if self._task is None:
            self._task = asyncio.ensure_future(self._pump())

    def _take(self) -> str:
        text = "".join(self._fresh)
        skipped = self._skipped + max(0, len(text) - PROGRESS_TEXT)
        text = text[-PROGRESS_TEXT:]
        self._fresh, self._fresh_chars, self._skipped = [], 0, 0
        return (f"[... {skipped} characters skipped ...]\n" if skipped else "") + text

    async def _pump(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            text = self._take()
            if not text:
                continue
            try:
                await self._send(float(self._total), text)
            except Exception as exc:  # noqa: BLE001 - a client that stopped listening costs it the stream only
                log.info("progress notifications stopped: %s", exc)
                self._broken = True
                return
            await asyncio.sleep(PROGRESS_INTERVAL)

    async def close(self) -> None:
        """Stop streaming, so that no notification follows the result (which carries it all)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])


# -- the MCP server ----------------------------------------------------------------------------

def _text(text: str, *, error: bool = False, data: dict | None = None) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=error,
                                structured_content=data)


def tool_definitions(config: ServerConfig) -> list[types.Tool]:
    """The three tools, described for the client's model."""
    where = f"{config.workspace}/SESSION"
    network = "with the host's network" if config.settings.sandbox.network else "without network"
    return [
        types.Tool(
            name="run_python",
            description=(
                "Run Python code in a persistent, sandboxed session: variables, imports and functions stay "
                "for the next call in the same session (started on first use). Returns what the code printed "
                "(head and tail when long, the cut counted), the traceback of an error, and a last line "
                "with the status (ok, error, timeout, killed, died), the duration and what happened. At the "
                "timeout the code is stopped, killed if need be; a kill resets the session's namespace and "
                f"the result names the variables lost. The code runs {network}; it may write files only under "
                f"{where} (readable afterwards as resources agentloop://SESSION/PATH) and /tmp. Print what "
                "you want to see."),
            input_schema={
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "Python source to run, as in a notebook cell; "
                                                              "top-level await works."},
                    "session": {"type": "string", "default": DEFAULT_SESSION,
                                "description": "Session name (letters, digits, _ - .): each is a namespace "
                                               "and a sandbox of its own."},
                    "timeout": {"type": "string", "default": DEFAULT_TIMEOUT,
                                "description": "Deadline: 250ms, 30s, 5m, 1h or plain seconds."},
                },
                "required": ["code"],
            },
            annotations=types.ToolAnnotations(title="Run Python", read_only_hint=False, destructive_hint=False,
                                              open_world_hint=config.settings.sandbox.network),
        ),
        types.Tool(
            name="reset_session",
            description=("End a session: its process is killed and its variables are gone; its files stay. "
                         "The next run_python naming it starts afresh."),
            input_schema={"type": "object", "properties": {"session": {"type": "string",
                                                                       "default": DEFAULT_SESSION}}},
            annotations=types.ToolAnnotations(title="Reset a session", destructive_hint=True,
                                              idempotent_hint=True, open_world_hint=False),
        ),
        types.Tool(
            name="list_sessions",
            description="The open sessions: their variables, blocks run, running calls, idle time, workspace.",
            input_schema={"type": "object", "properties": {}},
            annotations=types.ToolAnnotations(title="List sessions", read_only_hint=True, open_world_hint=False),
        ),
    ]


class AgentloopMCP:
    """The tools and resources of one server, over ``Sessions``; ``server`` is the MCP SDK's
    low-level ``Server`` that answers with them."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.sessions = Sessions(config)
        self.tools = tool_definitions(config)
        try:
            own_version = version("agentloop")
        except PackageNotFoundError:
            own_version = "0"
        self.server = Server(
            "agentloop", version=own_version, title="agentloop",
            instructions=("Runs Python in persistent, sandboxed sessions (run_python). A session keeps its "
                          "namespace between calls; its files are resources agentloop://SESSION/PATH."),
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            on_list_resources=self._list_resources, on_list_resource_templates=self._list_templates,
            on_read_resource=self._read_resource)

    # -- tools ---------------------------------------------------------------------------------
    async def _list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools)

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = dict(params.arguments or {})
        try:
            if params.name == "run_python":
                return await self.run_python(args, ctx.session.report_progress)
            if params.name == "reset_session":
                return await self.reset_session(args)
            if params.name == "list_sessions":
                return self.list_sessions()
            names = ", ".join(t.name for t in self.tools)
            return _text(f"no tool named {params.name!r}; the tools are {names}", error=True)
        except CallRefused as exc:
            return _text(str(exc), error=True)
        except Exception as exc:  # noqa: BLE001 - the edge: a bug of ours is a tool error, not a dead client
            log.exception("tool %s failed", params.name)
            return _text(f"agentloop failed to run {params.name}: {type(exc).__name__}: {exc}", error=True)

    async def run_python(self, args: dict, report: Callable[..., Awaitable[None]] | None = None
                         ) -> types.CallToolResult:
        """Run ``args['code']`` in session ``args['session']``; progress goes to ``report``."""
        code = args.get("code")
        if not isinstance(code, str):
            raise CallRefused("run_python needs `code`, the Python source to run, as a string")
        name = args.get("session", DEFAULT_SESSION) or DEFAULT_SESSION
        try:
            timeout = parse_duration(args.get("timeout") or DEFAULT_TIMEOUT)
        except AgentloopError as exc:
            raise CallRefused(f"timeout: {exc}") from exc
        async with self.sessions.use(name) as (session, started):
            progress = Progress(lambda total, text: report(total, None, text)) if report is not None else None
            notes = [f"session {name!r} started; its files go in {session.workspace}"] if started else []
            try:
                result = await session.worker.run(code, timeout=timeout, budget=OUTPUT_BUDGET,
                                                  on_output=progress.add if progress else None)
            except AgentloopError as exc:  # the worker could not be started again, or was closed
                raise CallRefused(f"session {name!r}: {exc}") from exc
            finally:
                if progress is not None:
                    await progress.close()
            session.blocks += 1
        if result.refused_write():
            notes.append(writable_note(session.workspace))
        return _text(result_text(result, name, notes), error=result.status != "ok",
                     data=result_data(result, name))

    async def reset_session(self, args: dict) -> types.CallToolResult:
        name = args.get("session", DEFAULT_SESSION) or DEFAULT_SESSION
        ended = await self.sessions.reset(name)
        if ended is None:
            open_ = ", ".join(self.sessions.names) or "none"
            return _text(f"session {name!r} was not open (open: {open_}); nothing to reset")
        session, lost = ended
        gone = f" (variables lost: {', '.join(lost)})" if lost else ""
        return _text(f"session {name!r} was reset: its process was stopped{gone}; its files stay in "
                     f"{session.workspace}. The next run_python naming it starts afresh.")

    def list_sessions(self) -> types.CallToolResult:
        sessions = self.sessions.describe()
        if not sessions:
            text = "no session is open; run_python starts one"
        else:
            text = "\n".join(
                f"{s['session']}: {s['blocks_run']} blocks run, {s['running']} running, idle "
                f"{format_duration(s['idle_s'])}, variables: {', '.join(s['variables']) or 'none'}; "
                f"files in {s['workspace']}" for s in sessions)
        text += (f"\n(at most {self.config.max_sessions} sessions; idle ones close after "
                 f"{format_duration(self.config.idle_timeout)})")
        return _text(text, data={"sessions": sessions, "max_sessions": self.config.max_sessions,
                                 "idle_timeout_s": self.config.idle_timeout})

    # -- resources -----------------------------------------------------------------------------
    async def _list_resources(self, ctx: Any, params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=await asyncio.to_thread(self.resources))

    def resources(self) -> list[types.Resource]:
        """The files of every session this server started, open or closed since."""
        out: list[types.Resource] = []
        for name in self.sessions.seen():
            for relative, size in list_files(self.sessions.workspace_of(name), MAX_LISTED_FILES - len(out)):
                out.append(types.Resource(uri=resource_uri(name, relative), name=f"{name}/{relative}",
                                          mime_type=mime_type(relative), size=size,
                                          description=f"a file of session {name}'s workspace"))
        return out

    async def _list_templates(self, ctx: Any, params: Any) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
            uri_template=f"{SCHEME}://{{session}}/{{+path}}", name="session file",
            description="A file in a session's workspace (PATH relative to it).")])

    async def _read_resource(self, ctx: Any, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        try:
            name, relative = parse_uri(uri)
            root = self.sessions.workspace_of(name)
            data = await asyncio.to_thread(read_file, root, relative)
        except (ValueError, CallRefused, OSError) as exc:
            raise MCPError(types.INVALID_PARAMS, f"cannot read {uri}: {_reason(exc)}") from exc
        mime = mime_type(relative)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            blob = base64.b64encode(data).decode("ascii")
            return types.ReadResourceResult(contents=[types.BlobResourceContents(uri=uri, mime_type=mime,
                                                                                 blob=blob)])
        if mime == "application/octet-stream":
            mime = "text/plain"
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, mime_type=mime, text=text)])


def _reason(exc: BaseException) -> str:
    """Why a resource cannot be read, in words (no errno numbers)."""
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "it is a link, and links in a workspace are not followed"
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return "no such file"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc)
