"""The block runtime: one persistent namespace, many concurrent blocks.

A block without ``await`` runs in a thread (the one that received it); a block with
top-level ``await`` runs as a task on the worker's event loop.  Both see the same namespace,
so imports, variables and functions persist across blocks.

Cancellation is cooperative here (cancel the task; raise ``BlockCancelled`` in the block's
thread).  Code stuck in C ignores both; the coordinator then kills the whole worker — this
module never has to be the last line of defence.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import collections
import concurrent.futures
import contextvars
import ctypes
import inspect
import linecache
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from . import proxy, script, wire
from .capture import FdCapture, Router, current_block

_WORKER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MAX_VARS = 100
_KEPT_SOURCES = 1000  # block sources kept for tracebacks; a long session must not grow forever


class BlockCancelled(BaseException):
    """Raised inside a block's thread to cancel it.  A BaseException, so that a broad
    ``except Exception`` in user code does not swallow the cancellation."""


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


def block_filename(block_id: str) -> str:
    return f"<block {block_id}>"


def _is_user_file(filename: str) -> bool:
    return not filename.startswith(_WORKER_DIR) and "asyncio" + os.sep not in filename.replace(
        "/", os.sep)


def _is_block(filename: str, block_file: str | None) -> bool:
    return filename == block_file or filename.startswith("<block ")


def _trim(te: traceback.TracebackException, seen: set[int], block_file: str | None) -> None:
    """Drop the worker's own frames (and asyncio's scaffolding around a task) from a traceback."""
    if id(te) in seen:
        return
    seen.add(id(te))
    frames = list(te.stack)
    start = next((i for i, f in enumerate(frames) if _is_block(f.filename, block_file)), 0)
    te.stack = traceback.StackSummary.from_list(
        [f for f in frames[start:] if _is_user_file(f.filename)])
    for nested in (te.__cause__, te.__context__):
        if nested is not None:
            _trim(nested, seen, block_file)


def format_user_error(exc: BaseException, block_file: str | None = None) -> str:
    """A traceback of the user's frames only, with the block's own line numbers and source.
    ``block_file``: the name the block was compiled under, when it is not ``<block ID>``."""
    if isinstance(exc, SyntaxError) and exc.filename and _is_block(exc.filename, block_file):
        return "".join(traceback.format_exception_only(exc))  # raised by compile(): no user frames
    te = traceback.TracebackException.from_exception(exc)
    _trim(te, set(), block_file)
    return "".join(te.format())


class _Running:
    """A sync block's thread, as far as cancellation is concerned.  ``cancel`` raises
    ``BlockCancelled`` in the thread only while the block runs, and one that lands late is
    cleared before the thread does anything else."""

    __slots__ = ("ident", "native_id", "lock", "active", "cancelled")

    def __init__(self) -> None:
        self.ident: int | None = None
        self.native_id: int | None = None
        self.lock = threading.Lock()
        self.active = False
        self.cancelled = False

    def enter(self) -> bool:
        """The block starts in this thread; False if it was cancelled before it could."""
        with self.lock:
            self.ident, self.native_id = threading.get_ident(), threading.get_native_id()
            self.active = not self.cancelled
            return self.active

    def leave(self) -> None:
        # A cancel may land anywhere until ``active`` is False under the lock: retry until the
        # thread is out of reach, then clear what was raised but not yet delivered.
        while True:
            try:
                with self.lock:
                    self.active = False
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), None)
                return
            except BlockCancelled:
                continue

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.active:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.ident), ctypes.py_object(BlockCancelled))

    def position(self) -> tuple[int, int] | None:
        """Where the thread is: (frame identity, bytecode offset); None when not running."""
        frame = sys._current_frames().get(self.ident or -1) if self.active else None
        return None if frame is None else (id(frame), frame.f_lasti)

    def sleeping(self) -> bool:
        """Whether the kernel has the thread waiting (state S or D), not running or runnable."""
        try:
            with open(f"/proc/self/task/{self.native_id}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"S", b"D")
        except (OSError, IndexError):
            return False


class Runtime:
    """Runs blocks in one namespace and sends each one's ``done`` with ``send``.

    A sync block runs in the thread that calls the function ``submit`` returns (the worker's
    listener itself, see ``serve``): no thread hand-off on the way in or out.  Awaiting blocks
    run as tasks on the user loop, started on first use.
    """

    def __init__(self, router: Router, fdcap: FdCapture | None, send: Callable[[dict], None],
                 call: proxy.Call, namespace: dict | None = None) -> None:
        self._call = call
        self._router = router
        self._fdcap = fdcap
        self._send = send
        self._user_loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins, "asyncio": asyncio}
        if namespace:
            self.namespace.update(namespace)
        self._base = set(self.namespace)
        self._tasks: dict[str, concurrent.futures.Future] = {}
        self._threads: dict[str, _Running] = {}
        self._sources: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._stdin: script.ScriptInput | None = None  # a script run's forwarded stdin

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
            if len(out) >= _MAX_VARS:
                break
        return out

    def submit(self, block_id: str, code: str, run_as: dict | None = None) -> Callable[[], None] | None:
        """Register a block so that a cancel finds it from now on.  Awaiting code starts on the
        user loop (None is returned); sync code is returned as a function for the caller to run
        in the thread of its choice.  ``run_as``: the ``script`` of a ``run`` message, to run
        the code as ``python FILE ARGS`` would (see ``script``)."""
        filename = block_filename(block_id)
        if run_as is not None:
            self._stdin = script.ScriptInput(bool(run_as.get("stdin")))
            filename = script.enter(self.namespace, run_as, self._stdin)
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
            return lambda: self._finish(block_id, *ctx.run(self._ending, block_id, run_as, ("error", error, None)))
        ctx = contextvars.copy_context()
        ctx.run(current_block.set, block_id)
        if compiled.co_flags & inspect.CO_COROUTINE:
            coro = eval(compiled, self.namespace)  # noqa: S307 - running user code is the job
            future = asyncio.run_coroutine_threadsafe(self._spawn(block_id, coro, ctx, run_as, filename),
                                                      self._loop())
            self._tasks[block_id] = future
            return None
        running = self._threads[block_id] = _Running()
        return lambda: ctx.run(self._run_sync, block_id, compiled, running, run_as, filename)

    def feed_stdin(self, data: bytes, eof: bool) -> None:
        """Bytes for a script run's stdin (dropped when no script run forwards it)."""
        if self._stdin is not None:
            self._stdin.feed(data, eof)

    @staticmethod
    def _outcome(exc: BaseException, filename: str) -> tuple[str, str, int | None]:
        """How a block that raised ``exc`` ended: (status, error, exit code).  A ``SystemExit``
        is an exit, with its message (``sys.exit("msg")``) written to stderr as CPython does."""
        if isinstance(exc, SystemExit):
            code, text = script.exit_status(exc)
            if text is not None:
                sys.stderr.write(text + "\n")
            return "exit", "", code
        return "error", format_user_error(exc, filename), None

    def _ending(self, block_id: str, run_as: dict | None, outcome: tuple[str, str, int | None]
                ) -> tuple[str, str, int | None]:
        """For a script run, what the interpreter does at the end: the traceback to stderr,
        then the threads and ``atexit`` handlers (``script.finish``).  Runs in the block's
        context, so what they print is the block's."""
        if run_as is None:
            return outcome
        status, error, code = outcome
        if status == "error":
            sys.stderr.write(error)
        if status in ("ok", "error", "exit"):
            try:
                script.finish()
            except BlockCancelled:
                return "cancelled", "", None
            except BaseException as exc:  # noqa: BLE001 - CPython reports it and exits all the same
                sys.stderr.write(format_user_error(exc))
        return outcome

    def _loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._user_loop is None:
                self._user_loop = _start_loop()
            return self._user_loop

    async def _spawn(self, block_id: str, coro, ctx: contextvars.Context, run_as: dict | None,
                     filename: str) -> None:
        # A task of its own on the user loop, in the block's context.
        await asyncio.get_running_loop().create_task(self._run_async(block_id, coro, run_as, filename),
                                                     context=ctx)

    async def _run_async(self, block_id: str, coro, run_as: dict | None, filename: str) -> None:
        outcome: tuple[str, str, int | None]
        if run_as is not None:
            script.like_main_thread()
        try:
            await coro
        except asyncio.CancelledError:
            outcome = ("cancelled", "", None)
        except BaseException as exc:  # noqa: BLE001 - user code may raise anything
            outcome = self._outcome(exc, filename)
        else:
            outcome = ("ok", "", None)
        if run_as is not None:  # atexit handlers may block: not on the loop
            outcome = await asyncio.to_thread(self._ending, block_id, run_as, outcome)  # in this context
        if self._fdcap is not None:
            self._fdcap.drain(0.02)
        self._tasks.pop(block_id, None)
        self._finish(block_id, *outcome)

    def _run_sync(self, block_id: str, compiled, running: _Running, run_as: dict | None = None,
                  filename: str = "") -> None:
        outcome: tuple[str, str, int | None] = ("cancelled", "", None)
        if run_as is not None:
            script.like_main_thread()
        try:
            if running.enter():
                try:
                    exec(compiled, self.namespace)  # noqa: S102
                except BlockCancelled:
                    pass
                except BaseException as exc:  # noqa: BLE001
                    outcome = self._outcome(exc, filename)
                else:
                    outcome = ("ok", "", None)
                outcome = self._ending(block_id, run_as, outcome)
        except BlockCancelled:  # landed in the handlers above
            pass
        finally:
            running.leave()
        if self._fdcap is not None:
            self._fdcap.drain()
        self._threads.pop(block_id, None)
        self._finish(block_id, *outcome)

    def _finish(self, block_id: str, status: str, error: str, code: int | None = None) -> None:
        self._router.end(block_id)
        self._send(wire.done(block_id, status, error, self.user_vars(), code))

    def position(self, block_id: str) -> tuple[int, int] | None:
        """Where a thread block is (frame, bytecode offset), to compare before and after a cancel."""
        running = self._threads.get(block_id)
        return running.position() if running is not None else None

    def stuck(self, block_id: str, at_cancel: tuple[int, int] | None, window: float = 0.01) -> bool:
        """After a cancel: is the block where cancellation cannot reach it?  Waits ``window``.
        A thread still at the very bytecode it was at when cancelled is blocked in C (one that
        moved on is running its cleanup, and gets the grace); an awaiting block is stuck when
        its loop does not answer within ``window`` (sync code blocks it).  Either way only a
        kill stops it, and waiting out the grace would be time lost."""
        running = self._threads.get(block_id)
        if running is not None:
            time.sleep(window)
            # Waiting in the kernel, at the same place: a spinning thread the scheduler starved
            # would be runnable, and is given the grace instead.
            return (block_id in self._threads and at_cancel is not None
                    and running.position() == at_cancel and running.sleeping())
        if block_id in self._tasks and self._user_loop is not None:
            ping = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._user_loop)
            time.sleep(window)
            return block_id in self._tasks and not ping.done()
        return False

    def cancel(self, block_id: str) -> bool:
        """Ask a block to stop.  Returns False when no such block runs."""
        future = self._tasks.get(block_id)
        if future is not None:
            future.cancel()  # cancels the _spawn task, which cancels the block's task
            return True
        running = self._threads.get(block_id)
        if running is None:
            return False
        running.cancel()
        return True

    # -- control requests from the coordinator ------------------------------------------------
    def control(self, op: str, args: dict) -> object:
        """Bind host stubs and ``self``, export or inject objects, describe, report the environment."""
        if op == "bind":
            added = {}
            for spec in args.get("host", []):
                added[spec["name"]] = proxy.host_stub(self._call, spec)
            if args.get("self"):
                added["self"] = proxy.AgentSelf(self._call, self.namespace)
            self.namespace.update(added)
            self.base_names(set(added))
            return sorted(added)
        if op == "export":
            items, errors = proxy.export(self.namespace, list(args.get("names", [])))
            return {"items": items, "errors": errors}
        if op == "inject":
            names = proxy.inject(self.namespace, args.get("items", {}), self._call)
            self.base_names(set(names))
            return names
        if op == "describe":
            from .describe import describe_object

            return [describe_object(n, self.namespace[n]) for n in args.get("names", []) if n in self.namespace]
        if op == "env":
            from .environment import describe_environment

            return describe_environment()
        raise ValueError(f"unknown request {op!r}")
