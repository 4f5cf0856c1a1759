"""Spans in the OpenTelemetry GenAI semantic conventions, from a run's display events.

``SpanObserver`` is a display: it folds the events of one run (``engine.observe``) and makes
a span of each piece, with the time the piece really started and ended:

- the run, and each sub-agent: ``invoke_agent {name}`` (INTERNAL), a sub-agent the child of the
  agent that started it; ``gen_ai.agent.name``, ``gen_ai.request.model``; at its end the
  tokens and cost of the run (``gen_ai.usage.*``, ``agentloop.cost_usd``) and its status.  A
  batch run's root span carries ``agentloop.task.id`` and ``agentloop.run.attempt``;
- each model request: ``chat {model}`` (CLIENT) with ``gen_ai.request.model``,
  ``gen_ai.request.max_tokens``, ``server.address``/``server.port``,
  ``gen_ai.response.finish_reasons``, ``gen_ai.usage.input_tokens``/``output_tokens``, the
  first token's delay (``agentloop.time_to_first_token_s``) and the server's own timing where it
  reports one (llama-server's ``timings``: ``agentloop.server.prompt_ms``, ``predicted_ms``,
  ...); below it one ``POST`` span (CLIENT, the HTTP conventions) per attempt, so a retried
  request shows each failed attempt with its ``http.response.status_code`` or ``error.type`` and
  ``http.request.resend_count`` on the ones after it;
- each code block: ``execute_tool run_code`` (INTERNAL) with ``gen_ai.tool.call.id`` (the
  block's id), ``agentloop.block.timeout_s``, ``agentloop.block.status`` (ok, error, timeout,
  cancelled, died, killed), ``agentloop.block.ended`` (ok, error, interrupted, killed, died, or
  cancelled when its run ended first), ``agentloop.block.output_bytes`` and, after a kill,
  ``agentloop.block.lost_variables``; heartbeats are span events;
- each tool call of ``agentloop ask``: ``execute_tool {tool}``;
- each code sample of ``exec --jsonl``: ``execute_tool sample``, a trace of its own, with the
  sample's id, status, exit code and peak memory.

Errors set the span's status to ERROR and ``error.type``: the HTTP status of a failed request
(``500``), the exception's type where there is no status (``ModelUnreachable``), the block's or
sample's status (``error``, ``timeout``, ``killed``, ``died``).  A thing cancelled is not an
error.

Versions: by default the GenAI conventions of semantic-conventions v1.36.0 (``gen_ai.system``);
with ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``, v1.38.0
(``gen_ai.provider.name``), as the conventions' transition plan asks.  The provider is
``openai``: agentloop speaks the OpenAI chat completions API to every server; which server it
was is ``server.address``.  Message contents, code and output are recorded only under v1.38.0
and only when ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` is ``true`` (or
``SPAN_ONLY``/``SPAN_AND_EVENT``): ``gen_ai.system_instructions`` and the task on the agent
span, on each chat span the message new to that request (not the whole history, which repeats
what the spans before hold) as ``gen_ai.input.messages`` and the reply as
``gen_ai.output.messages``, a block's code and result as ``gen_ai.tool.call.arguments`` and
``gen_ai.tool.call.result``, each string cut at ``CONTENT_CHARS``.  The API key is never in an
event, so never in a span.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.agent import AgentDisplay
from engine.observe._activity import AGENT, ATTEMPT, BLOCK, REQUEST, TOOL, Activity, Piece

#: Characters of one recorded content string (a message, code, output) kept on a span.
CONTENT_CHARS = 16_000
_PROVIDER = "openai"


#: A connection event's attributes: (attribute, the event's field, its type).
_CONNECTION_ATTRIBUTES = (("server.address", "host", str), ("server.port", "port", int),
                          ("network.peer.address", "address", str), ("agentloop.network.verdict", "verdict", str),
                          ("agentloop.network.why", "why", str), ("agentloop.network.sent_bytes", "sent", int),
                          ("agentloop.network.received_bytes", "received", int))


def schema_url(settings: Any) -> str:
    return f"https://opentelemetry.io/schemas/{settings.semconv}"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _cut(text: Any) -> str:
    text = text if isinstance(text, str) else "" if text is None else str(text)
    return text if len(text) <= CONTENT_CHARS else text[:CONTENT_CHARS] + f"[... {len(text) - CONTENT_CHARS} more]"


def _messages(role: str, text: Any, finish_reason: Any = None) -> str:
    """One message in the conventions' JSON shape (recorded on spans as a JSON string)."""
    message: dict[str, Any] = {"role": role, "parts": [{"type": "text", "content": _cut(text)}]}
    if finish_reason:
        message["finish_reason"] = str(finish_reason)
    return json.dumps([message], ensure_ascii=False)


