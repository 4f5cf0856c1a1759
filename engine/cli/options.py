"""What the commands share: value types, exit codes, the worker and agent options, the display.

Every command that starts workers takes ``worker_options`` (one decorator, so ``--help`` of
each lists the same sandbox, limit and interpreter options) and reads them back with
``worker_settings()``, which builds the command's ``engine.launch.WorkerSettings`` once; the
options never become parameters of the command functions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from engine.config import CONFIG_FILE, read_config
from engine.durations import parse_duration
from engine.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OWN, EXIT_TIMEOUT, AgentloopError
from engine.inert import inert
from engine.launch import WorkerSettings
from engine.net import Allowlist
from engine.results import OUTPUT_CAP
from engine.sandbox import SandboxPolicy, which_python
from engine.secrets import redact_urls


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


def fail(message: str) -> None:
    """End the command with one line on stderr and exit status 125 (agentloop's own errors)."""
    # Messages quote endpoints and files: no URL's user or password, nothing a terminal acts on.
    click.echo(inert(redact_urls(f"agentloop: {message}")), err=True)
    sys.exit(EXIT_OWN)


def apply_options(f, options):
    """Decorate ``f`` with ``options`` so that ``--help`` lists them in the order given."""
    for option in reversed(options):
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


@dataclass
class _WorkerOptions:
    """The worker options of the current command, as ``worker_options`` collected them."""

    sandbox: str = "auto"
    network: bool = False
    workspace: Path | None = None
    preload: tuple[str, ...] = ()
    python: str | None = None
    keep_output: bool = False
    max_output: int = OUTPUT_CAP
    limits: dict = field(default_factory=dict)
    #: ``--write-cwd``: code writes the current directory (``write_options``); None: the command's default.
    write_cwd: bool | None = None
    #: ``--allow-net``: the entries given, in order (the file's ``network.allow`` join them).
    allow_net: tuple[str, ...] = ()
    _built: WorkerSettings | None = None

    def policy(self) -> SandboxPolicy:
        """The sandbox policy (mode, network, limits).  Code that writes the current directory
        runs as the user (``SandboxPolicy.as_caller``)."""
        return SandboxPolicy(mode=self.sandbox, network=self.network, as_caller=bool(self.write_cwd), **self.limits)

    def python_choice(self) -> tuple[str, str]:
        """The workers' interpreter and which source chose it (``engine.sandbox.which_python``,
        ./agentloop.toml read as every command reads it); a bad choice or file ends the command
        in one line."""
        try:
            return which_python(self.python, workspace=self.workspace or Path("files"))
        except AgentloopError as exc:
            fail(str(exc))

    def settings(self) -> WorkerSettings:
        """The command's worker settings, built once: the policy (a warning on stderr for
        ``--sandbox none``) and the interpreter ``python_choice`` chooses.  With ``--write-cwd``
        the current directory becomes ``workspace``."""
        if self._built is None:
            if self.sandbox == "none":
                click.echo("agentloop: warning: --sandbox none runs model code with your privileges", err=True)
            if self.write_cwd:
                if self.workspace is not None:
                    fail("--workspace DIR goes with --read-only: with --write-cwd code writes the current directory")
                self.workspace = Path.cwd()
            try:
                self._built = WorkerSettings(sandbox=self.policy(), python=self.python_choice()[0],
                                             preload=self.preload, keep_output=self.keep_output,
                                             max_output=self.max_output, allow_net=self.allowlist())
            except AgentloopError as exc:
                fail(str(exc))
        return self._built

    def allowlist(self) -> Allowlist:
        """The entries of ``network.allow`` in ./agentloop.toml and ``--allow-net``'s, each once
        (``engine.net.Allowlist``); ConfigError naming the first that is none, and where."""
        config = Path(CONFIG_FILE)
        listed = read_config(config).get("network", {}).get("allow", []) if config.is_file() else []
        entries = (*Allowlist.parse(listed, f"{config}: network.allow").entries, *Allowlist.parse(self.allow_net).entries)
        return Allowlist(tuple(dict.fromkeys(entries)))


def worker_settings() -> _WorkerOptions:
    """The current command's worker options (defaults outside a command); ``.settings()`` is
    what its engines are given, ``.workspace`` where its workers write."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return _WorkerOptions()
    return ctx.meta.setdefault("agentloop.worker", _WorkerOptions())  # one ``meta`` per command line


def _setting(name: str):
    def remember(ctx, param, value):
        if value is not None:
            setattr(worker_settings(), name, value)
    return remember


def _limit(name: str, field_name: str, kind: click.ParamType, what: str):
    """A resource-limit option; its value goes to the sandbox policy, not to the command."""
    def remember(ctx, param, value):
        if value is not None:
            worker_settings().limits[field_name] = value
    return click.option(name, field_name, type=kind, default=None, expose_value=False, callback=remember,
                        help=what)


def _allow_net(ctx, param, value):
    if value:
        worker_settings().allow_net += tuple(value)


def _preload(ctx, param, value):
    if value is not None:
        worker_settings().preload = modules(value)


def modules(text: str) -> tuple[str, ...]:
    """``numpy, pandas`` as ``("numpy", "pandas")``."""
    return tuple(m.strip() for m in text.split(",") if m.strip())


def worker_options(f):
    """The options of every command that starts workers: how they are contained, their limits,
    where they may write and what the fork server imports for them."""
    return apply_options(f, [
        click.option("--sandbox", type=click.Choice(["auto", "bwrap", "landlock", "none"]), default="auto",
                     show_default=True, expose_value=False, callback=_setting("sandbox"),
                     help="How workers are contained; 'none' runs them unsandboxed."),
        click.option("--network", is_flag=True, default=None, expose_value=False, callback=_setting("network"),
                     help="Give workers the host's network."),
        click.option("--allow-net", multiple=True, metavar="HOST[:PORT]", expose_value=False, callback=_allow_net,
                     help="Let workers reach HOST (example.com, *.example.com its subdomains, **.example.com "
                          "both, or an IP address) on PORT (default 443 and 80) through a proxy outside the "
                          "sandbox, and nothing else; repeatable (and network.allow in agentloop.toml)."),
        click.option("--workspace", type=click.Path(file_okay=False, path_type=Path), default=None,
                     expose_value=False, callback=_setting("workspace"),
                     help="The directory workers may write (default ./files; batch: each run's own)."),
        click.option("--python", default=None, metavar="PATH", expose_value=False, callback=_setting("python"),
                     help="The Python workers run (default: $AGENTLOOP_PYTHON, python in ./agentloop.toml, "
                          "the active virtual environment, else agentloop's own)."),
        click.option("--preload", default=None, metavar="MODULES", expose_value=False,
                     callback=_preload,
                     help="Modules the fork server imports once for every worker, e.g. numpy,pandas."),
        click.option("--keep-output", is_flag=True, default=None, expose_value=False,
                     callback=_setting("keep_output"),
                     help="Keep the files of block outputs too large for memory after the run (batch "
                          "always keeps them, in each run's directory)."),
        click.option("--max-output", type=Size(), default=None, expose_value=False,
                     callback=_setting("max_output"),
                     help="What the files of block outputs too large for memory may hold in all, per "
                          "run (default 1G; each file 256M at most)."),
        _limit("--memory", "memory_bytes", Size(), "Memory per worker (default 2G)."),
        _limit("--cpu-time", "cpu_seconds", click.IntRange(1), "CPU seconds per worker (default: no limit)."),
        _limit("--max-processes", "max_processes", click.IntRange(1), "Processes per worker (default 256)."),
        _limit("--max-open-files", "max_open_files", click.IntRange(16),
                        "Open files per worker (default 1024)."),
        _limit("--max-file-size", "max_file_bytes", Size(), "Largest file a worker may write (default 1G)."),
        _limit("--tmp-size", "tmp_bytes", Size(), "Size of a worker's /tmp (default 512M)."),
        _limit("--share-cwd/--no-share-cwd", "share_cwd", click.BOOL,
                        "Show workers the current directory (read-only) even when it is /, a home directory "
                        "or holds homes / never show it (default: only a project directory)."),
    ])


#: Where code may write, in the words of ``--help`` (and of the table in docs/worker-options.md).
WRITE_HELP = ("Where code may write.  --write-cwd: the current directory, but its .git, agentloop.toml, virtual "
              "environments (directories holding pyvenv.cfg), the interpreter and agentloop's own code stay "
              "read-only; code runs as you (as root: uid 0 without capabilities).  --read-only: the current "
              "directory is read-only, and code writes only to the workspace (./files, or --workspace DIR).  "
              "Either way $TMPDIR is a private /tmp.")


def write_options(write_cwd: bool):
    """``--write-cwd/--read-only``, with the command's default (``exec``: the current
    directory; ``run`` and ``chat``, whose code a model wrote: the workspace)."""
    default = "--write-cwd" if write_cwd else "--read-only"
    return click.option("--write-cwd/--read-only", "write_cwd", default=write_cwd, expose_value=False,
                        callback=_setting("write_cwd"), help=f"{WRITE_HELP}  Default: {default}.")


def served_options(prefix: str = ""):
    """``--token-file`` and ``--allow-host`` of a command that serves over TCP (``serve``, and
    ``mcp`` with ``prefix`` "With --http: "): what every such server asks, in the same words."""
    def apply(f):
        return apply_options(f, [
            click.option("--token-file", type=click.Path(dir_okay=False, readable=False, path_type=Path),
                         default=None,
                         help=f"{prefix}The file holding the token to require instead (yours, mode 0600; one "
                              "line of at least 32 characters among A-Z a-z 0-9 - _ . ~).  No option takes the "
                              "token itself: every local user can read a command line."),
            click.option("--allow-host", "allowed_hosts", metavar="NAME", multiple=True,
                         help=f"{prefix}A host name clients may use to reach the server (repeatable).  Requests "
                              "name an IP address or localhost otherwise; any other Host or Origin is refused, "
                              "so no web page can reach the server by DNS rebinding.")])
    return apply


def _subagent_limit(ctx, param, value):
    """``--max-subagents``: the limit of the agents this command makes, for as long as it runs
    (so ``run`` and ``chat`` need no parameter for it)."""
    from engine.agent import subagent_limit

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
    """The model and agent options of the commands that run agents interactively (run, chat);
    the worker options are ``worker_options``'s."""
    return apply_options(f, [
        max_tokens_option,
        click.option("--model", "model", default=None, help="Model alias (see `agentloop models`)."),
        click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Model aliases file (default ./agentloop.toml, else LLM_URL/LLM_MODEL).  A key "
                          "($LLM_API_KEY, or the alias's api_key_env) goes only to a URL you named, never to "
                          "the built-in default; a server on this machine is used only when it is yours or "
                          "root's."),
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
    ])


