"""How ``agentloop mcp`` is reached: stdio (read without a thread, so a signal ends it; one
client) or the streamable HTTP transport (each MCP session a client of its own, behind the
gate of ``http_gate``: the owner's token, then the DNS-rebinding checks); both close every
session before the process exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Awaitable, Callable

try:
    from mcp.server.stdio import stdio_server
    from mcp.server.transport_security import TransportSecuritySettings
except ImportError as exc:  # the optional extra: say how to get it
    from engine.extras import install_hint

    raise ImportError(f"the MCP server needs the MCP SDK ({exc}): {install_hint('mcp')}") from exc

from engine.integrations.http_gate import ServerToken, TokenGate, listen, server_keeping_signals
from engine.integrations.mcp import AgentloopMCP
from engine.integrations.mcp_sessions import CLOSE_TIMEOUT, ServerConfig

__all__ = ["MAX_MCP_SESSIONS", "MAX_MESSAGE", "run", "serve_http", "serve_stdio"]

log = logging.getLogger("agentloop")

#: MCP sessions (clients) the HTTP transport holds at once; one more is answered 503.
MAX_MCP_SESSIONS = 256


class _StdinLines:
    """Lines of the process's stdin, read by the event loop (no thread): cancelling a read,
    as SIGTERM does, never waits for the client to write."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> _StdinLines:
        return self

    async def __anext__(self) -> str:
        line = await self._reader.readline()
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", "replace")


#: The longest message a client may send (a line of JSON): code is rarely longer than this.
MAX_MESSAGE = 64 * 1024 * 1024


async def _stdin_lines() -> _StdinLines | None:
    """The client's messages from fd 0, read through a private duplicate; fd 0 itself then
    reads from the null device, so nothing else in the process can take the client's bytes.
    None when stdin is a regular file (``agentloop mcp < requests.jsonl``): the SDK's own
    reader takes it, and its end comes by itself."""
    if stat.S_ISREG(os.fstat(0).st_mode):
        return None
    loop = asyncio.get_running_loop()
    wire = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    reader = asyncio.StreamReader(limit=MAX_MESSAGE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(wire, "rb", buffering=0))
    return _StdinLines(reader)


async def _until_closed(mcp: AgentloopMCP, serve: Awaitable[None], how: str) -> None:
    """Serve until the transport ends (or this task is cancelled: SIGTERM, Ctrl-C), then close
    every session, whatever else is cancelled meanwhile."""
    reason = f"the client closed {how}"
    try:
        await serve
    except asyncio.CancelledError:
        reason = "stopped by a signal"
        raise
    finally:
        closing = asyncio.ensure_future(mcp.sessions.close_all())
        while not closing.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(closing)
        closed = closing.result()
        log.info("mcp server stopped (%s); %d session%s closed", reason, closed, "" if closed == 1 else "s")


async def serve_stdio(config: ServerConfig) -> None:
    """Serve MCP on stdin and stdout until the client closes them or the task is cancelled."""
    mcp = AgentloopMCP(config)

    async def serve() -> None:
        stdin = await _stdin_lines()
        async with stdio_server(stdin=stdin) as (read_stream, write_stream):  # type: ignore[arg-type]
            await mcp.server.run(read_stream, write_stream, mcp.server.create_initialization_options())

    await _until_closed(mcp, serve(), "the connection")


async def serve_http(config: ServerConfig, host: str, port: int, announce: Callable[[str], None],
                     allowed_hosts: tuple[str, ...] = (), token: ServerToken | None = None) -> None:
    """Serve MCP over streamable HTTP at ``http://HOST:PORT/TOKEN/mcp`` until the task is
    cancelled or uvicorn stops (SIGTERM, Ctrl-C).  Every request must carry ``token`` (default:
    the one of agentloop's token file), in its path as here or as ``Authorization: Bearer``.
    ``announce`` gets that URL once it is listening (port 0 picks a free port).
    ``allowed_hosts``: names a request's Host and Origin may carry besides addresses and
    ``localhost``.  An MCP session the client leaves without a request for ``idle_timeout``
    expires, as its idle sessions do."""
    import uvicorn

    token = token or ServerToken.load()
    mcp = AgentloopMCP(config, per_session=True)
    # The SDK logs each MCP session id at INFO (-v): an id is its client's only credential.
    logging.getLogger("mcp").setLevel(max(logging.WARNING, logging.getLogger("mcp").getEffectiveLevel()))
    app = mcp.server.streamable_http_app(
        host=host, session_idle_timeout=max(config.idle_timeout, 1.0), max_sessions=MAX_MCP_SESSIONS,
        # The gate checks Host and Origin on every address, the SDK only on three loopback names.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    gated = TokenGate(app, token=token, allowed_names=allowed_hosts, on_end=mcp.end_mcp_session)
    sock = listen(host, port)
    family_v6 = sock.family == socket.AF_INET6
    bound = sock.getsockname()[1]

    # No access log: a request's path holds the token.  Signals stay ours: they cancel the
    # serving task, which stops uvicorn below.
    server = server_keeping_signals(uvicorn.Config(gated, log_level="warning", lifespan="on", access_log=False))

    async def serve() -> None:
        started = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not started.done():
            await asyncio.sleep(0.01)  # uvicorn offers no event for it
        shown = f"[{host}]" if family_v6 else host
        if server.started:
            announce(f"http://{shown}:{bound}/{token.value}/mcp")
        try:
            await asyncio.shield(started)
        except asyncio.CancelledError:
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(started), CLOSE_TIMEOUT)
            raise
        finally:
            sock.close()

    await _until_closed(mcp, serve(), "the listening socket")


def run(config: ServerConfig, http: tuple[str, int] | None = None,
        announce: Callable[[str], None] = lambda url: None, allowed_hosts: tuple[str, ...] = (),
        token: ServerToken | None = None) -> None:
    """Run the server in this process until the client closes stdin (stdio) or a signal
    (SIGTERM, SIGINT) stops it; returns once every session is closed."""
    coro = serve_stdio(config) if http is None else serve_http(config, *http, announce, allowed_hosts, token)
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner() as runner:
        runner.run(_cancel_on_sigterm(coro))


async def _cancel_on_sigterm(coro: Awaitable[None]) -> None:
    """``coro``, cancelled on SIGTERM (and on SIGINT, by asyncio.Runner) so it cleans up."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGTERM)
