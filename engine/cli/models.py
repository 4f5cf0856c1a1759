"""``agentloop models``: the model aliases, with what their servers report."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from engine.cli.options import load_registry
from engine.inert import inert

__all__ = ["models_cmd"]


@click.command("models")
@click.option("--models", "models_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Model aliases file (default ./agentloop.toml).")
def models_cmd(models_file) -> None:
    """List the model aliases agents can use, with what their servers report (context size,
    tool support); a server that does not answer within a few seconds is listed as configured.
    A server on this machine that another user runs is not asked (nothing is sent to it): the
    line below its alias says whose it is."""
    from dataclasses import replace

    from engine.models import probe, which_wins

    registry = load_registry(models_file)
    if wins := which_wins(registry, models_file):
        click.echo(inert(f"note: {wins}"))

    async def ask_all():
        return await asyncio.gather(*(probe(config) for config in registry))

    for config, server in zip(registry, asyncio.run(ask_all()), strict=True):
        mark = "*" if config is registry.default else " "
        shown, source = config, ""
        if not config.context_window and server.context_window:
            shown, source = replace(config, context_window=server.context_window), "from the server"
        notes = [config.shown_url, f"protocol {config.protocol}", f"max_tokens {config.max_tokens}"]
        if server.supports_tools is False:
            notes.append("no tools: tools falls back to tags")
        if (config.vision if config.vision is not None else server.vision):
            notes.append("takes images")
        click.echo(inert(f"{mark} {shown.describe(context_from=source).removeprefix('- ')}  [{', '.join(notes)}]"))
        if server.foreign:  # not asked: its server is another user's (nothing was sent)
            click.echo(inert(f"  not used: {server.foreign}"))
