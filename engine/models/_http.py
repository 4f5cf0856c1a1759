"""An endpoint's HTTP, as every client of a model server speaks it: the client (TLS, the checked
connections of ``engine.models._endpoint``), the key's header, and failures in words."""

from __future__ import annotations

import email.utils
import functools
import socket
import ssl
import time
import types

import httpx

from engine.models._endpoint import checked_client
from engine.models._registry import ModelConfig
from engine.secrets import redact_urls

__all__ = ["auth_headers", "caused_by", "nobody_listens", "open_client", "retry_after", "start_hint", "transport_reason"]


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for the process: building one costs tens of milliseconds, and every
    client would otherwise build its own (every sub-agent's conversation has a client)."""
    return httpx.create_ssl_context()


def open_client(model: ModelConfig, transport: httpx.AsyncBaseTransport | None = None,
                **options: object) -> httpx.AsyncClient:
    """The HTTP client for conversations with ``model``'s endpoint (its timeout; the shared TLS
    context; ``options`` as httpx's own), which uses no connection to another user's server on
    this machine (``engine.models._endpoint``: ForeignServer before anything is sent)."""
    timeout = httpx.Timeout(model.timeout, connect=min(model.timeout, 30.0))
    return checked_client(transport=transport, timeout=timeout, verify=_tls(), **options)


def auth_headers(model: ModelConfig) -> dict[str, str]:
    """The Authorization header for ``model``'s key, read now; none without a key."""
    key = model.api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def start_hint(base_url: str) -> str:
    """How to start a server where ``base_url`` points (its host and port, not a fixed 8080)."""
    url = httpx.URL(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    host = url.host or "127.0.0.1"
    where = "" if host in ("127.0.0.1", "localhost", "::1") else f" --host {host}"
    return (f"Start one there: `llama-server -m MODEL.gguf{where} --port {port} --jinja`; or point LLM_URL "
            "(or base_url in agentloop.toml) at a server that runs, e.g. Ollama's "
            "(`LLM_URL=http://localhost:11434/v1 LLM_MODEL=qwen3:4b`).")


def nobody_listens(exc: BaseException) -> bool:
    """Whether a failed connection means no server is there: refused, or a host name that does
    not resolve (as opposed to a reset, a broken stream or a timeout from a server that is up)."""
    return caused_by(exc, ConnectionRefusedError | socket.gaierror) or (
        isinstance(exc, httpx.ConnectError) and "refused" in str(exc).lower())


def caused_by(exc: BaseException, kind: type | types.UnionType) -> bool:
    """Whether ``exc``, or an exception it was raised from (eight deep at most), is a ``kind``."""
    cause: BaseException | None = exc
    for _ in range(8):
        if cause is None:
            return False
        if isinstance(cause, kind):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def transport_reason(exc: httpx.TransportError) -> str:
    """A few words on why the connection failed, from the OS error underneath when there is one
    (httpx reports every refused connect as "All connection attempts failed")."""
    cause: BaseException | None = exc
    for _ in range(8):
        if cause is None:
            break
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, OSError) and cause.strerror:
            return redact_urls(cause.strerror.lower())
        cause = cause.__cause__ or cause.__context__
    text = redact_urls(str(exc))  # (a proxy's URL, say)
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect: {text}" if text else "cannot connect"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