def _server(url: str) -> dict[str, Any]:
    """``server.address``/``server.port`` of a base URL (never its user or password)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return {}
    return {"server.address": parts.hostname, "server.port": port} if parts.hostname else {}


class SpanObserver(AgentDisplay):
    """A display that makes spans of one run's events (see the module docstring).  Spans open
    and end as the pieces do; ``close()`` ends what the run left open.  ``context``: the parent
    of the run's root span (default: the OpenTelemetry context current when it is made, so a
    run inside an application's span is its child)."""

    def __init__(self, tracer: Any, settings: Any, *, models: Any = None, root: Mapping[str, Any] | None = None,
                 context: Any = None) -> None:
        self.tracer = tracer
        self.latest = settings.latest
        self.content = settings.content
        self.models = models
        self.root = {k: v for k, v in (root or {}).items() if v is not None}
        self.context = otel_context.get_current() if context is None else context
        self.activity = Activity(self)
        self._spans: dict[Piece, Any] = {}
        self._described: dict[Piece, dict[str, Any]] = {}  # what a request's span began with

    def event(self, type: str, **fields: Any) -> None:
        self.activity.feed(type, fields, time.time())

    def close(self) -> None:
        self.activity.close(time.time())

    # -- the listener ----------------------------------------------------------------------------
    def _config(self, alias: Any) -> Any:
        if self.models is None or not isinstance(alias, str):
            return None
        try:
            return self.models.get(alias)
        except Exception:  # noqa: BLE001 - an alias the registry does not know: no model attributes
            return None

    def _gen_ai(self, operation: str) -> dict[str, Any]:
        return {"gen_ai.operation.name": operation,
                ("gen_ai.provider.name" if self.latest else "gen_ai.system"): _PROVIDER}

    def opened(self, piece: Piece) -> None:
        parent = self._spans.get(piece.parent) if piece.parent is not None else None
        ctx = trace.set_span_in_context(parent) if parent is not None else self.context
        name, kind, attributes = self._describe(piece)
        if piece.kind == REQUEST:
            self._described[piece] = attributes
        self._spans[piece] = self.tracer.start_span(name, context=ctx, kind=kind, attributes=attributes,
                                                    start_time=_ns(piece.start))

    def _agent_of(self, piece: Piece) -> Piece | None:
        while piece is not None and piece.kind != AGENT:
            piece = piece.parent
        return piece

    def _describe(self, piece: Piece) -> tuple[str, SpanKind, dict[str, Any]]:
        if piece.kind == AGENT:
            attributes = {**self._gen_ai("invoke_agent"), "gen_ai.agent.name": piece.name}
            config = self._config(piece.facts.get("model"))
            if config is not None:
                attributes["gen_ai.request.model"] = config.model
            if piece.parent is None:
                attributes.update(self.root)
            if piece.facts.get("forked"):
                attributes["agentloop.agent.forked"] = True  # its worker is a fork of its parent's
            return f"invoke_agent {piece.name}", SpanKind.INTERNAL, attributes
        if piece.kind == REQUEST:
            agent = self._agent_of(piece)
            config = self._config(agent.facts.get("model") if agent is not None else None)
            attributes = self._gen_ai("chat")
            if config is not None:
                attributes.update({"gen_ai.request.model": config.model, **_server(config.base_url)})
            model = attributes.get("gen_ai.request.model")
            return (f"chat {model}" if model else "chat"), SpanKind.CLIENT, attributes
        if piece.kind == ATTEMPT:
            agent = self._agent_of(piece)
            config = self._config(agent.facts.get("model") if agent is not None else None)
            attributes = {"http.request.method": "POST"}
            if config is not None:
                attributes.update(_server(config.base_url))
            attempt = piece.facts.get("attempt")
            if isinstance(attempt, int) and attempt > 1:
                attributes["http.request.resend_count"] = attempt - 1
            return "POST", SpanKind.CLIENT, attributes
        tool = "run_code" if piece.kind == BLOCK else str(piece.facts.get("tool") or "tool")
        attributes = {**self._gen_ai("execute_tool"), "gen_ai.tool.name": tool, "gen_ai.tool.call.id": piece.key,
                      "gen_ai.tool.type": "function"}
        if piece.kind == BLOCK:
            for fact, key in (("timeout", "agentloop.block.timeout_s"), ("heartbeat", "agentloop.block.heartbeat_s")):
                if isinstance(piece.facts.get(fact), int | float):
                    attributes[key] = float(piece.facts[fact])
        return f"execute_tool {tool}", SpanKind.INTERNAL, attributes

    def marked(self, piece: Piece | None, mark: str, at: float, fields: dict[str, Any]) -> None:
        span = self._spans.get(piece) if piece is not None else None
        if span is None:
            return
        if mark == "progress":
            current = fields.get("current")
            span.add_event("heartbeat", {"agentloop.block.elapsed_s": float(current)}
                           if isinstance(current, int | float) else {}, timestamp=_ns(at))
        elif mark == "retrying":
            attributes = {k: v for k, v in (("agentloop.retry.attempt", fields.get("attempt")),
                                            ("agentloop.retry.wait_s", fields.get("wait")))
                          if isinstance(v, int | float)}
            span.add_event("retry", attributes, timestamp=_ns(at))
        elif mark == "connection":  # (--allow-net) one event per connection the block's code made
            attributes = {key: fields[name] for key, name, kind in _CONNECTION_ATTRIBUTES
                          if isinstance(fields.get(name), kind) and not isinstance(fields.get(name), bool)}
            span.add_event("connection", attributes, timestamp=_ns(at))
        elif mark in ("cancelled", "failed"):
            text = fields.get("label") if mark == "cancelled" else fields.get("message")
            span.add_event(mark, {"agentloop.message": _cut(text)} if self.content else {}, timestamp=_ns(at))

    def closed(self, piece: Piece) -> None:
        span = self._spans.pop(piece, None)
        if span is None:
            return
        facts = piece.facts
        attributes: dict[str, Any] = {}
        if piece.kind == AGENT:
            for fact, key in (("tokens_in", "gen_ai.usage.input_tokens"), ("tokens_out", "gen_ai.usage.output_tokens"),
                              ("cost", "agentloop.cost_usd"), ("status", "agentloop.run.status")):
                if facts.get(fact) is not None:
                    attributes[key] = facts[fact]
            if facts.get("unfinished"):
                attributes["agentloop.unfinished"] = True
            if self.content:
                if facts.get("system"):
                    attributes["gen_ai.system_instructions"] = json.dumps(
                        [{"type": "text", "content": _cut(facts["system"])}], ensure_ascii=False)
                if facts.get("task"):
                    attributes["gen_ai.input.messages"] = _messages("user", facts["task"])
        elif piece.kind == REQUEST:
            self._request_attributes(piece, attributes)
            if facts.get("model") and "gen_ai.request.model" not in self._described.pop(piece, {}):
                span.update_name(f"chat {facts['model']}")  # the alias was unknown when it began
        elif piece.kind == ATTEMPT:
            if facts.get("status"):
                attributes["http.response.status_code"] = facts["status"]
        elif piece.kind == BLOCK:
            attributes["agentloop.block.status"] = str(facts.get("status") or piece.outcome)
            attributes["agentloop.block.ended"] = piece.outcome
            for fact, key in (("duration", "agentloop.block.duration_s"), ("output_bytes", "agentloop.block.output_bytes")):
                if isinstance(facts.get(fact), int | float):
                    attributes[key] = facts[fact]
            if isinstance(facts.get("lost"), list) and facts["lost"]:
                attributes["agentloop.block.lost_variables"] = [str(v) for v in facts["lost"]]
            if self.content:
                attributes["gen_ai.tool.call.arguments"] = json.dumps({"code": _cut(facts.get("code"))},
                                                                      ensure_ascii=False)
                if facts.get("output") is not None:
                    attributes["gen_ai.tool.call.result"] = _cut(facts["output"])
        elif piece.kind == TOOL and self.content:
            attributes["gen_ai.tool.call.arguments"] = _cut(facts.get("arguments"))
            attributes["gen_ai.tool.call.result"] = _cut(facts.get("result"))
        if attributes:
            span.set_attributes(attributes)
        if piece.error_type:
            span.set_attribute("error.type", piece.error_type)
            span.set_status(Status(StatusCode.ERROR, _cut(facts.get("error") or facts.get("message")
                                                          or facts.get("reason") or piece.error_type)[:200]))
        span.end(end_time=_ns(piece.end if piece.end is not None else piece.start))

    def _request_attributes(self, piece: Piece, attributes: dict[str, Any]) -> None:
        facts = piece.facts
        if facts.get("model"):
            attributes["gen_ai.request.model"] = facts["model"]
        for fact, key in (("max_tokens", "gen_ai.request.max_tokens"), ("tokens_in", "gen_ai.usage.input_tokens"),
                          ("tokens_out", "gen_ai.usage.output_tokens")):
            if isinstance(facts.get(fact), int):
                attributes[key] = facts[fact]
        if facts.get("finish_reason"):
            attributes["gen_ai.response.finish_reasons"] = [str(facts["finish_reason"])]
        if isinstance(facts.get("first_token"), float):
            attributes["agentloop.time_to_first_token_s"] = round(facts["first_token"] - piece.start, 6)
        for key, value in (facts["timings"] if isinstance(facts.get("timings"), dict) else {}).items():
            attributes[f"agentloop.server.{key}"] = value
        if self.content:
            if facts.get("message") is not None:
                attributes["gen_ai.input.messages"] = _messages("user", facts["message"])
            if facts.get("reply") is not None:
                attributes["gen_ai.output.messages"] = _messages("assistant", facts["reply"],
                                                                 facts.get("finish_reason"))


