"""Routing policies: which worker serves a request.

A policy sees the request's ``RouteKey`` and the healthy candidates for its model and returns
one of them; the router then calls ``on_routed`` with the worker that actually took the request
(after retries), so state that mirrors the workers' caches follows what really happened.

- ``round_robin``: each candidate in turn.
- ``least_load``: power of two choices on in-flight requests — two random candidates, the less
  loaded wins. It avoids the herd that "always the least loaded" causes when many routers (or
  many requests between load updates) see the same minimum.
- ``prefix_hash``: consistent hashing of the prompt's first tokens, so requests that share a
  prefix land on the same worker without any state, and a pool change moves only ~1/n of keys.
- ``cache_aware``: the worker whose prefix cache most likely holds the prompt. Approximate mode
  keeps one radix tree of the text routed to each worker; exact mode reads the workers' own
  KV-cache events through a ``KVIndex``. Both fall back to least load when load is imbalanced.

A request under a LoRA adapter can use only blocks computed under that adapter (a worker's
prefix cache never shares them across adapters, nor with the base model), so every policy keys
it apart: ``RouteKey.adapter`` names it, the text is prefixed with it (the approximate tree,
``prefix_hash``) and the exact index matches only its blocks. A base request's key is what it
always was.

Policies run on the router's event loop only (no locking); the ``KVIndex`` they read is written
from subscriber threads and locks itself.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from tokenmill.router.config import POLICIES, RouterConfig
from tokenmill.router.prefix_tree import PrefixTree

if TYPE_CHECKING:
    from tokenmill.router.kv_index import KVIndex


class WorkerLike(Protocol):
    """What a policy reads of a worker; the router's ``Worker`` has more."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


W = TypeVar("W", bound=WorkerLike)


def adapter_prefix(adapter: str) -> str:
    """What a LoRA request's route text starts with: NULs around it, because no prompt text
    a client renders begins that way by accident, so it never shares a prefix with a base
    prompt or another adapter's."""
    return f"\0lora:{adapter}\0"


@dataclass
class RouteKey:
    """What a policy may route on.

    ``text`` is the prompt as the router renders it (a completion's prompt, or chat messages as
    ``"<|role|>content\\n"`` each, prefixed by ``cache_salt`` when given, then by the adapter's
    ``adapter_prefix`` for a LoRA request); ``token_ids`` is filled by the router before
    ``choose`` only when ``policy.needs_tokens``; ``adapter``: the LoRA adapter's name (the
    workers' id of it), None for the base model.
    """

    model: str | None
    text: str
    token_ids: list[int] | None = None
    adapter: str | None = None
    # What the KV index held of the prompt per worker when ``choose`` ran: the exact hit figure
    # must use it, because by ``on_routed`` (response headers) the worker has usually stored
    # the prompt's blocks and a fresh match would count them as hits.
    cached_tokens: dict[str, int] | None = field(default=None, init=False, repr=False,
                                                 compare=False)

    def under_adapter(self, adapter: str | None) -> None:
        """Key the request to ``adapter``'s cache (None: the base model, nothing changes)."""
        if adapter is not None and self.adapter is None:
            self.adapter = adapter
            self.text = adapter_prefix(adapter) + self.text


class Policy(ABC):
    """Chooses a worker per request; see the module docstring for the contract."""

    name: str = ""

    @property
    def needs_tokens(self) -> bool:
        """True: the router tokenizes the prompt (a worker's ``/tokenize``) before ``choose``."""
        return False

    @abstractmethod
    def choose(self, key: RouteKey, workers: Sequence[W]) -> W:
        """One of ``workers`` (non-empty: the healthy candidates for ``key.model``)."""

    def on_routed(self, key: RouteKey, worker: WorkerLike) -> None:
        """``worker`` took the request for ``key``."""

    def forget_worker(self, url: str) -> None:
        """The worker at ``url`` left the pool: drop what is known of it."""

    def stats(self) -> dict[str, float]:
        """Figures the router exports as metrics (e.g. ``cache_hit_estimate``)."""
        return {}


