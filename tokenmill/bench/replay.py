"""``tokenmill bench replay DIR``: send a request log's requests (``serve --request-log DIR``)
to any OpenAI-compatible server again, each at its logged arrival time (scaled by
``--time-scale``), and report the figures ``bench serve`` reports.

A log written without ``--request-log-prompts`` holds token counts instead of text: each prompt
(and each chat message's content) is rebuilt as random text of the same number of tokens, so
the server sees requests of the same lengths in the same order. Each request asks for as many
tokens as it generated the first time (``ignore_eos``; ``--keep-max-tokens`` sends the logged
``max_tokens`` instead). Only completions and chat requests the server answered with 200 are
sent again; the rest are counted as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.client import BenchClient, CallResult, RunConfig
from tokenmill.bench.report import format_table, parse_slo, summarize
from tokenmill.bench.workloads import Tokenizer, random_text

LOG_NAME = "requests.jsonl"  # as server/request_log.py writes it (bench talks HTTP only)
_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


@dataclass
class ReplayItem:
    """One logged request, ready to send ``offset`` seconds after the replay starts."""

    offset: float
    kind: str  # completions or chat
    body: dict[str, Any]
    prompt_tokens: int  # as logged


def read_log(directory: str | Path) -> list[dict[str, Any]]:
    """Every line of a request log directory, rotated files included, by arrival time; a line
    cut short (a crash while writing) is skipped."""
    paths = sorted(Path(directory).glob("requests*.jsonl*"))  # each server's, rotated too
    if not paths:
        raise ValueError(f"{directory}: no {LOG_NAME} (written by serve --request-log DIR)")
    entries = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    continue
    entries.sort(key=lambda e: e.get("time", 0.0))
    return entries


class PromptBuilder:
    """Text of an exact token count, for prompts logged as counts."""

    def __init__(self, tok: Tokenizer, seed: int = 0):
        self.tok = tok
        self.rng = random.Random(seed)
        self.vocab = getattr(tok, "vocab_size", 32000)
        # tokens the server adds around a completions prompt (a BOS), counted in the log
        self.specials = len(tok.encode("a", add_special_tokens=True)) - \
            len(tok.encode("a", add_special_tokens=False))

    def text(self, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        for _ in range(8):  # decoded random ids re-encode to their count nearly always
            text = random_text(self.rng, self.tok, num_tokens, self.vocab)
            if self._count(text) == num_tokens:
                return text
        return self._padded(text, num_tokens)

    def _padded(self, text: str, num_tokens: int) -> str:
        """Cut or pad a near miss to the count, one word at a time."""
        while self._count(text) > num_tokens:
            text = self.tok.decode(self.tok.encode(text, add_special_tokens=False)[:-1])
        while self._count(text) < num_tokens:
            text += " the"
        return text

    def _count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def completion_prompt(self, logged_tokens: int) -> str:
        return self.text(logged_tokens - self.specials)

    def messages(self, logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages logged as ``{"role", "tokens"}``, with text of those counts."""
        return [{"role": m.get("role") or "user", "content": self.text(m.get("tokens", 0))}
                for m in logged]


def build_items(entries: list[dict[str, Any]], prompts: PromptBuilder, time_scale: float = 1.0,
                keep_max_tokens: bool = False, model: str | None = None
                ) -> tuple[list[ReplayItem], int]:
    """The requests to send (with their offsets from the first one) and how many were
    skipped."""
    items, skipped = [], 0
    start = entries[0]["time"] if entries else 0.0
    for entry in entries:
        body = _body(entry, prompts, keep_max_tokens)
        if body is None:
            skipped += 1
            continue
        if model is not None:
            body["model"] = model
        items.append(ReplayItem((entry["time"] - start) * time_scale, _PATHS[entry["path"]],
                                body, entry.get("prompt_tokens", 0)))
    return items, skipped


def _body(entry: dict[str, Any], prompts: PromptBuilder,
          keep_max_tokens: bool) -> dict[str, Any] | None:
    """The body to send again, or None for a request that is not replayed."""
    logged = entry.get("body")
    if entry.get("status") != 200 or entry.get("path") not in _PATHS \
            or not isinstance(logged, dict) or not entry.get("requests"):
        return None
    body = dict(logged)
    if entry["path"] == "/v1/completions" and "prompt" not in body:
        texts = [prompts.completion_prompt(r["prompt_tokens"]) for r in entry["requests"]]
        body["prompt"] = texts[0] if len(texts) == 1 else texts
    messages = body.get("messages")
    if isinstance(messages, list) and messages and "content" not in messages[0]:
        body["messages"] = prompts.messages(messages)
    for name in ("tools", "functions", "suffix"):
        if isinstance(body.get(name), dict):  # logged as a count: nothing to send
            del body[name]
            body.pop({"tools": "tool_choice", "functions": "function_call"}.get(name, ""), None)
    if not keep_max_tokens:
        _same_output_length(body, entry)
    body.update(stream=True, stream_options={"include_usage": True})
    return body


