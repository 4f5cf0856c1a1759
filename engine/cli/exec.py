"""``agentloop exec``: ``python FILE ARGS`` in a sandbox, or many code samples (``--jsonl``).

A file is run by ``engine.exec`` as ``python FILE ARGS`` itself, in a sandbox planned
by ``engine.exec``: its streams, exit status and signals are python's.  agentloop's
own errors, usage errors included, are one line on stderr and exit status 125, so they never
look like the script's (an argparse error exits 2).  Samples run in slots of a fork server
(``engine.samples``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click

from engine.cli.options import (
    EXIT_INTERRUPTED,
    Duration,
    fail,
    worker_options,
    worker_settings,
    write_options,
)
from engine.durations import DEFAULT_BLOCK_TIMEOUT
from engine.errors import AgentloopError, ConfigError
from engine.inert import inert
from engine.results import OUTPUT_CAP
from engine.secrets import NOT_SECRETS, SECRET_PATTERNS, secret_names
from worker.contract.egress import FORWARDER_PORT, proxy_environment

__all__ = ["SAMPLE_REDO", "exec_cmd"]

log = logging.getLogger("agentloop")

#: What ``--redo`` may name with ``--jsonl``.
SAMPLE_REDO = ("error", "timeout", "oom", "died")

class _ExecCommand(click.Command):
    """Usage errors of ``exec`` are agentloop's own errors: one line, exit status 125."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            hint = f" (see agentloop {ctx.info_name} --help)" if isinstance(exc, click.NoSuchOption) else ""
            fail(exc.format_message() + hint)


@click.command("exec", cls=_ExecCommand, context_settings={"allow_interspersed_args": False})
@click.argument("file", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--timeout", type=Duration(), default=None,
              help="A deadline, as timeout(1) keeps one: SIGTERM to the script, SIGKILL after a 5 s grace, exit "
                   "124.  250ms, 30s, 5m, 1h or plain seconds.  Default: none (with --jsonl: 10s a sample).")
@write_options(write_cwd=True)
@click.option("--env", "env_names", multiple=True, metavar="NAME[=VALUE]",
              help="Pass this variable to the script although it looks like a secret, or set it to VALUE.  "
                   f"Not passed otherwise: names matching {', '.join(SECRET_PATTERNS)} in any case (but "
                   f"{', '.join(NOT_SECRETS)}), the models' API key variables, and any variable whose value holds "
                   "a URL with a password (scheme://user:PW@, :PW@), an http(s) URL with a user part "
                   "(https://TOKEN@host) or a URL with a secret-named query parameter (?password=, ?token=, "
                   "?key=, ?sig=, ...): dropped whole, not passed with the password cut out.  agentloop -v exec "
                   "names what was dropped.  Repeatable.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object on stdout after the run (the script's stdout goes to stderr).")
@click.option("--color", "allow_sgr", is_flag=True,
              help="Let the script's colour and style sequences (ESC [ ... m: colours, bold, dim, italic, "
                   "underline, reverse, strike; not concealed text or blink) through to a terminal.  Without it, "
                   "output bound for a terminal loses every escape sequence and control character but newline, "
                   "tab, carriage return and backspace; output to a pipe or a file is passed unchanged either way.")
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
def exec_cmd(file: str | None, args: tuple[str, ...], timeout: float | None, env_names: tuple[str, ...], as_json: bool, allow_sgr: bool, samples: Path | None, output: Path | None,
             parallel: int | None, redo: tuple[str, ...], skip_invalid: bool, progress: str,
             ray_address: str | None) -> None:
    """Run FILE (or - for stdin) as `python FILE ARGS` runs it, in a sandbox: the same
    sys.argv, streams, exit status and signals.  Options go before FILE; everything after it
    is the script's.

    The script runs as you, with your environment minus what looks like a secret (see
    --env), sees the system, the interpreter, the current directory, its own directory and
    the directories of PATH and PYTHONPATH, and writes as --write-cwd/--read-only say.  Its
    streams are yours: piped or redirected they are passed as they are; a terminal is a
    terminal of its own, whose output is made inert (see --color).  agentloop's own errors
    are one line and exit status 125.  What stood in the directory it writes and other tools
    obey (.git, agentloop.toml, virtual environments) stays read-only, as do set-user-ID files
    when it runs as root; what it creates there that tools obey (a .git, .envrc, .vscode/, a
    virtual environment, ...) is named in one line when it ends.

    With --jsonl SAMPLES -o RESULTS: every sample of SAMPLES runs that way, in a sandbox of its
    own (process, namespaces, /tmp and workspace), and its result (status, exit code, stdout and
    stderr, duration, peak memory) is appended to RESULTS as it ends; resume, Ctrl-C and the
    progress bar are `agentloop batch`'s."""
    if samples is not None:
        if args or env_names or worker_settings().write_cwd is not True:
            fail("--jsonl SAMPLES takes neither FILE nor --env nor --read-only: each sample writes a workspace "
                 "of its own")
        worker_settings().write_cwd = None  # (samples: a workspace each)
        _run_samples(samples, output, file, as_json, timeout if timeout is not None else DEFAULT_BLOCK_TIMEOUT,
                     parallel, redo, skip_invalid, progress, ray_address)
        return
    if file is None:
        fail("exec needs FILE (or - for stdin), or --jsonl SAMPLES -o RESULTS")
    if output is not None or parallel is not None or redo or skip_invalid or ray_address is not None:
        fail("-o, --parallel, --redo, --skip-invalid and --ray go with --jsonl")
    _run_file(file, list(args), timeout, env_names, as_json, allow_sgr)


