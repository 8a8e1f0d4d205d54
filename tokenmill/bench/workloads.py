"""Benchmark workloads: deterministic lists of requests for any OpenAI-compatible server.

Every generator takes a seed, so a run is repeatable. Prompts are text (every server accepts
text); their lengths are counted with the model's tokenizer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class Tokenizer:  # the two methods the workloads use (tokenmill.tokenizer.Tokenizer fits)
    encode: Callable[..., list[int]]
    decode: Callable[..., str]


@dataclass
class BenchRequest:
    """One request, or one conversation whose user turns are sent in order (``turns``)."""

    prompt: str | None = None  # completions endpoint
    turns: list[str] = field(default_factory=list)  # chat endpoint: user messages in order
    system: str | None = None  # conversations: a system message sent before the first turn
    prompt_len: int = 0  # tokens of ``prompt`` (or of the first turn)
    output_len: int = 128
    model: str | None = None  # the ``model`` it names (a LoRA adapter); None: the run's

    @property
    def is_conversation(self) -> bool:
        return bool(self.turns)


def assign_models(reqs: list[BenchRequest], models: Sequence[str], seed: int) -> None:
    """Each request names one of ``models`` (LoRA adapters), drawn uniformly and reproducibly
    from ``seed``, as vLLM's serving benchmark spreads requests over ``--lora-modules``."""
    rng = random.Random(seed)
    for req in reqs:
        req.model = rng.choice(models)


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_text(rng: random.Random, tok: Tokenizer, num_tokens: int, vocab: int) -> str:
    """Text of about ``num_tokens`` tokens: random ids decoded, re-encoded and trimmed, so the
    count holds after the server tokenizes it again (decode/encode is not a bijection)."""
    ids = [rng.randrange(1000, vocab) for _ in range(num_tokens)]
    text = tok.decode(ids)
    for _ in range(4):
        ids = tok.encode(text, add_special_tokens=False)[:num_tokens]
        text = tok.decode(ids)
    return text


def random_workload(tok: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0,
                    vocab: int = 32000) -> list[BenchRequest]:
    rng = random.Random(seed)
    ins = _lengths(rng, num_prompts, input_len, range_ratio)
    outs = _lengths(rng, num_prompts, output_len, range_ratio)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        text = random_text(rng, tok, n_in, vocab)
        reqs.append(BenchRequest(prompt=text, prompt_len=_count(tok, text), output_len=n_out))
    return reqs


def shared_prefix_workload(tok: Tokenizer, num_groups: int, prompts_per_group: int,
                           system_len: int, question_len: int, output_len: int,
                           seed: int = 0, vocab: int = 32000) -> list[BenchRequest]:
    """G groups of P requests; the requests of a group share a system prompt of S tokens and
    each adds a unique question. Requests are shuffled so groups interleave, as in real traffic."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_groups):
        system = random_text(rng, tok, system_len, vocab)
        for _ in range(prompts_per_group):
            text = system + "\n" + random_text(rng, tok, question_len, vocab)
            reqs.append(BenchRequest(prompt=text, prompt_len=_count(tok, text),
                                     output_len=output_len))
    rng.shuffle(reqs)
    return reqs


def multi_turn_workload(tok: Tokenizer, num_conversations: int, turns: int, turn_len: int,
                        output_len: int, seed: int = 0, vocab: int = 32000,
                        system_len: int = 0) -> list[BenchRequest]:
    """Conversations of ``turns`` user messages; each turn is sent with the whole history, so a
    server (or a router) that keeps a conversation's cache answers later turns faster. With
    ``system_len`` every conversation starts with the same system prompt of that many tokens:
    a prefix shared across conversations as well as within one."""
    rng = random.Random(seed)
    # drawn only when asked for, so workloads without a system prompt stay as they were
    system = random_text(rng, tok, system_len, vocab) if system_len > 0 else None
    convs = []
    for _ in range(num_conversations):
        msgs = [random_text(rng, tok, turn_len, vocab) for _ in range(turns)]
        convs.append(BenchRequest(turns=msgs, system=system, prompt_len=_count(tok, msgs[0]),
                                  output_len=output_len))
    return convs


def file_workload(path: str | Path, tok: Tokenizer, default_output_len: int) -> list[BenchRequest]:
    """JSONL, one object a line: ``{"prompt": str}`` or ``{"turns": [str, ...]}`` (or OpenAI
    ``{"messages": [...]}``, whose user messages become the turns and whose system message, or
    a ``"system"`` string, is sent first), optional ``output_len``."""
    reqs = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
        reqs.append(_from_record(obj, tok, default_output_len, f"{path}:{lineno}"))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def _from_record(obj: dict, tok: Tokenizer, default_output_len: int, where: str) -> BenchRequest:
    out_len = int(obj.get("output_len", default_output_len))
    if isinstance(obj.get("prompt"), str):
        return BenchRequest(prompt=obj["prompt"], prompt_len=_count(tok, obj["prompt"]),
                            output_len=out_len)
    messages = obj.get("messages", [])
    turns = obj.get("turns") or [m["content"] for m in messages if m.get("role") == "user"]
    if not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: needs a string 'prompt', 'turns' or user 'messages'")
    system = obj.get("system") or next((m["content"] for m in messages
                                        if m.get("role") == "system"), None)
    return BenchRequest(turns=list(turns), system=system if isinstance(system, str) else None,
                        prompt_len=_count(tok, turns[0]), output_len=out_len)


def _count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def describe(reqs: Sequence[BenchRequest]) -> str:
    n_turns = sum(max(1, len(r.turns)) for r in reqs)
    return f"{len(reqs)} requests ({n_turns} HTTP calls)"