def _same_output_length(body: dict[str, Any], entry: dict[str, Any]) -> None:
    """Ask for the tokens it generated the first time, however it ended then."""
    generated = max((n for r in entry["requests"] for n in r.get("output_tokens", [])),
                    default=0)
    body.pop("max_completion_tokens", None)
    body.pop("stop", None)
    body.update(max_tokens=max(1, generated), ignore_eos=True)


async def send(items: list[ReplayItem], client: BenchClient,
               on_done: Any = lambda: None) -> tuple[list[CallResult], float, list[float]]:
    """Send each item at its offset; returns the results, the wall time and how late each
    send was (seconds)."""
    results: list[CallResult] = []
    lags: list[float] = []
    start = time.perf_counter()

    async def one(item: ReplayItem) -> None:
        results.append(await client.call(item.body, item.kind))
        on_done()

    tasks = []
    for item in items:
        delay = item.offset - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        lags.append(max(0.0, (time.perf_counter() - start) - item.offset))
        tasks.append(asyncio.create_task(one(item)))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - start, lags


# ----- the command --------------------------------------------------------------------------

def add_replay_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("replay", help="send a request log's requests again at their times")
    p.add_argument("log_dir", help="a serve --request-log directory")
    p.add_argument("--base-url", "--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="send this model name (default: as logged)")
    p.add_argument("--tokenizer", default=None,
                   help="whose tokenizer rebuilds prompts logged as token counts (default: "
                        "the logged model if tokenmill can load it, else the default model)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="arrival times are multiplied by this: 0.5 replays twice as fast, 0 "
                        "sends everything at once (default: 1)")
    p.add_argument("--keep-max-tokens", action="store_true",
                   help="send max_tokens as logged (default: as many tokens as each request "
                        "generated, with ignore_eos)")
    p.add_argument("--limit", type=int, default=None, help="the first N requests only")
    p.add_argument("--seed", type=int, default=0, help="seeds the rebuilt prompts' text")
    p.add_argument("--slo", default=None, help="e.g. ttft_ms=1000,tpot_ms=100")
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-file", default=None, help="the summary as JSON")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: when stderr is a terminal)")
    p.set_defaults(func=cmd_bench_replay)


def _tokenizer(name: str | None, entries: list[dict[str, Any]]) -> Tokenizer:
    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.errors import TokenmillError
    from tokenmill.tokenizer import load_tokenizer

    if name:
        return load_tokenizer(name)
    logged = next((e["model"] for e in entries if e.get("model")), None)
    try:
        return load_tokenizer(logged or DEFAULT_MODEL)
    except TokenmillError:
        return load_tokenizer(DEFAULT_MODEL)


async def replay(args: argparse.Namespace) -> dict[str, Any]:
    """Read, rebuild, send, summarize."""
    from tqdm.auto import tqdm

    if args.time_scale < 0:
        raise ValueError("--time-scale must be >= 0")
    entries = read_log(args.log_dir)[:args.limit]
    tok = _tokenizer(args.tokenizer, entries)
    items, skipped = build_items(entries, PromptBuilder(tok, args.seed), args.time_scale,
                                 args.keep_max_tokens, args.model)
    cfg = RunConfig(args.base_url, args.model or "", api_key=args.api_key)
    client = BenchClient(cfg, lambda text: len(tok.encode(text, add_special_tokens=False)))
    try:
        with tqdm(total=len(items), desc="replay", unit="req",
                  disable=None if args.progress is None else not args.progress) as bar:
            results, duration, lags = await send(items, client, lambda: bar.update(1))
    finally:
        await client.close()
    summary = summarize(results, duration, parse_slo(args.slo))
    summary.update(log_dir=str(args.log_dir), base_url=args.base_url, replayed=len(items),
                   skipped=skipped, time_scale=args.time_scale,
                   send_lag_ms={"mean": 1000 * sum(lags) / len(lags) if lags else 0.0,
                                "max": 1000 * max(lags, default=0.0)})
    return summary


def cmd_bench_replay(args: argparse.Namespace) -> int:
    summary = asyncio.run(replay(args))
    print(f"replayed {summary['replayed']} requests from {args.log_dir} "
          f"({summary['skipped']} skipped), time scale {args.time_scale:g}, sends late by "
          f"{summary['send_lag_ms']['max']:.1f} ms at most", file=sys.stderr)
    print(format_table(summary))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=2))
    return 0 if summary["completed"] == summary["replayed"] else 1
