"""The sampler: one token per row from the logits of one step.

Per row (vLLM / HF semantics):

    raw logits ──► log_softmax ─────────────────────────────────► logprobs ("raw" mode)
        │
        ├─ 1. logit_bias    + params.logit_bias
        ├─ 2. grammar_mask  tokens outside row.token_bitmask -> lowest float (never drawn)
        ├─ 3. min_tokens    row.stop_token_ids -> -inf while output < min_tokens
        ├─ 4. penalties     repetition (prompt + output), presence / frequency (output)
        ├─ 4b. thinking     past params.thinking_budget: only the closing tag (no grammar)
        ├─ greedy rows: argmax
        └─ sampled rows:
           ├─ 5. temperature   / temperature
           ├─ 6. top_k_top_p   outside top-k, then outside the nucleus -> -inf
           ├─ 7. min_p         p < min_p * p_max -> -inf
           └─ softmax -> argmax(probs / Exponential(1))   (no multinomial, no host sync)

Steps 1-7 are ``LogitsProcessor`` objects (``logits_processors.py``), applied in this order by
``process_logits``; ``Sampler(processors=...)`` takes another list. Each runs batched over the
rows that use it and is skipped when none does; the sampled-only stages 5-7 run after the greedy
rows took their argmax, on the sampled rows gathered once. The caller's logits tensor is never
written: it is copied once, just before the first processor that applies (a plain greedy batch is a
single argmax, with no copy).

Host syncs: one per step, the copy of the sampled ids (with the logprob table appended, as
float64, where rows ask for logprobs) to the host. ``launch`` queues everything up to that
copy and returns; ``PendingSample.result()`` waits for it (``__call__`` is both). Index and
seed tensors reach the device through pinned memory, never by a blocking copy.

A row is one position to sample: usually one per sequence, but speculative verification scores
several positions of one sequence in one step (same ``seq_id``, each with its own output prefix).

Speculative verification: a row may carry a draft token and the distribution q it was drawn
from (``draft_probs``, a draft model's); it then follows the rejection rule instead of a plain
draw: the draft is kept with probability min(1, p(d) / q(d)), else the row's token is drawn from
normalize(max(p - q, 0)), so the token is distributed as p whatever q was. A draft with no
distribution (n-gram, grammar, a greedy draft) needs no rule: the row is drawn from p as usual
and the runner keeps the draft only if the draw equals it.

Randomness: a row whose ``params.seed`` is set draws from a generator seeded with its seed, its
``seq_index`` and its position in the output (``len(output_token_ids)``), one stream per use
(the draw, a draft's draw, the acceptance test, the residual draw). So its tokens do not depend
on which other rows share the batch, or where, nor on how many steps produced them: a
sequence's token at position i is the same whether it was sampled alone or verified against a
draft without a distribution. Unseeded rows share one generator.

On a GPU the seeded rows do not take a generator each (a seed and a kernel launch per row and
stream): their draws are counter-based, ``u[row, token] = splitmix64(position_seed + (token + 1)
* golden) -> (0, 1)``, computed for all seeded rows of a step in one batch of elementwise ops
(``hashed_uniform``; ``Sampler(hashed_seeds=True)`` does the same on a CPU, where the per-row
generators are faster). The draws are as reproducible and batch-independent as the generators',
but a different stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.runner.logits_processors import (  # noqa: F401  (re-exported: one import site)
    GrammarMask, LogitBias, LogitsProcessor, MinP, MinTokens, Penalties, Temperature, TopKTopP,
    apply_min_p, apply_penalties, apply_temperature, apply_top_k_top_p, default_processors,
    host_to_device, process_logits, token_counts, unpack_bitmask)
from tokenmill.runner.rows import SamplingRow  # noqa: F401  (re-exported, as above)

_U64 = (1 << 64) - 1  # torch.Generator.manual_seed takes seeds modulo 2**64
# Streams of one seeded position (see the module docstring).
SAMPLE, DRAFT, ACCEPT, RESIDUAL = range(4)
# Exponential(1) draws this close to 0 would turn probs / q into inf or nan.
_MIN_NOISE = 1e-20
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model logits
    rank: int  # 1 = most likely; ties count against it, as in vLLM
    top: list[tuple[int, float]]  # top-N (token_id, logprob), most likely first; N = logprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


@dataclass
class PendingSample:
    """A step's sampled ids (followed by ``logprob_table`` where rows asked for logprobs) on
    their way to the host; ``done`` marks the copy's end on a GPU (None: already there)."""

    host: torch.Tensor
    done: torch.cuda.Event | None
    num_top: list[int | None]  # per row: params.logprobs
    wanted: list[int]  # rows with logprobs

    def result(self) -> SamplerOutput:
        if self.done is not None:
            self.done.synchronize()
        values = self.host.tolist()
        n = len(self.num_top)
        if not self.wanted:
            return SamplerOutput(values, [None] * n)
        return SamplerOutput([int(t) for t in values[:n]],
                             logprob_entries(values[n:], self.num_top, self.wanted))


