"""Routing policies and the approximate prefix tree: unit tests, no model, no network."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tokenmill.kv_events import BlockStored, KVEventBatch
from tokenmill.router.config import POLICIES, RouterConfig
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.policies import (CacheAware, LeastLoad, PrefixHash, RouteKey, RoundRobin,
                                       load_imbalanced, make_policy)
from tokenmill.router.prefix_tree import PrefixTree, _Node


@dataclass
class FakeWorker:
    url: str
    in_flight: int = 0


def workers(*loads: int) -> list[FakeWorker]:
    return [FakeWorker(f"http://w{i}", load) for i, load in enumerate(loads)]


def key(text: str, model: str | None = "m", token_ids: list[int] | None = None) -> RouteKey:
    return RouteKey(model=model, text=text, token_ids=token_ids)


# ----- make_policy ------------------------------------------------------------------------------

def test_make_policy_builds_every_named_policy() -> None:
    for name in POLICIES:
        assert make_policy(RouterConfig(policy=name)).name == name


def test_an_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError) as err:
        make_policy(RouterConfig(policy="fastest"))
    assert all(name in str(err.value) for name in POLICIES)


# ----- round robin and least load ---------------------------------------------------------------

def test_round_robin_takes_each_worker_in_turn() -> None:
    pool = workers(0, 0, 0)
    policy = RoundRobin()
    assert [policy.choose(key("x"), pool).url for _ in range(7)] == \
        [w.url for w in pool * 2] + [pool[0].url]


def test_least_load_picks_the_lesser_of_the_two_it_samples() -> None:
    pool = workers(7, 2)
    policy = LeastLoad(random.Random(1))
    assert {policy.choose(key("x"), pool).url for _ in range(50)} == {"http://w1"}


def test_least_load_never_picks_the_most_loaded_and_spreads_over_the_rest() -> None:
    pool = workers(0, 5, 9, 3)
    policy = LeastLoad(random.Random(0))
    chosen = [policy.choose(key("x"), pool).url for _ in range(400)]
    assert "http://w2" not in chosen  # the maximum loses every pair it is drawn into
    assert {"http://w0", "http://w1", "http://w3"} <= set(chosen)


def test_least_load_samples_two_distinct_workers() -> None:
    class Recorder(random.Random):
        def sample(self, population, k, **kw):  # type: ignore[override]
            drawn = super().sample(population, k, **kw)
            assert k == 2 and drawn[0] is not drawn[1]
            return drawn

    pool = workers(1, 1, 1)
    LeastLoad(Recorder(3)).choose(key("x"), pool)
    assert LeastLoad(Recorder(3)).choose(key("x"), pool[:1]) is pool[0]


# ----- prefix hash ------------------------------------------------------------------------------

def _owners(policy: PrefixHash, pool: list[FakeWorker], keys: list[RouteKey]) -> list[str]:
    return [policy.choose(k, pool).url for k in keys]


def test_prefix_hash_depends_only_on_the_model_and_the_first_tokens() -> None:
    cfg = RouterConfig(policy="prefix_hash", prefix_hash_tokens=4)
    policy, pool = PrefixHash(cfg), workers(*[0] * 8)
    base = [1, 2, 3, 4]
    same = {policy.choose(key("", token_ids=base + [i]), pool).url for i in range(30)}
    assert len(same) == 1
    text = "0123456789abcdef"  # 4 tokens -> 16 characters
    assert len({policy.choose(key(text + str(i)), pool).url for i in range(30)}) == 1
    models = {policy.key_hash(key(text, model=f"m{i}")) for i in range(30)}
    assert len(models) == 30


def test_prefix_hash_is_stable_across_processes() -> None:
    """Two routers (or a restarted one) must send a prefix to the same worker: no salted hash."""
    urls = [f"http://w{i}" for i in range(5)]
    texts = [f"prompt {i} " * 20 for i in range(40)]
    script = (
        "import json, sys\n"
        "from tokenmill.router.config import RouterConfig\n"
        "from tokenmill.router.policies import PrefixHash, RouteKey\n"
        "from types import SimpleNamespace as W\n"
        "urls, texts = json.loads(sys.stdin.read())\n"
        "p = PrefixHash(RouterConfig(policy='prefix_hash'))\n"
        "pool = [W(url=u, in_flight=0) for u in urls]\n"
        "print(json.dumps([p.choose(RouteKey('m', t), pool).url for t in texts]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps([urls, texts]),
                         capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""})
    pool = [FakeWorker(u) for u in urls]
    here = _owners(PrefixHash(RouterConfig(policy="prefix_hash")), pool, [key(t) for t in texts])
    assert json.loads(out.stdout) == here
    assert len(set(here)) > 1


def test_a_worker_joining_takes_about_a_share_and_moves_nothing_else() -> None:
    policy = PrefixHash(RouterConfig(policy="prefix_hash"))
    keys = [key(f"session {i}: hello") for i in range(3000)]
    before = _owners(policy, workers(*[0] * 10), keys)
    grown = workers(*[0] * 11)
    after = _owners(policy, grown, keys)
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == grown[10].url for _, a in moved)  # only to the newcomer
    assert 0.5 / 11 < len(moved) / len(keys) < 2 / 11


def test_a_worker_leaving_moves_only_its_own_keys() -> None:
    policy = PrefixHash(RouterConfig(policy="prefix_hash"))
    keys = [key(f"user {i} asks") for i in range(3000)]
    pool = workers(*[0] * 6)
    before = _owners(policy, pool, keys)
    gone = pool.pop(2)
    policy.forget_worker(gone.url)
    after = _owners(policy, pool, keys)
    assert all(b == a for b, a in zip(before, after) if b != gone.url)
    share = before.count(gone.url) / len(keys)
    assert 0.5 / 6 < share < 2 / 6


# ----- load imbalance ---------------------------------------------------------------------------

@pytest.mark.parametrize("loads, imbalanced", [
    ((0, 33), True),     # gap 33 > 32 and 33 > 0 * 1.5
    ((0, 32), False),    # the gap must exceed the absolute threshold
    ((100, 140), False),  # gap 40 > 32 but 140 <= 100 * 1.5
    ((100, 151), True),
    ((1, 3), False),     # a ratio of 3 on tiny loads is noise
])
def test_load_is_imbalanced_only_past_both_thresholds(loads: tuple[int, int],
                                                      imbalanced: bool) -> None:
    assert load_imbalanced(workers(*loads), RouterConfig()) is imbalanced


# ----- cache aware, approximate -----------------------------------------------------------------

def test_cache_aware_follows_the_worker_that_saw_the_prefix() -> None:
    policy = CacheAware(RouterConfig())
    pool = workers(0, 0, 0)
    doc = "You are a helpful assistant. Here is a long document about routers. " * 4
    policy.on_routed(key(doc + "Q1"), pool[1])
    assert policy.choose(key(doc + "Q2, a different question"), pool) is pool[1]
    # Its in-flight count is higher but the load is not imbalanced: the cache still wins.
    pool[1].in_flight = 20
    assert policy.choose(key(doc + "Q3"), pool) is pool[1]


def test_cache_aware_switches_to_least_load_when_load_is_imbalanced() -> None:
    policy = CacheAware(RouterConfig())
    pool = workers(40, 5)
    policy.on_routed(key("shared system prompt " * 10), pool[0])
    assert policy.choose(key("shared system prompt " * 10 + "more"), pool) is pool[1]


def test_cache_aware_below_the_threshold_goes_to_the_smallest_tree() -> None:
    policy = CacheAware(RouterConfig(cache_threshold=0.5))
    pool = workers(0, 0)
    policy.on_routed(key("a" * 100), pool[0])
    policy.on_routed(key("b" * 10), pool[1])
    # 40 of 100 characters match w0: under half, so the emptier w1 gets it.
    assert policy.choose(key("a" * 40 + "c" * 60), pool) is pool[1]
    # 60 of 100: the tree wins.
    assert policy.choose(key("a" * 60 + "c" * 40), pool) is pool[0]


def test_cache_aware_ties_go_to_the_lower_in_flight() -> None:
    policy = CacheAware(RouterConfig())
    pool = workers(3, 1)
    for w in pool:
        policy.on_routed(key("common prefix " * 5), w)
    assert policy.choose(key("common prefix " * 5 + "!"), pool) is pool[1]


def test_cache_aware_spreads_new_prefixes_over_empty_workers() -> None:
    policy = CacheAware(RouterConfig())
    pool = workers(0, 0, 0)
    for i in range(3):
        k = key(f"group {i} " * 30)
        policy.on_routed(k, policy.choose(k, pool))
    assert sorted(policy.tree.chars(w.url) > 0 for w in pool) == [True] * 3


def test_cache_hit_estimate_counts_text_already_on_the_chosen_worker() -> None:
    policy = CacheAware(RouterConfig())
    pool = workers(0, 0)
    policy.on_routed(key("x" * 100), pool[0])
    policy.on_routed(key("x" * 100), pool[0])  # all of it seen
    policy.on_routed(key("x" * 50 + "y" * 50), pool[1])  # none of it on w1
    stats = policy.stats()
    assert stats["matched_chars"] == 100 and stats["total_chars"] == 300
    assert stats["cache_hit_estimate"] == pytest.approx(1 / 3)


def test_forgetting_a_worker_drops_its_tree() -> None:
    policy = CacheAware(RouterConfig())
    pool = workers(0, 0)
    policy.on_routed(key("abc" * 20), pool[0])
    policy.on_routed(key("abc" * 20), pool[1])
    policy.forget_worker(pool[0].url)
    assert policy.tree.match("abc" * 20) == {pool[1].url: 60}
    assert policy.tree.chars(pool[0].url) == 0


# ----- cache aware, exact (KV events) -----------------------------------------------------------

def _index_with(url: str, tokens: list[int], block_size: int = 4) -> KVIndex:
    index = KVIndex()
    n = len(tokens) // block_size
    event = BlockStored(block_hashes=list(range(100, 100 + n)), parent_block_hash=None,
                        token_ids=tokens[:n * block_size], block_size=block_size)
    index.apply(url, KVEventBatch(ts=0.0, events=[event]))
    return index


def test_exact_mode_needs_tokens_only_once_a_worker_published() -> None:
    index = KVIndex()
    policy = CacheAware(RouterConfig(), index)
    assert not policy.needs_tokens
    index.apply("http://w0", KVEventBatch(ts=0.0, events=[]))
    assert policy.needs_tokens
    assert not make_policy(RouterConfig(policy="cache_aware")).needs_tokens


def test_exact_mode_follows_the_cached_blocks_not_the_text() -> None:
    pool = workers(0, 0)
    tokens = list(range(32))
    policy = CacheAware(RouterConfig(), _index_with(pool[1].url, tokens))
    # The tree says w0 saw this text; the worker's own events say w1 holds the tokens.
    policy.on_routed(key("same text"), pool[0])
    routed = key("same text", token_ids=tokens + [7, 7])
    assert policy.choose(routed, pool) is pool[1]
    policy.on_routed(routed, pool[1])
    assert policy.stats()["exact_hit_tokens"] == 32


def test_the_exact_hit_figure_uses_what_was_cached_when_the_worker_was_chosen() -> None:
    """By on_routed the worker has stored the prompt; counting that would always say 100%."""
    pool = workers(0, 0)
    index = KVIndex()
    policy = CacheAware(RouterConfig(), index)
    index.apply(pool[0].url, KVEventBatch(ts=0.0, events=[]))  # a candidate publishes
    routed = key("t", token_ids=list(range(16)))
    chosen = policy.choose(routed, pool)
    index.apply(chosen.url, KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4)]))
    policy.on_routed(routed, chosen)
    stats = policy.stats()
    assert stats["exact_hit_tokens"] == 0 and stats["exact_prompt_tokens"] == 16
    assert stats["exact_hit_rate"] == 0.0


def test_exact_mode_below_the_threshold_takes_the_least_loaded() -> None:
    pool = workers(3, 0)
    tokens = list(range(40))
    policy = CacheAware(RouterConfig(cache_threshold=0.5), _index_with(pool[0].url, tokens[:8]))
    # 8 of 40 cached tokens: under half, so the cache does not decide.
    assert policy.choose(key("t", token_ids=tokens), pool) is pool[1]
    # 8 of the 8 whole blocks of a 10-token prompt (the partial last block cannot be cached).
    assert policy.choose(key("t", token_ids=tokens[:10]), pool) is pool[0]


def test_exact_mode_yields_to_imbalanced_load() -> None:
    pool = workers(50, 2)
    tokens = list(range(64))
    policy = CacheAware(RouterConfig(), _index_with(pool[0].url, tokens))
    assert policy.choose(key("t", token_ids=tokens), pool) is pool[1]


def test_events_from_a_worker_outside_the_candidates_leave_the_tree_in_charge() -> None:
    pool = workers(0, 0)
    policy = CacheAware(RouterConfig(), _index_with("http://other-model", list(range(16))))
    policy.on_routed(key("hello there " * 10), pool[1])
    routed = key("hello there " * 10 + "?", token_ids=list(range(16)))
    assert policy.choose(routed, pool) is pool[1] and routed.cached_tokens is None


def test_without_token_ids_the_tree_decides_even_with_an_index() -> None:
    pool = workers(0, 0)
    policy = CacheAware(RouterConfig(), _index_with(pool[1].url, list(range(16))))
    policy.on_routed(key("hello there " * 10), pool[0])
    assert policy.choose(key("hello there " * 10 + "?"), pool) is pool[0]


# ----- the prefix tree --------------------------------------------------------------------------

def _check_invariants(tree: PrefixTree) -> None:
    """Holders of a node hold its parent; chars are the sums of held labels; no empty leaves."""
    chars: dict[str, int] = {}
    stack: list[_Node] = [tree._root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.parent is node and child.label[0] in node.children
            assert child.depth == node.depth + len(child.label)
            assert child.stamps, "a node nobody holds must be unlinked"
            if node is not tree._root:
                assert set(child.stamps) <= set(node.stamps)
                assert all(child.stamps[w] <= node.stamps[w] for w in child.stamps)
            for w in child.stamps:
                chars[w] = chars.get(w, 0) + len(child.label)
            stack.append(child)
    assert {w: c for w, c in chars.items() if c} == {w: c for w, c in tree._chars.items() if c}


def test_tree_matches_and_splits_shared_prefixes() -> None:
    tree = PrefixTree(max_chars=1000)
    assert tree.insert("abcdef", "a") == 0
    assert tree.insert("abcxyz", "b") == 0
    assert tree.insert("abcxyq", "a") == 3
    assert tree.match("abcxyzzz") == {"a": 5, "b": 6}
    assert tree.match("abd") == {"a": 2, "b": 2}
    assert tree.match("zzz") == {}
    assert tree.chars("a") == 3 + 3 + 2 + 1  # abc, def, xy, q
    _check_invariants(tree)


def test_tree_evicts_least_recently_used_leaves_first() -> None:
    tree = PrefixTree(max_chars=12)
    tree.insert("aaaa", "w")
    tree.insert("bbbb", "w")
    tree.insert("cccc", "w")
    tree.insert("aaaa", "w")  # a is now the most recent; b the least
    tree.insert("dddd", "w")
    assert tree.chars("w") == 12
    assert "w" not in tree.match("bbbb")
    assert all(tree.match(t) == {"w": 4} for t in ("aaaa", "cccc", "dddd"))
    tree.insert("eeee", "w")  # now c is the least recently used
    assert "w" not in tree.match("cccc") and tree.match("aaaa") == {"w": 4}
    _check_invariants(tree)


def test_eviction_takes_leaves_before_the_prefix_they_share() -> None:
    tree = PrefixTree(max_chars=6)
    tree.insert("abcdef", "w")
    tree.insert("abcxyz", "w")  # 9 chars: the older leaf "def" goes, the shared "abc" stays
    assert tree.chars("w") == 6
    assert tree.match("abcdef") == {"w": 3} and tree.match("abcxyz") == {"w": 6}
    _check_invariants(tree)


def test_eviction_is_per_worker() -> None:
    tree = PrefixTree(max_chars=11)
    tree.insert("shared-xx", "a")
    tree.insert("shared-xx", "b")
    tree.insert("shared-yyyy", "a")  # a: 7 + 2 + 4 = 13 > 11, its older leaf "xx" goes
    assert tree.chars("a") == 11 and tree.chars("b") == 9
    assert tree.match("shared-xx") == {"a": 7, "b": 9}
    _check_invariants(tree)


def test_tree_random_inserts_match_a_reference_and_keep_invariants() -> None:
    rng = random.Random(7)
    tree, seen = PrefixTree(max_chars=10**9), {"w0": [], "w1": [], "w2": []}
    for _ in range(400):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
        worker = rng.choice(list(seen))
        tree.insert(text, worker)
        seen[worker].append(text)
    for _ in range(200):
        probe = "".join(rng.choice("abc") for _ in range(rng.randint(1, 14)))
        expect = {w: max(_common(probe, t) for t in texts) for w, texts in seen.items()}
        got = tree.match(probe)
        assert {w: got.get(w, 0) for w in seen} == expect
    _check_invariants(tree)


def test_tree_under_pressure_stays_within_its_cap() -> None:
    rng = random.Random(3)
    tree = PrefixTree(max_chars=200)
    for i in range(2000):
        text = rng.choice(["sys A: ", "sys B: ", ""]) + "".join(rng.choice("xyz") for _ in
                                                                range(rng.randint(5, 40)))
        tree.insert(text, f"w{i % 3}")
        assert all(tree.chars(f"w{j}") <= 200 for j in range(3))
    _check_invariants(tree)
    assert len(tree._heaps["w0"]) <= 4 * tree._live["w0"] + 64


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

