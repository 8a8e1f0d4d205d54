"""One radix tree over characters for every worker: which worker has seen which prompt prefix.

The approximate ``cache_aware`` policy cannot see a worker's prefix cache, so it remembers what
it routed there: each node is an edge label (a run of characters) plus, per worker that was sent
a prompt running through it, when that was (a logical clock, so order is exact and tests are
deterministic). One tree shared by all workers keeps a common prefix stored once however many
workers saw it.

Invariants, which matching and eviction rely on:

- A worker holding a node holds all its ancestors (inserting touches the whole path; eviction
  takes only a worker's leaves; forgetting takes a worker from every node).
- A node's stamp for a worker is >= the stamps of its children for that worker, because
  touching a child touches its parents in the same insert. So the worker's oldest stamp, ties
  broken deepest first, is always one of its leaves: a lazy min-heap per worker finds LRU
  leaves without scanning the tree.
- A node no worker holds has no children and is unlinked.

Per worker, ``chars`` counts the characters of the edges it holds — its share of the tree —
and eviction keeps it <= ``max_chars``, least recently used leaves first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

_HeapEntry = tuple[int, int, int, "_Node"]  # (stamp, -end depth, node id, node)
_node_ids = itertools.count()  # heap tie-breaker: nodes themselves do not compare


class _Node:
    __slots__ = ("label", "parent", "children", "stamps", "depth", "id")

    def __init__(self, label: str, parent: _Node | None, depth: int) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's label -> child
        self.stamps: dict[str, int] = {}  # worker url -> last time a prompt through here went there
        self.depth = depth  # characters from the root to the end of this node's label
        self.id = next(_node_ids)

    def held_below(self, worker: str) -> bool:
        return any(worker in c.stamps for c in self.children.values())


def _shared_length(label: str, text: str, pos: int) -> int:
    """How many leading characters of ``label`` ``text`` has at ``pos``. Prompts run to tens
    of thousands of characters, so comparisons stay in C: one ``startswith`` for the usual
    whole-edge match, a binary search of them on the one edge where the prompt diverges."""
    if text.startswith(label, pos):
        return len(label)
    low, high = 0, min(len(label), len(text) - pos)  # text matches label[:low]; not past high
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(label[:mid], pos):
            low = mid
        else:
            high = mid - 1
    return low


class PrefixTree:
    """The routed text of every worker, with per-worker LRU eviction."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._root = _Node("", None, 0)
        self._clock = 0
        self._chars: dict[str, int] = {}
        self._heaps: dict[str, list[_HeapEntry]] = {}
        self._live: dict[str, int] = {}  # nodes a worker holds, to bound its heap's stale entries

    def chars(self, worker: str) -> int:
        return self._chars.get(worker, 0)

    def total_chars(self) -> int:
        return sum(self._chars.values())

    def workers(self) -> set[str]:
        return set(self._chars)

    def match(self, text: str) -> dict[str, int]:
        """Per worker, how many leading characters of ``text`` it has seen (a prompt diverging
        inside an edge counts the part of the edge it shares)."""
        out: dict[str, int] = {}
        for node, shared in self._walk(text):
            for worker in node.stamps:
                out[worker] = node.depth - len(node.label) + shared
        return out

    def _walk(self, text: str) -> Iterator[tuple[_Node, int]]:
        """The nodes along ``text``'s path and how much of each label it shares."""
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                return
            shared = _shared_length(child.label, text, pos)
            yield child, shared
            if shared < len(child.label):
                return
            node, pos = child, pos + shared

    def insert(self, text: str, worker: str) -> int:
        """Record that ``text`` went to ``worker``; returns how many of its leading characters
        the worker had already seen (the hit estimate's numerator). Evicts past ``max_chars``."""
        self._clock += 1
        seen, node, pos = 0, self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = self._add_child(node, text[pos:])
            shared = _shared_length(child.label, text, pos)
            if shared < len(child.label):
                child = self._split(child, shared)
            if worker in child.stamps:
                seen = child.depth
            self._touch(child, worker)
            node, pos = child, pos + shared
        self._evict(worker)
        return seen

    def _add_child(self, parent: _Node, label: str) -> _Node:
        child = _Node(label, parent, parent.depth + len(label))
        parent.children[label[0]] = child
        return child

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s label after ``at`` characters; the new upper node is returned. It
        takes the node's holders and stamps, so chars and the stamp order stay as they were."""
        assert node.parent is not None and 0 < at < len(node.label)
        upper = _Node(node.label[:at], node.parent, node.depth - len(node.label) + at)
        node.parent.children[upper.label[0]] = upper
        node.label = node.label[at:]
        node.parent = upper
        upper.children[node.label[0]] = node
        upper.stamps = dict(node.stamps)
        for worker, stamp in upper.stamps.items():
            self._live[worker] += 1
            self._push(worker, stamp, upper)
        return upper

    def _touch(self, node: _Node, worker: str) -> None:
        if worker not in node.stamps:
            self._chars[worker] = self._chars.get(worker, 0) + len(node.label)
            self._live[worker] = self._live.get(worker, 0) + 1
        node.stamps[worker] = self._clock
        self._push(worker, self._clock, node)

    def _push(self, worker: str, stamp: int, node: _Node) -> None:
        heap = self._heaps.setdefault(worker, [])
        heapq.heappush(heap, (stamp, -node.depth, node.id, node))
        if len(heap) > 4 * self._live.get(worker, 0) + 64:
            self._rebuild_heap(worker)

    def _rebuild_heap(self, worker: str) -> None:
        """Drop stale entries (a node touched again leaves its old entry behind)."""
        heap = [(n.stamps[worker], -n.depth, n.id, n) for n in self._held_by(worker)]
        heapq.heapify(heap)
        self._heaps[worker] = heap

    def _held_by(self, worker: str) -> Iterator[_Node]:
        stack = [c for c in self._root.children.values() if worker in c.stamps]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(c for c in node.children.values() if worker in c.stamps)

    def _evict(self, worker: str) -> None:
        """The worker's least recently used leaves go until it fits ``max_chars``."""
        heap = self._heaps.get(worker, [])
        while self._chars.get(worker, 0) > self.max_chars and heap:
            stamp, _, _, node = heapq.heappop(heap)
            if node.stamps.get(worker) != stamp or node.held_below(worker):
                continue  # stale: touched again since, or a split moved it (see the invariants)
            self._release(node, worker)

    def _release(self, node: _Node, worker: str) -> None:
        del node.stamps[worker]
        self._chars[worker] -= len(node.label)
        self._live[worker] -= 1
        if not node.stamps and not node.children and node.parent is not None:
            del node.parent.children[node.label[0]]
            node.parent = None

    def forget(self, worker: str) -> None:
        """The worker left: it holds nothing any more."""
        for node in sorted(self._held_by(worker), key=lambda n: -n.depth):
            self._release(node, worker)
        self._chars.pop(worker, None)
        self._heaps.pop(worker, None)
        self._live.pop(worker, None)
