"""Pass or fail for the long benchmarks in ``benchmarks/`` (the soak, speculation under load, a
noisy neighbour): pure functions of the figures a run recorded, so that every rule is tested on
made-up series (``tests/test_verdicts.py``) and a run can only pass when its figures say so.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# ----- the soak ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakLimits:
    """``warmup_s``: seconds of load (from the sample taken before it) in which memory may grow
    without limit: caches filling (oneDNN keeps a primitive per matmul shape, up to 256 of
    them under ``tokenmill serve``), the allocator's arenas reaching their working size. After it,
    private resident memory (``memory_growth``) may grow by at most ``max_growth_mib_per_hour``."""

    warmup_s: float = 180.0
    max_growth_mib_per_hour: float = 512.0


def growth_mib_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """The Theil-Sen slope of (seconds, MiB) samples, in MiB per hour: the median of the slopes
    between every two samples, so that one sample caught in a burst of allocations (or just
    after a trim) does not decide it. None with fewer than two samples."""
    slopes = [(b - a) / (tb - ta) for (ta, a), (tb, b) in itertools.combinations(points, 2)
              if tb != ta]
    return statistics.median(slopes) * 3600 if slopes else None


def memory_growth(series: Sequence[Mapping], warmup_s: float) -> dict:
    """Private resident memory under load after the warm-up: the samples used and their growth
    rate. ``series``: rows with ``t_s`` (seconds since the sample before the load), ``phase``
    (``load ...`` while clients run) and ``private_mib``: resident memory less shared pages,
    which are the KV cache's (its mapping becomes resident block by block as blocks first
    hold tokens, up to the budget it was given: growth, but no leak)."""
    points = [(row["t_s"], row["private_mib"]) for row in series
              if row["phase"].startswith("load") and row.get("private_mib") is not None
              and row["t_s"] >= warmup_s]
    rate = growth_mib_per_hour(points)
    return {"samples": len(points), "from_s": points[0][0] if points else None,
            "mib_per_hour": None if rate is None else round(rate, 1),
            "first_last_mib": [points[0][1], points[-1][1]] if points else None}


def soak_verdict(series: Sequence[Mapping], final: Mapping, errors: Mapping[str, int],
                 limits: SoakLimits = SoakLimits()) -> dict:
    """Clean when no request failed, the server is idle again with every KV block it had free
    before the load free (or cached and evictable) again, and its private memory after the
    warm-up grew no faster than the limit. ``series[0]`` is the sample before the load;
    ``final`` the gauges once idle, with ``blocks`` (``total``/``free``) where the server
    reports them."""
    problems = []
    if errors:
        problems.append(f"{sum(errors.values())} failed requests: "
                        + ", ".join(f"{n}x {what}" for what, n in errors.items()))
    if "error" in final:
        problems.append(f"server unreachable at the end ({final['error']})")
    for key in ("running", "waiting", "kv_cache_usage"):
        if final.get(key) not in (0, 0.0):
            problems.append(f"{key} = {final.get(key)} once the load was over")
    problems += _leaked_blocks(series[0] if series else {}, final.get("blocks", {}))
    growth = memory_growth(series, limits.warmup_s)
    rate = growth["mib_per_hour"]
    if rate is None:
        problems.append(f"fewer than two memory samples under load after the "
                        f"{limits.warmup_s:g} s warm-up: growth unknown")
    elif rate > limits.max_growth_mib_per_hour:
        problems.append(f"private memory grew {rate:.0f} MiB/hour after the warm-up "
                        f"(limit {limits.max_growth_mib_per_hour:g})")
    return {"clean": not problems, "problems": problems, "memory_growth": growth,
            "limits": {"warmup_s": limits.warmup_s,
                       "max_growth_mib_per_hour": limits.max_growth_mib_per_hour}}


def _leaked_blocks(before: Mapping, blocks: Mapping) -> list[str]:
    """KV blocks free (or evictable) before the load and not after it."""
    idle, free = before.get("free_blocks"), blocks.get("free")
    if idle is None or free is None:
        return ["the server reports no free KV block count: leaked blocks cannot be checked"]
    if free < idle:
        return [f"{idle - free:.0f} KV blocks leaked: {free:.0f} free or evictable once idle, "
                f"{idle:.0f} before the load"]
    return []


# ----- speculation under load ------------------------------------------------------------------

QUEUE_MIN_RATIO = 0.97  # with a queue at high concurrency: speculation must cost (nearly) nothing
GROUNDED_MIN_RATIO = 1.5  # at low concurrency on input-grounded tasks: it must pay


def speculation_verdict(rows: Sequence[Mapping]) -> dict:
    """Each row: ``workload`` (``queue`` or ``grounded``), ``concurrency``, ``ratio``
    (throughput with n-gram speculation over without) and, for queue rows, ``temperature`` and
    ``peak_waiting`` (the most requests seen waiting in the server's queue). Passes when every
    queue row had a queue and a ratio of at least ``QUEUE_MIN_RATIO``, and every grounded row
    at least ``GROUNDED_MIN_RATIO``."""
    minimum = {"queue": QUEUE_MIN_RATIO, "grounded": GROUNDED_MIN_RATIO}
    problems = []
    for r in rows:
        name = f"{r['workload']} at concurrency {r['concurrency']}" + (
            f", temperature {r['temperature']:g}" if r["workload"] == "queue" else "")
        if r["ratio"] < minimum[r["workload"]]:
            problems.append(f"{name}: {r['ratio']:.3f}x < {minimum[r['workload']]}x")
        if r["workload"] == "queue" and not r.get("peak_waiting"):
            problems.append(f"{name}: no request was seen waiting")
    missing = {"queue", "grounded"} - {r["workload"] for r in rows}
    problems += [f"no {w} row was measured" for w in sorted(missing)]
    return {"passed": not problems, "problems": problems, "minimum_ratio": minimum}


# ----- a noisy neighbour -----------------------------------------------------------------------

MIN_LOADED_SHARE = 0.5  # of the idle throughput, with every core busy elsewhere
MAX_START_S = 30.0  # process start to /health 200, with every core busy elsewhere


def neighbour_verdict(idle: Mapping[int, float], loaded: Mapping[int, float],
                      start_s: float) -> dict:
    """``idle`` / ``loaded``: output tok/s by concurrency without and with the busy processes;
    ``start_s``: the server's start-up with them. Passes when every concurrency keeps at least
    ``MIN_LOADED_SHARE`` of its idle throughput and start-up takes under ``MAX_START_S``."""
    problems = []
    shares = {}
    for c, base in sorted(idle.items()):
        share = loaded.get(c, 0.0) / base if base > 0 else 0.0
        shares[c] = round(share, 3)
        if share < MIN_LOADED_SHARE:
            problems.append(f"concurrency {c}: {share:.2f} of the idle throughput under load "
                            f"(< {MIN_LOADED_SHARE})")
    if not idle:
        problems.append("no throughput was measured")
    if not start_s < MAX_START_S:
        problems.append(f"start-up took {start_s:.1f} s with every core busy "
                        f"(limit {MAX_START_S:g} s)")
    return {"passed": not problems, "problems": problems, "loaded_share": shares,
            "start_s": round(start_s, 1)}
