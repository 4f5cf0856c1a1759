"""The worker's side of the connection: handshake, then serve requests until shutdown.

Threads take turns at the socket, the process's main thread first among them.  The listening
thread runs a block (or a request that may run user code) it received itself, sends its
``done`` and listens on: a round trip crosses no thread boundary.  If the block runs longer
than a couple of milliseconds, or waits for a host call, a waiting thread takes over the
listening (see ``_baton``), so cancels, host-call replies and output keep flowing while user
code blocks.  A block that arrives while the main thread is free is handed to it, so a block
that runs alone always runs on the main thread (see ``runtime``).  A burst of concurrent
blocks gets a thread each; threads left idle beyond a few end.

Blocks that ``await`` run on the user loop (see ``runtime``): the listener starts them and
listens on.  Cancels and host-call replies are handled by the listener as they come.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from . import _confine, _memory, _running, forking
from ._baton import Baton
from ._outpipe import Fifos, PipeWriter
from .capture import (
    FdCapture,
    NoInput,
    Router,
    TextStream,
    hide_runtime_threads,
    inherit_block_in_threads,
    plain_streams_in_children,
)
from .channel import Channel
from .contract import wire
from .contract.framing import FrameError, encode
from .contract.limits import COPY_NOT_APART, INTERRUPT_SIGNAL, MAX_NOTE, STDERR, STDOUT
from .contract.schema import ContractError
from .display import Displays
from .runtime import Runtime

__all__ = ["Crew", "HANDSHAKE_TIMEOUT", "HostCalls", "HostError", "IDLE_TRIM", "SPIN_AFTER_BLOCK", "serve"]

HANDSHAKE_TIMEOUT = 15.0
IDLE_TRIM = 1.0  # seconds idle before freed memory goes back to the kernel
SPIN_AFTER_BLOCK = 150e-6  # seconds the listener polls before sleeping, after a block
_KEEP_IDLE = 2  # idle threads kept beyond the listener
#: Messages that may run user code: never handled while listening.
_HEAVY = frozenset({wire.Run.kind, *(request.kind for request in wire.REQUESTS)})


class HostError(Exception):
    """A host function (tool, ``self``) failed or refused; the message says why."""


class HostCalls:
    """Calls from code in the worker to host functions, and their pending replies."""

    def __init__(self, channel: Channel, baton: Baton) -> None:
        self._channel = channel
        self._baton = baton
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)

    def call(self, name: str, args: list, kwargs: dict, block: str | None) -> Future:
        """Ask the coordinator to run host function ``name``; a thread-safe future of its value."""
        cid = next(self._ids)
        future: Future = Future()
        msg = wire.Call(cid, name, tuple(args), kwargs, block)
        try:
            frame = encode(msg)
        except (TypeError, ValueError) as exc:
            future.set_exception(HostError(f"{name}(): arguments must be plain data "
                                           f"(str, numbers, lists, dicts, bytes, None): {exc}"))
            return future
        self._calls[cid] = future
        self._baton.give_up()  # the caller is about to wait for the reply: someone must hear it
        self._channel.send_frame(frame)
        return future

    def resolve(self, msg: wire.Reply) -> None:
        future = self._calls.pop(msg.cid, None)
        if future is None or future.done():
            return
        if msg.ok:
            future.set_result(msg.value)
        else:
            future.set_exception(HostError(msg.error or "host call failed"))


class Crew:
    """The threads that listen to the socket in turn and run what arrives."""

    def __init__(self, channel: Channel, router: Router, runtime: Runtime, calls: HostCalls,
                 baton: Baton, diag_fd: int, early: list[bytes] | None = None) -> None:
        self.channel = channel
        self.router = router
        self.runtime = runtime
        self.calls = calls
        self.diag_fd = diag_fd
        self.exit_code: int | None = None
        self.exited = threading.Event()
        self.baton = baton
        self._early = early or []  # frames received with the welcome, handled first
        self._trim_at: float | None = None
        self._spin = 0.0
        #: Ends the process at once: ``shutdown`` heard by a thread other than the main one,
        #: which may be running a block, never waits for it.
        self.exit_now: Callable[[int], None] = os._exit
        #: What the runtime holds before any user code runs: its descriptors and processes,
        #: which a fork's copy closes and does not count as the code's (see ``forking``).
        self.own_fds = forking.own_descriptors()
        self.own_children = forking.runtime_children()

    def serve_main(self) -> None:
        """Listen and run blocks on the calling thread, the process's main thread, until
        ``shutdown``; the frames received with the welcome are handled first.  An exception
        that reaches this loop (a signal's handler, such as SIGINT's or an alarm the code
        set, run while no block ran) is said and the serving goes on."""
        while not self.exited.is_set():
            try:
                self._member()
            except BaseException as exc:  # noqa: BLE001
                os.write(self.diag_fd, f"agentloop worker: {type(exc).__name__} outside any block: "
                                       f"{exc}\n".encode())

    def _add(self) -> None:
        threading.Thread(target=self._member, name="agentloop-worker", daemon=True).start()

    def _member(self) -> None:
        main = threading.get_ident() == self.baton.main
        while not self.exited.is_set():
            if not main and self.baton.waiters >= _KEEP_IDLE:
                return  # enough threads wait already
            job = self.baton.take()  # the main thread may be handed a job with the baton
            while not self.exited.is_set():
                if main and job is None:
                    job = self.baton.main_job()  # handed over while it finished the last one
                if job is None:
                    # Blocks are registered (a cancel finds them, the output tick sees them)
                    # before they run.
                    jobs = [j for msg in self._listen() if (j := self._safely(self._handle, msg))]
                    if not jobs:
                        continue
                    if not main and self.baton.hand_to_main(jobs[0]):
                        # The main thread was free: it runs the first and listens after it.
                        self._spawn(jobs[1:])
                        break
                    if not self.baton.busy():
                        self._add()  # someone must be able to take over the listening
                    self._spawn(jobs[:-1])  # blocks of one agent run concurrently
                    job = jobs[-1]
                self._safely(job)
                job = None
                if main:
                    self.baton.main_free()
                self._trim_at = time.monotonic() + IDLE_TRIM
                self._spin = SPIN_AFTER_BLOCK
                if not self.baton.done():
                    break  # another thread listens now: wait for a turn

    def _spawn(self, jobs: list) -> None:
        for job in jobs:
            threading.Thread(target=self._safely, args=(job,), name="agentloop-block", daemon=True).start()

    def _listen(self) -> list[wire.Message]:
        """Wait for messages; handle the quick ones here (cancels, replies) and return as soon
        as one that may run user code is among them, with the rest of its batch."""
        while not self.exited.is_set():
            timeout = self.router.tick()
            if timeout is None and self._trim_at is not None:
                timeout = self._trim_at - time.monotonic()
                if timeout <= 0:  # idle for a while: an idle worker should be small
                    self._trim_at = None
                    _memory.trim()
                    continue
            frames, self._early = self._early or self.channel.receive(timeout, self._spin), []
            self._spin = 0.0
            for i, frame in enumerate(frames):
                msg = _decode(frame)
                if msg is None:
                    continue
                if msg.kind in _HEAVY:
                    return [msg, *filter(None, map(_decode, frames[i + 1:]))]
                self._safely(self._handle, msg)
        return []

    def _safely(self, fn, *args):
        """``fn(*args)``, or None if it raised: the worker's own error is said, and the serving
        goes on."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001
            os.write(self.diag_fd, f"agentloop worker: {type(exc).__name__}: {exc}\n".encode())
        return None

    def _handle(self, msg: wire.Message):
        """Act on one message; returns a function to run for one that may run user code."""
        if isinstance(msg, wire.Run):
            return self.runtime.submit(msg.id, msg.code, msg.script)
        if isinstance(msg, wire.Stdin):
            self.runtime.feed_stdin(msg.data, msg.eof)
        elif isinstance(msg, wire.REQUESTS):
            return lambda: self._answer(msg)
        elif isinstance(msg, wire.Cancel):
            if self.runtime.interrupt(msg.id, msg.reason, msg.after):
                grace = 0.5 if msg.grace is None else msg.grace
                try:
                    threading.Thread(target=self._watch, args=(msg.id, grace),
                                     name="agentloop-cancel", daemon=True).start()
                except RuntimeError:  # no thread to be had: the process limit is used up
                    self.channel.send(wire.Stopping(msg.id, "it was interrupted, but no thread could be "
                                                            "started to look at it (the worker's process "
                                                            "limit is used up)"))
        elif isinstance(msg, wire.Reply):
            self.calls.resolve(msg)
        elif isinstance(msg, wire.Shutdown):
            self.router.flush_all()
            self.channel.send(wire.Bye())
            self.channel.close()
            self.exit_code = 0
            self.exited.set()
            if threading.get_ident() != self.baton.main:
                self.exit_now(0)  # the main thread may be running a block: never wait for it
        return None

    def _watch(self, block_id: str, grace: float) -> None:
        """Say how an interrupted block stands: at once if the interrupt cannot reach it
        (``stuck``: the coordinator kills now), else shortly after the interrupt and again
        shortly before the grace runs out (``stopping``: the words of a kill, if one comes)."""
        said = None
        for window in (None, max(0.0, 0.8 * grace - 0.05)):
            verdict = self.runtime.assess(block_id) if window is None else self.runtime.assess(block_id, window)
            if verdict is None:
                return
            if verdict != said:
                kind, why = verdict
                why = why[:MAX_NOTE]
                self.channel.send(wire.Stuck(block_id, why) if kind == "stuck" else wire.Stopping(block_id, why))
                said = verdict
            if verdict[0] == "stuck":
                return

    def _answer(self, msg: wire.Message) -> None:
        """Answer a control request (bind tools, export/inject a namespace, describe, env) with
        its reply, or with ``refused`` and the words of what went wrong."""
        rid = msg.rid  # type: ignore[attr-defined]
        try:
            reply = self._fork(msg) if isinstance(msg, wire.Fork) else self.runtime.answer(msg)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator as words
            reply = wire.refused(rid, f"{type(exc).__name__}: {exc}")
        try:
            frame = encode(reply)
        except (TypeError, ValueError, OverflowError) as exc:
            frame = encode(wire.refused(rid, f"unsendable value: {exc}"))
        self.channel.send_frame(frame)

    def _fork(self, msg: wire.Fork) -> wire.Message:
        """Fork this process once per child of ``msg`` (see ``forking``); ``forked`` with their
        pids, or ``refused`` saying what to stop first."""
        runtime = self.runtime
        why = forking.refusal(runtime.running_blocks(), msg.caller, runtime.pending_tasks(), self.own_children,
                              runtime.loop_executor_threads(), len(msg.children))
        if why is not None:
            return wire.refused(msg.rid, f"cannot fork now: {why}")
        parent = os.getpid()

        def fork_all() -> list[int]:
            pids: list[int] = []
            for child in msg.children:
                try:
                    pid = os.fork()
                except OSError as exc:  # (the process limit, most often): none of them, then
                    forking.discard(pids)
                    raise OSError(exc.errno, f"{len(pids)} of {len(msg.children)} copies could be made "
                                             f"before fork() failed ({exc.strerror}): the worker's process limit "
                                             "counts its copies' threads too; fork fewer at once") from None
                if pid == 0:
                    self._become_fork(child, parent)  # never returns
                pids.append(pid)
            return pids

        self.router.flush_all()  # what is on its way out is the parent's, not the copies'
        return wire.Forked(msg.rid, tuple(forking.forker().run(fork_all)))

    def _become_fork(self, child: wire.ForkChild, parent: int) -> None:
        """In a fork's copy (one thread: the forking one, the main thread now): close what was
        the parent's connection, dial ``child``'s endpoint, and serve the same namespace as a
        worker of its own.  Never returns."""
        code = 72
        try:
            forking.die_with_parent(parent)
            # Stopped until the coordinator has put it in cgroups of its own: it is born in its
            # parent's, and its threads would count against the parent's limit.
            os.kill(os.getpid(), signal.SIGSTOP)
            # Apart from its parent and its siblings from here on: no signals, ptrace or
            # abstract sockets between them (``_confine.separate``); still one thread.
            try:
                _confine.separate()
            except _confine.ConfinementError:
                os._exit(COPY_NOT_APART)
            with contextlib.suppress(OSError):  # (a sandbox whose filter refuses it: the parent's session)
                os.setsid()
            forking.forget_forker()
            forking.reseed()
            os.dup2(self.diag_fd, 2)  # the worker's own stderr, for the copy's last words
            forking.close_descriptors(self.own_fds)
            _running.MAIN = threading.get_ident()
            channel, router, fdcap = _link(child.endpoint, None, "", "")
            early = _greet(channel, child.token, fdcap.diag_fd)
            if isinstance(early, int):
                os._exit(early)
            baton = Baton()
            calls = HostCalls(channel, baton)
            self.runtime.rewire(router, fdcap, channel.send, calls.call, baton.main_free)
            crew = Crew(channel, router, self.runtime, calls, baton, fdcap.diag_fd, early)
            code = _serve(crew, fdcap)
        except BaseException as exc:  # noqa: BLE001 - the last words of a copy that failed to start
            with contextlib.suppress(OSError):
                os.write(2, f"agentloop worker: a fork's copy failed to start: {type(exc).__name__}: {exc}\n".encode())
        os._exit(code)


