"""The engine core with real worker processes over real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from engine.sandbox import SandboxPolicy
from engine.workers import Engine, WorkerState
from worker.contract import wire
from worker.contract.framing import encode

from .conftest import NO_FORK_SERVER, processes_with, wait_until


async def test_namespace_persists_across_blocks(worker):
    assert (await worker.run("import math\nx = 40\ndef f(v):\n    return v + 2")).ok
    result = await worker.run("print(f(x), math.pi > 3)")
    assert result.status == "ok"
    assert result.output == "42 True\n"
    assert {"x", "f"} <= set(worker.vars)


async def test_system_exit_ends_the_block_not_the_worker(worker):
    assert (await worker.run("x = 7")).ok
    pid = worker.pid
    three = await worker.run("import sys\nprint('a')\nsys.exit(3)")
    assert three.status == "error" and three.exited and three.exit_code == 3
    assert three.output == "a\n" and "exited with 3" in three.message and not three.worker_killed
    said = await worker.run("import sys; sys.exit('no more')")
    assert said.exit_code == 1 and said.output == "no more\n"
    zero = await worker.run("raise SystemExit")
    assert zero.ok and zero.exit_code == 0
    after = await worker.run("print(x)")
    assert after.output == "7\n" and worker.pid == pid


async def test_two_sleeping_blocks_run_concurrently(worker):
    started = time.monotonic()
    a, b = await asyncio.gather(worker.run("import time; time.sleep(1); print('a')"),
                                worker.run("import time; time.sleep(1); print('b')"))
    elapsed = time.monotonic() - started
    assert (a.output, b.output) == ("a\n", "b\n")
    assert elapsed < 1.9


async def test_concurrent_output_never_mixes(worker):
    code = ("import time, threading\n"
            "def spam_{tag}():\n"  # one name per block: the namespace is shared
            "    for i in range(300):\n"
            "        print('{tag}', i)\n"
            "        if i % 50 == 0: time.sleep(0.01)\n"
            "t_{tag} = threading.Thread(target=spam_{tag}); t_{tag}.start()\n"
            "spam_{tag}(); t_{tag}.join()\n")
    results = await asyncio.gather(*(worker.run(code.format(tag=tag), timeout=30) for tag in "ABC"))
    for tag, result in zip("ABC", results, strict=True):
        # A block's own two threads may interleave within a line, as in plain Python;
        # another block's output never appears.
        assert result.output.count(tag) == 600
        assert set(result.output) <= set(tag + "0123456789 \n"), result.output[:200]


async def test_top_level_await(worker):
    result = await worker.run("await asyncio.sleep(0.05)\nv = await asyncio.to_thread(lambda: 7)\nprint(v)")
    assert result.status == "ok" and result.output == "7\n"
    assert (await worker.run("print(v * 6)")).output == "42\n"


async def test_output_arrives_before_the_block_ends(worker, run_dir: Path):
    flag = run_dir / "files" / "go"
    code = ("import os, time\nprint('first')\n"
            "while not os.path.exists('files/go'):\n    time.sleep(0.01)\nprint('second')")
    seen = []
    async for item in worker.stream(code, timeout=20):
        if hasattr(item, "data"):
            seen.append(item.data)
            if b"first" in item.data:
                flag.touch()  # only possible if 'first' streamed while the block was waiting
        else:
            result = item
    assert result.status == "ok"
    assert b"".join(seen) == b"first\nsecond\n"


async def _consume_slowly(worker, code: str) -> tuple[list, object]:
    """Stream ``code``'s output, taking each chunk a millisecond late: (stream, data) chunks
    and the result."""
    chunks, result = [], None
    async for item in worker.stream(code, timeout=60):
        if hasattr(item, "data"):
            chunks.append((item.stream, item.data))
            await asyncio.sleep(0.001)
        else:
            result = item
    return chunks, result


async def test_a_slow_stream_consumer_loses_nothing(worker):
    # stdout and stderr alternate: 400 chunks, far more than the stream's queue holds, so the
    # coordinator stops reading the worker until the consumer catches up.
    code = "import sys\nfor i in range(200):\n    print(i)\n    print(-i, file=sys.stderr)\n"
    chunks, result = await _consume_slowly(worker, code)
    assert result.status == "ok"
    assert [c for c in chunks if c[0] == "stdout"] == [("stdout", f"{i}\n".encode()) for i in range(200)]
    assert b"".join(d for s, d in chunks if s == "stderr") == "".join(f"{-i}\n" for i in range(200)).encode()
    assert len(chunks) == 400


async def test_flushed_output_held_back_by_a_slow_consumer_still_comes_before_the_end(worker):
    # Every line is flushed (through the output pipe, where that exists), more than the pipe
    # holds, and the block's done follows at once (over the socket): the done must wait until
    # the consumer has taken every line written before it.
    code = ("import os, sys\nfor i in range(300):\n    print(f'{i:04d}' * 1000, flush=True)\n"
            "    os.write(2, b'%d\\n' % -i)\n")
    chunks, result = await _consume_slowly(worker, code)
    assert result.status == "ok"
    out = "".join(f"{i:04d}" * 1000 + "\n" for i in range(300))
    err = "".join(f"{-i}\n" for i in range(300))
    assert b"".join(d for s, d in chunks if s == "stdout") == out.encode()
    assert b"".join(d for s, d in chunks if s == "stderr") == err.encode()
    assert result.output_bytes == len(out) + len(err)


async def test_fd_level_output_is_captured(worker):
    code = ("import os, subprocess, sys\n"
            "os.write(1, b'fd-one\\n')\n"
            "subprocess.run([sys.executable, '-c', 'import sys; print(\"child\"); print(\"err\", file=sys.stderr)'])\n"
            "sys.stdout.buffer.write(b'bytes\\n')\n")
    result = await worker.run(code, timeout=20)
    assert result.status == "ok"
    for piece in ("fd-one\n", "child\n", "err\n", "bytes\n"):
        assert piece in result.output


async def test_while_true_is_cancelled_cooperatively(worker):
    await worker.run("keep = 1")
    started = time.monotonic()
    result = await worker.run("while True:\n    pass", timeout=0.5)
    assert result.status == "timeout"
    assert "timed out after 0.5 s" in result.message
    assert not result.worker_killed
    assert time.monotonic() - started < 5
    assert (await worker.run("print(keep)")).output == "1\n"  # same namespace: no kill was needed


#: Code no interrupt can reach: it waits in the kernel with every signal blocked.
SIGNALS_BLOCKED = ("import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n"
                   "os.read(os.pipe()[0], 1)")
#: Code that holds the interpreter in C: a catastrophic regular expression.
C_LOOP = "import re\nre.match(r'(a+)+$', 'a' * 40 + 'b')"


@pytest.mark.parametrize("stuck", [SIGNALS_BLOCKED, C_LOOP], ids=["signals-blocked", "c-loop"])
async def test_block_stuck_in_c_is_killed_and_replaced(worker, stuck):
    await worker.run("precious = [1, 2, 3]")
    first_pid = worker.pid
    started = time.monotonic()
    result = await worker.run(stuck, timeout=0.5)
    elapsed = time.monotonic() - started
    assert result.status == "timeout"
    assert result.worker_killed
    assert "precious" in result.lost_vars
    assert "killed" in result.message and "precious" in result.message
    assert elapsed < 5
    after = await worker.run("print('fresh', 'precious' in globals())")
    assert after.output == "fresh False\n"
    assert worker.pid != first_pid


async def test_double_forked_daemon_dies_with_the_worker(worker):
    token = f"99{secrets.randbelow(10**6)}"
    code = ("import os, subprocess\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execvp('sleep', ['sleep', '{token}'])\n"
            "    os._exit(0)\n"
            + SIGNALS_BLOCKED)
    task = asyncio.ensure_future(worker.run(code, timeout=1.5))
    assert await asyncio.to_thread(wait_until, lambda: processes_with(token), 10)
    result = await task
    assert result.status == "timeout" and result.worker_killed
    assert await asyncio.to_thread(wait_until, lambda: not processes_with(token), 5), "daemon survived"


@pytest.mark.parametrize("code, words, sig", [
    ("import ctypes; ctypes.string_at(0)", "signal 11 (SIGSEGV)", 11),
    ("import os; os._exit(3)", "exit code 3", None),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "signal 9 (SIGKILL)", 9),
])
async def test_crash_ends_blocks_with_a_clear_status(worker, code, words, sig):
    await worker.run("lost_me = 1")
    bystander = asyncio.ensure_future(worker.run("import time; time.sleep(30)", timeout=60))
    result = await worker.run(code, timeout=20)
    assert result.status == "died"
    assert f"worker died: {words}" in result.message
    assert result.signal == sig
    assert "lost_me" in result.message
    other = await bystander
    assert other.status == "died"
    assert worker.state is WorkerState.DEAD
    again = await worker.run("print('alive')")
    assert again.output == "alive\n" and worker.state is WorkerState.READY


@pytest.mark.parametrize("words, death", [
    ("print('last words', flush=True)", "os.kill(os.getpid(), signal.SIGKILL)"),
    ("sys.stderr.write('last words\\n'); sys.stderr.flush()", "os.kill(os.getpid(), signal.SIGKILL)"),
    ("os.write(1, b'last words\\n')", "os.kill(os.getpid(), signal.SIGKILL)"),
    ("subprocess.run(['echo', 'last words'])", "os.kill(os.getpid(), signal.SIGKILL)"),
    ("print('last words', flush=True)", "ctypes.string_at(0)"),
    ("os.write(2, b'last words\\n')", "os._exit(3)"),
], ids=["print-kill", "stderr-kill", "fd-kill", "subprocess-kill", "print-segfault", "fd-exit"])
async def test_what_was_written_before_a_death_reaches_the_result(worker, words, death):
    # Each time in a fresh worker (the death takes the last one): a race would show.
    for _ in range(3):
        code = f"import ctypes, os, signal, subprocess, sys\n{words}\n{death}\n"
        result = await worker.run(code, timeout=20)
        assert result.status == "died", result
        assert result.output == "last words\n", result


async def test_code_the_compiler_cannot_take_is_an_error_not_a_hang(worker):
    result = await worker.run("x = " + "-" * 5_000 + "1", timeout=20)
    assert result.status == "error" and "RecursionError" in result.error
    assert (await worker.run("print('fine')")).output == "fine\n"


async def test_traceback_shows_only_user_frames(worker):
    result = await worker.run("def inner():\n    return 1 / 0\n\ninner()\n")
    assert result.status == "error"
    assert result.error == (
        "Traceback (most recent call last):\n"
        '  File "<block b1>", line 4, in <module>\n'
        "    inner()\n"
        '  File "<block b1>", line 2, in inner\n'
        "    return 1 / 0\n"
        "           ~~^~~\n"
        "ZeroDivisionError: division by zero\n")
    syntax = await worker.run("x = (", block_id="syn")
    assert syntax.status == "error"
    assert 'File "<block syn>", line 1' in syntax.error and "SyntaxError" in syntax.error
    assert "worker" not in syntax.error and "<string>" not in syntax.error
    awaited = await worker.run("await asyncio.sleep(0)\nraise KeyError('k')", block_id="aw")
    assert awaited.error.splitlines()[1] == '  File "<block aw>", line 2, in <module>'
    assert "asyncio" not in awaited.error.split("\n", 1)[1].split("KeyError")[0]


async def test_input_fails_at_once(worker):
    started = time.monotonic()
    result = await worker.run("input('name? ')", timeout=10)
    assert result.status == "error"
    assert "no interactive input" in result.error
    assert time.monotonic() - started < 5


async def test_secrets_do_not_reach_the_worker(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_API_KEY", "sk-very-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-very-secret")
    async with Engine(cwd=run_dir, state_dir=tmp_path / "state") as engine:
        worker = await engine.start_worker()
        result = await worker.run(
            "import os\nprint(sorted(os.environ))\n"
            "try:\n    print(open('/proc/self/environ','rb').read().count(b'very-secret'))\n"
            "except PermissionError:\n    print(0)  # a sandbox may hide it altogether\n")
    assert "LLM_API_KEY" not in result.output and "AWS_SECRET_ACCESS_KEY" not in result.output
    assert "AGENTLOOP_START" not in result.output  # (the start: token, confinement)
    assert result.output.splitlines()[-1] == "0"


async def test_working_directory_and_workspace(worker, run_dir: Path):
    result = await worker.run("import os\nprint(os.getcwd())\nopen('files/out.txt','w').write('hi')")
    assert result.output == f"{run_dir}\n"
    assert (run_dir / "files" / "out.txt").read_text() == "hi"


async def test_output_flood_is_bounded(worker):
    size_mb = 200
    code = (f"import sys\nline = 'y' * 1023 + '\\n'\n"
            f"for _ in range({size_mb} * 1024):\n    sys.stdout.write(line)\nprint('END')")
    with open("/proc/self/status") as f:
        before = _vm_rss(f.read())
    peak = before
    done = asyncio.Event()

    async def sample():
        nonlocal peak
        while not done.is_set():
            with open("/proc/self/status") as f:
                peak = max(peak, _vm_rss(f.read()))
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample())
    result = await worker.run(code, timeout=120)
    done.set()
    await sampler
    total = size_mb * 1024 * 1024 + 4
    assert result.status == "ok"
    assert result.output_bytes == total and result.truncated
    assert result.output.endswith("END\n")
    head, note_and_tail = result.output.split("\n[... ", 1)
    note, tail = note_and_tail.split(" ...]\n", 1)
    cut = int(note.split(" bytes cut")[0])
    assert len(head.encode()) + cut + len(tail.encode()) == total  # the count of what was cut is exact
    assert result.output_file in note
    assert result.output_file and os.path.getsize(result.output_file) == total
    assert (peak - before) < 100 * 1024 * 1024, f"coordinator grew by {(peak - before) >> 20} MiB"


async def test_one_write_larger_than_a_frame_arrives_whole(worker):
    # A single write bigger than the largest frame either side accepts is cut into frames.
    code = ("import sys\nsys.stdout.write('\u00e9' * 20_000_000)\n"
            "sys.stdout.buffer.write(b'z' * 40_000_000)\nprint('end')")
    result = await worker.run(code, timeout=60)
    assert result.status == "ok"
    assert result.output_bytes == 80_000_004
    assert result.output.endswith("zzzend\n")
    assert os.path.getsize(result.output_file) == 80_000_004


async def test_output_of_a_thread_that_outlives_its_block_is_kept(worker):
    started = await worker.run("import threading\nlate_go = threading.Event()\n"
                               "def late():\n    late_go.wait(30); print('late words')\n"
                               "late_t = threading.Thread(target=late)\nlate_t.start()\nprint('first')")
    assert started.output == "first\n"
    # Written after its own block ended: it goes to the block that runs, not nowhere.
    later = await worker.run("late_go.set()\nlate_t.join(30)\nprint('second')")
    assert later.output == "late words\nsecond\n"


async def test_output_written_while_no_block_runs_goes_to_the_next_block(worker, run_dir: Path):
    code = ("import os, threading, time\n"
            "def between():\n"
            "    while not os.path.exists('files/go'): time.sleep(0.01)\n"
            "    print('between blocks')\n"
            "    open('files/printed', 'w').close()\n"
            "threading.Thread(target=between).start()\n")
    assert (await worker.run(code)).output == ""
    (run_dir / "files" / "go").touch()
    assert await asyncio.to_thread(wait_until, (run_dir / "files" / "printed").exists, 20)
    assert (await worker.run("print('next')")).output == "between blocks\nnext\n"


async def test_concurrent_blocks_calling_host_functions_all_get_their_replies(worker):
    # A block waiting for a host call's reply hands the listening over; with many such blocks
    # at once, sync and awaiting, every reply still reaches its caller.
    from engine.agent._code_task import host_spec

    def double(x):
        return 2 * x

    async def adouble(x):
        await asyncio.sleep(0.001)
        return 2 * x

    async def on_call(name, args, kwargs, block):
        return double(*args) if name == "double" else await adouble(*args)

    worker.adopt(on_call)
    await worker.request(wire.Bind((host_spec("double", double), host_spec("adouble", adouble))))
    sync = "print(sum(double(i) for i in range({n})))"
    awaiting = "print(sum([await adouble(i) for i in range({n})]))"
    codes = [(sync if k % 2 else awaiting).format(n=10 + k) for k in range(20)]
    results = await asyncio.wait_for(asyncio.gather(*(worker.run(c, timeout=60) for c in codes)), 120)
    assert [r.output for r in results] == [f"{(10 + k) * (9 + k)}\n" for k in range(20)]


async def test_a_worker_serves_one_owner_and_refuses_a_second_in_words(engine):
    # The owner of a worker's host calls is given once, at the start: a second owner would
    # silently take the first one's calls (the last writer winning), so it is refused.
    from engine.agent._code_task import host_spec
    from engine.errors import AlreadyOwned

    def whose():
        raise AssertionError("the host function runs in the coordinator, never in the worker")

    async def first(name, args, kwargs, block):
        return "first"

    async def second(name, args, kwargs, block):
        return "second"

    owned = await engine.start_worker("owned", on_call=first)
    with pytest.raises(AlreadyOwned, match="already has an owner"):
        owned.adopt(second)
    await owned.request(wire.Bind((host_spec("whose", whose),)))
    assert (await owned.run("print(whose())", timeout=30)).output == "first\n"

    later = await engine.start_worker("later")  # started before its owner: adopted once
    await later.request(wire.Bind((host_spec("whose", whose),)))
    refused = await later.run("whose()", timeout=30)
    assert "no host functions" in refused.output + (refused.error or "")
    later.adopt(second)
    with pytest.raises(AlreadyOwned):
        later.adopt(first)
    assert (await later.run("print(whose())", timeout=30)).output == "second\n"


async def test_short_and_long_blocks_interleave(worker):
    # Short blocks run in the thread that received them; a long one hands the listening over,
    # so short ones, cancels and output keep going around it.
    long = asyncio.ensure_future(worker.run("import time\nwhile True: time.sleep(0.01)", timeout=30))
    shorts = await asyncio.gather(*(worker.run(f"print({i} * 2)") for i in range(50)))
    assert [r.output for r in shorts] == [f"{i * 2}\n" for i in range(50)]
    cancelled = await worker.cancel(worker.running[0])
    assert cancelled is not None and cancelled.status == "cancelled" and not cancelled.worker_killed
    assert (await long).status == "cancelled"
    assert (await worker.run("print('still here')")).output == "still here\n"


def _vm_rss(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def test_a_stranger_on_the_tcp_port_reaches_nothing(run_dir, tmp_path):
    # Over TCP anyone may dial the port (an ipc socket's file is gone once the worker is in):
    # once the worker is in, nobody else gets a connection, let alone a frame read.
    policy = SandboxPolicy(network=True)  # the worker connects over the host's loopback
    async with Engine(cwd=run_dir, state_dir=tmp_path / "state", transport="tcp", sandbox=policy) as engine:
        worker = await engine.start_worker()
        session = worker.session
        endpoint = session.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        ctx = zmq.asyncio.Context()
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(endpoint)
        running = asyncio.ensure_future(worker.run("import time; time.sleep(0.5); print('real')", timeout=20,
                                                   block_id="victim"))
        frames = (b"", b"\xc1garbage", b"\x92\x01\x02", encode({"no": "type"}),
                  encode({"t": "done", "id": "victim", "status": "ok", "error": ""}),
                  encode({"t": "out", "id": "victim", "o": [[1, b"injected"]]}),
                  encode({"t": "hello", "v": 1, "token": "guess", "pid": 1}),
                  b"\xdd\xff\xff\xff\xff")
        try:
            for frame in frames:
                await intruder.send(frame)
            await intruder.send_multipart([b"a", b"b", b"c"])
            result = await running
            assert session.dropped == 0  # not even read: refused before ZeroMQ takes a message
        finally:
            intruder.close(0)
            ctx.term()
        assert result.status == "ok" and result.output == "real\n"
        assert (await worker.run("print(1)")).output == "1\n"
        assert worker.session is session  # the stranger did not cost the worker anything


async def test_a_worker_that_breaks_the_protocol_is_stopped(worker):
    # The worker's own code speaks the protocol on its socket: its first invalid message ends it.
    code = ("import gc, zmq\n"
            "socks = [o for o in gc.get_objects() if isinstance(o, zmq.Socket)]\n"
            "from worker.contract.framing import encode\n"
            "for s in socks:\n"
            "    for frame in (b'\\x00\\x01junk', encode({'t': 'out', 'id': 'nope', 'o': [[7, 'x']]}),\n"
            "                  encode({'t': 'out', 'id': 'me', 'o': [[7, 'x'], 'bad']}),\n"
            "                  encode({'t': 'done', 'id': 'nope', 'status': 'ok'}),\n"
            "                  encode({'t': 'weird'}), encode({'t': 'done', 'id': 'me', 'vars': 5})):\n"
            "        s.send(frame)\n"
            "print('sent', len(socks))\n")
    result = await worker.run(code, timeout=20, block_id="me")
    assert result.status == "killed" and result.worker_killed, result
    assert result.message.startswith("the worker broke the protocol (undecodable frame"), result.message
    assert result.duration_s < 10
    assert (await worker.run("print(2)")).output == "2\n"


async def test_restart_and_close(worker):
    await worker.run("a = 1")
    await worker.restart()
    assert (await worker.run("print('a' in globals())")).output == "False\n"
    await worker.close()
    assert worker.state is WorkerState.CLOSED
    from engine.errors import WorkerClosed
    with pytest.raises(WorkerClosed):
        await worker.run("print(1)")


async def test_cancel_a_running_block(worker):
    task = asyncio.ensure_future(worker.run("await asyncio.sleep(30)", block_id="long", timeout=60))
    assert await asyncio.to_thread(wait_until, lambda: "long" in worker.running, 10)
    result = await worker.cancel("long")
    assert result.status == "cancelled"
    assert (await task).status == "cancelled"


async def test_tcp_transport(run_dir, tmp_path):
    # A worker reaching its coordinator over TCP needs a network: a private one has no route.
    policy = SandboxPolicy(network=True)
    async with Engine(cwd=run_dir, state_dir=tmp_path / "state", transport="tcp", sandbox=policy) as engine:
        worker = await engine.start_worker()
        assert worker.session.sock.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://127.0.0.1:")
        assert (await worker.run("print('over tcp')")).output == "over tcp\n"


async def test_warm_pool_serves_new_workers_and_replacements(run_dir, tmp_path):
    async with Engine(cwd=run_dir, state_dir=tmp_path / "state", pool=1) as engine:
        first = await engine.start_worker("first")
        assert await asyncio.to_thread(wait_until, lambda: len(engine.idle_pids) == 1, 30)
        pooled = engine.idle_pids[0]
        started = time.monotonic()
        second = await engine.start_worker("second")
        assert time.monotonic() - started < 1.0  # the target is ~10 ms; no process start happened
        assert second.pid == pooled
        assert (await second.run("print('warm')")).output == "warm\n"
        # A kill's replacement comes from the refilled pool too.
        assert await asyncio.to_thread(wait_until, lambda: len(engine.idle_pids) == 1, 30)
        refill = engine.idle_pids[0]
        result = await first.run(SIGNALS_BLOCKED, timeout=0.3)
        assert result.worker_killed
        assert (await first.run("print('replaced')")).output == "replaced\n"
        assert first.pid == refill


async def test_cancellation_lets_cleanup_finish_but_not_a_block_in_c(worker):
    # A block that took the cancellation and is cleaning up gets the grace ...
    tidy = await worker.run("import time\ntry:\n    while True: time.sleep(0.001)\n"
                            "finally:\n    time.sleep(0.1)\n    print('cleaned up')", timeout=0.3)
    assert tidy.status == "timeout" and not tidy.worker_killed
    assert tidy.output == "cleaned up\n"
    # ... one the interrupt cannot reach is killed without waiting it out.
    stuck = await worker.run(SIGNALS_BLOCKED, timeout=0.3)
    assert stuck.worker_killed and "it waits with signals blocked" in stuck.message, stuck.message


async def test_fork_server_preloads_and_isolates(run_dir, tmp_path):
    if NO_FORK_SERVER:
        pytest.skip(reason=NO_FORK_SERVER)
    async with Engine(cwd=run_dir, state_dir=tmp_path / "state", pool=0, fork_server=True,
                      preload=("decimal",)) as engine:
        a = await engine.start_worker("a")
        b = await engine.start_worker("b")
        seen = await a.run("import os, sys\nprint('decimal' in sys.modules, sorted(os.listdir('/proc'))[:3])")
        preloaded, first_pids = seen.output.split(" ", 1)
        assert preloaded == "True"
        # A /proc of its own, showing only what it may trace: not its init (pid 1), itself (pid 2).
        assert first_pids.startswith("['2', "), first_pids
        assert a.pid != b.pid
        ids = [(await w.run("import os; print(os.getuid())")).output for w in (a, b)]
        # The run's uid (root's run has one of its own, an unprivileged user's is the user's):
        # each worker owns what the others wrote.
        assert ids[0] == ids[1] != "0\n"
        assert os.geteuid() == 0 or ids[0] == f"{os.getuid()}\n"


async def test_a_forked_worker_lists_the_distributions_a_cold_one_does(run_dir, tmp_path):
    """The fork server reads the installed distributions once for the workers it forks; what
    a worker's own directory holds is still read by that worker, whoever started it."""
    if NO_FORK_SERVER:
        pytest.skip(reason=NO_FORK_SERVER)
    planted = run_dir / "planted_here-1.0.dist-info"
    planted.mkdir()
    (planted / "METADATA").write_text("Metadata-Version: 2.1\nName: Planted-Here\nVersion: 1.0\n\nA body.\n")
    listed = {}
    for fork_server in (False, True):
        async with Engine(cwd=run_dir, state_dir=tmp_path / f"state-{fork_server}", pool=0,
                          fork_server=fork_server) as engine:
            # The second worker is forked after the server read them for the first.
            workers = [await engine.start_worker(name) for name in ("a", "b")]
            listed[fork_server] = [(await w.request(wire.Env())).packages for w in workers]
    cold, forked = listed[False], listed[True]
    assert cold[0] == cold[1] == forked[0] == forked[1]
    assert "Planted-Here" in forked[1] and "pyzmq" in forked[1]



async def test_a_workspace_another_run_uses_outlives_the_run_that_made_it(run_dir, tmp_path):
    """The run that made a workspace removes it at its end when nothing was written there,
    but not while another run on it lives: that one's workers keep it and start in it."""
    workspace = run_dir / "made" / "files"
    runs = [Engine(cwd=run_dir, state_dir=tmp_path / "state", workspace=workspace, pool=0) for _ in range(2)]
    maker, other = runs
    try:
        maker.open()  # makes it
        other.open()
        await maker.start_worker("first")
        late = await other.start_worker("late")
        await maker.shutdown()
        assert workspace.is_dir()
        assert (await late.run("print('still here')")).output == "still here\n"
        assert (await (await other.start_worker("later")).run("print('started')")).output == "started\n"
    finally:
        for run in runs:
            await run.shutdown()
    assert workspace.is_dir()  # (left, empty: the run that made it was not the last one on it)
    async with Engine(cwd=run_dir, state_dir=tmp_path / "state", workspace=run_dir / "alone", pool=0) as alone:
        await alone.start_worker("alone")
    assert not (run_dir / "alone").exists()  # one run alone on what it made removes it
