"""The chat client: one conversation with one OpenAI-compatible endpoint.

``Chat`` keeps the transcript, streams replies (``/chat/completions`` with ``stream: true``),
retries what is worth retrying, and counts tokens, money and time.  It copes with the common
deviations of local servers: a JSON body where SSE was asked for, a 400 for ``stream_options``
or for ``max_tokens``, no ``usage`` at all.  Failures leave as ``ModelUnreachable`` or
``ModelResponseError`` with one message that says what to do; the API key never appears in a
message, an event or a repr.

Every request carries a reply-length cap (``max_tokens``); ``last_finish_reason`` says whether
the reply ended or was cut (``"length"``), and the agents act on it.  A user message may carry
images (``images``); an endpoint that refuses them is asked again without them, once, and the
conversation keeps none from then on (``images_refused``).  Reasoning, whether in
a field of its own or inline as ``<think>``, is shown and recorded as ``reasoning`` events and
never becomes content.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

from engine.errors import ModelResponseError, ModelUnreachable
from engine.models._http import (
    auth_headers,
    caused_by,
    nobody_listens,
    retry_after,
    start_hint,
    transport_reason,
)
from engine.models._images import (
    content_chars,
    has_images,
    image_tokens,
    join_user,
    keep_last_images,
    strip_images,
)
from engine.models._pool import ClientPool, pooled
from engine.models._reasoning import ThinkSplitter, reasoning_of, strip_think
from engine.models._registry import ModelConfig
from engine.models._stream import Assembly, normal_call, timings
from engine.secrets import redact_url
from worker.contract.bounded_json import loads as bounded_loads

__all__ = ["Chat", "Display", "MIN_REPLY_TOKENS"]

_RETRY_STATUS = {408, 429}
#: Base URLs that have answered a completion in this process (see ``Chat.request``).
_answered: set[str] = set()
_BODY_PREVIEW = 400
#: The smallest reply cap sent when the context window leaves less room than the configured cap.
MIN_REPLY_TOKENS = 256
#: Characters per token when the prompt has to be estimated for the reply cap: low on purpose
#: (code packs fewer characters into a token than prose), since too high a cap is an HTTP 400
#: on servers that check prompt + max_tokens against their window (vLLM).
_CHARS_PER_TOKEN_LOW = 3


#: What ``_finish`` reads after a stream's ``[DONE]`` at most: lines, seconds.
_AFTER_DONE_LINES, _AFTER_DONE_WAIT = 8, 0.25


async def _finish(lines: AsyncIterator[str]) -> None:
    """Read what follows a stream's ``[DONE]`` (the chunked body's last, empty chunk), so that
    its connection goes back to the client's pool for the next request instead of being closed
    unread.  A server that sends more, or not at once, has its connection closed, as before."""
    # StopAsyncIteration: the body was read to its end (the connection is kept).
    with contextlib.suppress(StopAsyncIteration, TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(_AFTER_DONE_WAIT):
            for _ in range(_AFTER_DONE_LINES):
                await anext(lines)


class Display(Protocol):
    def event(self, type: str, **fields: Any) -> None: ...


class _Transient(Exception):
    """One failed attempt that may succeed if repeated; carries the error to raise if it does not.
    ``refused``: the connection was refused (see ``Chat.request`` for when that is retried)."""

    def __init__(self, final: Exception, reason: str, retry_after: float | None = None, *,
                 refused: bool = False) -> None:
        super().__init__(reason)
        self.final = final
        self.reason = reason
        self.retry_after = retry_after
        self.refused = refused


class _StreamRefused(Exception):
    """The server rejected ``stream``/``stream_options``; ask again without streaming."""


class _CapRefused(Exception):
    """The server rejected ``max_tokens`` (OpenAI's newer models want ``max_completion_tokens``)."""


class Chat:
    """A transcript plus the client that extends it.

    ``send(text)`` appends a user message, asks the model and appends (and returns) its reply
    with any ``<think>`` part removed.  ``request(messages)`` is the lower layer: one completion
    for any message list, returning the assistant message dict (with ``tool_calls`` when the
    model made some) and leaving the transcript alone.  One ``httpx.AsyncClient`` per Chat:
    ``client`` when given (already connected while the agent was being set up), else opened on
    first use (within ``ClientPool.shared``, a batch's, the pool's for its endpoint); the Chat
    closes it in ``aclose()`` (or ``async with``), or gives a pool's back.

    Each request asks for at most ``model.max_tokens`` tokens, fewer when the model's context
    window (configured or learned from the server) leaves less room.  After a request,
    ``last_finish_reason`` is the server's (``"length"``: the reply was cut at the cap),
    ``last_max_tokens`` the cap that was sent and ``last_reasoning`` what the model thought.

    Token counts come from the server's ``usage``.  When a server reports none, they are
    estimated as characters // 4 and ``usage_estimated`` becomes True; cost follows from
    whichever counts there are.
    """

    def __init__(self, system: str, model: ModelConfig, *, display: Display | None = None, name: str = "main",
                 transport: httpx.AsyncBaseTransport | None = None, max_retries: int = 4,
                 stop: list[str] | None = None, extra_body: dict[str, Any] | None = None,
                 backoff: float = 0.5, backoff_max: float = 8.0, retry_after_max: float = 30.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.model = model
        self.name = name
        self.display = display
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.stop = list(stop) if stop else None
        self.extra_body = dict(extra_body or {})
        self.max_retries = max_retries
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.retry_after_max = retry_after_max
        self._transport = transport
        self._client: httpx.AsyncClient | None = client
        self._stream = True  # turned off for good once a server refuses streaming
        self._cap_key = "max_tokens"  # the field the server takes the reply cap in
        self._lock = asyncio.Lock()  # one send() at a time: the transcript is sequential
        # accounting
        self.context = 0
        self.last_latency = 0.0
        self.tokens_in = 0
        self.tokens_out = 0
        self.seconds = 0.0
        self.requests = 0
        self.usage_estimated = False
        self.last_finish_reason: str | None = None
        self.last_max_tokens: int | None = None
        self.last_timings: dict[str, float] | None = None  # the server's account of its time (llama-server)
        self.last_reasoning = ""
        self._counted = 0  # messages the last usage count covered (``context``)
        #: How many times ``compact`` replaced the history: a caller holding positions in
        #: ``messages`` (a tool call waiting for its answer) tells by it that they are gone.
        self.compactions = 0
        #: Why the endpoint refused images, once it has ("" while it has not): none are sent since.
        self.images_refused = ""
        self._openai = "api.openai.com" in model.base_url
        self._emit("system", prompt=system, model=model.alias)

    # ------------------------------------------------------------------ public surface

    @property
    def system(self) -> str:
        return self.messages[0]["content"]

    @property
    def cost(self) -> float:
        """USD spent by this conversation at the model's configured prices."""
        return self.model.cost(self.tokens_in, self.tokens_out)

    @property
    def stats(self) -> dict[str, Any]:
        """Cumulative use: context (tokens of the last exchange), generated, cost (USD), seconds,
        requests, tokens_in, tokens_out.  A fresh dict each time."""
        return {"context": self.context, "generated": self.tokens_out, "cost": self.cost,
                "seconds": self.seconds, "requests": self.requests,
                "tokens_in": self.tokens_in, "tokens_out": self.tokens_out}

    async def send(self, message: str, images: list[dict[str, Any]] | None = None) -> str:
        """Append ``message`` as the user's turn, get the model's reply, append it and return it
        (reasoning stripped).  If the request fails, the transcript is left as it was, so the
        same message can be sent again.  A user message directly after another (as after
        ``compact``) is merged into it, since many chat templates require alternating roles.
        ``images``: ``image_url`` parts to send with the text (``engine.models.image_part``)."""
        async with self._lock:
            saved = list(self.messages)
            self.add_user(message, images)
            self._emit("sent", message=message, count=len(self.messages))
            try:
                reply = await self.request(self.messages)
            except BaseException:
                self.messages = saved
                raise
            text = strip_think(reply.get("content") or "")
            self.messages.append({"role": "assistant", "content": text})
            self._emit("replied", message=text, stats=self.stats, latency=self.last_latency,
                       finish_reason=self.last_finish_reason, reasoning=self.last_reasoning)
            return text

    def add_user(self, text: str, images: list[dict[str, Any]] | None = None) -> None:
        """Append a user message of ``text`` and ``images`` (none once the endpoint refused
        them), joined to a user message already last; the conversation keeps its last
        ``KEPT_IMAGES`` images, the older ones become a line of text."""
        join_user(self.messages, text, [] if self.images_refused else list(images or ()))
        keep_last_images(self.messages)

    async def request(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                      tool_choice: Any = None) -> dict[str, Any]:
        """One completion for ``messages``: the assistant message dict, ``content`` always a
        string, ``tool_calls`` (OpenAI shape, assembled from stream deltas) when there are any.
        Retries connection errors, timeouts, 408, 429 and 5xx with exponential backoff; then
        raises ``ModelUnreachable`` (no connection) or ``ModelResponseError`` (error status).
        A refused connection to an endpoint that has not answered this process yet is not
        retried: nothing listens there, and waiting seconds to say so helps nobody.  Once it has
        answered, a refusal is a server restarting, and is retried like the rest."""
        self.last_max_tokens = self.reply_cap(messages)
        body: dict[str, Any] = {"model": self.model.model, "messages": messages,
                                "max_tokens": self.last_max_tokens, **self.extra_body}
        if self.stop:
            body["stop"] = self.stop
        if tools:
            body["tools"] = tools
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
        started = time.monotonic()
        try:
            try:
                message, usage = await self._with_retries(body)
            except ModelResponseError as exc:
                if not (has_images(messages) and _refuses_images(exc)):
                    raise
                # A model that takes no images (llama-server without its projector answers 500,
                # vLLM 400): the images become lines, here and in every later request.
                self.images_refused = str(exc)[:300]
                strip_images(messages)
                self._emit("note", message=f"the endpoint refused images ({self.images_refused}); they are "
                                           "sent as lines of text from now on")
                message, usage = await self._with_retries(body)
        except BaseException as exc:
            self._waited(started, error=type(exc).__name__, status=getattr(exc, "status", None))
            raise
        tokens_in, tokens_out = self._account(messages, message, usage)  # the reply's prompt and completion
        self._waited(started, tokens_in=tokens_in, tokens_out=tokens_out, finish_reason=self.last_finish_reason,
                     timings=self.last_timings)
        return message

    def _waited(self, started: float, **outcome: Any) -> None:  # count its time, say how it went
        self.last_latency = time.monotonic() - started
        self.seconds += self.last_latency
        self._emit("waited", seconds=self.last_latency, model=self.model.model, max_tokens=self.last_max_tokens,
                   **outcome)

    def reply_cap(self, messages: list[dict[str, Any]]) -> int:
        """The ``max_tokens`` to send: the model's cap, lowered to what the context window has
        left after the prompt (the server's last count plus an estimate of what came since, on
        the high side), but not below ``MIN_REPLY_TOKENS`` (nor above the cap)."""
        cap = self.model.max_tokens
        window = self.model.context_window
        if not window:
            return cap
        if self.context and 0 < self._counted <= len(messages):  # the server counted most of it
            prompt = self.context + self._chars(messages[self._counted:]) // _CHARS_PER_TOKEN_LOW
        else:
            prompt = self._chars(messages) // _CHARS_PER_TOKEN_LOW
        return max(min(cap, window - prompt), min(cap, MIN_REPLY_TOKENS))

    def _chars(self, messages: list[dict[str, Any]]) -> int:
        """Characters ``messages`` count as for an estimate of their tokens: text as it is, each
        image at its tokens' worth (``image_tokens``), tool calls as their JSON."""
        return sum(self._content_chars(m.get("content"), _CHARS_PER_TOKEN_LOW)
                   + (len(json.dumps(m["tool_calls"])) if m.get("tool_calls") else 0) for m in messages)

    def _content_chars(self, content: Any, per_token: int) -> int:
        if not isinstance(content, list):
            return len(str(content or ""))
        images = sum(image_tokens(p, self._openai) for p in content
                     if isinstance(p, dict) and p.get("type") == "image_url")
        return content_chars(content, 0) + per_token * images

    def _estimate_prompt(self, messages: list[dict[str, Any]]) -> int:
        return sum(self._content_chars(m.get("content"), 4) for m in messages) // 4

    def compact(self, summary: str) -> None:
        """Replace the whole history after the system prompt with one user message holding
        ``summary``.  What the summary leaves out is gone."""
        self.messages = [self.messages[0], {"role": "user", "content": summary}]
        self.context = self._estimate_prompt(self.messages)
        self._counted = 0
        self.compactions += 1

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await ClientPool.release(client)  # (a batch's pooled client stays open for its other runs)

    async def __aenter__(self) -> Chat:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"Chat(name={self.name!r}, model={self.model.alias!r}, messages={len(self.messages)})"

    # ------------------------------------------------------------------ transport

    @property
    def _url(self) -> str:
        return f"{self.model.base_url}/chat/completions"

    @property
    def _shown_url(self) -> str:
        """The endpoint as messages name it: no user or password (``engine.secrets``)."""
        return redact_url(self._url)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = pooled(self.model, self._transport)
        return self._client

    async def _with_retries(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        attempt = 0
        while True:
            self._emit("waiting", attempt=attempt + 1)
            try:
                return await self._attempt(body, stream=self._stream)
            except _StreamRefused:
                self._stream = False  # remembered for every later request of this Chat
                continue
            except _CapRefused:
                self._cap_key = "max_completion_tokens"  # remembered, as the stream refusal is
                continue
            except _Transient as failure:
                if attempt >= self.max_retries or (failure.refused and self.model.base_url not in _answered):
                    raise failure.final from failure.final.__cause__
                if failure.retry_after is not None:
                    wait = min(failure.retry_after, self.retry_after_max)
                else:
                    wait = min(self.backoff * 2**attempt, self.backoff_max)
                attempt += 1
                self._emit("retrying", attempt=attempt, of=self.max_retries, wait=wait, reason=failure.reason,
                           status=getattr(failure.final, "status", None))
                await asyncio.sleep(wait)

    async def _attempt(self, body: dict[str, Any], *, stream: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        payload = dict(body)
        if self._cap_key != "max_tokens" and "max_tokens" in payload:
            payload[self._cap_key] = payload.pop("max_tokens")
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        headers = {"Accept": "text/event-stream" if stream else "application/json", **auth_headers(self.model)}
        try:
            async with self._http().stream("POST", self._url, json=payload, headers=headers) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode("utf-8", errors="replace")
                    raise self._status_error(response, text, stream=stream)
                ctype = response.headers.get("content-type", "")
                if stream and "text/event-stream" in ctype:
                    lines = response.aiter_lines()
                    read = await self._read_events(lines)
                    await _finish(lines)
                    return read
                raw = (await response.aread()).decode("utf-8", errors="replace")
                if stream and raw.lstrip().startswith("data:"):  # SSE under the wrong content type
                    return await self._read_events(_lines(raw))
                return self._read_plain(raw)
        except httpx.UnsupportedProtocol as exc:
            raise ModelUnreachable(f"cannot use the model URL {self.model.shown_url}: it must start with "
                                   f"http:// or https://; fix base_url or LLM_URL") from exc
        except httpx.ConnectTimeout as exc:
            reason = f"no connection within {min(self.model.timeout, 30.0):g}s"
            raise _Transient(self._unreachable(reason, exc, start=False), reason) from exc
        except httpx.TimeoutException as exc:
            reason = f"no answer within {self.model.timeout:g}s"
            raise _Transient(self._too_slow(exc), reason) from exc
        except httpx.TransportError as exc:
            reason = transport_reason(exc)
            raise _Transient(self._unreachable(reason, exc, start=nobody_listens(exc)), reason,
                             refused=caused_by(exc, ConnectionRefusedError)) from exc

    def _status_error(self, response: httpx.Response, text: str, *, stream: bool) -> Exception:
        status = response.status_code
        if stream and status == 400 and "stream" in text.lower():
            return _StreamRefused()
        if status == 400 and self._cap_key == "max_tokens" and "max_completion_tokens" in text:
            return _CapRefused()
        hint = ""
        if status in (401, 403):
            hint = f" (check the key in ${self.model.api_key_env})"
        elif status == 404:
            hint = f" (check the URL {self.model.shown_url} and the model id {self.model.model!r})"
        error = ModelResponseError(self._redact(
            f"the model endpoint {self._shown_url} answered HTTP {status}{hint}: {text[:_BODY_PREVIEW]}"), status)
        if status in _RETRY_STATUS or status >= 500:
            return _Transient(error, f"HTTP {status}", retry_after(response.headers.get("retry-after")))
        return error

    def _unreachable(self, reason: str, exc: Exception, *, start: bool) -> ModelUnreachable:
        """No connection.  Only where nobody listens (refused, or a name that does not resolve)
        is starting a server the advice; a server that is there but slow gets other words."""
        advice = start_hint(self.model.base_url) if start else (
            "Check that the server at that address is up and reachable from here, or set LLM_URL.")
        error = ModelUnreachable(f"cannot reach the model at {self.model.shown_url} ({reason}). {advice}")
        error.__cause__ = exc
        return error

    def _too_slow(self, exc: Exception) -> ModelUnreachable:
        """A read timeout: the server took the request and did not answer in time."""
        error = ModelUnreachable(
            f"the model at {self.model.shown_url} did not answer within {self.model.timeout:g} s (the request "
            f"timeout, LLM_TIMEOUT or the alias's `timeout` in agentloop.toml): the server is there but slow. "
            f"Raise the timeout (e.g. LLM_TIMEOUT={max(600, int(self.model.timeout * 4))}) or ask for less "
            "(--max-tokens).")
        error.__cause__ = exc
        return error

    def _redact(self, text: str) -> str:
        key = self.model.api_key()
        return text.replace(key, "***") if key else text

    # ------------------------------------------------------------------ reading replies

    async def _read_events(self, lines: AsyncIterator[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Consume an SSE stream: ``data:`` lines (joined per event), ``[DONE]`` ends it; comments
        and other fields are ignored.  Content deltas go to the display as they arrive."""
        reply = Assembly()
        splitter = ThinkSplitter()
        data: list[str] = []
        async for line in lines:
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                continue
            if line.strip() or not data:
                continue  # a comment, another field, or a blank line between events
            event, data = "\n".join(data), []
            if event.strip() == "[DONE]":
                break
            self._chunk(reply, splitter, event)
        else:
            if data and "\n".join(data).strip() != "[DONE]":
                self._chunk(reply, splitter, "\n".join(data))
        self._show(reply, *splitter.flush())
        self.last_finish_reason = reply.finish_reason
        self.last_timings = reply.timings
        self.last_reasoning = "".join(reply.reasoning)
        return reply.message(), reply.usage

    def _show(self, reply: Assembly, reasoning: str, text: str) -> None:
        """Send a piece of reasoning and a piece of answer to the display, reasoning kept aside."""
        if reasoning:
            reply.reasoning.append(reasoning)
            self._emit("reasoning", text=reasoning)
        if text:
            self._emit("delta", text=text)

    def _chunk(self, reply: Assembly, splitter: ThinkSplitter, event: str) -> None:
        try:
            chunk = bounded_loads(event)
        except ValueError as exc:  # not JSON, or JSON beyond the bounds (nested too deep, a number too long)
            raise ModelResponseError(self._redact(
                f"the model endpoint {self._shown_url} streamed a chunk that is not JSON ({exc}): "
                f"{event[:_BODY_PREVIEW]}")) from None
        if not isinstance(chunk, dict):
            return
        if chunk.get("error"):
            raise ModelResponseError(self._redact(
                f"the model endpoint {self._shown_url} reported an error mid-stream: {json.dumps(chunk['error'])[:_BODY_PREVIEW]}"))
        thought, piece = reply.add(chunk)
        self._show(reply, thought, "")
        if piece:
            self._show(reply, *splitter.feed(piece))

    def _read_plain(self, raw: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        try:
            data = bounded_loads(raw)
            message = data["choices"][0]["message"]
            if not isinstance(message, dict):
                raise TypeError("message is not an object")
        except (ValueError, KeyError, IndexError, TypeError):
            raise ModelResponseError(self._redact(
                f"the model endpoint {self._shown_url} answered with a body that is not a chat completion: "
                f"{raw[:_BODY_PREVIEW]}")) from None
        self.last_finish_reason = data["choices"][0].get("finish_reason")
        self.last_timings = timings(data.get("timings"))
        result: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        calls = [normal_call(call, i) for i, call in enumerate(message.get("tool_calls") or [])]
        if calls:
            result["tool_calls"] = calls
        shown = Assembly()
        splitter = ThinkSplitter()
        self._show(shown, reasoning_of(message), "")
        self._show(shown, *splitter.feed(result["content"]))
        self._show(shown, *splitter.flush())
        self.last_reasoning = "".join(shown.reasoning)
        usage = data.get("usage")
        return result, usage if isinstance(usage, dict) else None

    def _account(self, messages: list[dict], reply: dict, usage: dict | None) -> tuple[int, int]:
        prompt = _int(usage, "prompt_tokens")
        completion = _int(usage, "completion_tokens")
        if prompt is None or completion is None:
            self.usage_estimated = True
            if prompt is None:
                prompt = self._estimate_prompt(messages)
            if completion is None:
                args = "".join(c["function"]["arguments"] for c in reply.get("tool_calls", []))
                completion = (len(reply.get("content") or "") + len(args)) // 4
        self.requests += 1
        _answered.add(self.model.base_url)
        self.tokens_in += prompt
        self.tokens_out += completion
        self.context = prompt + completion
        self._counted = len(messages) + 1  # the reply is the next message, when it is kept
        return prompt, completion

    def _emit(self, type: str, **fields: Any) -> None:
        if self.display is not None:
            self.display.event(type, name=self.name, **fields)


async def _lines(text: str) -> AsyncIterator[str]:
    for line in text.splitlines():
        yield line
    yield ""


def _refuses_images(exc: ModelResponseError) -> bool:
    """Whether an error answer is an endpoint refusing images (llama-server: "image input is not
    supported", vLLM: "is not a multimodal model", OpenAI: "image_url ... not supported")."""
    text = str(exc).lower()
    return getattr(exc, "status", None) in (400, 415, 422, 500) and (
        "image" in text or "multimodal" in text or "vision" in text)


def _int(usage: dict[str, Any] | None, key: str) -> int | None:
    value = (usage or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


