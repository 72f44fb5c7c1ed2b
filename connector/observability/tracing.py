"""OpenTelemetry spans for lookups, loads and saves.

Spans join the request's own trace when vLLM's request carries W3C trace
headers (``traceparent``). Export is configured by the standard ``OTEL_*``
environment variables (OTLP over HTTP); with none set, and no tracer
provider installed by the host process, tracing is off and costs nothing.
Attributes name requests, groups, counts and codes — never prompt text, token
ids or pool keys; an exception escaping a span is named by its type alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "kvpool.connector"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_lock = threading.Lock()
_configured = False
_propagator = TraceContextTextMapPropagator()


def configure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Install an OTLP/HTTP exporter when ``OTEL_*`` asks for one; True if tracing is on.

    Leaves an already installed tracer provider (the host's) alone.
    """
    global _configured, _off_until
    environ = os.environ if environ is None else environ
    with _lock:
        if _configured:
            return True
        if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return False
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            _configured = True  # the host process set one up
            _off_until = 0.0  # seen at the next check
            return True
        if not any(environ.get(var) for var in ENDPOINT_VARS):
            return False
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        service = environ.get("OTEL_SERVICE_NAME", "vllm-kvpool")
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _configured = True
        _off_until = 0.0  # seen at the next check
        return True


def flush() -> None:
    """Export buffered spans now (shutdown paths)."""
    provider = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        force_flush()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


#: What :func:`span` returns while no tracer provider is installed: no span, no work.
_OFF: AbstractContextManager[Span] = nullcontext(trace.INVALID_SPAN)


#: While none is installed, how long "off" is believed before asking OpenTelemetry again
#: (the hooks ask per request; OpenTelemetry's answer costs ~1.5 µs). A provider is
#: installed once per process and never removed, so "on" is believed for good.
OFF_RECHECK_S = 0.1
_on = False
_off_until = 0.0


def enabled() -> bool:
    """Whether a tracer provider is installed (the host's or :func:`configure_from_env`'s);
    one installed is seen within :data:`OFF_RECHECK_S`."""
    global _on, _off_until
    if _on:
        return True
    now = time.monotonic()
    if now < _off_until:
        return False
    _on = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    _off_until = now + OFF_RECHECK_S
    return _on


def span(
    name: str,
    parent_headers: Mapping[str, str] | None = None,
    *,
    start_time_ns: int | None = None,
    **attributes: Any,
) -> AbstractContextManager[Span]:
    """A span under the request's trace (when it carries ``traceparent``), begun at
    ``start_time_ns`` (epoch ns; default now); a shared no-op context, costing one check,
    while tracing is off."""
    if not enabled():
        return _OFF
    return _span(name, parent_headers, attributes, start_time_ns)


@contextmanager
def _span(
    name: str,
    parent_headers: Mapping[str, str] | None,
    attributes: Mapping[str, Any],
    start_time_ns: int | None = None,
) -> Iterator[Span]:
    context = _propagator.extract(dict(parent_headers)) if parent_headers else None
    # An exception escaping a span is named by its type alone: OpenTelemetry would record its
    # message (a Mooncake binding's repeats the call's pool keys) as an event and the status.
    with tracer().start_as_current_span(
        name,
        context=context,
        attributes=_clean(attributes),
        start_time=start_time_ns,
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except Exception as error:
            current.set_status(Status(StatusCode.ERROR, type(error).__qualname__))
            raise


def set_attributes(current: Span, **attributes: Any) -> None:
    if current.is_recording():
        current.set_attributes(_clean(attributes))


def mark_failed(current: Span, failures: Mapping[str, int]) -> None:
    """Record per-reason failure counts and an error status."""
    if failures:
        current.set_attributes({f"kvpool.failures.{k}": int(v) for k, v in failures.items()})
        current.set_status(Status(StatusCode.ERROR, f"{sum(failures.values())} block(s) failed"))


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, tuple):
            value = list(value)
        out[f"kvpool.{key}"] = value
    return out
