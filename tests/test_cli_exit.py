"""How the ``agentloop`` process ends (``engine.cli.run``): at once when its command is done,
with what a normal exit would have done first — the same status, ``atexit`` handlers run,
stdout and stderr flushed — and as Python exits when something is still going."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def leave(body: str) -> subprocess.CompletedProcess:
    code = "import atexit, sys, threading, time\nfrom engine.cli import _leave\n" + body
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (125, 125), (256 + 7, 7), (-1, 255)])
def test_the_status_is_the_one_python_would_exit_with(code, status):
    done = leave(f"_leave({code!r})")
    assert done.returncode == status == subprocess.run([sys.executable, "-c", f"raise SystemExit({code!r})"]).returncode


def test_atexit_handlers_run_and_buffered_output_is_written():
    done = leave("atexit.register(lambda: print('last words'))\nprint('said', end='')\n"
                 "sys.stderr.write('to stderr')\n_leave(4)")
    assert (done.returncode, done.stdout, done.stderr) == (4, "saidlast words\n", "to stderr")


def test_a_thread_still_running_is_waited_for_as_python_does():
    done = leave("def late():\n    time.sleep(0.3)\n    print('thread done', flush=True)\n"
                 "threading.Thread(target=late).start()\n_leave(5)")
    assert (done.returncode, done.stdout) == (5, "thread done\n")


def test_a_message_as_the_status_is_printed_and_exits_1():
    done = leave("_leave('agentloop: gone')")
    assert (done.returncode, done.stderr.strip()) == (1, "agentloop: gone")


def test_a_stdout_that_cannot_be_flushed_exits_as_python_does():
    """Output left for a reader that is gone: Python's own exit says so, and exits 120."""
    gone = ("import io, sys\nclass Gone(io.StringIO):\n    def flush(self):\n"
            "        raise BrokenPipeError(32, 'Broken pipe')\nsys.stdout = Gone()\n")
    ours = subprocess.run([sys.executable, "-c", gone + "from engine.cli import _leave\n_leave(0)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    python = subprocess.run([sys.executable, "-c", gone], capture_output=True, text=True, timeout=60)
    assert ours.returncode == python.returncode == 120, (ours.stderr, python.stderr)
    assert "BrokenPipeError" in ours.stderr and "BrokenPipeError" in python.stderr
