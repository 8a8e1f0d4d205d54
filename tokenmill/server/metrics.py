"""Prometheus metrics named like vLLM's (``vllm:`` -> ``tokenmill:``), labelled by model_name.

Counters and histograms are fed by the engine loop thread through ``StatsListener``; gauges are
read from the engine's published snapshot at scrape time. ``--metrics-prefix vllm`` names them
exactly as vLLM does, for dashboards and routers written against vLLM. Finished requests'
latencies also go to a rolling window, the dashboard's percentiles of the last minutes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.async_engine import AsyncEngine, RequestTimings
from tokenmill.engine.async_types import EngineSnapshot
from tokenmill.request import RequestOutput
from tokenmill.server.dashboard_window import LatencyWindow

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


DEFAULT_PREFIX = "tokenmill"


class ServerMetrics:
    """One registry per app, so tests can build several apps in one process. Every name is
    ``<prefix>:<name>`` (``tokenmill`` by default; ``vllm`` gives vLLM's own names, and adds
    the older names vLLM still exports for its dashboards)."""

    def __init__(self, model_name: str, prefix: str = DEFAULT_PREFIX):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        self.window = LatencyWindow()  # the last minutes' latencies, for the dashboard
        self._engine: AsyncEngine | None = None
        self._add_gauges()
        self._add_counters()
        self._add_latencies()
        self.req_prompt = self._histogram("request_prompt_tokens", "Prompt tokens per request.",
                                          _TOKEN_BUCKETS)
        self.req_gen = self._histogram("request_generation_tokens",
                                       "Generated tokens per request.", _TOKEN_BUCKETS)
        self.iteration = self._histogram("iteration_tokens_total", "Tokens per engine step.",
                                         _TOKEN_BUCKETS)
        self.registry.register(_EngineCounters(self))
        self.registry.register(_LoRAInfo(self))

    def _gauge(self, name: str, doc: str, read: Callable[[EngineSnapshot], float]) -> None:
        g = Gauge(self.name(name), doc, ["model_name"], registry=self.registry)
        g.labels(self.model_name).set_function(
            lambda: read(self._engine.snapshot) if self._engine else 0.0)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ("model_name",)) -> Counter:
        c = Counter(self.name(name), doc, labels, registry=self.registry)
        if len(labels) == 1:
            c.labels(self.model_name)  # export zeros from the start
        return c

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        h = Histogram(self.name(name), doc, ["model_name"], buckets=buckets,
                      registry=self.registry)
        h.labels(self.model_name)  # export an empty histogram from the start
        return h

    def _add_gauges(self) -> None:
        gauge = self._gauge
        gauge("num_requests_running", "Requests running on the engine.", lambda s: s.num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting)
        gauge("num_requests_swapped", "Always 0: tokenmill preempts by recomputing and never "
              "swaps a request's KV out (vLLM v0's name, which its dashboards read).",
              lambda s: 0.0)
        gauge("kv_cache_usage_perc", "KV cache usage, 0 to 1.", lambda s: s.kv_cache_usage)
        if self.prefix == "vllm":  # vLLM's older name of the same, which routers still read
            gauge("gpu_cache_usage_perc", "KV cache usage, 0 to 1 (kv_cache_usage_perc).",
                  lambda s: s.kv_cache_usage)
        gauge("kv_cache_blocks", "Usable KV cache blocks.", lambda s: s.stats.num_blocks)
        gauge("kv_cache_free_blocks", "KV cache blocks free for new tokens (never used, or "
              "cached and evictable).", lambda s: s.stats.num_free_blocks)
        gauge("prefix_cache_blocks", "KV cache blocks the prefix cache holds (in use or "
              "evictable).", lambda s: s.stats.num_cached_blocks)
        gauge("num_requests_loading_kv", "Requests waiting for their KV from a tier or a "
              "prefill instance.", lambda s: s.stats.num_loading)
        gauge("kv_held_requests", "Finished prefills whose KV blocks wait for a decode "
              "instance to pull them.", lambda s: s.stats.num_held)

    def _add_counters(self) -> None:
        counter = self._counter
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Preemptions.")
        self.success = counter("request_success", "Finished requests.",
                               ["model_name", "finished_reason"])
        self.rejections = counter("admission_rejections", "Requests rejected as overload (503).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens whose KV came from the prefix cache.")

    def _add_latencies(self) -> None:
        histogram = self._histogram
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             _LATENCY_BUCKETS)
        # vLLM's older name of the same, still read by its example dashboards
        self.itl_alias = histogram("time_per_output_token_seconds", "Time between output "
                                   "tokens (inter_token_latency_seconds).", _LATENCY_BUCKETS) \
            if self.prefix == "vllm" else None
        self.tpot = histogram("request_time_per_output_token_seconds", "Per request: first "
                              "to last token over the tokens after the first.", _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                               _E2E_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first "
                                 "token.", _E2E_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to last token.",
                                _E2E_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to "
                                   "last token.", _E2E_BUCKETS)

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def name(self, name: str) -> str:
        """A metric's exported name: ``name`` under this registry's prefix."""
        return f"{self.prefix}:{name}"

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ----- StatsListener (called from the engine loop thread) ----------------------------------

    def on_step(self, num_batched_tokens: int, num_new_tokens: int, num_preemptions: int) -> None:
        m = self.model_name
        if num_batched_tokens:
            self.iteration.labels(m).observe(num_batched_tokens)
        if num_new_tokens:
            self.generation_tokens.labels(m).inc(num_new_tokens)
        if num_preemptions:
            self.preemptions.labels(m).inc(num_preemptions)

    def on_request_finished(self, output: RequestOutput, t: RequestTimings) -> None:
        m = self.model_name
        reason = next((c.finish_reason for c in output.outputs if c.finish_reason), None)
        self.success.labels(m, reason.value if reason else "abort").inc()
        self.prompt_tokens.labels(m).inc(len(output.prompt_token_ids))
        self.req_prompt.labels(m).observe(len(output.prompt_token_ids))
        if t.scheduled is not None:  # looked up in the cache when it was first admitted
            self.prefix_queries.labels(m).inc(len(output.prompt_token_ids))
            self.prefix_hits.labels(m).inc(output.num_cached_tokens)
        self.req_gen.labels(m).observe(t.num_tokens)
        if t.first_token is not None:
            self.ttft.labels(m).observe(t.first_token - t.arrival)
        for itl in (self.itl, self.itl_alias) if self.itl_alias else (self.itl,):
            for gap in t.token_gaps:
                itl.labels(m).observe(gap)
        if t.finished is not None:
            self.e2e.labels(m).observe(t.finished - t.arrival)
        if t.scheduled is not None:
            self.queue.labels(m).observe(t.scheduled - t.arrival)
        self._phases(t)
        self._to_window(t)

    def _phases(self, t: RequestTimings) -> None:
        """vLLM's per-request phases: prefill (scheduled to first token), decode (first to
        last token), inference (both), and the mean time per output token after the first."""
        m = self.model_name
        if t.scheduled is None or t.first_token is None or t.last_token is None:
            return  # aborted before its first token: no phase ended
        self.prefill.labels(m).observe(t.first_token - t.scheduled)
        self.decode.labels(m).observe(t.last_token - t.first_token)
        self.inference.labels(m).observe(t.last_token - t.scheduled)
        if t.num_tokens > 1:
            self.tpot.labels(m).observe((t.last_token - t.first_token) / (t.num_tokens - 1))

    def _to_window(self, t: RequestTimings) -> None:
        """The same observations as the histograms above, kept for the dashboard's window."""
        window = self.window
        if t.first_token is not None:
            window.observe("ttft", (t.first_token - t.arrival,))
        window.observe("itl", t.token_gaps)
        if t.finished is not None:
            window.observe("e2e", (t.finished - t.arrival,))
        if t.scheduled is not None:
            window.observe("queue", (t.scheduled - t.arrival,))


