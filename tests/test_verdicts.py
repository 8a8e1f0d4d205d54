"""The verdicts of the long benchmarks (``tokenmill.bench.verdicts``) on made-up series: each
kind of failure fails, and a run that is fine passes. Pure functions, no server."""

from __future__ import annotations

import random

import pytest

from tokenmill.bench.verdicts import (GROUNDED_MIN_RATIO, QUEUE_MIN_RATIO, SoakLimits,
                                      growth_mib_per_hour, neighbour_verdict, soak_verdict,
                                      speculation_verdict)

LIMITS = SoakLimits(warmup_s=180, max_growth_mib_per_hour=512)
IDLE = {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0,
        "blocks": {"total": 5824.0, "free": 5824.0, "prefix_cached": 2000.0}}


def series(growth_after_warmup_mib_per_min: float, seed: int = 0) -> list[dict]:
    """A 5-minute soak sampled every 15 s: private memory climbs 300 MiB in the first 150 s
    (caches filling), then moves at the given rate with +-5 MiB of noise."""
    rng = random.Random(seed)
    rows = [{"t_s": 0.0, "phase": "start", "private_mib": 900.0, "free_blocks": 5824.0,
             "blocks": 5824.0}]
    for t in range(15, 301, 15):
        base = 900 + 300 * min(t, 150) / 150
        base += growth_after_warmup_mib_per_min * max(0, t - 150) / 60
        rows.append({"t_s": float(t), "phase": "load r1" if t < 300 else "load r1 end",
                     "private_mib": round(base + rng.uniform(-5, 5), 1),
                     "free_blocks": 5400.0, "blocks": 5824.0})
    rows.append({"t_s": 306.0, "phase": "idle r1", "private_mib": rows[-1]["private_mib"],
                 "free_blocks": 5824.0, "blocks": 5824.0})
    return rows


def test_theil_sen_slope_ignores_an_outlier() -> None:
    points = [(t, 1000 + t / 60) for t in range(0, 300, 15)]  # 1 MiB a minute
    points[7] = (points[7][0], points[7][1] + 400)  # one sample caught in a burst
    assert growth_mib_per_hour(points) == pytest.approx(60, rel=1e-6)
    assert growth_mib_per_hour(points[:1]) is None


@pytest.mark.parametrize("seed", range(5))
def test_a_plateau_after_the_warm_up_is_clean(seed) -> None:
    v = soak_verdict(series(0.0, seed), IDLE, {}, LIMITS)
    assert v["clean"], v["problems"]
    assert v["memory_growth"]["samples"] == 9  # 180 s .. 300 s, every 15 s
    assert abs(v["memory_growth"]["mib_per_hour"]) < 512


@pytest.mark.parametrize("seed", range(5))
def test_a_leak_above_the_limit_fails(seed) -> None:
    # 20 MiB a minute (1,200 MiB/hour): what the old "last two samples" rule let through
    v = soak_verdict(series(20.0, seed), IDLE, {}, LIMITS)
    assert not v["clean"]
    assert v["memory_growth"]["mib_per_hour"] > 512
    assert any("MiB/hour" in p for p in v["problems"])


def test_memory_growth_needs_samples_after_the_warm_up() -> None:
    v = soak_verdict(series(0.0), IDLE, {}, SoakLimits(warmup_s=300))
    assert not v["clean"] and "growth unknown" in v["problems"][0]


def test_any_failed_request_fails() -> None:
    v = soak_verdict(series(0.0), IDLE, {"HTTP 500": 1}, LIMITS)
    assert not v["clean"] and v["problems"] == ["1 failed requests: 1x HTTP 500"]


def test_leaked_blocks_fail() -> None:
    leaked = {**IDLE, "blocks": {**IDLE["blocks"], "free": 5820.0}}
    v = soak_verdict(series(0.0), leaked, {}, LIMITS)
    assert not v["clean"] and v["problems"] == [
        "4 KV blocks leaked: 5820 free or evictable once idle, 5824 before the load"]
    unknown = {**IDLE, "blocks": {"total": 5824.0}}  # a server without the counts: unchecked
    assert not soak_verdict(series(0.0), unknown, {}, LIMITS)["clean"]


def test_a_server_still_busy_or_gone_fails() -> None:
    busy = {**IDLE, "running": 2.0, "kv_cache_usage": 0.01}
    problems = soak_verdict(series(0.0), busy, {}, LIMITS)["problems"]
    assert [p.split(" =")[0] for p in problems] == ["running", "kv_cache_usage"]
    gone = {"error": "ConnectError", "blocks": {}}
    assert not soak_verdict(series(0.0), gone, {}, LIMITS)["clean"]


def row(workload: str, c: int, ratio: float, waiting: float = 40.0) -> dict:
    return {"workload": workload, "concurrency": c, "ratio": ratio, "temperature": 1.0,
            "peak_waiting": waiting}


def test_speculation_verdict_holds_both_thresholds() -> None:
    good = [row("queue", 64, 0.99), row("queue", 128, QUEUE_MIN_RATIO),
            row("grounded", 1, 1.9), row("grounded", 8, GROUNDED_MIN_RATIO)]
    assert speculation_verdict(good)["passed"]
    slow_queue = [*good[1:], row("queue", 64, 0.95)]
    assert speculation_verdict(slow_queue)["problems"] == [
        "queue at concurrency 64, temperature 1: 0.950x < 0.97x"]
    no_gain = [*good[:3], row("grounded", 8, 1.3)]
    assert speculation_verdict(no_gain)["problems"] == [
        "grounded at concurrency 8: 1.300x < 1.5x"]
    assert speculation_verdict(good[:2])["problems"] == ["no grounded row was measured"]


def test_speculation_verdict_needs_a_queue() -> None:
    no_queue = [row("queue", 64, 1.2, waiting=0.0), row("grounded", 1, 1.9)]
    assert speculation_verdict(no_queue)["problems"] == [
        "queue at concurrency 64, temperature 1: no request was seen waiting"]


def test_neighbour_verdict_half_the_throughput_and_30_s() -> None:
    idle = {1: 30.0, 8: 90.0}
    assert neighbour_verdict(idle, {1: 16.0, 8: 45.0}, 20.0)["passed"]
    v = neighbour_verdict(idle, {1: 14.0, 8: 60.0}, 20.0)
    assert not v["passed"] and v["loaded_share"] == {1: 0.467, 8: 0.667}
    assert not neighbour_verdict(idle, {1: 16.0, 8: 45.0}, 31.0)["passed"]
    assert not neighbour_verdict(idle, {1: 16.0}, 20.0)["passed"]  # a run that never finished
    assert not neighbour_verdict({}, {}, 20.0)["passed"]
