"""The ``agentloop`` command line.

Exit codes of ``exec`` follow timeout(1) and the shell: 0 finished, 1 raised, 124 deadline,
128+N worker died of signal N (the worker's own exit code when it exited), 125 agentloop's
own errors, with a one-line message on stderr.

Whatever a model or a worker wrote is printed inert (``engine.inert``: no escape sequence or
control character but newline and tab reaches a terminal), except where ``exec`` writes to a
pipe or a file: there the program's bytes pass unchanged, as with ``python script.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import click

from ..durations import DEFAULT_BLOCK_TIMEOUT, parse_duration
from ..engine import Engine
from ..errors import AgentloopError
from ..inert import InertStream, inert
from ..results import BlockResult, OutputChunk
from ..sandbox import SandboxPolicy
from ..script import Script

EXIT_ERROR = 1
EXIT_OWN = 125
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C (and SIGTERM, which stops a command the same way)


class Duration(click.ParamType):
    """A click type for ``250ms``, ``30s``, ``5m``, ``1h`` or plain seconds."""

    name = "DURATION"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        try:
            return parse_duration(value)
        except AgentloopError as exc:
            self.fail(str(exc), param, ctx)


def _fail(message: str) -> None:
    click.echo(inert(f"agentloop: {message}"), err=True)  # messages quote endpoints and files
    sys.exit(EXIT_OWN)


def _exit_code(result: BlockResult) -> int:
    if result.exited:  # SystemExit: its status, as Python exits with it
        return result.exit_code or 0
    if result.status == "ok":
        return 0
    if result.status == "timeout":
        return EXIT_TIMEOUT
    if result.status == "died":
        if result.signal:
            return 128 + result.signal
        return result.exit_code if result.exit_code else EXIT_ERROR
    if result.status == "cancelled":
        return EXIT_INTERRUPTED
    return EXIT_ERROR


def _apply(f, options):
    for option in reversed(options):  # so --help lists them in the order written here
        f = option(f)
    return f


_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


class Size(click.ParamType):
    """A byte count: ``512M``, ``2G``, ``1GiB``, ``64k`` or plain bytes."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().removesuffix("b").removesuffix("i")
        number, unit = text.rstrip("kmgt"), text[len(text.rstrip("kmgt")):]
        try:
            size = int(float(number) * _SIZE_UNITS[unit])
        except (ValueError, KeyError):
            self.fail(f"expected a size like 512M, 2G, 1GiB or plain bytes, got {value!r}", param, ctx)
        if size <= 0:
            self.fail(f"a size must be positive, got {value!r}", param, ctx)
        return size


def _limit(name: str, field: str, kind: click.ParamType, what: str):
    """A resource-limit option; its value goes to the sandbox policy, not to the command."""
    def remember(ctx, param, value):
        if value is not None:
            ctx.meta.setdefault("agentloop.limits", {})[field] = value

    return click.option(name, field, type=kind, default=None, expose_value=False, callback=remember,
                        help=what)


def _sandbox_options(f):
    return _apply(f, [
        click.option("--sandbox", type=click.Choice(["auto", "bwrap", "landlock", "none"]), default="auto",
                     show_default=True, help="How workers are contained; 'none' runs them unsandboxed."),
        click.option("--network", is_flag=True, help="Give workers the host's network."),
        click.option("--workspace", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="The directory workers may write (default ./files)."),
        _limit("--memory", "memory_bytes", Size(), "Memory per worker (default 2G)."),
        _limit("--cpu-time", "cpu_seconds", click.IntRange(1), "CPU seconds per worker (default: no limit)."),
        _limit("--max-processes", "max_processes", click.IntRange(1), "Processes per worker (default 256)."),
        _limit("--max-open-files", "max_open_files", click.IntRange(16), "Open files per worker (default 1024)."),
        _limit("--max-file-size", "max_file_bytes", Size(), "Largest file a worker may write (default 1G)."),
        _limit("--tmp-size", "tmp_bytes", Size(), "Size of a worker's /tmp (default 512M)."),
        _limit("--share-cwd/--no-share-cwd", "share_cwd", click.BOOL,
               "Show workers the current directory (read-only) even when it is /, a home directory "
               "or holds homes / never show it (default: only a project directory)."),
    ])


