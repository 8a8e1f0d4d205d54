"""Grammars on llguidance: compile a ``StructuredOutputs`` once, then one matcher per sequence.

Why llguidance rather than xgrammar (both measured by ``benchmarks/grammar_backends.py`` on the
default model's 49,152-token vocabulary, 32 schemas and regexes, random walks through each
grammar; docs/performance.md): compile 0.6 ms mean / 0.8 ms max against xgrammar's 7 / 110 ms;
a token mask 56 us mean and 0.5 ms p99 against 164 us and 4.6 ms (xgrammar's median is faster,
but a step waits for every sequence's mask, so the mean and the tail count); and it installs as
one wheel with no dependencies, where xgrammar brings transformers and triton. What llguidance
does not implement of JSON Schema (``uniqueItems``, ``propertyNames``) it refuses at compile
time, so such a request gets a 400 naming the keyword instead of output the schema rejects.

A matcher follows the tokens a sequence *accepted*; masks for draft positions are computed by
consuming the drafts and rolling them back, so its state never runs ahead of the output.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from tokenmill.params import ConstraintError, StructuredOutputs
from tokenmill.util import cdiv

if TYPE_CHECKING:  # the server's frontend compiles grammars without torch
    import torch

_CACHE_SIZE = 256  # compiled grammars kept (keyed by the constraint)
# llguidance writes a mask as int32 words of 32 tokens (bit j of word i allows token 32 i + j),
# the layout the sampler reads from SamplingRow.token_bitmask.
_WORD_BITS = 32
# Longest run of grammar-forced tokens offered for verification in one step.
MAX_FORCED_TOKENS = 32


class GrammarError(ConstraintError):
    """A constraint that does not compile."""


@dataclass
class GrammarStats:
    """Totals since start (read by the engine's stats; compile figures written under the
    backend's lock, mask figures by the one grammar worker thread)."""

    num_compiled: int = 0
    compile_seconds: float = 0.0
    num_mask_steps: int = 0  # steps that filled at least one mask
    mask_seconds: float = 0.0


class CompiledGrammar:
    """A compiled constraint: a matcher at the start state, copied for each new sequence."""

    def __init__(self, spec: StructuredOutputs, template: llguidance.LLMatcher,
                 eos_token_ids: frozenset[int]):
        self.spec = spec
        self._template = template
        self._eos = eos_token_ids

    def matcher(self) -> SequenceGrammar:
        return SequenceGrammar(self._template.deep_copy(), self._eos)


class SequenceGrammar:
    """The grammar state of one sequence."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]):
        self._m = matcher
        self._eos = eos_token_ids

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance over accepted tokens; a token the grammar forbids raises ``ValueError``
        (the mask makes that impossible for sampled tokens)."""
        if not self._m.consume_tokens(list(token_ids)):
            raise ValueError(f"the grammar rejected tokens {list(token_ids)}: "
                             f"{self._m.get_error()}")

    @property
    def is_stopped(self) -> bool:
        """Nothing but the end can follow: the sequence is complete."""
        return self._m.is_stopped()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward), canonically tokenized; never the
        end itself (a complete grammar ends the sequence, as it does without jump-forward)."""
        forced = self._m.compute_ff_tokens()[:MAX_FORCED_TOKENS]
        end = next((i for i, t in enumerate(forced) if t in self._eos), len(forced))
        return forced[:end]

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar allows from here."""
        return self._m.validate_tokens(list(token_ids)) if token_ids else 0

    def fill_masks(self, drafts: Sequence[int], words: torch.Tensor, row: int) -> None:
        """Fill rows ``row .. row + len(drafts)`` of ``words`` (int32, contiguous, CPU) with the
        allowed tokens after the accepted tokens and after each prefix of ``drafts``."""
        nbytes = words.shape[1] * words.element_size()
        base = words.data_ptr() + row * nbytes
        self._m.unsafe_compute_mask_ptr(base, nbytes)
        consumed = 0
        try:
            for j, token in enumerate(drafts, 1):
                if not self._m.consume_token(token):
                    raise ValueError(f"draft token {token} breaks the grammar")
                consumed += 1
                self._m.unsafe_compute_mask_ptr(base + j * nbytes, nbytes)
        finally:
            if consumed:
                self._m.rollback(consumed)


class GrammarBackend:
    """Compiles constraints against one tokenizer (thread-safe, cached by ``spec.key``).

    A cache hit takes no lock: the engine's loop may look one up while a large schema compiles
    (seconds) in a server thread. A miss compiles in its caller's thread with no lock held, so
    different constraints compile side by side (llguidance lets go of the GIL); callers of a
    constraint already compiling wait for that one compile."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()  # held only to update the dicts below and the stats
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._compiling: dict[tuple, Future] = {}
        self.stats = GrammarStats()

    def new_masks(self, rows: int) -> torch.Tensor:
        """(rows, words) int32, all zero (no token allowed), for ``fill_masks`` to fill."""
        import torch

        return torch.zeros(rows, cdiv(self.vocab_size, _WORD_BITS), dtype=torch.int32)

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:  # ~0.5 s, on the first constrained request
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json,
                                                         n_vocab=self.vocab_size,
                                                         eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar of ``spec``; raises ``GrammarError`` naming the field."""
        key = spec.key
        hit = self._cached(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._cached(key)
            if hit is not None:
                return hit
            pending = self._compiling.get(key)
            if pending is None:
                pending = self._compiling[key] = Future()
                mine = True
            else:
                mine = False
        return self._compile_into(spec, pending) if mine else pending.result()

    def _cached(self, key: tuple) -> CompiledGrammar | None:
        hit = self._cache.get(key)  # each OrderedDict call is atomic under the GIL
        if hit is not None:
            try:
                self._cache.move_to_end(key)
            except KeyError:  # evicted in between: still a valid grammar
                pass
        return hit

    def _compile_into(self, spec: StructuredOutputs, pending: Future) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = CompiledGrammar(spec, self._compile(spec), frozenset(self._eos))
        except BaseException as e:
            with self._lock:
                del self._compiling[spec.key]
            pending.set_exception(e)
            raise
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[spec.key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            del self._compiling[spec.key]
        pending.set_result(compiled)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(spec)
        except (ValueError, GbnfToLarkError) as e:
            raise GrammarError(str(e), spec.param) from None
        tokenizer = self._lltokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise GrammarError(f"invalid {spec.kind}: {error.strip()}", spec.param)
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}", spec.param)
        return matcher


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) for a constraint."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        try:
            schema = json.loads(spec.json) if kind == "json" else {"type": "object"}
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        schema = json.dumps(closed_objects(schema))
        ws = {"whitespace_flexible": False} if spec.whitespace_pattern is None else \
            {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=ws)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema):
    """A copy of ``schema`` in which an object that lists its ``properties`` and says nothing
    about others allows no others (strict mode, as OpenAI's structured outputs and xgrammar's
    default have it). Without it a model may append invented keys until ``max_tokens``.
    Members of an ``allOf`` are left open: closing each would reject the others' keys."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k == "allOf" else closed_objects(v) for k, v in schema.items()}
    if "properties" in out and isinstance(out["properties"], dict) \
            and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
