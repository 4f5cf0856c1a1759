"""``agentloop exec``: one file as one block in a fresh worker, as ``python FILE ARGS`` runs it.

Exit codes follow timeout(1) and the shell: 0 finished, 1 raised, 124 deadline, 128+N worker
died of signal N (the worker's own exit code when it exited), 125 agentloop's own errors.
Output bound for a terminal is made inert (``engine.inert``); to a pipe or a file the
program's bytes pass unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import click

from ..durations import DEFAULT_BLOCK_TIMEOUT
from ..engine import Engine
from ..errors import AgentloopError
from ..inert import InertStream, inert
from ..results import BlockResult, OutputChunk, writable_note
from ..samples import exit_code as _exit_code
from ..script_run import ScriptRun
from ..settings import WorkerSettings
from .options import (
    EXIT_INTERRUPTED,
    Duration,
    fail,
    worker_options,
    worker_settings,
)

__all__ = ["SAMPLE_REDO", "exec_cmd"]

#: What ``--redo`` may name with ``--jsonl``.
SAMPLE_REDO = ("error", "timeout", "oom", "died")


@click.command("exec", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
@click.argument("file", type=click.File("r", encoding="utf-8"), required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--timeout", type=Duration(), default=f"{DEFAULT_BLOCK_TIMEOUT:g}s", show_default=True,
              help="Deadline of the block: 250ms, 30s, 5m, 1h or plain seconds.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object on stdout after the run (the code's stdout goes to stderr).")
@click.option("--color", "allow_sgr", is_flag=True,
              help="Let the code's colour and style sequences (ESC [ ... m: colours, bold, dim, italic, "
                   "underline, reverse, strike; not concealed text or blink) through to a terminal.  Without it, "
                   "output bound for a terminal loses every escape sequence and control character but "
                   "newline and tab (a lone carriage return becomes a newline); output to a pipe or a "
                   "file is passed unchanged either way.")
@click.option("--jsonl", "samples", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Run every code sample of this JSONL file (id, code; optional stdin, args, timeout, files, "
                   "env), each in a fresh sandbox of its own, instead of FILE; results go to -o.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --jsonl: the results JSONL, one line per sample as it ends; rerun to resume.")
@click.option("--parallel", type=click.IntRange(1), default=None,
              help="With --jsonl: samples at once (default: min(2 x CPUs, available GiB of memory)).")
@click.option("--redo", multiple=True, type=click.Choice(list(SAMPLE_REDO)),
              help="With --jsonl: also run again the samples recorded with this status (cancelled ones always "
                   "are).  Repeatable.")
@click.option("--skip-invalid", is_flag=True, help="With --jsonl: report invalid lines and go on without them.")
@click.option("--progress", type=click.Choice(["auto", "bar", "lines", "none"]), default="auto",
              show_default=True, help="With --jsonl: a live bar (auto: when stderr is a terminal) or one line per sample.")
@click.option("--ray", "ray_address", metavar="ADDRESS", default=None,
              help="With --jsonl: run the samples on a Ray cluster (needs the ray extra), in chunks, one "
                   "agent_slot each; see `agentloop batch --help`.")
@worker_options
def exec_cmd(file, args: tuple[str, ...], timeout: float, as_json: bool, allow_sgr: bool, samples: Path | None,
             output: Path | None, parallel: int | None, redo: tuple[str, ...], skip_invalid: bool, progress: str,
             ray_address: str | None) -> None:
    """Run FILE (or - for stdin) as one block in a fresh worker, streaming its output, as
    `python FILE ARGS` runs it: sys.argv is [FILE, *ARGS], __file__ is set, SystemExit gives
    the exit status, atexit handlers run, a piped stdin reaches the code.  Options go before
    FILE; everything after it (a leading -- dropped) is the script's.

    On a terminal the output is made inert (see --color); piped, it is passed byte for byte.

    With --jsonl SAMPLES -o RESULTS: every sample of SAMPLES runs that way, in a sandbox of its
    own (process, namespaces, /tmp and workspace), and its result (status, exit code, stdout and
    stderr, duration, peak memory) is appended to RESULTS as it ends; resume, Ctrl-C and the
    progress bar are `agentloop batch`'s."""
    if samples is not None:
        _run_samples(samples, output, file, as_json, timeout, parallel, redo, skip_invalid, progress, ray_address)
        return
    if file is None:
        fail("exec needs FILE (or - for stdin), or --jsonl SAMPLES -o RESULTS")
    if output is not None:
        fail("-o goes with --jsonl")
    code = file.read()
    script = _script(file, args)
    out = _Sink(sys.stderr if as_json else sys.stdout, allow_sgr)
    err = _Sink(sys.stderr, allow_sgr)
    try:
        options = worker_settings()
        # A stream bound for a terminal is a terminal for the code too (a pty of its own: colours
        # and progress bars behave as under python; what reaches the screen is still made
        # inert); with --json, or piped, it stays a pipe.
        tty = () if as_json else tuple(fd for fd, sink in ((1, out), (2, err)) if sink.filter is not None)
        result = asyncio.run(_exec(code, timeout, out, err, options.settings().replace(tty=tty),
                                   options.workspace, script))
    except AgentloopError as exc:
        fail(str(exc))
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
    if result.refused_write():
        err.text(f"agentloop: note: {writable_note(worker_settings().workspace or './files')}\n")
    # All of it was streamed here; the file is kept only on request (then it is said where).
    output_file = result.output_file if worker_settings().keep_output else None
    if result.truncated and output_file:
        whole = os.path.getsize(output_file) == result.output_bytes  # (a cut file ends saying so)
        err.text(f"agentloop: the whole output is in {output_file}\n" if whole else
                 f"agentloop: the output is in {output_file}, cut where it says why\n")
    if as_json:
        click.echo(json.dumps({
            "status": result.status, "exit_code": _exit_code(result),
            "duration_s": round(result.duration_s, 4), "output_bytes": result.output_bytes,
            "truncated": result.truncated, "output_file": output_file,
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


def _run_samples(samples: Path, output: Path | None, file, as_json: bool, timeout: float, parallel: int | None,
                 redo: tuple[str, ...], skip_invalid: bool, progress: str, ray_address: str | None) -> None:
    """``exec --jsonl``: every sample of the file, to the results file (``engine.batch.sample_file``)."""
    from ..batch.progress import print_summary
    from ..batch.sample_file import run_samples

    if file is not None or output is None or as_json:
        fail("--jsonl SAMPLES takes -o RESULTS, and neither FILE nor --json")
    settings = worker_settings()
    if settings.workspace is not None:
        fail("--jsonl gives each sample a workspace of its own; --workspace does not apply")
    # The current directory may hold the results: shown to samples only when asked for.
    settings.limits.setdefault("share_cwd", False)
    output = output.absolute()
    try:
        outcome = run_samples(samples, output, settings.settings(), parallel=parallel, timeout=timeout,
                              progress=progress, skip_invalid=skip_invalid, redo=redo, ray_address=ray_address)
    except AgentloopError as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # before the run's own handlers were in place
        click.echo("agentloop: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    print_summary(outcome.tally, output, None, outcome.stopped)
    sys.exit(outcome.exit_code)


def _script(file, args: tuple[str, ...]) -> ScriptRun:
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
    return ScriptRun(path, ["-" if from_stdin else file.name, *args], stdin)


async def _exec(code: str, timeout: float, out: _Sink, err: _Sink, settings: WorkerSettings,
                workspace: Path | None, script: ScriptRun | None = None) -> BlockResult:
    def show(chunk: OutputChunk) -> None:
        (err if chunk.stream == "stderr" else out).write(chunk.data)

    async with Engine(settings, workspace=workspace, pool=0) as engine:  # one worker: no pool
        worker = await engine.start_worker("exec")
        for note in worker.notes:
            err.text(f"agentloop: {note}\n")
        return await worker.run(code, timeout=timeout, block_id="main", on_output=show, script=script)
