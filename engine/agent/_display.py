"""Displays: where an agent's typed events go (a console, a recording, several at once).

Events carry only what is safe to show or store: prompts, replies, code, output, timings, costs.
No credentials travel in events, by design; keep it that way when adding one.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine import trust
from engine.errors import ConfigError
from worker.contract.bounded_json import loads as bounded_loads

__all__ = [
    "AgentDisplay", "DispatchDisplay", "FanoutDisplay", "JsonlRecorder", "accepted_kwargs",
    "read_recording", "replay"
]


class AgentDisplay:
    """Everything an agent reports flows through one method: ``event(type, **fields)``. The base is a no-op.

    Event types and their fields::

        system(name, prompt)                       the system prompt of agent `name`
        sent(name, message, count)                 a message sent to the model; count = messages so far
        replied(name, message, stats, latency, finish_reason, reasoning)
                                                   the model's full reply, usage stats, seconds taken,
                                                   why it ended ("length": cut at the cap), its reasoning
        waiting(name, attempt)                     a request went out; nothing of the reply has arrived yet
        waited(name, seconds, model, max_tokens, tokens_in, tokens_out, finish_reason, timings, error, status)
                                                   the request ended after that long: answered (its tokens,
                                                   why the reply ended, the server's own ``timings``) or
                                                   failed (``error``: the exception's type; ``status``: HTTP)
        retrying(name, attempt, of, wait, reason, status)
                                                   an attempt failed (status: its HTTP status, or None);
                                                   attempt `attempt` of `of` retries comes after `wait` s
        delta(name, text)                          a piece of the reply as it streams in
        reasoning(name, text)                      a piece of the model's reasoning as it streams in
                                                   (never part of the reply, never sent back)
        endpoint(name, model, kind, context_window, context_source, supports_tools, model_ids)
                                                   what the model's server reported about itself
        launched(name, id, timeout, heartbeat, code)   a <run_code> block started
        output(name, id, stream, text)             a live output chunk of a running block ("stdout"/"stderr")
        display(name, id, index, line, text, width, height, files, note, png, svg, html)
                                                   block `id` displayed something (its `index`-th):
                                                   `line` its one line (an image's size and file),
                                                   `text` what a reader of text gets, and what a
                                                   viewer shows: `png` (base64), `svg`, `html` (text)
        progress(name, id, current, output)        a heartbeat: seconds so far, output so far
        finished(name, id, duration, cancelled, output, status, output_bytes, killed, lost, message)
                                                   a block ended (output ends in [timed out]/[cancelled]);
                                                   status as BlockResult's; killed: its worker was killed,
                                                   taking the variables named in ``lost``
        connection(name, id, host, port, method, verdict, why, words, status, address, sent, received, seconds)
                                                   block `id`'s code made a connection through its
                                                   sandbox's way out (``--allow-net``): "allowed",
                                                   "refused" or "failed", why, bytes each way
        cancelled(name, label)                     something of `name` was cancelled, and why
        failed(name, message)                      something of `name` could not be done
        agent_started(name, parent, model, task, forked?)
                                                   a sub-agent began; parent is None for the top agent;
                                                   forked: its worker is a fork of its parent's
        agent_finished(name, status, duration, reason, error_type)
                                                   an agent ended: "answered", "failed", "cancelled";
                                                   reason: why it failed ("" otherwise), error_type: the
                                                   exception's type
        run_started(name, task, model)             a run of the top agent `name` began (``run_task``)
        run_finished(name, status, error, error_type, tokens_in, tokens_out, cost, duration)
                                                   that run ended: "answered", "failed", "timed_out",
                                                   "cancelled"; its totals, sub-agents included
        note(name, message)                        a one-line notice (sandbox state, retries, ...)

    Renderers must tolerate event types and fields they do not know: new ones get added.
    """

    def event(self, type: str, **fields: Any) -> None:
        pass


def accepted_kwargs(handler: Callable[..., Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The subset of `fields` that `handler` declares by name (all of them when it takes ``**kwargs``), so an
    event can carry an optional field that only some renderers render without the others raising on it."""
    params = inspect.signature(handler).parameters.values()
    if any(param.kind == inspect.Parameter.VAR_KEYWORD for param in params):
        return fields
    names = {param.name for param in params}
    return {key: value for key, value in fields.items() if key in names}


class DispatchDisplay(AgentDisplay):
    """For renderers: routes each event to the same-named method (``def launched(self, name, id, ...)``) if
    defined, ignoring event types the subclass does not handle and fields the handler does not declare."""

    def event(self, type: str, **fields: Any) -> None:
        handler = getattr(self, type, None)
        if callable(handler):
            handler(**accepted_kwargs(handler, fields))


class FanoutDisplay(AgentDisplay):
    """Sends every event to several displays at once, e.g. a console renderer plus a JSONL recorder."""

    def __init__(self, displays: Iterable[AgentDisplay]):
        self.displays = list(displays)

    def event(self, type: str, **fields: Any) -> None:
        for display in self.displays:
            display.event(type, **fields)


def _jsonable(value: Any) -> Any:
    """`value` with everything JSON cannot hold replaced by its repr (dict keys become strings)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {key if isinstance(key, str) else repr(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return repr(value)


class JsonlRecorder(AgentDisplay):
    """Appends each event as one JSON line ``{"t": epoch_seconds, "type": ..., **fields}``.

    Strings are kept whole; values JSON cannot hold are stored as their repr. Each line is written and
    flushed as the event happens, so a crash loses at most the line being written (read_recording skips
    it). Safe to call from several threads; events after close() are dropped.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # Model text goes into this file: a link a worker left on its way (into ~/.bashrc, say)
        # must not carry it elsewhere (UntrustedFile).
        trust.check(self.path, "the recording", writing=True)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # closed in close()
        self._lock = threading.Lock()

    def event(self, type: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "type": type, **_jsonable(fields)}, ensure_ascii=False)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> JsonlRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_recording(path: str | Path) -> list[dict[str, Any]]:
    """The events of a JsonlRecorder file, in order. A torn last line (the writer died mid-line) is
    skipped; a damaged line anywhere else raises ConfigError naming it."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = bounded_loads(line)
        except ValueError as error:  # not JSON, or beyond the bounds (nested too deep, a number too long)
            if number == len(lines):
                break
            raise ConfigError(f"{path}:{number}: not a recorded event ({getattr(error, 'msg', error)})") from error
        if not isinstance(record, dict) or "type" not in record:
            raise ConfigError(f"{path}:{number}: not a recorded event (no type)")
        events.append(record)
    return events


def replay(path: str | Path, display: AgentDisplay) -> int:
    """Feeds the events recorded in `path` to `display`, without their timestamps; returns how many."""
    events = read_recording(path)
    for record in events:
        fields = {key: value for key, value in record.items() if key not in ("t", "type")}
        display.event(record["type"], **fields)
    return len(events)
