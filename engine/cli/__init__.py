"""The ``agentloop`` command line: one module per command, their shared options in ``options``.

Every command loads only when called (``_LazyGroup``), so ``agentloop --help`` and a command
whose optional extra is not installed stay fast and working.  Exit codes are ``options``'s:
0 done, 1 failed, 124 deadline, 125 agentloop's own errors, 130 interrupted (Ctrl-C or
SIGTERM).  Whatever a model or a worker wrote is printed inert (``engine.inert``), except where
``exec`` writes to a pipe or a file.
"""

from __future__ import annotations

import importlib
import logging
import signal

import click

from engine.cli.options import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OWN,
    EXIT_TIMEOUT,
    Duration,
    Size,
    WorkerSettings,
    agent_options,
    fail,
    terminated,
    worker_options,
    worker_settings,
)

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OWN", "EXIT_TIMEOUT", "Duration", "Size",
           "WorkerSettings", "agent_options", "fail", "main", "run", "worker_options", "worker_settings"]


class _LazyGroup(click.Group):
    """Commands with heavy or optional imports load only when called."""

    lazy = {
        "ask": "engine.cli.ask:ask", "batch": "engine.cli.batch:batch", "chat": "engine.cli.chat:chat",
        "demo": "engine.cli.demo:demo", "doctor": "engine.cli.doctor:doctor_cmd",
        "exec": "engine.cli.exec:exec_cmd", "mcp": "engine.cli.mcp:mcp", "models": "engine.cli.models:models_cmd",
        "run": "engine.cli.run:run_cmd", "scripted": "engine.cli.scripted:scripted",
        "serve": "engine.cli.serve:serve", "view": "engine.cli.view:view_cmd",
    }

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx, name):
        if name in self.lazy and name not in self.commands:
            module, attr = self.lazy[name].split(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except ImportError as exc:  # an optional extra missing: say so, keep the rest working
                why = f"{name} is unavailable: {exc}"

                @click.command(name, help=f"({why})")
                def unavailable() -> None:
                    fail(why)

                return unavailable
        return super().get_command(ctx, name)


def _redacted(record: logging.LogRecord) -> bool:
    """A logging filter: the record's message with every URL's user part redacted
    (``engine.secrets``), formatted once here."""
    from engine.secrets import redact_urls

    message = record.getMessage()
    shown = redact_urls(message)
    if shown != message:
        record.msg, record.args = shown, None
    return True


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentloop")
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does to stderr.")
@click.option("--trace", is_flag=True,
              help="Send OpenTelemetry traces of what runs (OTLP, to OTEL_EXPORTER_OTLP_ENDPOINT, default "
                   "http://localhost:4318), as OTEL_TRACES_EXPORTER=otlp does; a collector on this machine "
                   "that another user runs gets nothing.")
@click.pass_context
def main(ctx: click.Context, verbose: bool, trace: bool) -> None:
    """agentloop: run model-written code in sandboxed worker processes."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="agentloop: %(message)s")
    for handler in logging.getLogger().handlers:  # what is logged names no URL's user or password
        handler.addFilter(_redacted)
    from engine.errors import AgentloopError
    from engine.observe import start_tracing, stop_tracing

    try:
        if start_tracing(trace) is not None:
            ctx.call_on_close(stop_tracing)
    except AgentloopError as exc:
        fail(f"tracing: {exc}")
    # SIGTERM (a service manager, `kill`, a CI timeout) stops a command as Ctrl-C does: the
    # running blocks and workers are stopped and the run's sockets and directories removed.
    # Commands that handle signals themselves (batch, chat) replace this while they run.
    # (A SIGTERM inherited as ignored stays so: ``exec`` passes that on to the script.)
    if signal.getsignal(signal.SIGTERM) != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, terminated)


def run() -> None:
    """The ``agentloop`` command as a process runs it: ``main``, then the process ends as soon as
    the command has (``_leave``)."""
    try:
        main(prog_name="agentloop")
    except SystemExit as exc:
        _leave(exc.code)
    _leave(0)


def _leave(code: object) -> None:
    """End the process with ``code``, skipping the interpreter's teardown of every module and
    object (a tenth of a short command's time) once nothing is left that it would finish: no
    thread of the command's still running, the ``atexit`` handlers run (traces, logs), stdout
    and stderr flushed.  Otherwise, and when a flush fails (a closed pipe: Python's own exit then
    says so and exits 120), it exits as the interpreter does.  Files are written through
    descriptors and synced as they are, never left for a finaliser to flush."""
    import atexit
    import os
    import sys
    import threading

    if code is None:
        code = 0
    if not isinstance(code, int) or threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except (OSError, ValueError):
        sys.exit(code)
    os._exit(code % 256)  # (what the interpreter makes of any int)
