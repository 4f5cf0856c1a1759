"""``agentloop run``: one task to its end, the answer alone on stdout."""

from __future__ import annotations

import json
import sys

import click

from engine.cli.options import (
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    Duration,
    agent_options,
    ending,
    fail,
    host_functions,
    load_registry,
    make_display,
    run_until_done,
    same_terminal,
    worker_options,
    worker_settings,
    write_options,
)
from engine.errors import AgentloopError
from engine.inert import inert
from engine.workers import Engine

__all__ = ["run_cmd"]

_RUN_EXIT = {"answered": 0, "failed": 1, "timed_out": EXIT_TIMEOUT, "cancelled": EXIT_INTERRUPTED}


@click.command("run")
@click.argument("task")
@agent_options
@click.option("--timeout", type=Duration(), default=None, help="Wall-clock cap for the whole run.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (answer, status, messages, tokens, cost, duration_s).")
@worker_options
@write_options(write_cwd=False)
def run_cmd(task: str, model, models_file, max_messages, record, tools, root, quiet, protocol, timeout,
            as_json) -> None:
    """Run TASK to its end: the final answer alone on stdout, the live display on stderr.

    The answer is printed inert (escape sequences and control characters but newline and tab
    removed, a lone carriage return made a newline); --json holds it exactly."""
    from engine.agent import run_task

    registry = load_registry(models_file)
    try:
        registry.get(model)
    except AgentloopError as exc:
        fail(str(exc))
    display = make_display(record, quiet, registry)
    functions = host_functions(tools, root)
    options = worker_settings()

    async def go():
        async with Engine(options.settings(), workspace=options.workspace) as engine:
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
