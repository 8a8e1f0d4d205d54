"""Sampling parameters: pure, validated, immutable data (no torch, no tokenizer).

Every check raises ``ValueError`` naming the offending field, so the server can turn it into a
400 response verbatim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from tokenmill.structured.spec import StructuredOutputs

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `n=True` is a client bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    Lists given for ``stop`` / ``stop_token_ids`` are stored as tuples and ``logit_bias`` as a
    read-only mapping, so an instance can be shared by the ``n`` sequences of a request.
    """

    n: int = 1  # independent completions of the same prompt
    max_tokens: int | None = 16  # None: until the context (max_model_len) ends
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many were generated
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N logprobs of each sampled token, 0 = only the sampled one
    # The output must match this JSON schema / regex / choice / grammar (``structured/``).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", MappingProxyType(dict(self.logit_bias)))
        self._check_lengths()
        self._check_sampling()
        self._check_penalties()
        self._check_stops()
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def _check_lengths(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        if self.max_tokens is not None:
            _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                     "must be an integer >= 1 or None", self.max_tokens)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
                 "must be an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _require(self.min_tokens <= self.max_tokens, "min_tokens",
                     f"must not exceed max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None:
            _require(_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                     f"must be None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)

    def _check_sampling(self) -> None:
        _require(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _require(_is_int(self.top_k) and (self.top_k >= -1), "top_k",
                 "must be -1 or 0 (off) or an integer >= 1", self.top_k)
        _require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _require(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None:
            _require(_is_int(self.seed), "seed", "must be an integer or None", self.seed)

    def _check_penalties(self) -> None:
        _require(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0",
                 self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, "must be in [-2, 2]", value)
        for token_id, bias in self.logit_bias.items():
            _require(_is_int(token_id) and token_id >= 0, "logit_bias",
                     "keys must be token ids >= 0", token_id)
            _require(-100.0 <= bias <= 100.0, "logit_bias",
                     f"values must be in [-100, 100] (token {token_id})", bias)

    def _check_stops(self) -> None:
        for s in self.stop:
            _require(isinstance(s, str) and s != "", "stop", "must hold non-empty strings", s)
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0, "stop_token_ids", "must hold token ids >= 0", t)
