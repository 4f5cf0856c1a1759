"""``agentloop chat``: an interactive conversation with one agent.

One agent answers every question: its worker (the namespace) and its transcript persist, so a
question can use what an earlier one computed.  Standard input is read by a thread of its own,
so a line typed while the agent works is not lost: it steers the running turn (the model reads
it as a ``<steer>`` note with its next message).

Keys and lines:

- a question at the ``you>`` prompt starts a turn; its final answer goes to stdout, the live
  display to stderr;
- a line typed while a turn runs steers it.  When stdin is not a terminal every line is a
  question, taken in order, and only a ``/steer TEXT`` line steers (in a terminal too);
- Ctrl-C while a turn runs cancels the turn (its blocks and sub-agents are stopped) and
  returns to the prompt; at the prompt it only prints a new prompt, and a second Ctrl-C
  within two seconds leaves (exit status 130);
- Ctrl-D (end of input) leaves once the running turn, if any, has answered: exit status 0,
  or 1 when stdin is not a terminal and some question could not be answered.

When stdin is not a terminal each question is echoed after its prompt, so stdout reads as
the session would have on a terminal.

Answers, echoed lines and error messages are printed inert (``engine.inert``): a model's
escape sequences and control characters never reach the terminal, nor a file that is shown
on one later; ``--record`` keeps the exact text.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import os
import signal
import sys
import threading
import time

import click

from engine.agent import Agent, make_agent
from engine.cli.options import (
    EXIT_INTERRUPTED,
    agent_options,
    close_display,
    fail,
    host_functions,
    load_registry,
    make_display,
    same_terminal,
    worker_options,
    worker_settings,
    write_options,
)
from engine.errors import AgentloopError
from engine.inert import inert
from engine.workers import Engine

__all__ = ["DOUBLE_INTERRUPT_S", "PROMPT", "STEER", "chat"]

PROMPT = "you> "
STEER = "/steer"
#: Two Ctrl-C at the prompt within this many seconds leave the chat.
DOUBLE_INTERRUPT_S = 2.0
#: How long a cancelled turn's blocks get to stop (a stuck one is killed within the engine's grace).
_SETTLE_S = 30.0
_INTERRUPTED_NOTE = ("(The user interrupted the previous turn; whatever was still running then was cancelled "
                     "and its results were not delivered.)\n\n")


def _read_lines(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, fd: int) -> None:
    """Feed the lines of ``fd`` to ``queue``, then None at end of input.

    Reads the descriptor directly, not ``sys.stdin``: this thread may still be blocked in a
    read when the program exits, and must then hold no lock of the interpreter's file objects.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending = ""

    def put(item: str | None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the chat has ended, nobody reads any more
            raise SystemExit from None

    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        pending += decoder.decode(data, final=not data)
        *lines, pending = pending.split("\n")
        for line in lines:
            put(line.rstrip("\r"))
        if not data:
            if pending:
                put(pending)
            put(None)
            return


def _steer_text(line: str) -> str | None:
    """The note of a ``/steer TEXT`` line; None for any other line."""
    text = line.strip()
    if text.startswith(STEER) and text[len(STEER):len(STEER) + 1] in ("", " ", "\t"):
        return text[len(STEER):].strip()
    return None


class _Session:
    """The prompt loop around one agent: questions, steering, interrupts, end of input."""

    def __init__(self, agent: Agent, *, interactive: bool, echo_answers: bool = True) -> None:
        self.agent = agent
        self.interactive = interactive
        # False when the live display already showed each answer on the terminal stdout is.
        self.echo_answers = echo_answers
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self.pending: collections.deque[str] = collections.deque()  # questions read during a turn
        self.eof = False
        self.failures = 0
        self.interrupted_turn = False
        self._turn: asyncio.Task | None = None
        self._waiting: asyncio.Task | None = None
        self._last_idle_interrupt = -DOUBLE_INTERRUPT_S
        self._leave = False

    # -- output ---------------------------------------------------------------------------------
    @staticmethod
    def _out(text: str) -> None:
        sys.stdout.write(inert(text))
        sys.stdout.flush()

    @staticmethod
    def _err(text: str) -> None:
        click.echo(inert(f"agentloop: {text}"), err=True)

    # -- Ctrl-C ---------------------------------------------------------------------------------
    def on_interrupt(self) -> None:
        """SIGINT: cancel the running turn, else re-prompt (or leave, on a quick second one)."""
        if self._turn is not None:  # a turn runs, or is being settled after it ended
            self._turn.cancel()
            return
        now = time.monotonic()
        if now - self._last_idle_interrupt < DOUBLE_INTERRUPT_S:
            self._leave = True
        self._last_idle_interrupt = now
        if self._waiting is not None and not self._waiting.done():
            self._waiting.cancel()

    def on_terminate(self) -> None:
        """SIGTERM: leave, as a quick second Ctrl-C does; a running turn is cancelled first."""
        self._leave = True
        if self._turn is not None:
            self._turn.cancel()
        if self._waiting is not None and not self._waiting.done():
            self._waiting.cancel()

    # -- the loop -------------------------------------------------------------------------------
    async def run(self) -> int:
        while True:
            question = await self._next_question()
            if question is None:
                break
            await self._ask(question)
        if self._leave:
            return EXIT_INTERRUPTED
        return 1 if self.failures and not self.interactive else 0

    async def _next_question(self) -> str | None:
        """Prompt until a question arrives; None at end of input or on a double Ctrl-C."""
        while True:
            if self._leave:
                return None
            self._out(PROMPT)
            echo = not self.interactive
            if self.pending:  # typed while the last turn was ending: the terminal echoed it elsewhere
                line: str | None = self.pending.popleft()
                echo = True
            elif self.eof:
                line = None
            else:
                self._waiting = asyncio.ensure_future(self.lines.get())
                await asyncio.wait([self._waiting])
                if self._waiting.cancelled():  # Ctrl-C at the prompt
                    self._out("\n")
                    if self._leave:
                        return None
                    click.echo("(Ctrl-C again to leave, or Ctrl-D)", err=True)
                    continue
                line = self._waiting.result()
            if line is None:
                self.eof = True
                self._out("\n")
                return None
            if echo:
                self._out(line + "\n")
            if _steer_text(line) is not None:
                self._err("nothing is running to steer; ask a question instead")
                continue
            if line.strip():
                return line.strip()

    async def _ask(self, question: str) -> None:
        """One turn: run the agent, steering it with lines that arrive meanwhile."""
        if self.interrupted_turn:
            question = _INTERRUPTED_NOTE + question
            self.interrupted_turn = False
        turn = self._turn = asyncio.ensure_future(self.agent.run(question))
        while not turn.done():
            if self.eof:
                await asyncio.wait([turn])
                break
            getter = asyncio.ensure_future(self.lines.get())
            await asyncio.wait([turn, getter], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            self._route(getter.result(), running=not turn.done())
        try:
            if turn.cancelled():
                self._err("turn cancelled")
                self.interrupted_turn = True
                await self._settle()
                return
            exc = turn.exception()
            if exc is None:
                self._out(f"{turn.result()}\n\n" if self.echo_answers else "\n")
                return
            self.failures += 1
            if isinstance(exc, AgentloopError):  # the endpoint failed, or the message budget ran out
                self._err(str(exc))
            else:  # a fault of ours: say it and keep the session (and its namespace) alive
                self._err(f"internal error: {type(exc).__name__}: {exc}")
            await self._settle()
        finally:
            self._turn = None  # only now: a Ctrl-C while settling must not count as one at the prompt

    def _route(self, line: str | None, *, running: bool) -> None:
        """A line read during a turn: end of input, a steer, or a question for later."""
        if line is None:
            self.eof = True
            return
        steer = _steer_text(line)
        explicit = steer is not None
        text = steer if explicit else line.strip()
        if running and text and (explicit or self.interactive):
            self.agent.steer(text)
            self.agent.display.event("note", name=self.agent.name, message=f"steer: {text}")
        elif explicit:
            self._err("the turn had ended; the /steer line was not delivered")
        elif text:
            self.pending.append(line)

    async def _settle(self) -> None:
        """After a turn that did not answer: the next question starts from a quiet agent."""
        await asyncio.wait_for(self.agent.settle(), _SETTLE_S)


def _banner(config, engine: Engine, interactive: bool) -> str:
    steer = "a line typed while it works steers it" if interactive else "a /steer TEXT line steers it"
    return (f"agentloop chat — model {config.alias} ({config.model}) at {config.shown_url}\n"
            f"workspace {engine.workspace}; the conversation and the namespace persist across questions\n"
            f"Ctrl-D to exit, Ctrl-C cancels the current turn, {steer}")


@click.command("chat")
@agent_options
@worker_options
@write_options(write_cwd=False)
def chat(model, models_file, max_messages, record, tools, root, quiet, protocol) -> None:
    """Talk to an agent: its answers on stdout, the live display on stderr.

    The conversation and the namespace persist across questions.  A line typed while the
    agent works steers it (the model reads it with its next message).  Ctrl-C cancels the
    current turn; at the prompt, Ctrl-C twice within 2 s leaves (status 130).  Ctrl-D leaves
    once the running turn has answered.

    With stdin not a terminal, each line is a question, answered in order, and only a
    /steer TEXT line steers; the exit status is 1 if some question went unanswered.
    """
    registry = load_registry(models_file)
    try:
        config = registry.get(model)
    except AgentloopError as exc:
        fail(str(exc))
    functions = host_functions(tools, root)
    options = worker_settings()
    display = make_display(record, quiet, registry)
    interactive = os.isatty(sys.stdin.fileno())

    async def go() -> int:
        loop = asyncio.get_running_loop()
        async with Engine(options.settings(), workspace=options.workspace) as engine:
            if not quiet:
                click.echo(_banner(config, engine, interactive), err=True)
            agent = make_agent(engine=engine, models=registry, model=config, functions=functions,
                               display=display, max_messages=max_messages, protocol=protocol)
            session = _Session(agent, interactive=interactive, echo_answers=quiet or not same_terminal())
            try:
                await agent.start()  # the worker is ready (or its failure known) before the first prompt
                # From here on Ctrl-C belongs to the session; before, it ends the program.
                loop.add_signal_handler(signal.SIGINT, session.on_interrupt)
                loop.add_signal_handler(signal.SIGTERM, session.on_terminate)
                threading.Thread(target=_read_lines, args=(loop, session.lines, sys.stdin.fileno()),
                                 name="agentloop-stdin", daemon=True).start()
                return await session.run()
            finally:
                loop.add_signal_handler(signal.SIGINT, lambda: None)  # closing is quick; let it finish
                try:
                    await asyncio.shield(agent.close())
                finally:
                    loop.remove_signal_handler(signal.SIGINT)
                    loop.remove_signal_handler(signal.SIGTERM)

    try:
        code = asyncio.run(go())
    except KeyboardInterrupt:  # while the worker was starting
        sys.exit(EXIT_INTERRUPTED)
    except AgentloopError as exc:
        fail(str(exc))
    finally:
        close_display(display)
    sys.exit(code)
