"""A real OTLP/HTTP receiver for the tests: protobuf exports on loopback, decoded with the
official proto package (``opentelemetry-proto``), kept as plain spans to assert on."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start: int
    end: int
    attributes: dict[str, Any]
    status: str
    status_message: str
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]
    scope: str
    schema_url: str
    children: list[Span] = field(default_factory=list)

    def attr(self, key: str) -> Any:
        return self.attributes.get(key)


class Receiver:
    """``with Receiver() as rx:`` listens on 127.0.0.1; ``rx.endpoint`` is the base URL to put in
    ``OTEL_EXPORTER_OTLP_ENDPOINT``; ``rx.spans`` grows as exports arrive."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _take(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), kind=KINDS[s.kind], start=s.start_time_unix_nano,
                        end=s.end_time_unix_nano, attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        status=STATUS[s.status.code], status_message=s.status.message,
                        events=[(e.name, {kv.key: _value(kv.value) for kv in e.attributes}) for e in s.events],
                        resource=resource, scope=ss.scope.name, schema_url=ss.schema_url))
        with self._lock:
            self.spans += got
            self.requests += 1
            self._lock.notify_all()

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        """Wait (bounded) until ``predicate(spans)`` holds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def trees(spans: list[Span]) -> list[Span]:
    """The root spans, each with ``children`` (sorted by start) filled in, down the tree."""
    by_id = {s.span_id: s for s in spans}
    for s in spans:
        s.children = []
    roots = []
    for s in sorted(spans, key=lambda s: s.start):
        parent = by_id.get(s.parent_id)
        (parent.children if parent is not None else roots).append(s)
    return roots


def shape(span: Span, depth: int = 0) -> str:
    """The tree under ``span`` as indented names, for failure messages."""
    return "\n".join([f"{'  ' * depth}{span.name} [{span.status}]", *(shape(c, depth + 1) for c in span.children)])
