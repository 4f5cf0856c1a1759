"""Which addresses a name may never lead to: the host's own, the local networks', the clouds'
metadata services, and every range the IANA special-purpose registries set aside.

``special_class`` names the class of an address a proxy must not dial for a name (loopback,
private, link-local, CGNAT, a metadata service, ...), or None for an ordinary public address.
``machine_addresses`` are the addresses of this machine's own interfaces: a public one of them
leads to the machine's own services as surely as 127.0.0.1 does.
IPv6 forms that carry an IPv4 address (mapped, compatible, SIIT, NAT64, 6to4) are judged by the
address they carry: ``64:ff9b::a9fe:a9fe`` is 169.254.169.254 behind a NAT64 gateway.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

__all__ = ["machine_addresses", "special_class"]

_LINK_LOCAL = "a link-local address (cloud metadata services live at 169.254.169.254)"
_PRIVATE = "a private address"
_DOCUMENTATION = "a documentation address"

#: IPv4 ranges no name may lead to (RFC 6890 and the IANA special-purpose registry), most
#: specific first, each with the words a refusal says.
_IPV4 = tuple((IPv4Network(net), words) for net, words in (
    ("168.63.129.16/32", "Azure's host metadata service (WireServer)"),
    ("0.0.0.0/8", "'this network' (0.0.0.0 reaches the machine's own services)"),
    ("10.0.0.0/8", _PRIVATE),
    ("100.64.0.0/10", "a shared (CGNAT) address (Alibaba Cloud's metadata service is 100.100.100.200)"),
    ("127.0.0.0/8", "a loopback address"),
    ("169.254.0.0/16", _LINK_LOCAL),
    ("172.16.0.0/12", _PRIVATE),
    ("192.0.0.0/24", "an IETF protocol assignment"),
    ("192.0.2.0/24", _DOCUMENTATION),
    ("192.88.99.0/24", "the 6to4 relay anycast range"),
    ("192.168.0.0/16", _PRIVATE),
    ("198.18.0.0/15", "a benchmarking address"),
    ("198.51.100.0/24", _DOCUMENTATION),
    ("203.0.113.0/24", _DOCUMENTATION),
    ("224.0.0.0/4", "a multicast address"),
    ("240.0.0.0/4", "a reserved address (or the broadcast address)"),
))

#: IPv6 ranges refused outright (those that carry an IPv4 address are below).
_IPV6 = tuple((IPv6Network(net), words) for net, words in (
    ("::/128", "the unspecified address (it reaches the machine's own services)"),
    ("::1/128", "a loopback address"),
    ("::ffff:0:0:0/96", "an IPv4-translated (SIIT) address"),
    ("64:ff9b:1::/48", "a local-use NAT64 address"),
    ("100::/64", "a discard-only address"),
    ("2001::/23", "an IETF protocol assignment (Teredo, benchmarking, ORCHID)"),
    ("2001:db8::/32", _DOCUMENTATION),
    ("3fff::/20", _DOCUMENTATION),
    ("5f00::/16", "a segment routing (SRv6) address"),
    ("fc00::/7", "a unique local (private) address (AWS's metadata service is fd00:ec2::254)"),
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a site-local address"),
    ("ff00::/8", "a multicast address"),
))

_MAPPED = IPv6Network("::ffff:0:0/96")
_COMPATIBLE = IPv6Network("::/96")
_NAT64 = IPv6Network("64:ff9b::/96")
_6TO4 = IPv6Network("2002::/16")


def _embedded(address: IPv6Address) -> tuple[IPv4Address, str] | None:
    """The IPv4 address an IPv6 form carries, and the form's name; None for a plain one."""
    value = int(address)
    if address in _MAPPED:
        return IPv4Address(value & 0xFFFFFFFF), "IPv4-mapped"
    if address in _COMPATIBLE:
        return IPv4Address(value & 0xFFFFFFFF), "IPv4-compatible"
    if address in _NAT64:
        return IPv4Address(value & 0xFFFFFFFF), "NAT64"
    if address in _6TO4:
        return IPv4Address((value >> 80) & 0xFFFFFFFF), "6to4"
    return None


def special_class(address: IPv4Address | IPv6Address) -> str | None:
    """Words for the class of ``address`` when no name may lead to it, else None (public)."""
    if isinstance(address, IPv4Address):
        return next((words for net, words in _IPV4 if address in net), None)
    for net, words in _IPV6:
        if address in net:
            return words
    carried = _embedded(address)
    if carried is None:
        return None
    inner, form = carried
    if form == "IPv4-compatible":
        return f"a deprecated IPv4-compatible address (of {inner})"
    words = special_class(inner)
    return None if words is None else f"a {form} form of {inner}, {words}"


def machine_addresses() -> frozenset[IPv4Address | IPv6Address]:
    """Every address of this machine's interfaces, as the kernel lists them now (IPv4 by
    ``SIOCGIFCONF``, secondary addresses included; IPv6 from ``/proc/net/if_inet6``)."""
    import array
    import fcntl
    import socket
    import struct

    found: set[IPv4Address | IPv6Address] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        size = 40  # struct ifreq on 64-bit Linux
        for count in (64, 1024, 16384):
            buf = array.array("B", bytes(size * count))
            used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), 0x8912, struct.pack("iL", len(buf),  # SIOCGIFCONF
                                                                                    buf.buffer_info()[0])))[0]
            if used < len(buf):
                break
        data = buf.tobytes()[:used]
        found |= {IPv4Address(data[i + 20:i + 24]) for i in range(0, used, size)}  # sin_addr of ifr_addr
    try:
        with open("/proc/net/if_inet6") as f:
            found |= {IPv6Address(int(line.split()[0], 16)) for line in f if line.strip()}
    except OSError:
        pass
    return frozenset(found)
