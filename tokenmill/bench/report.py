"""Benchmark figures from call results: throughput, latency percentiles, goodput."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.bench.client import CallResult

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        name = key.strip().removesuffix("_ms")
        if name not in METRICS or not value:
            raise ValueError(f"bad SLO {part!r}: use ttft_ms=, tpot_ms=, itl_ms= or e2el_ms=")
        slo[name] = float(value) / 1000
    return slo


def _tpot(r: CallResult) -> float | None:
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {"mean_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    arr = np.asarray(values) * 1000
    out = {"mean_ms": float(arr.mean())}
    for p in PERCENTILES:
        out["median_ms" if p == 50 else f"p{p}_ms"] = float(np.percentile(arr, p))
    return out


def _meets(r: CallResult, slo: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": _tpot(r) or 0.0, "e2el": r.e2e,
              "itl": max(r.itl, default=0.0)}
    return all(values[k] <= limit for k, limit in slo.items())


def summarize(results: Sequence[CallResult], duration: float,
              slo: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft": _stats([r.ttft for r in ok]),
        "tpot": _stats([t for r in ok if (t := _tpot(r)) is not None]),
        "itl": _stats([g for r in ok for g in r.itl]),
        "e2el": _stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
    if any(r.turn for r in results):  # conversations: does a later turn find its history cached?
        summary["ttft_by_turn"] = {"first": _stats([r.ttft for r in ok if r.turn == 1]),
                                   "later": _stats([r.ttft for r in ok if r.turn > 1])}
    if slo:
        good = sum(_meets(r, slo) for r in ok)
        summary["slo_ms"] = {k: v * 1000 for k, v in slo.items()}
        summary["goodput"] = good / duration if duration else 0.0
    return summary


def format_table(s: dict) -> str:
    rows = [("Completed requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Duration (s)", f"{s['duration_s']:.2f}"),
            ("Input tokens", s["total_input_tokens"]), ("Output tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.3f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}")]
    if "goodput" in s:
        rows.append(("Goodput (req/s)", f"{s['goodput']:.3f}"))
    for m in METRICS:
        for key in ("mean_ms", "median_ms", "p90_ms", "p99_ms"):
            rows.append((f"{m.upper()} {key.removesuffix('_ms')} (ms)", f"{s[m][key]:.1f}"))
    for which, by_turn in s.get("ttft_by_turn", {}).items():
        name = "TTFT turn 1" if which == "first" else "TTFT turns 2+"
        rows += [(f"{name} {key.removesuffix('_ms')} (ms)", f"{by_turn[key]:.1f}")
                 for key in ("median_ms", "p99_ms")]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(["=" * (width + 12), *lines, "=" * (width + 12)])
