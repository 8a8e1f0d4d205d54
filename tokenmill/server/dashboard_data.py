"""What ``GET /dashboard/data`` answers: the server's figures now, over the last minutes, and
what it runs, as one JSON object the page (``server/static/dashboard.js``) draws.

Totals are read from the same Prometheus registry ``/metrics`` renders, so the page and a
scrape agree; rates come from those counters between polls (``CounterHistory``), latency
percentiles from the listener's rolling window (``LatencyWindow``)."""

from __future__ import annotations

import math
import time
from typing import Any

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine, RequestStream
from tokenmill.server.dashboard_window import CounterHistory, Sample
from tokenmill.server.metrics import ServerMetrics

_MAX_ROWS = 100  # in-flight requests listed (the oldest first); the count covers them all
_PROMPT_TOKENS = 64  # of a prompt shown with --dashboard-show-prompts
_RATE_SECONDS = 5.0  # "now" for tok/s: the last few seconds of polls
_LATENCIES = ("ttft", "itl", "e2e", "queue")
# gauges and counters kept per poll, by their name without the prefix
_HISTORY = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "prompt_tokens_computed_total", "generation_tokens_total", "request_success_total",
            "num_preemptions_total")


class DashboardView:
    """Builds the page's data from the engine and the metrics; lives as long as the app."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                 show_prompts: bool = False):
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.show_prompts = show_prompts
        self.history = CounterHistory()
        self.started = time.time()

    def data(self) -> dict[str, Any]:
        """The whole answer (on the event loop; a registry collection, like a scrape)."""
        now = Sample(time.time(), self.values())
        self.history.add(now)
        v = now.values
        return {
            "kind": "server", "model": self.model_name, "version": tokenmill.__version__,
            "time": now.t, "uptime_s": now.t - self.started, "window_s": self.history.seconds,
            "prefix": self.metrics.prefix, "show_prompts": self.show_prompts,
            "now": _gauges(v), "totals": _totals(v), "rates": self._rates(now),
            "ratios": self._ratios(now), "latency": self._latency(),
            "history": self._series(), "requests": self._requests(),
            "plan": plan_rows(self.engine.info), "machine": machine_rows(self.engine.info),
        }

    def values(self) -> dict[str, float]:
        """Every sample of the registry by its name without the prefix, summed over labels
        (finish reason, tier, position...); histogram buckets and creation times left out."""
        prefix = f"{self.metrics.prefix}:"
        out: dict[str, float] = {}
        for family in self.metrics.registry.collect():
            for s in family.samples:
                if "le" in s.labels or s.name.endswith("_created"):
                    continue
                if not math.isfinite(s.value):  # a rate of nothing yet: JSON has no NaN
                    continue
                name = s.name.removeprefix(prefix)
                out[name] = out.get(name, 0.0) + s.value
        return out

    def _rates(self, now: Sample) -> dict[str, float | None]:
        def rate(name: str) -> float | None:
            return self.history.rate(name, now, _RATE_SECONDS)

        return {"prompt_tps": rate("prompt_tokens_computed_total"),
                "generation_tps": rate("generation_tokens_total"),
                "requests_per_s": rate("request_success_total"),
                "preemptions_per_s": rate("num_preemptions_total")}

    def _ratios(self, now: Sample) -> dict[str, dict[str, Any] | None]:
        """Shares over the kept history (since start while it holds no change)."""
        return {"prefix_hit_rate": self._ratio(now, "prefix_cache_hits_total",
                                               "prefix_cache_queries_total"),
                "spec_acceptance": self._ratio(now, "spec_decode_num_accepted_tokens_total",
                                               "spec_decode_num_draft_tokens_total"),
                "structured_share": self._ratio(now, "structured_output_requests_total",
                                                "request_success_total")}

    def _ratio(self, now: Sample, part: str, whole: str) -> dict[str, Any] | None:
        if whole not in now.values:  # not exported: speculative decoding off, say
            return None
        num, den = self.history.delta(part, now), self.history.delta(whole, now)
        over = "window"
        if den <= 0:
            num, den, over = now.values.get(part, 0.0), now.values[whole], "since start"
        return {"value": min(1.0, num / den) if den > 0 else None, "over": over}

    def _latency(self) -> dict[str, dict[str, Any]]:
        window = self.metrics.window
        return {name: window.summary(name) for name in _LATENCIES}

    def _series(self) -> dict[str, list[float | None]]:
        """The charts' points: gauges as sampled, counters as rates between samples."""
        samples = self.history.samples()
        out: dict[str, list[float | None]] = {"t": [s.t for s in samples]}
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            out[name] = [s.values.get(name) for s in samples]
        for name in ("prompt_tokens_computed_total", "generation_tokens_total"):
            out[name] = [None] + [_per_second(a, b, name) for a, b in zip(samples, samples[1:])]
        return out

    def _requests(self) -> dict[str, Any]:
        streams = sorted(self.engine.in_flight(), key=lambda s: s.timings.arrival)
        now = time.monotonic()
        return {"count": len(streams), "rows": [self._row(s, now) for s in streams[:_MAX_ROWS]]}

    def _row(self, stream: RequestStream, now: float) -> dict[str, Any]:
        t, last = stream.timings, stream.last
        state = "waiting" if t.scheduled is None else \
            "prefill" if t.first_token is None else "decode"
        row: dict[str, Any] = {
            "id": stream.request_id, "state": state, "age_s": now - t.arrival,
            "prompt_tokens": len(last.prompt_token_ids) if last else None,
            "cached_tokens": last.num_cached_tokens if last else None,
            "output_tokens": t.num_tokens}
        if self.show_prompts:
            row["prompt"] = self._prompt_text(last.prompt_token_ids) if last else None
        return row

    def _prompt_text(self, ids: list[int]) -> str:
        text = self.engine.tokenizer.decode(ids[:_PROMPT_TOKENS], skip_special_tokens=False)
        return text + ("…" if len(ids) > _PROMPT_TOKENS else "")


