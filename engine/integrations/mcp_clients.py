"""Whose sessions: the MCP client a request comes from, and where its sessions' files live.

Sessions belong to the client that started them; another client neither sees, uses, reads nor
resets them, and ``default`` is per client.

- **stdio** has one client, the process at the other end: its sessions' workspaces are
  ``WORKSPACE/SESSION``, and the sessions it owns are those this server started.
- **Streamable HTTP**: each MCP session (the transport's session id, by which the SDK routes
  every request after ``initialize``) is a client of its own.  Its sessions' workspaces are
  ``WORKSPACE/client-ID/SESSION``, where ID is a keyed hash of the MCP session id (a key of this
  server process's own: the directory names neither reveal an id nor can be chosen by anyone),
  so two clients' ``default`` never share a file and the directory holds nothing but that
  client's sessions.  The session id itself is the client's credential: it is kept nowhere but
  in the SDK and never written to a path or a log.  A request that carries no session id (the
  stateless 2026 protocol over HTTP) belongs to no client and is refused in words.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from mcp.types.version import HANDSHAKE_PROTOCOL_VERSIONS
except ImportError as exc:  # the optional extra: say how to get it
    from engine.extras import install_hint

    raise ImportError(f"the MCP server needs the MCP SDK ({exc}): {install_hint('mcp')}") from exc

from engine.errors import NoClient
from engine.integrations.http_gate import SESSION_ID_HEADER

__all__ = ["Client", "Clients", "session_directories"]
_STDIO = "stdio"


@dataclass(frozen=True)
class Client:
    """One MCP client: ``id`` names it in logs and keys its sessions; its sessions' workspaces
    are ``root/SESSION``; ``private``: ``root`` is its own, holding nothing but its sessions."""

    id: str
    root: Path
    private: bool


class Clients:
    """The clients of one server: one for stdio (``per_session=False``), or one per MCP session
    of the streamable HTTP transport."""

    def __init__(self, workspace: Path, *, per_session: bool) -> None:
        self.workspace = workspace
        self.per_session = per_session
        self._key = secrets.token_bytes(32)
        self._stdio = Client(_STDIO, workspace, private=False)

    def of(self, ctx: Any) -> Client:
        """The client a request (the SDK's request context) comes from; NoClient otherwise."""
        if not self.per_session:
            return self._stdio
        request = getattr(ctx, "request", None)
        session_id = request.headers.get(SESSION_ID_HEADER) if request is not None else None
        # The SDK routes a request by its session id only on the handshake protocols; a request
        # of the stateless protocol reaches handlers with whatever header it carried.
        if not session_id or getattr(ctx, "protocol_version", None) not in HANDSHAKE_PROTOCOL_VERSIONS:
            raise NoClient("this server keeps sessions per MCP session, and this request came without one "
                           "(the stateless protocol over HTTP has none): connect with the initialize handshake "
                           f"(protocol {HANDSHAKE_PROTOCOL_VERSIONS[-1]}; the Python SDK's Client(mode='legacy'))")
        return self.for_session_id(session_id)

    def for_session_id(self, session_id: str) -> Client:
        """The client of MCP session ``session_id`` (HTTP only)."""
        digest = hmac.new(self._key, session_id.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:20]
        name = f"client-{digest}"
        return Client(name, self.workspace / name, private=True)


def session_directories(root: Path) -> list[str]:
    """The names of the directories in a private client root (its sessions), without
    following a link; [] when it does not exist yet."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    names = []
    for entry in entries:
        try:
            if stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
                names.append(entry.name)
        except OSError:
            continue
    return sorted(names)
