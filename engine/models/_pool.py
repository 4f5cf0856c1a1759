"""One HTTP client per endpoint for many conversations: a batch's runs share them.

A conversation's own client costs its making and, above all, a new connection, each checked
by reading the machine's TCP tables (``engine.models._endpoint``: whose server it is).  The
runs of a batch talk to the same endpoints one after another, so within ``shared_clients``
(``ClientPool.shared``) every conversation of a run takes the pool's client for its endpoint
and keeps its connections warm for the next run.  What stays each conversation's own: its
transcript, its headers (the key is read and sent with each request) and its retries; every
new connection is checked as before.  What is not shared: cookies (a pooled client keeps
none, so no run sees what a server set for another) and a client made on a transport of the
caller's (tests, proxies of their own).
"""

from __future__ import annotations

import contextlib
import contextvars
import http.cookiejar
import weakref
from collections.abc import Iterator

import httpx

from engine.models._http import open_client
from engine.models._registry import ModelConfig

__all__ = ["ClientPool", "pooled"]

#: Every client a pool made (a conversation closing one is told apart by it, in any context).
_pooled: weakref.WeakSet[httpx.AsyncClient] = weakref.WeakSet()
_current: contextvars.ContextVar[ClientPool | None] = contextvars.ContextVar("agentloop_clients", default=None)


class ClientPool:
    """The clients of a batch's runs, one per endpoint (its base URL's origin and its
    timeout), made on first use, all closed by ``aclose``.  A pool belongs to one event loop."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, float], httpx.AsyncClient] = {}
        self._closed = False

    def client(self, model: ModelConfig) -> httpx.AsyncClient:
        """The pool's client for ``model``'s endpoint: unbounded connections, as many kept
        alive as were needed at once (conversations that had clients of their own never waited
        for a connection either), no cookies kept."""
        if self._closed:
            raise RuntimeError("the pool of HTTP clients is closed")
        url = httpx.URL(model.base_url)
        key = (f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}", model.timeout)
        client = self._clients.get(key)
        if client is None:
            nothing = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
            client = open_client(model, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                 cookies=nothing)
            self._clients[key] = client
            _pooled.add(client)
        return client

    async def aclose(self) -> None:
        """Close every client (their connections with them); the pool hands out no more."""
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    @staticmethod
    async def release(client: httpx.AsyncClient) -> None:
        """A conversation is done with ``client``: closed, unless a pool shares it."""
        if client not in _pooled:
            await client.aclose()

    @staticmethod
    @contextlib.contextmanager
    def shared(pool: ClientPool | None) -> Iterator[None]:
        """Within this block (and the tasks it starts), conversations without a transport of
        their own take ``pool``'s clients (None: each its own, as outside)."""
        token = _current.set(pool)
        try:
            yield
        finally:
            _current.reset(token)


def pooled(model: ModelConfig, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """The client a conversation with ``model`` uses: the shared pool's (see the module doc),
    else one of its own."""
    pool = _current.get()
    if pool is None or transport is not None:
        return open_client(model, transport)
    return pool.client(model)