class Sampler:
    """Picks one token per row; holds the shared random generator (and nothing else)."""

    def __init__(self, seed: int | None = None,
                 processors: Sequence[LogitsProcessor] | None = None,
                 hashed_seeds: bool | None = None) -> None:
        self._seed = seed  # of the generator shared by unseeded rows; None: nondeterministic
        # seeded rows drawn by hashed_uniform in one batch (None: on GPUs), else a generator each
        self._hashed_seeds = hashed_seeds
        self.processors: tuple[LogitsProcessor, ...] = tuple(
            default_processors() if processors is None else processors)
        # Sampled-only stages that end the list run on the sampled rows gathered once; a list
        # that interleaves them runs every stage over the whole batch, in its order.
        tail = len(self.processors)
        while tail and self.processors[tail - 1].sampled_only:
            tail -= 1
        self._all_rows, self._sampled_rows = self.processors[:tail], self.processors[tail:]
        self._shared: dict[torch.device, torch.Generator] = {}
        self._positional: dict[torch.device, torch.Generator] = {}  # re-seeded per use

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 owned: bool = False) -> SamplerOutput:
        """``logits``: (len(rows), vocab), one row per position, left unmodified unless
        ``owned`` (the caller gives them up: with no row asking for logprobs, which read the
        raw logits, the processors then work in place instead of on a copy)."""
        return self.launch(logits, rows, owned).result()

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
               owned: bool = False) -> PendingSample:
        """``__call__`` in two halves: queue the sampling and the one copy of its result to
        the host, and return at once; ``result()`` waits for it (a CPU has nothing to wait
        for). Until then the host may prepare the next step while the device works."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        num_top = [r.params.logprobs for r in rows]
        wanted = [i for i, n in enumerate(num_top) if n is not None]
        if not rows:
            return PendingSample(torch.empty(0, dtype=torch.int64), None, num_top, wanted)
        writable = (owned or logits.dtype != torch.float32) and not wanted
        logits = logits.float()
        x = process_logits(logits, rows, self._all_rows, owned=writable)
        out = self._choose(x, rows, owned=writable or x is not logits)
        if wanted:  # the ids and the logprob table travel together, as float64 (exact)
            table = logprob_table(logits, out, num_top, wanted)
            out = torch.cat([out.double(), table.flatten()])
        if out.device.type == "cpu":
            return PendingSample(out, None, num_top, wanted)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)  # the step's one device -> host transfer
        done = torch.cuda.Event()
        done.record()
        return PendingSample(host, done, num_top, wanted)

    def draft(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
              owned: bool = False) -> tuple[list[int], list[torch.Tensor | None]]:
        """A draft model's step: per row a token and the distribution it was drawn from
        (processed exactly as the target's rows are, so q resembles p): greedy rows take the
        argmax and get None (a draft without a distribution), sampled rows draw from q on
        their own ``DRAFT`` stream."""
        if not rows:
            return [], []
        x = process_logits(logits.float(), rows, self._all_rows, owned=owned)
        tokens = x.argmax(dim=-1)
        probs: list[torch.Tensor | None] = [None] * len(rows)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = host_to_device(sampled, torch.int64, x.device)
            sub = [rows[i] for i in sampled]
            q = process_logits(x[idx], sub, self._sampled_rows, owned=True).softmax(dim=-1)
            tokens[idx] = (q / self._noise(q, sub, DRAFT)).argmax(dim=-1)
            for j, i in enumerate(sampled):
                probs[i] = q[j]
        return tokens.tolist(), probs

    def _choose(self, x: torch.Tensor, rows: Sequence[SamplingRow],
                owned: bool) -> torch.Tensor:
        """Greedy rows: argmax of ``x``; sampled rows: the sampled-only stages, then a draw.
        ``owned``: ``x`` is the sampler's own copy (written in place), not the caller's."""
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampled:
            return x.argmax(dim=-1)
        if len(sampled) == len(rows):
            return self._sample(x, rows, owned)
        tokens = x.argmax(dim=-1)
        idx = host_to_device(sampled, torch.int64, x.device)
        tokens[idx] = self._sample(x[idx], [rows[i] for i in sampled], owned=True)
        return tokens

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow], owned: bool) -> torch.Tensor:
        """Draw from softmax of the processed logits per row (every row here samples); rows
        with a draft distribution follow the rejection rule."""
        x = process_logits(x, rows, self._sampled_rows, owned)
        probs = x.softmax(dim=-1)
        verify = [i for i, r in enumerate(rows) if r.draft_probs is not None]
        if verify:  # an index tensor made here, not by torch from the list: that one syncs
            verify_idx = host_to_device(verify, torch.int64, probs.device)
            p_verify = probs[verify_idx]  # before the draw below overwrites probs
        # argmax(p / q) with q ~ Exp(1) is a draw from p (the exponential race), with no sync.
        tokens = probs.div_(self._noise(probs, rows, SAMPLE)).argmax(dim=-1)
        if verify:
            tokens[verify_idx] = self._verify(p_verify, [rows[i] for i in verify])
        return tokens

    def _verify(self, p: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The rejection rule for rows whose draft came with its distribution q."""
        q = torch.stack([r.draft_probs.to(p.device, torch.float32) for r in rows])
        drafts = host_to_device([r.draft_token for r in rows], torch.int64, p.device)
        p_d = p.gather(-1, drafts[:, None]).squeeze(-1)
        q_d = q.gather(-1, drafts[:, None]).squeeze(-1)
        u = self._noise(p[:, :1], rows, ACCEPT, uniform=True).squeeze(-1)
        accept = u * q_d < p_d  # u < p/q without dividing by a q that may be 0
        residual = (p - q).clamp_min_(0)
        empty = residual.sum(-1, keepdim=True) <= 0  # p == q: rejection is impossible there
        residual = torch.where(empty, p, residual)
        resampled = residual.div_(self._noise(residual, rows, RESIDUAL)).argmax(dim=-1)
        return torch.where(accept, drafts, resampled)

    def _noise(self, like: torch.Tensor, rows: Sequence[SamplingRow], stream: int,
               uniform: bool = False) -> torch.Tensor:
        """Exp(1) draws (or U(0, 1) with ``uniform``) shaped like ``like``, one row per row."""
        q = torch.empty_like(like)
        fill = (lambda t, g: t.uniform_(generator=g)) if uniform else exponential_
        seeded = [(i, r) for i, r in enumerate(rows) if r.params.seed is not None]
        if len(seeded) < len(rows):
            # Seeded rows are overwritten below; drawing them here too keeps this one kernel.
            fill(q, self._shared_generator(like.device))
        hashed = self._hashed_seeds
        if seeded and (hashed or (hashed is None and like.device.type != "cpu")):
            seeds = host_to_device([_signed(position_seed(r.params.seed + r.seq_index,
                                                          len(r.output_token_ids), stream))
                                    for _, r in seeded], torch.int64, like.device)
            u = hashed_uniform(seeds, like.shape[-1])
            idx = host_to_device([i for i, _ in seeded], torch.int64, like.device)
            q[idx] = u if uniform else u.log_().neg_()
            seeded = []
        for i, row in seeded:
            fill(q[i], self._row_generator(row, stream, like.device))
        return q if uniform else q.clamp_min_(_MIN_NOISE)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed & _U64)
            self._shared[device] = gen
        return gen

    def _row_generator(self, row: SamplingRow, stream: int,
                       device: torch.device) -> torch.Generator:
        gen = self._positional.get(device)
        if gen is None:
            gen = self._positional[device] = torch.Generator(device=device)
        # seed + seq_index: the n sequences of a seeded request differ, reproducibly.
        gen.manual_seed(position_seed(row.params.seed + row.seq_index,
                                      len(row.output_token_ids), stream))
        return gen


