"""agentloop's workers as an MCP server: what ``agentloop mcp`` serves.

Tools: ``run_python(code, session="default", timeout="30s")`` runs one block in the session's
worker (started on first use, its namespace kept between calls), ``reset_session(session)``,
``fork_session(session, new_session)`` (a new session holding a copy of one, ``Worker.fork``:
in its sandbox, sharing its files, closed with it) and ``list_sessions()``.  Resources: the files of each session's workspace, as
``agentloop://SESSION/PATH``.

What it guarantees:

- **Sessions belong to the client that started them** (``mcp_clients``): over stdio, the one
  client; over streamable HTTP, the MCP session.  Another client neither lists, uses, reads
  (as resources or from its own sandbox) nor resets them, and ``default`` is per client.  A
  client's sessions are closed (their workers killed, their files kept) when its MCP session
  ends: at once when the client ends it, and within ``idle_timeout`` when it goes quiet (the
  transport expires the MCP session after as long without a request, and its sessions, as
  idle, close by themselves).
- **Sessions are sandboxes of their own.**  Each has an ``Engine`` of its own: its worker, its
  workspace (``WORKSPACE/SESSION`` over stdio, ``WORKSPACE/client-ID/SESSION`` over HTTP, which
  also derives its uid for a root coordinator), the sandbox and limits of the command line;
  over HTTP the workspace root is hidden from every session's view, so no session sees another
  client's directory through the current directory it is shown.  A session idle for
  ``idle_timeout`` is closed (its files stay); at most ``max_sessions`` are open on the whole
  server, and one more is refused in words.
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
  made can expose a file outside the workspace.  Only the workspaces of the client's own
  sessions are resources: a file the user put elsewhere in the workspace root is nobody's.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import errno
import logging
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError
except ImportError as exc:  # the optional extra: say how to get it
    from engine.extras import install_hint

    raise ImportError(f"the MCP server needs the MCP SDK ({exc}): {install_hint('mcp')}") from exc

from engine.agent import OUTPUT_BUDGET  # what a block's result carries, as an agent sees it
from engine.durations import format_duration, parse_duration
from engine.errors import AgentloopError, CallRefused, NoClient
from engine.integrations.mcp_clients import Client, Clients
from engine.integrations.mcp_sessions import ServerConfig, Sessions
from engine.integrations.workspace_files import (
    MAX_LISTED_FILES,
    list_files,
    mime_type,
    parse_uri,
    read_file,
    resource_uri,
)
from engine.models import MAX_IMAGES_A_MESSAGE, image_part
from engine.results import BlockResult, OutputChunk, displays_words, writable_note

__all__ = [
    "AgentloopMCP", "DEFAULT_SESSION", "DEFAULT_TIMEOUT", "PROGRESS_INTERVAL", "PROGRESS_TEXT", "Progress",
    "SCHEME", "ServerConfig", "result_data", "result_images", "result_text", "tool_definitions"
]

log = logging.getLogger("agentloop")

#: Seconds between two progress notifications of one block, at least.
PROGRESS_INTERVAL = 0.1
#: Characters of output one progress notification carries at most (the rest is counted).
PROGRESS_TEXT = 8_000
#: Connections a result's note names (``--allow-net``); the rest are counted (all are in ``network``).
_NETWORK_SHOWN = 20
DEFAULT_SESSION = "default"
DEFAULT_TIMEOUT = "30s"
SCHEME = "agentloop"


# -- results ------------------------------------------------------------------------------------

def result_text(result: BlockResult, session: str, notes: list[str] = ()) -> str:
    """A block's result as the client's model reads it: the output (head and tail, the cut
    counted), the traceback, any notes, then one line with the status, the duration and what
    happened."""
    shown = displays_words(result.displays)
    if shown and result.output and not result.output.endswith("\n"):
        shown = "\n" + shown
    body = result.output + shown + result.error
    if body and not body.endswith("\n"):
        body += "\n"
    line = f"status: {result.status}, {format_duration(result.duration_s)}, session {session}"
    if result.message:
        line += f"; {result.message}"
    return body + "".join(f"[note: {note}]\n" for note in notes) + f"[{line}]"


def _connections_note(network: list[dict]) -> str:
    """The connections a block made through its way out (``--allow-net``), in one note: each
    host and port, allowed or refused and why, the bytes each way; at most ``_NETWORK_SHOWN``
    named, the rest counted."""
    def one(c: dict) -> str:
        why = f" ({c.get('why')})" if c.get("verdict") != "allowed" and c.get("why") else ""
        flow = f", {c.get('sent', 0)} B sent, {c.get('received', 0)} B received" if c.get("verdict") == "allowed" else ""
        return f"{str(c.get('host'))[:100]}:{c.get('port')} {c.get('verdict')}{why}{flow}"
    more = len(network) - _NETWORK_SHOWN
    return "connections: " + "; ".join(one(c) for c in network[:_NETWORK_SHOWN]) + (f"; {more} more" if more > 0 else "")


def result_data(result: BlockResult, session: str, network: list[dict] | None = None) -> dict[str, Any]:
    """The same result as structured content; with an allowlist, ``network`` lists the
    connections the block made (``engine.net.ConnectionRecord``'s fields)."""
    return {**({"network": network} if network is not None else {}),"status": result.status, "session": session, "output": result.output, "error": result.error,
            "message": result.message, "duration_s": round(result.duration_s, 4),
            "output_bytes": result.output_bytes, "truncated": result.truncated,
            "output_file": result.output_file, "lost_vars": list(result.lost_vars),
            "exit_code": result.exit_code,
            "displays": [{"index": s.index, "files": dict(s.files), "text": s.text, "width": s.width,
                          "height": s.height} for s in result.displays]}


def result_images(result: BlockResult) -> list[types.ImageContent]:
    """The PNGs a block displayed, as MCP image content (its ``image/png``, base64), at most
    ``MAX_IMAGES_A_MESSAGE``; what is not attached is named in the result's text."""
    images = []
    for shown in result.displays:
        part = image_part(shown.png) if shown.png else None
        if part is not None and len(images) < MAX_IMAGES_A_MESSAGE:
            data = part["image_url"]["url"].split(",", 1)[1]
            images.append(types.ImageContent(type="image", data=data, mime_type="image/png"))
    return images


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

def _text(text: str, *, error: bool = False, data: dict | None = None,
          images: list[types.ImageContent] = ()) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text), *images], is_error=error,
                                structured_content=data)


