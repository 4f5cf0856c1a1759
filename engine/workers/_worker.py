"""The coordinator's handle on one worker process.

A ``Worker`` outlives the processes behind it: when a block has to be killed, or the
process crashes, the handle starts a fresh one and the next block runs there (with an
empty namespace, which the result says).  Deadlines are kept here, never trusted to the
worker: at the deadline the block is interrupted (an exception raised inside what it waits
on; the namespace is kept); if it has not stopped within ``grace`` seconds, the whole
process tree is killed with SIGKILL (see ``Worker._supervise``).

Everything a worker sends is checked: frames are size-bounded, decoded without unpickling
and parsed into typed messages (``worker.contract.wire``), and messages from a peer that did
not complete the handshake are dropped.  A worker that breaks the protocol is killed at once:
its blocks end
saying so, the next block gets a fresh process, and nothing of it reaches the caller as an
exception.  Stale messages an honest worker can send (a response to a request that timed
out) are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from engine.durations import DEFAULT_BLOCK_TIMEOUT
from engine.errors import AlreadyOwned, ForkRefused, WorkerClosed, WorkerError, WorkerStartError
from engine.results import BlockResult, OutputChunk, OutputSink, Shown, describe_exit
from engine.workers._displays import BlockDisplays, DisplayRefused
from engine.workers._forks import Roster, fork_sessions
from engine.workers._requests import PendingRequests
from engine.workers._running import RunningBlock
from engine.workers._script_run import ScriptRun, forward_stdin
from engine.workers._session import Owner, Session
from worker.contract import wire
from worker.contract.framing import encode
from worker.contract.limits import MAX_CHUNK, STDERR, STDOUT

if TYPE_CHECKING:
    from engine.launch import Launcher

__all__ = ["HostCall", "Worker", "WorkerState"]

log = logging.getLogger("agentloop")

_STREAMS = {STDOUT: "stdout", STDERR: "stderr"}
#: The replies a worker may send to control requests (``refused`` answers any).
_REPLIES = frozenset({*wire.REPLIES.values(), wire.Refused})
#: Host calls one worker may have running at once; more are refused in words, not queued.
_MAX_CALLS = 64

#: Runs a host call from code in the worker: (name, args, kwargs, block id) -> its value.
HostCall = Callable[[str, list, dict, "str | None"], Awaitable[Any]]


class WorkerState(enum.Enum):
    STARTING = "starting"  # process launched, handshake not yet complete
    READY = "ready"  # handshake done; accepts blocks, any number at once
    DEAD = "dead"  # process gone (crash or kill); the next block starts a fresh one
    CLOSED = "closed"  # closed by its owner; every further call raises WorkerClosed


class Worker:
    """A persistent namespace in a sandboxed process; blocks run in it concurrently."""

    _ids = itertools.count(1)

    def __init__(self, launcher: Launcher, name: str = "worker", *,
                 take_idle: Callable[[], Session | None] | None = None, on_call: HostCall | None = None,
                 roster: Roster | None = None) -> None:
        self.launcher = launcher
        self._roster = roster
        self._take_idle = take_idle or (lambda: None)  # a started process from a warm pool
        self.name = name
        self.index = next(Worker._ids)
        self.state = WorkerState.STARTING
        self.vars: list[str] = []  # names of the user's variables, as of the last finished block
        self.var_notes: list[str] = []  # the same as ``name:type``, for the model's status note
        self.notes: list[str] = []
        # Who runs the code's host calls: one owner, given here or once by ``adopt``.
        self._on_call = on_call
        #: Control requests waiting for their reply: rid -> (the reply's class, its future).
        self._requests = PendingRequests(name)  # control requests waiting for their replies
        # Requests that bind a process (host functions, ``self``, handed objects), made again
        # on every replacement before it runs a block; and the names they define.
        self._bindings: list[tuple[wire.Message, float]] = []
        self._bound_names: set[str] = set()
        self._call_tasks: set[asyncio.Task] = set()
        self._session: Session | None = None
        self._blocks: dict[str, RunningBlock] = {}
        self._lock = asyncio.Lock()
        self._block_ids = itertools.count(1)
        self._restarting: asyncio.Task | None = None
        self._forks = itertools.count(1)  # the numbers of its copies' names
        #: The worker this one is a fork of (``fork``), None for one started afresh.
        self.parent: Worker | None = None

    def __repr__(self) -> str:
        pid = self.pid
        return f"<Worker {self.name!r} {self.state.value} pid={pid}>"

    @property
    def pid(self) -> int | None:
        s = self._session
        return s.proc.pid if s and s.proc else None

    @property
    def session(self) -> Session | None:
        """The process the worker runs in now (its socket, output pipes, process and cgroups),
        for inspection; None while none runs.  A kill replaces it."""
        return self._session

    async def connections(self, settle: float = 1.0) -> list[dict]:
        """The connections its sandbox made through its way out (``--allow-net``) that ended
        since the last call (``engine.net.ConnectionRecord``'s fields), those open now given up
        to ``settle`` s to end first (a block's last request may still be closing as its result
        comes; one open after that is told later); [] without an allowlist."""
        gates, s = self.launcher.gates, self._session
        return [] if gates is None or s is None else await gates.settled_take(s.sock_dir, settle)

    @property
    def running(self) -> list[str]:
        return list(self._blocks)

    def adopt(self, on_call: HostCall) -> None:
        """Make ``on_call`` the one owner of this worker's host calls, for a worker started
        before its owner existed.  AlreadyOwned if it has one: a second owner would silently
        take the first one's calls."""
        if self._on_call is not None:
            raise AlreadyOwned(f"worker {self.name!r} already has an owner for its host calls; "
                               "start another worker for a second one")
        self._on_call = on_call

    # -- forks --------------------------------------------------------------------------------
    async def fork(self, n: int = 1, *, caller: str | None = None, on_call: HostCall | None = None,
                   timeout: float = 30.0) -> list[Worker]:
        """``n`` copies of this worker as it is now, each a ``Worker`` of its own (``NAME/1``,
        ``NAME/2``, ...), holding the whole namespace copy-on-write, not pickled.  From then on
        a copy's variables, output, deadlines and kill are its own; what processes of one
        sandbox share it shares with its parent (``worker.forking``), and it ends with its
        parent's process.  Refused (ForkRefused, saying what to stop first), not waited for,
        while a block runs (but ``caller``, the block asking through ``self``), or a thread, an
        event-loop task or a process of the code.  A copy killed or crashed is replaced by a
        fresh process, as any worker.  ``on_call``: the copies' owner of host calls (default:
        this worker's); the engine counts them among its workers and closes them with the rest."""
        if not 1 <= n <= wire.MAX_FORKS:
            raise ValueError(f"fork: n must be between 1 and {wire.MAX_FORKS}, not {n!r}")
        if self._roster is not None:
            self._roster.admit(n)
        session = await self._ensure_ready()
        busy = [b for b in self._blocks if b != caller]
        if busy:
            raise ForkRefused(f"worker {self.name!r} cannot fork now: block {', '.join(map(repr, busy[:5]))} is "
                              "running; a worker forks between blocks: await it (or cancel it) and fork again")
        sessions = await fork_sessions(session, self._requests, n, caller, timeout)
        copies = [self._copy(s, self._on_call if on_call is None else on_call) for s in sessions]
        if self._roster is not None:
            for copy in copies:
                self._roster.add(copy)
        return copies

    def _copy(self, session: Session, on_call: HostCall | None) -> Worker:
        """The ``Worker`` of a fork's copy that runs in ``session``: this one's namespace as far
        as the coordinator knows it, bound as this one is (what replaces the copy's process is
        bound the same), its host calls going to ``on_call``."""
        child = Worker(self.launcher, f"{self.name}/{next(self._forks)}", on_call=on_call, roster=self._roster)
        child._bindings = list(self._bindings)
        child._bound_names = set(self._bound_names)
        child.vars, child.var_notes = list(self.vars), list(self.var_notes)
        session.owner = Owner(child.name, child._dispatch, child._on_exit, child._on_broken)
        child._session = session
        child.notes = [*self.notes]
        child.state = WorkerState.READY
        child.parent = self
        return child

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> Worker:
        async with self._lock:
            if self.state is WorkerState.CLOSED:
                raise WorkerClosed(f"worker {self.name!r} is closed; start a new one")
            if self._session is None or self.state is WorkerState.DEAD:
                await self._start_locked()
        return self

    async def _start_locked(self) -> None:
        self.state = WorkerState.STARTING
        session = self._take_idle()
        if session is None:
            try:
                session = await Session.start(self.launcher)
            except WorkerStartError as exc:
                self.state = WorkerState.DEAD
                raise WorkerStartError(f"worker {self.name!r}: {exc}") from exc
        session.owner = Owner(self.name, self._dispatch, self._on_exit, self._on_broken)
        self._session = session
        self.notes = session.notes
        try:
            for request, timeout in self._bindings:  # bound exactly as the first process was
                await self._ask(session, request, timeout)
        except (WorkerError, OSError) as exc:
            await session.kill()
            self._session = None
            self.state = WorkerState.DEAD
            raise WorkerStartError(f"worker {self.name!r}: the new process could not be bound as "
                                   f"the first was: {exc}") from exc
        self.state = WorkerState.READY

    async def _ensure_ready(self) -> Session:
        if self.state is WorkerState.CLOSED:
            raise WorkerClosed(f"worker {self.name!r} is closed; start a new one")
        if self._restarting is not None:
            with contextlib.suppress(Exception):
                await self._restarting
        if self.state is not WorkerState.READY:
            await self.start()
        assert self._session is not None
        return self._session

    async def restart(self) -> None:
        """Kill the process (namespace lost) and start a fresh one."""
        async with self._lock:
            await self._kill_locked("worker restarted", status="killed")
            if self.state is not WorkerState.CLOSED:
                await self._start_locked()

    async def close(self) -> None:
        """Shut the worker down (politely, then by force).  Idempotent."""
        async with self._lock:
            if self.state is WorkerState.CLOSED:
                return
            session = self._session
            if session is not None:
                session.killing = True
                await session.shutdown()
            await self._kill_locked("worker closed", status="cancelled")
            self.state = WorkerState.CLOSED

    async def _kill_locked(self, why: str, *, status: str = "killed", cause: RunningBlock | None = None,
                           cause_message: str = "", **extra: Any) -> None:
        """Kill the current process tree (reaping whatever it left) and end every running block
        with words saying why; ``extra`` goes into their results (signal, exit code)."""
        session = self._session
        if session is None:
            return
        lost = [v for v in self.vars if v not in self._bound_names]
        await session.kill()
        self._session = None
        # What exists now: what the replacement is bound with (handed objects), nothing else.
        self.var_notes = [n for n in self.var_notes if n.split(":", 1)[0] in self._bound_names]
        self.vars = [n.split(":", 1)[0] for n in self.var_notes]
        if self.state is not WorkerState.CLOSED:
            self.state = WorkerState.DEAD
        reset = _reset_words(lost)
        self._requests.fail_all(why)  # nobody will answer them now
        for block in list(self._blocks.values()):
            if block is cause:
                block.finish("timeout" if block.timed_out else "cancelled",
                             message=f"{cause_message}; {reset}", worker_killed=True, lost_vars=lost)
            else:
                block.finish(status, message=f"{why}; {reset}", worker_killed=True, lost_vars=lost,
                             **extra)
        self._blocks.clear()

    async def _on_broken(self, session: Session, why: str) -> None:
        """The process broke the protocol: kill it now, end its blocks with why, and start
        the replacement, as after a kill for a deadline."""
        async with self._lock:
            if self._session is not session or session.killing:
                return
            await self._kill_locked(f"the worker broke the protocol ({why}) and was stopped", status="killed")
            if self.state is WorkerState.DEAD:
                self._restarting = asyncio.ensure_future(self._restart_quietly())

    async def _on_exit(self, session: Session, rc: int) -> None:
        """A process that died on its own: end its blocks with the cause, clean up."""
        async with self._lock:
            if self._session is not session or session.killing:
                return
            assert session.proc is not None
            # What it sent before it died is read before its blocks end (its last words), and
            # then what its fd 1 and 2 still held goes where the worker would have sent it.
            await session.settle(min(0.5, self.launcher.settings.grace))
            block = next(iter(self._blocks.values()), None)  # the first started
            for stream, data in session.leftovers() if block is not None else ():
                n = MAX_CHUNK
                for start in range(0, len(data), n):
                    pending = self._dispatch(session, wire.Out(block.id, ((stream, data[start:start + n]),)))
                    if pending is not None:
                        await pending
            words, sig = describe_exit(rc, via_namespace=session.proc.pid_namespace)
            memory = session.over_memory_limit()
            if memory:
                words = (f"worker killed: over its memory limit ({self.launcher.settings.sandbox.memory_bytes / 2**20:.0f} "
                         "MiB, shared memory and /tmp files included)")
            await self._kill_locked(words, status="died", signal=sig, exit_code=rc, over_memory=memory)
            log.info("worker %s: %s", self.name, words)

    def _dispatch(self, session: Session, msg: wire.Message) -> Awaitable[None] | None:
        """Act on one message from the worker (parsed: every field is within its bounds).
        Returns an awaitable only when a consumer of ``stream()`` is behind: the session reads
        nothing more until it is done."""
        if isinstance(msg, wire.Out):
            block = self._blocks.get(msg.id)
            if block is None:
                session.drop("output for no running block")
                return None
            waiting = []
            for stream, data in msg.o:
                block.sink.add(data)
                chunk = OutputChunk(block.id, _STREAMS[stream], data)
                if block.on_output is not None:
                    block.on_output(chunk)
                if block.queue is not None:
                    if waiting or block.queue.full():
                        waiting.append(chunk)
                    else:
                        block.queue.put_nowait(chunk)
            if waiting and block.queue is not None:
                return _put_all(block.queue, waiting)
        elif isinstance(msg, wire.Done):
            block = self._blocks.pop(msg.id, None)
            if block is None:
                session.drop("done for no running block")
                return None
            self.var_notes = list(msg.vars)
            self.vars = [n.split(":", 1)[0] for n in self.var_notes]
            why = f"timed out after {_secs(block.timeout)}" if block.timed_out else "cancelled"
            if msg.status == "cancelled":
                # Interrupted, and the process lives on: say what was raised and that nothing was lost.
                block.finish("timeout" if block.timed_out else "cancelled", error=msg.error,
                             message=f"{why}: {msg.note}; the worker and its namespace are kept" if msg.note else why)
            elif msg.status in ("ok", "error"):
                block.finish(msg.status, error=msg.error, message=f"{why}: {msg.note}" if msg.note else "")
            else:  # exit: SystemExit
                code = 1 if msg.code is None else msg.code
                block.finish("ok" if code == 0 else "error", exit_code=code,
                             message=f"the code exited with {code} (SystemExit); the worker and its namespace "
                                     "are kept")
        elif isinstance(msg, wire.Display):
            block = self._blocks.get(msg.id)
            if block is None:
                session.drop("display for no running block")
                return None
            try:
                shown = block.displays.add(msg.data)
            except DisplayRefused as exc:
                session.violation(str(exc))
                return None
            if block.on_display is not None:
                try:
                    block.on_display(shown, msg.data)
                except Exception:  # a consumer's fault is not the worker's: said, and the block goes on
                    log.exception("worker %s: block %s: a display could not be shown", self.name, block.id)
        elif isinstance(msg, (wire.Stuck, wire.Stopping)):
            block = self._blocks.get(msg.id)
            if block is not None:  # else stale: the block's done came first, an honest race
                block.interrupted = True
                if isinstance(msg, wire.Stuck):
                    block.stuck_why = msg.why
                    block.stuck.set()
                else:
                    block.stopping_why = msg.why
        elif type(msg) in _REPLIES:
            self._requests.answered(session, msg)
        elif isinstance(msg, wire.Call):
            if self._on_call is None:
                session.send(wire.Reply(msg.cid, False, error="this worker has no host functions"))
            elif len(self._call_tasks) >= _MAX_CALLS:
                session.send(wire.Reply(msg.cid, False,
                                        error=f"{_MAX_CALLS} host calls are already running; await some first"))
            else:
                task = asyncio.get_running_loop().create_task(self._host_call(msg))
                self._call_tasks.add(task)
                task.add_done_callback(self._call_tasks.discard)
        elif isinstance(msg, wire.Hello):
            session.violation("it said hello twice")
        return None  # (bye: the worker is on its way out)

    async def _host_call(self, msg: wire.Call) -> None:
        """Run one host call for code in the worker and send back its value or error, in words."""
        cid = msg.cid
        try:
            value = await self._on_call(msg.name, list(msg.args), msg.kwargs, msg.block)  # type: ignore[misc]
            try:
                frame = encode(wire.Reply(cid, True, value))
            except (TypeError, ValueError):
                frame = encode(wire.Reply(cid, True, repr(value)))
        except Exception as exc:  # noqa: BLE001 - the tool's failure goes back to the code as words
            frame = encode(wire.Reply(cid, False, error=str(exc) or type(exc).__name__))
        if self._session is not None:
            self._session.send_frame(frame)

    async def request(self, request: wire.Message, timeout: float = 30.0, *, keep: bool = False) -> Any:
        """A control request to the worker (``wire.Bind``, ``Export``, ``Inject``,
        ``Describe``, ``Env``; its ``rid`` is given here); its reply (``wire.Bound``,
        ``Exported``, ...: ``wire.REPLIES``), every field checked.  WorkerError when the worker
        refused it (its words), did not answer in ``timeout`` seconds or was stopped, or when
        the request breaks the contract itself (the worker would refuse to read it).

        ``keep``: the request binds the process (``Bind``, ``Inject``): once it succeeded it is
        made again, in order, on every process that replaces this one (after a kill, a crash,
        a restart) before that process runs a block, so only what code defined is ever lost."""
        if type(request) not in wire.REPLIES:
            raise TypeError(f"not a control request: {request!r}"[:200])
        session = await self._ensure_ready()
        reply = await self._ask(session, request, timeout)
        if keep:
            self._bindings.append((request, timeout))
            if isinstance(reply, wire.Injected):
                self._bound_names.update(reply.names)
        return reply

    async def _ask(self, session: Session, request: wire.Message, timeout: float) -> wire.Message:
        return await self._requests.ask(session, request, timeout)

    def send(self, msg: wire.Message) -> None:
        """Send a protocol message to the current process (never waits)."""
        if self._session is not None:
            self._session.send(msg)

    # -- running blocks -----------------------------------------------------------------------
    async def _submit(self, code: str, timeout: float, block_id: str | None,
                      on_output: Callable[[OutputChunk], None] | None, budget: int | None = None,
                      script: ScriptRun | None = None,
                      on_display: Callable[[Shown, dict], None] | None = None) -> RunningBlock:
        session = await self._ensure_ready()
        if block_id is None:
            block_id = f"b{next(self._block_ids)}"
            while block_id in self._blocks:
                block_id = f"b{next(self._block_ids)}"
        elif block_id in self._blocks:
            raise ValueError(f"block {block_id!r} is already running")
        sink = OutputSink(lambda: self.launcher.output_path(self.index, block_id),
                          file_cap=self.launcher.settings.output_file_cap, budget=self.launcher.output_budget)
        displays = BlockDisplays(lambda number: self.launcher.display_path(self.index, block_id, number),
                                 self.launcher.output_budget)
        block = RunningBlock(block_id, sink, timeout, on_output, budget, displays, on_display)
        self._blocks[block_id] = block
        session.send(wire.Run(block_id, code, script.spec() if script is not None else None))
        if script is not None and script.stdin is not None:
            forward_stdin(script.stdin, self.send, block_id, block.future.done)
        return block

    async def run(self, code: str, *, timeout: float = DEFAULT_BLOCK_TIMEOUT, block_id: str | None = None,
                  on_output: Callable[[OutputChunk], None] | None = None,
                  budget: int | None = None, script: ScriptRun | None = None,
                  on_display: Callable[[Shown, dict], None] | None = None) -> BlockResult:
        """Run one block and return how it ended.  Never raises for what the code did.

        ``budget`` caps ``result.output`` in bytes (head and tail, with the count cut between).
        ``script``: run the code as ``python FILE ARGS`` would (``agentloop exec``; see
        ``engine.workers``): then a traceback is part of the output, as Python prints it.
        ``on_display``: told of each display as it arrives (``Shown``, and the bundle it was
        made of); ``result.displays`` holds them all.

        A ``SystemExit`` ends the block, never the worker: ``exit_code`` holds its status (the
        status is ok for 0, else error) and ``exited`` is true.
        """
        block = await self._submit(code, timeout, block_id, on_output, budget, script, on_display)
        return await self._supervise(block)

    async def stream(self, code: str, *, timeout: float = DEFAULT_BLOCK_TIMEOUT,
                     block_id: str | None = None) -> AsyncIterator[OutputChunk | BlockResult]:
        """Run one block, yielding its output chunks as they arrive and then its result.

        Leaving the iteration early cancels the block.
        """
        block = await self._submit(code, timeout, block_id, None)
        block.queue = asyncio.Queue(maxsize=64)  # backpressure up to the worker
        supervisor = asyncio.ensure_future(self._supervise(block))
        try:
            while True:
                getter = asyncio.ensure_future(block.queue.get())
                await asyncio.wait({getter, supervisor}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not block.queue.empty():
                    yield block.queue.get_nowait()
                yield supervisor.result()
                return
        finally:
            queue, block.queue = block.queue, None
            while queue is not None and not queue.empty():
                queue.get_nowait()
            if not supervisor.done():
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervisor

    async def _supervise(self, block: RunningBlock) -> BlockResult:
        """Wait for ``block``'s result, keeping its deadline.  The contract, all of it here:

        - The deadline is ``timeout`` seconds from when the ``run`` was sent, kept by the
          coordinator; the worker's own clock and good will are never relied on.
        - At the deadline the block is interrupted as Jupyter interrupts a cell: a
          ``TimeoutError`` naming the deadline is raised inside what it waits on (a block on
          the worker's main thread: ``time.sleep``, ``Event.wait``, ``queue.get``, ``select``,
          socket reads, ``subprocess`` waits; in another thread at its next Python bytecode;
          an awaiting block's task is cancelled), and its ``finally:`` blocks get ``grace``
          (the engine's, ``Engine(grace=...)``).  A block that stops keeps the worker, its
          namespace and the other blocks: status ``timeout``, the traceback in ``error``, the
          message saying what was raised and that nothing was lost.  A cancel (``cancel``, a
          cancelled caller, Ctrl-C in ``chat``/``run``) is the same with what Ctrl-C gives a
          script: the code's SIGINT handler, else ``KeyboardInterrupt``.
        - The worker is killed (SIGKILL to its whole tree) when the grace runs out, or at once
          when it reports the block ``stuck`` where no interrupt can reach (signals blocked or
          ignored, an event loop held by synchronous code).  The message says which it was:
          the worker's words, or that it did not answer at all (C code holding the
          interpreter, such as a catastrophic regular expression).
        - A kill resets the namespace: every block running in that worker ends ("killed",
          naming the block that caused it), the result lists the variables lost, and the next
          block runs in a fresh process, bound as the first was (host functions, ``self``,
          handed objects: ``request(..., keep=True)``).
        - Cancelling the caller of ``run`` stops the block the same way; a stop the deadline
          already started is waited for, never started twice.
        """
        # The deadline is a timer that starts the stop, not wait_for() or wait(): on the round
        # trip of a short block each of those costs an extra pass of the event loop.
        loop = asyncio.get_running_loop()
        timer = loop.call_later(block.timeout, self._expire, block)
        try:
            return await block.future
        except asyncio.CancelledError:
            if block.future.cancelled():  # our cancellation reached the future: it needs a new one
                block.future = loop.create_future()
            # A stop the deadline already started is the one to wait for, not a second one.
            await asyncio.shield(block.stopping or self._stop(block, "cancelled"))
            raise
        finally:
            timer.cancel()

    def _expire(self, block: RunningBlock) -> None:
        if not block.future.done():
            block.timed_out = True
            block.stopping = asyncio.ensure_future(self._stop(block, f"timed out after {_secs(block.timeout)}"))

    async def cancel(self, block_id: str) -> BlockResult | None:
        """Stop a running block; returns its result, or None if no such block runs."""
        block = self._blocks.get(block_id)
        if block is None:
            return None
        return await asyncio.shield(self._stop(block, "cancelled"))

    async def _stop(self, block: RunningBlock, why: str) -> BlockResult:
        """The interrupt, then — after ``grace``, or at once when the worker says it cannot
        reach the block — the hard kill of the whole tree, with words saying which it was."""
        self.send(wire.Cancel(block.id, "timeout" if block.timed_out else "cancel", block.timeout,
                              self.launcher.settings.grace))
        grace = self.launcher.settings.grace
        stuck = asyncio.ensure_future(block.stuck.wait())
        try:
            await asyncio.wait([block.future, stuck], timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stuck.cancel()
        async with self._lock:
            if not block.future.done():
                if block.stuck.is_set():
                    how = block.stuck_why or "the interrupt cannot reach it"
                elif block.interrupted:
                    how = f"it did not stop within {_secs(grace)} of the interrupt: " + (
                        block.stopping_why or "it kept running")
                else:
                    how = (f"the worker did not answer the interrupt within {_secs(grace)}: C code held "
                           "the interpreter (a long call into C, such as a regular expression or a "
                           "C extension's loop), where no exception can be raised")
                log.info("worker %s: block %s: %s; killing the worker", self.name, block.id, how)
                await self._kill_locked(f"the worker was killed because block {block.id} {why}",
                                        cause=block, cause_message=f"{why}; {how}, so the worker was killed")
                if self.state is WorkerState.DEAD:
                    self._restarting = asyncio.ensure_future(self._restart_quietly())
        return await block.future

    async def _restart_quietly(self) -> None:
        try:
            await self.start()
        except Exception as exc:  # noqa: BLE001 - the next run() reports it
            log.warning("worker %s: replacement failed to start: %s", self.name, exc)


async def _put_all(queue: asyncio.Queue, chunks: list[OutputChunk]) -> None:
    for chunk in chunks:
        await queue.put(chunk)


def _secs(seconds: float) -> str:
    return f"{seconds:g} s"


def _reset_words(lost: list[str]) -> str:
    if not lost:
        return "the namespace was reset"
    shown = ", ".join(lost[:20]) + (f" and {len(lost) - 20} more" if len(lost) > 20 else "")
    return f"the namespace was reset (lost variables: {shown})"