def _modules(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _policy(sandbox: str, network: bool) -> SandboxPolicy:
    """The sandbox policy of the current command: mode, network and the limit options."""
    if sandbox == "none":
        click.echo("agentloop: warning: --sandbox none runs model code with your privileges", err=True)
    ctx = click.get_current_context(silent=True)
    limits = ctx.meta.get("agentloop.limits", {}) if ctx is not None else {}
    return SandboxPolicy(mode=sandbox, network=network, **limits)


class _LazyGroup(click.Group):
    """Commands with heavy or optional imports load only when called."""

    lazy = {"ask": "engine.ask:ask", "batch": "engine.batch:batch", "chat": "engine.chat:chat",
            "demo": "engine.demo:demo", "mcp": "engine.cli.mcp:mcp"}

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx, name):
        if name in self.lazy and name not in self.commands:
            module, attr = self.lazy[name].split(":")
            import importlib

            try:
                return getattr(importlib.import_module(module), attr)
            except ImportError as exc:  # an optional extra missing: say so, keep the rest working
                why = f"{name} is unavailable: {exc}"

                @click.command(name, help=f"({why})")
                def unavailable() -> None:
                    _fail(why)

                return unavailable
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentloop")
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does to stderr.")
def main(verbose: bool) -> None:
    """agentloop: run model-written code in sandboxed worker processes."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="agentloop: %(message)s")
    # SIGTERM (a service manager, `kill`, a CI timeout) stops a command as Ctrl-C does: the
    # running blocks and workers are stopped and the run's sockets and directories removed.
    # Commands that handle signals themselves (batch, chat) replace this while they run.
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, frame)  # asyncio.run's: cancel the main task, let it clean up
    else:
        raise KeyboardInterrupt


@main.command("exec", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
@click.argument("file", type=click.File("r", encoding="utf-8"))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--timeout", type=Duration(), default=f"{DEFAULT_BLOCK_TIMEOUT:g}s", show_default=True,
              help="Deadline of the block: 250ms, 30s, 5m, 1h or plain seconds.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object on stdout after the run (the code's stdout goes to stderr).")
@click.option("--color", "allow_sgr", is_flag=True,
              help="Let the code's colour sequences (ESC [ ... m) through to a terminal.  Without it, "
                   "output bound for a terminal loses every escape sequence and control character but "
                   "newline and tab (a lone carriage return becomes a newline); output to a pipe or a "
                   "file is passed unchanged either way.")
@_sandbox_options
def exec_cmd(file, args: tuple[str, ...], timeout: float, as_json: bool, allow_sgr: bool, sandbox: str,
             network: bool, workspace) -> None:
    """Run FILE (or - for stdin) as one block in a fresh worker, streaming its output, as
    `python FILE ARGS` runs it: sys.argv is [FILE, *ARGS], __file__ is set, SystemExit gives
    the exit status, atexit handlers run, a piped stdin reaches the code.  Options go before
    FILE; everything after it (a leading -- dropped) is the script's.

    On a terminal the output is made inert (see --color); piped, it is passed byte for byte."""
    code = file.read()
    script = _script(file, args)
    out = _Sink(sys.stderr if as_json else sys.stdout, allow_sgr)
    err = _Sink(sys.stderr, allow_sgr)
    try:
        result = asyncio.run(_exec(code, timeout, out, err, _policy(sandbox, network), workspace, script))
    except AgentloopError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    finally:
        out.end()
        err.end()
    # A traceback, or sys.exit's message, is part of a script's output, where Python prints it;
    # a script that exited (SystemExit, os._exit) gets no words of ours, as under Python.
    on_its_own = result.exited or (result.status == "died" and not result.signal and result.exit_code)
    if result.message and not on_its_own:
        err.text(f"agentloop: {result.message}\n")
    if result.truncated and result.output_file:
        err.text(f"agentloop: the whole output is in {result.output_file}\n")
    if as_json:
        click.echo(json.dumps({
            "status": result.status, "exit_code": _exit_code(result),
            "duration_s": round(result.duration_s, 4), "output_bytes": result.output_bytes,
            "truncated": result.truncated, "output_file": result.output_file,
        }))
    sys.exit(_exit_code(result))


class _Sink:
    """One of ``exec``'s output streams.  To a terminal, bytes go through an ``InertStream``
    (its state carries sequences and characters split across chunks); to anything else they
    pass unchanged.  Each stream decides on its own, as ``python script.py 2>log`` would."""

    def __init__(self, stream, allow_sgr: bool) -> None:
        self.stream = stream
        self.buffer = stream.buffer
        try:
            terminal = stream.isatty()
        except (AttributeError, ValueError):
            terminal = False
        self.filter = InertStream(allow_sgr=allow_sgr, encoding=stream.encoding or "utf-8") if terminal else None

    def write(self, data: bytes) -> None:
        if self.filter is not None:
            data = self.filter.feed(data)
        if data:
            self.buffer.write(data)
            self.buffer.flush()

    def text(self, text: str) -> None:
        """A whole message (agentloop's, or the code's traceback), after the output has ended."""
        if self.filter is None:
            self.stream.write(text)
            self.stream.flush()
        else:
            self.buffer.write(inert(text).encode(self.filter.encoding, "replace"))
            self.buffer.flush()

    def end(self) -> None:
        """The program's output ended: what a sequence cut short left in the filter is dropped."""
        if self.filter is not None and (tail := self.filter.flush()):
            self.buffer.write(tail)
        self.buffer.flush()


