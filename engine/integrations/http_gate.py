"""What ``agentloop mcp --http`` lets through before the MCP SDK sees a request.

**DNS rebinding.**  A web page on the attacker's domain, its name rebound to this server's
address, sends requests whose ``Host`` names that domain; a page of another site sends its
``Origin``.  On every address the server binds — loopback (all of 127.0.0.0/8, ``::1``), the
wildcard (``0.0.0.0``, ``::``), a LAN address — a request passes only when its ``Host`` is an
IP address (a rebinding page can only name its domain), ``localhost``, or a name given with
``--allow-host``; and its ``Origin``, when it has one, is ``http``/``https`` on ``localhost``, a
loopback address, the host the request names, or an allowed name.  Any other request is
answered 421 (Host) or 403 (Origin) and never reaches the SDK.

**The end of an MCP session.**  A ``DELETE`` that the SDK accepted ends the MCP session its
``Mcp-Session-Id`` names: ``on_end`` is told its id, so that the session's client's workers stop
at once instead of at their idle timeout.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.integrations.mcp_clients import SESSION_ID_HEADER

__all__ = ["Gate", "host_allowed", "origin_allowed"]


def _host_of(authority: str) -> str | None:
    """The host of ``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT``, lower-cased; None when it
    is none of these."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        end = authority.find("]")
        host, rest = (authority[1:end], authority[end + 1:]) if end > 0 else ("", "")
        if not host or ":" not in host or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
        return host if _ip(host) is not None else None
    host, sep, port = authority.partition(":")
    if not host or (sep and not port.isdigit()):
        return None
    return host


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_allowed(host_header: str | None, names: Iterable[str] = ()) -> bool:
    """Whether a request whose ``Host`` is ``host_header`` may reach the server."""
    host = _host_of(host_header or "")
    return host is not None and (host == "localhost" or _ip(host) is not None or host in names)


def origin_allowed(origin: str | None, host_header: str | None, names: Iterable[str] = ()) -> bool:
    """Whether a request from ``origin`` (None: not from a web page) may reach the server."""
    if origin is None:
        return True
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or parts.path or parts.query or "@" in parts.netloc:
        return False
    host = _host_of(parts.netloc)
    if host is None:
        return False
    ip = _ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback) or host == _host_of(host_header or "") \
        or host in names


class Gate:
    """ASGI middleware in front of the SDK's app: the DNS-rebinding checks (see the module
    docstring) for every HTTP request, and ``on_end(session_id)`` after an accepted DELETE."""

    def __init__(self, app: ASGIApp, *, allowed_names: Iterable[str] = (),
                 on_end: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.names = frozenset(name.lower() for name in allowed_names)
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: the SDK's session manager starts and stops there
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        hosts = headers.getlist("host")
        if len(hosts) != 1 or not host_allowed(hosts[0], self.names):
            await Response("Invalid Host header", status_code=421)(scope, receive, send)
            return
        origins = headers.getlist("origin")
        if len(origins) > 1 or not origin_allowed(origins[0] if origins else None, hosts[0], self.names):
            await Response("Invalid Origin header", status_code=403)(scope, receive, send)
            return
        session_id = headers.get(SESSION_ID_HEADER)
        if scope.get("method") != "DELETE" or self.on_end is None or not session_id:
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, watch)
        if status and 200 <= status[0] < 300:
            self.on_end(session_id)
