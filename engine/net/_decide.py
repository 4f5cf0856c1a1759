"""The one decision the proxy makes for a connection, in two pure steps.

``before_lookup`` judges the canonical target (host, port) alone, in order: names that are never
allowed (deny), then the entries that name the host (allow), then their ports (port).  An IP
address passes only when that address is listed; a name passes to the lookup.  Nothing is
looked up for a name no entry names, so an unlisted name never reaches a resolver (no DNS
exfiltration through the proxy).

``after_lookup`` judges what the name resolved to: every address must be public and not one of
this machine's own, or listed itself with that port; one that is not refuses the whole name (the proxy then dials nothing),
and the proxy dials only addresses judged here.  Each verdict carries the words a refusal says
and the option that would allow it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from engine.net._address import special_class
from engine.net._allow import Allowlist, denied_name
from engine.net._host import Host, show_host

__all__ = ["Verdict", "after_lookup", "before_lookup"]


@dataclass(frozen=True)
class Verdict:
    """``allowed``, else ``why`` (a short code: "denied-name", "not-listed", "port",
    "special-address", "no-address"), ``words`` (a sentence for the record and the refusal)
    and ``hint`` (the option that would allow it, or empty)."""

    allowed: bool
    why: str = ""
    words: str = ""
    hint: str = ""


_ALLOWED = Verdict(True)


def before_lookup(allowlist: Allowlist, host: Host, port: int) -> Verdict:
    """The verdict on ``host`` (canonical) and ``port`` before anything is looked up."""
    target = show_host(host, port)
    if isinstance(host, str) and denied_name(host):
        return Verdict(False, "denied-name", f"{host} names this machine or a metadata service, which no "
                                             "name may reach", "")
    naming = allowlist.naming(host)
    if not naming:
        what = "address" if not isinstance(host, str) else "host"
        cls = "" if isinstance(host, str) else special_class(host)
        extra = f" ({cls})" if cls else ""
        return Verdict(False, "not-listed", f"the {what} {show_host(host)}{extra} is not on this sandbox's "
                                            "network allowlist", f"--allow-net {target}")
    ports = sorted({p for e in naming for p in e.ports}, reverse=True)
    if port not in ports:
        listed = ", ".join(map(str, ports))
        return Verdict(False, "port", f"{show_host(host)} is allowed on port{'s' if len(ports) > 1 else ''} "
                                      f"{listed} only, not {port}", f"--allow-net {target}")
    return _ALLOWED


def after_lookup(allowlist: Allowlist, name: str, port: int, addresses: Sequence[IPv4Address | IPv6Address],
                 machine: Collection[IPv4Address | IPv6Address] = ()) -> Verdict:
    """The verdict on the addresses ``name`` resolved to (IPv4-mapped ones already made IPv4):
    allowed only if there is one and each is public and none of ``machine`` (this machine's own,
    ``machine_addresses``), or listed itself with ``port``."""
    if not addresses:
        return Verdict(False, "no-address", f"{name} has no address", "")
    for address in addresses:
        cls = special_class(address) or ("an address of this machine" if address in machine else None)
        if cls is not None and not allowlist.lists_address(address, port):
            return Verdict(False, "special-address",
                           f"{name} resolves to {address}, {cls}; a name may never lead to such an address "
                           "unless that address itself is listed", f"--allow-net {show_host(address, port)}")
    return _ALLOWED
