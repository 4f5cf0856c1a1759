"""A terminal of the program's own: ``exec`` at a terminal gives the script a pty and relays.

The script never holds the user's terminal (it could write anything to it, or reopen it through
``/proc/self/fd``): each of its standard streams that is a terminal for ``agentloop exec`` is
the slave of a pty made here, with the terminal's modes and size.  What the script writes
comes out of the master and is made inert (``engine.inert``) before it reaches the user's
terminal, but carriage returns and backspaces pass, so progress bars redraw their line, and
``--color`` lets colours through.  The pty takes the terminal's modes, so the script's newlines
become what the terminal itself would make of them: where the user's terminal turns ``\n``
into ``\r\n`` on its own (``ONLCR``, when it is not in raw mode), the pty's conversion is undone
before the bytes reach it, and the terminal receives exactly what ``python FILE`` would send.  When ``agentloop exec`` reads the terminal (stdin is the
terminal, and it is the foreground job), the user's terminal is put in raw mode and every
keystroke goes to the pty: its line discipline echoes, edits lines, and turns Ctrl-C, Ctrl-\\
and Ctrl-Z into the script's signals, as the terminal itself would (``ssh -t``, ``docker -t``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import termios

from engine.inert import InertStream

__all__ = ["TerminalRelay"]

_CHUNK = 65536
#: Keystrokes held for the pty while the script does not read them, at most.
_INPUT_LIMIT = 1 << 20


class TerminalRelay:
    """One pty for the script: ``slave`` goes to it, the master is read and written here.

    ``terminal``: the user's terminal descriptor whose modes and size the pty copies;
    ``sink``: where the script's output goes (a terminal); ``keyboard``: the descriptor to read
    keystrokes from (the user's terminal as stdin), or None."""

    def __init__(self, terminal: int, sink: int, keyboard: int | None, *, allow_sgr: bool, encoding: str) -> None:
        self.terminal, self.sink, self.keyboard = terminal, sink, keyboard
        self.master, self.slave = os.openpty()
        os.set_blocking(self.master, False)
        self._saved: list | None = None
        self._pending = b""
        self._undo_onlcr = False  # the sink converts newlines itself: undo the pty's conversion
        self._held_cr = False  # a carriage return that ended the last chunk (a newline may follow)
        self._filter = InertStream(allow_sgr=allow_sgr, encoding=encoding, carriage_returns=True, backspaces=True)
        with contextlib.suppress(termios.error):
            termios.tcsetattr(self.slave, termios.TCSANOW, termios.tcgetattr(terminal))
        self.resize()
        self._sink_mode()

    # -- the user's terminal -------------------------------------------------------------------
    def raw(self) -> None:
        """Send every keystroke to the pty (when reading the keyboard, and in the foreground)."""
        if self.keyboard is None or self._saved is not None or not _foreground(self.keyboard):
            return
        with contextlib.suppress(termios.error):
            self._saved = termios.tcgetattr(self.keyboard)
            termios.tcsetattr(self.keyboard, termios.TCSANOW, _raw(self._saved))
        self._sink_mode()

    def restore(self) -> None:
        """The user's terminal as it was (before agentloop speaks, stops or ends)."""
        if self._saved is not None:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(self.keyboard, termios.TCSADRAIN, self._saved)
            self._saved = None
            self._sink_mode()

    def _sink_mode(self) -> None:
        try:
            oflag = termios.tcgetattr(self.sink)[1]
        except termios.error:
            oflag = 0
        self._undo_onlcr = bool(oflag & termios.OPOST and oflag & termios.ONLCR)

    def resize(self) -> None:
        """The pty takes the terminal's size (the kernel then signals SIGWINCH to the script)."""
        with contextlib.suppress(OSError):
            size = fcntl.ioctl(self.terminal, termios.TIOCGWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, size)

    # -- the relay -------------------------------------------------------------------------------
    def read_output(self) -> bool:
        """Move what the script wrote to the sink, made inert; False once no process holds the
        slave any more (the master reads EIO) or, ``drain``ing, once nothing is waiting."""
        try:
            data = os.read(self.master, _CHUNK)
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            data = b""
        if data:
            self._write(self._filter.feed(self._unmap(data)))
            return True
        self._write(self._filter.flush())
        return False

    def _unmap(self, data: bytes) -> bytes:
        """Undo the pty's ``\n`` -> ``\r\n`` where the sink makes it again (an exact inverse:
        every ``\r\n`` the pty sends holds a newline the script wrote)."""
        if not self._undo_onlcr:
            return data
        if self._held_cr:
            data, self._held_cr = b"\r" + data, False
        if data.endswith(b"\r"):
            data, self._held_cr = data[:-1], True
        return data.replace(b"\r\n", b"\n")

    def drain(self) -> None:
        """What is still in the pty once the sandbox has ended (every slave is closed then, so
        the master reads its data and then EIO; a slave still held somewhere ends the drain
        when nothing more is waiting)."""
        while True:
            try:
                data = os.read(self.master, _CHUNK)
            except OSError:  # EIO: the end; EAGAIN: nothing more now
                break
            if not data:
                break
            self._write(self._filter.feed(self._unmap(data)))
        if self._held_cr:
            self._held_cr = False
            self._write(self._filter.feed(b"\r"))
        self._write(self._filter.flush())

    def read_keyboard(self) -> bool:
        """Queue keystrokes for the script; False at the keyboard's end of file."""
        try:
            data = os.read(self.keyboard, _CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            return False
        self._pending = (self._pending + data)[-_INPUT_LIMIT:]
        self.write_input()
        return True

    @property
    def input_pending(self) -> bool:
        return bool(self._pending)

    def write_input(self) -> None:
        """Give the pty what it takes of the queued keystrokes (it holds a few KiB unread)."""
        try:
            while self._pending:
                self._pending = self._pending[os.write(self.master, self._pending):]
        except BlockingIOError:
            pass
        except OSError:
            self._pending = b""

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # a terminal that went away: the script's output is lost with it
            view = memoryview(data)
            while view:
                view = view[os.write(self.sink, view):]

    def close(self) -> None:
        self.restore()
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)

    def close_slave(self) -> None:
        """The sandbox holds the slave now: once it ends, the master reads EIO."""
        with contextlib.suppress(OSError):
            os.close(self.slave)


def _raw(mode: list) -> list:
    """``mode`` made raw, as ``cfmakeraw`` makes it: bytes pass as typed, nothing is echoed or
    converted, no key makes a signal."""
    iflag, oflag, cflag, lflag, ispeed, ospeed, cc = mode
    iflag &= ~(termios.BRKINT | termios.ICRNL | termios.INPCK | termios.ISTRIP | termios.IXON)
    oflag &= ~termios.OPOST
    cflag = (cflag & ~(termios.CSIZE | termios.PARENB)) | termios.CS8
    lflag &= ~(termios.ECHO | termios.ICANON | termios.IEXTEN | termios.ISIG)
    cc = list(cc)
    cc[termios.VMIN], cc[termios.VTIME] = 1, 0
    return [iflag, oflag, cflag, lflag, ispeed, ospeed, cc]


def _foreground(fd: int) -> bool:
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