def least_loaded(workers: Sequence[W]) -> W:
    """The candidate with the fewest requests in flight; the first of equals."""
    return min(workers, key=lambda w: w.in_flight)


def load_imbalanced(workers: Sequence[WorkerLike], cfg: RouterConfig) -> bool:
    """Both thresholds must hold: an absolute gap alone is normal under heavy load, a ratio
    alone is normal when the loads are tiny (1 vs 3)."""
    loads = [w.in_flight for w in workers]
    low, high = min(loads), max(loads)
    return high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, key: RouteKey, workers: Sequence[W]) -> W:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker


class LeastLoad(Policy):
    """Power of two choices; ``rng`` is injectable so tests can pin the draws."""

    name = "least_load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, key: RouteKey, workers: Sequence[W]) -> W:
        if len(workers) == 1:
            return workers[0]
        first, second = self._rng.sample(list(workers), 2)
        return second if second.in_flight < first.in_flight else first


def stable_hash(data: bytes) -> int:
    """64 bits of blake2b: the same in every process (Python's ``hash`` is salted per process,
    and two routers must agree on where a prefix goes)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring: ``virtual_nodes`` points per worker, a key goes to the first
    point at or after its hash (wrapping). Many points per worker even out the arcs, so each
    worker owns ~1/n of the keys and a join or leave moves only the arcs it takes or frees."""

    def __init__(self, urls: Sequence[str], virtual_nodes: int) -> None:
        points = sorted((stable_hash(f"{url}#{i}".encode()), url)
                        for url in set(urls) for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]

    def lookup(self, key_hash: int) -> str:
        i = bisect.bisect_left(self._hashes, key_hash)
        return self._urls[i % len(self._urls)]


class PrefixHash(Policy):
    name = "prefix_hash"
    _MAX_RINGS = 64  # candidate sets differ by model and health; few exist at a time

    def __init__(self, cfg: RouterConfig) -> None:
        self._tokens = cfg.prefix_hash_tokens
        self._virtual_nodes = max(1, cfg.virtual_nodes)
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()

    def key_hash(self, key: RouteKey) -> int:
        """Hash of the model and the first N tokens (4N characters when only text is known);
        an adapter's requests by its name, whichever way ``model`` named it."""
        if key.token_ids is not None:
            prefix = ",".join(map(str, key.token_ids[: self._tokens])).encode()
        else:
            prefix = key.text[: 4 * self._tokens].encode("utf-8", "surrogatepass")
        scope = (key.model or "") if key.adapter is None else adapter_prefix(key.adapter)
        return stable_hash(scope.encode() + b"\0" + prefix)

    def choose(self, key: RouteKey, workers: Sequence[W]) -> W:
        if len(workers) == 1:
            return workers[0]
        by_url = {w.url: w for w in workers}
        return by_url[self._ring(tuple(sorted(by_url))).lookup(self.key_hash(key))]

    def _ring(self, urls: tuple[str, ...]) -> HashRing:
        """Rings are cached per candidate set: building one hashes n * virtual_nodes points."""
        ring = self._rings.get(urls)
        if ring is None:
            ring = self._rings[urls] = HashRing(urls, self._virtual_nodes)
            if len(self._rings) > self._MAX_RINGS:
                self._rings.popitem(last=False)
        self._rings.move_to_end(urls)
        return ring

    def forget_worker(self, url: str) -> None:
        for urls in [u for u in self._rings if url in u]:
            del self._rings[urls]


