"""The block runtime: one persistent namespace, many concurrent blocks.

Where blocks run (the rule, for every worker):

- A block without ``await`` runs on the worker's **main thread** whenever the main thread is
  free, which it is whenever no other such block runs.  A block that runs alone therefore runs
  where a script's code runs: ``signal.signal``, ``signal.alarm``, ``threading.main_thread()``
  and libraries that need the main thread work as under ``python``, and logging names the
  thread ``MainThread``.  A sync block that starts while another one holds the main thread runs
  beside it in a thread of its own; nothing moves between threads once started.
- A block with top-level ``await`` runs as a task on the worker's event loop, in a thread of
  its own.
- They all share one namespace, and that namespace is ``sys.modules["__main__"]``: functions
  and classes a block defines pickle by reference as a script's do, so ``multiprocessing`` and
  ``ProcessPoolExecutor`` find them in children forked from the worker.  A child started by
  spawn or forkserver re-imports ``__main__`` from its file: a script run's (``exec``) is
  found, an agent block's code has no file (as in a REPL or Jupyter).

Interrupts (a deadline, a cancel, Ctrl-C): the block gets an exception *inside* what it waits
on, as Jupyter's interrupt does, and its namespace, the worker and other blocks are kept.

- On the main thread: ``INTERRUPT_SIGNAL`` is sent to that thread, so a blocking call
  (``time.sleep``, ``Event.wait``, ``queue.get``, ``select``, socket reads, ``subprocess``
  waits) returns EINTR and Python runs the handler, which raises: ``TimeoutError`` naming the
  deadline for a deadline; for a cancel what Ctrl-C gives in a script, the code's own SIGINT
  handler if it set one, else ``KeyboardInterrupt``.  One that arrives while the runtime sends
  (output taken off its queue, a host call) is raised once that is sent, so nothing is lost.
- In another thread: the same exception is raised asynchronously in that thread.  CPython
  runs it only when the thread next executes bytecode: a signal cannot end another thread's
  blocking call (CPython retries the call, measured on 3.11-3.13), so a loop of short waits
  stops within one wait, a single long wait only when it returns.
- An awaiting block: its task is cancelled (``CancelledError`` at the ``await``).

What an interrupt cannot reach is said in words (see ``assess``): signals blocked or ignored,
an event loop held by synchronous code, C code that restarts its wait.  The coordinator then
kills the worker, at once when the worker says it is stuck, else when the grace runs out; code
that holds the interpreter in C (a catastrophic regular expression) cannot even be looked at,
and the coordinator says so.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import collections
import concurrent.futures
import contextlib
import contextvars
import inspect
import linecache
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import ClassVar

from . import capture, proxy, script_run
from ._running import MAIN, Running, deadline_words, has_signal, interrupt_note, task_status
from .capture import FdCapture, Router, current_block
from .contract import wire
from .contract.limits import INTERRUPT_SIGNAL, MAX_VARS
from .display import Displays
from .tracebacks import block_filename, format_user_error

__all__ = ["Runtime"]

_WORKER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_KEPT_SOURCES = 1000  # block sources kept for tracebacks; a long session must not grow forever


# ``INTERRUPT_SIGNAL`` interrupts a block on the main thread: one no library uses, so a
# handler the code installs for SIGINT or SIGALRM is never replaced or confused with it.
_WINDOW = 0.02  # seconds an interrupt is given before the runtime looks at what it did


#: Where the runtime sends (output taken off its queue, a ``done``, a host call): an exception
#: raised there, or in pyzmq below, would lose what is on its way out, so an interrupt waits
#: until it is left (``Runtime._after_send``, or the next signal ``assess`` sends).
_SENDING_FILES = frozenset(os.path.join(_WORKER_DIR, n) for n in (
    "channel.py", "_outpipe.py", "contract/wire.py", "contract/framing.py", "contract/schema.py",
    "contract/output.py"))


#: The coroutines of the runtime's own tasks, one pair per awaiting block that runs.
_BLOCK_TASKS = frozenset({"Runtime._spawn", "Runtime._run_async"})


def _put_off(frame) -> bool:
    """Whether the main thread, interrupted in ``frame``, is sending, or in this module's own
    code (before the block's code starts or after it ended: the interrupt is for the code)."""
    if frame is not None and frame.f_code.co_filename == __file__:
        return True
    while frame is not None:
        if frame.f_code in capture.SENDING_CODES or frame.f_code.co_filename in _SENDING_FILES:
            return True
        frame = frame.f_back
    return False


def _start_loop() -> asyncio.AbstractEventLoop:
    """An event loop in a thread of its own, for blocks that ``await``."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    threading.Thread(target=run, name="agentloop-user-loop", daemon=True).start()
    ready.wait(10)
    return loop


class Runtime:
    """Runs blocks in one namespace and sends each one's ``done`` with ``send``.

    A sync block runs in the thread that calls the function ``submit`` returns (the worker's
    listener itself, see ``serve``, which picks the main thread when it is free): no thread
    hand-off on the way in or out.  Awaiting blocks run as tasks on the user loop, started on
    first use.  ``on_main_free`` is called on the main thread when a block there is over, just
    before its ``done`` is sent.  ``displays``: what ``display()`` in the namespace sends, told
    when each block ends (``Displays.end``: the figures it left open are shown).
    """

    def __init__(self, router: Router, fdcap: FdCapture | None, send: Callable[[dict], None],
                 call: proxy.Call, namespace: dict | None = None, displays: Displays | None = None,
                 on_main_free: Callable[[], None] = lambda: None) -> None:
        self._host = call
        self._router = router
        self._fdcap = fdcap
        self._send = send
        self._user_loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        # The namespace is the dict of the module ``__main__`` resolves to, so that pickle finds
        # what blocks define (``f.__module__ == "__main__"``), as it does in a script.
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        self.namespace: dict = main.__dict__
        self.namespace.update({"__builtins__": builtins, "asyncio": asyncio})
        self._displays = displays
        if displays is not None:
            self.namespace["display"] = displays.display
        if namespace:
            self.namespace.update(namespace)
        self._on_main_free = on_main_free
        self._main = MAIN
        self._on_main: Running | None = None  # the block the main thread runs
        self._base = set(self.namespace)
        self._tasks: dict[str, concurrent.futures.Future] = {}
        self._threads: dict[str, Running] = {}
        self._sources: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._stdin: script_run.ScriptInput | None = None  # a script run's forwarded stdin

    def _call(self, name: str, args: list, kwargs: dict, block: str | None) -> concurrent.futures.Future:
        """A host call, by whichever channel the process has now: the stubs and ``self``
        bound in the namespace call through here, so a fork's copies call through their own."""
        return self._host(name, args, kwargs, block)

    def running_blocks(self) -> list[str]:
        """The ids of the blocks that run now."""
        return [*self._threads, *self._tasks]

    def pending_tasks(self) -> list[str]:
        """The tasks on the user loop that are not done (what a block left running there), the
        runtime's own tasks of the blocks that run left out (``running_blocks`` names those)."""
        loop = self._user_loop
        if loop is None:
            return []
        found = [(task.get_name(), getattr(task.get_coro(), "__qualname__", "?"))
                 for task in asyncio.all_tasks(loop) if not task.done()]
        return [f"{name} ({what})" for name, what in found if what not in _BLOCK_TASKS]

    def loop_executor_threads(self) -> frozenset[int]:
        """The threads of the user loop's default executor (``asyncio.to_thread``): idle ones
        wait there for ever, and a fork's copy, which starts a loop of its own, needs none."""
        executor = getattr(self._user_loop, "_default_executor", None)
        threads = getattr(executor, "_threads", ())
        return frozenset(t.ident for t in list(threads) if t.ident is not None)

    def rewire(self, router: Router, fdcap: FdCapture, send: Callable[[wire.Message], None], call: proxy.Call,
               on_main_free: Callable[[], None]) -> None:
        """In a fork's copy of this process (one thread, this one, the main thread now): the
        same namespace, its output, messages and host calls going by the copy's own channel,
        and no block running.  The user loop was the parent's (its thread is gone, and its
        epoll descriptor is shared with the parent): a new one starts on first use."""
        self._router, self._fdcap, self._send, self._host = router, fdcap, send, call
        self._on_main_free = on_main_free
        if self._displays is not None:
            self._displays.rewire(send, router)
        loop, self._user_loop = self._user_loop, None
        if loop is not None:
            for fd in (loop._selector.fileno(), loop._ssock.fileno(), loop._csock.fileno()):  # type: ignore[attr-defined]
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._loop_lock = threading.Lock()
        self._main = threading.get_ident()
        self._on_main = None
        self._tasks.clear()
        self._threads.clear()
        self._stdin = None

    def base_names(self, names: set[str]) -> None:
        """Names injected by the host (tools, ``self``): not reported as the user's variables."""
        self._base |= names

    def user_vars(self) -> list[str]:
        """``name:type`` of the user's variables (``type(len)`` for sized builtins), as the
        status note shows them."""
        out = []
        for name, value in list(self.namespace.items()):
            if name in self._base or name.startswith("_") or inspect.ismodule(value):
                continue
            descr = type(value).__name__
            if isinstance(value, (str, bytes, list, dict, tuple, set)):
                descr += f"({len(value)})"
            out.append(f"{name}:{descr}")
            if len(out) >= MAX_VARS:
                break
        return out

    def submit(self, block_id: str, code: str, run_as: wire.ScriptSpec | None = None) -> Callable[[], None] | None:
        """Register a block so that a cancel finds it from now on.  Awaiting code starts on the
        user loop (None is returned); sync code is returned as a function for the caller to run
        in the thread of its choice.  ``run_as``: the ``script`` of a ``run`` message, to run
        the code as ``python FILE ARGS`` would (see ``script``)."""
        filename = block_filename(block_id)
        if run_as is not None:
            if self._displays is not None:  # python's: no display()
                self._displays.scripts.add(block_id)
                if self.namespace.get("display") == self._displays.display:
                    del self.namespace["display"]
            self._stdin = script_run.ScriptInput(run_as.stdin)
            filename = script_run.enter(self.namespace, run_as, self._stdin)
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self._sources[filename] = None
        self._sources.move_to_end(filename)
        if len(self._sources) > _KEPT_SOURCES:  # tracebacks of old blocks lose their source lines
            linecache.cache.pop(self._sources.popitem(last=False)[0], None)
        self._router.begin(block_id)
        try:
            compiled = compile(code, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                               dont_inherit=True)
        except Exception as exc:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes),
            # RecursionError or MemoryError (deep nesting): the block's error, not the worker's
            error = format_user_error(exc, filename)
            ctx = contextvars.copy_context()
            ctx.run(current_block.set, block_id)
            return lambda: self._finish(block_id, *ctx.run(self._ending, block_id, run_as,
                                                           ("error", error, None)))
        ctx = contextvars.copy_context()
        ctx.run(current_block.set, block_id)
        if compiled.co_flags & inspect.CO_COROUTINE:
            coro = eval(compiled, self.namespace)  # noqa: S307 - running user code is the job
            future = asyncio.run_coroutine_threadsafe(self._spawn(block_id, coro, ctx, run_as, filename),
                                                      self._loop())
            self._tasks[block_id] = future
            # (A block that ends at once has popped itself before it was put there.)
            future.add_done_callback(lambda f, b=block_id: self._tasks.get(b) is f and self._tasks.pop(b, None))
            return None
        running = self._threads[block_id] = Running()
        return lambda: ctx.run(self._run_sync, block_id, compiled, running, run_as, filename)

    def feed_stdin(self, data: bytes, eof: bool) -> None:
        """Bytes for a script run's stdin (dropped when no script run forwards it)."""
        if self._stdin is not None:
            self._stdin.feed(data, eof)

    @staticmethod
    def _outcome(exc: BaseException, filename: str, running: Running | None = None
                 ) -> tuple[str, str, int | None]:
        """How a block that raised ``exc`` ended: (status, error, exit code).  A ``SystemExit``
        is an exit, with its message (``sys.exit("msg")``) written to stderr as CPython does;
        an exception that ended an interrupted block is its interrupt ("cancelled"), with the
        traceback, which says where the code was."""
        if isinstance(exc, SystemExit):
            code, text = script_run.exit_status(exc)
            if text is not None:
                sys.stderr.write(text + "\n")
            return "exit", "", code
        status = "cancelled" if running is not None and running.took(exc) else "error"
        return status, format_user_error(exc, filename), None

    def _ending(self, block_id: str, run_as: wire.ScriptSpec | None, outcome: tuple[str, str, int | None],
                running: Running | None = None, raised: BaseException | None = None
                ) -> tuple[str, str, int | None]:
        """For a script run, what the interpreter does at the end: the traceback to stderr,
        then the threads and ``atexit`` handlers (``script_run.finish``), which run after an
        interrupt too (as after a ``KeyboardInterrupt`` in CPython).  A ``KeyboardInterrupt``
        the script raised itself (``raised``; not an interrupt of ours) ends it as CPython
        ends: status 130, as if killed by SIGINT.  Runs in the block's context, so what they
        print is the block's."""
        if run_as is None:
            return outcome
        status, error, code = outcome
        if status in ("error", "cancelled"):
            sys.stderr.write(error)
        if status == "error" and isinstance(raised, KeyboardInterrupt):
            outcome = ("exit", "", 128 + signal.SIGINT)
        try:
            script_run.finish()
        except BaseException as exc:  # noqa: BLE001 - CPython reports it and exits all the same
            if running is not None and running.took(exc):
                return "cancelled", error, None
            sys.stderr.write(format_user_error(exc))
        return outcome

    def _loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._user_loop is None:
                self._user_loop = _start_loop()
            return self._user_loop

    async def _spawn(self, block_id: str, coro, ctx: contextvars.Context, run_as: wire.ScriptSpec | None,
                     filename: str) -> None:
        # A task of its own on the user loop, in the block's context.
        await asyncio.get_running_loop().create_task(self._run_async(block_id, coro, run_as, filename),
                                                     context=ctx)

    async def _run_async(self, block_id: str, coro, run_as: wire.ScriptSpec | None, filename: str) -> None:
        outcome: tuple[str, str, int | None]
        note = ""
        if run_as is not None:
            script_run.like_main_thread()
        try:
            await coro
        except asyncio.CancelledError:
            outcome = ("cancelled", "", None)
            note = "its task was cancelled (CancelledError at the await it was waiting on)"
        except BaseException as exc:  # noqa: BLE001 - user code may raise anything
            outcome = self._outcome(exc, filename)
        else:
            outcome = ("ok", "", None)
        if run_as is not None:  # atexit handlers may block: not on the loop
            outcome = await asyncio.to_thread(self._ending, block_id, run_as, outcome)  # in this context
        if self._fdcap is not None:
            self._fdcap.drain(0.02)
        self._tasks.pop(block_id, None)
        self._finish(block_id, *outcome, note=note)

    def _run_sync(self, block_id: str, compiled, running: Running, run_as: wire.ScriptSpec | None = None,
                  filename: str = "") -> None:
        outcome: tuple[str, str, int | None] = ("cancelled", "", None)
        if run_as is not None:
            script_run.like_main_thread()
        if threading.get_ident() == self._main:
            self._on_main = running  # before it can be interrupted: the handler looks here
        try:
            if running.enter():
                raised = None
                try:
                    exec(compiled, self.namespace)  # noqa: S102
                except BaseException as exc:  # noqa: BLE001
                    outcome, raised = self._outcome(exc, filename, running), exc
                else:
                    outcome = ("ok", "", None)
                outcome = self._ending(block_id, run_as, outcome, running, raised)
                del raised  # its traceback holds the block's frames
        except BaseException as exc:  # noqa: BLE001 - the interrupt landed in the handlers above
            if not running.took(exc):
                outcome = ("error", format_user_error(exc, filename), None)
        finally:
            running.leave()
        if self._on_main is running:
            self._on_main = None
        if self._fdcap is not None:
            self._fdcap.drain()
        self._threads.pop(block_id, None)
        self._finish(block_id, *outcome, note=interrupt_note(running, outcome[0]))

    def _finish(self, block_id: str, status: str, error: str, code: int | None = None,
                note: str = "") -> None:
        if self._displays is not None:  # (as a cell's end in Jupyter: the figures left open are shown)
            self._displays.end(block_id, shown=status != "cancelled")
        self._router.end(block_id)
        if threading.get_ident() == self._main:
            self._on_main_free()
        self._send(wire.done(block_id, status, error, self.user_vars(), code, note))

    # -- interrupts ---------------------------------------------------------------------------
    def install_interrupts(self) -> None:
        """On the main thread: the handler of ``INTERRUPT_SIGNAL``, and SIGINT as a script has
        it (a coordinator that ignored it must not leave the code ignoring it)."""
        signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        capture.after_send = self._after_send

    def _after_send(self) -> None:
        # Output has left: an interrupt put off while it was being sent is given now.
        running = self._on_main
        if running is not None and running.deferred and threading.get_ident() == self._main:
            self._on_signal(INTERRUPT_SIGNAL, None)

    def _on_signal(self, signum: int, frame) -> None:
        # Runs on the main thread between two bytecodes (or where a blocking call returned
        # EINTR): raise only into the block that was asked to stop, and only once.
        running = self._on_main
        if running is None or not running.active or not running.pending:
            return
        if _put_off(frame):
            running.deferred = True  # raised once sent (``_after_send``), or at the next signal
            return
        running.pending = running.deferred = False
        if running.reason == "cancel":
            handler = signal.getsignal(signal.SIGINT)
            if handler is signal.default_int_handler:
                running.given = "KeyboardInterrupt"
                raise KeyboardInterrupt
            if callable(handler):
                running.given = "its SIGINT handler"
                handler(signal.SIGINT, frame)  # what Ctrl-C does in a script that set one
            # SIG_IGN or SIG_DFL: Ctrl-C would be ignored, or end the process; ``assess`` says so
            return
        running.given = "TimeoutError"
        raise TimeoutError(deadline_words(running.deadline))

    def interrupt(self, block_id: str, reason: str, deadline: float | None = None) -> bool:
        """Ask a block to stop: ``reason`` "timeout" (``TimeoutError`` naming ``deadline``) or
        "cancel" (what Ctrl-C gives).  Returns False when no such block runs."""
        future = self._tasks.get(block_id)
        if future is not None:
            future.cancel()  # cancels the _spawn task, which cancels the block's task
            return True
        running = self._threads.get(block_id)
        if running is None:
            return False
        running.interrupt(reason, deadline)
        return True

    def assess(self, block_id: str, window: float = _WINDOW) -> tuple[str, str] | None:
        """After an interrupt, wait up to ``window`` for the block to end, then say how things
        stand: None if it ended; ("stuck", why) when the interrupt cannot reach it (only a kill
        stops it, and waiting out the grace would be time lost); else ("stopping", why), the
        words for a kill should the grace run out."""
        running = self._threads.get(block_id)
        if running is not None:
            # What needs little waiting first: a signal blocked or ignored, seen twice 10 ms
            # apart (CPython blocks signals for a moment while it starts a subprocess).
            verdict = self._assess_main(running, at_once=True) if running.on_main else None
            if verdict is not None:
                time.sleep(0.01)
                verdict = None if running.ended else self._assess_main(running, at_once=True)
            until = time.monotonic() + window
            while verdict is None and not running.ended and time.monotonic() < until:
                time.sleep(0.002)
                running.signal_again()
            if running.ended:
                return None
            if verdict is not None:
                return verdict
            return self._assess_main(running) if running.on_main else self._assess_thread(running)
        if block_id in self._tasks and self._user_loop is not None:
            ping = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._user_loop)
            try:
                ping.result(window)
            except concurrent.futures.TimeoutError:
                if block_id in self._tasks:
                    return ("stuck", "it is an awaiting block whose event loop is held by a call that "
                                     "does not await (a synchronous wait or computation), where "
                                     "cancelling its task cannot reach")
                return None
            return ("stopping", "its task was cancelled, and it goes on running (it caught the "
                                "CancelledError, or waits in its cleanup)")
        return None

    def _assess_main(self, running: Running, at_once: bool = False) -> tuple[str, str] | None:
        """How a block on the main thread stands; ``at_once``: only a verdict of "stuck" that
        needs no waiting (None otherwise)."""
        what = "KeyboardInterrupt" if running.reason == "cancel" else "TimeoutError"
        if running.reason == "cancel":
            handler = signal.getsignal(signal.SIGINT)
            if handler == signal.SIG_IGN:
                return ("stuck", "it ignores SIGINT (signal.SIG_IGN): Ctrl-C cannot interrupt it")
            if handler in (signal.SIG_DFL, None):
                return ("stuck", "its SIGINT handler is SIG_DFL, with which Ctrl-C ends the process")
        if signal.getsignal(INTERRUPT_SIGNAL) != self._on_signal:
            return ("stuck", f"it replaced the handler of signal {INTERRUPT_SIGNAL} (SIGRTMIN+5), "
                             "which agentloop interrupts blocks with")
        fields = {} if running.given else task_status(running.native_id)
        pending = has_signal(fields, "SigPnd") or has_signal(fields, "ShdPnd")
        if pending and has_signal(fields, "SigBlk"):
            return ("stuck", "it waits with signals blocked (signal.pthread_sigmask), where no "
                             f"{what} can be raised in it")
        if has_signal(fields, "SigIgn"):
            return ("stuck", f"it ignores signal {INTERRUPT_SIGNAL}, which agentloop interrupts blocks with")
        if at_once:
            return None
        if running.given:
            return ("stopping", f"{running.given} was raised in it, and it kept running (it caught "
                                "the exception, or its cleanup takes long)" if running.given != "its SIGINT handler"
                    else "its SIGINT handler was called, and it kept running")
        state = fields.get("State", "?")[:1]
        if state in ("S", "D") and not pending:
            return ("stopping", f"the interrupt reached it but no {what} could be raised: it waits in C "
                                "code that resumes its wait when a signal interrupts it, without "
                                "returning to Python")
        return ("stopping", f"it is running C code that has not returned to Python, where no {what} "
                            "can be raised until it does")

    @staticmethod
    def _assess_thread(running: Running) -> tuple[str, str]:
        what = "KeyboardInterrupt" if running.reason == "cancel" else "TimeoutError"
        state = task_status(running.native_id).get("State", "?")[:1]
        where = ("waiting in C (a sleep, a lock, a read)" if state in ("S", "D")
                 else "running C code or a loop that catches it")
        return ("stopping", f"it runs in a thread of its own (another block had the main thread), where "
                            f"the {what} lands only when the code next runs Python, and it stayed "
                            f"{where}")

    # -- control requests from the coordinator ------------------------------------------------
    def answer(self, request: wire.Message) -> wire.Message:
        """Do a control request (``wire.REQUESTS``): bind host stubs and ``self``, export or
        inject objects, describe them, say what the machine is; its reply (``wire.REPLIES``).
        What it raises is the coordinator's to hear, as words."""
        return self._answers[type(request)](self, request)

    def _bind(self, request: wire.Bind) -> wire.Bound:
        added: dict[str, object] = {spec.name: proxy.host_stub(self._call, spec) for spec in request.host}
        if request.agent:
            added["self"] = proxy.AgentSelf(self._call, self.namespace)
        self.namespace.update(added)
        self.base_names(set(added))
        return wire.Bound(request.rid, tuple(sorted(added)))

    def _export(self, request: wire.Export) -> wire.Exported:
        items, errors = proxy.export(self.namespace, list(request.names))
        return wire.exported(request.rid, items, errors)

    def _inject(self, request: wire.Inject) -> wire.Injected:
        names = proxy.inject(self.namespace, request.items)
        self.base_names(set(names))
        return wire.Injected(request.rid, tuple(names))

    def _describe(self, request: wire.Describe) -> wire.Described:
        from .contract.describe import describe_object

        namespace = self.namespace
        return wire.described(request.rid, [describe_object(n, namespace[n]) for n in request.names if n in namespace])

    def _environment(self, request: wire.Env) -> wire.Environment:
        from .environment import describe_environment

        return wire.environment(request.rid, describe_environment())

    _answers: ClassVar[dict[type, Callable]] = {wire.Bind: _bind, wire.Export: _export, wire.Inject: _inject,
                                                 wire.Describe: _describe, wire.Env: _environment}