def position_seed(seed: int, position: int, stream: int) -> int:
    """A 64-bit seed for one (sequence seed, output position, stream): splitmix64 of their mix,
    so neighbouring positions get unrelated generator states."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + stream * 0xABC98388FB8FAC03
         + 0x632BE59BD9B4E019) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX1, _MIX2, _STEP = (_signed(c) for c in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB, _GOLDEN))


def _shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def hashed_uniform(seeds: torch.Tensor, width: int) -> torch.Tensor:
    """(rows,) int64 seeds -> (rows, width) float32 uniforms in (0, 1): splitmix64 of
    ``seed + (j + 1) * golden`` for column j (int64 products wrap, as the unsigned ones do),
    its top 23 bits as ``(2k + 1) / 2^24`` (exact in float32, never 0 or 1)."""
    j = torch.arange(1, width + 1, dtype=torch.int64, device=seeds.device)
    z = seeds[:, None] + j[None, :] * _STEP
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 41) * 2 + 1).float().mul_(1.0 / (1 << 24))


def exponential_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``t`` in place with Exponential(1) draws.

    On CPU ``-log(U)`` is about 3x faster than torch's ``exponential_``; on CUDA the fused
    kernel wins. Either is an exact Exp(1) draw, but the streams differ, so a seed gives
    different tokens on CPU and on CUDA (as it does for any sampler).
    """
    if t.device.type == "cpu":
        return t.uniform_(generator=generator).log_().neg_()
    return t.exponential_(generator=generator)


