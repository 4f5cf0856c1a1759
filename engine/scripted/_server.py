"""A scripted OpenAI-compatible model server: real HTTP on 127.0.0.1, replies from a script.

It lets the engine run end to end without a model (``agentloop demo``, the tests, a user trying
things out).  It answers ``POST /v1/chat/completions`` (plain JSON or SSE streaming, with usage,
tool calls, reasoning, ``stop`` and ``max_tokens`` handling) and ``GET /v1/models``, and records
every request it gets.  ``like_llama_server``, ``like_vllm`` and ``like_ollama`` make one that
also answers what those servers answer about themselves (``/props``, their ``/v1/models``,
``/api/show``) in their shapes, and streams as they do.

A script maps *keys* to lists of turns.  A request belongs to the first key (in script order)
that is a substring of its first user message, else to ``"*"``; its turn is the number of
assistant messages it already carries.  So concurrent conversations, each with its own task
text, get their own deterministic replies.  A turn is

- a string: the assistant's content;
- a dict ``{"content": ..., "tool_calls": [{"id": ..., "name": ..., "arguments": "{...}"}]}``,
  optionally with ``"reasoning"`` (streamed first, in its own field) and ``"finish_reason"``;
- ``Fail(status, times)``: answer that error status ``times`` times before the turn after it
  (Fails do not count as turns, so retried requests land on the right reply);
- ``Delay(seconds, then=turn)``: wait, then answer ``then``;
- a callable ``(request_body) -> turn`` for replies computed from the request.

A conversation past its last turn gets ``"(script exhausted)"``, plain text, so loops end.
A request's ``max_tokens`` is honoured as real servers do, at four characters a token (the
rate ``usage`` is counted at): what goes beyond is cut, and ``finish_reason`` is ``"length"``.

Every completion request is checked against the rules strict servers (OpenAI, vLLM) enforce on
a message sequence (``sequence_problems``); a request that breaks them is still answered, as
lenient local servers do, but recorded in ``violations`` and in ``take_invalid()``, which the
test suite checks after every test.

Run one by hand with ``agentloop scripted [SCRIPT.json]`` (``engine.cli.scripted``; JSON turns:
strings, tool-call dicts, ``{"fail": 500, "times": 2}``, ``{"delay": 1.5, "then": ...}``).
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine.scripted._sequence import record_invalid, sequence_problems
from engine.scripted._turns import EXHAUSTED, Delay, Fail, Script

__all__ = ["CHARS_PER_TOKEN", "Received", "ScriptedServer"]

_MAX_BODY = 64 * 1024 * 1024


@dataclass
class Received:
    """One request as the server saw it: headers lower-cased, body parsed, and the conversation
    key and turn index it was matched to (None for requests that are not completions)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    key: str | None = None
    turn: int | None = None
    status: int = 200
    at: float = field(default_factory=time.monotonic)
    peer: int | None = None  # the client's port: requests on one connection share it
    problems: list[str] = field(default_factory=list)  # the sequence rules it breaks


#: Characters per token, for ``usage`` and for honouring ``max_tokens``.
CHARS_PER_TOKEN = 4


