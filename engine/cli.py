"""The ``agentloop`` command line.

Exit codes of ``exec`` follow timeout(1) and the shell: 0 finished, 1 raised, 124 deadline,
128+N worker died of signal N (the worker's own exit code when it exited), 125 agentloop's
own errors, with a one-line message on stderr.
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

from .durations import parse_duration
from .engine import Engine
from .errors import AgentloopError
from .results import BlockResult, OutputChunk
from .sandbox import SandboxPolicy

EXIT_ERROR = 1
EXIT_OWN = 125
EXIT_TIMEOUT = 124


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
    click.echo(f"agentloop: {message}", err=True)
    sys.exit(EXIT_OWN)


def _exit_code(result: BlockResult) -> int:
    if result.status == "ok":
        return 0
    if result.status == "timeout":
        return EXIT_TIMEOUT
    if result.status == "died":
        if result.signal:
            return 128 + result.signal
        return result.exit_code if result.exit_code else EXIT_ERROR
    if result.status == "cancelled":
        return 128 + signal.SIGINT
    return EXIT_ERROR


def _sandbox_options(f):
    f = click.option("--sandbox", type=click.Choice(["auto", "bwrap", "landlock", "none"]), default="auto",
                     show_default=True, help="How workers are contained; 'none' runs them unsandboxed.")(f)
    f = click.option("--network", is_flag=True, help="Give workers the host's network.")(f)
    f = click.option("--workspace", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="The directory workers may write (default ./files).")(f)
    return f


def _policy(sandbox: str, network: bool) -> SandboxPolicy:
    if sandbox == "none":
        click.echo("agentloop: warning: --sandbox none runs model code with your privileges", err=True)
    return SandboxPolicy(mode=sandbox, network=network)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentloop")
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does to stderr.")
def main(verbose: bool) -> None:
    """agentloop: run model-written code in sandboxed worker processes."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="agentloop: %(message)s")


@main.command("exec")
@click.argument("file", type=click.File("r", encoding="utf-8"))
@click.option("--timeout", type=Duration(), default="10s", show_default=True,
              help="Deadline of the block: 250ms, 30s, 5m, 1h or plain seconds.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object on stdout after the run (the code's stdout goes to stderr).")
@_sandbox_options
def exec_cmd(file, timeout: float, as_json: bool, sandbox: str, network: bool, workspace) -> None:
    """Run FILE (or - for stdin) as one block in a fresh worker, streaming its output."""
    code = file.read()
    try:
        result = asyncio.run(_exec(code, timeout, as_json, _policy(sandbox, network), workspace))
    except AgentloopError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
    if result.error:
        sys.stderr.write(result.error)
    if result.message:
        click.echo(f"agentloop: {result.message}", err=True)
    if result.truncated and result.output_file:
        click.echo(f"agentloop: the whole output is in {result.output_file}", err=True)
    if as_json:
        click.echo(json.dumps({
            "status": result.status, "exit_code": _exit_code(result),
            "duration_s": round(result.duration_s, 4), "output_bytes": result.output_bytes,
            "truncated": result.truncated, "output_file": result.output_file,
        }))
    sys.exit(_exit_code(result))


async def _exec(code: str, timeout: float, as_json: bool, policy: SandboxPolicy,
                workspace: Path | None) -> BlockResult:
    out = sys.stderr.buffer if as_json else sys.stdout.buffer
    err = sys.stderr.buffer

    def show(chunk: OutputChunk) -> None:
        stream = err if chunk.stream == "stderr" else out
        stream.write(chunk.data)
        stream.flush()

    async with Engine(sandbox=policy, workspace=workspace) as engine:
        worker = await engine.start_worker("exec")
        for note in worker.notes:
            click.echo(f"agentloop: {note}", err=True)
        return await worker.run(code, timeout=timeout, block_id="main", on_output=show)


if __name__ == "__main__":  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]))