def _decode(frame: bytes) -> wire.Message | None:
    """A message from the coordinator, or None for a frame that is none (never expected)."""
    try:
        return wire.decode_message(frame, wire.TO_WORKER)
    except (ContractError, FrameError):
        return None


def _keep_last_words(fdcap: FdCapture, router: Router, channel: Channel) -> Callable[[], None]:
    """Make ``os._exit`` in this process deliver what was written before it: fd 1/2's pipe
    drained, every block's pending output sent (what was not flushed too, which a process
    that dies on a signal loses: see ``capture``), and the socket closed with its linger
    (which waits until the frames have left).  ``os._exit`` is replaced as a Python attribute:
    code that calls it from C, or a child forked from this process, exits at once as before.
    Returns the function that puts the original back."""
    real_exit, pid = os._exit, os.getpid()

    def _exit(status: int) -> None:
        if os.getpid() == pid:
            with contextlib.suppress(BaseException):  # last words are best effort; the exit is not
                fdcap.drain(0.2)
                router.flush_all()
                channel.close()
        real_exit(status)

    os._exit = _exit  # type: ignore[assignment]

    def restore() -> None:
        os._exit = real_exit

    return restore


def _link(endpoint: str, fifos: Fifos | None, tty: str, curve: str) -> tuple[Channel, Router, FdCapture]:
    """The worker's connection to the coordinator: its channel, the router of the blocks'
    output (by the output pipes when ``fifos`` are given, else by the socket), fd 1 and 2
    captured into it, and ``sys`` streams that write to it."""
    channel = Channel(endpoint, curve=curve)
    writer = PipeWriter(fifos.out, keep=INTERRUPT_SIGNAL) if fifos is not None else None
    router = Router(channel.send) if writer is None else \
        Router(writer.send, move=writer.move, last=channel.send)
    fdcap = FdCapture(router, tty, fifos.pipes if fifos is not None else None)
    channel.diag_fd = fdcap.diag_fd
    if writer is not None:
        writer.diag_fd = fdcap.diag_fd
    sys.stdout = TextStream(router, STDOUT)
    sys.stderr = TextStream(router, STDERR)
    sys.stdin = NoInput()
    return channel, router, fdcap


