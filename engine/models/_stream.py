"""A streamed reply put back together: chunks of content, reasoning and tool calls folded into
the assistant message a plain reply would have been (``engine.models`` reads the stream)."""

from __future__ import annotations

import json
import math
from typing import Any

from engine.models._reasoning import reasoning_of

__all__ = ["Assembly", "normal_call", "timings"]


def timings(value: Any) -> dict[str, float] | None:
    """llama-server's ``timings``, its finite numbers only: a server puts nothing else into an event."""
    numbers = isinstance(value, dict) and {str(k)[:64]: v for k, v in list(value.items())[:32]
                                           if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
    return numbers or None


class Assembly:
    """The assistant message under construction from stream chunks."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.timings: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> tuple[str, str]:
        """Fold one chunk in; return its reasoning and its content text (either possibly empty).
        The reasoning is the caller's to keep: inline ``<think>`` is only found in the content."""
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        self.timings = timings(chunk.get("timings")) or self.timings
        choices = chunk.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return "", ""
        choice = choices[0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        delta = choice.get("delta") or choice.get("message") or {}
        thought = reasoning_of(delta)
        piece = delta.get("content") or ""
        if piece:
            self.content.append(piece)
        for position, fragment in enumerate(delta.get("tool_calls") or []):
            index = fragment.get("index", position)
            call = self.calls.setdefault(index, {"id": "", "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            if fragment.get("id") and not call["id"]:
                call["id"] = fragment["id"]
            function = fragment.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            arguments = function.get("arguments") or ""
            call["function"]["arguments"] += arguments if isinstance(arguments, str) else json.dumps(arguments)
        return thought, piece

    def message(self) -> dict[str, Any]:
        result: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.calls:
            calls = [self.calls[i] for i in sorted(self.calls)]
            for i, call in enumerate(calls):
                call["id"] = call["id"] or f"call_{i}"
            result["tool_calls"] = calls
        return result


def normal_call(call: dict[str, Any], position: int) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments") or ""
    return {"id": call.get("id") or f"call_{position}", "type": "function",
            "function": {"name": function.get("name") or "",
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