def tool_definitions(config: ServerConfig, where: str) -> list[types.Tool]:
    """The tools, described for the client's model; ``where`` says where a session's
    files go."""
    allowed = config.settings.allow_net.texts()
    network = ("with the host's network" if config.settings.sandbox.network else
               # (--allow-net) the model is told what it may reach, and how: through the proxy the
               # environment names, so urllib, pip and requests work as they are
               f"with network to {', '.join(allowed)} only (through the HTTP proxy its environment names; "
               "anything else is refused with 403)" if allowed else "without network")
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
                                              open_world_hint=config.settings.sandbox.network or bool(allowed)),
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
            name="fork_session",
            description=("Copy a session into a new one: the new session holds everything the first holds now "
                         "(variables, imports, loaded data), copied in milliseconds, and from then on each "
                         "changes only itself. It shares the first's files and ends when the first does. Only "
                         "between calls, with no thread or subprocess of the code left running."),
            input_schema={"type": "object", "properties": {
                "session": {"type": "string", "default": DEFAULT_SESSION, "description": "the session to copy"},
                "new_session": {"type": "string", "description": "the new session's name"}},
                "required": ["new_session"]},
            annotations=types.ToolAnnotations(title="Fork a session", destructive_hint=False,
                                              open_world_hint=False),
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
    low-level ``Server`` that answers with them.  ``per_session``: each MCP session is a client
    of its own (streamable HTTP); else the server has one client (stdio)."""

    def __init__(self, config: ServerConfig, *, per_session: bool = False) -> None:
        self.config = config
        self.sessions = Sessions(config)
        self.clients = Clients(config.workspace, per_session=per_session)
        where = f"{config.workspace}/client-ID/SESSION (a directory of this client's own)" if per_session \
            else f"{config.workspace}/SESSION"
        self.tools = tool_definitions(config, where)
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
        if per_session:
            # Sessions belong to MCP sessions, which the stateless protocol has none of: a client
            # that probes for it (the SDK's Client in its default mode) is told to use the handshake.
            self.server.add_request_handler("server/discover", types.RequestParams, self._no_discover)

    async def _no_discover(self, ctx: Any, params: Any) -> types.DiscoverResult:
        raise MCPError(types.METHOD_NOT_FOUND, "this server keeps sessions per MCP session: connect with the "
                                               "initialize handshake")

    def end_mcp_session(self, session_id: str) -> None:
        """The client of MCP session ``session_id`` ended it: its sessions close now."""
        client = self.clients.for_session_id(session_id)
        closed = self.sessions.end_client(client)
        if closed:
            log.info("%d session%s of an MCP client closed: it ended its MCP session (%s)", closed,
                     "" if closed == 1 else "s", client.id)

    # -- tools ---------------------------------------------------------------------------------
    async def _list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools)

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = dict(params.arguments or {})
        try:
            client = self.clients.of(ctx)
            if params.name == "run_python":
                return await self.run_python(client, args, ctx.session.report_progress)
            if params.name == "reset_session":
                return await self.reset_session(client, args)
            if params.name == "fork_session":
                return await self.fork_session(client, args)
            if params.name == "list_sessions":
                return self.list_sessions(client)
            names = ", ".join(t.name for t in self.tools)
            return _text(f"no tool named {params.name!r}; the tools are {names}", error=True)
        except (CallRefused, NoClient) as exc:
            return _text(str(exc), error=True)
        except Exception as exc:  # noqa: BLE001 - the edge: a bug of ours is a tool error, not a dead client
            log.exception("tool %s failed", params.name)
            return _text(f"agentloop failed to run {params.name}: {type(exc).__name__}: {exc}", error=True)

    async def run_python(self, client: Client, args: dict, report: Callable[..., Awaitable[None]] | None = None
                         ) -> types.CallToolResult:
        """Run ``args['code']`` in ``client``'s session ``args['session']``; progress goes to
        ``report``."""
        code = args.get("code")
        if not isinstance(code, str):
            raise CallRefused("run_python needs `code`, the Python source to run, as a string")
        name = args.get("session", DEFAULT_SESSION) or DEFAULT_SESSION
        try:
            timeout = parse_duration(args.get("timeout") or DEFAULT_TIMEOUT)
        except AgentloopError as exc:
            raise CallRefused(f"timeout: {exc}") from exc
        async with self.sessions.use(client, name) as (session, started):
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
            # (--allow-net) what the block reached, from the gate outside its sandbox: ended since
            # the session's last block (one still open is told with a later one)
            network = await session.worker.connections() if self.config.settings.allow_net else None
        if result.refused_write():
            notes.append(writable_note(session.workspace))
        if network:
            notes.append(_connections_note(network))
        return _text(result_text(result, name, notes), error=result.status != "ok",
                     data=result_data(result, name, network), images=result_images(result))

    async def reset_session(self, client: Client, args: dict) -> types.CallToolResult:
        name = args.get("session", DEFAULT_SESSION) or DEFAULT_SESSION
        ended = await self.sessions.reset(client, name)
        if ended is None:
            open_ = ", ".join(self.sessions.names(client)) or "none"
            return _text(f"session {name!r} was not open (open: {open_}); nothing to reset")
        session, lost = ended
        gone = f" (variables lost: {', '.join(lost)})" if lost else ""
        return _text(f"session {name!r} was reset: its process was stopped{gone}; its files stay in "
                     f"{session.workspace}. The next run_python naming it starts afresh.")

    async def fork_session(self, client: Client, args: dict) -> types.CallToolResult:
        source = args.get("session", DEFAULT_SESSION) or DEFAULT_SESSION
        name = args.get("new_session")
        if not isinstance(name, str):
            raise CallRefused("fork_session needs `new_session`, the new session's name, as a string")
        session = await self.sessions.fork(client, source, name)
        held = ", ".join(session.worker.vars) or "none"
        return _text(f"session {name!r} is a fork of {source!r}: it holds what {source!r} held (variables: {held}) "
                     f"and shares its files in {session.workspace}; it ends when {source!r} does.",
                     data=session.describe())

    def list_sessions(self, client: Client) -> types.CallToolResult:
        sessions = self.sessions.describe(client)
        if not sessions:
            text = "no session is open; run_python starts one"
        else:
            text = "\n".join(
                f"{s['session']}: {s['blocks_run']} blocks run, {s['running']} running, idle "
                f"{format_duration(s['idle_s'])}, variables: {', '.join(s['variables']) or 'none'}; "
                f"files in {s['workspace']}" for s in sessions)
        text += (f"\n(at most {self.config.max_sessions} sessions open on this server; idle ones close after "
                 f"{format_duration(self.config.idle_timeout)})")
        return _text(text, data={"sessions": sessions, "max_sessions": self.config.max_sessions,
                                 "idle_timeout_s": self.config.idle_timeout})

    # -- resources -----------------------------------------------------------------------------
    def _client(self, ctx: Any) -> Client:
        """The client of a resource request; a request error when it has none."""
        try:
            return self.clients.of(ctx)
        except NoClient as exc:
            raise MCPError(types.INVALID_REQUEST, str(exc)) from exc

    async def _list_resources(self, ctx: Any, params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=await asyncio.to_thread(self.resources, self._client(ctx)))

    def resources(self, client: Client) -> list[types.Resource]:
        """The files of every session ``client`` started, open or closed since."""
        out: list[types.Resource] = []
        for name in self.sessions.owned(client):
            for relative, size in list_files(self.sessions.workspace_of(client, name), MAX_LISTED_FILES - len(out)):
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
        client = self._client(ctx)
        try:
            name, relative = parse_uri(uri)
            root = self.sessions.workspace_of(client, name)
            if name not in await asyncio.to_thread(self.sessions.owned, client):
                raise CallRefused(f"no session {name!r} of yours has files")
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
