"""A request queue kept sorted by policy key, most important first."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterator

from tokenmill.request import LoRARequest, Request
from tokenmill.sched.policy import PolicyKey


class RequestQueue:
    """Sorted by ``key`` (computed once per insertion). Keys are unique: the scheduler's
    ``arrival_seq`` plus ``seq_index`` break every tie, so lookups by bisection are exact.

    Inserting and removing cost O(log n) comparisons plus a memmove of the pointer list, which is
    cheap at the queue lengths a server holds (thousands). ``loras`` counts the queued sequences
    of each LoRA adapter (base-model ones are not counted), so the adapters a queue holds are
    known without a walk over it.
    """

    def __init__(self, key: PolicyKey) -> None:
        self._key = key
        self._keys: list[tuple[float, ...]] = []
        self._requests: list[Request] = []
        self.loras: Counter[LoRARequest] = Counter()

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._requests)

    def push(self, request: Request) -> None:
        key = self._key(request)
        i = bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, request)
        if request.lora is not None:
            self.loras[request.lora] += 1

    def first(self) -> Request:
        return self._requests[0]

    def last(self) -> Request:
        return self._requests[-1]

    def pop_first(self) -> Request:
        del self._keys[0]
        request = self._requests.pop(0)
        self._uncount(request)
        return request

    def remove(self, request: Request) -> bool:
        """Take ``request`` out; False when it is not queued here."""
        i = bisect_left(self._keys, self._key(request))
        if i == len(self._requests) or self._requests[i] is not request:
            return False
        del self._keys[i], self._requests[i]
        self._uncount(request)
        return True

    def _uncount(self, request: Request) -> None:
        lora = request.lora
        if lora is not None:
            self.loras[lora] -= 1
            if not self.loras[lora]:
                del self.loras[lora]
