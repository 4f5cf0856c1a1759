"""The egress allowlist's pure parts: entries, canonical hosts, address classes, the decision.

The decision is checked exhaustively over a finite world (every allowlist of up to three
entries from a pool, every host of a list, every port of a list) against a model of the rules
written here independently of the code: label lists instead of string suffixes."""

from __future__ import annotations

import itertools
from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest

from engine.errors import ConfigError
from engine.net import (
    AllowEntry,
    Allowlist,
    after_lookup,
    before_lookup,
    canonical_host,
    machine_addresses,
    show_host,
    special_class,
)

# -- canonical hosts ---------------------------------------------------------------------------

CANONICAL = [
    ("example.com", "example.com"), ("Example.COM.", "example.com"), ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("a-b.example", "a-b.example"), ("127.0.0.1", IPv4Address("127.0.0.1")), ("0.0.0.0", IPv4Address("0.0.0.0")),
    ("[::1]", IPv6Address("::1")), ("[::]", IPv6Address("::")), ("[2001:DB8::7]", IPv6Address("2001:db8::7")),
    # IPv4-mapped is the IPv4 address itself, in either spelling.
    ("[::ffff:127.0.0.1]", IPv4Address("127.0.0.1")), ("[::ffff:7f00:1]", IPv4Address("127.0.0.1")),
    ("[::127.0.0.1]", IPv6Address("::7f00:1")), ("localhost.", "localhost"), ("LOCALHOST", "localhost"),
    ("127.0.0.1.", IPv4Address("127.0.0.1")),  # (one trailing dot, as for a name: WHATWG reads it so too)
]

#: Every spelling glibc (or a URL parser) reads as another address or name: never guessed.
REFUSED_SPELLINGS = [
    "127.1", "0x7f.0.0.1", "0x7f.1", "0x7f000001", "2130706433", "0177.0.0.1", "017700000001", "127.000.000.001",
    "0", "1.2.3", "example.123", "ex.0x", "127.0.0.01", "256.0.0.1", "[fe80::1%25lo]", "[fe80::1%lo]",
    "::1", "[::1", "::1]", "a..b", "-a.com", "a-.com", "a_b.com", ".example.com", "", ".", "evil.com#.allowed.com",
    "allowed.com@evil.com", "allowed.com\\@evil.com", "allowed.com/evil", "allowed.com?x", "allowed%2ecom",
    "allowed .com", "allowed.com\t", "allowed.com\x00", "a" * 64 + ".com", ".".join(["a" * 63] * 4) + ".com",
    "bücher.example", "аllowed.com",  # (a Cyrillic а: a request must send A-labels)
]


@pytest.mark.parametrize("text,expected", CANONICAL)
def test_canonical_hosts(text, expected):
    assert canonical_host(text) == expected


@pytest.mark.parametrize("text", REFUSED_SPELLINGS)
def test_every_other_spelling_is_refused(text):
    with pytest.raises(ConfigError):
        canonical_host(text)


def test_a_person_may_write_a_name_in_unicode():
    assert canonical_host("bücher.example", unicode=True) == "xn--bcher-kva.example"
    assert canonical_host("ＥＸＡＭＰＬＥ.com", unicode=True) == "example.com"  # (UTS 46 maps full width)
    # A homograph is another name: it matches only what its own A-labels match.
    homograph = canonical_host("аllowed.com", unicode=True)
    assert homograph.startswith("xn--") and homograph.endswith(".com") and homograph != "allowed.com"


def test_show_host_brackets_ipv6():
    assert show_host(IPv6Address("::1"), 443) == "[::1]:443"
    assert show_host(IPv4Address("192.0.2.1"), 80) == "192.0.2.1:80"
    assert show_host("example.com") == "example.com"


# -- address classes --------------------------------------------------------------------------

