"""OpenTelemetry traces of what ran: configured the standard way, off by default, free when off.

Tracing is on for a command when ``agentloop --trace`` is given or when the environment asks for
it as the OpenTelemetry SDK's own configuration does: ``OTEL_TRACES_EXPORTER`` names an exporter
other than ``none`` (``otlp``, ``console``), and ``OTEL_SDK_DISABLED`` is not ``true``.  The rest
is the SDK's standard environment, read by the SDK itself: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and
``..._TRACES_ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``, ``_CERTIFICATE``),
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``, the default; ``grpc`` when its exporter is
installed), ``OTEL_SERVICE_NAME`` (default ``agentloop``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` and ``OTEL_BSP_*``.

Off, nothing of OpenTelemetry is imported and nothing observes the engine: the only cost is
reading two environment variables when a command starts.  On, one observer per run
(``engine.observe._spans.SpanObserver``) turns the run's display events into spans, which a background
thread batches and sends; the agent loop never waits for it.  The SDK is an optional extra
(``otel``); asking for traces without it is a one-line error saying how to get it
(``engine.extras``).

What the spans say (the GenAI semantic conventions, which version, message contents only on
opt-in, never the API key) is ``engine.observe``'s docstring.  At the end of a command the spans
not yet sent are given ``FLUSH_SECONDS`` at most; a collector that cannot be reached costs the
command that long, once, and one line on stderr saying so instead of the SDK's log lines.
A collector on this machine that is another user's gets nothing (``_collector``): tracing then
does not start, in one line.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError
from engine.secrets import redact_url, redact_urls

if TYPE_CHECKING:
    from engine.agent import AgentDisplay
    from engine.models import ModelRegistry

#: Longest wait at the end of a command for the spans not yet sent.
FLUSH_SECONDS = 5.0
#: The GenAI conventions emitted by default, and with ``gen_ai_latest_experimental``.
SEMCONV_DEFAULT, SEMCONV_LATEST = "1.36.0", "1.38.0"
_CONTENT_ON = {"true", "1", "span_only", "span_and_event"}


@dataclass(frozen=True)
class TraceSettings:
    """What the spans hold.  ``latest``: ``OTEL_SEMCONV_STABILITY_OPT_IN`` lists
    ``gen_ai_latest_experimental`` (GenAI conventions ``SEMCONV_LATEST`` instead of
    ``SEMCONV_DEFAULT``); ``content``: message contents, code and output are recorded
    (``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``; under the latest conventions only,
    which put them on spans)."""

    latest: bool = False
    content: bool = False

    @property
    def semconv(self) -> str:
        return SEMCONV_LATEST if self.latest else SEMCONV_DEFAULT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TraceSettings:
        opt_in = {part.strip().lower() for part in environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")}
        latest = "gen_ai_latest_experimental" in opt_in
        return cls(latest=latest, content=latest and _content_asked(environ))


def _content_asked(environ: Mapping[str, str]) -> bool:
    return environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().lower() in _CONTENT_ON


def requested(flag: bool = False, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this command traces: ``--trace``, or an exporter named in ``OTEL_TRACES_EXPORTER``."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return flag or bool(_exporter_names(environ) - {"none"})


def _exporter_names(environ: Mapping[str, str]) -> set[str]:
    return {part.strip().lower() for part in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if part.strip()}


def endpoint(environ: Mapping[str, str] = os.environ) -> str:
    """Where OTLP/HTTP spans go, as the exporter works it out (for messages)."""
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if url:
        return url
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


class _ExportTrouble(logging.Handler):
    """Takes the SDK's log lines (one per failed export and per retry) so that a collector that
    is down costs one line at the end, not a stream of them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        try:
            self.last = record.getMessage()[:300]
        except Exception:  # noqa: BLE001 - a log line that cannot be formatted is still a failure
            self.last = str(record.msg)[:300]


class Tracing:
    """Tracing for one process: the provider, the settings, and the observers made from them."""

    def __init__(self, provider: Any, settings: TraceSettings, where: str) -> None:
        self.provider = provider
        self.settings = settings
        self.where = where
        self.trouble = _ExportTrouble()
        self._done = False
        from engine.observe import _spans as spans  # imports opentelemetry: only once tracing is on

        self._spans = spans
        self.tracer = provider.get_tracer("agentloop", _version(), schema_url=spans.schema_url(settings))

    def observer(self, models: ModelRegistry | None = None, root: Mapping[str, Any] | None = None) -> AgentDisplay:
        """A display that turns one run's events into spans.  ``root``: attributes for the run's
        root span (a batch run's task id and attempt); ``models`` resolves aliases to model ids
        and servers."""
        return self._spans.SpanObserver(self.tracer, self.settings, models=models, root=root)

    def sample_span(self, record: Mapping[str, Any]) -> None:
        """One span for a code sample that ended (``exec --jsonl``), from its result record."""
        self._spans.sample_span(self.tracer, self.settings, record)

    def flush(self, timeout: float = FLUSH_SECONDS) -> None:
        """Send the spans that ended so far, waiting at most ``timeout`` seconds."""
        sending = threading.Thread(target=self.provider.force_flush, name="agentloop-trace-flush", daemon=True)
        sending.start()
        sending.join(timeout)

    def shutdown(self, timeout: float = FLUSH_SECONDS) -> None:
        """Send what is left, waiting at most ``timeout`` seconds, then say in one line on stderr
        if sending failed."""
        if self._done:
            return
        self._done = True
        closing = threading.Thread(target=self.provider.shutdown, name="agentloop-trace-flush", daemon=True)
        closing.start()
        closing.join(timeout)
        if closing.is_alive() or self.trouble.count:
            why = f" ({self.trouble.last})" if self.trouble.last else ""
            print(redact_urls(f"agentloop: traces could not all be sent to {self.where}{why}"), file=sys.stderr,
                  flush=True)