def _script(file, args: tuple[str, ...]) -> Script:
    """What ``exec FILE ARGS`` runs as: the file's absolute path (``<stdin>`` for ``-``), the
    arguments as given, and this process's stdin when it is a pipe or a file that is not the
    code itself (a terminal is not read: a background job would stop on it)."""
    if args[:1] == ("--",):
        args = args[1:]
    from_stdin = file.name in ("-", "<stdin>")
    path = None if from_stdin else os.path.abspath(file.name)
    stdin = None
    if not from_stdin:
        try:
            if not os.isatty(0):
                stdin = 0
        except OSError:
            stdin = None
    return Script(path, ["-" if from_stdin else file.name, *args], stdin)


async def _exec(code: str, timeout: float, out: _Sink, err: _Sink, policy: SandboxPolicy,
                workspace: Path | None, script: Script | None = None) -> BlockResult:
    def show(chunk: OutputChunk) -> None:
        (err if chunk.stream == "stderr" else out).write(chunk.data)

    async with Engine(sandbox=policy, workspace=workspace, pool=0) as engine:  # one worker: no pool
        worker = await engine.start_worker("exec")
        for note in worker.notes:
            err.text(f"agentloop: {note}\n")
        return await worker.run(code, timeout=timeout, block_id="main", on_output=show, script=script)


def _subagent_limit(ctx, param, value):
    """``--max-subagents``: the limit of the agents this command makes, for as long as it runs
    (so ``run`` and ``chat`` need no parameter for it)."""
    from ..agent import subagent_limit

    token = subagent_limit.set(value)
    ctx.call_on_close(lambda: subagent_limit.reset(token))


def _remember_max_tokens(ctx, param, value):
    if value is not None:
        ctx.meta["agentloop.max_tokens"] = value


#: ``--max-tokens``: read by ``load_registry``, so commands need no parameter for it.
max_tokens_option = click.option(
    "--max-tokens", type=click.IntRange(1), default=None, expose_value=False, callback=_remember_max_tokens,
    help="Longest reply in tokens, sent as max_tokens (default: each model alias's max_tokens in "
         "agentloop.toml, else 8192).  A reply cut there is never taken as the answer.")


