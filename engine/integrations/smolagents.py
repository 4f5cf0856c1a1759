"""agentloop's sandboxed worker as the code executor of smolagents' ``CodeAgent``.

The few lines a user writes::

    from smolagents import CodeAgent, InferenceClientModel
    from engine.integrations.smolagents import AgentloopExecutor

    with CodeAgent(tools=[...], model=InferenceClientModel(),
                   executor=AgentloopExecutor(timeout="30s")) as agent:
        agent.run("How many primes are below 10,000?")

It keeps the contract of smolagents' own remote executors (E2B, Docker, Modal):

- A step's code runs in one worker whose namespace persists between steps; ``__call__``
  returns a ``CodeOutput``: ``logs`` are what it printed (head and tail, the cut counted) and
  a line for each image it displayed, ``output`` the ``repr`` of its last expression (as a
  Jupyter kernel reports it) or, when that is an image (a Pillow image: it has
  ``_repr_png_``), the image as smolagents' ``AgentImage``, and ``is_final_answer`` whether
  it called ``final_answer``.  Every PNG the step displayed (``display()``, matplotlib
  figures, ``Image.show()``) is in ``images`` afterwards, as ``AgentImage``s of the files
  agentloop kept (for a step callback to put in ``ActionStep.observations_images``, where
  smolagents shows images to a model); agentloop never decodes them itself.
- ``final_answer(...)`` ends the step: the final-answer tool runs in this process with the
  arguments, its value is the output, and the rest of the step does not run.
- ``send_variables`` puts the agent's variables in the namespace; ``send_tools`` offers the
  tools to the code as functions of the same name that run here, in this process, as host
  functions do for agentloop's own agents (so a tool keeps its credentials and clients).  Both
  survive a kill: a replacement worker is given them again before it runs a step.
- An exception, a deadline or a kill raises ``CodeFailed`` whose message holds the output and
  the traceback (or what the kill took), which ``CodeAgent`` puts in the agent's memory as it
  does for its other executors.  A step's deadline (``timeout``) is kept by the coordinator and
  ends in a kill of the worker's whole process tree when cancelling does not stop it.

What crosses between the worker and this process is plain data (None, bools, numbers, str,
bytes, lists, dicts with str keys): tool arguments, variables and the final answer.  A tool's
return value that is not plain data reaches the code as its ``repr``.

Nothing the worker names becomes a key in this process: a host call carries the id of the block
it came from, which the code can set to anything, so the final answer and the last value are
taken only from the step running now (one slot each, the repr cut at ``MAX_REPR``) and a call
naming any other id is refused in words, keeping nothing.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

try:
    from smolagents.agent_types import AgentImage
    from smolagents.local_python_executor import CodeOutput, PythonExecutor
except ImportError as exc:  # the optional extra: say how to get it
    from engine.extras import install_hint

    raise ImportError(f"AgentloopExecutor needs smolagents ({exc}): {install_hint('smolagents')}") from exc

from engine.agent import OUTPUT_BUDGET  # what a block's result carries, as an agent sees it
from engine.durations import parse_duration
from engine.errors import AgentloopError, CodeFailed, WorkerError
from engine.results import BlockResult, displays_words
from engine.sandbox import SandboxPolicy
from engine.workers import Engine, Worker
from worker.contract import wire

__all__ = ["AgentloopExecutor", "MAX_REPR", "is_plain", "with_last_value"]

log = logging.getLogger("agentloop")

#: Characters of a last expression's repr that are kept.
MAX_REPR = 20_000
#: Seconds beyond a step's own deadline that waiting for its result may take (the grace, the kill).
_MARGIN = 30.0
_FINAL = "final_answer"
_LAST_VALUE = "_agentloop_last_value"
_VALUE = "_agentloop_value"  # (the last expression's value, in the namespace: a name of ours)
_PLAIN = (type(None), bool, int, float, str, bytes)


class _FinalAnswerGiven(Exception):
    """Raised (as words) into the code by ``final_answer``: it ends the step."""


def is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` crosses to a worker as it is (msgpack's plain data)."""
    if isinstance(value, _PLAIN):
        return True
    if depth > 20:
        return False
    if isinstance(value, (list, tuple)):
        return all(is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v, depth + 1) for k, v in value.items())
    return False


