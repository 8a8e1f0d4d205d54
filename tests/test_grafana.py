"""deploy/grafana and deploy/prometheus without a server: the dashboards' JSON is what their
generator writes, is well formed for Grafana, and names only metrics tokenmill's registry
holds, under either ``--metrics-prefix``; the Prometheus config scrapes what the Kubernetes
manifests announce. The same expressions are checked against a live server's and router's
/metrics in tests/test_dashboard.py."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
PROMETHEUS = ROOT / "deploy" / "prometheus"
# a metric a dashboard names: the server's <prefix>:<name> or the router's tokenmill_router_*
METRIC = re.compile(r"\b(?:tokenmill|vllm):[a-zA-Z0-9_]+|\btokenmill_router_[a-zA-Z0-9_]+")


def generator() -> Any:
    spec = importlib.util.spec_from_file_location("make_dashboards",
                                                  GRAFANA / "make_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expressions(path: Path, prefix: str = "tokenmill") -> list[tuple[str, str]]:
    """(panel title, PromQL with the prefix variable filled in) of every target of a
    dashboard, and the queries of its variables."""
    board = json.loads(path.read_text())
    out = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["query"]["query"])
            for v in board["templating"]["list"] if v["type"] == "query"]
    return [(title, expr.replace("${prefix}", prefix)) for title, expr in out]


def exported_names(text: str) -> set[str]:
    """Every name a /metrics text declares or samples (a counter family is also named with
    its ``_total``: the parser strips it)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        names.update(s.name for s in family.samples)
    return names


def missing_metrics(path: Path, exported: set[str], prefix: str = "tokenmill") -> list[str]:
    """``title: name`` for each metric an expression names that ``exported`` lacks; also an
    entry for an expression that names none."""
    problems = []
    for title, expr in expressions(path, prefix):
        named = METRIC.findall(expr)
        if not named:
            problems.append(f"{title}: no metric in {expr!r}")
        problems += [f"{title}: {name}" for name in named if name not in exported]
    return problems


def registry_text(prefix: str) -> str:
    """A server's /metrics as its registry renders it with speculative decoding on (an
    engine stand-in: its snapshot is all the collectors read)."""
    from tokenmill.engine.async_types import EngineSnapshot
    from tokenmill.engine.info import EngineStats
    from tokenmill.server.metrics import ServerMetrics
    from tokenmill.speculative.decoder import SpecStats

    metrics = ServerMetrics("m", prefix)
    spec = SpecStats(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=1,
                     accepted_per_position=(1, 0))
    metrics.attach(SimpleNamespace(snapshot=EngineSnapshot(stats=EngineStats(spec=spec)),
                                   heartbeat_ages=dict))
    return metrics.render().decode()


def test_the_json_is_what_the_generator_writes() -> None:
    make = generator()
    for name, board in make.dashboards().items():
        assert (GRAFANA / name).read_text() == make.render(board), \
            f"{name} is stale: run python deploy/grafana/make_dashboards.py"


@pytest.mark.parametrize("name", ["tokenmill.json", "tokenmill-router.json"])
def test_dashboards_are_well_formed(name: str) -> None:
    board = json.loads((GRAFANA / name).read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in board["templating"]["list"]}
    for p in board["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        for t in p.get("targets", []):
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            used = set(re.findall(r"\$\{?([a-z_]+)\}?", expr)) - {"__rate_interval"}
            assert used <= variables, f"{p['title']}: unknown variables {used - variables}"
        assert p["type"] == "row" or p["targets"], p["title"]
    rows = [p for p in board["panels"] if p["type"] != "row"]
    assert len(rows) >= 10


@pytest.mark.parametrize("prefix", ["tokenmill", "vllm"])
def test_server_dashboard_names_only_exported_metrics(prefix: str) -> None:
    exported = exported_names(registry_text(prefix))
    assert missing_metrics(GRAFANA / "tokenmill.json", exported, prefix) == []


def test_vllm_prefix_renames_every_metric_and_adds_vllms_older_names() -> None:
    ours = {n.split(":", 1)[1] for n in exported_names(registry_text("tokenmill"))}
    theirs = exported_names(registry_text("vllm"))
    assert all(n.startswith("vllm:") for n in theirs)
    theirs = {n.split(":", 1)[1] for n in theirs}
    # the names vLLM's dashboards and routers read, which tokenmill exports under its own too
    assert ours <= theirs
    assert theirs - ours == {"gpu_cache_usage_perc", "time_per_output_token_seconds",
                             "time_per_output_token_seconds_bucket",
                             "time_per_output_token_seconds_count",
                             "time_per_output_token_seconds_sum",
                             "time_per_output_token_seconds_created"}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "request_success_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                 "request_inference_time_seconds_bucket", "num_requests_swapped",
                 "request_time_per_output_token_seconds_bucket",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"):
        assert name in theirs, name


def test_metrics_prefix_flag() -> None:
    from tokenmill.cli import build_parser
    from tokenmill.server.dashboard_args import dashboard_settings

    args = build_parser().parse_args(["serve", "--metrics-prefix", "vllm",
                                      "--dashboard-show-prompts"])
    assert dashboard_settings(args) == {"metrics_prefix": "vllm",
                                        "dashboard_show_prompts": True}
    defaults = dashboard_settings(build_parser().parse_args(["serve"]))
    assert defaults == {"metrics_prefix": "tokenmill", "dashboard_show_prompts": False}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-prefix", "vllm:x"])


def test_prometheus_scrapes_what_the_manifests_announce() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"tokenmill", "tokenmill-router", "kubernetes-pods"} <= set(jobs)
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())
    pods = jobs["kubernetes-pods"]["relabel_configs"]
    # the adapter's rules (deploy/kubernetes/prometheus-adapter.yaml) select on these labels
    assert {r["target_label"] for r in pods if "target_label" in r} >= {"namespace", "pod"}
    keep = next(r for r in pods if r.get("action") == "keep")
    for manifest in ("worker.yaml", "router.yaml"):
        text = (ROOT / "deploy" / "kubernetes" / manifest).read_text()
        annotations = next(d for d in yaml.safe_load_all(text) if d["kind"] != "Service")[
            "spec"]["template"]["metadata"]["annotations"]
        assert re.fullmatch(keep["regex"], annotations["prometheus.io/scrape"])
        assert annotations["prometheus.io/path"] == "/metrics"


def test_compose_mounts_what_exists() -> None:
    compose = yaml.safe_load((PROMETHEUS / "compose.yaml").read_text())
    for service in compose["services"].values():
        for volume in service["volumes"]:
            source = volume.split(":", 1)[0]
            assert (PROMETHEUS / source).exists(), source
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tokenmill.yml")
                              .read_text())["providers"][0]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["../grafana"] == provider["options"]["path"]
