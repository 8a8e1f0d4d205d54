"""Seeing each request after the fact: tracing (``tracing.py``), the request log
(``request_log.py``) and crash dumps (``dumps.py``) share one observer of the generation routes.

    ObserveMiddleware   pure ASGI: a POST to a generation route gets a ``RequestRecord`` —
                        arrival, trace headers, body bytes (for the log), status, whether the
                        client left, the end of its response
    ObservedPipeline    ``submit`` ties the job and the engine streams it made to the request's
                        record (a context variable: the route runs in the middleware's task)
    Observer.end        the record, read with the streams' own ``RequestTimings`` and last
                        outputs (the engine stamped them: nothing is timed twice), goes to the
                        tracer, the log and the dumps' ring

None of it exists unless a flag asks for it: the app then builds the plain pipeline and no
middleware, so a server without these flags pays nothing for them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.async_engine import AsyncEngine, RequestStream
from tokenmill.server.dumps import DumpWriter
from tokenmill.server.health import Watchdog
from tokenmill.server.pipeline import EngineJob, RequestPipeline
from tokenmill.server.request_log import RequestLog
from tokenmill.server.request_record import RequestRecord
from tokenmill.server.tracing import RequestTracer, check_tracing

logger = logging.getLogger("tokenmill.server")

OBSERVED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                            "/v1/messages"})
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# The record of the HTTP request being handled (set by the middleware, read by the pipeline).
CURRENT: ContextVar[RequestRecord | None] = ContextVar("tokenmill_request_record", default=None)


@dataclass(frozen=True)
class ObserveSettings:
    """What ``serve`` records about requests; all off by default."""

    otlp_traces_endpoint: str | None = None  # OTLP collector for request spans
    request_log: str | None = None  # directory of the request log
    request_log_max_bytes: int = 100 * 2**20  # one file's size before it rotates
    request_log_keep: int = 5  # rotated files kept
    request_log_prompts: bool = False  # prompts and messages in the log (else token counts)
    dump_dir: str | None = None  # crash / watchdog dumps (default: the request log's)
    dump_window: float = 300.0  # seconds of finished requests a dump holds
    span_exporter: Any = None  # tests: an SDK SpanExporter instead of an OTLP endpoint

    @property
    def tracing(self) -> bool:
        return self.otlp_traces_endpoint is not None or self.span_exporter is not None

    @property
    def dumps_to(self) -> str | None:
        return self.dump_dir or self.request_log

    @property
    def enabled(self) -> bool:
        return self.tracing or self.request_log is not None or self.dump_dir is not None


class Observer:
    """The sinks a finished request goes to, and the requests in flight."""

    def __init__(self, engine: AsyncEngine, tracer: RequestTracer | None,
                 log: RequestLog | None, dumps_to: str | None):
        self.engine = engine
        self.tracer = tracer
        self.log = log
        self.speculative = bool(engine.info.speculative)
        self.in_flight: set[RequestRecord] = set()
        self.dumps = DumpWriter(dumps_to, engine, self._in_flight, log.recent) \
            if dumps_to and log is not None else None
        self._watch: asyncio.Task | None = None

    @classmethod
    def build(cls, settings: ObserveSettings, engine: AsyncEngine,
              served_model: str) -> Observer | None:
        """The observer the settings ask for; None when they ask for nothing."""
        if not settings.enabled:
            return None
        tracer = None
        if settings.span_exporter is not None:
            tracer = RequestTracer.with_exporter(settings.span_exporter, served_model)
        elif settings.otlp_traces_endpoint:
            tracer = RequestTracer.otlp(settings.otlp_traces_endpoint, served_model)
        log = None
        if settings.request_log or settings.dump_dir:
            tokenizer = engine.tokenizer
            log = RequestLog(settings.request_log,
                             lambda text: len(tokenizer.encode(text, False)) if text else 0,
                             settings.request_log_max_bytes, settings.request_log_keep,
                             settings.request_log_prompts, settings.dump_window)
        return cls(engine, tracer, log, settings.dumps_to)

    def begin(self, scope: dict[str, Any]) -> RequestRecord:
        headers = None
        if self.tracer is not None:
            headers = {k.decode("latin-1"): v.decode("latin-1")
                       for k, v in scope.get("headers") or () if k in _TRACE_HEADERS}
        record = RequestRecord(scope["path"], headers, self.log is not None, self.speculative)
        self.in_flight.add(record)
        return record

    def end(self, record: RequestRecord) -> None:
        """The request's response is over: hand it to every sink (never raises)."""
        record.ended = time.monotonic()
        self.in_flight.discard(record)
        try:
            if self.tracer is not None:
                self.tracer.emit(record)
            if self.log is not None:
                self.log.put(record.summary(), record.body())
        except Exception:  # observing must never fail a request
            logger.exception("recording request %s failed", record.rid)

    def _in_flight(self) -> list[dict[str, Any]]:
        return [r.progress() for r in list(self.in_flight)]

    def start(self, watchdog: Watchdog) -> None:
        """From the app's start-up: the dumps' watch on the watchdog's verdict."""
        if self.dumps is not None:
            interval = min(1.0, watchdog.step_timeout / 4)
            self._watch = asyncio.create_task(self.dumps.watch(watchdog, interval))

    def stop_watching(self) -> None:
        """Before the engine shuts down: a clean stop is no crash."""
        if self._watch is not None:
            self._watch.cancel()

    async def close(self) -> None:
        """After the engine stopped: the log written out, batched spans exported."""
        self.stop_watching()
        if self.log is not None:
            await asyncio.to_thread(self.log.close)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)


