"""What a model server says about itself: the models it serves, its context size, tool support.

OpenAI-compatible servers agree on ``/chat/completions`` and little else; what they report
about themselves lives in different places:

- ``GET {base}/models`` (every server): the model ids; vLLM adds ``max_model_len``,
  llama-server a ``meta`` object per model;
- ``GET {root}/props`` (llama-server): ``default_generation_settings.n_ctx`` (one slot's
  window, what a conversation gets), ``chat_template_caps.supports_tools`` (false: the chat
  template drops tool definitions without an error) and ``modalities.vision`` (whether a
  multimodal projector is loaded: images are refused with an HTTP 500 without one);
- ``POST {root}/api/show`` (Ollama): ``capabilities`` (``"tools"``, ``"vision"`` among them or
  not) and the Modelfile's ``num_ctx``.  Some llama-server versions answer it too, for Ollama clients, but
  without ``"tools"`` whatever the template does, so it counts only where ``/props`` did not.

``{root}`` is the base URL without its ``/v1``.  Every probe is bounded by ``PROBE_TIMEOUT``
and they run at once; one that fails, times out or answers something unreadable adds
nothing, and a server that answers none is simply not described (never an error).  Results
are kept per endpoint (base URL and model id) for the life of the process, and callers
probing the same endpoint at the same time share one probe.  A server that answered nothing
is asked again next time, since it may just not have been up yet.

A server on this machine that is another user's is not asked at all (``_endpoint``): the probe
says whose it is (``ServerInfo.foreign``), and ``connect`` raises ForeignServer with those words.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import httpx

from engine.errors import ForeignServer
from engine.models._http import auth_headers, nobody_listens, open_client, start_hint, transport_reason
from engine.models._pool import ClientPool, pooled
from engine.models._registry import ModelConfig
from engine.secrets import redact_url
from worker.contract.bounded_json import loads as bounded_loads

__all__ = ["FOREIGN", "NO_SERVER", "PROBE_TIMEOUT", "ServerInfo", "connect", "forget", "probe", "root_of"]

#: Seconds one probe may take, connection included; they run concurrently.
PROBE_TIMEOUT = 2.0

#: Marks, in a probe's reason, that nobody listens at the address (see ``ServerInfo.no_server``).
NO_SERVER = "\0no server: "
#: Marks, in a probe's reason, that the server is another user's (see ``ServerInfo.foreign``).
FOREIGN = "\0foreign: "

_NUM_CTX = re.compile(r"^\s*num_ctx\s+(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ServerInfo:
    """What an endpoint reported; None (or empty) wherever it said nothing."""

    answered: bool = False
    #: HTTP status of ``GET /models``, or why it got no answer (``models_error``).
    models_status: int | None = None
    models_error: str = ""
    #: ``GET /models`` found nobody listening (refused, or a host name that does not resolve):
    #: the one case where starting a server is the advice.
    no_server: bool = False
    #: Why nothing was asked: the server is another user of this machine's (its owner named).
    foreign: str = ""
    kind: str | None = None  # "llama.cpp", "vllm" or "ollama" when recognised
    model_ids: tuple[str, ...] | None = None
    context_window: int | None = None
    context_source: str = ""  # where the window was read, e.g. "/props n_ctx"
    supports_tools: bool | None = None
    tools_source: str = ""
    vision: bool | None = None  # the model takes images
    vision_source: str = ""

    @property
    def single_model(self) -> bool:
        """The server serves one model whatever id a request names (llama-server, not in router mode)."""
        return self.kind == "llama.cpp" and (self.model_ids is None or len(self.model_ids) <= 1)

    def silence(self, base_url: str) -> str:
        """Why the endpoint at ``base_url`` gave no answer and what to do, in one sentence or
        two: how to start a server there when nobody listens, else to check the address."""
        if self.foreign:
            return self.foreign
        advice = start_hint(base_url) if self.no_server else (
            "Check that the server at that address is up and reachable from here, or set LLM_URL.")
        return f"the model at {redact_url(base_url)} does not answer ({self.models_error}). {advice}"

    def check_id(self, model_id: str) -> tuple[bool, str]:
        """(acceptable, words) for requests naming ``model_id``; words are "" when the server listed nothing."""
        if not self.model_ids:
            return True, ""
        if model_id in self.model_ids or f"{model_id}:latest" in self.model_ids:
            return True, f"model id {model_id!r} is served"
        if self.single_model:
            return True, (f"the server serves one model ({self.model_ids[0]}) and ignores the id: "
                          f"{model_id!r} gets it")
        listed = ", ".join(self.model_ids[:10]) + (", ..." if len(self.model_ids) > 10 else "")
        return False, f"model id {model_id!r} is not among the server's models: {listed}"


_cache: dict[tuple[str, str], ServerInfo] = {}
_running: dict[tuple[str, str], tuple[asyncio.AbstractEventLoop, asyncio.Task[ServerInfo]]] = {}


def forget() -> None:
    """Drop every remembered probe (for tests, and a server known to have changed)."""
    _cache.clear()
    _running.clear()


async def probe(config: ModelConfig, client: httpx.AsyncClient | None = None) -> ServerInfo:
    """What ``config``'s endpoint says about itself, asked once per process (see the module doc).

    ``client`` is used for the requests, so the connection they open can serve the first
    completion; without one a client is opened and closed here.  Never raises for anything the
    server does; bounded by about ``PROBE_TIMEOUT``."""
    key = (config.base_url, config.model)
    if key in _cache:
        return _cache[key]
    loop = asyncio.get_running_loop()
    running = _running.get(key)
    if running is None or running[0] is not loop or running[1].done():
        running = (loop, loop.create_task(_probe(config, client)))
        _running[key] = running
    task = running[1]
    info = await asyncio.shield(task)
    if _running.get(key) == running:
        del _running[key]
    if info.answered:
        _cache[key] = info
    return info


async def connect(config: ModelConfig, transport: httpx.AsyncBaseTransport | None = None
                  ) -> tuple[httpx.AsyncClient, ServerInfo]:
    """A client for ``config``'s endpoint, created now and connected by the probe it runs.

    Meant to run while the agent's worker starts and its system prompt is built, so the first
    completion finds the client made and, on servers that keep connections open, connected.
    Within ``ClientPool.shared`` (a batch's runs) the client is the pool's for that endpoint:
    ``ClientPool.release`` it, never close it."""
    client = pooled(config, transport)
    try:
        info = await probe(config, client)
        if info.foreign:
            raise ForeignServer(info.foreign)
        return client, info
    except BaseException:
        await ClientPool.release(client)
        raise


def root_of(base_url: str) -> str | None:
    """The server's root for its own routes (``/props``, ``/api/show``): the base URL without
    ``/v1``; None when the base URL does not end in it (then those routes are not guessed at)."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else None


async def _probe(config: ModelConfig, client: httpx.AsyncClient | None) -> ServerInfo:
    own = client is None
    client = client or open_client(config)
    try:
        headers = auth_headers(config)
        root = root_of(config.base_url)
        asks = [_ask(client, "GET", f"{config.base_url.rstrip('/')}/models", headers)]
        if root is not None:
            asks.append(_ask(client, "GET", f"{root}/props", headers))
            asks.append(_ask(client, "POST", f"{root}/api/show", headers, {"model": config.model}))
        answers = await asyncio.gather(*asks)
    finally:
        if own:
            await client.aclose()
    models = answers[0]
    props, show = (answers[1], answers[2]) if root is not None else ((None, None, ""), (None, None, ""))
    return _read(config.model, models, props, show)


async def _ask(client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str],
               body: dict[str, Any] | None = None) -> tuple[int | None, Any, str]:
    """(status, JSON body or None, why there was no answer) of one bounded request."""
    try:
        response = await asyncio.wait_for(
            client.request(method, url, headers=headers, json=body, timeout=PROBE_TIMEOUT), PROBE_TIMEOUT)
    except TimeoutError:
        return None, None, f"no answer within {PROBE_TIMEOUT:g}s"
    except httpx.TimeoutException:
        return None, None, f"no answer within {PROBE_TIMEOUT:g}s"
    except ForeignServer as exc:
        return None, None, FOREIGN + str(exc)
    except httpx.TransportError as exc:
        return None, None, (NO_SERVER if nobody_listens(exc) else "") + transport_reason(exc)
    except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: a client closed under a shared probe
        return None, None, type(exc).__name__
    try:
        data = bounded_loads(response.content) if response.status_code == 200 else None
    except ValueError:  # not JSON, or beyond the bounds: it says nothing then
        data = None
    return response.status_code, data, ""


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _read(model_id: str, models: tuple[int | None, Any, str], props: tuple[int | None, Any, str],
          show: tuple[int | None, Any, str]) -> ServerInfo:
    """The ServerInfo of three probe answers (see the module doc for what each holds)."""
    fields: dict[str, Any] = {"answered": any(status is not None for status, _, _ in (models, props, show)),
                              "models_status": models[0], "models_error": models[2].removeprefix(NO_SERVER),
                              "no_server": models[2].startswith(NO_SERVER)}
    foreign = next((why for _, _, why in (models, props, show) if why.startswith(FOREIGN)), "")
    if foreign:
        return ServerInfo(models_error=foreign.removeprefix(FOREIGN), foreign=foreign.removeprefix(FOREIGN))
    window: list[tuple[int | None, str]] = []

    entries = models[1].get("data") if isinstance(models[1], dict) else None
    if isinstance(entries, list):
        entries = [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]
        fields["model_ids"] = tuple(e["id"] for e in entries)
        mine = next((e for e in entries if e["id"] == model_id), entries[0] if len(entries) == 1 else None)
        if mine is not None:
            meta = mine.get("meta") if isinstance(mine.get("meta"), dict) else {}
            window.append((_whole(meta.get("n_ctx")), "/v1/models meta.n_ctx"))
            window.append((_whole(mine.get("max_model_len")), "/v1/models max_model_len"))
            if mine.get("owned_by") == "vllm" or "max_model_len" in mine:
                fields["kind"] = "vllm"
            elif mine.get("owned_by") == "llamacpp":
                fields["kind"] = "llama.cpp"

    body = props[1] if isinstance(props[1], dict) else {}
    settings = body.get("default_generation_settings")
    if isinstance(settings, dict):
        fields["kind"] = "llama.cpp"
        window.insert(0, (_whole(settings.get("n_ctx")), "/props n_ctx"))  # one slot's: what a request gets
        caps = body.get("chat_template_caps")
        if isinstance(caps, dict) and isinstance(caps.get("supports_tools"), bool):
            fields["supports_tools"] = caps["supports_tools"]
            fields["tools_source"] = "/props chat_template_caps.supports_tools"
        modalities = body.get("modalities")
        if isinstance(modalities, dict) and isinstance(modalities.get("vision"), bool):
            fields["vision"] = modalities["vision"]
            fields["vision_source"] = "/props modalities.vision"
    elif isinstance(show[1], dict) and isinstance(show[1].get("capabilities"), list):
        fields["kind"] = fields.get("kind") or "ollama"
        fields["supports_tools"] = "tools" in show[1]["capabilities"]
        fields["tools_source"] = "/api/show capabilities"
        fields["vision"] = "vision" in show[1]["capabilities"]
        fields["vision_source"] = "/api/show capabilities"
        parameters = show[1].get("parameters")
        found = _NUM_CTX.search(parameters) if isinstance(parameters, str) else None
        window.append((int(found.group(1)) if found else None, "/api/show num_ctx"))

    size, source = next(((n, where) for n, where in window if n), (None, ""))
    fields["context_window"] = size
    fields["context_source"] = source
    return ServerInfo(**fields)
