"""``agentloop ask``'s terminal side: the one-shot question, the prompt loop and the command
(the assistant itself, and the contract it keeps, are ``engine.agent``'s)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from engine.agent import (
    ASK_SYSTEM,
    EXIT_FAILED,
    PROMPT,
    Answer,
    AnswerStream,
    Assistant,
    ClientEvents,
    FanoutDisplay,
)
from engine.cli.options import EXIT_INTERRUPTED, close_display, fail, load_registry
from engine.cli.options import terminated as stop_like_ctrl_c
from engine.errors import AgentloopError, ModelError
from engine.inert import inert
from engine.models import Chat
from engine.observe import trace_observer
from engine.tools import RepoTools

__all__ = ["ask"]

# ---------------------------------------------------------------------------------- terminal

def _isatty(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(inert(text) + "\n")
    sys.stderr.flush()


def _show(answer: Answer) -> None:
    if not answer.streamed:  # else it is on the terminal already, its line ended
        _out(inert(answer.text) + "\n")


def _banner(config: Any, root: Path) -> str:
    model = config.model if config.alias == "default" else f"{config.alias} ({config.model})"
    return (f"agentloop ask — model {model} at {config.shown_url}\n"
            f"root {root} (Ctrl-D to exit; the conversation persists across questions)")


def _one_shot(runner: asyncio.Runner, assistant: Assistant, question: str, as_json: bool) -> int:
    started = time.monotonic()
    answer, error = None, ""
    try:
        answer = runner.run(assistant.ask(question))
    except KeyboardInterrupt:
        _err("agentloop: interrupted")
        return EXIT_INTERRUPTED
    except ModelError as exc:
        error = str(exc)
        _err(f"agentloop: {exc}")
    if as_json:
        chat = assistant.chat
        status = "failed" if answer is None else "stopped" if answer.stopped else "answered"
        _out(json.dumps({"answer": answer and answer.text, "status": status, "error": error,
                         "messages": chat.requests, "tokens": {"in": chat.tokens_in, "out": chat.tokens_out},
                         "cost": round(chat.cost, 6), "duration_s": round(time.monotonic() - started, 3),
                         "tool_calls": assistant.tool_calls, "root": str(assistant.tools.root)}) + "\n")
    elif answer is not None:
        _show(answer)
    return EXIT_FAILED if answer is None else 0


def _read_question(terminal: bool) -> str | None:
    """The next line typed, None at end of input; KeyboardInterrupt passes through."""
    _out("\n")
    try:
        line = input(PROMPT)
    except EOFError:
        _out("\n")
        return None
    if not terminal:
        _out(inert(line) + "\n")  # stdout reads as the session would have on a terminal
    return line


def _interactive(runner: asyncio.Runner, assistant: Assistant, banner: str) -> int:
    """The prompt loop (see the module docstring); returns the exit status."""
    terminal = _isatty(sys.stdin)
    if terminal and _isatty(sys.stdout):
        import readline  # noqa: F401 - line editing and history for input()
    _err(banner)
    terminated: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:  # leave, wherever it comes
        terminated.append(signum)
        stop_like_ctrl_c(signum, frame)  # a running question is cancelled as by Ctrl-C

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    failures, interrupted = 0, False
    try:
        while True:
            try:
                line = _read_question(terminal)
            except KeyboardInterrupt:
                _out("\n")
                if interrupted or terminated:
                    return EXIT_INTERRUPTED
                interrupted = True
                _err("(Ctrl-C again to leave, or Ctrl-D)")
                continue
            if line is None:
                break
            interrupted = False
            question = line.strip()
            if not question:
                continue
            try:
                _show(runner.run(assistant.ask(question)))
            except KeyboardInterrupt:
                if terminated:
                    return EXIT_INTERRUPTED
                _err("agentloop: interrupted; the question was dropped from the conversation")
            except ModelError as exc:
                failures += 1
                _err(f"agentloop: {exc} (the question was dropped from the conversation; ask it again)")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return EXIT_FAILED if failures and not terminal else 0


# ---------------------------------------------------------------------------------- the command

@click.command("ask")
@click.argument("question", nargs=-1)
@click.option("--root", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              envvar="AGENT_ROOT", show_envvar=True,
              help="The directory the tools may read (default: the current directory).")
@click.option("--max-turns", type=click.IntRange(1), default=20, show_default=True, envvar="MAX_TURNS",
              show_envvar=True, help="Requests to the model per question before it is stopped.")
@click.option("--model", "model", default=None, help="Model alias (see `agentloop models`).")
@click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Model aliases file (default ./agentloop.toml, else LLM_URL/LLM_MODEL).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (answer, status, messages, tokens, cost, duration_s, ...).")
@click.option("--record", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Record every event to this JSONL file.")
def ask(question: tuple[str, ...], root: Path | None, max_turns: int, model: str | None,
        models_file: Path | None, as_json: bool, record: Path | None) -> None:
    """Answer QUESTION about the repository at --root with three read-only tools
    (list_dir, read_file, search); without QUESTION, ask one after another at a you> prompt.

    The words of QUESTION are joined with spaces.  The answer goes to stdout (shown as it is
    written on a terminal), one line per tool call to stderr.  No code is run.  Exit 0 with an
    answer (the round-limit message included), 1 when the model endpoint failed, 130 when
    interrupted.
    """
    text = " ".join(question).strip()
    if question and not text:
        raise click.UsageError("the question is empty")
    if as_json and not text:
        raise click.UsageError("--json needs a QUESTION")
    registry = load_registry(models_file)
    try:
        config = registry.get(model)
        tools = RepoTools(root if root is not None else os.getcwd())
    except AgentloopError as exc:
        fail(str(exc))
    recorder = None
    if record is not None:
        from engine.agent import JsonlRecorder

        try:
            recorder = JsonlRecorder(record)
        except OSError as exc:
            tools.close()
            fail(f"cannot record to {record}: {exc.strerror or exc}")
        except AgentloopError as exc:
            tools.close()
            fail(str(exc))
    if (spans := trace_observer(registry)) is not None:  # the tool calls as spans, too
        recorder = FanoutDisplay([d for d in (recorder, spans) if d is not None])
    stream = AnswerStream(_out) if _isatty(sys.stdout) and not as_json else None
    events = _events(recorder, stream)
    chat = Chat(ASK_SYSTEM.format(root=tools.root), config, display=events, name="ask")
    assistant = Assistant(chat, tools, max_turns=max_turns, stream=stream, gear=_err)
    code = EXIT_FAILED
    try:
        with asyncio.Runner() as runner:
            try:
                if text:
                    code = _one_shot(runner, assistant, text, as_json)
                else:
                    code = _interactive(runner, assistant, _banner(config, tools.root))
            finally:
                tools.close()  # first: a tool call abandoned by Ctrl-C ends with its process
                runner.run(chat.aclose())
    except KeyboardInterrupt:  # while closing
        code = EXIT_INTERRUPTED
    finally:
        tools.close()
        if recorder is not None:
            close_display(recorder)
    sys.exit(code)


def _events(recorder: Any, stream: AnswerStream | None) -> ClientEvents:
    return ClientEvents(recorder, stream, (lambda text: _err(f"agentloop: {text}")) if _isatty(sys.stderr) else None)
