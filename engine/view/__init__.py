"""``agentloop view``: what ran, as one self-contained HTML page that needs no network.

A recording (``--record``, or a batch run's ``transcript.jsonl``) becomes a timeline
(``timeline``): one lane per agent, model requests and code blocks as bars on one time axis,
heartbeats as ticks, interrupts and kills marked; selecting a bar shows its code, output and
result.  A results file (``batch -o``, ``exec --jsonl -o``) becomes a report (``report``):
counts by status and failure reason, a histogram of durations, tokens and cost, the slowest
and the failed runs.  For a batch, the report links the runs it lists (the slowest, then the
failed, at most ``TIMELINES``) to their timelines, written beside it in ``NAME.timelines/``
from the transcripts the results name.

Whatever the file's size, ``view`` reads it a line at a time and the page stays within bounds
(``timeline``, ``report``): what was left out or shortened is said at the top of the page and in
``Written.summarised``.

The page draws itself from data embedded as inert JSON (``_page``): nothing a model or a worker
wrote is ever markup.  A file cut short (its writer killed mid-line, or a run stopped before its
end) is shown as far as it goes, with one warning; anything else that is not one of these files
is refused in one line that says what was expected.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.view import report, timeline
from engine.view._page import page
from engine.view._read import BATCH, RECORDING, kind_of, open_lines

#: Timelines a batch report writes for the runs it lists.
TIMELINES = 200


@dataclass
class Written:
    """What ``write`` made: the page, its kind, what it shows, the warning to give (if any), and
    what the page summarised to stay within its bounds (sentences; the page says them too)."""

    path: Path
    kind: str
    summary: str
    warning: str | None = None
    timelines: int = 0
    summarised: tuple[str, ...] = ()


def default_output(source: Path) -> Path:
    """``run.jsonl`` -> ``run.html``, beside it."""
    return source.with_suffix(".html") if source.suffix == ".jsonl" else source.with_name(source.name + ".html")


def _write_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a reader never sees half a page)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def _timeline(source: Path, lines) -> tuple[str, dict, str | None]:
    """A recording's page, its data and its warning."""
    data, warning = timeline.build(lines, source)
    return page(f"agentloop: {source.name}", "timeline", data), data, warning


def write(source: Path, out: Path | None = None) -> Written:
    """Read ``source`` (streamed: its size costs time, not memory), write its page to ``out``
    (default: ``default_output``); ConfigError for a file that is none of those ``view`` reads."""
    out = out or default_output(source)
    lines = open_lines(source)
    if lines.kind == RECORDING:
        text, data, warning = _timeline(source, lines)
        _write_file(out, text)
        totals = data["totals"]
        summary = (f"{totals['agents']} agent{'s' * (totals['agents'] != 1)}, {totals['requests']} model "
                   f"requests, {totals['blocks']} blocks, {totals['duration']:.1f} s")
        return Written(out, "timeline", summary, warning, summarised=tuple(data["summarised"]))
    summed = report.summarise(lines, lines.kind, TIMELINES if lines.kind == BATCH else 0)
    links, written = _timelines(summed.listed(), out) if lines.kind == BATCH else ({}, 0)
    data = summed.data(source, links)
    warning = None
    if lines.cut_line is not None:
        warning = f"line {lines.cut_line} was cut short (its writer stopped mid-line): it is left out"
    data["warning"] = warning
    _write_file(out, page(f"agentloop: {source.name}", "report", data))
    return Written(out, "report", f"{data['runs']} runs", warning, written, tuple(data["summarised"]))


def _timelines(listed: list[dict], out: Path) -> tuple[dict[str, str], int]:
    """Write the timelines of the runs a batch report lists; run id -> link relative to ``out``."""
    folder = out.with_name(out.stem + ".timelines")
    links: dict[str, str] = {}
    from engine.batch.run import run_slug

    for record in listed:
        transcript = record.get("transcript")
        # Only a file called transcript.jsonl that reads as a recording: a results file names it,
        # and a results file is only as trustworthy as whoever wrote it.
        if not isinstance(transcript, str) or Path(transcript).name != "transcript.jsonl":
            continue
        path = Path(transcript)
        if not path.is_absolute():
            path = out.parent / path
        try:
            lines = open_lines(path) if path.is_file() else None
            if lines is None or lines.kind != RECORDING:
                continue
            text, _, _ = _timeline(path, lines)
            name = f"{run_slug(str(record.get('id')))}.html"
            _write_file(folder / name, text)
        except Exception:  # noqa: BLE001 - one unreadable transcript costs its link, not the report
            continue
        links[str(record.get("id"))] = f"{folder.name}/{name}"
    return links, len(links)


__all__ = ["TIMELINES", "Written", "default_output", "kind_of", "write"]
