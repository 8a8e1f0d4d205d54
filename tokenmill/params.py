"""Sampling parameters and output constraints: pure, validated, immutable data (no torch, no
tokenizer, no grammar library).

Every check raises ``ValueError`` naming the offending field, so the server can turn it into a
400 response verbatim.

``StructuredOutputs`` is the offline API's ``SamplingParams.structured_outputs`` and what every
request field of the server (``response_format``, vLLM's ``structured_outputs`` and
``guided_*``, tool choice) turns into (``structured/spec.py::from_request``). Exactly one
constraint is set. ``key`` identifies the compiled grammar, so equal constraints share one
compilation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20


class ParamError(ValueError):
    """A parameter out of its range; ``param`` names the field (a server's 400 reports it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ParamError(name, f"{name} {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `n=True` is a client bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ThinkingBudget:
    """At most ``tokens`` tokens of reasoning, then the closing tag ``end_ids`` is forced
    (``thinking_token_budget``; ``runner/logits_processors.py``'s ``ThinkingBudgetCap``).
    Reasoning starts at the output's start (``starts_open``: the prompt opened it) or after the
    first ``start_ids`` in the output."""

    tokens: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    starts_open: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_ids", tuple(self.start_ids))
        object.__setattr__(self, "end_ids", tuple(self.end_ids))
        _require(_is_int(self.tokens) and self.tokens >= 0, "thinking_token_budget",
                 "must be an integer >= 0", self.tokens)
        _require(len(self.end_ids) > 0, "thinking_token_budget",
                 "needs the closing tag's token ids", self.end_ids)


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
    # vLLM's: the logprob of every prompt token after the first (and its top-N); the prompt is
    # then computed whole, never read from the prefix cache (its positions' logits are needed)
    prompt_logprobs: int | None = None
    # The output must match this JSON schema / regex / choice / grammar (``structured/``).
    structured_outputs: StructuredOutputs | None = None
    thinking_budget: ThinkingBudget | None = None  # reasoning models: think at most this much

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
            raise ParamError("structured_outputs", f"structured_outputs must be a "
                             f"StructuredOutputs, got {type(self.structured_outputs).__name__}")

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(_is_int(value) and 0 <= value <= MAX_LOGPROBS, name,
                         f"must be None or an integer in [0, {MAX_LOGPROBS}]", value)

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


POOLING_TASKS = ("embed", "score")
POOLING_KINDS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """What a pooling request (an embedding, or a cross-encoder's score) wants of its prompt's
    hidden states. ``None`` fields take the model's defaults (``LLMEngine.pooling_defaults``:
    a sentence-transformers directory's, else last-token and normalised for a decoder, CLS
    for an encoder). ``task="score"`` returns a cross-encoder's logits as they are (the
    sigmoid is the caller's choice), so ``pooling``, ``normalize`` and ``dimensions`` must be
    left unset there."""

    task: str = "embed"  # "embed" | "score" (a cross-encoder's relevance logit)
    pooling: str | None = None  # "last" | "mean" | "cls"; None: the model's default
    normalize: bool | None = None  # L2-normalise (after any truncation); None: the model's
    dimensions: int | None = None  # keep the first n (Matryoshka); None: all

    def __post_init__(self) -> None:
        _require(self.task in POOLING_TASKS, "task", f"must be one of {POOLING_TASKS}",
                 self.task)
        _require(self.pooling is None or self.pooling in POOLING_KINDS, "pooling",
                 f"must be None or one of {POOLING_KINDS}", self.pooling)
        _require(self.normalize is None or isinstance(self.normalize, bool), "normalize",
                 "must be None or a bool", self.normalize)
        if self.dimensions is not None:
            _require(_is_int(self.dimensions) and self.dimensions >= 1, "dimensions",
                     "must be None or an integer >= 1", self.dimensions)
        if self.task == "score":
            for name in ("pooling", "normalize", "dimensions"):
                _require(getattr(self, name) is None, name,
                         "does not apply to task 'score' (a cross-encoder's logits)",
                         getattr(self, name))

    def resolved(self, defaults: PoolingParams) -> PoolingParams:
        """These params with every unset field taken from ``defaults`` (the model's)."""
        if self.task == "score":
            return self
        return PoolingParams(
            self.task, self.pooling or defaults.pooling,
            defaults.normalize if self.normalize is None else self.normalize,
            self.dimensions if self.dimensions is not None else defaults.dimensions)


# ----- output constraints ----------------------------------------------------------------------

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class ConstraintError(ValueError):
    """A constraint that is malformed or does not compile; ``param`` names the request field
    it came from (the server's 400 reports it)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint.

    - ``json``: a JSON schema (a dict or its JSON text);
    - ``regex``: the whole output matches it;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a context-free grammar, in Lark syntax or GBNF (``root ::= ...``);
    - ``json_object``: any JSON object.

    ``whitespace_pattern`` (JSON only) is a regex for the whitespace allowed between tokens of
    the JSON text. None (the default) allows none (compact ``,`` and ``:`` separators), so a
    model cannot pad blanks until ``max_tokens`` and the forced text between values (keys,
    quotes, braces) can be jumped over.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None
    param: str = "structured_outputs"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, Mapping):
                raise ConstraintError(f"a JSON schema must be an object, got "
                                      f"{type(self.json).__name__}", self.param)
            object.__setattr__(self, "json", json.dumps(self.json))  # key order is output order
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice \
                    or not all(isinstance(c, str) and c for c in choice):
                raise ConstraintError(f"choice must be a non-empty list of non-empty strings, "
                                      f"got {choice!r}", self.param)
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConstraintError(f"{name} must be a non-empty string, got {value!r}",
                                      self.param)
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ConstraintError(f"exactly one of {', '.join(KINDS)} must be set, got "
                                  f"{set_kinds or 'none'}", self.param)
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise ConstraintError("whitespace_pattern applies to JSON only", self.param)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, str | None]:
        """Equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        text = json.dumps(value) if self.kind == "choice" else str(value)
        return self.kind, text, self.whitespace_pattern

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], param: str = "structured_outputs"
                  ) -> StructuredOutputs | None:
        """vLLM's ``structured_outputs`` object. Keys it defines that tokenmill does not
        implement are refused by name; an object with no constraint is None."""
        if not isinstance(data, Mapping):
            raise ConstraintError("must be an object", param)
        unknown = set(data) - _DICT_KEYS - _IGNORED_KEYS
        if unknown:
            raise ConstraintError(f"unsupported field(s) {sorted(unknown)}; supported: "
                                  f"{sorted(_DICT_KEYS)}", param)
        kw = {k: data[k] for k in _DICT_KEYS if data.get(k) not in (None, False)}
        if kw.pop("disable_any_whitespace", None) and "whitespace_pattern" in kw:
            raise ConstraintError("disable_any_whitespace and whitespace_pattern conflict", param)
        if not kw or set(kw) == {"whitespace_pattern"}:
            return None
        return cls(**kw, param=param)


# vLLM's StructuredOutputsParams fields. `disable_any_whitespace` asks for what is already the
# default here. Ignored: `backend` and `disable_fallback` choose among libraries, and tokenmill
# has one, which never falls back; `disable_additional_properties` tunes one library's handling
# of objects that say nothing about extra keys, which tokenmill always closes (backend.py).
_DICT_KEYS = {"json", "regex", "choice", "grammar", "json_object", "whitespace_pattern",
              "disable_any_whitespace"}
_IGNORED_KEYS = {"backend", "disable_fallback", "disable_additional_properties"}