_current: Tracing | None = None
_lock = threading.Lock()


def start_tracing(flag: bool = False, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Turn tracing on for this process if the flag or the environment asks for it (see the
    module docstring); the tracing, or None when off.  Raises ConfigError (one line) when the SDK
    is missing or the environment names an exporter or protocol agentloop cannot send with."""
    global _current
    environ = os.environ if environ is None else environ
    with _lock:
        if _current is not None or not requested(flag, environ):
            return _current
        settings = TraceSettings.from_env(environ)
        provider, where = _provider(flag, environ)
        tracing = Tracing(provider, settings, where)
        logger = logging.getLogger("opentelemetry")
        logger.addHandler(tracing.trouble)
        logger.propagate = False  # the SDK's lines are summed up by ``shutdown``
        _current = tracing
    atexit.register(tracing.shutdown)
    if _content_asked(environ) and not settings.latest:  # v1.36.0 puts contents in log events only
        print("agentloop: traces hold message contents only under the latest GenAI conventions: set "
              "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental too", file=sys.stderr, flush=True)
    return _current


def current_tracing() -> Tracing | None:
    """The process's tracing, or None when it is off."""
    return _current


def trace_observer(models: ModelRegistry | None = None, root: Mapping[str, Any] | None = None) -> AgentDisplay | None:
    """A span observer for one run when tracing is on, else None (nothing to add)."""
    return _current.observer(models, root) if _current is not None else None


def tracing_env() -> dict[str, str]:
    """What a process elsewhere (a Ray task) needs to trace as this one does: the ``OTEL_*``
    variables, and ``OTEL_TRACES_EXPORTER`` when ``--trace`` turned tracing on; nothing when off."""
    if _current is None:
        return {}
    env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    if not requested(False, env):
        env["OTEL_TRACES_EXPORTER"] = "otlp"
    return env


def stop_tracing() -> None:
    """End tracing for this process (the command is over): send what is left, bounded."""
    global _current
    tracing, _current = _current, None
    if tracing is not None:
        tracing.shutdown()


def _provider(flag: bool, environ: Mapping[str, str]) -> tuple[Any, str]:
    """The SDK's tracer provider with one batching processor per exporter asked for."""
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        from engine.extras import install_hint  # (importlib.metadata: only when it is needed)

        raise ConfigError(f"tracing needs the OpenTelemetry SDK, which is not installed: {install_hint('otel')}") from exc
    names = _exporter_names(environ) - {"none"} or {"otlp"}
    unknown = names - {"otlp", "console"}
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER names {', '.join(sorted(unknown))}: agentloop sends traces with "
                          "otlp or console")
    exporters, where = [], []
    if "otlp" in names:
        exporters.append(_otlp_exporter(environ))
        where.append(redact_url(endpoint(environ)))  # (said on stderr: a collector's user part never)
    if "console" in names:
        exporters.append(ConsoleSpanExporter(out=sys.stderr))  # stdout holds a command's answer
        where.append("stderr")
    resource = Resource.create({SERVICE_VERSION: _version()})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "agentloop"}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider, " and ".join(where)


def _otlp_exporter(environ: Mapping[str, str]) -> Any:
    """The OTLP exporter the environment asks for, to a collector that is not another user's
    on this machine (``_collector``: checked now, and for HTTP at each new connection)."""
    from engine.observe import _collector as collector

    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol in ("http/protobuf", "grpc"):
        named = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() \
            or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        where = endpoint(environ) if protocol == "http/protobuf" else named or "http://localhost:4317"
        if (words := collector.refusal(where)) is not None:
            raise ConfigError(words)
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            from engine.extras import install_hint

            raise ConfigError(f"OTLP over HTTP needs its exporter, which is not installed: {install_hint('otel')}") from exc
        return OTLPSpanExporter(session=collector.checked_session(environ))
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError as exc:
            raise ConfigError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc "
                              "(pip install it), or use http/protobuf") from exc
        return GrpcExporter()
    raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: agentloop sends OTLP as http/protobuf or grpc")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentloop")
    except PackageNotFoundError:
        return "0"


__all__ = ["FLUSH_SECONDS", "SEMCONV_DEFAULT", "SEMCONV_LATEST", "TraceSettings", "Tracing", "current_tracing",
           "endpoint", "requested", "start_tracing", "stop_tracing", "trace_observer", "tracing_env"]
