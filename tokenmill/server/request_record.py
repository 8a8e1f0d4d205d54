"""One HTTP generation request as the observer (``observe.py``) saw it, and what its engine
streams' own timings and outputs say about it: what the tracer, the request log and the
crash dumps read. Timestamps are the engine's and the middleware's (``time.monotonic``);
``wall_ns`` turns one into Unix nanoseconds for a span."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import RequestStream
    from tokenmill.params import SamplingParams
    from tokenmill.server.pipeline import EngineJob


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclass(frozen=True)
class StreamFacts:
    """One engine request (one prompt of the HTTP request) once it is over."""

    index: int  # the prompt's place in the request
    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    output_tokens: tuple[int, ...]  # per choice
    finish_reasons: tuple[str | None, ...]  # per choice; None: it did not finish
    engine_arrival: float  # the engine took it (after tokenizing)
    scheduled: float | None
    first_token: float | None
    finished: float | None
    decode_steps: int  # steps after the first token's that added tokens
    # one choice: tokens beyond one per decode step (drafts the target accepted); None else
    accepted_drafts: int | None

    @classmethod
    def of(cls, index: int, stream: RequestStream, prompt_len: int,
           ended: float) -> StreamFacts:
        t, out = stream.timings, stream.last
        choices = out.outputs if out is not None else []
        steps = len(t.token_gaps)  # one gap per step that added tokens after the first
        accepted = max(0, t.num_tokens - 1 - steps) if len(choices) == 1 and t.num_tokens \
            else None
        finished = t.finished if t.finished is not None else \
            (ended if t.first_token is not None else None)  # its abort not yet taken
        return cls(index, stream.request_id,
                   len(out.prompt_token_ids) if out is not None else prompt_len,
                   out.num_cached_tokens if out is not None else 0,
                   tuple(len(c.token_ids) for c in choices),
                   tuple(c.finish_reason.value if c.finish_reason else None for c in choices),
                   t.arrival, t.scheduled, t.first_token, finished, steps, accepted)

    def summary(self) -> dict[str, Any]:
        """Its part of a request log line: seconds from when the engine took it, as the
        server's metrics count them."""
        def since(end: float | None) -> float | None:
            return _seconds(None if end is None else end - self.engine_arrival)

        return {"id": self.request_id, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": list(self.output_tokens),
                "finish_reasons": list(self.finish_reasons), "queue": since(self.scheduled),
                "ttft": since(self.first_token), "e2e": since(self.finished),
                "decode_steps": self.decode_steps}


class RequestRecord:
    """Filled in by the middleware (arrival, headers, body, status, end) and by the pipeline
    (the job and its engine streams); read once ``ended`` is set."""

    def __init__(self, path: str, trace_headers: dict[str, str] | None, keep_body: bool,
                 speculative: bool = False):
        self.path = path
        self.arrival = time.monotonic()
        self._wall = time.time_ns()  # the same instant on the wall clock
        self.trace_headers = trace_headers
        self.chunks: list[bytes] | None = [] if keep_body else None
        self.speculative = speculative
        self.status = 0
        self.client_gone = False
        self.ended: float | None = None
        self.rid: str | None = None
        self.job: EngineJob | None = None
        self.streams: list[RequestStream] = []
        self._facts: list[StreamFacts] | None = None

    def wall_ns(self, monotonic: float) -> int:
        return self._wall + int((monotonic - self.arrival) * 1e9)

    @property
    def wall_time(self) -> float:
        """Arrival in Unix seconds."""
        return self._wall / 1e9

    def attach(self, rid: str, job: EngineJob, streams: list[RequestStream]) -> None:
        self.rid, self.job, self.streams = rid, job, streams

    @property
    def params(self) -> SamplingParams | None:
        return None if self.job is None else self.job.params

    @property
    def model_name(self) -> str | None:
        return None if self.job is None or self.job.model is None else self.job.model.name

    def body(self) -> bytes | None:
        return None if self.chunks is None else b"".join(self.chunks)

    def stream_facts(self) -> list[StreamFacts]:
        """Per engine request, read from its stream once the request ended (cached)."""
        if self._facts is None:
            ended = self.ended if self.ended is not None else time.monotonic()
            prompts = self.job.prompts if self.job is not None else []
            facts = [StreamFacts.of(i, s, len(prompts[i].ids) if i < len(prompts) else 0,
                                    ended) for i, s in enumerate(self.streams)]
            if self.ended is None:
                return facts  # still running: read again next time
            self._facts = facts
        return self._facts

    @property
    def outcome(self) -> str:
        """ok; error (an HTTP error status); aborted (the client left first); failed (the
        engine ended it with an error mid-stream)."""
        if self.status >= 400 or self.status == 0:
            return "error"
        if all(None not in f.finish_reasons and f.finish_reasons
               for f in self.stream_facts()):
            return "ok"
        return "aborted" if self.client_gone else "failed"

    @property
    def failed(self) -> bool:
        return self.outcome in ("error", "failed")

    def summary(self) -> dict[str, Any]:
        """The request log line, less its body (``request_log.RequestLog`` adds that)."""
        facts = self.stream_facts()
        firsts = [f.first_token for f in facts if f.first_token is not None]
        end = self.ended if self.ended is not None else time.monotonic()
        return {"time": round(self.wall_time, 6), "id": self.rid, "path": self.path,
                "status": self.status, "outcome": self.outcome, "model": self.model_name,
                "duration": _seconds(end - self.arrival),
                "ttft": _seconds(min(firsts) - self.arrival) if firsts else None,
                "prompt_tokens": sum(f.prompt_tokens for f in facts),
                "completion_tokens": sum(sum(f.output_tokens) for f in facts),
                "cached_tokens": sum(f.cached_tokens for f in facts),
                "requests": [f.summary() for f in facts]}

    def progress(self) -> dict[str, Any]:
        """Where a request still in flight stands (for a dump)."""
        now = time.monotonic()
        return {"time": round(self.wall_time, 6), "id": self.rid, "path": self.path,
                "age": _seconds(now - self.arrival),
                "requests": [{"id": s.request_id, "scheduled": s.timings.scheduled is not None,
                              "tokens": s.timings.num_tokens} for s in self.streams]}
