"""A batch's report: a results file summed up for the page, whatever its size.

The sums are made here, so the page carries numbers, not ten thousand records: counts by
status and by failure reason, a histogram of durations (by status), tokens and cost, the
slowest runs, and the failed ones (every one, as rows the page shows a page at a time).  A
failure reason is the run's error (for samples, its message) with numbers and quoted parts
replaced, so that "no answer within 3600 s" from a thousand runs is one reason, not a
thousand; a sample without a message gives the last line of its stderr (the exception of a
traceback), else its exit code.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from engine.view._read import BATCH, BATCH_STATUSES, SAMPLE_STATUSES

#: Slowest runs listed; failed runs carried (the rest are counted).
SLOWEST, MAX_FAILED = 20, 20_000
#: Characters of an error, an answer or an output kept for one row.
ROW_CHARS = 600
BINS = 40
_FAILED = {BATCH: ("failed", "timed_out"), "samples": ("error", "timeout", "killed", "died")}
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def reason(text: Any, status: str) -> str:
    """The failure reason of a run: its words with numbers and quoted parts made general."""
    words = text if isinstance(text, str) and text.strip() else status
    words = _NUMBER.sub("N", _QUOTED.sub("'…'", words.strip().splitlines()[0] if words.strip() else status))
    return words[:160]


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) else 0.0


def _cut(value: Any) -> str:
    text = value if isinstance(value, str) else "" if value is None else str(value)
    return text if len(text) <= ROW_CHARS else text[:ROW_CHARS] + "…"


def _sample_words(record: dict[str, Any]) -> str:
    """Why a sample failed: its message, else the last line it wrote to stderr (a traceback's
    exception), else its exit code."""
    if isinstance(record.get("message"), str) and record["message"].strip():
        return record["message"]
    stderr = record.get("stderr") if isinstance(record.get("stderr"), str) else ""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {record.get('exit_code')}"


def histogram(durations: list[tuple[float, str]], statuses: tuple[str, ...]) -> dict[str, Any]:
    """Bins of durations, counted by status: linear up to the slowest run, or logarithmic when
    the slowest took over fifty times the fastest (so a long tail does not squash the rest)."""
    if not durations:
        return {"edges": [], "counts": {}, "log": False}
    low = min(d for d, _ in durations)
    high = max(d for d, _ in durations)
    log = low > 0 and high / low > 50
    if log:
        a, b = math.log10(low), math.log10(high)
        edges = [10 ** (a + (b - a) * i / BINS) for i in range(BINS + 1)]
    else:
        top = high if high > 0 else 1.0
        edges = [top * i / BINS for i in range(BINS + 1)]
    counts = {status: [0] * BINS for status in statuses}
    span = edges[-1] - edges[0]
    for value, status in durations:
        if log:
            where = (math.log10(value) - math.log10(edges[0])) / (math.log10(edges[-1]) - math.log10(edges[0])) \
                if edges[-1] > edges[0] else 0
        else:
            where = (value - edges[0]) / span if span else 0
        counts.setdefault(status, [0] * BINS)[min(BINS - 1, max(0, int(where * BINS)))] += 1
    return {"edges": [round(e, 4) for e in edges], "counts": counts, "log": log}


def build(records: list[dict[str, Any]], kind: str, source: Path,
          links: dict[str, str] | None = None) -> dict[str, Any]:
    """The page's data for a results file.  A run resumed or redone has several lines: the last
    one counts.  ``links``: run id -> the page of its timeline, relative to the report."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        latest[str(record.get("id"))] = record
    runs = list(latest.values())
    statuses = BATCH_STATUSES if kind == BATCH else SAMPLE_STATUSES
    failed_statuses = _FAILED[kind]
    by_status = Counter(str(r.get("status")) for r in runs)
    reasons: Counter[str] = Counter()
    for r in runs:
        if r.get("status") in failed_statuses:
            reasons[reason(r.get("error") if kind == BATCH else _sample_words(r), str(r.get("status")))] += 1
    links = links or {}

    def row(r: dict[str, Any]) -> dict[str, Any]:
        key = str(r.get("id"))
        out: dict[str, Any] = {"id": key, "status": r.get("status"), "duration": round(_number(r.get("duration_s")), 3)}
        if kind == BATCH:
            tokens = r.get("tokens") if isinstance(r.get("tokens"), dict) else {}
            out.update(error=_cut(r.get("error")), tokens_in=int(_number(tokens.get("in"))),
                       tokens_out=int(_number(tokens.get("out"))), cost=_number(r.get("cost")),
                       attempts=r.get("attempts"), model=_cut(r.get("model")),
                       infrastructure=bool(r.get("infrastructure")), transcript=_cut(r.get("transcript")))
        else:
            out.update(error=_cut(r.get("message")), exit_code=r.get("exit_code"), stdout=_cut(r.get("stdout")),
                       stderr=_cut(r.get("stderr")), max_rss_mb=r.get("max_rss_mb"))
        if key in links:
            out["link"] = links[key]
        return out

    ordered = sorted(runs, key=lambda r: _number(r.get("duration_s")), reverse=True)
    failed = [r for r in runs if r.get("status") in failed_statuses]
    tokens_in = tokens_out = 0
    cost = 0.0
    for r in runs:
        tokens = r.get("tokens") if isinstance(r.get("tokens"), dict) else {}
        tokens_in += int(_number(tokens.get("in")))
        tokens_out += int(_number(tokens.get("out")))
        cost += _number(r.get("cost"))
    durations = [_number(r.get("duration_s")) for r in runs]
    ranked = sorted(durations)
    return {
        "source": source.name, "kind": kind, "runs": len(runs), "lines": len(records),
        "statuses": list(statuses), "by_status": {s: by_status.get(s, 0) for s in {*statuses, *by_status}},
        "failed_statuses": list(failed_statuses),
        "reasons": [[text, count] for text, count in reasons.most_common()],
        "histogram": histogram([(_number(r.get("duration_s")), str(r.get("status"))) for r in runs], statuses),
        "totals": {"tokens_in": tokens_in, "tokens_out": tokens_out, "cost": round(cost, 6),
                   "duration": round(sum(durations), 3),
                   "p50": round(ranked[len(ranked) // 2], 3) if ranked else 0,
                   "p99": round(ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))], 3) if ranked else 0},
        "slowest": [row(r) for r in ordered[:SLOWEST]],
        "failed": [row(r) for r in failed[:MAX_FAILED]], "failed_total": len(failed),
    }


def listed(records: list[dict[str, Any]], kind: str, limit: int) -> list[dict[str, Any]]:
    """The runs a report links to their timelines, most wanted first: the slowest, then the
    failed, at most ``limit`` (each a page to write)."""
    latest = {str(r.get("id")): r for r in records}
    runs = list(latest.values())
    slowest = sorted(runs, key=lambda r: _number(r.get("duration_s")), reverse=True)[:SLOWEST]
    failed = [r for r in runs if r.get("status") in _FAILED[kind]]
    seen: set[str] = set()
    out = []
    for r in [*slowest, *failed]:
        key = str(r.get("id"))
        if key not in seen and len(out) < limit:
            seen.add(key)
            out.append(r)
    return out


__all__ = ["build", "histogram", "listed", "reason"]
