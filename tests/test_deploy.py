"""The Kubernetes manifests in ``deploy/kubernetes``, checked without a cluster: each object
deserializes into the ``kubernetes`` client's model of its kind and serializes back unchanged
(a misspelt or misplaced field would be dropped), the pieces refer to each other consistently
(selectors, ports, names, the workers the router lists), the commands parse with tokenmill's own
CLI, and the autoscaler's metrics are series tokenmill exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
# what a Prometheus series of a metric family may be called
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")


def _objects() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in _objects() if o["kind"] == kind]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in _by_kind(kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _model_name(obj: dict[str, Any]) -> str:
    """apps/v1 Deployment -> V1Deployment; autoscaling/v2 HorizontalPodAutoscaler ->
    V2HorizontalPodAutoscaler (the client's class names)."""
    return obj["apiVersion"].split("/")[-1].capitalize() + obj["kind"]


def _round_trip(obj: dict[str, Any]) -> Any:
    client = kubernetes.client.ApiClient()
    model = client._ApiClient__deserialize(obj, _model_name(obj))
    return client.sanitize_for_serialization(model)


def test_there_are_manifests() -> None:
    kinds = {o["kind"] for o in _objects()}
    assert {"Service", "StatefulSet", "Deployment", "HorizontalPodAutoscaler",
            "ConfigMap"} <= kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_object_is_its_kind_and_loses_no_field(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path.name} holds no object"
    for obj in docs:
        assert hasattr(kubernetes.client, _model_name(obj)), obj["kind"]
        assert _round_trip(obj) == obj, f"{path.name}: {obj['kind']} changed on a round trip"


def test_the_round_trip_catches_a_misspelt_field() -> None:
    worker = _one("StatefulSet", "tokenmill-worker")
    bad = {**worker, "spec": {**worker["spec"], "replica": 3}}
    assert _round_trip(bad) != bad


def test_the_kustomization_lists_the_cluster_objects() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert all((DEPLOY / r).is_file() for r in kustomization["resources"])
    assert set(kustomization["resources"]) == {"worker.yaml", "router.yaml", "hpa.yaml"}


# ----- the pieces fit together ------------------------------------------------------------------

def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _container_ports(workload: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in _pod_spec(workload)["containers"]
            for p in c.get("ports", [])}


def _workloads() -> list[dict[str, Any]]:
    return _by_kind("Deployment") + _by_kind("StatefulSet")


@pytest.mark.parametrize("service", _by_kind("Service"), ids=lambda s: s["metadata"]["name"])
def test_each_service_selects_a_workload_and_its_ports(service: dict[str, Any]) -> None:
    selector = service["spec"]["selector"]
    matched = [w for w in _workloads()
               if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert len(matched) == 1, f"{service['metadata']['name']} selects {len(matched)} workloads"
    workload = matched[0]
    assert selector.items() <= workload["spec"]["selector"]["matchLabels"].items()
    ports = _container_ports(workload)
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports or port["targetPort"] in ports.values()


@pytest.mark.parametrize("workload", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_probes_and_scrape_annotations_name_real_ports(workload: dict[str, Any]) -> None:
    ports = _container_ports(workload)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for container in _pod_spec(workload)["containers"]:
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in ports, probe
        assert container["resources"]["requests"] and container["resources"]["limits"]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_workers_are_a_headless_service_with_stable_names() -> None:
    worker = _one("StatefulSet", "tokenmill-worker")
    service = _one("Service", worker["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert _pod_spec(worker)["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_router_lists_every_worker_the_autoscaler_may_create() -> None:
    worker = _one("StatefulSet", "tokenmill-worker")
    hpa = _one("HorizontalPodAutoscaler", "tokenmill-worker")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", "tokenmill-worker")
    assert target["apiVersion"] == worker["apiVersion"]
    args = _router_args()
    urls = [args[i + 1] for i, a in enumerate(args) if a == "--worker"]
    port = _container_ports(worker)["http"]
    service = worker["spec"]["serviceName"]
    assert urls == [f"http://tokenmill-worker-{i}.{service}:{port}"
                    for i in range(hpa["spec"]["maxReplicas"])]
    assert hpa["spec"]["minReplicas"] <= worker["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def _router_args() -> list[str]:
    return _pod_spec(_one("Deployment", "tokenmill-router"))["containers"][0]["args"]


def _worker_args() -> list[str]:
    return _pod_spec(_one("StatefulSet", "tokenmill-worker"))["containers"][0]["args"]


def test_the_commands_parse_with_tokenmills_own_cli() -> None:
    from tokenmill.cli import build_parser, engine_options
    from tokenmill.router.cli import config_from_args

    serve = build_parser().parse_args(_worker_args())
    engine_options(serve)  # engine flags that cannot go together fail here
    assert (serve.host, serve.port, serve.public_metrics) == ("0.0.0.0", 8000, True)
    events = serve.kv_events_config
    assert events.publishing
    router = config_from_args(build_parser().parse_args(_router_args()))
    assert router.policy == "cache_aware" and router.port == 8000
    ports = _container_ports(_one("StatefulSet", "tokenmill-worker"))
    assert serve.port == ports["http"]
    assert events.endpoint == f"tcp://*:{ports['kv-events']}"
    assert events.replay_endpoint == f"tcp://*:{ports['kv-replay']}"


# ----- the autoscaling signals exist ------------------------------------------------------------

def _exported_series() -> set[str]:
    """Every series name a tokenmill server's /metrics can hold."""
    from tokenmill.server.metrics import ServerMetrics

    families = {m.name for m in ServerMetrics("m").registry.collect()}
    return {f + s for f in families for s in _SUFFIXES}


def _adapter_rules() -> list[dict[str, Any]]:
    config = _one("ConfigMap", "adapter-config")["data"]["config.yaml"]
    return yaml.safe_load(config)["rules"]


def test_the_adapter_rules_read_series_tokenmill_exports() -> None:
    exported = _exported_series()
    for rule in _adapter_rules():
        series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
        assert series in exported, f"{series} is not a tokenmill metric"
        assert re.fullmatch(rule["name"]["matches"], series)
        assert ":" not in rule["name"]["as"]  # custom metric names cannot hold one
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_the_hpa_scales_on_queue_depth_and_kv_usage_through_the_adapter() -> None:
    hpa = _one("HorizontalPodAutoscaler", "tokenmill-worker")
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names == ["tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_perc"]
    served = {r["name"]["as"]: re.match(r"[\w:]+", r["seriesQuery"]).group(0)
              for r in _adapter_rules()}
    assert served["tokenmill_num_requests_waiting"] == "tokenmill:num_requests_waiting"
    assert served["tokenmill_kv_cache_usage_perc"] == "tokenmill:kv_cache_usage_perc"
    assert set(names) <= set(served)