def agent_options(f):
    """Options shared by the commands that run agents (run, chat, batch, demo)."""
    return _sandbox_options(_apply(f, [
        max_tokens_option,
        click.option("--model", "model", default=None, help="Model alias (see `agentloop models`)."),
        click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Model aliases file (default ./agentloop.toml, else LLM_URL/LLM_MODEL)."),
        click.option("--protocol", type=click.Choice(["tags", "tools"]), default=None,
                     help="How the model acts: <run_code> tags (the default) or native tool calls; "
                          "default: each model alias's `protocol` in agentloop.toml."),
        click.option("--max-messages", type=click.IntRange(1), default=200, show_default=True,
                     help="Messages to the model before the run gives up."),
        click.option("--max-subagents", type=click.IntRange(1), default=8, show_default=True,
                     expose_value=False, callback=_subagent_limit,
                     help="Sub-agents working at once in a run; the model is told to wait beyond it."),
        click.option("--tools", type=click.Choice(["none", "repo"]), default="none", show_default=True,
                     help="Host functions to offer: repo = list_dir, read_file, search (read-only)."),
        click.option("--root", type=click.Path(file_okay=False, exists=True, path_type=Path), default=".",
                     help="Directory the repo tools may read (default: current directory)."),
        click.option("--record", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Record every display event to this JSONL file."),
        click.option("-q", "--quiet", is_flag=True, help="No live display on stderr."),
    ]))


def load_registry(models_file: Path | None):
    """The model aliases (the file, else LLM_URL/LLM_MODEL), with the command's ``--max-tokens``
    applied to every one; a bad file ends the command in one line."""
    from ..models import load_models

    try:
        return apply_max_tokens(load_models(models_file))
    except AgentloopError as exc:
        _fail(str(exc))


def apply_max_tokens(registry):
    """``registry`` with the current command's ``--max-tokens``, if it was given, on every model."""
    ctx = click.get_current_context(silent=True)
    cap = ctx.meta.get("agentloop.max_tokens") if ctx is not None else None
    return registry.replace_all(max_tokens=cap) if cap else registry


def host_functions(tools: str, root: Path) -> dict:
    if tools == "repo":
        from ..repo_tools import RepoTools

        return RepoTools(root).functions()
    return {}


def make_display(record: Path | None, quiet: bool):
    """The live console on stderr (unless quiet), plus a JSONL recorder when asked."""
    from ..console import ConsoleDisplay
    from ..display import AgentDisplay, FanoutDisplay, JsonlRecorder

    displays = [] if quiet else [ConsoleDisplay()]
    if record is not None:
        displays.append(JsonlRecorder(record))
    if not displays:
        return AgentDisplay()
    return displays[0] if len(displays) == 1 else FanoutDisplay(displays)


def close_display(display) -> None:
    for d in getattr(display, "displays", [display]):
        if hasattr(d, "close"):
            d.close()


def run_until_done(coro, display):
    """Run a command's coroutine; Ctrl-C and agentloop's own errors end the process in one line."""
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        click.echo("agentloop: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except AgentloopError as exc:
        _fail(str(exc))
    finally:
        close_display(display)


_RUN_EXIT = {"answered": 0, "failed": 1, "timed_out": EXIT_TIMEOUT, "cancelled": EXIT_INTERRUPTED}


@main.command("run")
@click.argument("task")
@agent_options
@click.option("--timeout", type=Duration(), default=None, help="Wall-clock cap for the whole run.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (answer, status, messages, tokens, cost, duration_s).")
@click.option("--preload", default="", metavar="MODULES",
              help="Modules the fork server imports once for every worker, e.g. numpy,pandas.")
def run_cmd(task: str, model, models_file, max_messages, record, tools, root, quiet, protocol, sandbox,
            network, workspace, timeout, as_json, preload) -> None:
    """Run TASK to its end: the final answer alone on stdout, the live display on stderr.

    The answer is printed inert (escape sequences and control characters but newline and tab
    removed, a lone carriage return made a newline); --json holds it exactly."""
    from ..agent import run_task

    registry = load_registry(models_file)
    try:
        registry.get(model)
    except AgentloopError as exc:
        _fail(str(exc))
    display = make_display(record, quiet)
    functions = host_functions(tools, root)
    policy = _policy(sandbox, network)

    async def go():
        async with Engine(sandbox=policy, workspace=workspace, preload=_modules(preload)) as engine:
            return await run_task(task, models=registry, model=model, engine=engine, functions=functions,
                                  display=display, max_messages=max_messages, timeout=timeout,
                                  protocol=protocol)

    result = run_until_done(go(), display)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    elif result.status == "answered" and (quiet or not same_terminal()):
        click.echo(inert(str(result.answer)))  # on the display's terminal the answer was just shown
    if result.status != "answered":
        click.echo(inert(f"agentloop: {ending(result)}"), err=True)
    sys.exit(_RUN_EXIT.get(result.status, 1))


def same_terminal() -> bool:
    """Whether stdout and stderr are one terminal: what the live display (stderr) showed is then
    already on the screen stdout would print to."""
    try:
        return os.isatty(1) and os.isatty(2) and os.ttyname(1) == os.ttyname(2)
    except OSError:
        return False


def ending(result) -> str:
    """How a run that gave no answer ended, as one plain sentence."""
    error = result.error.rstrip()
    stop = "" if error.endswith((".", "!", "?", ")")) else "."
    if result.status == "cancelled":
        return "the run was cancelled."
    if result.status == "timed_out":
        return f"the run was stopped at its --timeout: {error}{stop}"
    return f"the run failed: {error}{stop}"


@main.command("doctor")
@click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--model", default=None, help="Model alias whose endpoint to check.")
@_sandbox_options
def doctor_cmd(models_file, model, sandbox, network, workspace) -> None:
    """Which sandbox layers are available and active here, whether a sandboxed worker really
    starts, and whether the model endpoint answers.  Exit 1 when something does not work."""
    from ..doctor import report

    policy = _policy(sandbox, network)
    healthy = True
    try:
        layers = report(policy)
    except AgentloopError as exc:
        _fail(str(exc))
    click.echo("sandbox layers (available / active here):")
    for layer in layers:
        mark = "✓" if layer.active else ("·" if layer.available else "✗")
        click.echo(f"  {mark} {layer.name:<34} {'yes' if layer.available else 'no ':>3} / "
                   f"{'yes' if layer.active else 'no ':>3}  {layer.reason}")

    async def try_worker():
        async with Engine(sandbox=policy, workspace=workspace, pool=0) as engine:
            worker = await engine.start_worker("doctor")
            result = await worker.run("import os; print(os.getuid(), os.getpid())", timeout=20)
            return worker.notes, result

    try:
        notes, result = asyncio.run(try_worker())
        started = result.ok
        click.echo(inert(f"worker: {'starts and runs code' if started else 'started but failed: ' + result.text()}"))
        for note in notes:
            click.echo(inert(f"  note: {note}"))
    except AgentloopError as exc:
        click.echo(inert(f"worker: does not start: {exc}"))
        started = False
    healthy &= started
    registry = load_registry(models_file)
    try:
        config = registry.get(model)
    except AgentloopError as exc:
        _fail(str(exc))
    from ..llm import start_hint
    from ..model_server import probe
    from ..models import which_wins

    if wins := which_wins(registry, models_file):
        click.echo(inert(f"models: {wins}"))
    server = asyncio.run(probe(config))
    if server.models_status is None:
        answers = False
        advice = start_hint(config.base_url) if server.no_server else (
            "Check that the server at that address is up and reachable from here, or set LLM_URL.")
        click.echo(inert(f"model endpoint {config.base_url}: does not answer ({server.models_error}). {advice}"))
    elif server.models_status in (401, 403):
        answers = False
        held = "is set" if config.api_key() else "is not set"
        click.echo(inert(f"model endpoint {config.base_url}: refuses the key (HTTP {server.models_status}). "
                         f"Check ${config.api_key_env} ({held}): it must hold a key this server accepts, and "
                         f"api_key_env of the alias {config.alias!r} in agentloop.toml must name that variable."))
    else:
        answers = server.models_status < 500
        click.echo(inert(f"model endpoint {config.base_url}: answers (HTTP {server.models_status})"))
        for fine, line in _endpoint_lines(config, server):
            click.echo(inert(f"  {'✓' if fine else '✗'} {line}"))
            answers &= fine
    healthy &= answers
    sys.exit(0 if healthy else 1)


def _endpoint_lines(config, server) -> list[tuple[bool, str]]:
    """``doctor``'s lines on what the endpoint reported about itself: (fine, words)."""
    lines = []
    if server.kind:
        lines.append((True, f"server: {server.kind}"))
    served, words = server.check_id(config.model)
    if words:
        lines.append((served, words))
    if config.context_window:
        reported = f"; the server reports {server.context_window}" if server.context_window else ""
        lines.append((True, f"context window: {config.context_window} tokens (agentloop.toml){reported}"))
    elif server.context_window:
        lines.append((True, f"context window: {server.context_window} tokens (from the server, "
                            f"{server.context_source})"))
    else:
        lines.append((True, "context window: not reported; set context_window in agentloop.toml"))
    if server.supports_tools is not None:
        lines.append((True, f"tools: {'supported' if server.supports_tools else 'not supported'} "
                            f"({server.tools_source})" + ("" if server.supports_tools else
                                                          "; --protocol tools falls back to tags")))
    lines.append((True, f"reply cap: max_tokens {config.max_tokens}"))
    return lines


@main.command("models")
@click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Model aliases file (default ./agentloop.toml).")
def models_cmd(models_file) -> None:
    """List the model aliases agents can use, with what their servers report (context size,
    tool support); a server that does not answer within a few seconds is listed as configured."""
    from dataclasses import replace

    from ..model_server import probe
    from ..models import which_wins

    registry = load_registry(models_file)
    if wins := which_wins(registry, models_file):
        click.echo(inert(f"note: {wins}"))

    async def ask_all():
        return await asyncio.gather(*(probe(config) for config in registry))

    for config, server in zip(registry, asyncio.run(ask_all()), strict=True):
        mark = "*" if config is registry.default else " "
        shown, source = config, ""
        if not config.context_window and server.context_window:
            shown, source = replace(config, context_window=server.context_window), "from the server"
        notes = [config.base_url, f"protocol {config.protocol}", f"max_tokens {config.max_tokens}"]
        if server.supports_tools is False:
            notes.append("no tools: tools falls back to tags")
        click.echo(inert(f"{mark} {shown.describe(context_from=source).removeprefix('- ')}  [{', '.join(notes)}]"))