class CacheAware(Policy):
    """Route to the worker most likely to hold the prompt's prefix in its cache.

    Exact when the ``KVIndex`` has events from a candidate (token ids, block chains as the
    worker reported them); otherwise approximate, from one radix tree of the text routed to
    each worker. The tree is updated in both modes so a worker without events still has a
    fallback. Imbalanced load overrides both: a cache hit does not pay for a long queue.
    """

    name = "cache_aware"

    def __init__(self, cfg: RouterConfig, kv_index: KVIndex | None = None) -> None:
        self._cfg = cfg
        self._index = kv_index
        self.tree = PrefixTree(cfg.max_tree_chars)
        self._matched_chars = 0
        self._total_chars = 0
        self._exact_hit_tokens = 0
        self._exact_total_tokens = 0

    @property
    def needs_tokens(self) -> bool:
        return self._index is not None and bool(self._index.workers())

    def choose(self, key: RouteKey, workers: Sequence[W]) -> W:
        exact = key.token_ids is not None and self._exact_for(workers)
        if exact:
            assert self._index is not None and key.token_ids is not None
            key.cached_tokens = self._index.match(key.token_ids, key.adapter)
        if len(workers) == 1:
            return workers[0]
        if load_imbalanced(workers, self._cfg):
            return least_loaded(workers)
        if exact:
            return self._choose_exact(key, workers)
        return self._choose_approximate(key.text, workers)

    def _exact_for(self, workers: Sequence[WorkerLike]) -> bool:
        if self._index is None:
            return False
        known = self._index.workers()
        return any(w.url in known for w in workers)

    def _choose_exact(self, key: RouteKey, workers: Sequence[W]) -> W:
        """Longest cached prefix in whole blocks, if it covers ``cache_threshold`` of the
        prompt's whole blocks (a partial last block is never cached, so it must not count)."""
        assert self._index is not None and key.token_ids is not None
        cached = key.cached_tokens or {}
        best = max(workers, key=lambda w: (cached.get(w.url, 0), -w.in_flight))
        hit = cached.get(best.url, 0)
        block = self._index.block_size(best.url) or 1
        cacheable = len(key.token_ids) - len(key.token_ids) % block
        if hit > 0 and hit >= self._cfg.cache_threshold * cacheable:
            return best
        return least_loaded(workers)

    def _choose_approximate(self, text: str, workers: Sequence[W]) -> W:
        matched = self.tree.match(text)
        best = max(workers, key=lambda w: (matched.get(w.url, 0), -w.in_flight))
        hit = matched.get(best.url, 0)
        if text and hit > 0 and hit >= self._cfg.cache_threshold * len(text):
            return best
        # No worker holds enough: the one with the most room, so prefixes spread evenly.
        return min(workers, key=lambda w: (self.tree.chars(w.url), w.in_flight))

    def on_routed(self, key: RouteKey, worker: WorkerLike) -> None:
        self._matched_chars += self.tree.insert(key.text, worker.url)
        self._total_chars += len(key.text)
        if key.token_ids is not None and key.cached_tokens is not None:
            self._exact_hit_tokens += key.cached_tokens.get(worker.url, 0)
            self._exact_total_tokens += len(key.token_ids)

    def forget_worker(self, url: str) -> None:
        self.tree.forget(url)

    def stats(self) -> dict[str, float]:
        """``cache_hit_estimate``: share of the routed text the chosen worker already had (by
        the tree); ``exact_hit_rate``: the same in tokens by the workers' own events."""
        out = {
            "cache_hit_estimate": self._matched_chars / max(1, self._total_chars),
            "matched_chars": float(self._matched_chars),
            "total_chars": float(self._total_chars),
            "tree_chars": float(self.tree.total_chars()),
        }
        if self._exact_total_tokens:
            out["exact_hit_rate"] = self._exact_hit_tokens / self._exact_total_tokens
            out["exact_hit_tokens"] = float(self._exact_hit_tokens)
            out["exact_prompt_tokens"] = float(self._exact_total_tokens)
        return out


def make_policy(cfg: RouterConfig, kv_index: KVIndex | None = None,
                rng: random.Random | None = None) -> Policy:
    """The policy ``cfg.policy`` names; ``kv_index`` makes ``cache_aware`` exact where workers
    publish KV events."""
    if cfg.policy == "round_robin":
        return RoundRobin()
    if cfg.policy == "least_load":
        return LeastLoad(rng)
    if cfg.policy == "prefix_hash":
        return PrefixHash(cfg)
    if cfg.policy == "cache_aware":
        return CacheAware(cfg, kv_index)
    raise ValueError(f"unknown routing policy {cfg.policy!r}; choose one of {', '.join(POLICIES)}")
