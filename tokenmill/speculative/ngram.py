"""N-gram prompt lookup: the longest suffix of a sequence (prompt + output) that occurred earlier
in it proposes the tokens that followed that occurrence.

Per sequence an index maps every n-gram (``min_n <= n <= max_n``) to the end of its latest
occurrence that has a token after it. It grows with the sequence (each new token adds at most
``max_n - min_n + 1`` entries), so a lookup costs ``max_n - min_n + 1`` dict probes however
long the sequence is, instead of a scan of the whole history every step.

    tokens   a b c d x a b c  ?          suffix "a b c" (n = 3) ended at 3 before
    drafts                  d x a ...    the tokens that followed it, up to k
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from tokenmill.request import Request


class _Index:
    __slots__ = ("ends", "size")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self.size = 0  # n-grams ending before this position are indexed


class NgramProposer:
    """Drafts by prompt lookup; no model, no KV cache, no distribution (point-mass drafts)."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, requests: Sequence[Request],
                num_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        """Up to ``num_tokens[seq_id]`` drafts for each sequence listed there (and > 0)."""
        drafts = {}
        for request in requests:
            k = num_tokens.get(request.request_id, 0)
            if k > 0:
                found = self._lookup(request.request_id, request.num_tokens,
                                     request.token_ids_slice, k)
                if found:
                    drafts[request.request_id] = found
        return drafts

    def lookup(self, seq_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """The tokens after the latest earlier occurrence of the longest indexed suffix of
        ``tokens`` (at most ``k``); [] when no suffix of ``min_n`` or more occurred before."""
        return self._lookup(seq_id, len(tokens), lambda a, b: list(tokens[a:b]), k)

    def _lookup(self, seq_id: str, total: int, window: Callable[[int, int], list[int]],
                k: int) -> list[int]:
        index = self._indexes.get(seq_id)
        if index is None or index.size > total:  # new, or a different history
            index = self._indexes[seq_id] = _Index()
        self._extend(index, total, window)
        suffix = window(max(0, total - self.max_n), total)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(suffix[len(suffix) - n:]))
            if end is not None:
                return window(end, min(end + k, total))
        return []

    def _extend(self, index: _Index, total: int,
                window: Callable[[int, int], list[int]]) -> None:
        # Index the n-grams ending at every e < total (each has a token after it); the suffix
        # ending at total is what gets looked up, never a match of itself.
        first = max(index.size, self.min_n)
        if first >= total:
            return
        base = max(0, first - self.max_n)
        tokens = window(base, total)
        ends = index.ends
        for end in range(first, total):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(tokens[end - n - base:end - base])] = end
        index.size = total

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._indexes.pop(seq_id, None)
