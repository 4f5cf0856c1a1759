"""Where traces go, under the model layer's rule for servers on this machine.

Traces hold prompts and code (and, on opt-in, whole messages), and the default collector is a
loopback port (``http://localhost:4318``) any local account may have bound first.  So the
collector's address is checked when tracing starts (``refusal``: a listener there of another
user stops the command in one line, before any span is made), and the OTLP/HTTP exporter gets
a ``requests`` session whose every new connection is checked again right after it is made and
before a byte is written (``checked_session``): a collector that is another user's then gets
nothing, and the exporter's failure is summed up at the end as any other.  The rule and its
``/proc/net`` reading are ``engine.models``' (``connection_refusal``, ``address_refusal``).

What this leaves: OTLP over gRPC, and a session from an OpenTelemetry credential provider
(``OTEL_PYTHON_EXPORTER_OTLP_HTTP_*CREDENTIAL_PROVIDER``), get the start-up check only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["PROVIDER_VARIABLES", "checked_session", "refusal"]

#: The variables that give the OTLP/HTTP exporter a session of its own.
PROVIDER_VARIABLES = ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                      "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER")
_WHAT = "the trace collector"


def refusal(url: str) -> str | None:
    """Why spans must not go to ``url``: a listener at its address on this machine is another
    user's.  None otherwise (a collector elsewhere, or nothing listening yet)."""
    from engine.models import address_refusal

    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None  # the exporter reports an address it cannot use
    return address_refusal(parts.hostname or "localhost", port, _WHAT)


def checked_session(environ: Mapping[str, str]) -> Any:
    """A ``requests.Session`` that uses no connection to another user's collector on this
    machine; None when a credential provider supplies the exporter's session."""
    if any(environ.get(name) for name in PROVIDER_VARIABLES):
        return None
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
    from urllib3.poolmanager import PoolManager, ProxyManager

    from engine.models import raise_if_foreign

    class _Checked:
        def _new_conn(self):  # the socket, connected, before TLS and before the request
            sock = super()._new_conn()  # type: ignore[misc]
            try:
                raise_if_foreign(sock, _WHAT)
            except BaseException:
                sock.close()
                raise
            return sock

    class _HTTP(_Checked, HTTPConnection):
        pass

    class _HTTPS(_Checked, HTTPSConnection):
        pass

    class _Pool(HTTPConnectionPool):
        ConnectionCls = _HTTP

    class _SPool(HTTPSConnectionPool):
        ConnectionCls = _HTTPS

    pools = {"http": _Pool, "https": _SPool}

    class _Adapter(HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = pools

        def proxy_manager_for(self, proxy: str, **kwargs: Any) -> PoolManager:
            manager = super().proxy_manager_for(proxy, **kwargs)
            if type(manager) is ProxyManager:  # (an HTTP proxy: its connection is checked too)
                manager.pool_classes_by_scheme = pools
            return manager

    session = requests.Session()
    session.mount("http://", _Adapter())
    session.mount("https://", _Adapter())
    return session
