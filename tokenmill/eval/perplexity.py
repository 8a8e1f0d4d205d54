"""Perplexity of a model on a text, computed through the engine's own forward path.

The text is tokenized as the engine tokenizes a prompt (``tokenizer.encode(text)``, the
model's usual special tokens: a BOS token only where the tokenizer adds one; SmolLM2's adds
none, so its first token is context only). The ids are scored in sliding windows:

    ids:       t0 t1 t2 ... t1023 t1024 ... t1535 t1536 ...
    window 0:  [t0 ........ t1023]                             scores t1 .. t1023
    window 1:        [t512 .......................... t1535]   scores t1024 .. t1535 only
    window 2:                      [t1024 ......................... t2047]   ...

A window is ``context`` tokens starting every ``stride`` tokens; each scores only the tokens no
earlier window scored, so every token after the first is scored once, with at least
``context - stride`` tokens of history (the usual sliding-window perplexity; with stride ==
context the windows are disjoint and each one's first token goes unscored). A window is a new
sequence at position 0 on KV blocks 1..n (block 0 is the engine's padding block), prefilled in
chunks of at most ``chunk`` tokens: later chunks attend to the earlier chunks' K/V as stored in
the paged cache, so the KV cache dtype (int8) shows in the number, as the weight format does.

Perplexity = exp(mean negative log-likelihood), log_softmax in float32 over the logits the
model returns (float32), summed in float64.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.config import DEFAULT_MODEL, EngineConfig, engine_option_default
from tokenmill.errors import TokenmillError
from tokenmill.runner.batch import Chunk
from tokenmill.util import cdiv, tracked

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.runner.model_runner import ModelRunner

DEFAULT_TEXT = Path(__file__).parent / "data" / "eval.txt"
DEFAULT_CONTEXT = 1024
DEFAULT_CHUNK = 256


class EvalError(TokenmillError):
    """An evaluation that cannot run as asked (no text, a window too small, ...)."""


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    tokens_scored: int
    tokens_forwarded: int  # through the model, overlapping windows counted again
    windows: int
    seconds: float  # the forwards and scoring, not loading
    tokens_per_second: float  # scored tokens
    context: int
    stride: int
    chunk: int
    bos: bool  # the ids began with the tokenizer's BOS token
    model: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    attention_backend: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        windows = f"{self.windows} window{'s' * (self.windows != 1)}"
        return (f"perplexity {self.perplexity:.4f} (mean NLL {self.mean_nll:.4f}) over "
                f"{self.tokens_scored} tokens, {windows} of {self.context} (stride "
                f"{self.stride}), in {self.seconds:.1f}s ({self.tokens_per_second:.0f} "
                f"tokens/s); {self.dtype}, weights "
                f"{self.quantization}, KV cache {self.kv_cache_dtype}, attention "
                f"{self.attention_backend}")


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, end)`` of the text run as one sequence; ``[score_from, end)`` scored."""

    start: int
    end: int
    score_from: int


def plan_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The sliding windows over ``num_tokens`` ids. Each token is scored at most once: every
    token but the first when windows overlap (stride < context); with stride == context the
    windows are disjoint and each one's first token, which has no history there, is not."""
    windows, start, scored_to = [], 0, 1
    while True:
        end = min(start + context, num_tokens)
        windows.append(Window(start, end, max(scored_to, start + 1)))
        if end == num_tokens:
            return windows
        scored_to, start = end, start + stride


def load_text(path: str | Path | None = None) -> str:
    """The text of ``path`` (default: the shipped evaluation text)."""
    path = Path(path) if path is not None else DEFAULT_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EvalError(f"text file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read text file {str(path)!r}: {exc}") from None
    if not text.strip():
        raise EvalError(f"text file {str(path)!r} is empty")
    return text


def build_eval_engine(model: str = DEFAULT_MODEL, context: int = DEFAULT_CONTEXT,
                      **engine_options: Any) -> LLMEngine:
    """The engine as ``LLMEngine.from_config`` builds it; unless a KV cache size is given, with
    just the blocks one window needs (plus the padding block 0)."""
    from tokenmill.engine.llm_engine import LLMEngine

    if "num_blocks" not in engine_options and "kv_cache_memory" not in engine_options:
        block_size = engine_options.get("block_size") or engine_option_default("block_size")
        engine_options["num_blocks"] = 1 + cdiv(context, block_size)
    return LLMEngine.from_config(EngineConfig.from_options(model, **engine_options))


def score_window(runner: ModelRunner, ids: Sequence[int], window: Window, chunk: int,
                 table: Sequence[int]) -> float:
    """Summed negative log-likelihood of the window's scored tokens, prefilled chunk by chunk
    on ``table``'s blocks."""
    nll = 0.0
    for start in range(window.start, window.end, chunk):
        end = min(start + chunk, window.end)
        # Logits at position p predict ids[p + 1]: the rows from the first position that
        # predicts a scored token to the chunk's end (the window's last row predicts nothing).
        first = min(max(start, window.score_from - 1), end)
        logits = runner.forward([Chunk(ids[start:end], start - window.start, table,
                                       num_logits=end - first)])
        targets = torch.tensor(ids[first + 1:min(end, window.end - 1) + 1],
                               device=logits.device)
        logprobs = logits[:len(targets)].float().log_softmax(-1)  # (targets, vocab)
        nll -= logprobs.gather(1, targets[:, None]).double().sum().item()
    return nll


