"""The router's Prometheus metrics (``tokenmill_router_*``): what it routed where, and at what cost.

One registry per app, so tests (and ``serve --data-parallel-size``) can build several routers in
one process. Per-worker gauges and the policy's estimates are read at scrape time, so the hot
path only bumps counters and observes histograms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Router-side latencies: from well under a millisecond (the router's own work) to minutes
# (a long generation end to end).
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# url -> (in flight, healthy, role); read when scraped
WorkerStates = Callable[[], dict[str, tuple[int, bool, str]]]
PolicyStats = Callable[[], dict[str, float]]


class _LiveGauges(Collector):
    """Gauges whose values live in the pool and the policy: read them when scraped rather than
    mirroring every change into a Gauge."""

    def __init__(self, workers: WorkerStates, policy_stats: PolicyStats):
        self._workers = workers
        self._policy_stats = policy_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily("tokenmill_router_in_flight",
                                      "Requests the router has open on each worker.",
                                      labels=["worker"])
        healthy = GaugeMetricFamily("tokenmill_router_worker_healthy",
                                    "1 while a worker is admitted (answers its health checks, "
                                    "not ejected), else 0.", labels=["worker"])
        per_role = GaugeMetricFamily("tokenmill_router_healthy_workers",
                                     "Admitted workers of each role (regular; PD mode: "
                                     "prefill, decode).", labels=["role"])
        roles: dict[str, int] = {}
        for url, (n, ok, role) in sorted(self._workers().items()):
            in_flight.add_metric([url], n)
            healthy.add_metric([url], 1.0 if ok else 0.0)
            roles[role] = roles.get(role, 0) + ok
        for role, count in sorted(roles.items()):
            per_role.add_metric([role], count)
        yield in_flight
        yield healthy
        yield per_role
        for name, value in sorted(self._policy_stats().items()):
            yield GaugeMetricFamily(f"tokenmill_router_{name}",
                                    f"The routing policy's {name.replace('_', ' ')}.", value=value)


class RouterMetrics:
    """Counters and histograms the proxy feeds; gauges read from the pool and the policy."""

    def __init__(self, workers: WorkerStates, policy_stats: PolicyStats):
        self.registry = r = CollectorRegistry()
        r.register(_LiveGauges(workers, policy_stats))
        self.requests = Counter("tokenmill_router_requests", "Requests answered, by the worker "
                                "that answered (empty: the router itself) and HTTP status.",
                                ["worker", "status"], registry=r)
        self.routed = Counter("tokenmill_router_routed", "Requests dispatched to each worker "
                              "(retries included).", ["worker"], registry=r)
        self.retries = Counter("tokenmill_router_retries", "Requests sent again to another "
                               "worker after one failed before answering.", registry=r)
        self.ejections = Counter("tokenmill_router_ejections", "Times a worker was ejected "
                                 "(circuit opened) after consecutive failures.", ["worker"],
                                 registry=r)
        self.latency = Histogram("tokenmill_router_request_latency_seconds", "Router-side time "
                                 "of a request, arrival to the last byte sent.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("tokenmill_router_upstream_ttfb_seconds", "Time from sending a "
                              "request to a worker to its response headers.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.added = Histogram("tokenmill_router_added_latency_seconds", "The router's own time "
                               "before the answering worker got the request: parsing, routing, "
                               "tokenizing for the policy, failed tries.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.pd_fallbacks = Counter("tokenmill_router_pd_fallbacks", "PD mode: requests sent "
                                    "to a decode worker without a KV hand-off (it computes the "
                                    "prompt itself), by why.", ["reason"], registry=r)
        self.pd_direct = Counter("tokenmill_router_pd_direct", "PD mode: prompts shorter than "
                                 "--pd-min-prompt-tokens, sent straight to a decode worker.",
                                 registry=r)
        self.pd_prefill = Histogram("tokenmill_router_pd_prefill_seconds", "PD mode: the "
                                    "prefill step of a request, arrival to the hand-off (or "
                                    "the fallback).", buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
