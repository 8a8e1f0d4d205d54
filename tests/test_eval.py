"""`tokenmill eval perplexity`: the sliding windows, chunked prefill through the paged KV cache,
the real model against transformers on the same ids, and the command line."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
import torch

from tokenmill.eval.perplexity import (DEFAULT_TEXT, EvalError, build_eval_engine,
                                       engine_perplexity, load_text, plan_windows)

CLI = [sys.executable, "-m", "tokenmill.cli", "eval", "perplexity"]


# ----- the windows (pure) -----------------------------------------------------------------------

@pytest.mark.parametrize("n, context, stride", [(2, 2, 1), (10, 4, 4), (10, 4, 1), (1000, 64, 32),
                                                (65, 64, 32), (64, 64, 32), (100, 8, 3)])
def test_windows_score_each_token_once(n, context, stride):
    """Overlapping windows score every token but the first; disjoint ones (stride == context)
    every token but each window's first, which has no history there."""
    windows = plan_windows(n, context, stride)
    scored = [t for w in windows for t in range(w.score_from, w.end)]
    assert scored == [t for t in range(1, n) if stride < context or t % context]
    for w in windows:
        assert w.end - w.start <= context and w.start < w.score_from <= w.end - 1
    for prev, w in itertools.pairwise(windows):
        assert w.start == prev.start + stride
        assert w.score_from - w.start >= context - stride  # history every scored token sees


def test_shipped_text_is_installed_and_thousands_of_tokens():
    from tokenmill.tokenizer import load_tokenizer

    text = load_text()
    assert DEFAULT_TEXT.name == "eval.txt" and "Four score and seven years ago" in text
    assert "def build_flat_batch(" in text  # the project's own code is part of it
    assert 4000 <= len(load_tokenizer("smollm2-135m-instruct").encode(text)) <= 8000


