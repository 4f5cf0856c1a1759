"""The proxy's HTTP/1: request heads read strictly, the one request forwarded, the answers it gives.

A client may send ``CONNECT host:port`` (a tunnel, for TLS) or a plain ``http://`` request in
absolute form whose ``Host`` names the same authority; nothing else (origin form, ``https://``
or other schemes, an ``Upgrade``).  A head is CRLF-delimited lines of visible ASCII, at most
``max_headers`` fields, no obs-fold, no space before a colon; a body has one Content-Length or
none (``Transfer-Encoding`` is refused: framing the proxy cannot check is framing another
parser could read differently).  Whatever is wrong is a ``BadRequest`` with its status and
words, never an exception of the parser's own.

The request forwarded is rewritten to origin form with the hop-by-hop and ``Proxy-*`` fields
dropped and ``Connection: close``; the response head gets ``Connection: close`` too, so the
client opens a new connection (and so a new decision) for its next request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import AgentloopError, ConfigError
from engine.net._host import Host, canonical_host, parse_port, show_host, split_authority

__all__ = ["BadRequest", "Request", "Response", "continue_head", "parse_request", "parse_response", "refusal"]

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
_TARGET = re.compile(rb"[\x21-\x7e]+\Z")
_STATUS = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [\t\x20-\x7e\x80-\xff]*)?\Z")
#: Fields that concern one connection, never forwarded (RFC 9110 7.6.1), and the proxy's own.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                  "expect"})


class BadRequest(AgentloopError):
    """A request the proxy will not read further: ``status`` (400, 431, 501) and words.
    The gate's own: it answers the client with it, and it never leaves ``engine.net``."""

    def __init__(self, status: int, words: str) -> None:
        super().__init__(words)
        self.status = status
        self.words = words


def _fields(lines: list[bytes], max_headers: int, who: str) -> list[tuple[str, str]]:
    if len(lines) > max_headers:
        raise BadRequest(431, f"the {who} has more than {max_headers} header fields")
    fields = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):  # (obs-fold, a space before the colon, no name)
            raise BadRequest(400, f"the {who} has a malformed header field")
        value = value.strip(b" \t")
        if not _VALUE.match(value):
            raise BadRequest(400, f"the {who}'s {name.decode()} field holds a control character")
        fields.append((name.decode("ascii"), value.decode("latin-1")))
    return fields


def _values(fields: list[tuple[str, str]], name: str) -> list[str]:
    return [v for n, v in fields if n.lower() == name]


def _split_head(head: bytes, who: str) -> list[bytes]:
    lines = head.split(b"\r\n")
    if any(b"\r" in line or b"\n" in line for line in lines):
        raise BadRequest(400, f"the {who} has a line ending that is not CRLF")
    return lines


@dataclass(frozen=True)
class Request:
    """A request the proxy may forward: ``connect`` (a tunnel) or a plain request to
    ``host``:``port`` with ``origin`` (its path and query), ``length`` body bytes and
    ``expect`` (it sent ``Expect: 100-continue``)."""

    method: str
    host: Host
    port: int
    connect: bool
    version: str = "HTTP/1.1"
    origin: str = "/"
    fields: tuple[tuple[str, str], ...] = ()
    length: int = 0
    expect: bool = False

    @property
    def authority(self) -> str:
        return show_host(self.host, self.port)

    def upstream_head(self) -> bytes:
        """The head to send the origin server: origin form, hop-by-hop fields dropped (those
        ``Connection`` names too), ``Proxy-*`` dropped, ``Connection: close``."""
        named = {t.strip().lower() for v in _values(list(self.fields), "connection") for t in v.split(",")}
        kept = [(n, v) for n, v in self.fields
                if n.lower() not in _HOP and n.lower() not in named and not n.lower().startswith("proxy-")]
        lines = [f"{self.method} {self.origin} {self.version}", *(f"{n}: {v}" for n, v in kept), "Connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _target(text: str, default_port: int | None, what: str) -> tuple[Host, int]:
    try:
        host_text, port_text = split_authority(text)
        host = canonical_host(host_text)
        if port_text is None:
            if default_port is None:
                raise ConfigError(f"{text!r} names no port")
            return host, default_port
        return host, parse_port(port_text, what)
    except ConfigError as exc:
        raise BadRequest(400, f"the {what} is not host:port: {exc}") from None


def parse_request(head: bytes, max_headers: int = 100) -> Request:
    """The request ``head`` holds (its bytes up to, not including, the blank line)."""
    lines = _split_head(head, "request")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not _TARGET.match(parts[1]):
        if lines[0][:1] in (b"\x04", b"\x05"):
            raise BadRequest(400, "SOCKS is not offered: this proxy speaks HTTP (CONNECT and http:// requests)")
        raise BadRequest(400, "the request line is not METHOD TARGET HTTP/1.1")
    method, target, version = parts[0].decode(), parts[1].decode(), parts[2].decode("latin-1")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(400 if not version.startswith("HTTP/") else 505, f"{version[:20]!r} is not HTTP/1.1 or 1.0")
    fields = _fields(lines[1:], max_headers, "request")
    if method == "CONNECT":
        host, port = _target(target, None, "CONNECT target")
        return Request(method, host, port, True, version, fields=tuple(fields))
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        if target.startswith("/") or target == "*":
            raise BadRequest(400, "an origin-form request (GET /path) is for a server, not a proxy: send the "
                                  "absolute URL (GET http://host/path), or CONNECT for https")
        raise BadRequest(400, "only http:// URLs are forwarded as they are; https and other protocols go through "
                              "CONNECT")
    if "#" in rest:
        raise BadRequest(400, "the URL holds a fragment (#)")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, origin = rest[:cut], rest[cut:] or "/"
    origin = origin if origin.startswith("/") else "/" + origin
    host, port = _target(authority, 80, "URL's authority")
    hosts = _values(fields, "host")
    if len(hosts) != 1:
        raise BadRequest(400, "the request must have exactly one Host field")
    if _target(hosts[0], 80, "Host field") != (host, port):
        raise BadRequest(400, f"the Host field ({hosts[0][:100]!r}) names another host than the URL ({show_host(host, port)})")
    for refused, why in (("transfer-encoding", "a Transfer-Encoding request body is not forwarded: send a "
                                               "Content-Length"), ("upgrade", "Upgrade is not forwarded over plain "
                                                                             "http: use https (CONNECT)")):
        if _values(fields, refused):
            raise BadRequest(400 if refused == "upgrade" else 501, why)
    lengths = _values(fields, "content-length")
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()) or (lengths and len(lengths[0]) > 18):
        raise BadRequest(400, "the request's Content-Length is not one decimal number")
    expects = [v.strip().lower() for v in _values(fields, "expect")]
    if any(v != "100-continue" for v in expects):
        raise BadRequest(417, "only Expect: 100-continue is understood")
    return Request(method, host, port, False, version, origin, tuple(fields), int(lengths[0]) if lengths else 0,
                   bool(expects) and version == "HTTP/1.1")