SPECIAL = {
    "0.0.0.0": "this network", "0.1.2.3": "this network", "10.1.2.3": "private", "100.64.0.1": "CGNAT",
    "100.100.100.200": "Alibaba", "127.0.0.1": "loopback", "127.255.255.254": "loopback",
    "169.254.169.254": "link-local", "169.254.170.2": "link-local", "172.16.0.1": "private",
    "172.31.255.255": "private", "192.0.0.192": "IETF", "192.0.2.1": "documentation", "192.88.99.1": "6to4",
    "192.168.1.1": "private", "198.18.0.1": "benchmarking", "198.51.100.1": "documentation",
    "203.0.113.1": "documentation", "224.0.0.1": "multicast", "240.0.0.1": "reserved",
    "255.255.255.255": "broadcast", "168.63.129.16": "Azure",
    "::": "unspecified", "::1": "loopback", "::ffff:127.0.0.1": "loopback", "::ffff:10.0.0.1": "private",
    "::127.0.0.1": "IPv4-compatible", "::8.8.8.8": "IPv4-compatible", "::ffff:0:7f00:1": "SIIT",
    "64:ff9b::a9fe:a9fe": "NAT64 form of 169.254.169.254", "64:ff9b::7f00:1": "loopback",
    "64:ff9b:1::1": "local-use NAT64", "100::1": "discard", "2001::1": "Teredo", "2001:2::1": "IETF",
    "2001:db8::1": "documentation", "2002:a9fe:a9fe::": "6to4 form of 169.254.169.254",
    "2002:7f00:1::1": "loopback", "3fff::1": "documentation", "5f00::1": "SRv6", "fd00:ec2::254": "unique local",
    "fc00::1": "unique local", "fe80::1": "link-local", "fec0::1": "site-local", "ff02::1": "multicast",
}
PUBLIC = ["93.184.216.34", "8.8.8.8", "1.1.1.1", "100.63.255.255", "100.128.0.0", "172.15.255.255",
          "172.32.0.0", "192.0.1.255", "192.0.3.0", "192.169.0.0", "198.17.255.255", "198.20.0.0",
          "223.255.255.255", "168.63.129.15", "168.63.129.17", "2001:4860:4860::8888", "2606:4700::1111",
          "64:ff9b::808:808", "2002:808:808::1", "2001:200::1"]


@pytest.mark.parametrize("address,words", SPECIAL.items())
def test_addresses_no_name_may_lead_to(address, words):
    found = special_class(ip_address(address))
    assert found is not None and words in found, (address, found)


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses(address):
    assert special_class(ip_address(address)) is None


# -- entries -----------------------------------------------------------------------------------

GOOD_ENTRIES = {
    "example.com": "example.com", " Example.COM. ": "example.com", "example.com:8443": "example.com:8443",
    "*.example.com": "*.example.com", "**.example.com": "**.example.com", "*.Example.com:8080": "*.example.com:8080",
    "bücher.example": "xn--bcher-kva.example", "192.0.2.7": "192.0.2.7", "127.0.0.2:8080": "127.0.0.2:8080",
    "[2001:db8::7]": "[2001:db8::7]", "[2001:db8::7]:443": "[2001:db8::7]:443", "[::ffff:10.0.0.5]:22": "10.0.0.5:22",
    "10.0.0.5:443": "10.0.0.5:443", "corp.internal": "corp.internal",
}

#: Entries refused, with a piece of what the refusal must say.
BAD_ENTRIES = {
    "*": "wildcard", "**": "wildcard", "*.com": "top-level domain", "**.com": "top-level domain",
    "a.*.example.com": "wildcard", "*example.com": "wildcard", "***.example.com": "wildcard",
    "example.com:0": "not a port", "example.com:65536": "not a port", "example.com:080": "not a port",
    "example.com:+80": "not a port", "example.com:": "not a port", "example.com:http": "not a port",
    "127.1": "usual form", "2130706433": "usual form", "::1": "brackets", "[::1": "not closed",
    "[::1]x": "only :PORT", "*.127.0.0.1": "never an address", "0.0.0.0": "not an address to connect to",
    "[::]": "not an address to connect to", "224.0.0.1": "not an address to connect to",
    "255.255.255.255": "not an address to connect to", "localhost": "never allowed by name",
    "localhost:8000": "never allowed by name", "*.localhost": "never allowed by name",
    "a.localhost": "never allowed by name", "metadata.google.internal": "never allowed by name",
    "metadata": "never allowed by name", "*.internal": "one by one", "**.corp.internal": "one by one",
    "http://example.com": "HOST or HOST:PORT", "example.com/path": "HOST or HOST:PORT",
    "user@example.com": "HOST or HOST:PORT", "exa mple.com": "HOST or HOST:PORT", "": "empty",
}


