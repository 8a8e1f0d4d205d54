"""Turn a stream of generated token ids into a stream of text deltas.

A token is not a unit of text: a byte-level token can hold half of a UTF-8 character, and a
SentencePiece token's leading space depends on what precedes it. So each step decodes a short
window of recent tokens twice -- ``ids[prefix:read]`` (already emitted) and ``ids[prefix:]`` --
and emits the difference. The window is the tokens of the last emitted delta plus the pending
ones, so a step costs O(1) however long the sequence is. While the decoded tail ends in U+FFFD
(an incomplete character) nothing is emitted; ``finish()`` flushes whatever remains.

Invariant: the concatenation of all deltas equals ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenmill.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request incremental decoder; feed ids with ``add`` and end with ``finish``."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = ()) -> None:
        """``context_ids``: already-emitted tokens (e.g. the prompt's tail) whose text is not
        emitted again but shapes the first delta, like the leading space of a SentencePiece word."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Per token, per sequence, every step: a set to test and a bound method, looked up once.
        self._skip_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._decode_ids = tokenizer.decode
        self._decode_token = tokenizer.decode_token
        self._ids: list[int] = [i for i in context_ids if not self._skipped(i)][-4:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it completes (may be empty)."""
        if token_id in self._skip_ids:
            # Dropping skipped ids up front equals decode(..., skip_special_tokens=True) over the
            # whole sequence, and keeps them from stalling or widening the window.
            return ""
        ids = self._ids
        ids.append(token_id)
        new_text = self._decode_ids(ids[self._prefix_offset:], False)  # never empty: one added
        if new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character: wait for the bytes that finish it
        return self._emit(new_text)

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def finish(self) -> str:
        """Flush held-back text at the end of the sequence (a truly broken tail shows as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix_offset, len(self._ids)))

    def _emit(self, new_text: str) -> str:
        start, end = self._prefix_offset, self._read_offset
        # The window before the new tokens is usually the one token emitted last step.
        prefix_text = self._decode_token(self._ids[start]) if end - start == 1 \
            else self._decode(start, end)
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim()
        self.text += delta
        return delta

    def _trim(self) -> None:
        """Forget ids before the window so memory stays O(1) too."""
        if self._prefix_offset > 64:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        # Skipped ids never enter the window, so decoding with skip=False changes nothing for
        # them and keeps special tokens the caller asked to see.
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=False)

    def _skipped(self, token_id: int) -> bool:
        return token_id in self._skip_ids
