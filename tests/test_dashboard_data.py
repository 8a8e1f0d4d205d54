"""The dashboard's data without a server or a browser: the rolling window's percentiles and
expiry, rates from polled counters, and what /dashboard/data says of in-flight requests (no
prompt text unless asked)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tokenmill.engine.async_types import EngineSnapshot, RequestTimings
from tokenmill.engine.info import EngineInfo, EngineStats
from tokenmill.request import RequestOutput
from tokenmill.server.dashboard_data import DashboardView
from tokenmill.server.dashboard_window import CounterHistory, LatencyWindow, Sample, percentile
from tokenmill.server.metrics import ServerMetrics


def test_percentiles_are_nearest_rank_values() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0


def test_the_window_forgets_what_is_older_than_it_and_caps_its_samples() -> None:
    window = LatencyWindow(seconds=10.0, max_samples=5)
    window.observe("ttft", [1.0, 2.0], now=100.0)
    window.observe("ttft", [3.0], now=105.0)
    assert window.summary("ttft", now=106.0) == {"n": 3, "p50": 2.0, "p99": 3.0, "max": 3.0}
    assert window.summary("ttft", now=112.0)["n"] == 1  # the two at 100 s are past 10 s
    window.observe("ttft", [float(v) for v in range(10)], now=112.0)
    assert window.summary("ttft", now=112.0)["n"] == 5
    assert window.summary("itl")["n"] == 0 and window.summary("itl")["p50"] is None


def test_rates_come_from_counters_between_polls() -> None:
    history = CounterHistory(seconds=60.0, every=1.0)
    for t, tokens in ((0.0, 0.0), (0.5, 10.0), (2.0, 40.0), (8.0, 160.0)):
        history.add(Sample(t, {"generation_tokens_total": tokens}))
    # the poll at 0.5 s came under a second after the first: not kept
    assert [s.t for s in history.samples()] == [0.0, 2.0, 8.0]
    now = Sample(10.0, {"generation_tokens_total": 200.0})
    assert history.rate("generation_tokens_total", now, over=5.0) == 20.0  # since 8 s
    assert history.rate("generation_tokens_total", now, over=9.0) == 20.0  # since 0 s
    assert history.delta("generation_tokens_total", now) == 200.0
    assert CounterHistory().rate("x", now) is None


def _view(show_prompts: bool) -> DashboardView:
    """A view over an engine stand-in with one request in decode and one waiting."""
    now = time.monotonic()
    decoding = SimpleNamespace(
        request_id="cmpl-1", last=RequestOutput("cmpl-1", [5, 6, 7], [], num_cached_tokens=2),
        timings=RequestTimings(arrival=now - 2, scheduled=now - 1, first_token=now - 0.5,
                               num_tokens=4))
    waiting = SimpleNamespace(request_id="cmpl-2", last=None,
                              timings=RequestTimings(arrival=now - 1))
    info = EngineInfo(model="m", vocab_size=10, max_model_len=64, kv_cache_tokens=64,
                      max_num_seqs=4, block_size=16, hardware={"cpu": "a CPU", "isa": ["avx2"]})
    engine = SimpleNamespace(
        in_flight=lambda: [waiting, decoding], info=info,
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "secret prompt"),
        snapshot=EngineSnapshot(1, 1, 0.25, stats=EngineStats(num_blocks=4, num_free_blocks=3)),
        heartbeat_ages=dict)
    metrics = ServerMetrics("m")
    metrics.attach(engine)
    return DashboardView(engine, metrics, "m", show_prompts)


def test_in_flight_requests_without_their_prompts_unless_asked() -> None:
    data = _view(show_prompts=False).data()
    rows = data["requests"]["rows"]
    assert data["requests"]["count"] == 2
    assert [(r["id"], r["state"]) for r in rows] == [("cmpl-1", "decode"), ("cmpl-2", "waiting")]
    assert (rows[0]["prompt_tokens"], rows[0]["cached_tokens"], rows[0]["output_tokens"]) == \
        (3, 2, 4)
    assert all("prompt" not in r for r in rows)
    assert "secret prompt" not in str(data)
    shown = _view(show_prompts=True).data()["requests"]["rows"]
    assert [r["prompt"] for r in shown] == ["secret prompt", None]


def test_the_data_carries_gauges_plan_and_machine() -> None:
    data = _view(show_prompts=False).data()
    assert data["now"]["running"] == 1 and data["now"]["kv_usage"] == 0.25
    assert data["ratios"]["spec_acceptance"] is None  # speculative decoding is off
    labels = {row["label"]: row["value"] for row in data["plan"]}
    assert labels["dtype"] == "float32" and labels["KV cache dtype"] == "auto"
    machine = {row["label"]: row["value"] for row in data["machine"]}
    assert machine == {"CPU": "a CPU", "instruction sets": "avx2"}
    assert data["totals"]["generation_tokens_total"] == 0