@dataclass(frozen=True)
class Response:
    """A response head from the origin server, rewritten for the client: ``status``,
    ``head`` (the bytes to send, blank line included), ``length`` (body bytes, None: until
    the server closes), ``interim`` (1xx: another head follows)."""

    status: int
    head: bytes
    length: int | None
    interim: bool


def parse_response(head: bytes, method: str, max_headers: int = 100) -> Response:
    """The response ``head`` holds (up to, not including, the blank line), to the request
    ``method``; BadRequest(502) for one that is no HTTP/1 response."""
    try:
        lines = _split_head(head, "response")
        match = _STATUS.match(lines[0])
        if match is None:
            raise BadRequest(502, "the server's response does not begin with an HTTP/1 status line")
        fields = _fields(lines[1:], max_headers, "response")
    except BadRequest as exc:
        raise BadRequest(502, f"the server sent a malformed response: {exc.words}") from None
    status = int(match.group(1))
    if 100 <= status < 200 and status != 101:
        return Response(status, head + b"\r\n\r\n", 0, True)
    named = {t.strip().lower() for v in _values(fields, "connection") for t in v.split(",")}
    kept = [(n, v) for n, v in fields
            if n.lower() not in ("connection", "keep-alive", "proxy-connection") and n.lower() not in named]
    out = [lines[0].decode("latin-1"), *(f"{n}: {v}" for n, v in kept), "Connection: close"]
    lengths = _values(fields, "content-length")
    length: int | None = None
    if method == "HEAD" or status in (204, 304):
        length = 0
    elif not _values(fields, "transfer-encoding") and len(set(lengths)) == 1 and lengths[0].isdigit():
        length = int(lengths[0])
    return Response(status, ("\r\n".join(out) + "\r\n\r\n").encode("latin-1"), length, False)


_REASONS = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 417: "Expectation Failed",
            431: "Request Header Fields Too Large", 501: "Not Implemented", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported"}
#: RFC 9209 Proxy-Status error types, by status.
_PROXY_STATUS = {400: "http_request_error", 403: "destination_ip_prohibited", 408: "http_request_error",
                 417: "http_request_error",
                 431: "http_request_error", 501: "http_request_error", 502: "destination_unavailable",
                 503: "connection_limit_reached", 504: "connection_timeout", 505: "http_request_error"}


def refusal(status: int, words: str, hint: str = "") -> bytes:
    """The whole answer to a request the proxy refuses or cannot carry: the reason phrase
    itself says why (clients such as pip show it), and the body says it again with ``hint``,
    the option that would allow it."""
    text = f"agentloop: {words}" + (f"; to allow it: {hint}" if hint else "")
    phrase = re.sub(r"[^\x20-\x7e]", "?", text)[:400]
    body = (text + "\n").encode("utf-8", "replace")
    detail = phrase.replace("\\", "\\\\").replace('"', '\\"')
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}: {phrase}\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\n"
            f'Proxy-Status: agentloop; error={_PROXY_STATUS.get(status, "proxy_internal_error")}; details="{detail}"\r\n'
            "Connection: close\r\n\r\n")
    return head.encode("ascii") + body


def continue_head() -> bytes:
    """The interim answer the proxy gives a request that waits for it (``Expect: 100-continue``)."""
    return b"HTTP/1.1 100 Continue\r\n\r\n"