@pytest.mark.parametrize("text,canonical", GOOD_ENTRIES.items())
def test_entries(text, canonical):
    entry = AllowEntry.parse(text)
    assert str(entry) == canonical
    assert AllowEntry.parse(str(entry)) == entry  # the canonical spelling means the same


@pytest.mark.parametrize("text,words", BAD_ENTRIES.items())
def test_bad_entries_say_what_to_write(text, words):
    with pytest.raises(ConfigError) as caught:
        AllowEntry.parse(text, "network.allow")
    assert words in str(caught.value) and "network.allow" in str(caught.value), str(caught.value)


def test_allowlist_drops_duplicates_and_refuses_what_is_no_list():
    allow = Allowlist.parse(["Example.com", "example.com.", "example.com:8443"])
    assert allow.texts() == ["example.com", "example.com:8443"]
    assert not Allowlist() and allow
    for bad in ("example.com", [1], [None]):
        with pytest.raises(ConfigError):
            Allowlist.parse(bad)  # type: ignore[arg-type]


def test_default_ports_are_https_and_http():
    allow = Allowlist.parse(["example.com"])
    assert [before_lookup(allow, "example.com", p).allowed for p in (443, 80, 8443, 22)] == [True, True, False, False]
    only = Allowlist.parse(["example.com:8443"])
    assert [before_lookup(only, "example.com", p).allowed for p in (443, 80, 8443)] == [False, False, True]


# -- the decision, exhaustively ------------------------------------------------------------------

POOL = ["example.com", "*.example.com", "**.example.com", "example.com:8443", "x.internal", "93.184.216.34",
        "127.0.0.2:8080", "[2001:4860::8888]", "10.0.0.5"]
HOSTS = ["example.com", "a.example.com", "a.b.example.com", "example.com.evil", "badexample.com", "com",
         "other.org", "x.internal", "y.x.internal", "example.internal", "localhost", "a.localhost",
         "metadata.google.internal", "metadata", IPv4Address("93.184.216.34"), IPv4Address("127.0.0.2"),
         IPv4Address("10.0.0.5"), IPv4Address("10.0.0.6"), IPv6Address("::1"), IPv6Address("2001:4860::8888")]
PORTS = [80, 443, 8443, 8080, 22]
NEVER = {"localhost", "metadata", "metadata.goog", "metadata.google.internal"}


def _model_matches(entry: str, host) -> tuple[bool, tuple[int, ...]]:
    """The rules in other words: a wildcard entry's labels are a proper tail of the host's
    (``*.``) or any tail (``**.``); an address matches itself; .internal needs exactness."""
    spelled, ports = entry, (443, 80)
    if spelled.startswith("[") or spelled[0].isdigit():
        addr, _, port = spelled.rpartition(":") if spelled.count(":") == 1 or "]:" in spelled else (spelled, "", "")
        addr = addr.strip("[]")
        return (not isinstance(host, str) and host == ip_address(addr)), ((int(port),) if port else ports)
    name, _, port = spelled.partition(":")
    ports = (int(port),) if port else ports
    if not isinstance(host, str):
        return False, ports
    wild = 2 if name.startswith("**.") else 1 if name.startswith("*.") else 0
    labels, own = host.split("."), name.lstrip("*.").split(".")
    internal = labels[-1] == "internal"
    if wild == 0:
        return labels == own, ports
    tail = labels[-len(own):] == own
    deeper = len(labels) > len(own)
    return (not internal and tail and (deeper or wild == 2)), ports


def _model(entries: tuple[str, ...], host, port: int) -> str:
    if isinstance(host, str) and (host in NEVER or host.split(".")[-1] == "localhost"):
        return "denied-name"
    ports = [p for e in entries for ok, ps in [_model_matches(e, host)] if ok for p in ps]
    if not ports:
        return "not-listed"
    return "" if port in ports else "port"


