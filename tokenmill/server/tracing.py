"""OpenTelemetry spans of requests (``serve --otlp-traces-endpoint URL``).

One span per HTTP generation request, from its arrival to the response's last byte, in the
trace its ``traceparent`` header names (W3C trace context) or a new one; under it, per engine
request (one per prompt), the phases the engine's ``RequestTimings`` already stamped:

    <operation> <model>   SERVER  arrival -> response sent
      preprocess                  arrival -> the engine took it (tokenize, chat template)
      queue                       the engine took it -> first scheduled
      prefill                     first scheduled -> first token
      decode                      first token -> finished

Spans are built once the request is over, from timestamps taken anyway (no clock is read per
token for tracing). Attribute names follow the OpenTelemetry GenAI semantic conventions where
they have one (``gen_ai.usage.input_tokens``); tokenmill's own are ``tokenmill.*``.

The SDK is an optional dependency (``pip install 'tokenmill[tracing]'``), imported only when
tracing is on: a server without it starts as long as no endpoint is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.params import SamplingParams
    from tokenmill.server.request_record import RequestRecord, StreamFacts

# The GenAI conventions' operation for each endpoint we trace.
_OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat",
               "/v1/responses": "chat", "/v1/messages": "chat"}
# SamplingParams field -> GenAI request attribute (unset ones are left out)
_REQUEST_FIELDS = (("max_tokens", "gen_ai.request.max_tokens"),
                   ("temperature", "gen_ai.request.temperature"),
                   ("top_p", "gen_ai.request.top_p"), ("top_k", "gen_ai.request.top_k"),
                   ("seed", "gen_ai.request.seed"), ("n", "gen_ai.request.choice.count"),
                   ("presence_penalty", "gen_ai.request.presence_penalty"),
                   ("frequency_penalty", "gen_ai.request.frequency_penalty"))
_INSTALL_HINT = "tracing needs the OpenTelemetry SDK: pip install 'tokenmill[tracing]'"


class TracingUnavailableError(ValueError):
    """``--otlp-traces-endpoint`` given without the optional packages installed."""


def check_tracing() -> None:
    """Raise ``TracingUnavailableError`` unless the SDK and the OTLP exporters import (the CLI
    asks before the model loads)."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise TracingUnavailableError(f"{_INSTALL_HINT} ({e})") from None


