"""``agentloop serve --http HOST:PORT``: SandboxFusion's ``/run_code`` for RL trainers' reward
code, each request a code sample in a sandbox of its own (``engine.integrations.run_code_server``).

The HTTP server needs Starlette and uvicorn (the ``serve`` extra, also in ``mcp``'s): without
them the command says how to install them, and the rest of the command line keeps working.
"""

from __future__ import annotations

from pathlib import Path

import click

from engine.cli.options import Duration, Size, fail, served_options, worker_options, worker_settings
from engine.errors import AgentloopError

__all__ = ["serve"]


@click.command("serve")
@click.option("--http", "http", metavar="HOST:PORT", required=True,
              help="Where to listen (port 0 picks a free one): http://HOST:PORT/TOKEN/run_code, the URL "
                   "printed on stderr.  Only requests that carry the server's token get in, in the URL's path "
                   "as printed or as 'Authorization: Bearer TOKEN'; it is kept in "
                   "~/.local/state/agentloop/server-token (made on first use, mode 0600).")
@served_options()
@click.option("--parallel", type=click.IntRange(1, 256), default=None,
              help="Samples run at once, all requests together (default: min(2 x CPUs, available GiB of "
                   "memory)).")
@click.option("--queue", type=click.IntRange(0, 1 << 20), default=1024, show_default=True,
              help="Samples that may wait for a free slot beyond those; a request that would take more is "
                   "answered 429 at once, with Retry-After.  Waiting requests are answered once they ran.")
@click.option("--timeout", "max_timeout", type=Duration(), default="60s", show_default=True,
              help="The longest run_timeout a request may have; a longer one is lowered to it, and the "
                   "response's message says so.")
@click.option("--max-body", type=Size(), default="32M", show_default=True,
              help="The largest request body (code, stdin and base64 files); a larger one is answered 413.")
@click.option("--max-batch", type=click.IntRange(1, 1 << 16), default=1024, show_default=True,
              help="The most requests one POST /run_batch may hold.")
@worker_options
def serve(http: str, token_file: Path | None, allowed_hosts: tuple[str, ...], parallel: int | None, queue: int,
          max_timeout: float, max_body: int, max_batch: int) -> None:
    """Serve SandboxFusion's code-running API to RL trainers and their reward code.

    POST /run_code takes SandboxFusion's RunCodeRequest (code, language: python, stdin,
    run_timeout, memory_limit_MB, files as base64 by name, fetch_files) and answers its
    RunCodeResponse (status Success/Failed/SandboxError, run_result with status
    Finished/TimeLimitExceeded/Error, execution_time, return_code, stdout, stderr, files).  Each
    request runs as a sample of `agentloop exec --jsonl` does: in a sandbox of its own, killed
    after, under the worker options' limits (--memory is the most a request may ask).  POST
    /run_batch takes a JSON array of requests and answers the array of responses, in order.
    SIGTERM stops taking connections, answers every request already read, then exits 0."""
    try:
        from engine.integrations import http_gate, run_code_api, run_code_server
    except ImportError as exc:
        from engine.extras import install_hint

        fail(f"serve needs Starlette and uvicorn ({exc}): {install_hint('serve')}")
    from engine.batch.capacity import default_parallel

    try:
        host, port = http_gate.parse_address(http)
    except ValueError as exc:
        fail(f"--http: {exc}")
    try:
        token = http_gate.ServerToken.load(token_file)
    except (AgentloopError, OSError) as exc:
        fail(f"--http: {exc}")
    if (warning := http_gate.exposure_warning(host, port)) is not None:
        click.echo(f"agentloop: warning: {warning}", err=True)
    options = worker_settings()
    if options.workspace is not None:
        fail("serve gives each sample a workspace of its own; --workspace does not apply")
    options.limits.setdefault("share_cwd", False)  # (what the server's directory holds is not the samples')
    settings = options.settings()
    config = run_code_server.ServeConfig(
        settings=settings, limits=run_code_api.RequestLimits(max_timeout, settings.sandbox.memory_bytes),
        parallel=parallel or default_parallel(), queue=queue, max_body=max_body, max_batch=max_batch,
        cwd=Path.cwd())

    def announce(url: str) -> None:
        click.echo(f"agentloop: serving SandboxFusion's /run_code at {url} ({url}run_code) only to requests "
                   f"that carry its token (in the URL's path as here, or as 'Authorization: Bearer TOKEN'), "
                   f"kept in {token.path}; {config.parallel} samples at once, {config.queue} waiting", err=True)

    try:
        run_code_server.run(config, host, port, announce, token, tuple(allowed_hosts))
    except AgentloopError as exc:
        fail(str(exc))
