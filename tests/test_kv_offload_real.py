"""The tiered prefix cache with the real default model, in its default dtype: blocks evicted to
host memory or written to disk load back bit for bit, survive a restart, and a corrupt file is a
miss that changes no token."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server_support import metrics, start_server, stop_server
from tokenmill import LLM, SamplingParams

# loads the real model or starts servers / ranks: not in the fast loop
pytestmark = pytest.mark.slow

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "wine making. Within decades presses spread across Europe, books became cheaper, and "
        "literacy rose in the cities. Scholars exchanged ideas faster than ever before, and the "
        "Reformation followed close behind. Printers in Venice, Paris and Antwerp competed for "
        "authors, and pamphlets carried news and arguments to every market town.")
OTHER = ("Tides are caused mainly by the gravitational pull of the Moon on the oceans, with a "
         "smaller contribution from the Sun. When the two line up, at new and full moon, the "
         "tides are strongest; at the quarters they partly cancel and the range is smallest. ")


def _llm(**options) -> LLM:
    # two threads whatever the load: bf16 sums depend on the thread count
    return LLM("smollm2-135m-instruct", block_size=BS, num_threads=2, **options)


def _run(llm: LLM, prompt: list[int]):
    (out,) = llm.generate([prompt], GREEDY)
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.num_cached_tokens


def _decode(tokens: list[int]) -> str:
    from tokenmill.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct").decode(tokens)


def _block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def _wait_for_files(root: Path, count: int, timeout: float = 20.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(files := _block_files(root)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return files


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def disk_runs(disk_dir):
    """One engine with a disk tier: the prompt from scratch, again from the radix cache, and
    again from disk after the radix cache was flushed."""
    llm = _llm(num_blocks=96, kv_offload="disk", kv_offload_size=64 << 20,
               kv_offload_dir=str(disk_dir))
    prompt = llm.tokenizer.encode(TEXT + OTHER)
    cacheable = (len(prompt) - 1) // BS * BS
    scratch = _run(llm, prompt)
    from_radix = _run(llm, prompt)
    files = _wait_for_files(disk_dir, cacheable // BS)
    assert llm.engine.flush_prefix_cache() >= cacheable // BS
    before = llm.engine.stats()
    from_disk = _run(llm, prompt)
    after = llm.engine.stats()
    llm.engine.shutdown()
    return dict(prompt=prompt, cacheable=cacheable, scratch=scratch, from_radix=from_radix,
                from_disk=from_disk, files=files, before=before, after=after)


def test_blocks_reloaded_from_disk_give_bit_identical_logprobs(disk_runs):
    r = disk_runs
    assert len(r["prompt"]) > 6 * BS
    assert len(r["files"]) >= r["cacheable"] // BS  # written through as they were cached
    assert r["from_radix"][2] == r["cacheable"]
    tokens, logprobs, cached = r["from_disk"]
    assert cached == r["cacheable"]
    assert (tokens, logprobs) == r["from_radix"][:2]  # logprobs compared as exact floats
    computed = (r["after"].num_prompt_tokens_computed - r["before"].num_prompt_tokens_computed)
    assert computed == len(r["prompt"]) - r["cacheable"]
    assert r["after"].external_cache_hits - r["before"].external_cache_hits == r["cacheable"]
    assert r["after"].kv_tiers["disk"].hits >= r["cacheable"] // BS


def test_the_disk_tier_survives_a_server_restart(disk_runs, disk_dir, tmp_path_factory):
    """A server started on the directory the engine above wrote (and shut down) finds the
    prompt's blocks there."""
    flags = ("--num-threads", "2", "--kv-offload", "disk", "--kv-offload-size", "64MiB",
             "--kv-offload-dir", str(disk_dir))
    body = {"model": "smollm2-135m-instruct", "prompt": disk_runs["prompt"], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    server = start_server(tmp_path_factory, *flags)
    try:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        # the tier's counters, from the engine core's process where serve runs it
        loaded = metrics(server.url)[("tokenmill:kv_tier_hits_total", (("tier", "disk"),))]
    finally:
        stop_server(server)
    assert loaded == disk_runs["cacheable"] // BS
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == disk_runs["cacheable"]
    assert r.json()["choices"][0]["text"] == _decode(disk_runs["from_radix"][0])


def test_a_corrupt_block_file_is_a_miss_and_changes_no_token(disk_runs, tmp_path, caplog):
    root = tmp_path / "copy"
    llm = _llm(num_blocks=96, kv_offload="disk", kv_offload_size=64 << 20,
               kv_offload_dir=str(root))
    try:
        prompt = disk_runs["prompt"]
        _run(llm, prompt)
        files = _wait_for_files(root, disk_runs["cacheable"] // BS)
        llm.engine.flush_prefix_cache()
        for path in files:  # one flipped payload byte per block
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x40
            path.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="tokenmill.kv_transfer"):
            tokens, logprobs, cached = _run(llm, prompt)
        misses = llm.engine.stats().kv_tiers["disk"].misses
    finally:
        llm.engine.shutdown()
    assert cached == 0  # the first block failed its check: everything was computed
    assert (tokens, logprobs) == disk_runs["scratch"][:2]
    assert misses >= 1
    assert any("checksum mismatch (removed)" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_blocks_evicted_under_pressure_reload_from_host_memory():
    # 19 usable blocks: the prompt's (6) and the filler's (16) cannot both stay cached
    llm = _llm(num_blocks=20, kv_offload="host", kv_offload_size=32 << 20)
    try:
        prompt = llm.tokenizer.encode(TEXT)
        cacheable = (len(prompt) - 1) // BS * BS
        _run(llm, prompt)
        from_radix = _run(llm, prompt)
        for mark in ("A", "B"):  # two fillers: the prompt's blocks are the oldest, evicted
            _run(llm, llm.tokenizer.encode(f"{mark}: {OTHER * 4}"))
        assert llm.engine.stats().kv_tiers["host"].blocks_saved > 0
        tokens, logprobs, cached = _run(llm, prompt)
        stats = llm.engine.stats()
        llm.engine.scheduler.check_integrity()
    finally:
        llm.engine.shutdown()
    assert cached == cacheable
    assert (tokens, logprobs) == from_radix[:2]
    assert stats.external_cache_hits > 0 and stats.kv_tiers["host"].hits > 0


def test_int8_kv_and_speculative_decoding_reload_bit_for_bit(tmp_path):
    """int8 KV blocks (values and scales) move as they are; drafts verified on reloaded KV
    give the same tokens as on the radix cache's."""
    llm = _llm(num_blocks=96, kv_cache_dtype="int8", speculative_method="layerskip",
               kv_offload="disk", kv_offload_size=64 << 20, kv_offload_dir=str(tmp_path))
    try:
        prompt = llm.tokenizer.encode(TEXT + OTHER)
        cacheable = (len(prompt) - 1) // BS * BS
        _run(llm, prompt)
        from_radix = _run(llm, prompt)
        _wait_for_files(tmp_path, cacheable // BS)
        llm.engine.flush_prefix_cache()
        from_disk = _run(llm, prompt)
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    assert llm.engine.info.kv_cache_dtype == "int8"
    assert from_disk[2] == cacheable
    assert from_disk[:2] == from_radix[:2]
    assert stats.num_draft_tokens > 0 and stats.kv_tiers["disk"].hits > 0
