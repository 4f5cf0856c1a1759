"""Progress: the tally of results, the live bar or lines, and the summary (all inert)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from engine.agent import AgentDisplay
from engine.batch.results_file import STATUSES
from engine.inert import inert

__all__ = ["BarView", "LinesView", "Meter", "QuietView", "Tally", "box_table", "make_view", "print_summary", "short"]


class Meter(AgentDisplay):
    """Tokens and cost of one running run, from its agents' ``replied`` events."""

    def __init__(self) -> None:
        self.by_agent: dict[str, dict] = {}

    def event(self, type: str, **fields: Any) -> None:
        if type == "replied" and isinstance(fields.get("stats"), dict):
            self.by_agent[str(fields.get("name"))] = fields["stats"]

    def totals(self) -> tuple[int, int, float]:
        stats = self.by_agent.values()
        return (sum(s.get("tokens_in", 0) for s in stats), sum(s.get("tokens_out", 0) for s in stats),
                sum(s.get("cost", 0.0) for s in stats))


class Tally:
    """Counts of the batch so far: what finished (by status), what runs, tokens and cost.
    ``kind``: ``runs`` (agent runs, ``STATUSES``) or ``samples`` (code samples, ``statuses``)."""

    def __init__(self, total: int, before: int, *, kind: str = "runs",
                 statuses: tuple[str, ...] = STATUSES) -> None:
        self.total = total
        self.before = before  # finished by an earlier invocation
        self.kind = kind
        self.statuses = statuses
        self.counts: Counter[str] = Counter()
        self.infrastructure = 0
        self.tokens_in = self.tokens_out = 0
        self.cost = 0.0
        self.running: dict[str, Meter | None] = {}
        self.started = time.monotonic()
        self.consecutive_infra = 0

    @property
    def finished(self) -> int:
        """Runs (samples) done in this invocation: cancelled ones are not, they run again."""
        return sum(n for status, n in self.counts.items() if status != "cancelled")

    @property
    def not_run(self) -> int:
        """Of the total, what is neither done (before or now) nor cancelled."""
        return self.total - self.before - self.finished - self.counts["cancelled"]

    def start(self, key: str, meter: Meter | None = None) -> None:
        self.running[key] = meter

    def finish(self, key: str, record: dict) -> None:
        self.running.pop(key, None)
        self.counts[record["status"]] += 1
        tokens = record.get("tokens") or {}
        self.tokens_in += tokens.get("in", 0)
        self.tokens_out += tokens.get("out", 0)
        self.cost += record.get("cost", 0.0)
        if record.get("infrastructure"):
            self.infrastructure += 1
            self.consecutive_infra += 1
        elif record["status"] != "cancelled":
            self.consecutive_infra = 0

    def usage(self) -> tuple[int, int, float]:
        """Tokens in, out and cost: finished runs plus what running ones have used so far."""
        tin, tout, cost = self.tokens_in, self.tokens_out, self.cost
        for meter in self.running.values():
            if meter is not None:
                a, b, c = meter.totals()
                tin, tout, cost = tin + a, tout + b, cost + c
        return tin, tout, cost

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def rate(self) -> float:
        """Runs finished per minute in this invocation."""
        elapsed = self.elapsed()
        return self.finished / elapsed * 60 if elapsed > 0 else 0.0

    def eta(self) -> float | None:
        left = self.not_run
        if not self.finished:
            return None
        return left * self.elapsed() / self.finished


