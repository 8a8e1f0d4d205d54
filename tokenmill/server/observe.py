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

import asyncio
import logging
import time
from contextvars import ContextVar
from typing import Any

from tokenmill.engine.async_engine import AsyncEngine, RequestStream
from tokenmill.server.dumps import DumpWriter
from tokenmill.server.health import Watchdog
from tokenmill.server.observe_args import ObserveSettings
from tokenmill.server.pipeline import EngineJob, RequestPipeline
from tokenmill.server.request_log import RequestLog
from tokenmill.server.request_record import RequestRecord
from tokenmill.server.tracing import RequestTracer

logger = logging.getLogger("tokenmill.server")

OBSERVED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                            "/v1/messages"})
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# The record of the HTTP request being handled (set by the middleware, read by the pipeline).
CURRENT: ContextVar[RequestRecord | None] = ContextVar("tokenmill_request_record", default=None)


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
