"""What a program in a sandbox with an egress allowlist is told: the proxy variables.

The proxy itself lives outside (``engine.net``); inside, the forwarder (``worker.egress``)
listens on the sandbox's own loopback, and every variable a common client reads for a proxy
names it: curl (``http_proxy`` lower case only, ``HTTPS_PROXY``, ``ALL_PROXY``), Python's urllib,
requests, pip (and ``PIP_PROXY``), httpx, git, npm (``npm_config_proxy``,
``npm_config_https_proxy``) and Yarn.  Plain ``http://`` in every one: there is no SOCKS
listener, and pip and requests fail on a ``socks5h://`` URL without PySocks.  ``NO_PROXY``
names only the sandbox's own loopback, so servers the code starts inside stay reachable, and no
private range (a listed private address goes through the proxy like any other).
"""

from __future__ import annotations

__all__ = ["FORWARDER_PORT", "NO_PROXY", "SOCKET_NAME", "NO_PROXY_VARIABLES", "PROXY_VARIABLES", "proxy_environment"]

#: The port the forwarder listens on in a sandbox the coordinator starts: each sandbox has a
#: loopback of its own, so one fixed port serves them all, and the coordinator can set the
#: proxy variables in the one environment it builds instead of the process after it starts.
FORWARDER_PORT = 3128
#: The name of the gate's socket in a process's socket directory.
SOCKET_NAME = "egress.sock"
#: The variables that name the forwarder, as ``http://127.0.0.1:PORT``.
PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                   "PIP_PROXY", "npm_config_proxy", "npm_config_https_proxy", "YARN_HTTP_PROXY",
                   "YARN_HTTPS_PROXY")
#: The variables that name what goes direct, as ``NO_PROXY``.
NO_PROXY_VARIABLES = ("NO_PROXY", "no_proxy", "npm_config_noproxy")
#: The sandbox's own loopback, and nothing else.
NO_PROXY = "localhost,127.0.0.1,::1"


def proxy_environment(port: int) -> dict[str, str]:
    """Every proxy variable for a forwarder listening on 127.0.0.1:``port``."""
    url = f"http://127.0.0.1:{port}"
    return {**dict.fromkeys(PROXY_VARIABLES, url), **dict.fromkeys(NO_PROXY_VARIABLES, NO_PROXY)}
