"""``agentloop doctor``: the sandbox layers here, a real worker start, the model endpoint."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from engine.cli.options import fail, load_registry, worker_options, worker_settings
from engine.errors import AgentloopError, UntrustedPython
from engine.inert import inert
from engine.launch import report
from engine.sandbox import probe as probe_python
from engine.sandbox import which_python
from engine.workers import Engine

__all__ = ["doctor_cmd"]


@click.command("doctor")
@click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--model", default=None, help="Model alias whose endpoint to check.")
@click.option("--serve", "serve_url", metavar="URL", default=None,
              help="Check a running `agentloop serve` instead, at the URL it printed "
                   "(http://HOST:PORT/TOKEN/): it answers, takes the token and runs a sample.")
@worker_options
def doctor_cmd(models_file, model, serve_url) -> None:
    """Which sandbox layers are available and active here, whether a sandboxed worker really
    starts, and whether the model endpoint answers (or, with --serve URL, whether a running
    `agentloop serve` runs code).  Exit 1 when something does not work."""
    if serve_url is not None:
        sys.exit(0 if asyncio.run(_check_service(serve_url)) else 1)
    options = worker_settings()
    try:  # (the file and the interpreter checked as every command checks them)
        python, chosen_by = which_python(options.python, workspace=options.workspace or Path("files"))
        refused = None
    except UntrustedPython as exc:  # said below, in its place; nothing runs it
        python = chosen_by = None
        refused = str(exc)
    except AgentloopError as exc:
        fail(str(exc))
    policy = options.policy()
    healthy = True
    try:
        layers = report(policy)
    except AgentloopError as exc:
        fail(str(exc))
    click.echo("sandbox layers (available / active here):")
    for layer in layers:
        mark = "✓" if layer.active else ("·" if layer.available else "✗")
        click.echo(f"  {mark} {layer.name:<34} {'yes' if layer.available else 'no ':>3} / "
                   f"{'yes' if layer.active else 'no ':>3}  {layer.reason}")

    async def try_worker():
        async with Engine(options.settings(), workspace=options.workspace, pool=0) as engine:
            worker = await engine.start_worker("doctor")
            result = await worker.run("import os; print(os.getuid(), os.getpid())", timeout=20)
            return worker.notes, result

    if refused is not None:
        click.echo("worker: not started: its Python is not used (below)")
        click.echo(inert(f"workers' python: {refused}"))
        healthy = False
    else:
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
        if started:
            fine, words = asyncio.run(_allowlisting(options.settings()))
            click.echo(inert(f"network by name (--allow-net): {words}"))
            healthy &= fine
        try:
            version = f" (Python {probe_python(python).version})"  # (checked: a TrustedPython)
        except AgentloopError:
            version = ""
        click.echo(inert(f"workers' python: {python}{version}, chosen by {chosen_by}"))
    registry = load_registry(models_file)
    try:
        config = registry.get(model)
    except AgentloopError as exc:
        fail(str(exc))
    from engine.models import probe, which_wins

    if wins := which_wins(registry, models_file):
        click.echo(inert(f"models: {wins}"))
    server = asyncio.run(probe(config))
    if server.models_status is None:
        answers = False
        click.echo(inert(f"model endpoint: {server.silence(config.base_url)}"))
    elif server.models_status in (401, 403):
        answers = False
        held = "is set" if config.api_key() else "is not set"
        click.echo(inert(f"model endpoint {config.shown_url}: refuses the key (HTTP {server.models_status}). "
                         f"Check ${config.api_key_env} ({held}): it must hold a key this server accepts, and "
                         f"api_key_env of the alias {config.alias!r} in agentloop.toml must name that variable."))
    else:
        answers = server.models_status < 500
        click.echo(inert(f"model endpoint {config.shown_url}: answers (HTTP {server.models_status})"))
        for fine, line in _endpoint_lines(config, server):
            click.echo(inert(f"  {'✓' if fine else '✗'} {line}"))
            answers &= fine
    healthy &= answers
    sys.exit(0 if healthy else 1)


#: What the doctor's worker runs to reach the doctor's listener through its forwarder (a plain
#: proxy request by hand: NO_PROXY rightly sends 127.0.0.1 past the proxy in every client).
_THROUGH = """
import os, socket
proxy = os.environ["HTTP_PROXY"].rsplit(":", 1)[1]
with socket.create_connection(("127.0.0.1", int(proxy)), timeout=10) as s:
    s.sendall(b"GET http://127.0.0.1:%d/ HTTP/1.1\\r\\nHost: 127.0.0.1:%d\\r\\n\\r\\n")
    said = b""
    while chunk := s.recv(65536):
        said += chunk
