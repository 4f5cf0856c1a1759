"""A sync block's thread as interrupts see it: whether one may be given, how it is given (a
signal to the main thread, an asynchronous exception elsewhere), and the words for what it did.
``runtime`` decides when; this module holds the mechanics and their corner cases."""

from __future__ import annotations

import ctypes
import signal
import threading

from .contract.limits import INTERRUPT_SIGNAL

__all__ = ["MAIN", "SIGNAL_BIT", "Running", "deadline_error", "deadline_words", "has_signal", "interrupt_note",
           "task_status"]

#: The process's main thread (kept by a child the main thread forks: the fork server's).
MAIN = threading.main_thread().ident
SIGNAL_BIT = 1 << (INTERRUPT_SIGNAL - 1)


def deadline_error(deadline: float | None) -> type[TimeoutError]:
    """A ``TimeoutError`` class whose instances (made without arguments, as an exception raised
    in another thread is) name the deadline.  It prints as ``TimeoutError``."""
    text = deadline_words(deadline)

    def __init__(self, *args) -> None:  # noqa: N807
        TimeoutError.__init__(self, *(args or (text,)))

    return type("TimeoutError", (TimeoutError,), {"__init__": __init__, "__module__": "builtins"})


def deadline_words(deadline: float | None) -> str:
    return (f"the block's deadline ({deadline:g} s) passed" if deadline is not None
            else "the block's deadline passed")


class Running:
    """A sync block's thread, as far as interrupts are concerned.  An interrupt is given only
    while the block runs: on the main thread through ``INTERRUPT_SIGNAL`` (whose handler checks
    ``active`` and ``pending``, both set and read on that thread between bytecodes), elsewhere
    as an asynchronous exception, of which one that lands late is cleared before the thread
    does anything else."""

    __slots__ = ("ident", "native_id", "on_main", "lock", "active", "ended", "cancelled", "reason",
                 "deadline", "pending", "deferred", "given", "exc_type")

    def __init__(self) -> None:
        self.ident: int | None = None
        self.native_id: int | None = None
        self.on_main = False
        self.lock = threading.Lock()
        self.active = False
        self.ended = False
        self.cancelled = False  # interrupted before it started: it never runs
        self.reason: str | None = None  # "timeout" or "cancel", once an interrupt was asked for
        self.deadline: float | None = None
        self.pending = False  # main thread: the signal's handler has yet to raise
        self.deferred = False  # main thread: ... because it ran while output was being sent
        self.given = ""  # main thread: what the handler raised ("its SIGINT handler" if it called that)
        self.exc_type: type[BaseException] | None = None  # another thread: what was raised there

    def enter(self) -> bool:
        """The block starts in this thread; False if it was cancelled before it could."""
        with self.lock:
            self.ident, self.native_id = threading.get_ident(), threading.get_native_id()
            self.on_main = self.ident == MAIN
            self.active = not self.cancelled
            return self.active

    def leave(self) -> None:
        # An interrupt may land anywhere until ``active`` is False: retry until the thread is
        # out of reach, then clear what was raised but not yet delivered.
        while True:
            try:
                if self.on_main:
                    self.active = False  # the handler checks it on this very thread
                    self.pending = False
                else:
                    with self.lock:
                        self.active = False
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), None)
                self.ended = True
                return
            except BaseException:  # noqa: BLE001, S112 - the interrupt, or the code's SIGINT handler's
                continue

    def interrupt(self, reason: str, deadline: float | None) -> None:
        with self.lock:
            if self.reason is None:
                self.reason, self.deadline = reason, deadline
            if not self.active:
                self.cancelled = not self.ended
                return
            if self.on_main:
                self.pending = True
                signal.pthread_kill(self.ident, INTERRUPT_SIGNAL)
            elif self.exc_type is None:
                self.exc_type = KeyboardInterrupt if reason == "cancel" else deadline_error(deadline)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.ident), ctypes.py_object(self.exc_type))

    def signal_again(self) -> None:
        """The main thread's handler put the interrupt off (it ran in the runtime's own code):
        signal again, so that it lands in the block's."""
        with self.lock:
            if self.on_main and self.active and self.pending:
                signal.pthread_kill(self.ident, INTERRUPT_SIGNAL)

    def took(self, exc: BaseException) -> bool:
        """Whether ``exc``, which ended the block, is (or followed) its interrupt."""
        if self.reason is None:
            return False
        return bool(self.given) or isinstance(exc, (KeyboardInterrupt, TimeoutError))


def interrupt_note(running: Running, status: str) -> str:
    """Words for the coordinator on what an interrupt did to a block that ended with
    ``status`` ("" when none was asked for, or when it is not known to have landed)."""
    if running.reason is None:
        return ""
    if running.cancelled:
        return "it was stopped before it started"
    if running.given == "its SIGINT handler":
        raised = "its SIGINT handler was called"
    else:
        what = running.given or ("KeyboardInterrupt" if running.reason == "cancel" else "TimeoutError")
        raised = f"{what} was raised in it" + ("" if running.on_main else " (in its thread)")
    if status == "cancelled":
        return raised
    if status == "ok" and running.given:
        return f"{raised}, and it finished normally after it"
    return ""


def task_status(native_id: int | None) -> dict[str, str]:
    """Fields of ``/proc/self/task/TID/status`` (State, SigPnd, SigBlk, ...), {} if unreadable."""
    fields: dict[str, str] = {}
    try:
        with open(f"/proc/self/task/{native_id}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        with open("/proc/self/status") as f:  # signals pending for the whole process
            for line in f:
                if line.startswith("ShdPnd:"):
                    fields["ShdPnd"] = line.partition(":")[2].strip()
    except OSError:
        pass
    return fields


def has_signal(fields: dict[str, str], key: str) -> bool:
    try:
        return bool(int(fields.get(key, "0"), 16) & SIGNAL_BIT)
    except ValueError:
        return False
