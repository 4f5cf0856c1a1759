"""The egress allowlist (``--allow-net HOST[:PORT]``): the entries as data, hosts in canonical
form, the addresses no name may lead to, the decision, and the proxy that applies it outside the
sandbox (one ``EgressGate``, a unix socket with its policy and its records, per sandbox).

A package of its own rather than part of ``engine.sandbox``: the sandbox's modules plan a
process (pure data and argv), while this one runs a service for the sandbox's whole life, with
its own I/O, resolver and records; the sandbox needs of it only a socket directory to bind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "machine_addresses": "_address", "special_class": "_address", "Allowlist": "_allow",
    "DEFAULT_PORTS": "_allow", "AllowEntry": "_allow", "after_lookup": "_decide", "before_lookup": "_decide",
    "Verdict": "_decide", "canonical_host": "_host", "Host": "_host", "show_host": "_host", "EgressGate":
    "_proxy", "Limits": "_proxy", "Resolver": "_proxy", "system_resolver": "_proxy", "ConnectionRecord":
    "_records"
}

if TYPE_CHECKING:
    from ._address import machine_addresses, special_class
    from ._allow import DEFAULT_PORTS, AllowEntry, Allowlist
    from ._decide import Verdict, after_lookup, before_lookup
    from ._host import Host, canonical_host, show_host
    from ._proxy import EgressGate, Limits, Resolver, system_resolver
    from ._records import ConnectionRecord

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Allowlist", "ConnectionRecord", "DEFAULT_PORTS", "AllowEntry", "EgressGate", "Host", "Limits", "Resolver",
    "Verdict", "after_lookup", "before_lookup", "canonical_host", "machine_addresses", "show_host",
    "special_class", "system_resolver"
]
