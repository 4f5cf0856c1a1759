"""Whose server a client is about to talk to, when that server is on this machine.

Loopback is shared by every local account: whoever binds ``127.0.0.1:8080`` first receives
what is sent there — an API key, the prompts, the traces — and answers with code that runs.
So a connection to a server on this machine is used only when the socket that accepted it
belongs to the user running agentloop or to root; otherwise one sentence names its owner
(uid and name) and nothing is sent.  A server elsewhere is not judged here (TLS is its check).

The owner comes from ``/proc/net/tcp`` and ``/proc/net/tcp6``, which list every TCP socket of
this network namespace with its owner's uid, readable by anyone.  ``connection_refusal`` looks
at a *connected* socket: the kernel lists the server's end of that very connection (accepted
or still in the listen queue) with its listener's uid, so there is no choice among wildcard and
specific listeners, and no window between the check and the connection — a server closed and
replaced after the connection was made does not get it.  It runs right after each new TCP
connection and before a byte is written: every HTTP client of the model layer gets it through
``checked_client`` (httpx's ``trace`` extension, which reports each new connection, through
a proxy too), the trace exporter through its own HTTP adapter (``engine.observe._tracing``).

``address_refusal`` is the weaker check for clients whose connections cannot be reached (an
OTLP/gRPC exporter, Ray): it matches the LISTEN sockets that could take a connection to an
address and port, and refuses when any of them is another user's.  What remains there: a
listener that changes hands between that check and the library's own connection.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from engine.errors import ForeignServer

if TYPE_CHECKING:
    import httpx

__all__ = ["address_refusal", "checked_client", "connection_refusal", "owner_name", "raise_if_foreign"]

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = 0x0A
_Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def owner_name(uid: int) -> str:
    """``uid``'s user name, or words saying it has none (a uid without a passwd line)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no user name"


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as the kernel names it, IPv4-mapped IPv6 addresses as the IPv4 they map."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _hex_address(field: str) -> _Address:
    """``0100007F:1F90`` (IPv4) or 32 hex digits and a port (IPv6) from /proc/net/tcp*: the
    address is printed as 32-bit words in the machine's byte order."""
    host, port = field.split(":")
    raw = b"".join(int(host[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(host), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(port, 16)


def _sockets() -> Iterator[tuple[_Address, _Address, int, int]]:
    """(local, remote, state, uid) of every TCP socket of this network namespace."""
    for table in _TABLES:
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            try:
                yield _hex_address(fields[1]), _hex_address(fields[2]), int(fields[3], 16), int(fields[7])
            except (IndexError, ValueError):
                continue


def _unreadable() -> bool:
    return not any(os.access(table, os.R_OK) for table in _TABLES)


def _words(what: str, host: str, port: int, uid: int) -> str:
    return (f"{what} at {host}:{port} is served by another user of this machine (uid {uid}, {owner_name(uid)}), "
            "not by you or root: nothing was sent to it (any local account can listen on a loopback port). "
            "Start your own server there, or point agentloop at one that is yours.")


def _shown(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    return f"[{ip}]" if ip.version == 6 else str(ip)


def connection_refusal(sock: socket.socket, what: str = "the server") -> str | None:
    """Why ``sock``, just connected, must not be used: the server's end of it is a socket of
    another user of this machine (or, on loopback, one whose owner cannot be told); None
    when it is the caller's or root's, or the server is not on this machine."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        peer, ours = sock.getpeername(), sock.getsockname()
    except OSError:
        return None  # not connected: there is nothing to send on
    server, client = (_ip(peer[0]), peer[1]), (_ip(ours[0]), ours[1])
    for local, remote, _, uid in _sockets():
        if local == server and remote == client:
            return None if _trusted(uid) else _words(what, _shown(server[0]), server[1], uid)
    if server[0].is_loopback:
        why = "cannot be read" if _unreadable() else "does not list it"
        return (f"{what} at {_shown(server[0])}:{server[1]} is on this machine, but whose it is cannot be told "
                f"(/proc/net/tcp {why}): nothing was sent to it")
    return None  # a server elsewhere


def _on_this_machine(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` is an address of this machine (loopback, or one of its interfaces'): only
    those can be bound, which is the test."""
    if ip.is_loopback:
        return True
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


def address_refusal(host: str, port: int, what: str = "the server") -> str | None:
    """Why a connection to ``host:port`` must not be made: a LISTEN socket on this machine that
    could take it belongs to another user (see the module docstring for what this leaves).
    ``host`` is resolved; a name that does not resolve is left to the client to report."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    targets = {ip for ip in (_ip(info[4][0]) for info in infos) if _on_this_machine(ip)}
    if not targets:
        return None
    listeners = [(local, uid) for local, _, state, uid in _sockets() if state == _LISTEN and local[1] == port]
    for target in sorted(targets, key=str):
        for (ip, _), uid in listeners:
            takes = ip == target or (ip.is_unspecified and (ip.version == target.version or ip.version == 6))
            if takes and not _trusted(uid):
                return _words(what, _shown(target), port, uid)
    return None


def raise_if_foreign(sock: socket.socket | None, what: str = "the model server") -> None:
    """ForeignServer (``sock`` closed first) when ``connection_refusal`` refuses ``sock``."""
    if sock is None:
        return
    words = connection_refusal(sock, what)
    if words is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise ForeignServer(words)


async def _on_trace(event: str, info: dict[str, Any]) -> None:
    """httpcore's report of each step of a request: after a new TCP connection (to the server,
    or to a proxy) and before anything is written on it, whose is the socket at the other end."""
    if event != "connection.connect_tcp.complete":
        return
    stream = info.get("return_value")
    sock = stream.get_extra_info("socket") if stream is not None else None
    try:
        raise_if_foreign(sock)
    except ForeignServer:
        await stream.aclose()
        raise


async def _checked(request: httpx.Request) -> None:
    request.extensions = {**request.extensions, "trace": _on_trace}


def checked_client(**options: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` (``options`` as its own) whose every new connection is checked
    before use: a server on this machine that is another user's raises ForeignServer."""
    import httpx  # (the trace exporter uses the rest of this module without it)

    hooks = dict(options.pop("event_hooks", None) or {})
    hooks["request"] = [_checked, *hooks.get("request", [])]
    return httpx.AsyncClient(event_hooks=hooks, **options)
