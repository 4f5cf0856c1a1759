"""``agentloop view FILE``: a recording as a timeline, a results file as a report, one HTML file."""

from __future__ import annotations

import os
import sys
import webbrowser
from pathlib import Path

import click

from engine.cli.options import fail
from engine.errors import AgentloopError
from engine.inert import inert

__all__ = ["view_cmd"]


def _at_a_desktop() -> bool:
    """Whether opening a browser can show the page to someone: a terminal, and a display."""
    return sys.stdout.isatty() and (sys.platform == "darwin" or bool(os.environ.get("DISPLAY"))
                                    or bool(os.environ.get("WAYLAND_DISPLAY")))


@click.command("view")
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The HTML file to write (default: FILE with .html for .jsonl).")
@click.option("--open/--no-open", "open_it", default=None,
              help="Open the page in a browser (default: when at a desktop).")
def view_cmd(file: Path, output: Path | None, open_it: bool | None) -> None:
    """Write FILE as one self-contained HTML page (no network needed) and print its path.

    A --record file (or a batch run's transcript.jsonl) becomes a timeline: a lane per agent,
    model requests and code blocks as bars on one time axis, heartbeats, interrupts and kills
    marked; click a bar for its code, output and result.  A results file of batch or exec
    --jsonl becomes a report: counts by status and failure reason, durations, tokens and cost,
    the slowest and failed runs (a batch's linked to their timelines, written beside the
    report).  A file cut short is shown as far as it goes, with a warning.  A file of any size
    is read a line at a time: the page keeps at most 10,000 bars and 500 lanes, 12 million
    characters of text (then 200 a text), the first 2,000 failed runs of a report, and leaves
    out lines over 16 MiB; what it summarised is said at its top and on stderr."""
    from engine import view

    try:
        written = view.write(file, output)
    except AgentloopError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write the page: {exc.strerror or exc}")
    if written.warning:
        click.echo(inert(f"agentloop: warning: {file}: {written.warning}"), err=True)
    if written.summarised:
        click.echo(inert(f"agentloop: note: {file} is large: the page summarises it ({'; '.join(written.summarised)})"),
                   err=True)
    more = f", {written.timelines} run timelines in {written.path.stem}.timelines/" if written.timelines else ""
    click.echo(inert(f"agentloop: {written.kind} of {written.summary}{more}"), err=True)
    click.echo(inert(str(written.path)))
    if open_it or (open_it is None and _at_a_desktop()):
        webbrowser.open(written.path.resolve().as_uri())
