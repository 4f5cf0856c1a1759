"""``agentloop serve``: SandboxFusion's ``/run_code`` over HTTP, each request a code sample
(``engine.samples``) run in a sandbox of its own by slots that stay warm between requests.

Routes, behind the gate of ``http_gate`` (the owner's token in the path or as ``Authorization:
Bearer``, then the DNS-rebinding checks):

    POST /run_code     one RunCodeRequest -> one RunCodeResponse (``run_code_api``)
    POST /run_batch    a JSON array of RunCodeRequests -> the array of their responses, in order
    GET  /v1/ping      "pong", as SandboxFusion answers it (``agentloop doctor --serve``)

Bounds, each answered in words: a body over ``max_body`` bytes is 413 (read and dropped up to
four times the bound, so that the client reads the answer; past that, at once); a batch of more
than ``max_batch`` requests, or more than may run and wait at once, is 413; a body that is
not JSON, or a request not of SandboxFusion's shape, is 422.  At most ``parallel`` samples run at
once, all requests together; up to ``queue`` more wait for a slot (a request that waits is not
answered until it has run: clients see latency, not errors); a request that would take the
samples waiting past ``queue`` is answered 429 at once, with ``Retry-After``; connections past
``parallel + queue + 64`` are answered 503 by uvicorn before they are read.  A request's
``run_timeout`` and ``memory_limit_MB`` are lowered to the server's (the response's message says
so); a lower memory limit is enforced too, by slots kept for it.

SIGTERM (or Ctrl-C) stops the server taking connections, lets every request already read run
to its end and be answered, then stops every slot; the process then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, InvalidRequest, ServiceBusy
from engine.integrations.http_gate import ServerToken, TokenGate, listen, server_keeping_signals
from engine.integrations.run_code_api import (
    LANGUAGES,
    RequestLimits,
    Run,
    parse_request,
    refused,
    response,
)
from engine.launch import WorkerSettings
from engine.samples import SampleResult
from engine.workers import Engine
from worker.contract.framing import FrameError, decode_json

__all__ = ["OUTPUT_BYTES", "ServeConfig", "Service", "run", "serve_http"]

log = logging.getLogger("agentloop")

#: Bytes of each stream's head and of its tail kept (about SandboxFusion's 1 MiB a stream).
OUTPUT_BYTES = 512 * 1024
#: How many times ``max_body`` an oversized body is read (and dropped) before the 413.
_DISCARDED = 4
#: Connections beyond those that may hold a sample (``parallel`` + ``queue``) served at once.
_MARGIN = 64
#: Seconds a request already read may take to be answered once SIGTERM came, past its deadline.
_DRAIN_SLACK = 30.0


@dataclass(frozen=True)
class ServeConfig:
    """The server's settings: how its samples are contained (``settings``: the worker options),
    the limits no request can raise (``limits``), how many samples run at once (``parallel``)
    and wait (``queue``), the largest body and batch, and where its runs' directories go."""

    settings: WorkerSettings
    limits: RequestLimits
    parallel: int
    queue: int
    max_body: int
    max_batch: int
    cwd: Path


