"""A run's timeline: its recording folded into lanes and bars (``engine.observe``), for the page.

One lane per agent (sub-agents below their parent), model requests and code blocks as bars on
one time axis, heartbeats as ticks, interrupts and kills marked by the block's outcome.  What
each bar holds is cut to sizes a page carries well: a block's code and result, and its streamed
output as head and tail with the count of what lies between, and what it displayed: a PNG (its
base64 checked to be one), an SVG (base64 here, so the page shows it only as an image, never as
markup) and HTML (as text), within ``IMAGE_BYTES`` for the page.

Whatever the recording's size, the page and the memory it takes stay bounded: the recording is
read a line at a time, every string is cut before it is held (``_held``), at most ``MAX_ITEMS``
bars and ``MAX_LANES`` lanes are drawn (what comes after is counted, not drawn), and the texts
of all bars together hold at most ``PAGE_TEXT`` characters (beyond, each keeps ``SHORT``).  The
page says what it summarised (``summarised``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.observe import AGENT, ATTEMPT, BLOCK, REQUEST, TOOL, Activity, Piece
from engine.view._read import Lines
from worker.contract.display import png_size
from worker.contract.limits import MAX_DISPLAYS

#: Characters of code, a result or a message kept for a bar.
TEXT_CHARS = 20_000
#: Characters of a block's streamed output kept at its head and at its tail.
OUTPUT_CHARS = 6_000
#: Heartbeat ticks kept per block, notes kept per run.
MAX_TICKS, MAX_NOTES = 600, 2_000
#: Connections shown per block (``--allow-net``); those beyond are counted.
MAX_CONNECTIONS = 200
#: Bars and lanes drawn, heartbeat ticks in all, attempts per request: beyond, counted only.
MAX_ITEMS, MAX_LANES, MAX_ALL_TICKS, MAX_ATTEMPTS = 10_000, 500, 100_000, 50
#: Characters (as the page's JSON holds them) of every bar's texts together; then each keeps SHORT.
PAGE_TEXT, SHORT = 12_000_000, 200
#: Events that open a bar or a lane: once the page is full they are counted, not fed.
_OPENERS = {"launched": "blocks", "tool_call": "tool calls", "waiting": "model requests",
            "agent_started": "agents", "run_started": "agents"}
#: Bytes of images (base64) one page carries, in all; the displays beyond it are named only.
IMAGE_BYTES = 64 * 1024 * 1024
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
#: A display's fields that hold an image whole (bounded by ``IMAGE_BYTES``, not cut as text).
_IMAGES = ("png", "svg")


class _Held(str):
    """A string cut before it was held, knowing how long it was (``total``)."""

    total: int


def _number(value: Any) -> int | float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _held(value: Any) -> Any:
    """``value``, a string cut to what any bar can keep of it (its length remembered)."""
    if not isinstance(value, str) or len(value) <= TEXT_CHARS:
        return value
    held = _Held(value[:TEXT_CHARS])
    held.total = getattr(value, "total", len(value))
    return held


def _length(text: str) -> int:
    return getattr(text, "total", len(text))


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

    def shown(self, room: int) -> dict[str, Any]:
        """Head and tail, each at most ``room`` characters."""
        head, tail = self.head[:room], self.tail[-room:] if room else ""
        return {"head": head, "tail": tail, "cut": self.total - len(head) - len(tail)}


class _Collect:
    """The listener: every piece as a lane or a bar, in the order they began, within the bounds."""

    def __init__(self) -> None:
        self.lanes: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []
        self.notes: list[dict[str, Any]] = []
        self._lane: dict[Piece, int] = {}
        self._item: dict[Piece, dict[str, Any]] = {}
        self._output: dict[Piece, _Output] = {}
        self.budget = PAGE_TEXT
        self.shortened = 0  # texts cut to SHORT once the budget was spent
        self.beyond: Counter[str] = Counter()  # what was not drawn, by kind
        self.ticks = 0
        self._images = IMAGE_BYTES  # bytes of images the page may still carry

    @property
    def full(self) -> bool:
        return len(self.items) >= MAX_ITEMS or len(self.lanes) >= MAX_LANES

    def cut(self, value: Any, limit: int = TEXT_CHARS) -> str:
        """``value`` as a text of at most ``limit`` characters, drawn from the page's budget."""
        text = value if isinstance(value, str) else "" if value is None else str(value)
        if self.budget <= 0 and len(text) > SHORT:
            limit = SHORT
            self.shortened += 1
        total = _length(text)
        kept = text[:limit] if len(text) > limit else text
        kept = kept if total <= len(kept) else kept + f"\n[... {total - len(kept)} more characters]"
        self.budget -= len(json.dumps(kept, ensure_ascii=False))
        return kept

    def _lane_of(self, piece: Piece | None) -> int | None:
        while piece is not None and piece.kind != AGENT:
            piece = piece.parent
        return self._lane.get(piece) if piece is not None else None

    def opened(self, piece: Piece) -> None:
        if piece.kind == AGENT:
            if len(self.lanes) >= MAX_LANES:
                self.beyond["agents"] += 1
                return
            parent = self._lane_of(piece.parent)
            self._lane[piece] = len(self.lanes)
            self.lanes.append({"name": self.cut(piece.name, 200), "parent": parent,
                               "depth": 0 if parent is None else self.lanes[parent]["depth"] + 1,
                               "s": piece.start, "model": self.cut(piece.facts.get("model"), 200),
                               "task": self.cut(piece.facts.get("task")),
                               **({"forked": True} if piece.facts.get("forked") else {})})
        elif piece.kind == ATTEMPT:
            request = self._item.get(piece.parent)
            if request is not None and len(request["attempts"]) < MAX_ATTEMPTS:
                request["attempts"].append(attempt := {"s": piece.start})
                self._item[piece] = attempt
        elif piece.kind in (REQUEST, BLOCK, TOOL):
            lane = self._lane_of(piece)
            if len(self.items) >= MAX_ITEMS or lane is None:
                self.beyond[{REQUEST: "model requests", BLOCK: "blocks", TOOL: "tool calls"}[piece.kind]] += 1
                return
            item: dict[str, Any] = {"k": piece.kind, "lane": lane, "s": piece.start, "id": self.cut(piece.key, 200)}
            if piece.kind == REQUEST:
                item.update(attempts=[], message=self.cut(piece.facts.get("message")))
            elif piece.kind == BLOCK:
                item.update(code=self.cut(piece.facts.get("code")), timeout=piece.facts.get("timeout"), beats=[])
                self._output[piece] = _Output()
            else:
                item.update(tool=self.cut(piece.facts.get("tool"), 200), args=self.cut(piece.facts.get("arguments")))
            self._item[piece] = item
            self.items.append(item)

    def marked(self, piece: Piece | None, mark: str, at: float, fields: dict[str, Any]) -> None:
        if mark == "output" and piece in self._output:
            text = fields.get("text")
            self._output[piece].add(text if isinstance(text, str) else "")
        elif mark == "display" and piece in self._item:
            shown = self._item[piece].setdefault("shown", [])
            if len(shown) < MAX_DISPLAYS:
                shown.append(self._shown(fields))
        elif mark == "connection" and piece in self._item:  # (--allow-net) what the block's code reached
            net = self._item[piece].setdefault("net", [])
            if len(net) < MAX_CONNECTIONS:
                net.append({"host": self.cut(fields.get("host"), 300), "port": _number(fields.get("port")),
                            "verdict": self.cut(fields.get("verdict"), 20), "why": self.cut(fields.get("why"), 40),
                            "sent": _number(fields.get("sent")), "received": _number(fields.get("received"))})
            else:
                self._item[piece]["net_more"] = self._item[piece].get("net_more", 0) + 1
        elif mark == "progress" and piece in self._item:
            beats = self._item[piece]["beats"]
            if len(beats) < MAX_TICKS and self.ticks < MAX_ALL_TICKS:
                beats.append(at)
                self.ticks += 1
        elif mark in ("note", "failed", "cancelled") and len(self.notes) < MAX_NOTES:
            text = fields.get("label") if mark == "cancelled" else fields.get("message")
            self.notes.append({"t": at, "lane": self._lane_of(piece), "kind": mark, "text": self.cut(text, 2000)})

    def closed(self, piece: Piece) -> None:
        facts = piece.facts
        if piece.kind == AGENT:
            if piece not in self._lane:
                return
            lane = self.lanes[self._lane[piece]]
            lane.update(e=piece.end, o=piece.outcome, status=facts.get("status"),
                        error=self.cut(facts.get("error"), 2000), unfinished=bool(facts.get("unfinished")),
                        model=lane["model"] or self.cut(facts.get("model"), 200))
            for key in ("tokens_in", "tokens_out", "cost"):
                if isinstance(facts.get(key), int | float):
                    lane[key] = facts[key]
            return
        item = self._item.pop(piece, None)
        if item is None:
            return
        item.update(e=piece.end, o=piece.outcome)
        if piece.error_type:
            item["error"] = self.cut(piece.error_type, 200)
        if piece.kind == ATTEMPT:
            item["status"] = facts.get("status")
        elif piece.kind == REQUEST:
            item.update({k: facts[k] for k in ("model", "tokens_in", "tokens_out", "finish_reason", "max_tokens",
                                               "timings") if facts.get(k) is not None})
            if isinstance(facts.get("first_token"), float):
                item["ttft"] = facts["first_token"] - piece.start
            item["reply"] = self.cut(facts.get("reply"))
        elif piece.kind == BLOCK:
            output = self._output.pop(piece, _Output())
            item.update(status=facts.get("status"), result=self.cut(facts.get("output")), bytes=facts.get("output_bytes"),
                        lost=[self.cut(v, 200) for v in facts["lost"][:100]] if isinstance(facts.get("lost"), list)
                        else [], message=self.cut(facts.get("message"), 2000),
                        out=output.shown(OUTPUT_CHARS if self.budget > 0 else SHORT // 2))
            self.budget -= len(json.dumps(item["out"], ensure_ascii=False))
        elif piece.kind == TOOL:
            item["result"] = self.cut(facts.get("result"))

    def _shown(self, fields: dict[str, Any]) -> dict[str, Any]:
        """One display for the page: its line and text, and the images it holds while the page's
        image budget lasts."""
        item: dict[str, Any] = {"index": fields.get("index"), "line": self.cut(fields.get("line"), 2000),
                                "text": self.cut(fields.get("text"), 4000)}
        png = fields.get("png")
        if isinstance(png, str) and _BASE64.fullmatch(png):
            try:
                head = base64.b64decode(png[:32])
            except (binascii.Error, ValueError):
                head = b""
            if png_size(head) is not None:
                item["size"] = png_size(head)
                if len(png) <= self._images:
                    self._images -= len(png)
                    item["png"] = png
                else:
                    item["omitted"] = len(png) * 3 // 4
        svg = fields.get("svg")
        if isinstance(svg, str):
            svg64 = base64.b64encode(svg.encode("utf-8", "replace")).decode("ascii")
            if len(svg64) <= self._images:
                self._images -= len(svg64)
                item["svg"] = svg64
            else:
                item["omitted"] = len(svg)
        if isinstance(fields.get("html"), str):
            item["html"] = self.cut(fields["html"])
        return item

    def summarised(self, lines: Lines | None) -> list[str]:
        """What the page leaves out or shortens, in sentences."""
        said = list(lines.summary()) if lines is not None else []
        if self.beyond:
            parts = [f"{count:,} more {kind}" for kind, count in sorted(self.beyond.items())]
            said.append(f"only the first {len(self.items):,} bars and {len(self.lanes):,} lanes are drawn: the recording "
                        f"goes on with {', '.join(parts)}, counted here but not drawn")
        if self.shortened:
            said.append(f"{self.shortened:,} texts are cut to {SHORT} characters, the page holding "
                        f"{PAGE_TEXT:,} characters of code, output and messages before them")
        if self.ticks >= MAX_ALL_TICKS:
            said.append(f"heartbeat ticks are drawn up to {MAX_ALL_TICKS:,} in all")
        return said


def _relative(value: Any, t0: float) -> Any:
    return round(value - t0, 4) if isinstance(value, float | int) and not isinstance(value, bool) else value


def build(records: Lines | Iterable[dict[str, Any]], source: Path, cut_line: int | None = None
          ) -> tuple[dict[str, Any], str | None]:
    """The page's data for a recording (a ``Lines`` streams it), and the one warning to give
    (None: the run is whole)."""
    lines = records if isinstance(records, Lines) else None
    collect = _Collect()
    activity = Activity(collect)
    costs: dict[str, float] = {}
    started = finished = 0
    t0: float | None = None
    for record in lines.records() if lines is not None else records:
        kind = record["type"]
        at = float(record["t"])
        t0 = at if t0 is None else min(t0, at)
        started += kind == "run_started"
        finished += kind == "run_finished"
        name = record.get("name")
        if collect.full and (kind in _OPENERS or name not in activity.agents) \
                and kind not in ("run_finished", "agent_finished"):
            if kind in _OPENERS and (kind != "waiting" or record.get("attempt") in (1, None)) \
                    and (kind not in ("agent_started", "run_started") or name not in activity.agents):
                collect.beyond[_OPENERS[kind]] += 1
            activity.last = max(activity.last, at)
            continue
        fields = {k: (v if (kind == "output" and k == "text") or (kind == "display" and k in _IMAGES) else _held(v))
                  for k, v in record.items()
                  if k not in ("t", "type")}
        if kind == "replied" and isinstance(record.get("stats"), dict) \
                and isinstance(record["stats"].get("cost"), int | float) and len(costs) < MAX_LANES:
            costs[str(name)] = float(record["stats"]["cost"])
        activity.feed(kind, fields, at)
    if lines is not None:
        cut_line = lines.cut_line
    end = activity.last
    activity.close(end)
    warning = None
    if cut_line is not None:
        warning = f"line {cut_line} was cut short (its writer stopped mid-line): shown up to the line before it"
    elif started > finished:
        warning = "the recording ends before its run did (it was stopped while running): shown as far as it goes"
    seen = t0 is not None
    t0 = t0 if t0 is not None else 0.0
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
        "duration": round(end - t0, 3) if seen else 0,
        "tokens_in": sum(lane.get("tokens_in", 0) for lane in roots) or sum(i.get("tokens_in", 0) for i in requests),
        "tokens_out": sum(lane.get("tokens_out", 0) for lane in roots) or sum(i.get("tokens_out", 0) for i in requests),
        "cost": round(sum(lane["cost"] for lane in roots if "cost" in lane) or sum(costs.values()), 6),
        "requests": len(requests) + collect.beyond["model requests"],
        "blocks": sum(i["k"] == BLOCK for i in collect.items) + collect.beyond["blocks"],
        "agents": len(collect.lanes) + collect.beyond["agents"],
        "status": roots[0].get("status") if len(roots) == 1 else None,
    }
    data = {"source": source.name, "warning": warning, "t0": t0, "totals": totals, "lanes": collect.lanes,
            "items": collect.items, "notes": collect.notes, "summarised": collect.summarised(lines)}
    return data, warning


__all__ = ["build"]
