"""A run's timeline: its recording folded into lanes and bars (``engine.observe``), for the page.

One lane per agent (sub-agents below their parent), model requests and code blocks as bars on
one time axis, heartbeats as ticks, interrupts and kills marked by the block's outcome.  What
each bar holds is cut to sizes a page carries well: a block's code and result, and its streamed
output as head and tail with the count of what lies between, and what it displayed: a PNG (its
base64 checked to be one), an SVG (base64 here, so the page shows it only as an image, never as
markup) and HTML (as text), within ``IMAGE_BYTES`` for the page.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Any

from engine.observe import AGENT, ATTEMPT, BLOCK, REQUEST, TOOL, Activity, Piece
from worker.contract.display import png_size
from worker.contract.limits import MAX_DISPLAYS

#: Characters of code, a result or a message kept for a bar.
TEXT_CHARS = 20_000
#: Characters of a block's streamed output kept at its head and at its tail.
OUTPUT_CHARS = 6_000
#: Heartbeat ticks kept per block, notes kept per run.
MAX_TICKS, MAX_NOTES = 600, 2_000
#: Bytes of images (base64) one page carries, in all; the displays beyond it are named only.
IMAGE_BYTES = 64 * 1024 * 1024
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _shown(fields: dict[str, Any], budget: list[int]) -> dict[str, Any]:
    """One display for the page: its line and text, and the images it holds while ``budget``
    (bytes left for the page's images) lasts."""
    item: dict[str, Any] = {"index": fields.get("index"), "line": _cut(fields.get("line"), 2000),
                            "text": _cut(fields.get("text"), 4000)}
    png = fields.get("png")
    if isinstance(png, str) and _BASE64.fullmatch(png):
        try:
            head = base64.b64decode(png[:32])
        except (binascii.Error, ValueError):
            head = b""
        if png_size(head) is not None:
            item["size"] = png_size(head)
            if len(png) <= budget[0]:
                budget[0] -= len(png)
                item["png"] = png
            else:
                item["omitted"] = len(png) * 3 // 4
    svg = fields.get("svg")
    if isinstance(svg, str):
        svg64 = base64.b64encode(svg.encode("utf-8", "replace")).decode("ascii")
        if len(svg64) <= budget[0]:
            budget[0] -= len(svg64)
            item["svg"] = svg64
        else:
            item["omitted"] = len(svg)
    if isinstance(fields.get("html"), str):
        item["html"] = _cut(fields["html"])
    return item


def _cut(value: Any, limit: int = TEXT_CHARS) -> str:
    text = value if isinstance(value, str) else "" if value is None else str(value)
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


class _Output:
    """Head and tail of a block's streamed output, and how much fell between them."""

    def __init__(self) -> None:
        self.head, self.tail, self.total = "", "", 0

    def add(self, text: str) -> None:
        self.total += len(text)
        room = OUTPUT_CHARS - len(self.head)
        if room > 0:
            self.head += text[:room]
            text = text[room:]
        if text:
            self.tail = (self.tail + text)[-OUTPUT_CHARS:]

    def shown(self) -> dict[str, Any]:
        return {"head": self.head, "tail": self.tail, "cut": self.total - len(self.head) - len(self.tail)}


class _Collect:
    """The listener: every piece as a lane or a bar, in the order they began."""

    def __init__(self) -> None:
        self.lanes: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []
        self.notes: list[dict[str, Any]] = []
        self._lane: dict[Piece, int] = {}
        self._item: dict[Piece, dict[str, Any]] = {}
        self._output: dict[Piece, _Output] = {}
        self._budget = [IMAGE_BYTES]  # (a list: shared by every display of the page)

    def _lane_of(self, piece: Piece | None) -> int | None:
        while piece is not None and piece.kind != AGENT:
            piece = piece.parent
        return self._lane.get(piece) if piece is not None else None

    def opened(self, piece: Piece) -> None:
        if piece.kind == AGENT:
            parent = self._lane_of(piece.parent)
            self._lane[piece] = len(self.lanes)
            self.lanes.append({"name": piece.name, "parent": parent,
                               "depth": 0 if parent is None else self.lanes[parent]["depth"] + 1,
                               "s": piece.start, "model": piece.facts.get("model"),
                               "task": _cut(piece.facts.get("task"))})
        elif piece.kind == ATTEMPT:
            request = self._item.get(piece.parent)
            if request is not None:
                request["attempts"].append(attempt := {"s": piece.start})
                self._item[piece] = attempt
        elif piece.kind in (REQUEST, BLOCK, TOOL):
            item: dict[str, Any] = {"k": piece.kind, "lane": self._lane_of(piece), "s": piece.start, "id": piece.key}
            if piece.kind == REQUEST:
                item.update(attempts=[], message=_cut(piece.facts.get("message")))
            elif piece.kind == BLOCK:
                item.update(code=_cut(piece.facts.get("code")), timeout=piece.facts.get("timeout"), beats=[])
                self._output[piece] = _Output()
            else:
                item.update(tool=piece.facts.get("tool"), args=_cut(piece.facts.get("arguments")))
            self._item[piece] = item
            self.items.append(item)

    def marked(self, piece: Piece | None, mark: str, at: float, fields: dict[str, Any]) -> None:
        if mark == "output" and piece in self._output:
            text = fields.get("text")
            self._output[piece].add(text if isinstance(text, str) else "")
        elif mark == "display" and piece in self._item:
            shown = self._item[piece].setdefault("shown", [])
            if len(shown) < MAX_DISPLAYS:
                shown.append(_shown(fields, self._budget))
        elif mark == "progress" and piece in self._item:
            beats = self._item[piece]["beats"]
            if len(beats) < MAX_TICKS:
                beats.append(at)
        elif mark in ("note", "failed", "cancelled") and len(self.notes) < MAX_NOTES:
            text = fields.get("label") if mark == "cancelled" else fields.get("message")
            self.notes.append({"t": at, "lane": self._lane_of(piece), "kind": mark, "text": _cut(text, 2000)})

    def closed(self, piece: Piece) -> None:
        facts = piece.facts
        if piece.kind == AGENT:
            lane = self.lanes[self._lane[piece]]
            lane.update(e=piece.end, o=piece.outcome, status=facts.get("status"), error=_cut(facts.get("error"), 2000),
                        unfinished=bool(facts.get("unfinished")), model=lane["model"] or facts.get("model"))
            for key in ("tokens_in", "tokens_out", "cost"):
                if isinstance(facts.get(key), int | float):
                    lane[key] = facts[key]
            return
        item = self._item.pop(piece, None)
        if item is None:
            return
        item.update(e=piece.end, o=piece.outcome)
        if piece.error_type:
            item["error"] = piece.error_type
        if piece.kind == ATTEMPT:
            item["status"] = facts.get("status")
        elif piece.kind == REQUEST:
            item.update({k: facts[k] for k in ("model", "tokens_in", "tokens_out", "finish_reason", "max_tokens",
                                               "timings") if facts.get(k) is not None})
            if isinstance(facts.get("first_token"), float):
                item["ttft"] = facts["first_token"] - piece.start
            item["reply"] = _cut(facts.get("reply"))
        elif piece.kind == BLOCK:
            item.update(status=facts.get("status"), result=_cut(facts.get("output")), bytes=facts.get("output_bytes"),
                        lost=[str(v) for v in facts["lost"]] if isinstance(facts.get("lost"), list) else [],
                        message=_cut(facts.get("message"), 2000),
                        out=self._output.pop(piece, _Output()).shown())
        elif piece.kind == TOOL:
            item["result"] = _cut(facts.get("result"))


def _relative(value: Any, t0: float) -> Any:
    return round(value - t0, 4) if isinstance(value, float | int) and not isinstance(value, bool) else value


def build(records: list[dict[str, Any]], source: Path, cut_line: int | None = None) -> tuple[dict[str, Any], str | None]:
    """The page's data for a recording, and the one warning to give (None: the run is whole)."""
    collect = _Collect()
    activity = Activity(collect)
    costs: dict[str, float] = {}
    started = finished = 0
    for record in records:
        fields = {k: v for k, v in record.items() if k not in ("t", "type")}
        kind = record["type"]
        started += kind == "run_started"
        finished += kind == "run_finished"
        if kind == "replied" and isinstance(record.get("stats"), dict) \
                and isinstance(record["stats"].get("cost"), int | float):
            costs[str(record.get("name"))] = float(record["stats"]["cost"])
        activity.feed(kind, fields, float(record["t"]))
    end = activity.last
    activity.close(end)
    warning = None
    if cut_line is not None:
        warning = f"line {cut_line} was cut short (its writer stopped mid-line): shown up to the line before it"
    elif started > finished:
        warning = "the recording ends before its run did (it was stopped while running): shown as far as it goes"
    t0 = min([r["t"] for r in records] or [0.0])
    for lane in collect.lanes:
        for key in ("s", "e"):
            lane[key] = _relative(lane.get(key), t0)
    for item in collect.items:
        for key in ("s", "e"):
            item[key] = _relative(item.get(key), t0)
        for attempt in item.get("attempts", ()):
            attempt["s"], attempt["e"] = _relative(attempt.get("s"), t0), _relative(attempt.get("e"), t0)
        if "beats" in item:
            item["beats"] = [_relative(b, t0) for b in item["beats"]]
    for note in collect.notes:
        note["t"] = _relative(note["t"], t0)
    roots = [lane for lane in collect.lanes if lane["parent"] is None]
    requests = [i for i in collect.items if i["k"] == REQUEST]
    totals = {
        "duration": round(end - t0, 3) if records else 0,
        "tokens_in": sum(lane.get("tokens_in", 0) for lane in roots) or sum(i.get("tokens_in", 0) for i in requests),
        "tokens_out": sum(lane.get("tokens_out", 0) for lane in roots) or sum(i.get("tokens_out", 0) for i in requests),
        "cost": round(sum(lane["cost"] for lane in roots if "cost" in lane) or sum(costs.values()), 6),
        "requests": len(requests), "blocks": sum(i["k"] == BLOCK for i in collect.items),
        "agents": len(collect.lanes),
        "status": roots[0].get("status") if len(roots) == 1 else None,
    }
    data = {"source": source.name, "warning": warning, "t0": t0, "totals": totals, "lanes": collect.lanes,
            "items": collect.items, "notes": collect.notes}
    return data, warning


__all__ = ["build"]
