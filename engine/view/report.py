"""A batch's report: a results file summed up for the page, whatever its size.

The sums are made here, so the page carries numbers, not ten thousand records: counts by
status and by failure reason, a histogram of durations (by status), tokens and cost, the
slowest runs, and the failed ones (the first ``MAX_FAILED``, as rows the page shows a page at
a time).  A failure reason is the run's error (for samples, its message) with numbers and
quoted parts replaced, so that "no answer within 3600 s" from a thousand runs is one reason,
not a thousand; a sample without a message gives the last line of its stderr (the exception of
a traceback), else its exit code.

The file is read twice, a line at a time, and never held (``summarise``): the first pass keeps
a few numbers per run (its last line, status, duration, tokens, cost; at most ``MAX_RUNS``
runs), the second takes the rows and reasons of the runs the page shows.  What the bounds leave
out is said on the page (``summarised``).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from engine.view._read import BATCH, BATCH_STATUSES, SAMPLE_STATUSES, Lines

#: Slowest runs listed; failed runs carried (the rest are counted).
SLOWEST, MAX_FAILED = 20, 2_000
#: Runs counted (a few numbers each, about 100 bytes of memory); lines of later runs are left out.
MAX_RUNS = 500_000
#: Distinct failure reasons counted, and listed on the page; the rest are "(other reasons)".
MAX_REASONS, SHOWN_REASONS = 10_000, 200
#: Characters of an error, an answer or an output kept for one row.
ROW_CHARS = 600
NETWORK_ROWS = 20  # connections of a sample a row shows (the rest counted)
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


def histogram(durations: Sequence[float], labels: Iterable[str], statuses: tuple[str, ...]) -> dict[str, Any]:
    """Bins of durations, counted by status (``labels``, one per duration): linear up to the
    slowest run, or logarithmic when the slowest took over fifty times the fastest (so a long
    tail does not squash the rest)."""
    if not durations:
        return {"edges": [], "counts": {}, "log": False}
    low = min(durations)
    high = max(durations)
    log = low > 0 and high / low > 50
    if log:
        a, b = math.log10(low), math.log10(high)
        edges = [10 ** (a + (b - a) * i / BINS) for i in range(BINS + 1)]
    else:
        top = high if high > 0 else 1.0
        edges = [top * i / BINS for i in range(BINS + 1)]
    counts = {status: [0] * BINS for status in statuses}
    span = edges[-1] - edges[0]
    for value, status in zip(durations, labels, strict=True):
        if log:
            where = (math.log10(value) - math.log10(edges[0])) / (math.log10(edges[-1]) - math.log10(edges[0])) \
                if edges[-1] > edges[0] else 0
        else:
            where = (value - edges[0]) / span if span else 0
        counts.setdefault(status, [0] * BINS)[min(BINS - 1, max(0, int(where * BINS)))] += 1
    return {"edges": [round(e, 4) for e in edges], "counts": counts, "log": log}


class Summary:
    """What the page shows of a results file, from two passes over it (``summarise``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.statuses = BATCH_STATUSES if kind == BATCH else SAMPLE_STATUSES
        self.failed_statuses = _FAILED[kind]
        self._slot: dict[int, int] = {}  # a run's id (hashed) -> its slot in the arrays below
        self.last = array("q")  # the number of each run's last record (the one that counts)
        self.status = array("b")
        self.duration = array("d")
        self.tokens_in = array("q")
        self.tokens_out = array("q")
        self.cost = array("d")
        self.lines = 0
        self.beyond = 0  # records of runs past MAX_RUNS: not counted
        self.reasons: Counter[str] = Counter()
        self.other_reasons = 0  # failed runs whose reason came after MAX_REASONS others
        self.rows: dict[int, dict[str, Any]] = {}  # slot -> row, for the runs the page lists
        self.transcripts: dict[int, Any] = {}  # slot -> its transcript, for the runs given timelines
        self.long: list[str] = []

    def slot(self, record: dict[str, Any], *, make: bool) -> int | None:
        key = int.from_bytes(hashlib.blake2b(str(record.get("id")).encode("utf-8", "surrogateescape"),
                                             digest_size=8).digest(), "big")
        found = self._slot.get(key)
        if found is None and make and len(self._slot) < MAX_RUNS:
            found = self._slot[key] = len(self.last)
            for column in (self.last, self.status, self.tokens_in, self.tokens_out):
                column.append(0)
            for column in (self.duration, self.cost):
                column.append(0.0)
        return found

    def first_pass(self, records: Iterable[dict[str, Any]]) -> None:
        for number, record in enumerate(records):
            self.lines += 1
            at = self.slot(record, make=True)
            if at is None:
                self.beyond += 1
                continue
            tokens = record.get("tokens") if isinstance(record.get("tokens"), dict) else {}
            self.last[at] = number
            self.status[at] = self.statuses.index(record["status"]) if record.get("status") in self.statuses else -1
            self.duration[at] = _number(record.get("duration_s"))
            self.tokens_in[at] = int(_number(tokens.get("in")))
            self.tokens_out[at] = int(_number(tokens.get("out")))
            self.cost[at] = _number(record.get("cost"))

    @property
    def runs(self) -> int:
        return len(self.last)

    def _failed(self, at: int) -> bool:
        return self.status[at] >= 0 and self.statuses[self.status[at]] in self.failed_statuses

    def slowest(self) -> list[int]:
        return heapq.nlargest(SLOWEST, range(self.runs), key=self.duration.__getitem__)

    def failed(self) -> list[int]:
        return [at for at in range(self.runs) if self._failed(at)]

    def second_pass(self, records: Iterable[dict[str, Any]], listed: int) -> None:
        """Reasons of every failed run, rows of the runs the page lists, transcripts of the
        ``listed`` runs given timelines."""
        slowest, failed = self.slowest(), self.failed()
        wanted = {*slowest, *failed[:MAX_FAILED]}
        timelines = set(_first(slowest + failed, listed))
        for number, record in enumerate(records):
            at = self.slot(record, make=False)
            if at is None or self.last[at] != number:
                continue
            if self._failed(at):
                words = reason(record.get("error") if self.kind == BATCH else _sample_words(record),
                               str(record.get("status")))
                if words in self.reasons or len(self.reasons) < MAX_REASONS:
                    self.reasons[words] += 1
                else:
                    self.other_reasons += 1
            if at in wanted:
                self.rows[at] = _row(record, self.kind)
            if at in timelines:
                self.transcripts[at] = {"id": record.get("id"), "transcript": record.get("transcript")}

    def listed(self) -> list[dict[str, Any]]:
        """The runs a report links to their timelines, most wanted first: the slowest, then the
        failed (their id and transcript)."""
        return [self.transcripts[at] for at in _first(self.slowest() + self.failed(), len(self.transcripts))
                if at in self.transcripts]

    def data(self, source: Path, links: dict[str, str] | None = None) -> dict[str, Any]:
        """The page's data.  ``links``: run id -> the page of its timeline, relative to the report."""
        links = links or {}

        def row(at: int) -> dict[str, Any]:
            found = dict(self.rows[at])
            if found["id"] in links:
                found["link"] = links[found["id"]]
            return found

        by_status = Counter(self.statuses[code] if code >= 0 else "None" for code in self.status)
        failed = self.failed()
        ranked = sorted(self.duration)
        shown_reasons = self.reasons.most_common(SHOWN_REASONS)
        hidden = sum(self.reasons.values()) - sum(n for _, n in shown_reasons) + self.other_reasons
        reasons = [[text, n] for text, n in shown_reasons] + ([["(other reasons)", hidden]] if hidden else [])
        summarised = list(self.long)
        if self.beyond:
            summarised.append(f"only the first {MAX_RUNS:,} runs are counted: {self.beyond:,} lines of later runs "
                              "are left out")
        if hidden:
            summarised.append(f"the {SHOWN_REASONS} most common failure reasons are listed; {hidden:,} failed runs "
                              "are counted under (other reasons)")
        if len(failed) > MAX_FAILED:
            summarised.append(f"the first {MAX_FAILED:,} of {len(failed):,} failed runs are listed")
        return {
            "source": source.name, "kind": self.kind, "runs": self.runs, "lines": self.lines,
            "statuses": list(self.statuses),
            "by_status": {s: by_status.get(s, 0) for s in {*self.statuses, *by_status}},
            "failed_statuses": list(self.failed_statuses),
            "reasons": reasons,
            "histogram": histogram(self.duration, (self.statuses[code] if code >= 0 else "None" for code in self.status),
                                   self.statuses),
            "totals": {"tokens_in": sum(self.tokens_in), "tokens_out": sum(self.tokens_out),
                       "cost": round(sum(self.cost), 6), "duration": round(sum(self.duration), 3),
                       "p50": round(ranked[len(ranked) // 2], 3) if ranked else 0,
                       "p99": round(ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))], 3) if ranked else 0},
            "slowest": [row(at) for at in self.slowest()],
            "failed": [row(at) for at in failed[:MAX_FAILED]], "failed_total": len(failed),
            "summarised": summarised,
        }