def _run_file(file: str, args: list[str], timeout: float | None, env_names: tuple[str, ...], as_json: bool,
              allow_sgr: bool) -> None:
    """``exec FILE``: plan, run, and end as the script ended."""
    from engine import trust
    from engine.environment import CALLER, environment
    from engine.exec import (
        ScriptCgroups,
        ScriptGate,
        appeared,
        exit_as,
        inherited_ignored,
        plan_script,
        run_script,
        snapshot,
    )
    from engine.sandbox import choose_python

    ignored = inherited_ignored()  # before any handler of ours
    settings = worker_settings()
    write_cwd = bool(settings.write_cwd)
    if settings.preload:
        fail("--preload is for workers and --jsonl samples: a script imports what it imports")
    if settings.keep_output or settings.max_output != OUTPUT_CAP:
        fail("--keep-output and --max-output are for workers and --jsonl samples: a script's output goes "
             "where you send it")
    policy = settings.policy()
    if policy.mode == "none":
        click.echo("agentloop: warning: --sandbox none runs the script unconfined", err=True)
    cgroups = plan = grant = before = gate = None
    planted: list[str] = []
    network: list[dict] = []
    try:
        from engine.launch import WorkerSettings

        allowlist = WorkerSettings(sandbox=policy, allow_net=settings.allowlist()).allow_net  # (checked as a run's)
        if allowlist:
            gate = ScriptGate(allowlist)
        # (A Python in the workspace model code writes by default is refused, whatever exec writes.)
        python = choose_python(settings.python, workspace=settings.workspace or Path("files"))
        program = [python, _program_file(file), *args]
        keys = _key_variables()
        env = environment(CALLER, passed=env_names, configured=keys,
                          proxies=proxy_environment(FORWARDER_PORT) if gate is not None else None)
        dropped = sorted(secret_names(os.environ, keys) - set(env))
        if dropped:  # (names only, never a value)
            log.info("not passed to the script, as they look like secrets: %s (--env NAME passes one)",
                     inert(", ".join(dropped)))
        cgroups = ScriptCgroups(policy)
        plan = plan_script(policy, python=python, cwd=Path.cwd(), script=None if file == "-" else file,
                           write_cwd=write_cwd, workspace=settings.workspace, environ=env,
                           memory_cgroup=cgroups.memory is not None, pids_cgroup=cgroups.pids,
                           egress=gate.socket if gate is not None else "")
        for note in plan.notes:
            log.info("%s", note)  # (agentloop -v exec ...: the script's stderr is its own)
        if policy.mode != "none":  # (what the script writes is told from the user's own files later)
            grant = trust.open_grant(plan.writable, plan.kept if plan.pid_namespace else ())
        before = snapshot(plan.writable)
        result = run_script(plan, program, env, python=python, timeout=timeout, allow_sgr=allow_sgr,
                            stdout=2 if as_json else 1, ignored=ignored, cgroups=cgroups)
    except AgentloopError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot run the script: {exc.strerror or exc}")
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    finally:
        if before is not None:  # (however the script ended, interrupted too: what it left is there)
            planted = appeared(plan.writable, before)
            if planted:
                click.echo(inert(f"agentloop: the script created {', '.join(planted)} in {plan.writable}, which "
                                 "those tools obey when run there: look at what it holds before you do"), err=True)
        if grant is not None:
            grant.end()
        if gate is not None:
            network = gate.close()
        if cgroups is not None:
            cgroups.close()
        if plan is not None:
            _remove_if_left_empty(plan.made)
    if result.status == "failed":
        fail(result.message)
    if result.message:
        click.echo(inert(f"agentloop: {result.message}"), err=True)
    if as_json:
        click.echo(json.dumps({"status": result.status, "exit_code": result.exit_code, "signal": result.signal,
                               "duration_s": round(result.duration_s, 4), "message": result.message,
                               "created": planted, **({"network": network} if gate is not None else {})}))
    exit_as(result)


def _program_file(file: str) -> str:
    """FILE as python is given it: as the user wrote it, unless a link on its way leads out of
    what the sandbox shows at that path (it then gets the file's real path).  ConfigError
    for a file that cannot be read: nothing could run it."""
    if file == "-":
        return file
    try:
        os.stat(file)
    except OSError as exc:
        raise ConfigError(f"cannot open {file}: {exc.strerror}") from None
    if not os.access(file, os.R_OK):
        raise ConfigError(f"cannot open {file}: permission denied")
    where = os.path.dirname(os.path.abspath(file))
    return file if os.path.realpath(where) == where else os.path.realpath(file)


def _key_variables() -> set[str]:
    """The variables the model configuration names as holding API keys (never a script's)."""
    from engine.models import load_models

    try:
        registry = load_models()
    except AgentloopError:
        return {"LLM_API_KEY"}
    return {"LLM_API_KEY", *(registry.get(alias).api_key_env for alias in registry.aliases())}


def _remove_if_left_empty(made: tuple[str, ...]) -> None:
    """What the sandbox made for the script (``./files`` of ``--read-only``, the ``.tmp`` that
    is its ``$TMPDIR`` without bubblewrap) goes again when the script left it empty."""
    for leftover in made:
        try:
            os.rmdir(leftover)
        except OSError:
            pass


def _run_samples(samples: Path, output: Path | None, file, as_json: bool, timeout: float, parallel: int | None,
                 redo: tuple[str, ...], skip_invalid: bool, progress: str, ray_address: str | None) -> None:
    """``exec --jsonl``: every sample of the file, to the results file (``engine.batch.sample_file``)."""
    from engine.batch.progress import print_summary
    from engine.batch.sample_file import run_samples

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
