"""Which of the worker's threads listens to the socket, and which block the main thread runs.

The listener runs a block it received itself and keeps the baton while it does: a short
block then costs no thread wake-up at all, on the way in or out.  A block that runs longer
than ``STEAL_AFTER`` has the baton taken by a waiting thread, which listens from then on
(cancels, host-call replies and output ticks wait that long at most).  A block that waits
for a host call gives the baton up at once, since its reply must be heard.

The main thread is one of the listeners, and the preferred one: a sync block runs on it
whenever it is free (see ``worker.runtime``).  When another thread listens and the main
thread is free, that thread hands the block and the baton over (``hand_to_main``): the main
thread runs the block, then listens on, so blocks that follow run on it again without a
hand-off.

Waiting threads sleep untimed while the worker is idle.  Once blocks run they watch with
timed waits (one wake-up per ``STEAL_AFTER`` at most, not one per block) until the worker
has been quiet for ``WATCH_FOR``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

STEAL_AFTER = 0.002
WATCH_FOR = 0.1


class Baton:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: int | None = None  # thread ident of the listener
        self._busy_since: float | None = None  # when the holder started running a block
        self._watch_until = 0.0
        self.waiters = 0
        self.main = threading.main_thread().ident
        #: The main thread runs nothing (and has said so, see ``main_free``): it may be handed a job.
        self._main_free = False
        self._main_job: Callable[[], object] | None = None

    def take(self) -> Callable[[], object] | None:
        """Wait until this thread may listen: the baton is free, or its holder has been
        running a block for longer than ``STEAL_AFTER``.  For the main thread, also until a
        job is handed to it: then it holds the baton and that job is returned, to run first."""
        me = threading.get_ident()
        with self._cond:
            self.waiters += 1
            try:
                while self._holder is not None and self._holder != me:
                    if me == self.main and self._main_job is not None:
                        # Handed a job, but the baton was stolen before this thread woke up
                        # (``hand_to_main`` marks the main thread busy): the job is still ours
                        # to run; the thief listens meanwhile.
                        return self._pop_main_job()
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
                if self._holder == me:  # handed a job (the main thread only)
                    return self._pop_main_job()
                self._holder = me
                self._busy_since = None
                return None
            finally:
                self.waiters -= 1

    def busy(self) -> bool:
        """The holder is about to run a block.  Returns whether a thread waits to take over
        (if not, the caller must start one)."""
        with self._cond:
            now = time.monotonic()
            self._busy_since = now
            if self._holder == self.main:
                self._main_free = False
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

    # -- the main thread ----------------------------------------------------------------------
    def main_free(self) -> None:
        """Called on the main thread when it has finished what it ran (before the result is
        sent, so that a block sent in answer to it finds the main thread free)."""
        with self._cond:
            self._main_free = self._main_job is None  # a job handed over meanwhile runs first

    def hand_to_main(self, job: Callable[[], object]) -> bool:
        """From the listening thread: if the main thread is free, give it ``job`` and the
        baton (it runs the job, then listens).  False if it is not free."""
        me = threading.get_ident()
        with self._cond:
            if not self._main_free or self._holder != me or me == self.main:
                return False
            self._main_free = False
            self._main_job = job
            self._holder = self.main
            self._busy_since = time.monotonic()  # it runs a block: stealable as any holder's
            self._watch_until = self._busy_since + WATCH_FOR
            self._cond.notify_all()  # the main thread among the waiters
            return True

    def main_job(self) -> Callable[[], object] | None:
        """On the main thread, holding the baton: a job handed to it meanwhile, if any.  The
        baton went to the main thread with the job, under the lock it has taken since (in
        ``done``), so the unlocked look sees a job handed over."""
        if self._main_job is None:
            return None
        with self._cond:
            return self._pop_main_job()

    def _pop_main_job(self) -> Callable[[], object] | None:
        job, self._main_job = self._main_job, None
        if job is not None and self._holder == threading.get_ident():
            self._busy_since = time.monotonic()  # (never for a listening holder: it is not busy)
        return job