def test_bad_text_files_are_eval_errors(tmp_path):
    with pytest.raises(EvalError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text(" \n\n")
    with pytest.raises(EvalError, match="is empty"):
        load_text(tmp_path / "blank.txt")


# ----- a tiny random model: windows and chunks through the engine -------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(engine in float32, the same weights in transformers). qwen3's head size (32) is one the
    compiled CPU attention takes."""
    from tests.tiny_models import write_word_tokenizer
    from tests.tiny_models import COMMON, make_hf_model, save_hf_model

    hf = make_hf_model("qwen3", seed=3)
    directory = save_hf_model(hf, tmp_path_factory.mktemp("tiny-eval"))
    write_word_tokenizer(directory, COMMON["vocab_size"])
    return build_eval_engine(str(directory), 128, dtype="float32"), hf


@pytest.fixture(scope="module")
def tiny_ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 96, (300,), generator=g).tolist()


def hf_window_nll(hf, ids, context, stride) -> tuple[float, int]:
    """Summed NLL of the same windows, each a full forward of transformers' model."""
    nll = 0.0
    for w in plan_windows(len(ids), context, stride):
        with torch.no_grad():
            logits = hf(torch.tensor([ids[w.start:w.end]])).logits[0].float()
        rows = logits.log_softmax(-1)[w.score_from - w.start - 1:-1]
        nll -= rows.gather(1, torch.tensor(ids[w.score_from:w.end])[:, None]).double().sum().item()
    return nll, len(ids) - 1


def test_stride_equal_to_context_is_the_mean_of_independent_windows(tiny, tiny_ids):
    engine, _ = tiny
    whole = engine_perplexity(engine, tiny_ids, context=32, stride=32, chunk=32)
    nll = scored = 0
    for start in range(0, len(tiny_ids), 32):
        alone = engine_perplexity(engine, tiny_ids[start:start + 32], context=32, chunk=32)
        assert alone.windows == 1
        nll, scored = nll + alone.mean_nll * alone.tokens_scored, scored + alone.tokens_scored
    assert whole.windows == 10 and whole.tokens_scored == scored == len(tiny_ids) - 10
    assert whole.mean_nll == pytest.approx(nll / scored, rel=1e-5)


def test_chunked_prefill_equals_one_chunk_and_transformers(tiny, tiny_ids):
    engine, hf = tiny
    one = engine_perplexity(engine, tiny_ids, context=64, stride=24, chunk=64)
    for chunk in (7, 16, 50):
        chunked = engine_perplexity(engine, tiny_ids, context=64, stride=24, chunk=chunk)
        assert chunked.perplexity == pytest.approx(one.perplexity, rel=1e-4)
    nll, scored = hf_window_nll(hf, tiny_ids, 64, 24)
    assert one.tokens_scored == scored and one.windows == len(plan_windows(300, 64, 24))
    assert one.perplexity == pytest.approx(math.exp(nll / scored), rel=1e-4)


def test_default_stride_is_half_the_context_and_max_tokens_cuts(tiny, tiny_ids):
    engine, _ = tiny
    r = engine_perplexity(engine, tiny_ids, max_tokens=100)  # context: the model's 128
    assert (r.context, r.stride, r.tokens_scored, r.windows) == (128, 64, 100, 1)
    assert r.dtype == "float32" and r.kv_cache_dtype == "auto" and not r.bos


def test_window_errors_are_clear(tiny, tiny_ids):
    engine, _ = tiny
    with pytest.raises(EvalError, match="at least 2"):
        engine_perplexity(engine, tiny_ids, context=1)
    with pytest.raises(EvalError, match="exceeds the model's length 128"):
        engine_perplexity(engine, tiny_ids, context=256)
    with pytest.raises(EvalError, match="--stride must be between 1 and the context"):
        engine_perplexity(engine, tiny_ids, context=32, stride=33)
    with pytest.raises(EvalError, match="needs at least 2"):
        engine_perplexity(engine, tiny_ids[:1], context=32)


# ----- the real default model -------------------------------------------------------------------

@pytest.mark.slow
def test_real_model_matches_transformers_on_one_window(hf_default_float32):
    hf = hf_default_float32[0]
    engine = build_eval_engine("smollm2-135m-instruct", 256, dtype="float32")
    ids = engine.tokenizer.encode(load_text())[:256]
    ours = engine_perplexity(engine, ids, context=256, chunk=96)  # 3 chunks through the cache
    assert (ours.windows, ours.tokens_scored, ours.dtype) == (1, 255, "float32")
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    ref = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).double().mean().item()
    assert ours.perplexity == pytest.approx(math.exp(ref), rel=1e-3)
    assert 1 < ours.perplexity < 100


@pytest.mark.slow
def test_cli_json_on_the_real_model():
    out = subprocess.run([*CLI, "--max-tokens", "256", "--json"], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1
    assert result["tokens_scored"] == 256 and result["windows"] == 1
    assert result["quantization"]
    # --kv-cache-dtype auto as the engine resolves it for --dtype auto on this machine
    from tokenmill.platform import choose_kv_cache_dtype
    assert result["kv_cache_dtype"] == choose_kv_cache_dtype("cpu", "auto", result["dtype"])[0]


def test_cli_missing_text_is_one_clear_line(tmp_path):
    out = subprocess.run([*CLI, "--text", str(tmp_path / "nope.txt")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == f"tokenmill: error: text file '{tmp_path}/nope.txt' does not " \
                                 "exist"
    assert out.stdout == ""


@pytest.mark.parametrize("flags, message", [(["--context", "1"], "--context must be at least 2"),
                                            (["--stride", "0"], "--stride must be between"),
                                            (["--chunk", "0"], "--chunk must be at least 1"),
                                            (["--max-tokens", "0"], "--max-tokens must be at")])
def test_cli_bad_window_flags_fail_before_loading(flags, message, capsys):
    from tokenmill.cli import main

    assert main(["eval", "perplexity", "/no/model.gguf", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tokenmill: error: {message}") and "\n" not in err
