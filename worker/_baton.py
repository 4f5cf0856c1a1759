"""Which of the worker's threads listens to the socket.

The listener runs a block it received itself and keeps the baton while it does: a short
block then costs no thread wake-up at all, on the way in or out.  A block that runs longer
than ``STEAL_AFTER`` has the baton taken by a waiting thread, which listens from then on
(cancels, host-call replies and output ticks wait that long at most).  A block that waits
for a host call gives the baton up at once, since its reply must be heard.

Waiting threads sleep untimed while the worker is idle.  Once blocks run they watch with
timed waits (one wake-up per ``STEAL_AFTER`` at most, not one per block) until the worker
has been quiet for ``WATCH_FOR``.
"""

from __future__ import annotations

import threading
import time

STEAL_AFTER = 0.002
WATCH_FOR = 0.1


class Baton:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: int | None = None  # thread ident of the listener
        self._busy_since: float | None = None  # when the holder started running a block
        self._watch_until = 0.0
        self.waiters = 0

    def take(self) -> None:
        """Wait until this thread may listen: the baton is free, or its holder has been
        running a block for longer than ``STEAL_AFTER``."""
        with self._cond:
            self.waiters += 1
            try:
                while self._holder is not None:
                    now = time.monotonic()
                    if self._busy_since is not None:
                        due = self._busy_since + STEAL_AFTER
                        if now >= due:
                            break
                        self._cond.wait(due - now)
                    elif now < self._watch_until:
                        self._cond.wait(STEAL_AFTER)
                    else:
                        self._cond.wait()
                self._holder = threading.get_ident()
                self._busy_since = None
            finally:
                self.waiters -= 1

    def busy(self) -> bool:
        """The holder is about to run a block.  Returns whether a thread waits to take over
        (if not, the caller must start one)."""
        with self._cond:
            now = time.monotonic()
            self._busy_since = now
            if now >= self._watch_until:
                self._cond.notify()  # waiters sleep untimed: one starts watching
            self._watch_until = now + WATCH_FOR
            return self.waiters > 0

    def done(self) -> bool:
        """The block is done; True if this thread still holds the baton (and listens on)."""
        with self._cond:
            if self._holder != threading.get_ident():
                return False
            self._busy_since = None
            return True

    def give_up(self) -> None:
        """If this thread holds the baton, let another thread listen now."""
        with self._cond:
            if self._holder == threading.get_ident():
                self._holder = self._busy_since = None
                self._cond.notify()