def _first(slots: list[int], limit: int) -> list[int]:
    seen: dict[int, None] = {}
    for at in slots:
        if len(seen) >= limit:
            break
        seen.setdefault(at)
    return list(seen)


def _row(r: dict[str, Any], kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {"id": str(r.get("id"))[:ROW_CHARS], "status": r.get("status"),
                           "duration": round(_number(r.get("duration_s")), 3)}
    if kind == BATCH:
        tokens = r.get("tokens") if isinstance(r.get("tokens"), dict) else {}
        attempts = r.get("attempts")
        out.update(error=_cut(r.get("error")), tokens_in=int(_number(tokens.get("in"))),
                   tokens_out=int(_number(tokens.get("out"))), cost=_number(r.get("cost")),
                   attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else None,
                   model=_cut(r.get("model")), infrastructure=bool(r.get("infrastructure")),
                   transcript=_cut(r.get("transcript")))
    else:
        exit_code = r.get("exit_code")
        out.update(error=_cut(r.get("message")),
                   exit_code=exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None,
                   stdout=_cut(r.get("stdout")), stderr=_cut(r.get("stderr")),
                   max_rss_mb=_number(r["max_rss_mb"]) if isinstance(r.get("max_rss_mb"), int | float) else None)
        network = r.get("network")
        if isinstance(network, list):  # (--allow-net) its connections, a line each, the first NETWORK_ROWS
            out["network"] = [_connection(c) for c in network[:NETWORK_ROWS]]
            out["network_count"] = len(network)
    return out


def _connection(c: Any) -> str:
    c = c if isinstance(c, dict) else {}
    why = f" ({_cut(c.get('why'))})" if c.get("why") else ""
    return _cut(f"{_cut(c.get('host'))}:{_cut(c.get('port'))} {_cut(c.get('verdict'))}{why}")


def summarise(records: Lines | Sequence[dict[str, Any]], kind: str, listed: int = 0) -> Summary:
    """The summary of a results file: two passes over ``records`` (a ``Lines`` streams it), the
    transcripts of the first ``listed`` runs a report links to kept for their timelines."""
    lines = records if isinstance(records, Lines) else None
    summary = Summary(kind)
    summary.first_pass(lines.records() if lines is not None else records)
    summary.second_pass(lines.records() if lines is not None else records, listed)
    if lines is not None:
        summary.long = lines.summary()
    return summary


def build(records: Lines | Sequence[dict[str, Any]], kind: str, source: Path,
          links: dict[str, str] | None = None) -> dict[str, Any]:
    """The page's data for a results file.  A run resumed or redone has several lines: the last
    one counts.  ``links``: run id -> the page of its timeline, relative to the report."""
    return summarise(records, kind).data(source, links)


__all__ = ["MAX_FAILED", "MAX_RUNS", "Summary", "build", "histogram", "reason", "summarise"]
