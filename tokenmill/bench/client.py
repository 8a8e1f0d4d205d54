"""An async load generator for OpenAI-compatible servers (tokenmill, vLLM, llama.cpp, ...).

Every HTTP call streams, so time to first token and the gaps between tokens are measured at
the client. A server that errors, drops the connection or times out is counted as a failed
request; it never stops the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from tokenmill.bench.workloads import BenchRequest


@dataclass
class CallResult:
    """What one HTTP call did, as seen by the client."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0  # seconds from sending to the first content
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    text: str = ""
    turn: int = 0  # 1, 2, ... within a conversation; 0 for a single request


@dataclass
class RunConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat" (conversations always use chat)
    request_rate: float = float("inf")  # Poisson arrivals; inf sends everything at once
    max_concurrency: int | None = None
    ignore_eos: bool = False
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0


class BenchClient:
    def __init__(self, cfg: RunConfig, count_tokens: Callable[[str], int]):
        self.cfg = cfg
        self.count_tokens = count_tokens  # fallback when a server sends no usage
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers,
                                      timeout=cfg.timeout_s, limits=limits)

    async def close(self) -> None:
        await self.http.aclose()

    async def run(self, reqs: Sequence[BenchRequest],
                  on_done: Callable[[], None] = lambda: None) -> tuple[list[CallResult], float]:
        """Send the workload; returns every call's result and the wall-clock duration."""
        rng = random.Random(self.cfg.seed)
        limit = asyncio.Semaphore(self.cfg.max_concurrency or 1 << 30)
        results: list[CallResult] = []
        tasks = []
        start = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(self._one(req, limit, results, on_done)))
            if self.cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(self.cfg.request_rate))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start

    async def _one(self, req: BenchRequest, limit: asyncio.Semaphore,
                   results: list[CallResult], on_done: Callable[[], None]) -> None:
        # a conversation holds its slot for all its turns: --max-concurrency counts sessions,
        # and a turn follows the one before it at once, as a user in a chat would
        async with limit:
            if req.is_conversation:
                await self._conversation(req, results)
            else:
                results.append(await self.call(self._completion_body(req), "completions"))
        on_done()

    async def _conversation(self, req: BenchRequest, results: list[CallResult]) -> None:
        """Send the turns in order, each with the whole history: the system message, every
        earlier user turn and the assistant's actual replies."""
        history: list[dict[str, str]] = []
        if req.system:
            history.append({"role": "system", "content": req.system})
        for number, turn in enumerate(req.turns, 1):
            history.append({"role": "user", "content": turn})
            res = await self.call(self._chat_body(history, req.output_len, req.model), "chat")
            res.turn = number
            results.append(res)
            if not res.ok:
                break
            history.append({"role": "assistant", "content": res.text})

    def _common(self, output_len: int, model: str | None = None) -> dict:
        body = {"model": model or self.cfg.model, "max_tokens": output_len, "stream": True,
                "temperature": self.cfg.temperature,
                "stream_options": {"include_usage": True}}
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True  # vLLM/tokenmill extra; llama.cpp ignores unknown fields
        return body

    def _completion_body(self, req: BenchRequest) -> dict:
        if self.cfg.endpoint == "chat":
            return self._chat_body([{"role": "user", "content": req.prompt}], req.output_len,
                                   req.model)
        return {**self._common(req.output_len, req.model), "prompt": req.prompt}

    def _chat_body(self, messages: list[dict[str, str]], output_len: int,
                   model: str | None = None) -> dict:
        return {**self._common(output_len, model), "messages": list(messages)}

    async def call(self, body: dict, kind: str) -> CallResult:
        path = "/v1/chat/completions" if kind == "chat" or "messages" in body else "/v1/completions"
        res = CallResult(start=time.perf_counter())
        try:
            await self._stream(path, body, res)
        except (httpx.HTTPError, OSError, ValueError) as e:  # refused, reset, timeout, bad JSON
            res.ok, res.error = False, res.error or f"{type(e).__name__}: {e}"
        res.e2e = time.perf_counter() - res.start
        if res.ok and not res.output_tokens:
            res.output_tokens = self.count_tokens(res.text)
        return res

    async def _stream(self, path: str, body: dict, res: CallResult) -> None:
        async with self.http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {text}"
                return
            last = res.start
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.ok = not res.error
                    return
                last = self._on_event(json.loads(data), res, last)
            res.error = res.error or "stream ended without [DONE]"

    def _on_event(self, event: dict, res: CallResult, last: float) -> float:
        if "error" in event:
            res.error = str(event["error"].get("message", event["error"]))
            return last
        usage = event.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens", 0)
            res.output_tokens = usage.get("completion_tokens", 0)
        piece = "".join(_choice_text(c) for c in event.get("choices", []))
        if not piece:
            return last
        now = time.perf_counter()
        if not res.text:
            res.ttft = now - res.start
        else:
            res.itl.append(now - last)
        res.text += piece
        return now


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""
