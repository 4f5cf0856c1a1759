"""What ``agentloop mcp --http`` lets through before the MCP SDK sees a request.

**DNS rebinding.**  A web page on the attacker's domain, its name rebound to this server's
address, sends requests whose ``Host`` names that domain; a page of another site sends its
``Origin``.  On every address the server binds — loopback (all of 127.0.0.0/8, ``::1``), the
wildcard (``0.0.0.0``, ``::``), a LAN address — a request passes only when its ``Host`` is an
IP address (a rebinding page can only name its domain), ``localhost``, or a name given with
``--allow-host``; and its ``Origin``, when it has one, is ``http``/``https`` on ``localhost``, a
loopback address, the host the request names, or an allowed name.  Any other request is
answered 421 (Host) or 403 (Origin) and never reaches the SDK.

**The owner's token.**  Loopback is shared by every account of the machine, so an address alone
lets anyone in: every request must carry the server's secret token, as the first segment of its
path (``http://127.0.0.1:PORT/TOKEN/mcp``, stripped before the app sees the path) or as
``Authorization: Bearer TOKEN``.  A request without it is answered 401, one with another 403,
compared in constant time, before anything else of the server runs.  The token is random
(``secrets``), kept in a file only its owner may read (``ServerToken``: by default
``STATE/agentloop/server-token``, made on first use and kept, so client configurations keep
working; ``--token-file`` names a fixed one), and never put on a command line, which every
local user can read in ``/proc/PID/cmdline``.  ``listen`` binds the socket and says, for an
address beyond loopback, that the token then crosses the network as plain HTTP.

Every server agentloop runs over TCP (``agentloop mcp --http``, ``agentloop serve``) answers
through ``TokenGate``; it needs Starlette, not the MCP SDK.

**The end of an MCP session.**  A ``DELETE`` that the SDK accepted ends the MCP session its
``Mcp-Session-Id`` names: ``on_end`` is told its id, so that the session's client's workers stop
at once instead of at their idle timeout.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import ConfigError
from engine.trust import state_dir

__all__ = ["SESSION_ID_HEADER", "ServerToken", "TOKEN_FILE", "TokenGate", "exposure_warning", "host_allowed",
           "server_keeping_signals",
           "is_loopback", "listen", "origin_allowed", "parse_address"]

#: The header by which MCP's streamable HTTP names the MCP session of a request.
SESSION_ID_HEADER = "mcp-session-id"
#: The default token file's name, in agentloop's state directory.
TOKEN_FILE = "server-token"
#: The characters a token may hold (it travels in a URL's path) and its shortest length.
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~")
_TOKEN_MIN = 32


@dataclass(frozen=True)
class ServerToken:
    """The secret a TCP server's every request must carry, and the file it is kept in."""

    value: str
    path: Path

    def __repr__(self) -> str:  # never the value
        return f"ServerToken(path={str(self.path)!r})"

    @classmethod
    def load(cls, path: Path | None = None) -> ServerToken:
        """The token of ``path`` (``--token-file``), or of the default file, made on first use
        (mode 0600, in agentloop's private state directory).  ConfigError, in one line saying
        what to do, for a file that is not this user's alone or holds no usable token."""
        if path is None:
            path = state_dir() / TOKEN_FILE
            token = secrets.token_urlsafe(32)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                pass
            except OSError as exc:
                raise ConfigError(f"cannot make the token file {path}: {exc.strerror or exc}") from None
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(token + "\n")
        return cls(_read_token(path), path)

    def carried_by(self, scope: Scope, headers: Headers) -> tuple[bool, str | None]:
        """(whether the request carries some credential, the path to pass on when it carries
        this token; None when it does not)."""
        path = scope.get("path", "")
        first, _, rest = path.removeprefix("/").partition("/")
        if _same(first, self.value):
            return True, "/" + rest
        given = headers.getlist("authorization")
        if not given:
            return False, None
        kind, _, value = given[0].strip().partition(" ")
        return True, path if len(given) == 1 and kind.lower() == "bearer" and _same(value.strip(), self.value) else None


def _same(given: str, token: str) -> bool:
    """Constant-time equality (in the token's length) of whatever was sent and the token."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode("ascii"))


def _read_token(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"the token file {path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"the token file {path} must be yours and no one else's (it is uid {st.st_uid}'s, "
                              f"mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 it, or use another")
        text = f.read(4096).decode("ascii", "replace").strip()
    if len(text) < _TOKEN_MIN or not set(text) <= _TOKEN_CHARS:
        raise ConfigError(f"the token file {path} must hold one token of at least {_TOKEN_MIN} characters among "
                          "A-Z a-z 0-9 - _ . ~ (it goes in a URL), e.g. made with: "
                          "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return text


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (all of 127.0.0.0/8 and ::1) or localhost."""
    if host == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def exposure_warning(host: str, port: int) -> str | None:
    """The warning for an address beyond loopback: the token crosses the network in clear."""
    if is_loopback(host):
        return None
    return (f"{host}:{port} is reachable beyond this machine and the server speaks plain HTTP: whoever sees "
            "the traffic sees the token, and with it can run code in the sandbox; keep to 127.0.0.1, or put "
            "TLS in front")


def server_keeping_signals(config: Any) -> Any:
    """A ``uvicorn.Server`` for ``config`` (a ``uvicorn.Config``) that installs no signal
    handlers: the command serving it owns SIGINT and SIGTERM and stops the server itself."""
    import uvicorn

    class _KeepingSignals(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return _KeepingSignals(config)


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT (``[::1]:8000`` for IPv6) as (host, port); ValueError with words otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:8000, got {text!r}")
    return host, int(port)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); ConfigError in words."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


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


class TokenGate:
    """ASGI middleware in front of a server's app: the owner's token and the DNS-rebinding
    checks (see the module docstring) for every HTTP request, and ``on_end(session_id)`` after
    an accepted DELETE.  Anything but HTTP (a WebSocket) is refused."""

    def __init__(self, app: ASGIApp, *, token: ServerToken, allowed_names: Iterable[str] = (),
                 on_end: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.token = token
        self.names = frozenset(name.lower() for name in allowed_names)
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the SDK's session manager starts and stops there
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        headers = Headers(scope=scope)
        carried, path = self.token.carried_by(scope, headers)
        if path is None:
            words, status = ("this server answers only requests that carry its token (in the URL's path, or as "
                             "Authorization: Bearer)", 401) if not carried else ("wrong token", 403)
            await Response(words, status_code=status)(scope, receive, send)
            return
        if path != scope.get("path"):  # the token was the path's first segment: the app never sees it
            raw, prefix = scope.get("raw_path") or b"", b"/" + self.token.value.encode("ascii")
            raw = raw[len(prefix):] or b"/" if raw.startswith(prefix) else path.encode("utf-8", "surrogateescape")
            scope = {**scope, "path": path, "raw_path": raw}
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
