"""Terminal injection: a model's reply or a block's output must not drive the user's terminal.

The attacks write OSC 52 (sets the clipboard), OSC 0 (the window title), CSI 2J (clears the
screen), DCS strings, the C1 forms (U+009B, U+009D and raw 0x9b/0x9d bytes) and colour codes,
some split across writes and chunks.  They run through the real command line with its stdout
and stderr on real pseudo-terminals, set raw so that the bytes read are exactly the bytes
written, and ``TERM=dumb`` so that rich adds no styling of its own: any ESC, BEL, C1 or other
control character that arrives came from the attacker.  Piped, ``exec`` must pass the bytes
unchanged, and colour only passes with ``--color``.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
import threading
import tty
from pathlib import Path

import pytest

from engine.batch import BarView, Tally, print_summary
from engine.scripted import Fail, ScriptedServer

from .harness import WAIT

AGENTLOOP = [sys.executable, "-P", "-m", "engine.cli"]
#: A whole command's bound: it starts sandboxed workers on a loaded machine.
COMMAND_WAIT = 120.0
#: What a terminal may receive of untrusted text: no C0 but tab and newline, no DEL, no C1.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

# -- a real terminal -------------------------------------------------------------------------


class _Terminal:
    """A pseudo-terminal in raw mode (no newline translation), read to its end by a thread."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        tty.setraw(self.slave)
        self._data = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        """The program holds the slave now: drop ours, so that its exit ends the reading."""
        os.close(self.slave)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the last writer closed its end
                return
            if not chunk:
                return
            self._data += chunk

    def received(self) -> bytes:
        self._thread.join(WAIT)
        assert not self._thread.is_alive(), "the terminal was not closed within the bound"
        os.close(self.master)
        return bytes(self._data)