def score_ids(runner: ModelRunner, ids: Sequence[int], context: int, stride: int,
              chunk: int) -> tuple[float, list[Window], float]:
    """(summed NLL of the scored tokens, the windows run, seconds they took) for ``ids``."""
    check_window_args(context, stride, chunk)
    if len(ids) < 2:
        raise EvalError(f"the text is {len(ids)} token(s); perplexity needs at least 2")
    windows = plan_windows(len(ids), context, stride)
    longest = max(w.end - w.start for w in windows)
    table = list(range(1, 1 + cdiv(longest, runner.block_size)))  # block 0: padding
    if table[-1] >= runner.num_blocks:
        raise EvalError(f"a window of {longest} tokens needs {len(table) + 1} KV blocks; the "
                        f"cache has {runner.num_blocks} (raise --kv-cache-memory)")
    warm_up(runner, ids[:min(chunk, longest)], table)
    t0 = time.perf_counter()
    nll = sum(score_window(runner, ids, w, chunk, table)
              for w in tracked(windows, "scoring", len(windows), "windows"))
    return nll, windows, time.perf_counter() - t0


def warm_up(runner: ModelRunner, ids: Sequence[int], table: Sequence[int]) -> None:
    """One untimed forward: the first one pays one-time costs (thread pools, kernel setup) that
    would otherwise count as the scoring's time. Its K/V are overwritten by the first window."""
    runner.forward([Chunk(ids, 0, table, num_logits=0)])


def check_window_args(context: int, stride: int, chunk: int) -> None:
    if context < 2:
        raise EvalError(f"--context must be at least 2, got {context}")
    if not 1 <= stride <= context:
        raise EvalError(f"--stride must be between 1 and the context ({context}), got {stride}")
    if chunk < 1:
        raise EvalError(f"--chunk must be at least 1, got {chunk}")


def check_max_tokens(max_tokens: int | None) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise EvalError(f"--max-tokens must be at least 1, got {max_tokens}")


def engine_perplexity(engine: LLMEngine, text: str | Sequence[int], *,
                      context: int | None = None, stride: int | None = None,
                      chunk: int = DEFAULT_CHUNK, max_tokens: int | None = None
                      ) -> PerplexityResult:
    """Perplexity of ``engine``'s model on ``text`` (or token ids, used as given).
    ``context`` defaults to 1024 (at most the model's length), ``stride`` to half the context,
    ``max_tokens`` (score at most this many) to all."""
    info = engine.info
    if context is None:
        context = min(DEFAULT_CONTEXT, info.max_model_len)
    elif context > info.max_model_len:
        raise EvalError(f"--context {context} exceeds the model's length {info.max_model_len}")
    if stride is None:
        stride = max(1, context // 2)
    ids = engine.tokenizer.encode(text) if isinstance(text, str) else [int(t) for t in text]
    check_max_tokens(max_tokens)
    if max_tokens is not None:
        ids = ids[:max_tokens + 1]
    nll, windows, seconds = score_ids(engine.executor.worker, ids, context, stride, chunk)
    scored = sum(w.end - w.score_from for w in windows)
    return PerplexityResult(
        math.exp(nll / scored), nll / scored, scored, sum(w.end - w.start for w in windows),
        len(windows), seconds, scored / seconds if seconds > 0 else 0.0, context, stride, chunk,
        ids[0] == engine.tokenizer.bos_token_id, info.model, info.dtype, info.quantization,
        info.kv_cache_dtype, info.attention_backend)


def perplexity(model: str = DEFAULT_MODEL, text: str | Sequence[int] | None = None, *,
               context: int | None = None, stride: int | None = None,
               chunk: int = DEFAULT_CHUNK, max_tokens: int | None = None,
               **engine_options: Any) -> PerplexityResult:
    """Load ``model`` with ``engine_options`` (``EngineConfig.from_options``'s: ``dtype``,
    ``quantization``, ``kv_cache_dtype``, ...) and score ``text`` (default: the shipped one)."""
    if text is None:
        text = load_text()
    if isinstance(text, str) and not text.strip():
        raise EvalError("the text is empty")
    # The same checks the scoring makes, before the model loads.
    guess = context or DEFAULT_CONTEXT
    check_window_args(guess, max(1, guess // 2) if stride is None else stride, chunk)
    check_max_tokens(max_tokens)
    engine = build_eval_engine(model, context or DEFAULT_CONTEXT, **engine_options)
    return engine_perplexity(engine, text, context=context, stride=stride, chunk=chunk,
                             max_tokens=max_tokens)
