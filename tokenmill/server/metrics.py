"""Prometheus metrics named like vLLM's (``vllm:`` -> ``tokenmill:``), labelled by model_name.

Counters and histograms are fed by the engine loop thread through ``StatsListener``; gauges are
read from the engine's published snapshot at scrape time.
"""

from __future__ import annotations

import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.async_engine import AsyncEngine, RequestTimings
from tokenmill.request import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class ServerMetrics:
    """One registry per app, so tests can build several apps in one process."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._engine: AsyncEngine | None = None
        r, lab = self.registry, ["model_name"]

        def gauge(name: str, doc: str, read) -> None:
            g = Gauge(f"tokenmill:{name}", doc, lab, registry=r)
            g.labels(model_name).set_function(lambda: read(self._engine.snapshot)
                                              if self._engine else 0.0)

        gauge("num_requests_running", "Requests running on the engine.", lambda s: s.num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting)
        gauge("kv_cache_usage_perc", "KV cache usage, 0 to 1.", lambda s: s.kv_cache_usage)
        gauge("kv_cache_blocks", "Usable KV cache blocks.", lambda s: s.stats.num_blocks)
        gauge("kv_cache_free_blocks", "KV cache blocks free for new tokens (never used, or "
              "cached and evictable).", lambda s: s.stats.num_free_blocks)
        gauge("prefix_cache_blocks", "KV cache blocks the prefix cache holds (in use or "
              "evictable).", lambda s: s.stats.num_cached_blocks)
        gauge("num_requests_loading_kv", "Requests waiting for their KV from a tier or a "
              "prefill instance.", lambda s: s.stats.num_loading)
        gauge("kv_held_requests", "Finished prefills whose KV blocks wait for a decode "
              "instance to pull them.", lambda s: s.stats.num_held)

        def counter(name: str, doc: str, labels=lab):
            return Counter(f"tokenmill:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets):
            return Histogram(f"tokenmill:{name}", doc, lab, buckets=buckets, registry=r)

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
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                               _E2E_BUCKETS)
        self.req_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                    _TOKEN_BUCKETS)
        self.req_gen = histogram("request_generation_tokens", "Generated tokens per request.",
                                 _TOKEN_BUCKETS)
        self.iteration = histogram("iteration_tokens_total", "Tokens per engine step.",
                                   _TOKEN_BUCKETS)
        r.register(_EngineCounters(self))
        r.register(_LoRAInfo(self))
        for c in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.rejections,
                  self.prefix_queries, self.prefix_hits):
            c.labels(model_name)  # export zeros from the start

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

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
        for gap in t.token_gaps:
            self.itl.labels(m).observe(gap)
        if t.finished is not None:
            self.e2e.labels(m).observe(t.finished - t.arrival)
        if t.scheduled is not None:
            self.queue.labels(m).observe(t.scheduled - t.arrival)


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
            "tokenmill:lora_requests_info", "Running and waiting requests' LoRA adapters "
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

    @staticmethod
    def _ranks(engine, model: list[str]):
        """Tensor / pipeline parallel ranks: how long since each was heard from."""
        ages = engine.heartbeat_ages() if engine is not None else {}
        if not ages:
            return
        gauge = GaugeMetricFamily("tokenmill:worker_heartbeat_age_seconds",
                                  "Seconds since each worker rank's last heartbeat.",
                                  labels=["model_name", "rank"])
        for rank, age in ages.items():
            gauge.add_metric([*model, str(rank)], age)
        yield gauge

    def _tiers(self, stats, model: list[str]):
        labels = ["model_name", "tier"]
        for name, doc, field in self._TIER_COUNTERS:
            family = CounterMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            for tier, counts in stats.kv_tiers.items():
                family.add_metric([*model, tier], getattr(counts, field))
            yield family
        for name, doc, field in (("kv_tier_blocks", "KV blocks the tier holds.",
                                  "stored_blocks"),
                                 ("kv_tier_bytes", "Bytes the tier holds.", "stored_bytes")):
            gauge = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            for tier, counts in stats.kv_tiers.items():
                gauge.add_metric([*model, tier], getattr(counts, field))
            yield gauge

    def collect(self):
        engine = self._metrics._engine
        stats = engine.snapshot.stats if engine is not None else None
        model = [self._metrics.model_name]
        for name, doc, field in self._COUNTERS:
            family = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            family.add_metric(model, getattr(stats, field) if stats is not None else 0.0)
            yield family
        yield from self._ranks(engine, model)
        if stats is not None and stats.kv_tiers:
            yield from self._tiers(stats, model)
        spec = stats.spec if stats is not None else None
        if spec is None:
            return
        for name, doc, field in self._SPEC_COUNTERS:
            family = CounterMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            family.add_metric(model, getattr(spec, field))
            yield family
        family = CounterMetricFamily("tokenmill:spec_decode_num_accepted_tokens_per_pos",
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
            gauge = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