class _LoRAInfo:
    """vLLM's ``lora_requests_info``: one sample whose labels are the adapter slots
    (``max_lora``) and the adapters of running and waiting requests (comma-joined names), and
    whose value is when it was read (a dashboard shows the labels of the latest). Exported
    only when the engine serves LoRA adapters. Only the current labels are exported, so
    the series do not pile up as adapters come and go."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self):
        engine = self._metrics._engine
        stats = engine.snapshot.stats if engine is not None else None
        if stats is None or not stats.max_loras:
            return
        gauge = GaugeMetricFamily(
            self._metrics.name("lora_requests_info"), "Running and waiting requests' LoRA adapters "
            "(labels); the value is when they were read (Unix time).",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        gauge.add_metric([self._metrics.model_name, str(stats.max_loras),
                          ",".join(stats.running_loras), ",".join(stats.waiting_loras)],
                         time.time())
        yield gauge


class _EngineCounters:
    """Counters kept by the engine itself, exported from its latest stats snapshot."""

    _COUNTERS = (
        ("structured_output_requests", "Requests with an output constraint (JSON schema, "
         "regex, choice, grammar, tool choice).", "num_structured_requests"),
        ("grammar_compile_seconds", "Time compiling output constraints (cache misses).",
         "grammar_compile_seconds"),
        ("grammar_mask_seconds", "Time filling token masks of constrained sequences, "
         "alongside the forward.", "grammar_mask_seconds"),
        ("grammar_mask_steps", "Steps that filled token masks (mask seconds per step = "
         "grammar_mask_seconds / grammar_mask_steps).", "num_grammar_mask_steps"),
        ("prompt_tokens_computed", "Prompt tokens run through the model (prefix-cache and KV "
         "connector hits skip it).", "num_prompt_tokens_computed"),
        ("external_prefix_cache_hits", "Prompt tokens whose KV a KV connector filled: "
         "offload tiers, or pulled from a prefill instance.", "external_cache_hits"),
    )

    # per KV tier or transfer (--kv-offload host / disk, --kv-role: p2p), labelled by tier
    _TIER_COUNTERS = (
        ("kv_tier_hits", "KV blocks loaded from the tier.", "hits"),
        ("kv_tier_misses", "KV blocks asked of the tier and not loaded (absent, failed "
         "their check, or a transfer cut).", "misses"),
        ("kv_tier_blocks_saved", "KV blocks written to the tier.", "blocks_saved"),
        ("kv_tier_bytes_loaded", "Bytes loaded from the tier.", "bytes_loaded"),
        ("kv_tier_bytes_saved", "Bytes written to the tier.", "bytes_saved"),
        ("kv_tier_load_seconds", "Time spent loading from the tier.", "load_seconds"),
    )

    # speculative decoding (exported when it is on), vLLM's spec_decode names
    _SPEC_COUNTERS = (
        ("spec_decode_num_drafts", "Verifications that carried drafts.", "num_drafts"),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
         "num_draft_tokens"),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
    )

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def _ranks(self, engine, model: list[str]):
        """Tensor / pipeline parallel ranks: how long since each was heard from."""
        ages = engine.heartbeat_ages() if engine is not None else {}
        if not ages:
            return
        gauge = GaugeMetricFamily(self._metrics.name("worker_heartbeat_age_seconds"),
                                  "Seconds since each worker rank's last heartbeat.",
                                  labels=["model_name", "rank"])
        for rank, age in ages.items():
            gauge.add_metric([*model, str(rank)], age)
        yield gauge

    def _tiers(self, stats, model: list[str]):
        labels = ["model_name", "tier"]
        for name, doc, field in self._TIER_COUNTERS:
            family = CounterMetricFamily(self._metrics.name(name), doc, labels=labels)
            for tier, counts in stats.kv_tiers.items():
                family.add_metric([*model, tier], getattr(counts, field))
            yield family
        for name, doc, field in (("kv_tier_blocks", "KV blocks the tier holds.",
                                  "stored_blocks"),
                                 ("kv_tier_bytes", "Bytes the tier holds.", "stored_bytes")):
            gauge = GaugeMetricFamily(self._metrics.name(name), doc, labels=labels)
            for tier, counts in stats.kv_tiers.items():
                gauge.add_metric([*model, tier], getattr(counts, field))
            yield gauge

    def collect(self):
        engine = self._metrics._engine
        stats = engine.snapshot.stats if engine is not None else None
        model = [self._metrics.model_name]
        for name, doc, field in self._COUNTERS:
            family = CounterMetricFamily(self._metrics.name(name), doc, labels=["model_name"])
            family.add_metric(model, getattr(stats, field) if stats is not None else 0.0)
            yield family
        yield from self._ranks(engine, model)
        if stats is not None and stats.kv_tiers:
            yield from self._tiers(stats, model)
        spec = stats.spec if stats is not None else None
        if spec is None:
            return
        for name, doc, field in self._SPEC_COUNTERS:
            family = CounterMetricFamily(self._metrics.name(name), doc, labels=["model_name"])
            family.add_metric(model, getattr(spec, field))
            yield family
        family = CounterMetricFamily(self._metrics.name("spec_decode_num_accepted_tokens_per_pos"),
                                     "Accepted draft tokens by their index in the drafts.",
                                     labels=["model_name", "position"])
        for position, count in enumerate(spec.accepted_per_position):
            family.add_metric([*model, str(position)], count)
        yield family
        for name, doc, value in (
                ("spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens, "
                 "since start.", spec.acceptance_rate),
                ("spec_decode_mean_accepted_length", "Tokens per verification (accepted "
                 "drafts + the target's own), since start.", spec.mean_accepted_length)):
            gauge = GaugeMetricFamily(self._metrics.name(name), doc, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
