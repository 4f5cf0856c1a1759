"""``agentloop batch``: the command (the batch itself is ``engine.batch``'s)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from engine.batch import RunSettings, print_summary, run_batch
from engine.cli.options import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    Duration,
    Size,
    apply_max_tokens,
    fail,
    max_tokens_option,
    worker_options,
    worker_settings,
)
from engine.errors import AgentloopError, ModelUnreachable
from engine.inert import inert
from engine.models import load_models, unsent_key_note

__all__ = ["batch"]


@click.command("batch")
@click.argument("tasks_file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Results JSONL: one record per finished run, appended as runs end; rerun to resume.")
@click.option("--parallel", type=click.IntRange(1), default=None,
              help="Runs at once.  Default: min(2 x CPUs, available GiB of memory), 1 to 64.")
@click.option("--retries", type=click.IntRange(0), default=0, show_default=True,
              help="More attempts for runs that failed for infrastructure reasons (endpoint down, "
                   "worker start); never for the model's own failures.")
@click.option("--retry-backoff", type=Duration(), default="2s", show_default=True,
              help="Wait before the first retry; doubles for each further one (at most 60s).")
@click.option("--timeout", type=Duration(), default="1h", show_default=True,
              help="Wall-clock cap of each attempt of a run (a task's own `timeout` wins).")
@click.option("--skip-invalid", is_flag=True, help="Report invalid task lines and go on without them.")
@click.option("--redo", multiple=True, type=click.Choice(["failed", "timed_out"]),
              help="Also run again the ids recorded with this status (cancelled ones, and those that "
                   "failed for infrastructure reasons, always are).  Repeatable.")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where each run's workspace and transcript go (default: OUTPUT's stem + .runs).")
@click.option("--max-workers-per-run", type=click.IntRange(1), default=16, show_default=True,
              help="Worker processes one run may hold (its agent and sub-agents).")
@click.option("--progress", type=click.Choice(["auto", "bar", "lines", "none"]), default="auto",
              show_default=True, help="A live bar (auto: when stderr is a terminal) or one line per run.")
@click.option("--ray", "ray_address", metavar="ADDRESS", default=None,
              help="Run on a Ray cluster (needs the ray extra): its GCS host:port, 'auto', or "
                   "ray://host:10001.  Nodes offer the agent_slot resource (runs per node).  If the cluster "
                   "uses token authentication (Ray 2.60's default), set RAY_AUTH_MODE=token and "
                   "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH).")
@click.option("--model", default=None, help="Model alias for tasks that name none.")
@click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Model aliases file (default ./agentloop.toml, else LLM_URL/LLM_MODEL).")
@click.option("--max-messages", type=click.IntRange(1), default=200, show_default=True,
              help="Messages to the model before a run gives up (a task's own value wins).")
@max_tokens_option
@click.option("--protocol", type=click.Choice(["tags", "tools"]), default=None,
              help="How the model acts: <run_code> tags or native tool calls (default: per model alias).")
@click.option("--tools", type=click.Choice(["none", "repo"]), default="none", show_default=True,
              help="Host functions to offer: repo = list_dir, read_file, search (read-only).")
@click.option("--root", type=click.Path(file_okay=False, exists=True, path_type=Path), default=".",
              help="Directory the repo tools may read (default: current directory).")
@click.option("--max-batch-output", type=Size(), default="4G", show_default=True,
              help="What the files of block outputs too large for memory may hold in all, for every run "
                   "of the batch together (on each machine); --max-output caps each run's.")
@worker_options
def batch(tasks_file: Path, output: Path, parallel: int | None, retries: int, retry_backoff: float,
          timeout: float, skip_invalid: bool, redo: tuple[str, ...], runs_dir: Path | None,
          max_workers_per_run: int, progress: str, ray_address: str | None, model: str | None,
          models_file: Path | None, max_messages: int, protocol: str | None, tools: str, root: Path,
          max_batch_output: int) -> None:
    """Run every task of TASKS_FILE and append one result line per finished run to OUTPUT.

    TASKS_FILE is JSONL, one task a line: id, task; optional model, max_messages, timeout,
    files.  Each result line is fsynced as its run ends; run the same command again to resume
    (ids already in OUTPUT are skipped; cancelled ones, and those that failed for
    infrastructure reasons, run again).  A model endpoint that does not answer stops the batch
    before its first run.  Ctrl-C cancels the running runs and exits 130; a second Ctrl-C
    leaves at once.  Exit 0 when the batch ran to its end, 1 when the endpoint did not answer
    or the infrastructure kept failing, 125 for bad input."""
    try:
        registry = apply_max_tokens(load_models(models_file))
        registry.get(model)
    except AgentloopError as exc:
        fail(str(exc))
    if note := unsent_key_note(registry):
        click.echo(inert(f"agentloop: note: {note}"), err=True)
    workers = worker_settings()
    if workers.workspace is not None:
        fail("batch gives each run a workspace of its own (under --runs-dir); --workspace does not apply")
    output = output.absolute()
    runs_dir = (runs_dir or output.with_name(output.stem + ".runs")).absolute()
    settings = RunSettings(
        models=registry, runs_dir=runs_dir, exclude=(runs_dir, output),
        model=model, protocol=protocol, max_messages=max_messages, timeout=timeout, tools=tools,
        root=str(root.resolve()), worker=workers.settings(), retries=retries,
        retry_backoff=retry_backoff, max_workers=max_workers_per_run, max_batch_output=max_batch_output)
    try:
        outcome = run_batch(tasks_file, output, settings, parallel=parallel, progress=progress,
                            skip_invalid=skip_invalid, redo=redo, ray_address=ray_address)
    except ModelUnreachable as exc:  # checked before the first run: the infrastructure, not the input
        click.echo(inert(f"agentloop: {exc}"), err=True)
        sys.exit(EXIT_ERROR)
    except AgentloopError as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # before the batch's own handlers were in place
        click.echo("agentloop: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    print_summary(outcome.tally, output, settings.runs_dir, outcome.stopped)
    if outcome.stopped and outcome.stopped != "interrupted":
        click.echo(inert(f"agentloop: stopped early: {outcome.stopped}"), err=True)
    sys.exit(outcome.exit_code)
