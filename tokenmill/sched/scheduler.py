"""The scheduler: which sequences run each step, how many tokens each, and who gets KV blocks.

One step, as the engine drives it (never call ``schedule()`` twice without the update between)::

    out = scheduler.schedule()                       # decide; KV blocks are allocated here
    result = runner.execute(out)                     # accepted tokens of chunks with num_logits
    updates = scheduler.update_from_output(out, result.token_ids)  # append, stop, roll back,
    # cache, free finished blocks; the engine detokenizes, matches stop strings and may call
    # scheduler.finish_request(...)

Each step is one flat batch under ``max_num_batched_tokens``: running sequences that need one
token (decodes) first, then running prefills that are still in progress, then new admissions
from the waiting queue, all in policy order. Long prompts are chunked to fit the budget.
``num_computed_tokens`` advances when a chunk is scheduled (the runner writes that KV during the
step), so the next ``schedule()`` sees the new state.

Several tokens per step: a running sequence whose chunk reaches its last known token may carry
draft tokens (``Request.spec_token_ids``, set by a proposer before ``schedule()``; capped by the
budget, ``max_tokens`` and the context, and dropped rather than preempting anyone for their
blocks). The chunk then asks for logits at the last known token and at every draft. The runner
returns the accepted tokens; ``update_from_output`` appends them one at a time with the stop
checks (a stop truncates the rest), keeps the KV of the drafts that match what was accepted and
trims the rest away (``KVBlockManager.trim``), and only then offers full blocks to the prefix
cache, so the cache never holds a rejected token's KV.

``n > 1``: the caller's request is split into sequences ``"<id>#0" .. "<id>#<n-1>"``.
Sequence 0 (the leader) prefills the prompt alone. In the step its prefill passes the shared
prefix, the last full prompt block before the final prompt token, the other sequences are forked
from it: they reference the leader's full prompt blocks (ref counts, no copy) and start with
those tokens computed. Each of them then recomputes only the prompt's tail (the last, partially
filled block; a whole block when the prompt fills its blocks exactly, since every sequence must
compute at least its last prompt token to sample from) into a block of its own, so no
block-copy kernel is ever needed. Forked sequences join the running queue directly and never
run in the step that writes the KV they share. A preempted sequence drops its references and
recomputes from scratch; siblings keep the shared blocks alive.

Prefix caching: on admission a sequence takes the longest cached prefix of its tokens (whole
blocks, at most up to its last token, which it always computes to have logits), so its first
chunk starts there and its KV budget counts only the uncached tokens. A prefill chunk's full
blocks enter the cache as soon as it has run (so requests arriving meanwhile share them);
finished and preempted sequences give the rest of their full blocks to the cache (aborted ones
do not: their last step may not have run). Under ``lpm`` the waiting queue is admitted longest
cached prefix first.

A prefix being computed is computed once: a waiting request whose first ``SHARED_PREFIX_BLOCKS``
blocks of prompt equal those of a request still prefilling (admitted earlier or in this step)
waits, while requests behind it are admitted, until that request has computed the full blocks
the two prompts share (or the cache holds them); blocks are shared at the end of the step that
computes them, and it then takes them from the cache (SGLang dedupes a batch's shared prefixes
the same way; ``shared_prefill.py``). Shorter prompts are never held; without a prefix cache
nothing is.

Preemption is by recomputation: the victim's blocks are freed (into the prefix cache, so the
recompute usually hits), it keeps its generated tokens and goes back to the waiting queue, and
is later prefilled again over prompt + generated tokens.
Waiting sequences never hold blocks, so a sequence alone in an empty cache always fits (requests
that could not are rejected by ``add_request``) and the most important running sequence always
makes progress: no deadlock.

A KV connector (``kv_remote.py``) may fill tokens past the cached prefix at admission (another
instance's prefill, an offload tier): the sequence waits in ``running`` for the load, neither
scheduled nor preempted. Finished sequences' blocks may stay held for a consumer to pull.
Pooling requests want no logits (their last chunk ends them); encoders' run whole, with no KV.

LoRA (``max_loras``): at most that many distinct adapters among running sequences. A sequence
whose adapter finds no slot is skipped, and after it only base-model sequences and those of
running adapters that arrived before it are admitted in that step (``lora_slots.py``).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenmill.cache import CacheIntegrityError, KVBlockManager
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.request import (FinishReason, Request, RequestStatus, check_prompt,
                               check_whole_prompt, sequence_id)
from tokenmill.sched.kv_remote import RemoteKV
from tokenmill.sched.lora_slots import AdapterSlots, adapter_names, check_max_loras
from tokenmill.sched.output import (Sampled, ScheduledChunk, SchedulerOutput, SchedulerStats,
                                    SeqUpdate, num_matching_drafts, sampled_tokens)
from tokenmill.sched.policy import (LPM_MAX_WAITING, get_policy, is_prefix_aware,
                                    longest_prefix_first)
from tokenmill.sched.queue import RequestQueue
from tokenmill.sched.shared_prefill import PrefillHolds
from tokenmill.sched.stop import append_until_stop
from tokenmill.sched.step_batch import Planned, StepBatch
from tokenmill.util import cdiv

if TYPE_CHECKING:
    from tokenmill.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler

# Blocks of prompt two requests must share for the later one to wait for the earlier one's
# prefill rather than compute them too (128 tokens at block size 16: a system prompt's worth;
# a shared chat-template header alone is not worth a step's wait).
SHARED_PREFIX_BLOCKS = 8


class Scheduler:
    """Owns the waiting and running queues and the KV block manager (built from ``cache_config``
    and ``num_blocks`` unless one is given). ``eos_token_ids`` are the model's; a request may
    override them with its own ``eos_token_ids``. ``connector``: a KV connector's scheduler
    side, or None (nothing of it is then done, per step or per sequence). ``max_loras``: the
    distinct LoRA adapters running sequences may use at once (None: no limit)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, *,
                 num_blocks: int | None = None, block_manager: KVBlockManager | None = None,
                 eos_token_ids: Iterable[int] = (), connector: KVConnectorScheduler | None = None,
                 max_loras: int | None = None) -> None:
        check_max_loras(max_loras)
        self.max_loras = max_loras
        self.config = scheduler_config
        self.block_manager = block_manager or _make_block_manager(cache_config, num_blocks)
        self.block_size = self.block_manager.block_size
        # Unset, the context ends where the cache does; the last sampled token needs no KV.
        capacity = self.block_manager.pool.num_usable_blocks * self.block_size + 1
        self.max_model_len = scheduler_config.max_model_len or capacity
        self.eos_token_ids = frozenset(eos_token_ids)
        key = get_policy(scheduler_config.policy)
        self.waiting = RequestQueue(key)  # holds no blocks, ever
        self.running = RequestQueue(key)
        self._prefix_aware = is_prefix_aware(scheduler_config.policy)
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found
        self._pending_forks: dict[str, list[Request]] = {}  # leader id -> siblings awaiting fork
        self._live: dict[str, Request] = {}  # sequence id -> unfinished sequence
        self._groups: dict[str, list[Request]] = {}  # caller's request id -> its sequences
        self._step_finished: dict[str, Request] = {}  # stopped by the latest update (not aborts)
        self._finished_ids: list[str] = []
        self._unapplied: SchedulerOutput | None = None  # scheduled, not yet updated
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # drafts scheduled for verification
        self.num_accepted_tokens = 0  # drafts the runner accepted
        self._num_steps = 0
        self._overhead_s = 0.0
        self._last_step = (0, 0)  # (batched tokens, scheduled sequences)
        self.connector = connector
        self.remote_kv = None if connector is None else RemoteKV(connector, self.block_manager)
        # LongRoPE (Phi-3/4): a sequence longer than this runs on the long factors, its KV
        # included; one crossing it is recomputed whole, as transformers does (set by the build)
        self.rope_boundary: int | None = None

    # ----- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> list[Request]:
        """Queue a new request; returns its schedulable sequences (``[request]`` when n == 1)."""
        sequences = request.sequences()
        self._check_new(request, sequences)
        arrival = next(self._arrivals)
        eos = tuple(self.eos_token_ids) if request.eos_token_ids is None else None
        for seq in sequences:
            seq.arrival_seq = arrival
            if eos is not None:
                seq.eos_token_ids = eos
            self._live[seq.request_id] = seq
        self._groups[request.request_id] = sequences
        leader, siblings = sequences[0], sequences[1:]
        if siblings and self._shared_prefix_len(leader) > 0:
            self._pending_forks[leader.request_id] = siblings
            siblings = []
        for seq in (leader, *siblings):
            self.waiting.push(seq)
        return sequences

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its sequences) or one sequence, in any state, freeing its blocks.
        Unknown or already finished ids are not an error; returns whether anything was aborted."""
        sequences = self._groups.get(request_id)
        if sequences is None:
            sequences = [self._live[request_id]] if request_id in self._live else []
        # Siblings first, so an aborted leader has no pending forks left to release.
        live = [seq for seq in reversed(sequences) if not seq.is_finished]
        for seq in live:
            self._finish(seq, RequestStatus.FINISHED_ABORTED)
        return bool(live)

    def finish_request(self, request_id: str, reason: FinishReason,
                       stop_reason: int | str | None = None,
                       num_output_tokens: int | None = None) -> bool:
        """Finish one sequence for a reason the scheduler cannot see (a matched stop string).
        ``num_output_tokens`` cuts its output there first: the tokens a multi-token step
        appended after the one that completed the stop string."""
        request = self._live.get(request_id) or self._step_finished.get(request_id)
        if request is None:
            return False
        if num_output_tokens is not None and num_output_tokens < request.num_output_tokens:
            del request.output_token_ids[num_output_tokens:]
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        if request.is_finished:  # by a stop token or length later in the same run: the stop
            request.status, request.stop_reason = reason.status, stop_reason  # string came first
        else:
            self._finish(request, reason.status, stop_reason)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    @property
    def has_pending_kv_work(self) -> bool:
        """The KV connector has ops queued, loads running or blocks held: the engine polls its
        workers even when no sequence is left to schedule."""
        return self.remote_kv is not None and self.remote_kv.has_pending_work

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting, preempted, and n > 1 siblings waiting for their prompt to be shared."""
        return len(self._live) - len(self.running)

    def waiting_prompt_tokens(self) -> int:
        """The prompt tokens the next step could admit from the waiting queue: the uncached
        tokens of the requests the free seats (``max_num_seqs``) would take, in queue order,
        at most the token budget. For a proposer, whose drafts are scheduled ahead of them
        (an estimate: KV room is not checked)."""
        seats = self.config.max_num_seqs - len(self.running)
        budget = self.config.max_num_batched_tokens
        total = 0
        for request in itertools.islice(self.waiting, max(seats, 0)):
            total += request.num_tokens - self.block_manager.cached_prefix_len(request)
            if total >= budget:
                return budget
        return total

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            num_preemptions=self.num_preemptions, kv_cache_usage=self.block_manager.usage,
            num_free_blocks=self.block_manager.num_free_blocks, num_steps=self._num_steps,
            last_num_batched_tokens=self._last_step[0], last_num_scheduled=self._last_step[1],
            overhead_seconds_total=self._overhead_s,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_blocks=self.block_manager.pool.num_usable_blocks,
            num_cached_blocks=self.block_manager.prefix_cache.num_cached_blocks,
            running_loras=adapter_names(self.running.loras),
            waiting_loras=adapter_names(self.waiting.loras),
            **(self.remote_kv.counters() if self.remote_kv is not None else {}))

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no sequence uses; returns the number of blocks dropped."""
        return self.block_manager.flush_prefix_cache()

    # ----- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._unapplied is not None:
            # Sequences of that step wait for their samples; scheduling them again would
            # compute nothing and leave them stuck.
            raise RuntimeError("schedule() called before update_from_output() of the last step")
        start = time.perf_counter()
        batch = StepBatch(self.config.max_num_batched_tokens)
        self._schedule_running(batch)
        # Blocks were just short for the running set: admitting more would only thrash.
        if not batch.preempted_ids and self.waiting:  # (steady decode: no pass for nothing)
            self._admit_waiting(batch)
        output = self._build_output(batch)
        if self._pending_forks:
            self._fork_shared_prompts(batch)
        self._num_steps += 1
        self._last_step = (output.num_batched_tokens, len(output.scheduled))
        self._overhead_s += time.perf_counter() - start
        self._unapplied = output
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: Sampled,
                           kv_output: KVConnectorOutput | None = None) -> list[SeqUpdate]:
        """Apply what the KV connector's workers finished (``kv_output``), then append the
        accepted tokens of every chunk that asked for logits, check the stop conditions that
        need no text token by token, roll back the KV of rejected drafts, share newly computed
        full blocks with the prefix cache, and free finished sequences' blocks at once.

        ``sampled`` maps a sequence id to one token id or a list of (Python int) token ids
        (``ModelOutput.token_ids``). Chunks of sequences aborted or finished since
        ``schedule()`` are skipped. Use ``group_by_request`` on the result to regroup the
        sequences of n > 1 requests. If the runner failed, abort the step's sequences first,
        then call this with ``{}``."""
        if output is not self._unapplied:
            raise ValueError("update_from_output() takes the latest schedule() output, once")
        self._unapplied = None
        start = time.perf_counter()
        self._step_finished.clear()  # not in schedule(): overlap matches stop strings after it
        chunks = output.scheduled
        if self.remote_kv is not None:
            chunks = self.remote_kv.update(kv_output, chunks)
        updates = []
        for chunk in chunks:
            if chunk.request.status is not RequestStatus.RUNNING:
                continue
            if chunk.num_logits:
                updates.append(self._apply_tokens(chunk, sampled_tokens(chunk, sampled)))
            elif chunk.request.pooling_params is not None and not _remaining(chunk.request):
                self._finish(chunk.request, RequestStatus.FINISHED_STOPPED)  # a pooled vector
                updates.append(SeqUpdate(chunk.request, [], True))
            else:  # prefill KV just written: share it with newcomers now
                self.block_manager.cache_computed(chunk.request)
        self._overhead_s += time.perf_counter() - start
        return updates

    # ----- scheduling ----------------------------------------------------------------------

    def _schedule_running(self, batch: StepBatch) -> None:
        # Decodes before prefills: a long prompt in progress must not stall token streams.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            (decodes if _remaining(request) == 1 else prefills).append(request)
        for request in (*decodes, *prefills):
            if batch.tokens_left == 0:
                return
            if request.status is RequestStatus.RUNNING:  # not preempted earlier in this step
                self._schedule_running_one(request, batch)

    def _schedule_running_one(self, request: Request, batch: StepBatch) -> None:
        if self.rope_boundary is not None and not request.long_rope \
                and request.num_tokens > self.rope_boundary:
            self._preempt(request, batch)  # KV on the short factors: recomputed on the long
            return
        num_new = min(_remaining(request), batch.tokens_left)
        drafts = self._num_drafts(request, num_new, batch.tokens_left) \
            if request.spec_token_ids else 0
        # Speculation never preempts anyone: without blocks for the drafts, run without them.
        if not (drafts and self.block_manager.allocate_slots(request, num_new + drafts)):
            drafts = 0
            while not self.block_manager.allocate_slots(request, num_new):
                # the policy's least important, maybe `request`; never a loading one
                victim = next(r for r in reversed(self.running)
                              if r.status is RequestStatus.RUNNING)
                self._preempt(victim, batch)
                if victim is request:
                    return
        batch.add(request, num_new, drafts)

    def _num_drafts(self, request: Request, num_new: int, tokens_left: int) -> int:
        """How many of the request's draft tokens this step can verify: only after its last
        known token, within the budget, and never past max_tokens or the context."""
        if not request.spec_token_ids or num_new < _remaining(request):
            return 0
        room = self.max_model_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, min(len(request.spec_token_ids), tokens_left - num_new, room))

    def _admit_waiting(self, batch: StepBatch) -> None:
        holds = PrefillHolds.for_step(SHARED_PREFIX_BLOCKS, self.block_manager, batch,
                                      self.running)
        order, reordered = self._admission_order()
        # a reordered admission still grants adapter slots in queue order (lora_slots.py)
        slots = AdapterSlots.for_step(self.max_loras, self.running.loras,
                                      self.waiting if reordered else ())
        for request in order:
            if batch.tokens_left == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if holds is not None and holds.holds(request):
                continue  # its prefix is being computed: take it from the cache later
            if slots is not None and not slots.allows(request):
                continue  # no slot for its adapter this step
            if not self._admit(request, batch):
                return  # head-of-line: a less important request must not overtake it
            if holds is not None:
                holds.admitted(request)
            if slots is not None:
                slots.admitted(request)

    def _admission_order(self) -> tuple[list[Request], bool]:
        """The waiting requests in the order to admit them (a copy: admitted ones leave the
        queue, held ones stay in their place), and whether it differs from the queue's."""
        if self._prefix_aware and len(self.waiting) <= LPM_MAX_WAITING:
            return longest_prefix_first(self.waiting, self.block_manager.cached_prefix_len), True
        return list(self.waiting), False

    def _admit(self, request: Request, batch: StepBatch) -> bool:
        manager = self.block_manager
        request.long_rope = self.rope_boundary is not None and \
            request.num_tokens > self.rope_boundary
        if (whole := request.bidirectional) and _remaining(request) > batch.tokens_left:
            return False  # an encoder's prompt runs whole: a later step's budget takes it
        cached = manager.acquire_cached_prefix(request) if request.reuses_cached_prefix else 0
        request.num_computed_tokens = cached
        kv = self.remote_kv
        ext, is_async = kv.num_external(request, cached) if kv is not None else (0, False)
        # An async load runs while others do: it takes no budget this step.
        num_new = 0 if is_async else min(_remaining(request) - ext, batch.tokens_left)
        # The watermark keeps room for running sequences to grow; with none running there
        # is nobody to keep room for, and insisting could starve a very long request.
        if not (whole or manager.can_allocate(request, ext + num_new, bool(self.running))
                and manager.allocate_slots(request, ext + num_new)):
            manager.free(request)  # gives the cached prefix back
            request.num_computed_tokens = 0
            return False
        self.waiting.remove(request)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += cached
        first = request.num_cached_tokens is None
        if first:
            request.num_cached_tokens = cached + ext
        request.status = RequestStatus.RUNNING
        self.running.push(request)
        if ext:
            kv.start_load(request, cached, ext, is_async, first)
        if not is_async:
            batch.add(request, num_new)
        return True

    def _preempt(self, request: Request, batch: StepBatch) -> None:
        self.running.remove(request)
        unscheduled = batch.drop(request)  # its chunk of this step will not run
        batch.preempted_ids.append(request.request_id)
        self.block_manager.free(request, request.num_computed_tokens - unscheduled)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    def _build_output(self, batch: StepBatch) -> SchedulerOutput:
        chunks = [self._chunk(planned) for planned in batch.chunks.values()]
        meta = None if self.connector is None else self.connector.build_connector_meta()
        return SchedulerOutput(chunks, batch.token_budget - batch.tokens_left,
                               batch.preempted_ids, self.take_finished_ids(), meta)

    def take_finished_ids(self) -> list[str]:
        """The sequences finished or aborted since the last call (``schedule`` calls it too):
        per-sequence state elsewhere (a drafter's cache) can be dropped now."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def _chunk(self, planned: Planned) -> ScheduledChunk:
        request, start, num_tokens, drafts = planned
        end = start + num_tokens
        token_ids = request.token_ids_slice(start, end)
        if request.spec_token_ids:  # proposed for this step: used now or never
            token_ids += request.spec_token_ids[:drafts]
            self.num_draft_tokens += drafts
            request.spec_token_ids = []
        num_logits = drafts + 1 if end == request.num_tokens and not request.pooling_params else 0
        table = list(self.block_manager.block_table(request.request_id))
        return ScheduledChunk(request.request_id, token_ids, start, table, num_logits, request,
                              drafts)

    # ----- n > 1: sharing the prompt ------------------------------------------------------

    def _shared_prefix_len(self, request: Request) -> int:
        """Whole blocks before the last prompt token, which every sequence computes itself."""
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _fork_shared_prompts(self, batch: StepBatch) -> None:
        for request, start, num_tokens, _ in batch.chunks.values():
            siblings = self._pending_forks.get(request.request_id)
            if siblings and start + num_tokens >= self._shared_prefix_len(request) and (
                    self.remote_kv is None or not self.remote_kv.fills_now(request.request_id)):
                del self._pending_forks[request.request_id]
                self._start_siblings(request, siblings)

    def _start_siblings(self, leader: Request, siblings: list[Request]) -> None:
        shared = self._shared_prefix_len(leader)
        for seq in siblings:
            if len(self.running) >= self.config.max_num_seqs:
                self.waiting.push(seq)  # no room to run now: it will prefill on its own
                continue
            self.block_manager.fork(leader, seq, shared)
            seq.num_computed_tokens, seq.long_rope = shared, leader.long_rope
            seq.status = RequestStatus.RUNNING
            self.running.push(seq)

    # ----- tokens and stopping -------------------------------------------------------------

    def _apply_tokens(self, chunk: ScheduledChunk, token_ids: list[int]) -> SeqUpdate:
        """One sampling chunk's result: append, roll back rejected drafts, cache, finish."""
        request = chunk.request
        num_known = request.num_tokens  # the chunk reached the last known token
        new, stop = append_until_stop(request, token_ids, self.max_model_len)
        rejected = 0
        if chunk.num_drafts:
            accepted = num_matching_drafts(chunk.draft_token_ids, new)
            self.num_accepted_tokens += accepted
            # KV is valid for the known tokens and the drafts that match appended tokens.
            rejected = request.num_computed_tokens - (num_known + accepted)
            if rejected:
                request.num_computed_tokens -= rejected
                self.block_manager.trim(request, request.num_computed_tokens)
        if stop is not None:
            self._finish(request, *stop)
            self._step_finished[request.request_id] = request
        elif len(chunk.token_ids) > 1:  # KV of a prompt or of accepted drafts: share it now
            self.block_manager.cache_computed(request)
        return SeqUpdate(request, new, stop is not None, rejected)

    def _finish(self, request: Request, status: RequestStatus,
                stop_reason: int | str | None = None) -> None:
        self._detach(request)
        request.status = status
        request.stop_reason = stop_reason
        if self.remote_kv is None or not self.remote_kv.finish(request):
            # An aborted sequence's last scheduled step may never have run: cache none of its KV.
            cacheable = 0 if status is RequestStatus.FINISHED_ABORTED \
                else request.num_computed_tokens
            self.block_manager.free(request, cacheable)
        self._finished_ids.append(request.request_id)
        del self._live[request.request_id]
        for seq in self._pending_forks.pop(request.request_id, []):
            self.waiting.push(seq)  # the leader is gone: its siblings prefill on their own
        group = self._groups.get(request.group_id, [])
        if all(seq.is_finished for seq in group):
            self._groups.pop(request.group_id, None)

    def _detach(self, request: Request) -> None:
        """Take an unfinished sequence out of whichever queue holds it."""
        if request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS):
            self.running.remove(request)
        elif not self.waiting.remove(request):
            leader_id = sequence_id(request.group_id, 0)
            self._pending_forks[leader_id].remove(request)

    # ----- validation ----------------------------------------------------------------------

    def _check_new(self, request: Request, sequences: list[Request]) -> None:
        ids = {request.request_id, *(seq.request_id for seq in sequences)}
        if any(i in self._live or i in self._groups for i in ids) or (
                self.remote_kv is not None and self.remote_kv.owns_any(ids)):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_output_tokens or request.num_computed_tokens or request.is_finished:
            raise ValueError(f"request {request.request_id!r} was already run; add a fresh one")
        check_prompt(request.prompt_token_ids, self.max_model_len)
        self._check_fits(request)

    def _check_fits(self, request: Request) -> None:
        """Reject a sequence that could not fit even alone in the empty cache."""
        if request.bidirectional:  # no KV at all, but the whole prompt in one step
            return check_whole_prompt(request.prompt_token_ids, self.config.max_num_batched_tokens)
        max_tokens = request.sampling_params.max_tokens
        longest = self.max_model_len if max_tokens is None else min(
            self.max_model_len, request.num_prompt_tokens + max_tokens)
        # The last sampled token never has its KV computed.
        needed = self.block_manager.blocks_for_tokens(longest - 1)
        usable = self.block_manager.pool.num_usable_blocks
        if needed > usable:
            raise ValueError(
                f"request {request.request_id!r} may grow to {longest} tokens, which needs "
                f"{needed} KV blocks of {self.block_size}, but the cache has {usable}; lower "
                "max_tokens or give the KV cache more memory")

    def check_integrity(self) -> None:
        """Cache invariants plus: only running sequences (loading ones included) hold blocks,
        exactly the blocks their computed tokens need, and ended ones the KV connector keeps;
        queues and counts agree. O(blocks + requests): tests only."""
        self.block_manager.check_integrity()
        running = list(self.running)
        _require(len(running) <= self.config.max_num_seqs, "more running than max_num_seqs")
        loras = Counter(r.lora for r in running if r.lora is not None)
        _require(loras == self.running.loras, "the running queue's adapter counts are off")
        _require(self.max_loras is None or len({lora.lora_int_id for lora in loras})
                 <= self.max_loras, f"more than max_loras={self.max_loras} adapters run")
        ended = set() if self.remote_kv is None else \
            self.remote_kv.check_integrity(running, self._live)
        _require(set(self.block_manager.owners()) <= {r.request_id for r in running} | ended,
                 "a sequence that is not running holds blocks")
        for r in running:  # a loading one is checked by remote_kv
            _require(r.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS),
                     f"{r.request_id} in running is {r.status}")
            # After an update KV exists only for verified tokens, and never for the newest one.
            _require(self._unapplied is not None or r.num_computed_tokens < r.num_tokens,
                     f"{r.request_id} has KV for {r.num_computed_tokens} of {r.num_tokens} tokens")
            blocks = len(self.block_manager.block_table(r.request_id))
            _require(blocks == cdiv(r.num_computed_tokens, self.block_size),
                     f"{r.request_id} holds {blocks} blocks for {r.num_computed_tokens} tokens")
        for r in itertools.chain(self.waiting, *self._pending_forks.values()):
            _require(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                     and r.num_computed_tokens == 0, f"{r.request_id} waits in a bad state")
        queued = len(running) + len(self.waiting) + sum(map(len, self._pending_forks.values()))
        _require(queued == len(self._live), f"{queued} queued but {len(self._live)} live")


def _remaining(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CacheIntegrityError(message)


def _make_block_manager(cache_config: CacheConfig, num_blocks: int | None) -> KVBlockManager:
    num_blocks = num_blocks if num_blocks is not None else cache_config.num_blocks
    if num_blocks is None:
        raise ValueError("the number of KV blocks is unknown: pass num_blocks (the runner "
                         "derives it from free memory) or set CacheConfig.num_blocks")
    return KVBlockManager(num_blocks, cache_config.block_size, cache_config.watermark,
                          cache_config.enable_prefix_caching)