def _greet(channel: Channel, token: str, diag_fd: int) -> list[bytes] | int:
    """The handshake: ``hello``, then the coordinator's ``welcome``; the frames that came with
    the welcome, or the exit code of a worker that was not welcomed."""
    channel.send(wire.Hello(token, os.getpid()))
    welcome = None
    early: list[bytes] = []  # frames that came in the welcome's batch
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    while welcome is None and time.monotonic() < deadline:
        frames = channel.receive(deadline - time.monotonic())
        for i, frame in enumerate(frames):
            welcome = _decode(frame)
            if welcome is not None:
                early = frames[i + 1:]
                break
    if welcome is None:
        os.write(diag_fd, b"agentloop worker: no welcome from the coordinator\n")
        return 3
    if not isinstance(welcome, wire.Welcome) or welcome.v != wire.PROTOCOL_VERSION:
        os.write(diag_fd, b"agentloop worker: handshake refused (protocol version?)\n")
        return 4
    return early


def _serve(crew: Crew, fdcap: FdCapture) -> int:
    restore_exit = _keep_last_words(fdcap, crew.router, crew.channel)
    crew.serve_main()
    restore_exit()
    return crew.exit_code or 0


def serve(endpoint: str, token: str, fifos: Fifos | None = None, tty: str = "", curve: str = "") -> int:
    """Handshake with the coordinator at ``endpoint``, then serve until ``shutdown``.  Must run
    on the process's main thread, which runs blocks (see ``runtime``).  ``fifos``: the
    coordinator's output pipes (``_outpipe.open_fifos``), where output goes instead of the
    socket.  ``tty``: which of fds 1 and 2 are a terminal, and its size.  ``curve``: the
    CurveZMQ keys of a TCP connection (see ``Channel``).  Returns the exit code; user code left
    running in threads is the caller's to abandon."""
    channel, router, fdcap = _link(endpoint, fifos, tty, curve)
    inherit_block_in_threads()
    hide_runtime_threads()
    plain_streams_in_children()
    early = _greet(channel, token, fdcap.diag_fd)
    if isinstance(early, int):
        return early
    baton = Baton()
    calls = HostCalls(channel, baton)
    displays = Displays(channel.send, router)
    displays.install()
    runtime = Runtime(router, fdcap, channel.send, calls.call, displays=displays, on_main_free=baton.main_free)
    runtime.install_interrupts()
    crew = Crew(channel, router, runtime, calls, baton, fdcap.diag_fd, early)
    return _serve(crew, fdcap)