def short(text: str, limit: int = 120) -> str:
    """``text`` on one line, inert, at most ``limit`` characters."""
    text = " ".join(inert(str(text)).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


class LinesView:
    """One plain line per finished run, for logs: ``[12/100] id=t7 answered 3.2s``."""

    def __init__(self, tally: Tally, stream: Any = None) -> None:
        self.tally = tally
        self.stream = stream or sys.stderr

    def start(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def finished(self, record: dict) -> None:
        t = self.tally
        line = (f"[{t.before + t.finished}/{t.total}] id={inert(str(record['id']))} {record['status']} "
                f"{record['duration_s']:.1f}s")
        if record.get("attempts", 1) > 1:
            line += f" after {record['attempts']} attempts"
        why = record.get("error") or record.get("message")
        if record["status"] not in ("answered", "ok") and why:
            line += f": {short(why)}"
        print(line, file=self.stream, flush=True)

    def stop(self) -> None:
        pass


class QuietView(LinesView):
    def finished(self, record: dict) -> None:
        pass


class BarView(LinesView):
    """A rich progress bar on stderr (done/total, ETA) over a line of counts: by status, running,
    rate, tokens and cost so far.  Failures are printed above it as they happen."""

    def __init__(self, tally: Tally, force_terminal: bool = False) -> None:
        super().__init__(tally)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.text import Text

        view = self

        class _Progress(Progress):
            def get_renderables(self):
                yield self.make_tasks_table(self.tasks)
                yield Text.from_markup(view.status)

        self.status = ""
        self.console = Console(stderr=True, force_terminal=force_terminal or None)
        self.progress = _Progress(TextColumn(f"[bold]{'batch' if tally.kind == 'runs' else 'samples'}"), BarColumn(bar_width=None), MofNCompleteColumn(),
                                  TextColumn("ETA {task.fields[eta]}"), console=self.console,
                                  refresh_per_second=4, expand=True)
        self.task = self.progress.add_task("batch", total=tally.total, completed=tally.before, eta="-:--")

    def start(self) -> None:
        self.progress.start()
        self.tick()

    def tick(self) -> None:
        t = self.tally
        tin, tout, cost = t.usage()
        if t.kind == "samples":
            per_s = t.finished / t.elapsed() if t.elapsed() > 0 else 0.0
            self.status = (f"[green]ok {t.counts['ok']}[/] · error {t.counts['error']} · "
                           f"timeout {t.counts['timeout']} · [red]killed {t.counts['killed']} · "
                           f"died {t.counts['died']}[/] · running {len(t.running)} · {per_s:.1f} samples/s")
            self.progress.update(self.task, completed=t.before + t.finished, eta=_clock(t.eta()))
            return
        self.status = (f"[green]answered {t.counts['answered']}[/] · [red]failed {t.counts['failed']}[/] · "
                       f"timed out {t.counts['timed_out']} · running {len(t.running)} · "
                       f"{t.rate():.1f} runs/min · {_tokens(tin)}/{_tokens(tout)} tokens in/out · ${cost:.4f}")
        self.progress.update(self.task, completed=t.before + t.finished, eta=_clock(t.eta()))

    def finished(self, record: dict) -> None:
        if record["status"] not in ("answered", "cancelled", "ok", "error"):
            why = record.get("error") or record.get("message")
            error = f": {short(why, 100)}" if why else ""
            self.progress.console.print(f"id={inert(str(record['id']))} {record['status']}{error}", markup=False,
                                        highlight=False)
        self.tick()

    def stop(self) -> None:
        self.tick()
        self.progress.stop()


def make_view(mode: str, tally: Tally) -> LinesView:
    """``auto``: a bar when stderr is a terminal, else lines; ``bar``, ``lines``, ``none``."""
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "lines"
    if mode == "bar":
        return BarView(tally, force_terminal=True)
    return QuietView(tally) if mode == "none" else LinesView(tally)


def print_summary(tally: Tally, results: Path, runs_dir: Path | None, stopped: str | None) -> None:
    """The closing table on stderr: runs (or samples) by status, tokens, cost, wall time, rate."""
    tin, tout, cost = tally.usage()
    rows = []
    for status in tally.statuses:
        value = str(tally.counts[status])
        if status == "failed" and tally.infrastructure:
            value += f" ({tally.infrastructure} infrastructure: a rerun runs them again)"
        rows.append((status.replace("_", " "), value))
    rows.append(("done before", str(tally.before)))
    if tally.not_run:
        rows.append(("not run", str(tally.not_run)))
    if tally.kind == "runs":
        rows += [("tokens in / out", f"{tin:,} / {tout:,}"), ("cost", f"${cost:.4f}")]
    rows.append(("wall time", _clock(tally.elapsed())))
    if tally.kind == "runs":
        rows.append(("runs / minute", f"{tally.rate():.1f}"))
    else:
        rows.append(("samples / second", f"{tally.rate() / 60:.1f}"))
    rows.append(("results", inert(str(results))))
    if runs_dir is not None:
        rows.append(("runs", inert(str(runs_dir))))
    if stopped:
        rows.append(("stopped", inert(stopped)))
    title = "batch summary" if tally.kind == "runs" else "samples summary"
    sys.stderr.write(box_table(title, rows))
    sys.stderr.flush()


def box_table(title: str, rows: list[tuple[str, str]]) -> str:
    """Two columns in a box, labels left and values right, the title above, as plain text.

    Drawn here rather than by rich: the table is printed once as a command ends, and importing
    rich to draw it cost ``exec --jsonl`` a tenth of its start.  No style either: nothing but
    printable text reaches the terminal.  Cells are never wrapped (a path stays one line, to
    copy), and must be inert already."""
    left = max(len(label) for label, _ in rows)
    right = max(len(value) for _, value in rows)
    lines = [title.ljust(left + right + 7), f"┌{'─' * (left + 2)}┬{'─' * (right + 2)}┐"]
    lines += [f"│ {label.ljust(left)} │ {value.rjust(right)} │" for label, value in rows]
    lines.append(f"└{'─' * (left + 2)}┴{'─' * (right + 2)}┘")
    return "\n".join(lines) + "\n"
