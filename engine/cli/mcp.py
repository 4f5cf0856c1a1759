"""``agentloop mcp``: agentloop's workers as an MCP server (``engine.integrations.mcp``).

The MCP SDK is an optional extra: without it the command says which one to install, and the
rest of the command line keeps working.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import click

from engine.cli.options import Duration, fail, worker_options, worker_settings
from engine.errors import AgentloopError

__all__ = ["mcp"]


@click.command("mcp")
@click.option("--http", "http", metavar="HOST:PORT", default=None,
              help="Serve the streamable HTTP transport at http://HOST:PORT/mcp instead of stdio "
                   "(port 0 picks a free one; the URL is printed on stderr).")
@click.option("--allow-host", "allowed_hosts", metavar="NAME", multiple=True,
              help="With --http: a host name clients may use to reach the server (repeatable).  "
                   "Requests name an IP address or localhost otherwise; any other Host or Origin "
                   "is refused, so no web page can reach the server by DNS rebinding.")
@click.option("--idle-timeout", type=Duration(), default="30m", show_default=True,
              help="Close a session (its worker; its files stay) after this long without a call; "
                   "over HTTP an MCP session that long without a request ends too.")
@click.option("--max-sessions", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Sessions open at once on the server, all clients together; run_python naming "
                   "one more is refused in words.")
@worker_options
def mcp(http: str | None, allowed_hosts: tuple[str, ...], idle_timeout: float, max_sessions: int) -> None:
    """Serve agentloop's sandboxed workers to an MCP client (stdio by default).

    Tools: run_python(code, session="default", timeout="30s") runs code in the session's
    persistent worker (output streamed as progress notifications); reset_session(session);
    list_sessions().  Each session is a sandbox of its own whose files, in WORKSPACE/SESSION
    (default ./files/SESSION), are readable as resources agentloop://SESSION/PATH.  Over --http
    each MCP session is a client of its own: its sessions (default included) are its alone,
    in WORKSPACE/client-ID/SESSION, and close when it ends its MCP session.  The sandbox and
    limit options, --python and --preload apply to every session.  The server stops, killing
    every worker, when the client closes the connection or on SIGTERM."""
    try:
        from engine.integrations import mcp as server
        from engine.integrations import mcp_transports as transports
    except ImportError as exc:  # its message names the extra to install
        fail(str(exc))
    address = None
    if http is not None:
        try:
            address = transports.parse_address(http)
        except ValueError as exc:
            fail(f"--http: {exc}")
        if not _loopback(address[0]):
            click.echo(f"agentloop: warning: anyone who reaches {http} can run code in the sandbox "
                       "(the MCP transport carries no authentication here)", err=True)
    elif allowed_hosts:
        fail("--allow-host applies to --http only")
    options = worker_settings()
    config = server.ServerConfig(
        workspace=(options.workspace or Path("files")).resolve(), settings=options.settings(),
        cwd=Path(os.getcwd()).resolve(), idle_timeout=idle_timeout, max_sessions=max_sessions)

    def announce(url: str) -> None:
        click.echo(f"agentloop: serving MCP at {url}", err=True)

    try:
        transports.run(config, address, announce, tuple(allowed_hosts))
    except AgentloopError as exc:
        fail(str(exc))


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (all of 127.0.0.0/8 and ::1) or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
