"""Per-request output state: incremental text, stop strings, logprobs.

Text a caller sees only grows. While a sequence runs, any tail that could still become a stop
string is held back, so a streamed delta never has to be taken back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tokenmill.params import SamplingParams
from tokenmill.request import CompletionOutput, Request, RequestOutput
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SeqText:
    detok: IncrementalDetokenizer
    text: str = ""  # everything decoded so far (final: cut at the stop string)
    stopped_at: str | None = None  # the stop string that ended the sequence
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, sequences: list[Request], tokenizer: Tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sequences = sequences
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.seqs = {s.request_id: SeqText(IncrementalDetokenizer(
            tokenizer, params.skip_special_tokens, context_ids=prompt_token_ids[-4:]))
            for s in sequences}
        # Neither stop strings nor logprobs: a token needs only its text (the hot path of a
        # large batch, run per sequence per step).
        self._plain = not params.stop and params.logprobs is None
        # n > 1 outputs list the sequences by index; one sequence needs no sort per step.
        self._ordered = sorted(sequences, key=lambda s: s.seq_index)
        # per prompt token, its logprobs entry once a step scored it (the first stays None)
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None \
            else [None] * len(prompt_token_ids)

    def take_prompt_logprobs(self, first: int, entries: Sequence[object]) -> None:
        """Entries scoring prompt tokens ``first, first + 1, ...``. A prompt computed again
        (after a preemption, or by each of n sequences) scores them again: the first stays."""
        scored = self.prompt_logprobs
        if scored is None:
            return
        for i, entry in enumerate(entries, start=first):
            if scored[i] is None:
                scored[i] = entry

    def on_tokens(self, seq: Request, token_ids: list[int],
                  logprobs: Sequence[object | None] | None) -> tuple[str, int] | None:
        """Take a step's new tokens of one sequence (``logprobs``: one entry per token, or
        None). Returns ``(stop string, tokens kept)`` when a stop string ends the sequence:
        the tokens after the one that completed it are not part of the output."""
        st = self.seqs[seq.request_id]
        if self._plain and token_ids:
            add = st.detok.add
            st.text += add(token_ids[0]) if len(token_ids) == 1 \
                else "".join([add(t) for t in token_ids])
            if seq.status.is_finished:
                st.text += st.detok.finish()
            return None
        for i, token_id in enumerate(token_ids):
            before = len(st.text)
            st.text += st.detok.add(token_id)
            if logprobs is not None and self.params.logprobs is not None:
                st.logprobs.append(logprobs[i])
                st.cumulative_logprob += logprobs[i].logprob
            if i == len(token_ids) - 1 and seq.is_finished:
                st.text += st.detok.finish()
            stop = self._match_stop(st, before)
            if stop is not None:
                return stop, i + 1
        return None

    def _match_stop(self, st: SeqText, before: int) -> str | None:
        if not self.params.stop or st.stopped_at is not None:
            return None
        # A stop string may straddle the old and new text: search from just before the new part.
        start = max(0, before - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            i = st.text.find(stop, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        st.text = st.text[:i + len(stop)] if self.params.include_stop_str_in_output else st.text[:i]
        st.stopped_at = stop
        return stop

    def _visible(self, seq: Request, st: SeqText) -> str:
        if seq.is_finished or st.stopped_at is not None or not self.params.stop:
            return st.text
        hold = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(st.text)), hold, -1):
                if st.text.endswith(stop[:k]):
                    hold = k
                    break
        return st.text[:len(st.text) - hold]

    def output(self) -> RequestOutput:
        outs = []
        finished = True
        with_logprobs = self.params.logprobs is not None
        for seq in self._ordered:
            st = self.seqs[seq.request_id]
            reason = seq.finish_reason
            finished = finished and reason is not None
            text = st.text if self._plain else self._visible(seq, st)
            logprobs = list(st.logprobs) if with_logprobs else None
            outs.append(CompletionOutput(
                seq.seq_index, list(seq.output_token_ids), text, reason, seq.stop_reason,
                logprobs, st.cumulative_logprob if with_logprobs else None))
        lead = self.sequences[0]
        return RequestOutput(self.request_id, self.prompt_token_ids, outs, finished=finished,
                             prompt=self.prompt, num_cached_tokens=lead.num_cached_tokens or 0,
                             kv_transfer_params=lead.kv_transfer_out if finished else None,
                             prompt_logprobs=None if self.prompt_logprobs is None
                             else list(self.prompt_logprobs))


def take_prompt_logprobs(states: Mapping[str, RequestState],
                         scored: Mapping[str, tuple[int, Sequence[object]]]) -> None:
    """A step's prompt logprobs (``ModelOutput.prompt_logprobs``) to their requests' states;
    requests gone since the step was scheduled are skipped."""
    for request_id, (first, entries) in scored.items():
        state = states.get(request_id)
        if state is not None:
            state.take_prompt_logprobs(first, entries)