class ObserveMiddleware:
    """Pure ASGI middleware: a ``RequestRecord`` for each POST to a generation route."""

    def __init__(self, app: Any, observer: Observer):
        self.app = app
        self.observer = observer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in OBSERVED_PATHS \
                or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        record = self.observer.begin(scope)
        token = CURRENT.set(record)

        async def tapped_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                if record.chunks is not None:
                    record.chunks.append(message.get("body", b""))
            elif message["type"] == "http.disconnect":
                record.client_gone = True
            return message

        async def watched_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, tapped_receive, watched_send)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            CURRENT.reset(token)
            self.observer.end(record)


class ObservedPipeline(RequestPipeline):
    """The pipeline whose ``submit`` tells the current request's record what it queued."""

    async def submit(self, rid: str, job: EngineJob) -> list[RequestStream]:
        record = CURRENT.get()
        if record is not None:
            record.attach(rid, job, [])  # a refused job still shows its prompts
        streams = await super().submit(rid, job)
        if record is not None:
            record.streams = streams
        return streams


# ----- the serve flags ----------------------------------------------------------------------

_SIZE = re.compile(r"\s*(\d+)\s*([kmg]?)(i?b?)\s*", re.IGNORECASE)


def byte_size(text: str) -> int:
    """``"64MiB"``, ``"100MB"``, ``"1048576"`` -> bytes."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes, e.g. 64MiB")
    power = "kmg".find(m.group(2).lower()) + 1 if m.group(2) else 0
    base = 1024 if m.group(3).lower().startswith("i") else 1000
    return int(m.group(1)) * base ** power


def add_observe_args(p: argparse.ArgumentParser) -> None:
    d = ObserveSettings()
    g = p.add_argument_group("tracing, request log and dumps (docs/observability.md)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export a span per request (queue, prefill, decode; token counts) to "
                        "this OpenTelemetry collector: OTLP/HTTP for a URL ending in "
                        "/v1/traces, else gRPC (needs pip install 'tokenmill[tracing]')")
    g.add_argument("--request-log", default=None, metavar="DIR",
                   help="write each generation request (body, timings, outcome) as a JSON "
                        "line under DIR; tokenmill bench replay DIR sends them again")
    g.add_argument("--request-log-max-bytes", type=byte_size, default=d.request_log_max_bytes,
                   help="rotate the request log past this size (default: 100MiB)")
    g.add_argument("--request-log-keep", type=int, default=d.request_log_keep,
                   help=f"rotated request log files kept (default: {d.request_log_keep})")
    g.add_argument("--request-log-prompts", action="store_true",
                   help="log prompts and messages too (default: their token counts only)")
    g.add_argument("--dump-dir", default=None, metavar="DIR",
                   help="where a crash or watchdog trip writes the engine's state and the "
                        "last requests (default: the --request-log directory)")
    g.add_argument("--dump-window", type=float, default=d.dump_window,
                   help=f"seconds of finished requests a dump holds (default: "
                        f"{d.dump_window:g})")


def observe_settings(args: argparse.Namespace) -> ObserveSettings:
    if args.otlp_traces_endpoint:
        check_tracing()  # before the model loads
    return ObserveSettings(
        otlp_traces_endpoint=args.otlp_traces_endpoint, request_log=args.request_log,
        request_log_max_bytes=args.request_log_max_bytes,
        request_log_keep=args.request_log_keep, request_log_prompts=args.request_log_prompts,
        dump_dir=args.dump_dir, dump_window=args.dump_window)
