"""OpenTelemetry spans of requests (``server/tracing.py``).

The server tests run the real app (``create_app`` under uvicorn, the default model) in this
process, its spans going to the SDK's ``InMemorySpanExporter``: one span per request in the
trace its ``traceparent`` names (same trace id, that span as parent), the engine's phases as
children, GenAI token counts as attributes. The rest need no server: speculative acceptance
on a made-up record, the OTLP/HTTP exporter against a small collector, a missing SDK, and an
app without tracing flags carrying none of it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.test_server_support import MODEL, free_port
from tokenmill.engine.async_types import RequestTimings
from tokenmill.request import CompletionOutput, FinishReason, RequestOutput
from tokenmill.server.observe import ObserveSettings
from tokenmill.server.request_record import RequestRecord
from tokenmill.server.tracing import RequestTracer, TracingUnavailableError, check_tracing

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
PHASES = ("preprocess", "queue", "prefill", "decode")


@pytest.fixture(scope="module")
def served():
    """(base URL, exporter) of a real server in a thread of this process."""
    import uvicorn

    from tokenmill.engine.llm import LLM
    from tokenmill.server.app import ServerSettings, create_app

    exporter = InMemorySpanExporter()
    port = free_port()
    engine = LLM(MODEL, num_blocks=256, max_model_len=1024).engine
    app = create_app(engine, ServerSettings(MODEL, port=port, observe=ObserveSettings(
        span_exporter=exporter)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}", exporter
    server.should_exit = True
    thread.join(30)


def trace_of(exporter: InMemorySpanExporter, response_id: str) -> tuple:
    """(request span, {phase: span}) of one response (its span ends just after the last
    byte: waited for)."""
    deadline = time.monotonic() + 10
    while True:
        spans = exporter.get_finished_spans()
        root = next((s for s in spans if s.attributes.get("gen_ai.response.id") == response_id),
                    None)
        if root is not None or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert root is not None, [s.name for s in spans]
    children = {s.name: s for s in spans if s.parent is not None
                and s.parent.span_id == root.context.span_id}
    return root, children


@pytest.mark.slow
def test_a_request_span_under_the_callers_trace(served):
    url, exporter = served
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={
        "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
        "temperature": 0.0})
    assert r.status_code == 200
    root, phases = trace_of(exporter, r.json()["id"])
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_ID and root.parent.is_remote
    assert root.kind is SpanKind.SERVER and root.name == f"text_completion {MODEL}"
    usage, a = r.json()["usage"], root.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (6, 0.0)
    assert a["http.response.status_code"] == 200 and a["tokenmill.outcome"] == "ok"
    assert 0 < a["gen_ai.response.time_to_first_chunk"]
    assert root.status.status_code is StatusCode.UNSET
    assert tuple(phases) == PHASES
    spans = [phases[name] for name in PHASES]
    assert all(s.context.trace_id == root.context.trace_id for s in spans)
    assert root.start_time == spans[0].start_time and spans[-1].end_time <= root.end_time
    for before, after in zip(spans, spans[1:]):
        assert before.end_time == after.start_time  # the phases tile the engine's time
    assert phases["prefill"].attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    decode = phases["decode"].attributes
    assert decode["gen_ai.usage.output_tokens"] == 6 and decode["tokenmill.decode.steps"] == 5
    assert "tokenmill.speculative.accepted_tokens" not in decode  # no speculation here


@pytest.mark.slow
def test_a_new_trace_without_traceparent_and_cached_tokens(served):
    url, exporter = served
    body = {"model": MODEL, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}
    roots = []
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        response_id = json.loads(events[0][len("data: "):])["id"]
        roots.append(trace_of(exporter, response_id))
    (root, phases), (again, _) = roots
    assert root.parent is None and root.name == f"chat {MODEL}"
    assert root.context.trace_id != again.context.trace_id
    assert again.attributes["gen_ai.usage.cache_read.input_tokens"] > 0
    assert root.attributes["gen_ai.usage.cache_read.input_tokens"] == 0
    assert tuple(phases) == PHASES


@pytest.mark.slow
def test_a_refused_request_is_an_error_span(served):
    url, exporter = served
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "max_tokens": -1}, timeout=60,
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 400
    deadline = time.monotonic() + 10
    while True:
        errors = [s for s in exporter.get_finished_spans()
                  if s.attributes.get("http.response.status_code") == 400]
        if errors or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert len(errors) == 1 and errors[0].status.status_code is StatusCode.ERROR
    assert f"{errors[0].context.trace_id:032x}" == TRACE_ID
    children = [s for s in exporter.get_finished_spans()
                if s.parent is not None and s.parent.span_id == errors[0].context.span_id]
    assert children == []  # nothing reached the engine


# ----- without a server -------------------------------------------------------------------

def finished_record(speculative: bool) -> RequestRecord:
    """A completions request whose one sequence took 9 tokens in 1 + 3 steps."""
    record = RequestRecord("/v1/completions", None, keep_body=False, speculative=speculative)
    t0 = record.arrival
    timings = RequestTimings(t0 + 0.01, scheduled=t0 + 0.02, first_token=t0 + 0.05,
                             last_token=t0 + 0.2, finished=t0 + 0.2,
                             token_gaps=[0.05, 0.05, 0.05], num_tokens=9)
    out = RequestOutput("r-1", [1, 2, 3, 4], [CompletionOutput(
        0, list(range(9)), "text", FinishReason.LENGTH)], finished=True, num_cached_tokens=0)
    stream = SimpleNamespace(request_id="r-1", timings=timings, last=out)
    job = SimpleNamespace(prompts=[SimpleNamespace(ids=[1, 2, 3, 4])], model=None,
                          params=None)
    record.attach("cmpl-1", job, [stream])
    record.status, record.ended = 200, t0 + 0.21
    return record


def test_speculative_acceptance_on_the_decode_span():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer.with_exporter(exporter, "m")
    tracer.emit(finished_record(speculative=True))
    decode = next(s for s in exporter.get_finished_spans() if s.name == "decode")
    # 8 tokens after the first in 3 steps: 5 of them accepted drafts
    assert decode.attributes["tokenmill.speculative.accepted_tokens"] == 5
    assert decode.attributes["tokenmill.speculative.mean_accepted_length"] == pytest.approx(
        1 + 5 / 3)
    tracer.shutdown()


def test_spans_reach_an_otlp_http_collector():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest)

    received: list[bytes] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        tracer = RequestTracer.otlp(f"http://127.0.0.1:{http.server_port}/v1/traces", "m")
        tracer.emit(finished_record(speculative=False))
        tracer.shutdown()  # exports what is batched
    finally:
        http.shutdown()
    names = []
    for body in received:
        request = ExportTraceServiceRequest.FromString(body)
        names += [s.name for rs in request.resource_spans for ss in rs.scope_spans
                  for s in ss.spans]
    assert sorted(names) == sorted(["text_completion m", *PHASES])


def test_tracing_without_the_sdk_is_a_clear_error(monkeypatch):
    for name in ("opentelemetry.sdk.trace", "opentelemetry.sdk.trace.export",
                 "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(TracingUnavailableError, match=r"pip install 'tokenmill\[tracing\]'"):
        check_tracing()
    with pytest.raises(TracingUnavailableError, match="tracing"):
        RequestTracer.otlp("http://127.0.0.1:4317", "m")


def test_an_app_without_the_flags_observes_nothing():
    from tests.test_engine_unit import make_engine
    from tokenmill.server.app import ServerSettings, create_app
    from tokenmill.server.observe import ObserveMiddleware
    from tokenmill.server.pipeline import RequestPipeline

    app = create_app(make_engine(), ServerSettings("fake"))
    assert type(app.state.pipeline) is RequestPipeline  # no submit hook
    assert all(m.cls is not ObserveMiddleware for m in app.user_middleware)
