"""The serving benchmark client: workloads, counts against the real server, failures, results."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from tests.test_server_support import MODEL, start_server, stop_server
from tokenmill.bench import workloads as wl
from tokenmill.bench.client import BenchClient, RunConfig
from tokenmill.bench.report import format_table, parse_slo, summarize
from tokenmill.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory)
    yield srv
    stop_server(srv)


def test_random_workload_deterministic_and_sized(tok):
    a = wl.random_workload(tok, 6, 40, 10, range_ratio=0.5, seed=3, vocab=tok.vocab_size)
    b = wl.random_workload(tok, 6, 40, 10, range_ratio=0.5, seed=3, vocab=tok.vocab_size)
    c = wl.random_workload(tok, 6, 40, 10, range_ratio=0.5, seed=4, vocab=tok.vocab_size)
    assert a == b and a != c
    for r in a:
        assert 20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))


def test_shared_prefix_workload(tok):
    reqs = wl.shared_prefix_workload(tok, 3, 4, 50, 10, 8, seed=1, vocab=tok.vocab_size)
    assert reqs == wl.shared_prefix_workload(tok, 3, 4, 50, 10, 8, seed=1, vocab=tok.vocab_size)
    assert len(reqs) == 12
    systems = {r.prompt.split("\n")[0] for r in reqs}
    assert len(systems) == 3  # three groups, each shared by four requests
    assert len({r.prompt for r in reqs}) == 12


def test_multi_turn_and_file_workloads(tok, tmp_path):
    convs = wl.multi_turn_workload(tok, 2, 3, 12, 8, seed=5, vocab=tok.vocab_size)
    assert convs == wl.multi_turn_workload(tok, 2, 3, 12, 8, seed=5, vocab=tok.vocab_size)
    assert all(c.is_conversation and len(c.turns) == 3 for c in convs)
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 5}\n\n'
                    '{"messages": [{"role": "system", "content": "s"}, '
                    '{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}\n')
    reqs = wl.file_workload(path, tok, 9)
    assert reqs[0].prompt == "hello there" and reqs[0].output_len == 5
    assert reqs[1].turns == ["a", "b"] and reqs[1].output_len == 9
    path.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        wl.file_workload(path, tok, 9)


def _run(cfg: RunConfig, reqs, tok):
    async def go():
        client = BenchClient(cfg, lambda t: len(tok.encode(t, add_special_tokens=False)))
        try:
            return await client.run(reqs)
        finally:
            await client.close()
    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_counts_against_real_server(server, tok, endpoint):
    reqs = wl.random_workload(tok, 6, 24, 7, seed=0, vocab=tok.vocab_size)
    cfg = RunConfig(server.url, MODEL, endpoint=endpoint, max_concurrency=3, ignore_eos=True)
    results, duration = _run(cfg, reqs, tok)
    s = summarize(results, duration, parse_slo("ttft_ms=60000,tpot_ms=60000"))
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert all(0 < r.ttft <= r.e2e for r in results)
    assert all(len(r.itl) == r.output_tokens - 1 for r in results)  # one token per chunk here
    if endpoint == "completions":
        assert s["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert s["goodput"] == pytest.approx(s["request_throughput"])


def test_multi_turn_sends_history(server, tok):
    convs = wl.multi_turn_workload(tok, 2, 3, 10, 4, seed=2, vocab=tok.vocab_size)
    results, _ = _run(RunConfig(server.url, MODEL, ignore_eos=True), convs, tok)
    assert len(results) == 6 and all(r.ok for r in results)
    # each turn's prompt holds the turns before it, so prompts grow within a conversation
    by_start = sorted(results, key=lambda r: r.start)
    assert max(r.prompt_tokens for r in by_start) > min(r.prompt_tokens for r in by_start)


class _BadServer:
    """A TCP server that misbehaves in one of three ways, on a thread of its own."""

    def __init__(self, mode: str):
        self.mode = mode
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(5)

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        srv = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = srv.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        if self.mode == "500":
            body = b'{"error": {"message": "boom"}}'
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json"
                         b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        elif self.mode == "cut":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            event = b'data: {"choices": [{"text": "hi"}]}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        writer.close()  # "drop": close without answering; "cut": close mid-stream

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize("mode", ["500", "drop", "cut"])
def test_misbehaving_server_counts_failures(tok, mode):
    bad = _BadServer(mode)
    try:
        reqs = [wl.BenchRequest(prompt="hello", prompt_len=1, output_len=4)] * 3
        results, duration = _run(RunConfig(f"http://127.0.0.1:{bad.port}", "m", timeout_s=10),
                                 reqs, tok)
    finally:
        bad.close()
    s = summarize(results, duration)
    assert s["completed"] == 0 and s["failed"] == 3 and s["errors"]
    assert "Completed requests" in format_table(s)


def test_cli_result_file_has_every_field(server, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", server.url,
         "--model", MODEL, "--workload", "shared-prefix", "--num-groups", "2",
         "--prompts-per-group", "2", "--system-len", "40", "--question-len", "8",
         "--output-len", "4", "--ignore-eos", "--max-concurrency", "2", "--no-progress",
         "--slo", "ttft_ms=60000,tpot_ms=60000", "--result-file", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Output token throughput" in proc.stdout
    result = json.loads(out.read_text())
    for key in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "goodput",
                "workload", "max_concurrency", "seed"):
        assert key in result, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert set(result[metric]) == {"mean_ms", "median_ms", "p90_ms", "p99_ms"}
    assert result["completed"] == 4 and result["total_output_tokens"] == 16


def test_parse_slo():
    assert parse_slo("ttft_ms=500,tpot_ms=50") == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError):
        parse_slo("latency=3")


def test_sweep_writes_results_and_plot(server, tmp_path):
    results, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "bench", "sweep", "--base-url", server.url,
         "--model", MODEL, "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
         "--ignore-eos", "--concurrencies", "1,4", "--label", "tokenmill", "--no-progress",
         "--result-file", str(results), "--plot", str(plot)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(results.read_text())
    assert [p["max_concurrency"] for p in runs["tokenmill"]] == [1, 4]
    assert all(p["completed"] == 4 for p in runs["tokenmill"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_turn_shared_system_prompt(tok, tmp_path):
    plain = wl.multi_turn_workload(tok, 3, 2, 10, 4, seed=7, vocab=tok.vocab_size)
    assert all(c.system is None for c in plain)
    convs = wl.multi_turn_workload(tok, 3, 2, 10, 4, seed=7, vocab=tok.vocab_size, system_len=30)
    assert convs == wl.multi_turn_workload(tok, 3, 2, 10, 4, seed=7, vocab=tok.vocab_size,
                                           system_len=30)
    assert len({c.system for c in convs}) == 1  # one system prompt, shared by every conversation
    assert len(tok.encode(convs[0].system, add_special_tokens=False)) == 30
    assert len({c.turns[0] for c in convs}) == 3
    path = tmp_path / "w.jsonl"
    path.write_text('{"messages": [{"role": "system", "content": "be brief"}, '
                    '{"role": "user", "content": "a"}]}\n')
    assert wl.file_workload(path, tok, 9)[0].system == "be brief"


class _RecordingChat:
    """An in-process chat endpoint (httpx MockTransport) that records what each call sent."""

    def __init__(self):
        self.calls: list[list[dict]] = []
        self.active = self.peak = 0

    async def __call__(self, request):
        import httpx

        messages = json.loads(request.content)["messages"]
        self.calls.append(messages)
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(0.01)
        self.active -= 1
        reply = f"reply to {messages[-1]['content']}"
        events = [{"choices": [{"index": 0, "delta": {"content": reply}}]},
                  {"choices": [],
                   "usage": {"prompt_tokens": len(messages), "completion_tokens": 1}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode(),
                              headers={"content-type": "text/event-stream"})


def _run_recorded(convs, max_concurrency):
    import httpx

    chat = _RecordingChat()

    async def go():
        client = BenchClient(RunConfig("http://bench.invalid", "m",
                                       max_concurrency=max_concurrency),
                             lambda text: len(text.split()))
        await client.http.aclose()
        client.http = httpx.AsyncClient(base_url="http://bench.invalid",
                                        transport=httpx.MockTransport(chat))
        try:
            return await client.run(convs)
        finally:
            await client.close()
    results, duration = asyncio.run(go())
    return chat, results, duration


def test_conversation_sends_system_history_and_replies():
    convs = [wl.BenchRequest(turns=[f"{name}{i}" for i in range(3)], system="sys", output_len=2)
             for name in ("a", "b", "c")]
    chat, results, duration = _run_recorded(convs, max_concurrency=2)
    assert len(chat.calls) == 9 and all(r.ok for r in results)
    for messages in chat.calls:
        assert messages[0] == {"role": "system", "content": "sys"}
        body = messages[1:]
        assert [m["role"] for m in body] == ["user", "assistant"] * (len(body) // 2) + ["user"]
        for user, assistant in zip(body[::2], body[1::2]):  # the replies actually received
            assert assistant["content"] == f"reply to {user['content']}"
    assert chat.peak <= 2
    s = summarize(results, duration)
    assert sorted(r.turn for r in results) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert set(s["ttft_by_turn"]) == {"first", "later"}
    assert "TTFT turn 1 median (ms)" in format_table(s)
    from tokenmill.bench.client import CallResult

    assert "ttft_by_turn" not in summarize([CallResult(ok=True)], 1.0)  # single requests


def test_conversation_turns_run_back_to_back():
    """--max-concurrency counts conversations: with one slot, a conversation's turns all go
    before the next conversation starts (no interleaving that would evict its cache)."""
    convs = [wl.BenchRequest(turns=[f"{name}{i}" for i in range(3)], output_len=2)
             for name in ("a", "b")]
    chat, results, _ = _run_recorded(convs, max_concurrency=1)
    assert [m[-1]["content"] for m in chat.calls] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert [r.turn for r in results] == [1, 2, 3, 1, 2, 3]


def test_router_benchmark_workloads_parse(tok):
    """benchmarks/router.py drives ``tokenmill bench serve`` with flags of its own: they must
    stay flags the bench accepts, and build the workloads the note describes."""
    import argparse
    import importlib.util
    from pathlib import Path

    from tokenmill.bench.main import add_bench_parser, build_workload

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "router.py"
    spec = importlib.util.spec_from_file_location("tokenmill_router_bench", path)
    rb = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = rb  # its dataclasses look their module up while being built
    saved_path = list(sys.path)
    try:
        spec.loader.exec_module(rb)
    finally:
        sys.path[:] = saved_path  # it puts benchmarks/ first, for its own imports
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    for workload in ("shared-prefix", "multi-turn"):
        args = parser.parse_args(["bench", "serve", "--model", "m",
                                  *rb.workload_flags(workload, rb.TINY)])
        reqs = build_workload(args, tok)
        if workload == "shared-prefix":
            assert len(reqs) == 8 * rb.TINY.prompts_per_group
            assert len({r.prompt.split("\n")[0] for r in reqs}) == 8
        else:
            assert len(reqs) == rb.TINY.conversations and args.endpoint == "chat"
            assert all(len(r.turns) == rb.TINY.turns for r in reqs)
            assert len({r.system for r in reqs}) == 1 and reqs[0].system


def test_lora_modules_spread_requests_over_adapters(tok):
    """``--lora-modules``: each request names one adapter, drawn reproducibly from the seed, in
    the body the client sends (completions and chat)."""
    from tokenmill.bench.main import build_workload
    from tokenmill.cli import build_parser

    argv = ["bench", "serve", "--model", MODEL, "--num-prompts", "40", "--input-len", "8",
            "--lora-modules", "a", "b", "c", "--seed", "3"]
    args = build_parser().parse_args(argv)
    reqs = build_workload(args, tok)
    assert {r.model for r in reqs} == {"a", "b", "c"}
    assert [r.model for r in build_workload(args, tok)] == [r.model for r in reqs]
    client = BenchClient(RunConfig("http://127.0.0.1:1", MODEL), len)
    try:
        assert client._completion_body(reqs[0])["model"] == reqs[0].model
        assert client._chat_body([], 4, "b")["model"] == "b"
        assert client._completion_body(wl.BenchRequest(prompt="x"))["model"] == MODEL
    finally:
        asyncio.run(client.close())
