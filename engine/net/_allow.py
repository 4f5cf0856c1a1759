"""The egress allowlist as data: ``--allow-net HOST[:PORT]`` entries, parsed once.

HOST is a name, exactly (``example.com``), its subdomains only (``*.example.com``: any depth,
never the name itself) or both (``**.example.com``); or an IP address (``192.0.2.7``,
``[2001:db8::7]``), which matches that address alone.  Without a port an entry allows 443 and
80; with one, that port only.  A name is written as people write it (upper case, a trailing dot,
Unicode: all made canonical, ``engine.net._host``).  Refused with a ConfigError that says what
to write instead: a wildcard over a top-level domain or everything, a name of the machine itself
or of a metadata service (list its address if that is truly meant), an address no one connects
to (unspecified, multicast, broadcast).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from engine.errors import ConfigError
from engine.net._host import Host, canonical_host, parse_port, show_host, split_authority

__all__ = ["DEFAULT_PORTS", "Allowlist", "AllowEntry", "denied_name"]

#: The ports an entry without one allows: HTTPS and HTTP.
DEFAULT_PORTS = (443, 80)

#: Names the machine or its cloud answers to, never allowed by name (their addresses are
#: refused after the lookup anyway; this says so before any lookup, in clearer words).
_NEVER_NAMES = ("localhost", "metadata", "metadata.goog", "metadata.google.internal")
#: Suffixes of names never allowed by name, and those allowed only by an exact entry.
_NEVER_SUFFIXES = ("localhost",)
_EXACT_ONLY_SUFFIXES = ("internal",)


def denied_name(name: str) -> bool:
    """Whether ``name`` (canonical) is one no entry may allow: the machine's own or a metadata
    service's."""
    return name in _NEVER_NAMES or any(name.endswith("." + s) for s in _NEVER_SUFFIXES)


def _exact_only(name: str) -> bool:
    return any(name == s or name.endswith("." + s) for s in _EXACT_ONLY_SUFFIXES)


@dataclass(frozen=True)
class AllowEntry:
    """One entry: ``kind`` is "exact", "subdomains" (``*.``), "domain" (``**.``: the name and
    its subdomains) or "address"; ``host`` the name (without its wildcard) or the address."""

    kind: str
    host: Host
    ports: tuple[int, ...] = DEFAULT_PORTS

    def matches(self, host: Host) -> bool:
        """Whether ``host`` (canonical) is one this entry names, whatever the port."""
        if self.kind == "address" or not isinstance(host, str):
            return self.kind == "address" and host == self.host
        if _exact_only(host) and self.kind != "exact":
            return False  # (a .internal name needs an entry of its own)
        if self.kind == "exact":
            return host == self.host
        below = host.endswith("." + str(self.host))
        return below or (self.kind == "domain" and host == self.host)

    def __str__(self) -> str:
        prefix = {"subdomains": "*.", "domain": "**."}.get(self.kind, "")
        shown = prefix + show_host(self.host)
        return shown if self.ports == DEFAULT_PORTS else f"{shown}:{self.ports[0]}"

    @classmethod
    def parse(cls, text: str, where: str = "--allow-net") -> AllowEntry:
        """The entry ``text`` (``HOST[:PORT]``) means; ConfigError naming ``where`` and what
        to write instead."""
        spelled = text.strip()
        what = f"{where} {text!r}"
        kind = "exact"
        for prefix, wildcard in (("**.", "domain"), ("*.", "subdomains")):
            if spelled.startswith(prefix):
                kind, spelled = wildcard, spelled[len(prefix):]
                break
        if "*" in spelled:
            raise ConfigError(f"{what}: a wildcard stands only as the first label (*.example.com, "
                              "**.example.com); to give workers the whole network use --network")
        try:
            host_text, port_text = split_authority(spelled)
            host = canonical_host(host_text, unicode=True)
            ports = DEFAULT_PORTS if port_text is None else (parse_port(port_text, what),)
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}. An entry is HOST or HOST:PORT, HOST a name (example.com, "
                              "*.example.com, **.example.com) or an IP address (192.0.2.7, [2001:db8::7])") from None
        if not isinstance(host, str):
            if kind != "exact":
                raise ConfigError(f"{what}: a wildcard goes before a name, never an address")
            if host.is_unspecified or host.is_multicast or host == IPv4Address("255.255.255.255"):
                raise ConfigError(f"{what}: {host} is not an address to connect to")
            return cls("address", host, ports)
        if denied_name(host):
            raise ConfigError(f"{what}: {host} names this machine or a metadata service and is never allowed "
                              "by name; if you mean it, list its address (--allow-net 127.0.0.1:8000)")
        if kind != "exact" and _exact_only(host):
            raise ConfigError(f"{what}: names under .internal are allowed one by one, never by a wildcard; "
                              "list each host exactly")
        if kind != "exact" and "." not in host:
            raise ConfigError(f"{what}: *.{host} would allow a whole top-level domain; name a domain "
                              "under it (*.example.com)")
        return cls(kind, host, ports)


@dataclass(frozen=True)
class Allowlist:
    """Every entry of a sandbox's allowlist (empty: the sandbox has no network at all)."""

    entries: tuple[AllowEntry, ...] = ()

    @classmethod
    def parse(cls, texts: Iterable[str], where: str = "--allow-net") -> Allowlist:
        """The allowlist of ``texts`` (each ``HOST[:PORT]``), duplicates dropped;
        ConfigError for the first entry that is none."""
        if isinstance(texts, str):
            raise ConfigError(f"{where}: a list of HOST[:PORT] entries, not one string")
        entries: list[AllowEntry] = []
        for text in texts:
            if not isinstance(text, str):
                raise ConfigError(f"{where}: {text!r} is not a HOST[:PORT] string")
            entry = AllowEntry.parse(text, where)
            if entry not in entries:
                entries.append(entry)
        return cls(tuple(entries))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def naming(self, host: Host) -> list[AllowEntry]:
        """The entries that name ``host``, whatever their ports."""
        return [e for e in self.entries if e.matches(host)]

    def lists_address(self, address: IPv4Address | IPv6Address, port: int) -> bool:
        """Whether ``address`` itself is listed, with ``port``."""
        return any(e.kind == "address" and e.host == address and port in e.ports for e in self.entries)

    def texts(self) -> list[str]:
        """The entries in canonical spelling (``Allowlist.parse`` of them gives this list back)."""
        return [str(e) for e in self.entries]