def _per_second(a: Sample, b: Sample, name: str) -> float:
    return max(0.0, b.values.get(name, 0.0) - a.values.get(name, 0.0)) / (b.t - a.t)


def _gauges(v: dict[str, float]) -> dict[str, float]:
    return {"running": v.get("num_requests_running", 0.0),
            "waiting": v.get("num_requests_waiting", 0.0),
            "loading_kv": v.get("num_requests_loading_kv", 0.0),
            "held_kv": v.get("kv_held_requests", 0.0),
            "kv_usage": v.get("kv_cache_usage_perc", 0.0),
            "kv_blocks": v.get("kv_cache_blocks", 0.0),
            "kv_free_blocks": v.get("kv_cache_free_blocks", 0.0),
            "prefix_cache_blocks": v.get("prefix_cache_blocks", 0.0)}


# counters shown as totals since start, by the names /metrics gives them (without the prefix)
_TOTALS = ("request_success_total", "prompt_tokens_total", "generation_tokens_total",
           "prompt_tokens_computed_total", "prefix_cache_queries_total",
           "prefix_cache_hits_total", "num_preemptions_total", "admission_rejections_total",
           "structured_output_requests_total", "spec_decode_num_draft_tokens_total",
           "spec_decode_num_accepted_tokens_total", "time_to_first_token_seconds_count",
           "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count")


def _totals(v: dict[str, float]) -> dict[str, float]:
    return {name: v[name] for name in _TOTALS if name in v}


def _row_of(label: str, value: Any, why: str = "") -> dict[str, str]:
    return {"label": label, "value": value if isinstance(value, str) else _text(value),
            "why": why}


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) for v in value)
    return str(value)


def plan_rows(info: Any) -> list[dict[str, str]]:
    """The load-time plan as label / value / why rows (``EngineInfo`` and its ``plan``)."""
    plan = info.plan or {}
    linear = plan.get("linear") or {}
    kv = plan.get("kv_cache") or {}
    return [_row_of("device", plan.get("device", "?")),
            _row_of("dtype", info.dtype, info.dtype_reason),
            _row_of("KV cache dtype", info.kv_cache_dtype, info.kv_cache_dtype_reason),
            _row_of("attention", info.attention_backend,
                    (plan.get("attention_backend") or {}).get("why", "")),
            _row_of("weight format", info.quantization,
                    f"GGUF blocks {linear['gguf_blocks']}" if linear.get("gguf_blocks") else ""),
            _row_of("linear kernels", linear.get("kernels", "?")),
            _row_of("CPU step", info.cpu_step), _row_of("CUDA graphs", info.cuda_graphs),
            _row_of("KV cache", f"{info.kv_cache_tokens} tokens in "
                    f"{kv.get('num_blocks', '?')} blocks of {info.block_size}",
                    str(kv.get("budget", ""))),
            _row_of("max model len", info.max_model_len),
            _row_of("max running", info.max_num_seqs),
            _row_of("speculative", info.speculative or "off"),
            _row_of("threads", (plan.get("threads") or {}).get("count", "?")),
            _row_of("parallel", plan.get("parallel", "one process"))]


def machine_rows(info: Any) -> list[dict[str, str]]:
    """The machine the plan was made for: CPU model, instruction sets, cores; or the GPU."""
    machine = {**(info.hardware or {}), **((info.plan or {}).get("machine") or {})}
    names = {"cpu": "CPU", "isa": "instruction sets", "cores": "cores",
             "cpu_kernels": "C++ kernels built", "gpu": "GPU", "capability": "capability"}
    return [_row_of(names.get(k, k), v) for k, v in machine.items()]
