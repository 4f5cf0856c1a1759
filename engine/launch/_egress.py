"""A run's ways out (``--allow-net``): one egress gate per sandbox, opened as its process is
planned, closed when it ends, its connections kept for the run's record.

Each process the launcher starts in a sandbox of its own (a worker, a sample slot) gets a
``engine.net.EgressGate`` on a socket in that process's own socket directory, which the sandbox
shows it (and no other sandbox), so the socket a connection arrives on says whose allowlist
applies.  Without an allowlist nothing here runs: no gate, no socket, no forwarder.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ConfigError
from worker.contract.egress import FORWARDER_PORT, SOCKET_NAME, proxy_environment

if TYPE_CHECKING:
    from engine.net import Allowlist, EgressGate
    from engine.sandbox import LaunchPlan

__all__ = ["Gates", "proxy_env"]

log = logging.getLogger("agentloop.net")

#: The connections a run's record keeps in all, beyond which they are counted only.
_RECORDED = 100_000


def proxy_env() -> dict[str, str]:
    """The proxy variables of a process whose forwarder listens on ``FORWARDER_PORT``."""
    return proxy_environment(FORWARDER_PORT)


class Gates:
    """The gates of one run, by socket directory; ``records`` holds the connections of the
    gates closed so far (dicts: ``ConnectionRecord``'s fields and ``process``, the name of the
    socket directory: ``w3``), ``dropped`` those left out; ``path``, when given, receives each
    as a JSON line as its gate closes."""

    def __init__(self, allowlist: Allowlist, path: Path | None = None) -> None:
        self.allowlist = allowlist
        self.path = path
        self.records: list[dict] = []
        self.dropped = 0
        self._open: dict[Path, EgressGate] = {}
        self._taken: dict[Path, set[int]] = {}  # per open gate: its records already taken (ids)

    def open(self, sock_dir: Path, plan: LaunchPlan, allowlist: Allowlist | None = None) -> str:
        """Open the gate of the process shown ``sock_dir`` (given to its uid); the socket's path
        for its start (``StartSpec.egress``).  ``allowlist``: this process's own (a sample's
        slot), else the run's.  Must run in the event loop that serves the gate."""
        if plan.bwrap is None:
            raise ConfigError("--allow-net needs the bubblewrap sandbox (an empty network namespace with one way "
                              "out), and this machine's workers run without it (agentloop doctor says why)")
        from engine.net import EgressGate  # (a run without an allowlist never imports the proxy)

        assert sock_dir not in self._open, "a socket directory is made for one process"
        gate = EgressGate(sock_dir / SOCKET_NAME, allowlist or self.allowlist).listen()
        self._open[sock_dir] = gate  # (closed with the directory's process, whatever happens next)
        plan.grant(gate.path)
        return str(gate.path)

    def gate(self, sock_dir: Path | None) -> EgressGate | None:
        """The open gate of the process shown ``sock_dir``, if it has one."""
        return None if sock_dir is None else self._open.get(sock_dir)

    def take(self, sock_dir: Path | None) -> list[dict]:
        """The connections of ``sock_dir``'s open gate that ended, or were refused (nothing more
        passes on those, though the client may hold them open), since the last ``take``, oldest
        first (dicts, as ``records`` holds them); one still carrying bytes waits for a later call."""
        gate = self.gate(sock_dir)
        if gate is None:
            return []
        assert sock_dir is not None
        taken = self._taken.setdefault(sock_dir, set())
        fresh = [r for r in gate.records if id(r) not in taken
                 and (r.seconds is not None or (r.verdict != "allowed" and r.status))]
        taken.update(id(r) for r in fresh)
        return [{**r.to_dict(), "process": sock_dir.name} for r in fresh]

    async def settled_take(self, sock_dir: Path | None, settle: float) -> list[dict]:
        """``take``, once the gate's connections open now have ended or ``settle`` s passed."""
        gate = self.gate(sock_dir)
        if gate is not None:
            await gate.settled(settle)
        return self.take(sock_dir)

    async def close(self, sock_dir: Path | None) -> list[dict]:
        """Close the gate of ``sock_dir`` (its sandbox has ended): its connections end, and are
        recorded; returns them."""
        gate = None if sock_dir is None else self._open.pop(sock_dir, None)
        return [] if gate is None else await self._close(sock_dir, gate)

    async def close_all(self) -> None:
        for sock_dir, gate in list(self._open.items()):
            self._open.pop(sock_dir, None)
            await self._close(sock_dir, gate)

    async def _close(self, sock_dir: Path, gate: EgressGate) -> list[dict]:
        await gate.close()
        self._taken.pop(sock_dir, None)
        records = [{**r.to_dict(), "process": sock_dir.name} for r in gate.records]
        room = max(0, _RECORDED - len(self.records))
        self.records += records[:room]
        self.dropped += gate.dropped + max(0, len(records) - room)
        if self.path is not None and records:
            try:
                await asyncio.to_thread(_append, self.path, records)
            except OSError as exc:
                log.warning("cannot record the network connections in %s: %s", self.path, exc)
        return records


def _append(path: Path, records: list[dict]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