print(said.decode("latin-1").rsplit("\\n", 1)[-1])
"""


async def _allowlisting(settings) -> tuple[bool, str]:
    """Whether ``--allow-net`` works here: a worker whose allowlist names a listener on the
    host's loopback reaches it through its gate and forwarder.  (fine, words)."""
    if settings.sandbox.network:
        return True, "not tried: --network gives workers the host's network"
    if settings.sandbox.mode in ("none", "landlock"):
        return True, f"not offered under --sandbox {settings.sandbox.mode} (it needs bubblewrap)"
    answered = []

    async def answer(reader, writer):
        answered.append(True)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\nreached")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with Engine(settings.replace(allow_net=[f"127.0.0.1:{port}"]), pool=0) as engine:
            worker = await engine.start_worker("doctor-net")
            result = await worker.run(_THROUGH % (port, port), timeout=20)
    except AgentloopError as exc:
        return False, f"does not work: {exc}"
    finally:
        listener.close()
    if result.ok and result.output.strip() == "reached" and answered:
        return True, "works (a worker reached a listed listener through its proxy)"
    return False, f"does not work: {result.text().strip()[-300:]}"


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
    if config.vision is not None:
        lines.append((True, f"images: {'taken' if config.vision else 'not sent'} (vision in agentloop.toml)"))
    elif server.vision is not None:
        lines.append((True, f"images: {'taken' if server.vision else 'not sent: the model takes none'} "
                            f"({server.vision_source})"))
    else:
        lines.append((True, "images: not sent (the server does not say whether the model takes them; "
                            "vision = true in agentloop.toml sends them)"))
    lines.append((True, f"reply cap: max_tokens {config.max_tokens}"))
    return lines


async def _check_service(url: str) -> bool:
    """``doctor --serve URL``: ping, then one sample through ``/run_code``; a line for each.
    The token in the URL goes only to that server, and never to another user's on this machine
    (``engine.models.checked_client``); it is never printed."""
    from urllib.parse import urlsplit

    import httpx

    from engine.errors import ForeignServer
    from engine.models import checked_client

    base = url.removesuffix("run_code").removesuffix("/") + "/"
    parts = urlsplit(base)
    shown = f"{parts.scheme}://{parts.netloc}/" + ("TOKEN/" if parts.path.strip("/") else "")
    try:
        async with checked_client(timeout=60) as client:
            ping = await client.get(base + "v1/ping")
            if ping.status_code in (401, 403):
                click.echo(inert(f"serve {shown}: refuses the token (HTTP {ping.status_code}): give the URL it "
                                 "printed, http://HOST:PORT/TOKEN/"))
                return False
            if ping.status_code != 200 or ping.text.strip() != '"pong"':
                click.echo(inert(f"serve {shown}: not agentloop serve (GET /v1/ping: HTTP {ping.status_code})"))
                return False
            click.echo(inert(f"serve {shown}: answers, and takes the token"))
            ran = await client.post(base + "run_code", json={"code": "print(6 * 7)", "language": "python"})
            answer = ran.json() if ran.status_code == 200 else {}
    except ForeignServer as exc:
        click.echo(inert(f"serve {shown}: not asked: {exc}"))
        return False
    except (httpx.HTTPError, ValueError) as exc:
        click.echo(inert(f"serve {shown}: does not answer: {type(exc).__name__}: {exc}"[:300]))
        return False
    answer = answer if isinstance(answer, dict) else {}
    run = answer.get("run_result") if isinstance(answer.get("run_result"), dict) else {}
    if answer.get("status") == "Success" and run.get("stdout") == "42\n":
        click.echo(inert(f"  ✓ runs a sample: {run.get('execution_time')} s"))
        return True
    click.echo(inert(f"  ✗ a sample did not run: HTTP {ran.status_code}, {str(answer)[:300]}"))
    return False
