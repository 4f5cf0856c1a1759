"""``agentloop scripted``: the scripted model server, to try every command without a model.

It serves ``engine.scripted.ScriptedServer`` from a JSON script (by default the example in
``engine/examples/scripted-model.json``, which knows the README's tour) on 127.0.0.1, as an
OpenAI-compatible endpoint that ``LLM_URL`` can point at.  stdout holds the server's base URL
and nothing else, so ``export LLM_URL=$(agentloop scripted --background)`` works; the words
for a person go to stderr.  It lists, as its one model, the id agentloop asks for by default
(``LLM_MODEL``, else ``qwen3-coder``), so ``doctor`` finds it served; it answers any id.

``--background`` returns once the port listens (no race with the next command): the server
goes on in a process of its own, in a session of its own with its standard streams on
``/dev/null``, until ``kill PID`` or ``--idle-exit`` (30 minutes by default) without a request,
so a forgotten one does not stay for good.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from engine.cli.options import Duration, fail
from engine.models import DEFAULT_MODEL_ID
from engine.scripted import Script, ScriptedServer

__all__ = ["BACKGROUND_IDLE", "EXAMPLE", "scripted"]

#: The script served when none is named: the README's tour.
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "scripted-model.json"
#: Seconds a server started with --background waits for a request before it stops.
BACKGROUND_IDLE = 30 * 60.0


@click.command("scripted")
@click.argument("script", required=False, type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Port to listen on; 0 picks a free one.  Default: 8080 (where agentloop looks when "
                   "LLM_URL is unset), or a free one with --background.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--background", is_flag=True,
              help="Serve from a process of its own and return once it listens; stdout is its URL.")
@click.option("--idle-exit", type=Duration(), default=None,
              help="Stop after this long without a request (default: 30m with --background, else never).")
def scripted(script: Path | None, port: int | None, host: str, background: bool, idle_exit: float | None) -> None:
    """Serve a scripted OpenAI-compatible model: replies come from SCRIPT, no LLM involved.

    SCRIPT is JSON: {"a piece of the task": [turn, ...], "*": [...]}.  A request belongs to the
    conversation whose key its first user message contains (else "*"), and gets its next turn
    (the first for a request with no reply of the model's in it yet): a string (the reply), or
    {"content": ..., "tool_calls": [{"name": ..., "arguments": {...}}]}.  Default:
    engine/examples/scripted-model.json, the README's tour.

    Point a command at it with LLM_URL=http://HOST:PORT/v1, or in one line:
    export LLM_URL=$(agentloop scripted --background)."""
    path = script or EXAMPLE
    try:
        loaded = Script.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        fail(f"cannot load the script {path}: {exc}")
    if port is None:
        port = 0 if background else 8080
    server = ScriptedServer(loaded, host=host, port=port, model_id=os.environ.get("LLM_MODEL") or DEFAULT_MODEL_ID)
    try:
        server.bind()
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
             + ("; choose another --port (0 picks a free one)" if port else ""))
    if background:
        idle = BACKGROUND_IDLE if idle_exit is None else idle_exit
        pid = _serve_in_background(server, idle)
        click.echo(server.url)
        click.echo(f"agentloop: scripted model at {server.url} (pid {pid}), replying from {path}; it stops "
                   f"after {idle / 60:g} min without a request, or with: kill {pid}", err=True)
        return
    click.echo(server.url)
    click.echo(f"agentloop: scripted model at {server.url}, replying from {path}; point agentloop at it "
               f"with LLM_URL={server.url}; Ctrl-C stops it", err=True)
    server.start()
    try:
        server.wait_idle(idle_exit)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        pass
    finally:
        server.close()


def _serve_in_background(server: ScriptedServer, idle: float) -> int:
    """Fork a child that serves ``server`` (already listening) until ``idle`` seconds pass
    without a request or it is killed; returns its pid.  The child is in a session of its own
    with its standard streams on /dev/null: it holds no terminal and no pipe of the caller's
    (a shell's ``$(...)`` would otherwise wait for it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        server.start()
        server.wait_idle(idle)
    except BaseException:  # noqa: BLE001 - SIGTERM (as KeyboardInterrupt) or anything: stop serving
        pass
    finally:
        server.close()
        os._exit(0)  # never returns: the caller's cleanups are the parent's
