"""``agentloop mcp``: agentloop's workers as an MCP server (``engine.integrations.mcp``).

The MCP SDK is an optional extra: without it the command says which one to install, and the
rest of the command line keeps working.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from engine.cli.options import Duration, fail, served_options, worker_options, worker_settings
from engine.errors import AgentloopError

__all__ = ["mcp"]


@click.command("mcp")
@click.option("--http", "http", metavar="HOST:PORT", default=None,
              help="Serve the streamable HTTP transport instead of stdio, at http://HOST:PORT/TOKEN/mcp "
                   "(port 0 picks a free one; the URL is printed on stderr).  Only requests that carry the "
                   "server's token get in, in the URL's path as printed or as 'Authorization: Bearer TOKEN'; "
                   "it is kept in ~/.local/state/agentloop/server-token (made on first use, mode 0600).")
@served_options("With --http: ")
@click.option("--idle-timeout", type=Duration(), default="30m", show_default=True,
              help="Close a session (its worker; its files stay) after this long without a call; "
                   "over HTTP an MCP session that long without a request ends too.")
@click.option("--max-sessions", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Sessions open at once on the server, all clients together; run_python naming "
                   "one more is refused in words.")
@worker_options
def mcp(http: str | None, token_file: Path | None, allowed_hosts: tuple[str, ...], idle_timeout: float,
        max_sessions: int) -> None:
    """Serve agentloop's sandboxed workers to an MCP client (stdio by default).

    Tools: run_python(code, session="default", timeout="30s") runs code in the session's
    persistent worker (output streamed as progress notifications); reset_session(session);
    list_sessions().  Each session is a sandbox of its own whose files, in WORKSPACE/SESSION
    (default ./files/SESSION), are readable as resources agentloop://SESSION/PATH.  Over --http
    each MCP session is a client of its own: its sessions (default included) are its alone,
    in WORKSPACE/client-ID/SESSION, and close when it ends its MCP session.  Loopback is shared
    by every account of the machine, so over --http a request without the server's token is
    answered 401 (403 with another token) before anything runs.  The sandbox and limit
    options, --python and --preload apply to every session.  The server stops, killing every
    worker, when the client closes the connection or on SIGTERM."""
    try:
        from engine.integrations import http_gate
        from engine.integrations import mcp as server
        from engine.integrations import mcp_transports as transports
    except ImportError as exc:  # its message names the extra to install
        fail(str(exc))
    address = token = None
    if http is not None:
        try:
            address = http_gate.parse_address(http)
        except ValueError as exc:
            fail(f"--http: {exc}")
        try:
            token = http_gate.ServerToken.load(token_file)
        except (AgentloopError, OSError) as exc:
            fail(f"--http: {exc}")
        if (warning := http_gate.exposure_warning(*address)) is not None:
            click.echo(f"agentloop: warning: {warning}", err=True)
    elif allowed_hosts or token_file is not None:
        fail(f"{'--allow-host' if allowed_hosts else '--token-file'} applies to --http only")
    options = worker_settings()
    config = server.ServerConfig(
        workspace=(options.workspace or Path("files")).resolve(), settings=options.settings(),
        cwd=Path(os.getcwd()).resolve(), idle_timeout=idle_timeout, max_sessions=max_sessions)

    def announce(url: str) -> None:
        assert token is not None
        click.echo(f"agentloop: serving MCP at {url} only to requests that carry its token (in the URL's path "
                   f"as here, or as 'Authorization: Bearer TOKEN'), kept in {token.path}", err=True)

    try:
        transports.run(config, address, announce, tuple(allowed_hosts), token)
    except AgentloopError as exc:
        fail(str(exc))
