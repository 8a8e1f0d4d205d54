"""Torch-free stand-ins for the executor, for scheduler and engine tests that run in ms.

``FakeExecutor`` keeps a (position, token id) record per KV slot and checks, before writing a
step's tokens, that every chunk finds its whole verified history where its block table says:
that is what attention would read, so it catches shared, reused, forgotten or rolled-back
blocks, not just bookkeeping. Its "model" is any function of a sequence and the draft tokens
before a scored position; drafts are verified the way the real runner does it (accept while the
model agrees, then add the model's own token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.cache import slot_of
from tokenmill.executor.base import Executor
from tokenmill.request import Request
from tokenmill.sched.output import ModelOutput, ScheduledChunk, SchedulerOutput
from tokenmill.tokenizer import Tokenizer

FakeModel = Callable[[Request, Sequence[int]], int]  # (sequence, drafts before) -> next token


@dataclass(frozen=True)
class FakeLogprob:
    """The one field the engine reads of a logprobs entry."""

    token_id: int
    logprob: float


class FakeExecutor(Executor):
    """The engine's executor, with a fake model: KV is a dict slot -> (position, token), and
    every read is checked against what earlier steps wrote."""

    def __init__(self, block_size: int, model: FakeModel,
                 forced: Callable[[Request], Sequence[int]] | None = None,
                 num_blocks: int = 1 << 20) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = model
        self.forced = forced  # tokens appended after the scored ones (a grammar's forced text)
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token id)
        self.num_executed = 0
        self.before_execute: Callable[[Sequence[ScheduledChunk]], None] | None = None

    @property
    def kv_capacity(self) -> int:
        return self.num_blocks

    def execute(self, out: SchedulerOutput, masks=None, draft_probs=None) -> ModelOutput:
        chunks = out.scheduled
        # ``masks``: grammar masks, always None here (engines built from fakes have no grammar
        # backend; structured output is tested with the real model).
        assert masks is None
        if self.before_execute is not None:
            self.before_execute(chunks)
        self.num_executed += 1
        self.check_reads(chunks)
        self.write(chunks)
        result = ModelOutput()
        for c in chunks:
            if c.num_logits:
                tokens = self.accepted(c)
                result.token_ids[c.request_id] = tokens
                result.logprobs[c.request_id] = [FakeLogprob(t, -0.25) for t in tokens]
        return result

    def accepted(self, c: ScheduledChunk) -> list[int]:
        drafts = c.draft_token_ids
        tokens = []
        for j in range(c.num_logits):
            tokens.append(self.model(c.request, drafts[:j]))
            if j < len(drafts) and tokens[-1] != drafts[j]:
                break
        if self.forced is not None:
            tokens += self.forced(c.request)
        return tokens

    def check_reads(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Reads see only KV written by earlier steps, and it must be the sequence's own."""
        for c in chunks:
            history = c.request.all_token_ids
            for pos in range(c.start_pos):
                slot = slot_of(c.block_table, pos, self.block_size)
                assert self.kv.get(slot) == (pos, history[pos]), (c.request_id, pos)

    def write(self, chunks: Sequence[ScheduledChunk]) -> None:
        for c in chunks:
            for i, token in enumerate(c.token_ids):
                pos = c.start_pos + i
                slot = slot_of(c.block_table, pos, self.block_size)
                assert slot >= self.block_size, f"{c.request_id} writes the padding block 0"
                self.kv[slot] = (pos, token)

    def check_prefix_cache(self, prefix_cache) -> None:
        """Every cached block holds the KV of exactly the tokens the tree files it under."""
        for _, tokens, blocks in prefix_cache.entries():
            for pos, token in enumerate(tokens):
                slot = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                assert self.kv.get(slot) == (pos, token), ("cached", pos, token, self.kv.get(slot))


def word_tokenizer(num_words: int = 200) -> Tokenizer:
    """A real ``Tokenizer`` over the words ``w0 .. w<n-1>`` (id i is ``w<i>``); ``</s>`` = 2
    ends generation. Decoding joins words with spaces."""
    vocab = {f"w{i}": i for i in range(num_words)}
    vocab["</s>"] = 2
    del vocab["w2"]
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("</s>", special=True)])
    return Tokenizer(backend, eos_token="</s>", unk_token="w0")


def run_collecting_failures(engine) -> tuple[dict, dict]:
    """Step ``engine`` until idle: (finished outputs, failed requests and why) by id."""
    finished, failures = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        failures.update(engine.take_failures())
    return finished, failures