def with_last_value(code: str) -> str:
    """``code`` with its last statement, when it is an expression, also reported: its repr
    (at most ``MAX_REPR`` characters) goes to the host function ``_agentloop_last_value``,
    with whether it was an image, which is then displayed.  The rewrite touches that statement
    only, so every line keeps its number."""
    try:
        tree = compile(code, "<step>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except (SyntaxError, ValueError):
        return code  # the worker reports it
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr) or last.end_lineno is None or last.end_col_offset is None:
        return code
    call = last.value
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in ("print", _FINAL):
        return code  # nothing to report: None, or the step ends inside
    lines = code.splitlines(keepends=True)

    def offset(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        line = lines[lineno - 1]
        return sum(len(x) for x in lines[:lineno - 1]) + len(line.encode()[:col].decode("utf-8", "replace"))

    start, end = offset(last.lineno, last.col_offset), offset(last.end_lineno, last.end_col_offset)
    value = f"({_VALUE} := ({code[start:end]}))"
    shown = f'hasattr({_VALUE}, "_repr_png_") and display({_VALUE}) is None'
    return f"{code[:start]}{_LAST_VALUE}(repr({value})[:{MAX_REPR}], {shown}){code[end:]}"


def _unwrap(text: str, original: str, rewritten: str) -> str:
    """``text`` (a traceback) showing the lines ``with_last_value`` changed as they were
    written, without the column markers under them (they point into the rewrite)."""
    swaps = {new.strip(): old.strip() for old, new in zip(original.splitlines(), rewritten.splitlines(), strict=False)
             if old != new and new.strip()}
    out: list[str] = []
    swapped = False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if swapped and stripped and set(stripped) <= set("~^"):
            swapped = False
            continue
        swapped = stripped in swaps
        if swapped:
            line = line[:len(line) - len(line.lstrip())] + swaps[stripped] + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return "".join(out)


def _spec(name: str, tool: Any) -> wire.HostFunction:
    """What a worker needs to build the function standing for ``tool`` (see ``worker.proxy``)."""
    target = getattr(tool, "forward", tool)
    try:
        signature = str(inspect.signature(target))
    except (TypeError, ValueError):
        signature = "(*args, **kwargs)"
    doc = getattr(tool, "description", None) or inspect.getdoc(target) or ""
    return wire.host_function(name, signature, str(doc))


class AgentloopExecutor(PythonExecutor):
    """Runs a ``CodeAgent``'s code in one sandboxed agentloop worker (see the module docstring).

    ``timeout``: each step's deadline (``30s``, ``5m`` or seconds); ``sandbox``, ``workspace``
    (the directory the code may write, default ``./files``), ``cwd`` (shown read-only when it
    is a project directory), ``python`` (the interpreter the worker runs) and ``preload`` are
    the engine's.  The worker starts in the constructor; call
    ``cleanup()`` (``CodeAgent.cleanup()`` and ``with CodeAgent(...)`` do) to stop it — an
    executor that is garbage-collected or outlived by the process stops it too.
    """

    def __init__(self, *, timeout: float | str = 30.0, sandbox: SandboxPolicy | None = None,
                 workspace: str | Path | None = None, cwd: str | Path | None = None,
                 python: str | None = None, preload: tuple[str, ...] = (), state_dir: str | Path | None = None,
                 budget: int = OUTPUT_BUDGET, start_timeout: float = 60.0) -> None:
        self.timeout = float(parse_duration(timeout))  # type: ignore[arg-type]
        self.budget = budget
        self.tools: dict[str, Callable[..., Any]] = {}
        self._step: str | None = None  # the block id of the step running now
        self._final: tuple[Any] | None = None  # (the answer,) once the step gave one
        self._last: str | None = None  # the step's last expression's repr
        self._last_image = False  # ... which was an image, displayed
        #: The PNGs the last step displayed, in order (``AgentImage``s of agentloop's files).
        self.images: list[AgentImage] = []
        self._steps = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agentloop-smolagents", daemon=True)
        self._thread.start()
        self.engine = Engine(cwd=cwd, workspace=workspace, sandbox=sandbox, python=python, preload=preload,
                             state_dir=state_dir, pool=0)
        self._closer = weakref.finalize(self, _stop, self._loop, self._thread, self.engine)
        try:
            self.worker: Worker = self._do(self._start(), start_timeout)
        except BaseException:
            self._closer()
            raise

    # -- smolagents' executor contract ------------------------------------------------------
    def send_tools(self, tools: Mapping[str, Any]) -> None:
        """Offer ``tools`` (smolagents ``Tool``s, managed agents, any callable) to the code,
        each as a function of its name that runs here.  ``final_answer`` ends the step."""
        new = [name for name in tools if name not in self.tools and name != _FINAL]
        self.tools.update(tools)
        if new:
            specs = [_spec(name, tools[name]) for name in new]
            self._do(self.worker.request(wire.Bind(tuple(specs)), keep=True), 60.0)

    def send_variables(self, variables: Mapping[str, Any]) -> None:
        """Put ``variables`` in the namespace (plain data only; TypeError names the others)."""
        if not variables:
            return
        refused = [f"{name} ({type(value).__name__})" for name, value in variables.items()
                   if not isinstance(name, str) or not is_plain(value)]
        if refused:
            raise TypeError(f"variables that are not plain data (None, bools, numbers, str, bytes, lists, "
                            f"dicts) cannot be sent to the worker: {', '.join(refused)}")
        items = {name: wire.Item("value", value) for name, value in variables.items()}
        self._do(self.worker.request(wire.Inject(items), keep=True), 60.0)

    def __call__(self, code_action: str) -> CodeOutput:
        """Run one step; its ``CodeOutput``, or ``CodeFailed`` when the code failed."""
        self._steps += 1
        block_id = f"step{self._steps}"
        code = with_last_value(code_action)
        self._step, self._final, self._last, self._last_image = block_id, None, None, False
        self.images = []
        try:
            result: BlockResult = self._do(
                self.worker.run(code, timeout=self.timeout, block_id=block_id, budget=self.budget),
                self.timeout + _MARGIN)
        except AgentloopError as exc:  # no worker could be started again: that is ours, not the code's
            raise CodeFailed(f"Executing code yielded an error:\nthe worker is unavailable: {exc}") from exc
        finally:
            given, last, last_image = self._final, self._last, self._last_image
            self._step, self._final, self._last = None, None, None
        shown = displays_words(result.displays)
        logs = result.output + ("\n" if shown and result.output and not result.output.endswith("\n") else "") + shown
        self.images = [AgentImage(s.png) for s in result.displays if s.png]
        if given is not None:
            return CodeOutput(output=given[0], logs=logs, is_final_answer=True)
        if result.status == "ok":
            if last_image and result.displays and result.displays[-1].png:
                return CodeOutput(output=self.images[-1], logs=logs, is_final_answer=False)
            return CodeOutput(output=last, logs=logs, is_final_answer=False)
        what = (_unwrap(result.error, code_action, code).rstrip() or result.message
                or f"the step ended with status {result.status}")
        if result.error and result.message:
            what += f"\n[{result.message}]"
        raise CodeFailed(f"{logs}{'' if not logs or logs.endswith(chr(10)) else chr(10)}"
                         f"Executing code yielded an error:\n{what}")

    def cleanup(self) -> None:
        """Stop the worker (killing a running step) and the executor's thread.  Idempotent."""
        self._closer()

    def __enter__(self) -> AgentloopExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # -- in the executor's event loop ------------------------------------------------------------
    def _do(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the executor's loop and wait for it, ``timeout`` seconds at most."""
        if not self._closer.alive:
            coro.close()
            raise WorkerError("this executor was cleaned up; make a new one")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError as exc:
            future.cancel()
            raise WorkerError(f"the worker did not answer within {timeout:g} s") from exc

    async def _start(self) -> Worker:
        method = weakref.WeakMethod(self._on_call)  # the worker must not keep the executor alive

        async def on_call(name: str, args: list, kwargs: dict, block: str | None) -> Any:
            call = method()
            if call is None:
                raise LookupError("the executor is gone")
            return await call(name, args, kwargs, block)

        worker = await self.engine.start_worker("smolagents", on_call=on_call)
        await worker.request(wire.Bind((wire.HostFunction(_FINAL, "(answer)", "Ends the step: answer is the final answer."),
                                        wire.HostFunction(_LAST_VALUE, "(text, image=False)"))), keep=True)
        for note in worker.notes:
            log.info("%s", note)
        return worker

    async def _on_call(self, name: str, args: list, kwargs: dict, block: str | None) -> Any:
        """A call from the code: a tool, ``final_answer`` or the last expression's repr.  The
        last two belong to the step running now: a call from any other block id is refused."""
        if name in (_LAST_VALUE, _FINAL) and (block is None or block != self._step):
            raise LookupError(f"{name}() was called from outside the step running now; nothing was kept")
        if name == _LAST_VALUE:
            value = args[0] if args else None
            self._last = value[:MAX_REPR] if isinstance(value, str) else None
            self._last_image = len(args) > 1 and args[1] is True
            return None
        if name == _FINAL:
            tool = self.tools.get(_FINAL)
            value = (await asyncio.to_thread(tool, *args, **kwargs) if tool is not None
                     else (args[0] if args else next(iter(kwargs.values()), None)))
            if block == self._step:  # (the step may have ended while the tool ran)
                self._final = (value,)
            raise _FinalAnswerGiven("final_answer() was called: the step ends here")
        tool = self.tools.get(name)
        if tool is None:
            raise LookupError(f"no tool named {name!r}; the tools are {', '.join(self.tools) or 'none'}")
        return await asyncio.to_thread(tool, *args, **kwargs)


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, engine: Engine) -> None:
    """Shut the engine down on its loop, then stop the loop and its thread (bounded waits)."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # collected in the loop's own thread: it cannot wait here
        task = loop.create_task(engine.shutdown())
        task.add_done_callback(lambda _t: loop.stop())
        return
    if thread.is_alive():
        future = asyncio.run_coroutine_threadsafe(engine.shutdown(), loop)
        try:
            future.result(30.0)
        except Exception as exc:  # noqa: BLE001 - shutting down: say it, go on stopping
            log.warning("the smolagents executor's engine did not shut down cleanly: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10.0)
    if not thread.is_alive():
        loop.close()