# --- logprobs ------------------------------------------------------------------------------

def compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Logprobs of the chosen tokens under the raw model logits (before any processing).

    ``num_top[i]`` is row i's ``params.logprobs``: None for no logprobs, else the top-N size.
    One host transfer per batch, none per row.
    """
    wanted = [i for i, n in enumerate(num_top) if n is not None]
    if not wanted:
        return [None] * len(num_top)
    table = logprob_table(raw_logits, token_ids, num_top, wanted)
    return logprob_entries(table.flatten().tolist(), num_top, wanted)


def logprob_table(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                  num_top: Sequence[int | None], wanted: Sequence[int]) -> torch.Tensor:
    """(len(wanted), 3 + 2 * max N) float64 on the logits' device, one row per wanted row: the
    chosen token, its logprob, its rank, the top-N ids, their logprobs (ids, ranks and float32
    logprobs are all exact in float64, so one tensor carries them to the host at once)."""
    idx = host_to_device(wanted, torch.int64, raw_logits.device)
    lp = raw_logits[idx].float().log_softmax(dim=-1)  # (wanted, vocab)
    chosen = token_ids[idx].unsqueeze(-1)
    chosen_lp = lp.gather(-1, chosen)
    ranks = (lp >= chosen_lp).sum(dim=-1, keepdim=True)  # vLLM's: ties count against the token
    top_lp, top_ids = lp.topk(max(num_top[i] for i in wanted), dim=-1)  # most likely first
    return torch.cat([t.double() for t in (chosen, chosen_lp, ranks, top_ids, top_lp)], dim=-1)


def logprob_entries(flat: Sequence[float], num_top: Sequence[int | None],
                    wanted: Sequence[int]) -> list[TokenLogprobs | None]:
    """``logprob_table``'s rows, flattened on the host, as one entry per row (None where no
    logprobs were wanted)."""
    result: list[TokenLogprobs | None] = [None] * len(num_top)
    max_n = max(num_top[i] for i in wanted)
    width = 3 + 2 * max_n
    for j, i in enumerate(wanted):
        row = flat[j * width:(j + 1) * width]
        ids, lps = [int(t) for t in row[3:3 + max_n]], row[3 + max_n:]
        # equal logprobs (common with bf16 logits) in token id order, the order argmax breaks
        # ties in, so a greedy token is listed first among the tokens tied with it
        top = sorted(zip(ids, lps), key=lambda pair: (-pair[1], pair[0]))[:num_top[i]]
        result[i] = TokenLogprobs(int(row[0]), row[1], int(row[2]), top)
    return result


# Rows of prompt logprobs computed at once: a long prompt's log-softmax over the vocabulary
# would otherwise take (prompt tokens x vocabulary) floats beside the logits.
_PROMPT_ROWS_PER_PASS = 256


def prompt_logprob_entries(logits: torch.Tensor, next_ids: Sequence[int],
                           num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row i of ``logits`` scores the prompt token ``next_ids[i]`` that follows it: that
    token's logprob and rank under the raw logits, and the row's top ``num_top[i]``."""
    entries: list[TokenLogprobs] = []
    ids = host_to_device(list(next_ids), torch.int64, logits.device)
    for start in range(0, len(next_ids), _PROMPT_ROWS_PER_PASS):
        end = min(start + _PROMPT_ROWS_PER_PASS, len(next_ids))
        tops = list(num_top[start:end])
        wanted = list(range(end - start))
        table = logprob_table(logits[start:end], ids[start:end], tops, wanted)
        entries += logprob_entries(table.flatten().tolist(), tops, wanted)
    return entries
