"""What a sandbox's way out records: one entry per connection made to it, allowed or not.

Kept by the sandbox's gate (``engine.net.EgressGate.records``) in the order connections came, at
most a bounded number (the count of those left out is kept too), and filled in as the
connection goes: bytes are counted while they flow, ``seconds`` is set when it ends.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

__all__ = ["ConnectionRecord"]


@dataclass
class ConnectionRecord:
    """One connection: ``host``/``port`` as the proxy understood them (``host`` empty when the
    request could not be read); ``method`` (``CONNECT``, ``GET``, ...); ``verdict``
    ("allowed", "refused": the policy or the request, "failed": allowed, but the server could
    not be reached); ``why`` (a short code: ``engine.net._decide.Verdict``'s, or "malformed",
    "timeout", "resolve", "dial", "busy", "closed"); ``words`` (what the refusal said);
    ``status`` (the HTTP status the proxy answered, or for plain HTTP the server's);
    ``address`` (the address dialled); ``sent`` and ``received`` (bytes from the client to the
    server and back, heads included for plain HTTP, the tunnel's payload for CONNECT)."""

    host: str = ""
    port: int = 0
    method: str = ""
    verdict: str = "refused"
    why: str = ""
    words: str = ""
    status: int = 0
    address: str = ""
    sent: int = 0
    received: int = 0
    started: float = field(default_factory=time.time)
    seconds: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)
