"""Blocks run where a script's code runs: a block that runs alone is on the worker's main
thread (signals, ``signal.alarm``, ``threading.main_thread()``), concurrent blocks run beside
it in threads, and the namespace is ``sys.modules["__main__"]`` (pickling by reference,
``multiprocessing``, ``ProcessPoolExecutor``, logging's names).  Real workers."""

from __future__ import annotations

import asyncio


async def test_a_lone_block_runs_on_the_main_thread(worker):
    result = await worker.run("import threading\nt = threading.current_thread()\n"
                              "print(t is threading.main_thread(), t.name, t.daemon)")
    assert result.output == "True MainThread False\n", result


async def test_after_a_long_block_the_next_one_is_on_the_main_thread_again(worker):
    # A long block has the listening taken over by another thread; the next block is handed back.
    await worker.run("import time\ntime.sleep(0.2)")
    for _ in range(20):
        result = await worker.run("import threading\nprint(threading.current_thread().name)")
        assert result.output == "MainThread\n", result
    for _ in range(10):  # long and short blocks, one after the other
        long = await worker.run("import threading, time\ntime.sleep(0.01)\nprint(threading.current_thread().name)")
        short = await worker.run("import threading\nprint(threading.current_thread().name)")
        assert (long.output, short.output) == ("MainThread\n", "MainThread\n"), (long, short)


async def test_signal_handlers_and_alarm_work_in_a_lone_block(worker):
    code = ("import signal, time\n"
            "def on_alarm(signum, frame):\n    raise RuntimeError('alarm rang')\n"
            "signal.signal(signal.SIGALRM, on_alarm)\n"
            "signal.alarm(1)\n"
            "try:\n    time.sleep(30)\nexcept RuntimeError as exc:\n    print('caught:', exc)\n"
            "finally:\n    signal.signal(signal.SIGALRM, signal.SIG_DFL)\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    result = await worker.run(code, timeout=20)
    assert result.status == "ok", result
    assert result.output == "caught: alarm rang\nTrue\n"


async def test_concurrent_blocks_run_beside_the_main_one(worker):
    started = asyncio.Event()
    first = asyncio.ensure_future(worker.run(
        "import threading, time\nprint(threading.current_thread().name, flush=True)\n"
        "while not globals().get('release'):\n    time.sleep(0.01)\n", timeout=60,
        on_output=lambda c: started.set()))
    await asyncio.wait_for(started.wait(), 30)
    beside = await asyncio.gather(*(worker.run(
        "import signal, threading\nprint(threading.current_thread() is threading.main_thread())\n"
        "try:\n    signal.signal(signal.SIGUSR1, signal.SIG_IGN)\nexcept ValueError as exc:\n    print(exc)\n")
        for _ in range(3)))
    for result in beside:
        assert result.output == "False\nsignal only works in main thread of the main interpreter\n", result
    await worker.run("release = True")
    assert (await first).output == "MainThread\n"


async def test_block_functions_and_classes_pickle_by_reference(worker):
    code = ("import pickle, sys\n"
            "def f(x):\n    return x + 1\n"
            "class Point:\n    def __init__(self, x): self.x = x\n"
            "g, P = pickle.loads(pickle.dumps((f, Point)))\n"
            "p = pickle.loads(pickle.dumps(Point(3)))\n"
            "print(g is f, P is Point, type(p) is Point, p.x)\n"
            "print(sys.modules['__main__'].__dict__ is globals(), __name__)\n")
    result = await worker.run(code)
    assert result.output == "True True True 3\nTrue __main__\n", result


async def test_multiprocessing_pool_maps_a_block_defined_function(worker):
    code = ("import multiprocessing as mp\n"
            "def square(x):\n    return x * x\n"
            "class Box:\n    def __init__(self, v): self.v = v\n"
            "def box(v):\n    return Box(v)\n"
            "with mp.Pool(2) as pool:\n"
            "    print(pool.map(square, range(6)), [b.v for b in pool.map(box, range(3))])\n")
    result = await worker.run(code, timeout=60)
    assert result.status == "ok", result
    assert result.output == "[0, 1, 4, 9, 16, 25] [0, 1, 2]\n"


async def test_process_pool_executor_and_what_its_children_print(worker):
    code = ("from concurrent.futures import ProcessPoolExecutor\n"
            "def cube(x):\n    print('child', x, flush=True)\n    return x ** 3\n"
            "with ProcessPoolExecutor(2) as ex:\n    print(sorted(ex.map(cube, range(4))))\n")
    result = await worker.run(code, timeout=60)
    assert result.status == "ok", result
    # What the children print reaches the block through fd 1, the parent's print directly: the
    # two may interleave otherwise than under python (a documented difference), but none is lost.
    lines = result.output.splitlines()
    assert sorted(lines) == ["[0, 1, 8, 27]"] + [f"child {i}" for i in range(4)]


async def test_logging_names_module_and_thread_as_a_script_does(worker):
    code = ("import logging, sys\n"
            "logging.basicConfig(stream=sys.stdout, format='%(name)s %(threadName)s %(message)s', force=True)\n"
            "logging.getLogger(__name__).warning('hello')\n")
    result = await worker.run(code)
    assert result.output == "__main__ MainThread hello\n", result
