"""Interrupts that keep the namespace: at a deadline and on a cancel, a block gets an exception
raised inside what it waits on (``TimeoutError`` naming the deadline, ``KeyboardInterrupt`` for
a cancel), its ``finally:`` runs, and the worker, its namespace and other blocks live on.  Only
code no interrupt can reach is killed, and the result says which it was.  Real workers."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.results import OutputChunk

#: Code that holds the interpreter in C: a catastrophic regular expression (2**40 steps).
C_LOOP = "import re\nre.match(r'(a+)+$', 'a' * 40 + 'b')"
#: Code that waits in the kernel with every signal blocked.
SIGNALS_BLOCKED = ("import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n"
                   "os.read(os.pipe()[0], 1)")

#: Blocking waits of every kind, each as a block that waits far longer than its deadline.
WAITS = {
    "time.sleep": "import time\ntime.sleep(10**6)",
    "Event.wait": "import threading\nthreading.Event().wait()",
    "queue.get": "import queue\nqueue.Queue().get()",
    "select": "import os, select\nr, w = os.pipe()\nselect.select([r], [], [])",
    "socket recv": "import socket\na, b = socket.socketpair()\na.recv(10)",
    "subprocess.wait": "import subprocess\nsubprocess.Popen(['sleep', '1000']).wait()",
    "os.read pipe": "import os\nos.read(os.pipe()[0], 1)",
    "Lock.acquire": "import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()",
}


def _kept(result, pid: int, worker) -> None:
    assert not result.worker_killed, result
    assert "the worker and its namespace are kept" in result.message, result.message
    assert worker.pid == pid


async def test_a_polling_sleep_past_its_deadline_is_interrupted_and_the_namespace_kept(worker):
    await worker.run("before = [1, 2, 3]")
    pid = worker.pid
    code = ("import time\ndone = False\ntry:\n    while not done:\n        time.sleep(1)\n"
            "finally:\n    print('finally ran', flush=True)\n")
    started = time.monotonic()
    result = await worker.run(code, timeout=1.2)
    assert result.status == "timeout", result
    assert time.monotonic() - started < 1.2 + 0.5 + 2  # at the deadline, not at the next wake-up
    assert result.output == "finally ran\n"
    assert result.message.startswith("timed out after 1.2 s: TimeoutError was raised in it"), result.message
    # The traceback says where the code was, and what was raised there.
    assert result.error.endswith("TimeoutError: the block's deadline (1.2 s) passed\n"), result.error
    assert "time.sleep(1)" in result.error
    _kept(result, pid, worker)
    after = await worker.run("print(before, done)")
    assert after.output == "[1, 2, 3] False\n"


@pytest.mark.parametrize("wait", list(WAITS))
async def test_every_kind_of_wait_is_interrupted(worker, wait):
    await worker.run("mine = 'kept'")
    pid = worker.pid
    result = await worker.run(f"try:\n    {WAITS[wait].replace(chr(10), chr(10) + '    ')}\n"
                              "finally:\n    print('cleanup', flush=True)\n", timeout=0.5)
    assert result.status == "timeout", result
    assert result.output == "cleanup\n", result
    assert "TimeoutError: the block's deadline (0.5 s) passed" in result.error, result.error
    _kept(result, pid, worker)
    assert (await worker.run("print(mine)")).output == "kept\n"


async def test_cancel_raises_keyboard_interrupt(worker):
    await worker.run("x = 7")
    pid = worker.pid
    started = asyncio.Event()

    def seen(chunk: OutputChunk) -> None:
        if b"waiting" in chunk.data:
            started.set()

    task = asyncio.ensure_future(worker.run(
        "import time\ntry:\n    print('waiting', flush=True)\n    time.sleep(10**6)\n"
        "except KeyboardInterrupt:\n    print('got Ctrl-C', flush=True)\n    raise\n",
        block_id="long", timeout=60, on_output=seen))
    await asyncio.wait_for(started.wait(), 30)
    result = await worker.cancel("long")
    assert result is not None and result.status == "cancelled", result
    assert result.output == "waiting\ngot Ctrl-C\n"
    assert result.error.endswith("KeyboardInterrupt\n"), result.error
    assert result.message.startswith("cancelled: KeyboardInterrupt was raised in it"), result.message
    _kept(result, pid, worker)
    assert (await task).status == "cancelled"
    assert (await worker.run("print(x)")).output == "7\n"


async def test_cancel_calls_the_codes_own_sigint_handler(worker):
    # As Ctrl-C in a script: a handler the code installed runs instead of KeyboardInterrupt.
    pid = worker.pid
    started = asyncio.Event()
    code = ("import signal, time\nstop = False\n"
            "def on_int(signum, frame):\n    global stop\n    stop = True\n"
            "signal.signal(signal.SIGINT, on_int)\n"
            "try:\n    print('ready', flush=True)\n    while not stop:  # the handler returns: the sleep goes on, as in a script\n        time.sleep(0.05)\n"
            "    print('stopped gracefully')\n"
            "finally:\n    signal.signal(signal.SIGINT, signal.default_int_handler)\n")
    task = asyncio.ensure_future(worker.run(code, block_id="graceful", timeout=60,
                                            on_output=lambda c: started.set()))
    await asyncio.wait_for(started.wait(), 30)
    result = await worker.cancel("graceful")
    assert result is not None and result.status == "ok", result
    assert result.output == "ready\nstopped gracefully\n"
    assert "its SIGINT handler was called" in result.message, result.message
    assert worker.pid == pid and not result.worker_killed
    await task


async def test_code_that_ignores_sigint_is_killed_at_once_on_cancel(worker):
    started = asyncio.Event()
    task = asyncio.ensure_future(worker.run(
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('ready', flush=True)\n"
        "time.sleep(10**6)\n", block_id="deaf", timeout=60, on_output=lambda c: started.set()))
    await asyncio.wait_for(started.wait(), 30)
    result = await worker.cancel("deaf")
    assert result is not None and result.status == "cancelled" and result.worker_killed, result
    assert "it ignores SIGINT (signal.SIG_IGN)" in result.message, result.message
    assert "so the worker was killed" in result.message
    await task


async def test_a_catastrophic_regex_is_killed_within_deadline_and_grace(engine, worker):
    await worker.run("lost_one = 1")
    started = time.monotonic()
    result = await worker.run(C_LOOP, timeout=0.5)
    elapsed = time.monotonic() - started
    assert result.status == "timeout" and result.worker_killed, result
    assert elapsed < 0.5 + engine.settings.grace + 3, elapsed
    assert "the worker did not answer the interrupt" in result.message, result.message
    assert "C code held the interpreter" in result.message and "so the worker was killed" in result.message
    assert "lost variables: lost_one" in result.message and result.lost_vars == ["lost_one"]
    assert (await worker.run("print('lost_one' in globals())")).output == "False\n"


async def test_signals_blocked_is_killed_at_once_with_words(engine, worker):
    await worker.run("gone = 1")
    result = await worker.run(SIGNALS_BLOCKED, timeout=0.5)
    assert result.status == "timeout" and result.worker_killed, result
    assert result.message.startswith("timed out after 0.5 s; it waits with signals blocked "
                                     "(signal.pthread_sigmask), where no TimeoutError can be raised in it, "
                                     "so the worker was killed; the namespace was reset (lost variables: gone)"), \
        result.message


async def test_code_that_catches_the_interrupt_and_runs_on_is_killed_after_the_grace(engine, worker):
    code = ("import time\nwhile True:\n    try:\n        while True:\n            time.sleep(0.01)\n"
            "    except BaseException:\n        pass\n")
    result = await worker.run(code, timeout=0.5)
    assert result.status == "timeout" and result.worker_killed, result
    assert f"it did not stop within {engine.settings.grace:g} s of the interrupt: TimeoutError was raised in it, " \
           "and it kept running" in result.message, result.message


async def test_a_block_beside_the_main_one_is_interrupted_in_its_thread(worker):
    # The first block holds the main thread; the second runs in a thread of its own, where the
    # exception lands at its next bytecode: a loop of short waits stops within one wait.
    started = asyncio.Event()
    main_block = asyncio.ensure_future(worker.run(
        "import threading, time\nprint(threading.current_thread().name, flush=True)\n"
        "while True:\n    time.sleep(0.05)\n", timeout=60, block_id="first", on_output=lambda c: started.set()))
    await asyncio.wait_for(started.wait(), 30)
    pid = worker.pid
    beside = await worker.run(
        "import threading, time\nprint(threading.current_thread() is threading.main_thread())\n"
        "try:\n    while True:\n        time.sleep(0.05)\nfinally:\n    print('cleaned')\n", timeout=0.5)
    assert beside.status == "timeout", beside
    assert beside.output == "False\ncleaned\n"
    assert "TimeoutError was raised in it (in its thread)" in beside.message, beside.message
    _kept(beside, pid, worker)
    first = await worker.cancel("first")
    assert first is not None and first.status == "cancelled" and first.output == "MainThread\n", first
    _kept(first, pid, worker)
    await main_block


async def test_a_long_wait_beside_the_main_block_is_killed_after_the_grace_with_words(engine, worker):
    # In a thread other than the main one, CPython retries a wait a signal interrupts: only the
    # kill stops it, and the result says why.
    started = asyncio.Event()
    main_block = asyncio.ensure_future(worker.run(
        "import time\nprint('main', flush=True)\nwhile True:\n    time.sleep(0.05)\n", timeout=60,
        on_output=lambda c: started.set()))
    await asyncio.wait_for(started.wait(), 30)
    result = await worker.run("import time\ntime.sleep(10**6)", timeout=0.5)
    assert result.status == "timeout" and result.worker_killed, result
    assert "it runs in a thread of its own (another block had the main thread)" in result.message, result.message
    bystander = await main_block
    assert bystander.status == "killed" and bystander.worker_killed


async def test_an_interrupt_is_given_once_so_cleanup_can_wait(worker):
    code = ("import time\ntry:\n    time.sleep(10**6)\nfinally:\n    time.sleep(0.2)\n    print('tidy')\n")
    result = await worker.run(code, timeout=0.3)
    assert result.status == "timeout" and not result.worker_killed, result
    assert result.output == "tidy\n"


async def test_code_that_catches_the_timeout_and_finishes_is_ok(worker):
    code = ("import time\ntry:\n    time.sleep(10**6)\nexcept TimeoutError as exc:\n"
            "    print('caught:', exc)\nresult = 'partial'\n")
    result = await worker.run(code, timeout=0.3)
    assert result.status == "ok", result
    assert result.output == "caught: the block's deadline (0.3 s) passed\n"
    assert "TimeoutError was raised in it, and it finished normally after it" in result.message
    assert (await worker.run("print(result)")).output == "partial\n"


async def test_system_exit_ends_the_block_and_keeps_the_namespace(worker):
    await worker.run("survivor = 1")
    pid = worker.pid
    result = await worker.run("import sys\nprint('leaving')\nsys.exit(4)")
    assert result.status == "error" and result.exit_code == 4 and result.exited, result
    assert "the code exited with 4" in result.message and not result.worker_killed
    assert worker.pid == pid
    assert (await worker.run("print(survivor)")).output == "1\n"


async def test_an_exec_script_past_its_deadline_gets_sigterm_and_may_clean_up(tmp_path):
    # ``agentloop exec --timeout`` keeps the deadline as timeout(1) does: SIGTERM, which the
    # script may handle (here by exiting, so its atexit handlers run); the status is 124.
    import subprocess
    import sys

    from tests.conftest import REPO

    script = tmp_path / "slow.py"
    script.write_text("import atexit, signal, sys, time\natexit.register(lambda: print('atexit ran'))\n"
                      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                      "print('start', flush=True)\ntime.sleep(10**6)\n")
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "exec", "--timeout", "5", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.stdout == "start\natexit ran\n", proc
    assert proc.stderr == "agentloop: the script ran past its --timeout of 5 s: stopped by SIGTERM\n"
    assert proc.returncode == 124, proc


def test_ctrl_c_on_exec_is_a_keyboard_interrupt_as_under_python(tmp_path):
    # The same script, Ctrl-C'd once it waits: the same output, traceback and exit status.
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO, read_line

    script = tmp_path / "wait.py"
    # One line for the print and the wait: the signal may land just after "ready" is out and
    # before the sleep (more often through exec's relay on a loaded machine): the same traceback.
    script.write_text("import time\ntry:\n    print('ready', flush=True); time.sleep(100)\n"
                      "finally:\n    print('finally ran', flush=True)\n")
    seen = []
    for argv in ([sys.executable, str(script)], [sys.executable, "-m", "engine.cli", "exec", str(script)]):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                stdin=subprocess.DEVNULL)
        try:
            assert read_line(proc.stdout, 60) == "ready\n"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        # (Python marks the call the signal landed in with carets: the print's or the sleep's.)
        err = "".join(line for line in err.replace(str(script), "FILE").splitlines(True) if line.strip(" ^\n"))
        seen.append((out, err, 128 - proc.returncode if proc.returncode < 0 else proc.returncode))
    assert seen[0] == seen[1]
    assert seen[1][0] == "finally ran\n" and seen[1][1].endswith("KeyboardInterrupt\n") and seen[1][2] == 130


async def test_an_interrupt_while_printing_loses_no_output(worker):
    # The interrupt waits until the runtime's own code (output on its way out) is left, so
    # every line the loop printed arrives, and the count it kept says how many.  As in CPython,
    # it may land inside print(), between the text and its newline.
    code = ("i = 0\ntry:\n    while True:\n        print('x' * 100)\n        i += 1\n"
            "finally:\n    print('printed', i)\n")
    result = await worker.run(code, timeout=0.5)
    assert result.status == "timeout" and not result.worker_killed, result
    tail = result.output.rsplit("printed ", 1)[1]
    printed = int(tail)
    before = result.output_bytes - len("printed " + tail)
    assert before in (101 * printed, 101 * printed + 100, 101 * (printed + 1)), (before, printed)


@pytest.mark.parametrize("where", ["main thread", "its own thread"])
async def test_an_interrupt_while_flushing_output_keeps_the_worker(worker, where):
    # Every line is flushed, faster than the coordinator reads: the deadline lands while output
    # is being written (through the output pipe, where that exists), and must neither be lost
    # in the writing nor tear a frame (which would end the worker as a broken one).
    pid = worker.pid
    code = ("_line = 'y' * 5000\ntry:\n    while True:\n        print(_line, flush=True)\n"
            "finally:\n    print('done')\n")
    for _ in range(3):
        holder = None
        if where == "its own thread":
            started = asyncio.Event()
            holder = asyncio.ensure_future(worker.run("import time\nprint('hold', flush=True)\ntime.sleep(1)",
                                                      timeout=30, on_output=lambda c, s=started: s.set()))
            await asyncio.wait_for(started.wait(), 30)
        result = await worker.run(code, timeout=0.3)
        assert result.status == "timeout", result
        # (As in CPython, the interrupt may land inside print(), between the text and its newline.)
        assert result.output_bytes % 5001 in (4, 5) and result.output.endswith("done\n"), result
        _kept(result, pid, worker)
        if holder is not None:
            assert (await holder).status == "ok"
