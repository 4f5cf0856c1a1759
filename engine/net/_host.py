"""Hosts in one canonical form, for the allowlist and the proxy alike.

A host is a name (lowercase LDH labels, A-labels for an internationalised name, no trailing
dot) or an address (``ipaddress``: an IPv4-mapped IPv6 address is its IPv4 address).  Every
other spelling is refused, never guessed at: glibc's resolver reads ``127.1``, ``0x7f.0.0.1``,
``2130706433`` and ``0177.0.0.1`` as 127.0.0.1, so a host whose last label is a number is an
address in the four-decimal form or nothing; an IPv6 address is one in brackets, without a
zone.  Errors are ``ConfigError``: the allowlist says them for its entries, the proxy in its
400 answers.
"""

from __future__ import annotations

import re
from ipaddress import IPv4Address, IPv6Address

from engine.errors import ConfigError

__all__ = ["Host", "canonical_host", "parse_port", "show_host", "split_authority"]

#: A name (str) or an address.
Host = str | IPv4Address | IPv6Address

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")
# WHATWG's "ends in a number": the last label is decimal digits or 0x and hex digits.
_NUMERIC = re.compile(r"(?:[0-9]+|0x[0-9a-f]*)\Z")
_PORT = re.compile(r"[1-9][0-9]{0,4}\Z")
# Nothing a URL or a header could make mean something else: userinfo, path, query, fragment,
# a percent-escape, a backslash (read as a slash by some URL parsers), whitespace, controls.
_NEVER = re.compile(r"[@/?#%\\\s\x00-\x1f\x7f]")


def _unmapped(address: IPv6Address) -> IPv4Address | IPv6Address:
    # ::ffff:a.b.c.d is a.b.c.d on the wire (connect() to it reaches the IPv4 address).
    return address.ipv4_mapped or address


def canonical_host(text: str, *, unicode: bool = False) -> Host:
    """``text`` as a name or an address, or ConfigError saying why it is neither.

    ``unicode``: a non-ASCII name is turned into its A-labels (IDNA, UTS 46), as for an entry
    a person wrote; a request must send the A-labels itself (``xn--...``)."""
    if not text:
        raise ConfigError("the host is empty")
    if text.startswith("[") or text.endswith("]"):
        inner = text[1:-1] if text.startswith("[") and text.endswith("]") else None
        if inner is None or "%" in inner:
            raise ConfigError(f"{text!r} is not an IPv6 address in brackets (without a zone)")
        try:
            return _unmapped(IPv6Address(inner))
        except ValueError:
            raise ConfigError(f"{text!r} is not an IPv6 address in brackets") from None
    if _NEVER.search(text):
        raise ConfigError(f"{text!r} is not a host name: it holds a character no host name has")
    if ":" in text:
        raise ConfigError(f"{text!r} is not a host name (an IPv6 address goes in brackets: [{text}])")
    name = text.lower()
    if name.endswith("."):
        name = name[:-1]  # one trailing dot: the same name, fully qualified
    if not name.isascii():
        if not unicode:
            raise ConfigError(f"{text!r} is not an ASCII host name (send the name's A-labels, xn--...)")
        name = _a_labels(text, name)
    labels = name.split(".")
    if _NUMERIC.match(labels[-1]):
        try:
            return IPv4Address(name)  # four decimal parts 0-255, no leading zero
        except ValueError:
            raise ConfigError(f"{text!r} is not an IPv4 address in its usual form (four decimal numbers "
                              "0-255 without leading zeros, such as 192.0.2.1), and a name never ends in a "
                              "number") from None
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ConfigError(f"{text!r} is not a host name (labels of letters, digits and inner hyphens, "
                          "at most 63 characters each, 253 in all)")
    return name


def _a_labels(text: str, name: str) -> str:
    import idna

    try:
        return idna.encode(name, uts46=True, transitional=False).decode("ascii")
    except (idna.IDNAError, UnicodeError) as exc:
        raise ConfigError(f"{text!r} is not an internationalised host name ({exc})") from None


def parse_port(text: str, what: str) -> int:
    """A port 1-65535 in decimal, without sign or leading zero; ConfigError naming ``what``."""
    if not _PORT.match(text) or int(text) > 65535:
        raise ConfigError(f"{what}: {text!r} is not a port (1 to 65535)")
    return int(text)


def split_authority(text: str) -> tuple[str, str | None]:
    """``host[:port]`` as (host, port text or None), the host of an IPv6 address with its
    brackets; ConfigError for anything else (a colon outside brackets, an empty port)."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"{text!r}: an IPv6 address's bracket is not closed")
        host, rest = text[:close + 1], text[close + 1:]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ConfigError(f"{text!r}: only :PORT may follow the address")
        return host, rest[1:]
    host, colon, port = text.rpartition(":")
    if not colon:
        return text, None
    if ":" in host:
        raise ConfigError(f"{text!r}: an IPv6 address goes in brackets ([2001:db8::1]:443)")
    return host, port


def show_host(host: Host, port: int | None = None) -> str:
    """How ``host`` (and ``port``) is written in an entry: an IPv6 address in brackets."""
    shown = f"[{host}]" if isinstance(host, IPv6Address) else str(host)
    return shown if port is None else f"{shown}:{port}"