def test_the_decision_before_lookup_matches_the_rules_everywhere():
    checked = 0
    for size in range(4):
        for entries in itertools.combinations(POOL, size):
            allow = Allowlist.parse(entries)
            for host, port in itertools.product(HOSTS, PORTS):
                verdict = before_lookup(allow, host, port)
                expected = _model(entries, host, port)
                assert (verdict.allowed, verdict.why) == (expected == "", expected), (entries, host, port, verdict)
                if verdict.why in ("not-listed", "port"):
                    assert verdict.hint == f"--allow-net {show_host(host, port)}", verdict
                    assert show_host(host) in verdict.words
                checked += 1
    assert checked == sum(1 for n in range(4) for _ in itertools.combinations(POOL, n)) * len(HOSTS) * len(PORTS)


ANSWERS = [IPv4Address("93.184.216.34"), IPv4Address("127.0.0.2"), IPv4Address("10.0.0.5"),
           IPv4Address("169.254.169.254"), IPv6Address("2001:4860::8888"), IPv6Address("fd00:ec2::254")]


def test_the_decision_after_lookup_matches_the_rules_everywhere():
    for size in range(3):
        for entries in itertools.combinations(POOL, size):
            allow = Allowlist.parse(["example.com", *entries])
            for n in range(3):
                for answers in itertools.permutations(ANSWERS, n):
                    for port in PORTS:
                        verdict = after_lookup(allow, "example.com", port, list(answers))
                        listed = {(a, p) for e in entries for a in answers
                                  for ok, ps in [_model_matches(e, a)] if ok for p in ps}
                        bad = [a for a in answers if special_class(a) and (a, port) not in listed]
                        if not answers:
                            assert verdict.why == "no-address"
                        elif bad:
                            assert verdict.why == "special-address" and str(bad[0]) in verdict.words, verdict
                            assert verdict.hint == f"--allow-net {show_host(bad[0], port)}"
                        else:
                            assert verdict.allowed, (entries, answers, port, verdict)


def test_refusals_say_why_and_what_would_allow_it():
    allow = Allowlist.parse(["example.com", "127.0.0.2:8080"])
    v = before_lookup(allow, "evil.example", 443)
    assert v.words == "the host evil.example is not on this sandbox's network allowlist"
    assert v.hint == "--allow-net evil.example:443"
    v = before_lookup(allow, "example.com", 22)
    assert (v.words, v.hint) == ("example.com is allowed on ports 443, 80 only, not 22", "--allow-net example.com:22")
    v = before_lookup(allow, IPv4Address("127.0.0.1"), 8080)
    assert "127.0.0.1 (a loopback address) is not on" in v.words and v.hint == "--allow-net 127.0.0.1:8080"
    v = after_lookup(allow, "example.com", 443, [IPv4Address("127.0.0.2")])
    assert "example.com resolves to 127.0.0.2, a loopback address" in v.words
    assert v.hint == "--allow-net 127.0.0.2:443"  # (listed with 8080, not 443)
    assert after_lookup(allow, "example.com", 8080, [IPv4Address("127.0.0.2")]).allowed
    v = before_lookup(allow, "localhost", 443)
    assert v.why == "denied-name" and not v.hint


def test_a_name_never_leads_to_the_machine_itself_unless_its_address_is_listed():
    mine = IPv4Address("8.8.4.4")  # (a public address of this machine, as far as the decision knows)
    allow = Allowlist.parse(["example.com"])
    v = after_lookup(allow, "example.com", 443, [IPv4Address("93.184.216.34"), mine], machine={mine})
    assert (v.why, v.hint) == ("special-address", "--allow-net 8.8.4.4:443")
    assert "8.8.4.4, an address of this machine" in v.words
    assert after_lookup(allow, "example.com", 443, [IPv4Address("93.184.216.34")], machine={mine}).allowed
    listed = Allowlist.parse(["example.com", "8.8.4.4"])
    assert after_lookup(listed, "example.com", 443, [mine], machine={mine}).allowed


def test_the_machines_addresses_are_its_interfaces():
    import socket

    found = machine_addresses()
    assert IPv4Address("127.0.0.1") in found and IPv4Address("192.0.2.99") not in found
    for address in found - {IPv6Address("::1")}:
        if isinstance(address, IPv4Address):  # each can be bound: it is this machine's
            with socket.socket() as s:
                s.bind((str(address), 0))


def test_the_face_names_what_it_exports():
    import engine.net as net

    assert sorted(net._WHERE) == sorted(net.__all__)
    for name in net.__all__:
        assert getattr(net, name) is not None

