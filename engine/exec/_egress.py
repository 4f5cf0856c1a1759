"""``exec FILE``'s way out (``--allow-net``): the script's egress gate, served by a thread of
its own while the script runs (``run_script`` waits in a loop of its own, not asyncio's).

The gate's socket lies in a private directory (mode 0700, the caller's: the script runs as the
caller) that the script's sandbox is shown read-only, and no other sandbox is.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path

from engine.net import Allowlist, EgressGate
from engine.trees import remove_tree
from worker.contract.egress import SOCKET_NAME

__all__ = ["ScriptGate"]

_SECONDS = 10.0  # to start the thread's loop, and to close the gate


class ScriptGate:
    """The gate of one script's sandbox: ``directory`` to show it, ``socket`` to name in its
    setup; ``close()`` ends every connection and returns their records (dicts), oldest first."""

    def __init__(self, allowlist: Allowlist) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="agentloop-net-"))
        self.socket = str(self.directory / SOCKET_NAME)
        self._loop = asyncio.new_event_loop()
        self._gate = EgressGate(self.socket, allowlist)
        self._thread = threading.Thread(target=self._loop.run_forever, name="agentloop-egress", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._gate.start(), self._loop).result(_SECONDS)
        except BaseException:
            self.close()
            raise

    def close(self) -> list[dict]:
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._gate.close(), self._loop).result(_SECONDS)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(_SECONDS)
        if not self._loop.is_running():
            self._loop.close()
        remove_tree(self.directory)
        return [record.to_dict() for record in self._gate.records]