def load_registry(models_file: Path | None):
    """The model aliases (the file, else LLM_URL/LLM_MODEL), with the command's ``--max-tokens``
    applied to every one; a bad file ends the command in one line.  A key set for an endpoint
    nobody named (the built-in default) is not sent, and one line on stderr says so."""
    from engine.models import load_models, unsent_key_note

    try:
        registry = apply_max_tokens(load_models(models_file))
    except AgentloopError as exc:
        fail(str(exc))
    if note := unsent_key_note(registry):
        click.echo(inert(f"agentloop: note: {note}"), err=True)
    return registry


def apply_max_tokens(registry):
    """``registry`` with the current command's ``--max-tokens``, if it was given, on every model."""
    ctx = click.get_current_context(silent=True)
    cap = ctx.meta.get("agentloop.max_tokens") if ctx is not None else None
    return registry.replace_all(max_tokens=cap) if cap else registry


def host_functions(tools: str, root: Path) -> dict:
    if tools == "repo":
        from engine.tools import RepoTools

        return RepoTools(root).functions()
    return {}


def make_display(record: Path | None, quiet: bool, models=None):
    """The live console on stderr (unless quiet), plus a JSONL recorder when asked (a file it
    cannot write ends the command in one line), plus the spans of the run when tracing is on
    (``models`` names its model ids and servers)."""
    from engine.agent import AgentDisplay, FanoutDisplay, JsonlRecorder
    from engine.observe import ConsoleDisplay, trace_observer

    displays = [] if quiet else [ConsoleDisplay()]
    if record is not None:
        try:
            displays.append(JsonlRecorder(record))
        except OSError as exc:
            fail(f"cannot record to {record}: {exc.strerror or exc}")
        except AgentloopError as exc:
            fail(str(exc))
    if (spans := trace_observer(models)) is not None:
        displays.append(spans)
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
        fail(str(exc))
    finally:
        close_display(display)


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


def terminated(signum: int, frame) -> None:
    """SIGTERM's handler: stop the command as Ctrl-C does (asyncio.run's SIGINT path)."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, frame)  # asyncio.run's: cancel the main task, let it clean up
    else:
        raise KeyboardInterrupt


__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OWN", "EXIT_TIMEOUT", "WRITE_HELP", "Duration", "Size",
           "agent_options", "apply_max_tokens", "apply_options", "close_display", "ending", "fail",
           "host_functions", "load_registry", "make_display", "max_tokens_option", "modules", "run_until_done",
           "same_terminal", "served_options", "terminated", "worker_options", "worker_settings", "write_options"]