class ScriptedServer:
    """The server; ``with ScriptedServer(script) as srv:`` starts it and ``srv.url`` is its base URL.

    ``streaming=False`` answers streaming requests with plain JSON (as some servers do);
    ``usage=False`` leaves ``usage`` out.  ``routes`` maps further paths (``/props``,
    ``/api/show``, or ``/v1/models`` to replace the default) to what they answer, GET or POST:
    a JSON value, a ``Fail``, or a callable ``(request_body) -> either``.  ``timings`` is added
    as llama-server adds its own: to the stream's last chunk (the one with empty ``choices``
    and ``usage``), to the finishing chunk when usage was not asked for, and to plain replies;
    ``reasoning_field`` names the delta field reasoning streams in; ``close_after_stream``
    closes the connection after each streamed reply, without saying so in a header (as
    llama-server does).  ``refuse_images``: a request holding an ``image_url`` part is answered
    HTTP 500 with these words, as a server without a vision model answers (llama-server).
    ``requests`` and ``received`` grow as requests arrive; read them from any thread."""

    def __init__(self, script: Script | Mapping[str, Sequence[Any]] | Sequence[Any], *, host: str = "127.0.0.1",
                 port: int = 0, chunk_chars: int = 20, streaming: bool = True, usage: bool = True,
                 model_id: str = "scripted", routes: Mapping[str, Any] | None = None,
                 timings: Mapping[str, Any] | None = None, reasoning_field: str = "reasoning_content",
                 close_after_stream: bool = False, refuse_images: str = "") -> None:
        self.script = script if isinstance(script, Script) else Script(script)
        self.host = host
        self.port = port
        self.chunk_chars = max(1, chunk_chars)
        self.streaming = streaming
        self.usage = usage
        self.model_id = model_id
        self.routes = dict(routes or {})
        self.timings = dict(timings) if timings is not None else None
        self.reasoning_field = reasoning_field
        self.close_after_stream = close_after_stream
        self.refuse_images = refuse_images
        self.received: list[Received] = []
        #: Requests whose message sequence a strict server would refuse (see ``sequence_problems``).
        self.violations: list[Received] = []
        self._fails_used: dict[tuple[str, int, int], int] = {}
        self._lock = threading.Condition()
        self._closing = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> ScriptedServer:
        """Take the port and listen (connections queue from here on) without answering yet:
        ``start`` answers.  A process may fork between the two, and its child serve."""
        if self._httpd is None:
            self._httpd = _HTTPServer((self.host, self.port), _Handler, self)
            self.port = self._httpd.server_address[1]
        return self

    def start(self) -> ScriptedServer:
        self.bind()
        if self._thread is None:
            self._started = time.monotonic()
            self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                            name=f"scripted-model:{self.port}", daemon=True)
            self._thread.start()
        return self

    def wait_idle(self, idle: float | None) -> None:
        """Block until the server is closed, or has received nothing for ``idle`` seconds
        (None: until closed)."""
        while True:
            with self._lock:
                last = self.received[-1].at if self.received else self._started
            left = None if idle is None else last + idle - time.monotonic()
            if left is not None and left <= 0:
                return
            if self._closing.wait(1.0 if left is None else min(left, 1.0)):
                return

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and cut open connections; returns within about ``timeout`` seconds."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._closing.set()
        httpd.shutdown()
        httpd.server_close()
        httpd.cut_connections()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # ------------------------------------------------------------------ what was received

    @property
    def requests(self) -> list[Any]:
        """The parsed JSON bodies of every completion request, in arrival order."""
        with self._lock:
            return [r.body for r in self.received if r.turn is not None]

    def conversation(self, key: str) -> list[Any]:
        """The request bodies that were matched to ``key``."""
        with self._lock:
            return [r.body for r in self.received if r.key == key]

    def wait_requests(self, count: int, timeout: float = 10.0) -> bool:
        """Block until at least ``count`` completion requests arrived; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len([r for r in self.received if r.turn is not None]) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    # ------------------------------------------------------------------ answering

    def _record(self, received: Received) -> None:
        with self._lock:
            self.received.append(received)
            self._lock.notify_all()

    def _choose(self, body: dict[str, Any]) -> tuple[str | None, int, Any]:
        """(key, turn index, what to answer): a Fail to send now, or the turn."""
        messages = body.get("messages") or []
        task = next((_text(m.get("content")) for m in messages if isinstance(m, dict) and m.get("role") == "user"), "")
        index = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        key = self.script.match(task)
        if key is None:
            return None, index, f"(no scripted conversation matches this task; keys: {', '.join(self.script.keys())})"
        step = self.script.step(key, index)
        if step is None:
            return key, index, EXHAUSTED
        with self._lock:
            for position, fail in enumerate(step.fails):
                used = self._fails_used.get((key, index, position), 0)
                if used < fail.times:
                    self._fails_used[key, index, position] = used + 1
                    return key, index, fail
        return key, index, step.turn

    def _resolve(self, turn: Any, body: dict[str, Any]) -> Any:
        """Follow Delays and callables down to a Fail, a str or a dict."""
        for _ in range(32):
            if isinstance(turn, Delay):
                self._closing.wait(turn.seconds)
                turn = turn.then
            elif isinstance(turn, Fail | str | dict):
                return turn
            elif callable(turn):
                turn = turn(body)
            else:
                raise TypeError(f"unsupported script turn {turn!r}")
        raise TypeError("script turn nests Delays or callables more than 32 deep")

    def _completion(self, handler: _Handler, body: dict[str, Any]) -> None:
        key, index, turn = self._choose(body)
        record = Received("POST", handler.path, _headers(handler), body, key, index, peer=handler.client_address[1],
                          problems=sequence_problems(body.get("messages")))
        if record.problems:
            with self._lock:
                self.violations.append(record)
            record_invalid(f"{self.url} (conversation {key!r}, turn {index}): {'; '.join(record.problems)}")
        self._record(record)  # on arrival, so a delayed reply is already visible
        try:
            turn = self._resolve(turn, body)
        except Exception as exc:  # a broken script is reported to the client, not swallowed
            record.status = 500
            handler.send_json(500, {"error": {"message": f"script error: {exc!r}", "type": "script_error"}})
            return
        if self._closing.is_set():  # closed during a Delay: the client sees the connection drop
            handler.close_connection = True
            return
        if self.refuse_images and _images(body.get("messages")):
            record.status = 500
            handler.send_json(500, {"error": {"code": 500, "message": self.refuse_images, "type": "server_error"}})
            return
        if isinstance(turn, Fail):
            record.status = turn.status
            headers = {"Retry-After": f"{turn.retry_after:g}"} if turn.retry_after is not None else {}
            if turn.body:
                handler.send_raw(turn.status, turn.body.encode(), "text/plain; charset=utf-8", headers)
            else:
                handler.send_json(turn.status, {"error": {"message": f"scripted failure (HTTP {turn.status})",
                                                          "type": "scripted_failure"}}, headers)
            return
        content, calls = _reply_parts(turn, key or "", index)
        reasoning = str(turn.get("reasoning") or "") if isinstance(turn, dict) else ""
        content, stopped = _apply_stop(content, body.get("stop"))
        finish = "tool_calls" if calls and not stopped else "stop"
        if isinstance(turn, dict) and turn.get("finish_reason"):
            finish = str(turn["finish_reason"])
        cap = _cap(body)
        if cap is not None and len(reasoning) + len(content) + _arguments(calls) > cap * CHARS_PER_TOKEN:
            budget = cap * CHARS_PER_TOKEN
            reasoning, content, calls = reasoning[:budget], content[:max(0, budget - len(reasoning))], []
            finish = "length"
        usage = self._usage(body, reasoning + content, calls)
        model = body.get("model") or self.model_id
        if body.get("stream") and self.streaming:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            handler.send_events(self._chunks(model, reasoning, content, calls, finish,
                                             usage if include_usage else None),
                                close=self.close_after_stream)
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                message[self.reasoning_field] = reasoning
            if calls:
                message["tool_calls"] = calls
            reply: dict[str, Any] = {"id": _completion_id(), "object": "chat.completion", "created": int(time.time()),
                                     "model": model, "choices": [{"index": 0, "message": message,
                                                                  "finish_reason": finish}]}
            if usage is not None:
                reply["usage"] = usage
            if self.timings is not None:
                reply["timings"] = self.timings
            handler.send_json(200, reply)

    def _usage(self, body: dict[str, Any], content: str, calls: list[dict[str, Any]]) -> dict[str, int] | None:
        if not self.usage:
            return None
        prompt = "".join(_text(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict))
        generated = content + "".join(c["function"]["arguments"] for c in calls)
        tokens_in, tokens_out = max(1, len(prompt) // 4), max(1, len(generated) // 4)
        return {"prompt_tokens": tokens_in, "completion_tokens": tokens_out, "total_tokens": tokens_in + tokens_out}

    def _chunks(self, model: str, reasoning: str, content: str, calls: list[dict[str, Any]], finish: str,
                usage: dict[str, int] | None) -> list[dict[str, Any]]:
        ident, created = _completion_id(), int(time.time())

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

        size = self.chunk_chars
        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({self.reasoning_field: reasoning[i:i + size]}) for i in range(0, len(reasoning), size)]
        out += [chunk({"content": content[i:i + size]}) for i in range(0, len(content), size)]
        for index, call in enumerate(calls):
            function = call["function"]
            out.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                              "function": {"name": function["name"], "arguments": ""}}]}))
            arguments = function["arguments"]
            out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": arguments[i:i + size]}}]})
                    for i in range(0, len(arguments), size)]
        out.append(chunk({}, finish))
        timings = {"timings": self.timings} if self.timings is not None else {}
        if usage is not None:
            out.append({"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": usage, **timings})
        else:
            out[-1].update(timings)
        return out

    def _route(self, handler: _Handler, method: str, body: Any) -> bool:
        """Answer a request for one of ``routes``; False when its path is not one."""
        path = handler.path.split("?", 1)[0]
        if path not in self.routes:
            return False
        answer = self.routes[path]
        if callable(answer) and not isinstance(answer, Fail):
            answer = answer(body)
        status = answer.status if isinstance(answer, Fail) else 200
        self._record(Received(method, handler.path, _headers(handler), body, status=status,
                              peer=handler.client_address[1]))
        if isinstance(answer, Fail):
            handler.send_json(answer.status, {"error": {"code": answer.status, "message": answer.body or "Not Found",
                                                        "type": "not_found_error"}})
        else:
            handler.send_json(200, answer)
        return True


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # close() cuts connections itself, with a bound

    def __init__(self, address: tuple[str, int], handler: type, owner: ScriptedServer) -> None:
        self.owner = owner
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.discard(request)

    def cut_connections(self) -> None:
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away mid-reply is not the server's problem


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # idle keep-alive connections end on their own
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        owner = self.server.owner
        if owner._route(self, "GET", None):
            return
        owner._record(Received("GET", self.path, _headers(self), None, peer=self.client_address[1]))
        if self.path.rstrip("/").endswith("/models"):
            self.send_json(200, {"object": "list", "data": [{"id": owner.model_id, "object": "model",
                                                             "owned_by": "agentloop"}]})
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self) -> None:
        owner = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(min(length, _MAX_BODY)) if length else b""
        if self.path.split("?", 1)[0] in owner.routes:
            try:
                routed = json.loads(raw) if raw else None
            except ValueError:
                routed = None
            owner._route(self, "POST", routed)
            return
        if not self.path.rstrip("/").endswith("/chat/completions"):
            owner._record(Received("POST", self.path, _headers(self), None, status=404))
            self.send_json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except ValueError as exc:
            owner._record(Received("POST", self.path, _headers(self), None, status=400))
            self.send_json(400, {"error": {"message": f"invalid JSON body: {exc}", "type": "invalid_request"}})
            return
        owner._completion(self, body)

    # ------------------------------------------------------------------ writing

    def send_raw(self, status: int, data: bytes, ctype: str, headers: Mapping[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def send_json(self, status: int, obj: Any, headers: Mapping[str, str] | None = None) -> None:
        self.send_raw(status, json.dumps(obj).encode(), "application/json", headers)

    def send_events(self, chunks: list[dict[str, Any]], close: bool = False) -> None:
        """SSE over chunked transfer encoding, one flush per event so clients see deltas arrive;
        ``close``: the connection ends with the reply."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for data in [json.dumps(c) for c in chunks] + ["[DONE]"]:
                event = f"data: {data}\n\n".encode()
                self.wfile.write(b"%X\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            self.close_connection = close
        except OSError:
            self.close_connection = True


def _headers(handler: BaseHTTPRequestHandler) -> dict[str, str]:
    return {name.lower(): value for name, value in handler.headers.items()}


def _text(content: Any) -> str:
    """The text of a message content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _images(messages: Any) -> int:
    """How many ``image_url`` parts the messages of a request hold."""
    if not isinstance(messages, list):
        return 0
    return sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url")


def _reply_parts(turn: str | dict[str, Any], key: str, index: int) -> tuple[str, list[dict[str, Any]]]:
    if isinstance(turn, str):
        return turn, []
    calls = []
    for position, call in enumerate(turn.get("tool_calls") or []):
        function = call.get("function") or call
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append({"id": call.get("id") or f"call_{index}_{position}", "type": "function",
                      "function": {"name": function.get("name", ""), "arguments": arguments}})
    return str(turn.get("content") or ""), calls


def _cap(body: dict[str, Any]) -> int | None:
    """The reply cap a request asks for, under any of the names servers take it by."""
    for key in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _arguments(calls: list[dict[str, Any]]) -> int:
    return sum(len(call["function"]["arguments"]) for call in calls)


def _apply_stop(content: str, stop: Any) -> tuple[str, bool]:
    """Cut ``content`` before the earliest stop string, as real servers do (stop not included)."""
    if isinstance(stop, str):
        stop = [stop]
    cuts = [content.find(s) for s in stop or [] if isinstance(s, str) and s and s in content]
    if not cuts:
        return content, False
    return content[:min(cuts)], True


_ids = itertools.count(1)


def _completion_id() -> str:
    return f"chatcmpl-scripted-{next(_ids)}"
