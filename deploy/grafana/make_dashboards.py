"""Writes the Grafana dashboards beside it from the panel lists below:

    python deploy/grafana/make_dashboards.py

``tokenmill.json`` reads a server's ``/metrics``; its ``prefix`` variable is the server's
``--metrics-prefix`` (``tokenmill``, or ``vllm`` for servers started with vLLM's names).
``tokenmill-router.json`` reads a router's ``tokenmill_router_*`` metrics. Every name here is
one the server or the router exports (``tests/test_dashboard.py`` checks each expression
against a live ``/metrics``, ``tests/test_grafana.py`` that the JSON is this script's output).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEL = '{model_name=~"$model_name", instance=~"$instance"}'
RATE = "[$__rate_interval]"
P = "${prefix}:"


def metric(name: str, rate: bool = False, by: str = "") -> str:
    """``sum [by (...)] ([rate(]<prefix>:name{selection}[)])``."""
    inner = f"{P}{name}{SEL}"
    if rate:
        inner = f"rate({inner}{RATE})"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def ratio(part: str, whole: str) -> str:
    return f"{metric(part, rate=True)} / {metric(whole, rate=True)}"


def quantile(q: float, histogram: str) -> str:
    return (f"histogram_quantile({q}, sum by (le) "
            f"(rate({P}{histogram}_bucket{SEL}{RATE})))")


def mean(histogram: str) -> str:
    return ratio(f"{histogram}_sum", f"{histogram}_count")


def quantiles(histogram: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99),
              with_mean: bool = True) -> list[tuple[str, str]]:
    targets = [(quantile(q, histogram), f"p{round(q * 100)}") for q in qs]
    return targets + ([(mean(histogram), "mean")] if with_mean else [])


# ----- the server's dashboard ------------------------------------------------------------------
# (title, unit, description, [(expression, legend)]); a str entry starts a row

STATS = [
    ("Running", "short", "Requests running now.", [(metric("num_requests_running"), "")]),
    ("Waiting", "short", "Requests waiting to be scheduled.",
     [(metric("num_requests_waiting"), "")]),
    ("KV cache usage", "percentunit", "The fullest instance's KV cache.",
     [(f"max({P}kv_cache_usage_perc{SEL})", "")]),
    ("Generation tok/s", "short", "Generated tokens per second, all instances.",
     [(metric("generation_tokens_total", rate=True), "")]),
    ("TTFT p99", "s", "Time to first token, 99th percentile.",
     [(quantile(0.99, "time_to_first_token_seconds"), "")]),
    ("Prefix-cache hit rate", "percentunit", "Prompt tokens whose KV came from the prefix "
     "cache, of those looked up.", [(ratio("prefix_cache_hits_total",
                                            "prefix_cache_queries_total"), "")]),
]

SERVER_PANELS: list[Any] = [
    "Load",
    ("Requests", "short", "Running and waiting requests per instance; swapped is always 0 "
     "(preemption recomputes); loading KV: waiting for their KV from a tier or a prefill "
     "instance.",
     [(metric("num_requests_running", by="instance"), "{{instance}} running"),
      (metric("num_requests_waiting", by="instance"), "{{instance}} waiting"),
      (metric("num_requests_swapped", by="instance"), "{{instance}} swapped"),
      (metric("num_requests_loading_kv", by="instance"), "{{instance}} loading KV")]),
    ("KV cache usage", "percentunit", "Share of the KV cache's blocks in use, per instance.",
     [(f"max by (instance) ({P}kv_cache_usage_perc{SEL})", "{{instance}}")]),
    ("KV cache blocks", "short", "Usable blocks, those free for new tokens (never used or "
     "evictable), and those the prefix cache holds.",
     [(metric("kv_cache_blocks"), "usable"), (metric("kv_cache_free_blocks"), "free"),
      (metric("prefix_cache_blocks"), "prefix cache")]),
    ("Token throughput", "short", "Tokens per second: prompts of finished requests, prompt "
     "tokens computed (cache hits skip it), generated tokens.",
     [(metric("prompt_tokens_total", rate=True), "prompt"),
      (metric("prompt_tokens_computed_total", rate=True), "prompt computed"),
      (metric("generation_tokens_total", rate=True), "generation")]),
    ("Finished requests / s", "reqps", "By finish reason; admission rejections are the "
     "503s of a full queue.",
     [(metric("request_success_total", rate=True, by="finished_reason"), "{{finished_reason}}"),
      (metric("admission_rejections_total", rate=True), "rejected (503)")]),
    ("Preemptions / s", "short", "Running requests sent back to wait (their KV recomputed).",
     [(metric("num_preemptions_total", rate=True), "preemptions")]),
    "Latency",
    ("Time to first token", "s", "Arrival to first token.",
     quantiles("time_to_first_token_seconds")),
    ("Inter-token latency", "s", "Time between output tokens of a request.",
     quantiles("inter_token_latency_seconds")),
    ("End-to-end latency", "s", "Arrival to finish.", quantiles("e2e_request_latency_seconds")),
    ("Request phases (p50)", "s", "Median queue (arrival to first scheduled), prefill "
     "(scheduled to first token), decode (first to last token).",
     [(quantile(0.5, "request_queue_time_seconds"), "queue"),
      (quantile(0.5, "request_prefill_time_seconds"), "prefill"),
      (quantile(0.5, "request_decode_time_seconds"), "decode")]),
    ("Time per output token (per request)", "s", "Each request's first-to-last token time "
     "over its tokens after the first.",
     quantiles("request_time_per_output_token_seconds", (0.5, 0.99), with_mean=False)),
    ("Queue time", "s", "Arrival to first scheduled.",
     quantiles("request_queue_time_seconds", (0.5, 0.99))),
    "Request sizes and steps",
    ("Prompt length", "short", "Prompt tokens per finished request.",
     quantiles("request_prompt_tokens", (0.5, 0.99))),
    ("Generation length", "short", "Generated tokens per finished request.",
     quantiles("request_generation_tokens", (0.5, 0.99))),
    ("Tokens per engine step", "short", "Prompt and generated tokens one step ran.",
     quantiles("iteration_tokens_total", (0.5, 0.99))),
    "Speculative decoding and structured output",
    ("Draft acceptance rate", "percentunit", "Accepted draft tokens of those proposed "
     "(--speculative-method; empty when off).",
     [(ratio("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"),
       "accepted")]),
    ("Tokens per verification", "short", "Accepted drafts + the target's own token, per "
     "verification that carried drafts.",
     [(f"1 + {ratio('spec_decode_num_accepted_tokens_total', 'spec_decode_num_drafts_total')}",
       "mean accepted length")]),
    ("Accepted drafts by position", "short", "Accepted draft tokens per second, by their "
     "index among a sequence's drafts.",
     [(metric("spec_decode_num_accepted_tokens_per_pos_total", rate=True, by="position"),
       "position {{position}}")]),
    ("Structured-output share", "percentunit", "Requests with an output constraint (JSON "
     "schema, regex, choice, grammar, tool choice), of finished requests.",
     [(ratio("structured_output_requests_total", "request_success_total"), "structured")]),
    ("Grammar time", "s", "Mask filling per step that filled masks; compiling constraints "
     "per second.",
     [(ratio("grammar_mask_seconds_total", "grammar_mask_steps_total"), "mask / step"),
      (metric("grammar_compile_seconds_total", rate=True), "compile / s")]),
]


def server_variables() -> list[dict[str, Any]]:
    return [
        datasource_variable(),
        {"name": "prefix", "label": "metrics prefix", "type": "custom",
         "description": "The server's --metrics-prefix.", "query": "tokenmill,vllm",
         "current": {"text": "tokenmill", "value": "tokenmill"},
         "options": [{"text": v, "value": v, "selected": v == "tokenmill"}
                     for v in ("tokenmill", "vllm")]},
        query_variable("model_name", "model", f"label_values({P}num_requests_running, "
                       "model_name)"),
        query_variable("instance", "instance", f"label_values({P}num_requests_running"
                       '{model_name=~"$model_name"}, instance)'),
    ]


# ----- the router's dashboard ------------------------------------------------------------------

def router_quantiles(histogram: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate(tokenmill_router_{histogram}_bucket"
             f'{{instance=~"$instance"}}{RATE})))', f"p{round(q * 100)}") for q in (0.5, 0.99)]


def router_metric(name: str, rate: bool = False, by: str = "") -> str:
    inner = f'tokenmill_router_{name}{{instance=~"$instance"}}'
    if rate:
        inner = f"rate({inner}{RATE})"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


ROUTER_PANELS: list[Any] = [
    "Workers",
    ("Healthy workers", "short", "Admitted workers by role (regular; PD mode: prefill, "
     "decode).", [(router_metric("healthy_workers", by="role"), "{{role}}")]),
    ("In flight per worker", "short", "Requests the router has open on each worker.",
     [(router_metric("in_flight", by="worker"), "{{worker}}")]),
    ("Worker admitted", "short", "1 while a worker answers its health checks and is not "
     "ejected.", [(router_metric("worker_healthy", by="worker"), "{{worker}}")]),
    ("Requests / s", "reqps", "Answered, by worker (empty: the router itself) and status.",
     [(router_metric("requests_total", rate=True, by="worker, status"),
       "{{worker}} {{status}}")]),
    ("Dispatched / s", "reqps", "Requests sent to each worker, retries included.",
     [(router_metric("routed_total", rate=True, by="worker"), "{{worker}}")]),
    ("Retries and ejections", "short", "Requests tried again on another worker, per second; "
     "ejections (circuit opened) in the interval.",
     [(router_metric("retries_total", rate=True), "retries / s"),
      (f'sum by (worker) (increase(tokenmill_router_ejections_total{{instance=~"$instance"}}'
       f"{RATE}))", "{{worker}} ejected")]),
    "Latency",
    ("Request latency", "s", "Arrival at the router to the last byte sent.",
     router_quantiles("request_latency_seconds")),
    ("Worker time to first byte", "s", "Sending a request to a worker to its response "
     "headers.", router_quantiles("upstream_ttfb_seconds")),
    ("Router overhead", "s", "The router's own time before the answering worker got the "
     "request.", router_quantiles("added_latency_seconds")),
    "Routing",
    ("Cache-aware hit estimate", "percentunit", "cache_aware policy: share of the routed "
     "text the chosen worker already held.",
     [('max(tokenmill_router_cache_hit_estimate{instance=~"$instance"})', "estimate")]),
    ("PD mode", "short", "Prompts sent straight to a decode worker, and decode requests "
     "without a KV hand-off, per second.",
     [(router_metric("pd_direct_total", rate=True), "direct"),
      (router_metric("pd_fallbacks_total", rate=True, by="reason"), "fallback {{reason}}")]),
    ("PD prefill time", "s", "Arrival to the KV hand-off (or the fallback).",
     router_quantiles("pd_prefill_seconds")),
]


def router_variables() -> list[dict[str, Any]]:
    return [datasource_variable(),
            query_variable("instance", "router", "label_values(tokenmill_router_in_flight, "
                           "instance)")]


# ----- Grafana's JSON --------------------------------------------------------------------------

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Prometheus", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0}


def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
            "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"}, "sort": 1}


def panel(pid: int, spec: tuple, pos: dict[str, int], kind: str = "timeseries"
          ) -> dict[str, Any]:
    title, unit, description, targets = spec
    options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom",
                                          "showLegend": True},
                               "tooltip": {"mode": "multi", "sort": "none"}}
    if kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    return {"id": pid, "type": kind, "title": title, "description": description,
            "datasource": DATASOURCE, "gridPos": pos,
            "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
            "options": options,
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                         "legendFormat": legend, "range": True}
                        for i, (expr, legend) in enumerate(targets)]}


def layout(specs: list[Any], stats: list[tuple] = ()) -> list[dict[str, Any]]:
    """Stats across the top (4 wide), then rows of panels three to a line (8 wide, 8 high)."""
    panels: list[dict[str, Any]] = []
    for i, spec in enumerate(stats):
        panels.append(panel(len(panels) + 1, spec, {"h": 4, "w": 4, "x": 4 * i, "y": 0},
                            "stat"))
    y, x = (4 if stats else 0), 0
    for spec in specs:
        if isinstance(spec, str):
            y += 8 if x else 0
            panels.append({"id": len(panels) + 1, "type": "row", "title": spec,
                           "collapsed": False, "panels": [],
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
            y, x = y + 1, 0
            continue
        panels.append(panel(len(panels) + 1, spec, {"h": 8, "w": 8, "x": x, "y": y}))
        x = (x + 8) % 24
        y += 8 if x == 0 else 0
    return panels


def dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]],
              variables: list[dict[str, Any]]) -> dict[str, Any]:
    return {"uid": uid, "title": title, "description": description,
            "tags": ["tokenmill", "llm-serving"], "editable": True, "graphTooltip": 1,
            "schemaVersion": 39, "version": 1, "refresh": "10s", "timezone": "browser",
            "time": {"from": "now-1h", "to": "now"}, "fiscalYearStartMonth": 0,
            "links": [], "annotations": {"list": []},
            "templating": {"list": variables}, "panels": panels}


def dashboards() -> dict[str, dict[str, Any]]:
    """File name -> the dashboard's JSON object."""
    return {
        "tokenmill.json": dashboard(
            "tokenmill-server", "tokenmill server", "A tokenmill server's /metrics (or "
            "vLLM-named: set prefix to vllm for --metrics-prefix vllm).",
            layout(SERVER_PANELS, STATS), server_variables()),
        "tokenmill-router.json": dashboard(
            "tokenmill-router", "tokenmill router", "The router's own /metrics: workers, "
            "routing, latency it adds.", layout(ROUTER_PANELS), router_variables()),
    }


def render(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    for name, obj in dashboards().items():
        (HERE / name).write_text(render(obj))
        print(f"wrote {HERE / name}")