class RequestTracer:
    """Turns finished ``RequestRecord``s into spans on its own ``TracerProvider`` (the
    process-wide one is left to the application, if any)."""

    def __init__(self, provider: Any, served_model: str):
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        import tokenmill

        self.provider = provider
        self.served_model = served_model
        self._tracer = provider.get_tracer("tokenmill", tokenmill.__version__)
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)
        self._in_context = set_span_in_context

    @classmethod
    def otlp(cls, endpoint: str, served_model: str) -> RequestTracer:
        """Spans batched to an OTLP collector: OTLP/HTTP when the URL's path is
        ``/v1/traces`` (the collector's HTTP port, 4318), else gRPC (4317)."""
        from urllib.parse import urlparse

        try:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            if urlparse(endpoint).path.rstrip("/").endswith("/v1/traces"):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter)
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter)
        except ImportError as e:
            raise TracingUnavailableError(f"{_INSTALL_HINT} ({e})") from None
        return cls(_provider(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))),
                   served_model)

    @classmethod
    def with_exporter(cls, exporter: Any, served_model: str) -> RequestTracer:
        """Spans handed to ``exporter`` (an SDK ``SpanExporter``, e.g. the tests'
        ``InMemorySpanExporter``) as each ends."""
        try:
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        except ImportError as e:
            raise TracingUnavailableError(f"{_INSTALL_HINT} ({e})") from None
        return cls(_provider(SimpleSpanProcessor(exporter)), served_model)

    def shutdown(self) -> None:
        """Export what is still batched, then stop."""
        self.provider.shutdown()

    def emit(self, record: RequestRecord) -> None:
        """The spans of one request that has ended (on the event loop)."""
        parent = self._propagator.extract(record.trace_headers) \
            if record.trace_headers else None
        op = _OPERATIONS.get(record.path, "chat")
        model = record.model_name or self.served_model
        span = self._tracer.start_span(f"{op} {model}", context=parent,
                                       kind=self._server_kind,
                                       start_time=record.wall_ns(record.arrival),
                                       attributes=self._request_attributes(record, op))
        inner = self._in_context(span)
        for facts in record.stream_facts():
            self._phases(inner, record, facts, len(record.streams) > 1)
        if record.failed:
            span.set_status(self._error)
        span.end(end_time=record.wall_ns(record.ended))

    def _request_attributes(self, record: RequestRecord, op: str) -> dict[str, Any]:
        facts = record.stream_facts()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op, "gen_ai.provider.name": "tokenmill",
            "gen_ai.response.model": self.served_model,
            "http.request.method": "POST", "url.path": record.path,
            "http.response.status_code": record.status,
            "tokenmill.outcome": record.outcome}
        if record.model_name:
            attrs["gen_ai.request.model"] = record.model_name
        if record.rid:
            attrs["gen_ai.response.id"] = record.rid
        if record.params is not None:
            attrs.update(_sampling_attributes(record.params))
        if facts:
            attrs.update(_usage(facts))
            reasons = [r for f in facts for r in f.finish_reasons]
            attrs["gen_ai.response.finish_reasons"] = [r or "none" for r in reasons]
            firsts = [f.first_token for f in facts if f.first_token is not None]
            if firsts:
                attrs["gen_ai.response.time_to_first_chunk"] = min(firsts) - record.arrival
        return attrs

    def _phases(self, inner: Any, record: RequestRecord, facts: StreamFacts,
                indexed: bool) -> None:
        """The child spans of one engine request: each phase whose both ends were stamped."""
        common = {"tokenmill.request_id": facts.request_id}
        if indexed:
            common["tokenmill.prompt_index"] = facts.index
        ends = (record.arrival, facts.engine_arrival, facts.scheduled, facts.first_token,
                facts.finished)
        extra = {"prefill": {"gen_ai.usage.input_tokens": facts.prompt_tokens,
                             "gen_ai.usage.cache_read.input_tokens": facts.cached_tokens},
                 "decode": _decode_attributes(facts, record.speculative)}
        for i, name in enumerate(("preprocess", "queue", "prefill", "decode")):
            start, end = ends[i], ends[i + 1]
            if start is None or end is None:
                continue
            child = self._tracer.start_span(name, context=inner,
                                            start_time=record.wall_ns(start),
                                            attributes={**common, **extra.get(name, {})})
            child.end(end_time=record.wall_ns(end))


def _provider(processor: Any) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    import tokenmill

    provider = TracerProvider(resource=Resource.create(
        {"service.name": "tokenmill", "service.version": tokenmill.__version__}))
    provider.add_span_processor(processor)
    return provider


def _sampling_attributes(params: SamplingParams) -> dict[str, Any]:
    """The engine's sampling settings as GenAI request attributes."""
    attrs: dict[str, Any] = {}
    for field, name in _REQUEST_FIELDS:
        value = getattr(params, field)
        if value is not None and not (field == "top_k" and value <= 0):
            attrs[name] = value
    if params.stop:
        attrs["gen_ai.request.stop_sequences"] = list(params.stop)
    return attrs


def _usage(facts: list[StreamFacts]) -> dict[str, int]:
    return {"gen_ai.usage.input_tokens": sum(f.prompt_tokens for f in facts),
            "gen_ai.usage.output_tokens": sum(sum(f.output_tokens) for f in facts),
            "gen_ai.usage.cache_read.input_tokens": sum(f.cached_tokens for f in facts)}


def _decode_attributes(facts: StreamFacts, speculative: bool) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gen_ai.usage.output_tokens": sum(facts.output_tokens),
                             "tokenmill.decode.steps": facts.decode_steps}
    if speculative and facts.accepted_drafts is not None:
        attrs["tokenmill.speculative.accepted_tokens"] = facts.accepted_drafts
        if facts.decode_steps:
            # tokens per verification: accepted drafts plus the target's own token
            attrs["tokenmill.speculative.mean_accepted_length"] = \
                1 + facts.accepted_drafts / facts.decode_steps
    return attrs
