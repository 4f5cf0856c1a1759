"""What makes a block run as ``python FILE ARGS`` runs a script (``agentloop exec``).

A script run sets the process's ``sys.argv``, ``sys.stdin`` and ``sys.path[0]`` and names the
code after its file, so it is meant for a worker of its own (``exec`` starts a fresh one).
How it ends follows CPython's ``Py_RunMain``: an uncaught exception's traceback, or the
message of ``sys.exit("msg")``, goes to stderr first; then non-daemon threads are waited
for; then ``atexit`` handlers run; the exit status is 0, 1 for an exception, or the
``SystemExit`` code.

``exit_status`` is also what an agent's block uses: there a ``SystemExit`` ends the block,
never the worker.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .contract.wire import ScriptSpec

__all__ = ["ScriptInput", "enter", "exit_status", "finish", "like_main_thread"]

#: How often a reader waiting for stdin wakes, so that a cancel (an exception raised in its
#: thread, which only lands between bytecodes) reaches it instead of a kill.
_WAKE = 0.1


def exit_status(exc: SystemExit) -> tuple[int, str | None]:
    """The process exit status CPython gives a ``SystemExit``, and the text it prints to stderr
    (None when it prints nothing): None -> 0; an int -> that int (the OS keeps its low 8 bits);
    anything else -> its ``str`` printed, status 1."""
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, int):
        return code & 0xFF, None  # bool included, as CPython's PyLong_AsLong takes it
    try:
        text = str(code)
    except Exception:  # noqa: BLE001 - CPython prints nothing useful either
        text = f"<unprintable {type(code).__name__} object>"
    return 1, text


class _Feed(io.RawIOBase):
    """Bytes that arrive in ``stdin`` messages, read as a pipe reads: a read waits until some
    arrive or the end is reached."""

    def __init__(self) -> None:
        super().__init__()
        self._data = bytearray()
        self._eof = False
        self._cond = threading.Condition()

    def feed(self, data: bytes, eof: bool) -> None:
        """Called by the listening thread; never waits for a reader."""
        with self._cond:
            self._data += data
            self._eof = self._eof or eof
            self._cond.notify_all()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        with self._cond:
            while not self._data and not self._eof:
                self._cond.wait(_WAKE)
            n = min(len(buffer), len(self._data))
            buffer[:n] = self._data[:n]
            del self._data[:n]
            return n


class ScriptInput:
    """The stdin of a script run: what the coordinator forwards, or an immediate end of file."""

    def __init__(self, forwarded: bool) -> None:
        self._raw = _Feed()
        if not forwarded:
            self._raw.feed(b"", True)
        # As CPython's stdin on a pipe under a UTF-8 locale: buffered, strict UTF-8.
        self.stream = io.TextIOWrapper(io.BufferedReader(self._raw), encoding="utf-8", errors="strict")

    def feed(self, data: bytes, eof: bool) -> None:
        self._raw.feed(data, eof)


def enter(namespace: dict, script: ScriptSpec, stdin: ScriptInput) -> str:
    """Make the process look like ``python FILE ARGS``; returns the code's file name (the
    absolute path, as CPython 3.9+ gives ``__file__``, or ``<stdin>`` for code read from stdin)."""
    path = script.path
    argv = list(script.argv)
    sys.argv = argv or [path or "-"]
    sys.stdin = stdin.stream
    if path:
        namespace["__file__"] = path
        namespace["__cached__"] = None
        if sys.path:  # the script's directory is searched first, as Python does
            sys.path[0] = os.path.dirname(path)
        return str(path)
    return "<stdin>"


def like_main_thread() -> None:
    """Threads the script starts are not daemons unless it says so, as when started from
    Python's main thread (a thread inherits the flag of the thread that made it, and the
    worker's threads are daemons)."""
    threading.current_thread()._daemonic = False  # type: ignore[attr-defined]


def finish() -> None:
    """What the interpreter does after the script's last line: wait for the threads it left
    running that are not daemons, then run the ``atexit`` handlers (their errors are printed,
    as CPython prints them, and change nothing)."""
    me, main = threading.current_thread(), threading.main_thread()
    for thread in threading.enumerate():
        if thread is me or thread is main or thread.daemon:
            continue
        while thread.is_alive():
            thread.join(_WAKE)  # in slices, so a cancel can land
    atexit._run_exitfuncs()
