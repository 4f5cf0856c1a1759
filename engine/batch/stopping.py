"""When a batch stops: Ctrl-C or SIGTERM (a second one leaves at once), or an infrastructure
that keeps failing."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from engine.errors import EXIT_INTERRUPTED, AlreadyOwned

__all__ = ["Stopper", "infra_threshold"]


class Stopper:
    """Interrupts: the first stops starting runs and tells the scheduler that adopted the
    stopper (it cancels the running ones); the second leaves at once — every finished record is
    already fsynced.  A scheduler that only asks ``interrupted`` adopts nothing."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.interrupted = False
        self._on_stop: Callable[[], None] | None = None

    def adopt(self, on_stop: Callable[[], None]) -> None:
        """Make ``on_stop`` what the first interrupt calls: one scheduler owns a stopper, and
        AlreadyOwned says so if a second tries (it would take the first one's interrupt)."""
        if self._on_stop is not None:
            raise AlreadyOwned("this stopper already cancels another scheduler's runs; make a Stopper per batch")
        self._on_stop = on_stop

    @property
    def stopping(self) -> bool:
        return self.reason is not None

    def interrupt(self) -> None:
        if self.interrupted:
            _leave_now()
        self.interrupted = True
        self.reason = "interrupted"
        print("\nagentloop: interrupted — cancelling the running runs (Ctrl-C again to leave at once)",
              file=sys.stderr, flush=True)
        if self._on_stop is not None:
            self._on_stop()

    def abort(self, reason: str) -> None:
        """Stop starting runs, letting the running ones finish."""
        if self.reason is None:
            self.reason = reason


def _leave_now() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\x1b[?25h\n")  # the progress bar hid the cursor
    sys.stderr.write("agentloop: left at once; finished results are on disk\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def infra_threshold(parallel: int) -> int:
    """Infrastructure failures in a row after which the batch stops starting runs."""
    return max(5, 2 * parallel)