_SAMPLE_ERRORS = {"error", "timeout", "killed", "died"}


def sample_span(tracer: Any, settings: Any, record: Mapping[str, Any]) -> None:
    """A span for one code sample that ended, from its results line: it ends now and began its
    duration ago (the record is all the driver of a Ray run sees)."""
    end = time.time()
    duration = record.get("duration_s")
    start = end - float(duration) if isinstance(duration, int | float) and duration >= 0 else end
    status = str(record.get("status") or "")
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        ("gen_ai.provider.name" if settings.latest else "gen_ai.system"): _PROVIDER,
        "gen_ai.tool.name": "sample", "gen_ai.tool.call.id": str(record.get("id")), "gen_ai.tool.type": "function",
        "agentloop.sample.id": str(record.get("id")), "agentloop.sample.status": status}
    for fact, key in (("exit_code", "agentloop.sample.exit_code"), ("max_rss_mb", "agentloop.sample.max_rss_mb"),
                      ("duration_s", "agentloop.sample.duration_s")):
        if isinstance(record.get(fact), int | float):
            attributes[key] = record[fact]
    if settings.content:
        attributes["gen_ai.tool.call.result"] = _cut(json.dumps(
            {"stdout": record.get("stdout"), "stderr": record.get("stderr")}, ensure_ascii=False))
    span = tracer.start_span("execute_tool sample", context=otel_context.Context(), kind=SpanKind.INTERNAL,
                             attributes=attributes, start_time=_ns(start))
    if status in _SAMPLE_ERRORS:
        span.set_attribute("error.type", status)
        span.set_status(Status(StatusCode.ERROR, _cut(record.get("message") or status)[:200]))
    span.end(end_time=_ns(end))


__all__ = ["CONTENT_CHARS", "SpanObserver", "sample_span", "schema_url"]