def agentloop(tmp_path: Path, *args: str, stdin: bytes = b"", stdout_tty: bool = True,
              stderr_tty: bool = True, url: str | None = None) -> tuple[int, bytes, bytes]:
    """Run the command with stdout and stderr on terminals (or pipes); its status and the bytes of each."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path.parent / f"{tmp_path.name}-state"), "TERM": "dumb"}
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS"):
        env.pop(name, None)
    if url:
        env["LLM_URL"] = url
    out = _Terminal() if stdout_tty else None
    err = _Terminal() if stderr_tty else None
    proc = subprocess.Popen([*AGENTLOOP, *args], stdin=subprocess.PIPE,
                            stdout=out.slave if out else subprocess.PIPE,
                            stderr=err.slave if err else subprocess.PIPE, cwd=tmp_path, env=env)
    try:
        for terminal in (out, err):
            if terminal is not None:
                terminal.start()
        piped_out, piped_err = proc.communicate(stdin, timeout=COMMAND_WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
    return (proc.returncode, out.received() if out else piped_out, err.received() if err else piped_err)


def assert_inert(data: bytes, *, line_editing: bool = False) -> str:
    """``data`` as text, after checking that it is valid UTF-8 with nothing a terminal acts on
    (``line_editing``: but carriage returns and backspaces, which ``exec`` lets a script's
    progress bars use)."""
    text = data.decode("utf-8")
    found = _CONTROL.search(text.replace("\r", "").replace("\b", "") if line_editing else text)
    assert found is None, f"{found.group()!r} reached the terminal at {found.start()}: {text!r}"
    return text


# -- exec ------------------------------------------------------------------------------------

#: Code whose stdout writes these bytes, in pieces: flushed writes, a sequence and a UTF-8
#: character cut between writes, and a write past the worker's batch size (256 KiB) that ends
#: in the middle of an OSC 52, so that the rest comes in another chunk.
_PADDING = 300_000
_EXEC_CODE = rf'''
import sys
out = sys.stdout.buffer
for piece in [b"clip\x1b]52;c;U0VDUkVU\x07board\n",
              b"title\x1b]0;pwned", b" by the model\x07 set\n",
              b"\x1b[2J\x1b[Hcleared\n",
              "c1 \u009b2J csi \u009d0;pwned\x07 osc\n".encode(),
              b"raw \x9b2J \x9d0;t\x07 bytes\n",
              b"split \x1b", b"[2J esc\n", b"split \xc2", b"\x9b2J c1\n",
              "split €".encode()[:-1], "split €".encode()[-1:] + b"\n",
              b"dcs\x1bPq#0;2;0;0;0\x1b\\ end\n",
              b"over\rwrite\r\n",
              b"\x1b[1;31mred\x1b[0m\n",
              b"x" * {_PADDING} + b"\x1b]52;c;", b"U0VDUkVU\x07after\n"]:
    out.write(piece)
    out.flush()
sys.stderr.buffer.write(b"err\x1b]52;c;U0VDUkVU\x07 line\x9b\n")
sys.stderr.flush()
raise ValueError("bad\x1b]0;pwned\x07 value")
'''
_EXEC_STDOUT = (b"clip\x1b]52;c;U0VDUkVU\x07board\ntitle\x1b]0;pwned by the model\x07 set\n"
                b"\x1b[2J\x1b[Hcleared\n" + "c1 \u009b2J csi \u009d0;pwned\x07 osc\n".encode()
                + b"raw \x9b2J \x9d0;t\x07 bytes\nsplit \x1b[2J esc\nsplit \xc2\x9b2J c1\n"
                + "split €\n".encode() + b"dcs\x1bPq#0;2;0;0;0\x1b\\ end\nover\rwrite\r\n"
                b"\x1b[1;31mred\x1b[0m\n" + b"x" * _PADDING + b"\x1b]52;c;U0VDUkVU\x07after\n")
_EXEC_STDOUT_SHOWN = ("clipboard\ntitle set\ncleared\nc1  csi  osc\nraw \ufffd2J \ufffd0;t bytes\n"
                      "split  esc\nsplit  c1\nsplit €\ndcs end\nover\rwrite\r\nred\n"
                      + "x" * _PADDING + "after\n").encode()
_EXEC_STDERR = b"err\x1b]52;c;U0VDUkVU\x07 line\x9b\n"
_EXEC_STDERR_SHOWN = "err line\ufffd\n".encode()


@pytest.mark.parametrize("stdout_tty, stderr_tty", [
    pytest.param(True, True, marks=pytest.mark.attack, id="both-terminals"),
    pytest.param(True, False, marks=pytest.mark.attack, id="stdout-terminal"),
    pytest.param(False, True, marks=pytest.mark.attack, id="stderr-terminal"),
    pytest.param(False, False, id="both-piped"),
])
def test_exec_output_is_inert_on_a_terminal_and_unchanged_in_a_pipe(tmp_path, stdout_tty, stderr_tty):
    code, out, err = agentloop(tmp_path, "exec", "--timeout", "60s", "-", stdin=_EXEC_CODE.encode(),
                               stdout_tty=stdout_tty, stderr_tty=stderr_tty)
    assert code == 1, err  # the code raised
    if stdout_tty:
        assert out == _EXEC_STDOUT_SHOWN
        assert_inert(out, line_editing=True)
    else:
        assert out == _EXEC_STDOUT  # byte for byte what the code wrote, as `python script.py > file`
    if stderr_tty:
        shown = assert_inert(err, line_editing=True)
        assert _EXEC_STDERR_SHOWN in err
        assert "ValueError: bad value\n" in shown  # the traceback is worker text too
    else:
        assert _EXEC_STDERR in err
        assert b"ValueError: bad\x1b]0;pwned\x07 value\n" in err


@pytest.mark.attack
def test_exec_color_passes_colours_and_nothing_else(tmp_path):
    code = (r'print("\x1b[1;31mred\x1b[0m \x1b]52;c;U0VDUkVU\x07\x1b[2J\x1b[?1049h\u009b31m'
            r'c1\x1b[5;31H ok\x1b[38;5;196m!\x1b[m")')
    status, out, _ = agentloop(tmp_path, "exec", "--color", "-", stdin=code.encode())
    assert status == 0
    assert out == b"\x1b[1;31mred\x1b[0m \x1b[31mc1 ok\x1b[38;5;196m!\x1b[m\n"
    status, out, _ = agentloop(tmp_path, "exec", "-", stdin=code.encode())
    assert status == 0 and out == b"red c1 ok!\n"


#: SGR sequences that are not plain colour or style: concealed text (8, also in a list), blink,
#: parameters no style has, colours out of range, sub-parameters, empty parameters, and runs of
#: parameters longer than any style needs.
_NOT_STYLES = [b"\x1b[8m", b"\x1b[1;8;31m", b"\x1b[5m", b"\x1b[" + b"9" * 40 + b"m", b"\x1b[38;5;999m",
               b"\x1b[38;2;1;2m", b"\x1b[38:2::1:2:3m", b"\x1b[;;;1m", b"\x1b[" + b"1;" * 20 + b"1m",
               b"\x1b[0031m", b"\x1b[10m", b"\x1b[6;31m"]


@pytest.mark.attack
def test_exec_color_passes_only_well_formed_bounded_styles(tmp_path):
    kept = b"\x1b[1;31mbold red\x1b[0m \x1b[38;2;10;20;30mrgb\x1b[39;49m \x1b[4;90;107mx\x1b[m"
    written = b"".join(seq + b"hidden%d " % i for i, seq in enumerate(_NOT_STYLES)) + kept
    code = f"import sys\nsys.stdout.buffer.write({written!r} + b'\\n')\n"
    status, out, _ = agentloop(tmp_path, "exec", "--color", "-", stdin=code.encode())
    assert status == 0
    assert out == b"".join(b"hidden%d " % i for i in range(len(_NOT_STYLES))) + kept + b"\n"


# -- run and chat: the live display and the answer -------------------------------------------

#: A reply whose prose carries sequences (the server streams it in 20-character pieces, so
#: they arrive cut) and whose block prints more, built so that the block's source, which the
#: display shows, never holds an OSC 52 payload whole.
_REPLY = ("Before\x1b]52;c;U0VDUkVU\x07 the block\x1b[2J\x9b2J\x9d0;pwned\x07 still prose\n"
          '<run_code id="b1">\n'
          r'print("out\x1b]52;c;" + "QkxP" + "Q0s=" + "\x07put \u009b2J\u009d0;x\x07shown")' "\n"
          r'print("next\x1b]0;x\x07 line\rover")' "\n"
          "</run_code>")
_ANSWER = "The answer\x1b]0;pwned\x07 is\x1b[2J 42\x9b2J.\x1b]52;c;U0VDUkVU\x07"


@pytest.mark.attack
def test_run_display_and_answer_are_inert(tmp_path):
    with ScriptedServer({"*": [_REPLY, _ANSWER]}) as server:
        status, out, err = agentloop(tmp_path, "run", "compute it", url=server.url)
    shown = assert_inert(err)
    assert status == 0, shown
    assert out == b"The answer is 42.\n"
    assert "Before the block still prose\n" in shown
    assert "│ output shown\n" in shown and "│ over\n" in shown  # a rewritten line shows its last state
    for payload in ("U0VDUkVU", "QkxPQ0s=", "pwned"):
        assert payload not in shown  # whole sequences went, even cut across streamed pieces


@pytest.mark.attack
def test_run_endpoint_error_is_inert(tmp_path):
    body = "no\x1b]52;c;U0VDUkVU\x07 model \x1b[2Jfor\x9b2J you\x07"
    with ScriptedServer({"*": [Fail(400, body=body)]}) as server:
        status, out, err = agentloop(tmp_path, "run", "compute it", url=server.url)
    shown = assert_inert(err)
    assert status == 1 and out == b""
    assert "HTTP 400: no model for you" in shown


@pytest.mark.attack
def test_chat_answers_are_inert(tmp_path):
    with ScriptedServer({"*": [_REPLY, _ANSWER]}) as server:
        status, out, err = agentloop(tmp_path, "chat", stdin=b"compute it\n", url=server.url)
    shown = assert_inert(err)
    assert status == 0, shown
    assert out == b"you> compute it\nThe answer is 42.\n\nyou> \n"
    assert "Before the block still prose\n" in shown and "U0VDUkVU" not in shown


# -- batch: progress lines, the bar, the summary ---------------------------------------------

_MODEL_ERROR = "no\x1b]52;c;U0VDUkVU\x07 model \x1b[2Jfor [red]you[/red]\x9b2J"


@pytest.mark.attack
def test_batch_progress_lines_and_summary_are_inert(tmp_path):
    task_id = "t\x1b]0;pwned\x07one"
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": task_id, "task": "compute it"}) + "\n")
    with ScriptedServer({"*": [Fail(400, body=_MODEL_ERROR)]}) as server:
        status, _, err = agentloop(tmp_path, "batch", "tasks.jsonl", "-o", "results.jsonl", "--progress", "lines",
                                   stdout_tty=False, url=server.url)
    shown = assert_inert(err)
    assert status == 0, shown
    assert "id=tone failed" in shown and "no model for [red]you[/red]" in shown
    assert "batch summary" in shown
    record = json.loads((tmp_path / "results.jsonl").read_text())
    assert record["id"] == task_id and _MODEL_ERROR in record["error"]  # the results keep the exact text


@pytest.mark.attack
def test_batch_bar_and_summary_print_neither_sequences_nor_markup(capsys):
    tally = Tally(1, 0)
    view = BarView(tally, force_terminal=True)
    view.console.file = io.StringIO()
    record = {"id": "t\x1b]0;pwned\x07one", "status": "failed", "error": _MODEL_ERROR, "duration_s": 0.1,
              "tokens": {"in": 0, "out": 0}, "cost": 0.0}
    tally.finish("t", record)
    view.finished(record)
    assert view.console.file.getvalue() == "id=tone failed: no model for [red]you[/red]\n"

    print_summary(tally, Path("results\x1b[2J.jsonl"), Path("[bold]runs"), f"stopped: {_MODEL_ERROR}")
    shown = capsys.readouterr().err
    assert_inert(shown.encode())
    assert "results.jsonl" in shown and "[bold]runs" in shown and "for [red]you[/red]" in shown