class Service:
    """The samples of every request: one engine per memory limit asked for (its slots warm from
    one request to the next), ``parallel`` samples at once, ``queue`` more waiting."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self._engines: dict[int | None, Engine] = {}
        self._running = asyncio.Semaphore(config.parallel)
        self._admitted = 0
        self._ids = itertools.count(1)

    def _engine(self, memory: int | None) -> Engine:
        engine = self._engines.get(memory)
        if engine is None:
            settings = self.config.settings
            settings = settings.replace(sandbox=replace(settings.sandbox, memory_bytes=memory))
            engine = self._engines[memory] = Engine(settings, cwd=self.config.cwd, pool=0)
        return engine

    def parse(self, body: Any) -> Run:
        """``body`` as a run (InvalidRequest in words)."""
        return parse_request(body, next(self._ids), self.config.limits)

    @contextlib.contextmanager
    def admitted(self, count: int) -> Iterator[None]:
        """Room for ``count`` samples among those running and waiting; ServiceBusy when there is none."""
        if self._admitted + count > self.config.parallel + self.config.queue:
            raise ServiceBusy(f"{self._admitted} samples are running or waiting here, and this server lets "
                       f"{self.config.parallel} run and {self.config.queue} wait; retry later")
        self._admitted += count
        log.info("serve: %d sample%s admitted, %d running or waiting", count, "" if count == 1 else "s",
                 self._admitted)
        try:
            yield
        finally:
            self._admitted -= count

    async def answer(self, run: Run) -> dict:
        """The response to ``run``, once it ran (waiting for a free slot first)."""
        if run.language not in LANGUAGES:
            return refused(run.language)
        async with self._running:
            result = await self._one(run)
        return response(result, run.notes)

    async def _one(self, run: Run) -> SampleResult:
        engine = self._engine(run.memory_bytes)
        results = engine.map([run.sample], concurrency=1, timeout=run.sample.timeout or 10.0,
                             output_bytes=OUTPUT_BYTES)
        try:
            async for result in results:
                return result
        finally:
            await results.aclose()
        raise AssertionError("a sample without a result")  # map_samples yields one per sample

    async def close(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        await asyncio.gather(*(e.shutdown() for e in engines), return_exceptions=True)


def _json(status: int, value: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[int, bytes, tuple]:
    return status, json.dumps(value, ensure_ascii=False).encode("utf-8"), headers


def _words(status: int, words: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[int, bytes, tuple]:
    return _json(status, {"detail": words}, headers)


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    """The client left before its body was read: nothing to answer."""


class App:
    """The ASGI application behind the gate (the module docstring's routes and bounds)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.max_body = service.config.max_body

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        try:
            status, body, headers = await self._route(scope, receive)
        except _Gone:
            return
        except _TooLarge:
            status, body, headers = _words(413, f"the request body is over this server's {self.max_body} bytes "
                                                "(--max-body); send fewer or smaller samples a request")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": body})

    async def _route(self, scope: dict, receive: Callable) -> tuple[int, bytes, tuple]:
        method, path = scope.get("method", ""), scope.get("path", "").rstrip("/")
        if path == "/v1/ping":
            return _json(200, "pong") if method in ("GET", "HEAD") else _words(405, "GET /v1/ping")
        if path not in ("/run_code", "/run_batch"):
            return _words(404, "not found: this server answers POST /run_code, POST /run_batch and GET /v1/ping")
        if method != "POST":
            return _words(405, f"{path} takes POST")
        raw = await self._body(scope, receive)
        try:
            value = decode_json(raw, self.max_body)
        except FrameError as exc:
            return _words(422, f"the body is not JSON: {exc}")
        try:
            if path == "/run_code":
                run = self.service.parse(value)
                with self.service.admitted(1):
                    return _json(200, await self.service.answer(run))
            if not isinstance(value, list):
                return _words(422, "/run_batch takes a JSON array of run_code requests")
            if len(value) > self.service.config.max_batch:
                return _words(413, f"a batch of {len(value)} requests is over this server's "
                                   f"{self.service.config.max_batch} (--max-batch)")
            room = self.service.config.parallel + self.service.config.queue
            if len(value) > room:
                return _words(413, f"a batch of {len(value)} requests is more than this server lets run and wait "
                                   f"at once ({room}: --parallel and --queue); send smaller batches")
            runs = []
            for i, item in enumerate(value):
                try:
                    runs.append(self.service.parse(item))
                except InvalidRequest as exc:
                    raise InvalidRequest(f"request {i}: {exc}") from None
            with self.service.admitted(len(runs)):
                return _json(200, list(await asyncio.gather(*(self.service.answer(r) for r in runs))))
        except InvalidRequest as exc:
            return _words(422, str(exc))
        except ServiceBusy as exc:
            return _words(429, str(exc), ((b"retry-after", b"1"),))

    async def _body(self, scope: dict, receive: Callable) -> bytes:
        """The request's body, ``max_body`` bytes at most (_TooLarge past it).  A body over the
        bound is still read, and dropped, up to ``_DISCARDED`` times the bound, so that the
        client, still sending, reads the 413 instead of a reset connection; a Content-Length
        past that is answered at once."""
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > _DISCARDED * self.max_body:
                raise _TooLarge
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body:
                chunks.append(chunk)
            elif size > _DISCARDED * self.max_body:
                raise _TooLarge
            if not message.get("more_body"):
                if size > self.max_body:
                    raise _TooLarge
                return b"".join(chunks)


async def serve_http(config: ServeConfig, host: str, port: int, announce: Callable[[str], None],
                     token: ServerToken, allowed_hosts: tuple[str, ...] = ()) -> None:
    """Serve until SIGTERM or SIGINT, then drain (the module docstring).  ``announce`` gets the
    URL (``http://HOST:PORT/TOKEN/``) once the server listens."""
    import uvicorn

    service = Service(config)
    gated = TokenGate(App(service), token=token, allowed_names=allowed_hosts)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host

    # No access log: a request's path holds the token.  Requests already read get their
    # deadline and a slack to be answered once the server is told to stop.
    server = server_keeping_signals(uvicorn.Config(gated, log_level="warning", lifespan="off", access_log=False,
                                    timeout_graceful_shutdown=int(config.limits.timeout + _DRAIN_SLACK),
                                    # Connections beyond those that may hold a sample, and a
                                    # margin for pings and refusals, are answered 503 at once.
                                    limit_concurrency=config.parallel + config.queue + _MARGIN, backlog=1024))
    loop = asyncio.get_running_loop()
    stops = 0

    def stop() -> None:
        nonlocal stops
        stops += 1
        server.should_exit = True
        if stops > 1:  # a second signal: leave now
            server.force_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)  # uvicorn offers no event for it
        if server.started:
            announce(f"http://{shown}:{bound}/{token.value}/")
        await serving
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        sock.close()
        await service.close()
    log.info("serve stopped: every request read was answered")


def run(config: ServeConfig, host: str, port: int, announce: Callable[[str], None], token: ServerToken,
        allowed_hosts: tuple[str, ...] = ()) -> None:
    """Run the server in this process until a signal stops it and it has drained."""
    if config.parallel < 1 or config.queue < 0:
        raise ConfigError("--parallel must be at least 1 and --queue at least 0")
    asyncio.run(serve_http(config, host, port, announce, token, allowed_hosts))
