"""The router's KV index: vLLM-format events mirrored exactly, and the ZMQ subscriber with its
replay on a sequence gap, against a real PUB socket and a real replay ROUTER stood up here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from tokenmill.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                 decode_batch, encode_batch, seq_bytes, seq_of)
from tokenmill.router.kv_index import KVEventSubscriber, KVIndex

W0, W1 = "http://w0", "http://w1"
BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int = BS,
           lora_id: int | None = None, medium: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=block_size, lora_id=lora_id, medium=medium)


def apply(index: KVIndex, url: str, *events: object) -> None:
    """Through the wire format, as a subscriber would."""
    batch = KVEventBatch(ts=time.time(), events=list(events))  # type: ignore[arg-type]
    index.apply(url, decode_batch(encode_batch(batch)))


PROMPT = list(range(1000, 1016))  # four blocks of four


def test_stored_blocks_match_whole_block_prefixes() -> None:
    index = KVIndex()
    apply(index, W0, stored([1, 2, 3], None, PROMPT[:12]))
    assert index.match(PROMPT) == {W0: 12}
    assert index.match(PROMPT[:11]) == {W0: 8}  # a partial block never matches
    assert index.match(PROMPT[:5] + [0] * 11) == {W0: 4}
    assert index.match([7] + PROMPT[1:]) == {W0: 0}
    assert index.match([]) == {W0: 0}


def test_a_chain_continues_across_events_through_the_parent_hash() -> None:
    index = KVIndex()
    apply(index, W0, stored([1], None, PROMPT[:4]))
    apply(index, W0, stored([2, 3], 1, PROMPT[4:12]))
    apply(index, W0, stored([4], 3, PROMPT[12:16]))
    assert index.match(PROMPT + [5]) == {W0: 16}
    assert index.blocks(W0) == 4


def test_the_same_tokens_under_another_prefix_do_not_match() -> None:
    index = KVIndex()
    other_root = [9, 9, 9, 9]
    apply(index, W0, stored([1, 2], None, other_root + PROMPT[4:8]))
    # The second block's tokens equal the prompt's second block, but its prefix differs.
    assert index.match(PROMPT) == {W0: 0}
    assert index.match(other_root + PROMPT[4:8]) == {W0: 8}


def test_removed_blocks_cut_the_match() -> None:
    index = KVIndex()
    apply(index, W0, stored([1, 2, 3, 4], None, PROMPT))
    apply(index, W0, BlockRemoved(block_hashes=[3], medium=None))
    assert index.match(PROMPT) == {W0: 8}
    apply(index, W0, BlockRemoved(block_hashes=[1, 2, 4, 77], medium=None))  # 77: never stored
    assert index.match(PROMPT) == {W0: 0} and index.blocks(W0) == 0


def test_all_blocks_cleared_empties_the_worker_but_keeps_it_known() -> None:
    index = KVIndex()
    apply(index, W0, stored([1, 2], None, PROMPT[:8]))
    apply(index, W1, stored([1, 2], None, PROMPT[:8]))
    apply(index, W0, AllBlocksCleared())
    assert index.match(PROMPT) == {W0: 0, W1: 8}
    assert index.workers() == {W0, W1}
    apply(index, W0, stored([5], None, PROMPT[:4]))  # events after a flush still count
    assert index.match(PROMPT)[W0] == 4


def test_a_block_whose_parent_is_unknown_never_matches() -> None:
    """The router joined late: the parent was stored before it listened."""
    index = KVIndex()
    apply(index, W0, stored([2, 3], 1, PROMPT[4:12]))  # parent 1 never seen
    apply(index, W0, stored([4], 3, PROMPT[12:16]))  # a child of an orphan is one too
    assert index.match(PROMPT[4:12]) == {W0: 0}
    assert index.match(PROMPT) == {W0: 0}
    assert index.blocks(W0) == 0
    # The parent arriving later does not make the already-stored orphans reachable ...
    apply(index, W0, stored([1], None, PROMPT[:4]))
    assert index.match(PROMPT) == {W0: 4}
    # ... but the worker re-storing them (its next prefill of the prompt) does.
    apply(index, W0, stored([2, 3, 4], 1, PROMPT[4:16]))
    assert index.match(PROMPT) == {W0: 16}
    apply(index, W0, BlockRemoved(block_hashes=[2], medium=None))
    assert index.match(PROMPT) == {W0: 4}


def test_lora_blocks_never_serve_another_adapter_or_the_base_model() -> None:
    index = KVIndex()
    apply(index, W0, stored([1, 2], None, PROMPT[:8], lora_id=1))
    apply(index, W1, stored([1], None, PROMPT[:4]))
    assert index.match(PROMPT) == {W0: 0, W1: 4}
    assert index.match(PROMPT, adapter=1) == {W0: 8, W1: 0}
    assert index.match(PROMPT, adapter=2) == {W0: 0, W1: 0}


def test_a_lora_name_identifies_the_adapter_when_the_id_is_absent() -> None:
    index = KVIndex()
    event = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=PROMPT[:4],
                        block_size=BS, lora_id=None, medium=None)
    if "lora_name" not in BlockStored.__struct_fields__:
        pytest.skip("this kv_events has no lora_name")
    event.lora_name = "sql-adapter"  # type: ignore[attr-defined]
    apply(index, W0, event)
    assert index.match(PROMPT) == {W0: 0}
    assert index.match(PROMPT, adapter="sql-adapter") == {W0: 4}


def test_copies_on_two_mediums_are_tracked_apart() -> None:
    index = KVIndex()
    apply(index, W0, stored([1, 2], None, PROMPT[:8], medium="GPU"))
    apply(index, W0, stored([1, 2], None, PROMPT[:8], medium="CPU"))
    apply(index, W0, BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    assert index.match(PROMPT) == {W0: 8}  # still offloaded on the CPU
    apply(index, W0, stored([3], 2, PROMPT[8:12], medium="GPU"))  # parent found on CPU
    assert index.match(PROMPT) == {W0: 12}
    apply(index, W0, BlockRemoved(block_hashes=[1], medium="CPU"))
    assert index.match(PROMPT) == {W0: 0}


def test_a_block_hash_stored_again_replaces_its_old_content() -> None:
    index = KVIndex()
    apply(index, W0, stored([1], None, PROMPT[:4]))
    apply(index, W0, stored([1], None, [5, 5, 5, 5]))
    assert index.match(PROMPT) == {W0: 0} and index.match([5] * 4) == {W0: 4}
    apply(index, W0, BlockRemoved(block_hashes=[1], medium=None))
    assert index.blocks(W0) == 0


def test_workers_with_different_block_sizes() -> None:
    index = KVIndex()
    apply(index, W0, stored([1, 2], None, PROMPT[:8]))
    apply(index, W1, stored([1], None, PROMPT[:8], block_size=8))
    assert index.match(PROMPT) == {W0: 8, W1: 8}
    assert index.match(PROMPT[:7]) == {W0: 4, W1: 0}
    assert index.block_size(W1) == 8 and index.block_size("http://nobody") is None


def test_a_malformed_stored_event_is_kept_unreachable() -> None:
    index = KVIndex()
    apply(index, W0, stored([1, 2], None, PROMPT[:6]))  # two hashes, one and a half blocks
    assert index.match(PROMPT) == {W0: 4}


def test_forget_worker() -> None:
    index = KVIndex()
    apply(index, W0, stored([1], None, PROMPT[:4]))
    index.forget_worker(W0)
    assert index.workers() == set() and index.match(PROMPT) == {}


def test_concurrent_writers_and_a_reader() -> None:
    index = KVIndex()
    errors: list[BaseException] = []

    def write(url: str) -> None:
        try:
            for i in range(300):
                apply(index, url, stored([i], None, [i] * BS))
                apply(index, url, BlockRemoved(block_hashes=[i - 1], medium=None))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(u,)) for u in (W0, W1)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        index.match([1] * BS)
    assert not errors
    assert index.match([299] * BS) == {W0: 4, W1: 4} and index.blocks(W0) == 1


# ----- the subscriber against a real publisher --------------------------------------------------

class Publisher:
    """A minimal publisher speaking the wire protocol: PUB [topic, seq, payload]; a ROUTER for
    replay answering [id, b"", seq, payload] per buffered batch from the asked seq, then an
    empty payload. ``drop`` seqs are buffered but not published (a lost message)."""

    def __init__(self, topic: str = "kv-events", replay: bool = True) -> None:
        ctx = zmq.Context.instance()
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self.seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            port = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def publish(self, *events: object, drop: bool = False, payload: bytes | None = None) -> int:
        batch = KVEventBatch(ts=time.time(), events=list(events))  # type: ignore[arg-type]
        data = payload if payload is not None else encode_batch(batch)
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, data))
        if not drop:
            self.pub.send_multipart([self.topic, seq_bytes(seq), data])
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, empty, start = self.router.recv_multipart()
            assert empty == b"" and len(start) == 8
            self.replays.append(seq_of(start))
            with self._lock:
                batches = [(s, p) for s, p in self.buffer if s >= seq_of(start)]
            for s, p in batches:
                self.router.send_multipart([client, b"", seq_bytes(s), p])
            self.router.send_multipart([client, b"", seq_bytes(2**63 - 1), b""])

    def close(self) -> None:
        self._stop.set()
        if self.replay_endpoint:
            self._thread.join(2)
            self.router.close(0)
        self.pub.close(0)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def connect(pub: Publisher, index: KVIndex, topic: str = "kv-events") -> KVEventSubscriber:
    """Publish block 1 before the subscriber exists (so only the buffer has it), start one,
    and publish empty batches until it hears one (ZMQ drops what a PUB sends before the SUB's
    subscription arrives)."""
    pub.publish(stored([1], None, PROMPT[:4]))
    sub = KVEventSubscriber(index, W0, pub.endpoint, pub.replay_endpoint, topic=topic)
    sub.start()
    wait_for(lambda: _heard(pub, sub))
    return sub


def _heard(pub: Publisher, sub: KVEventSubscriber) -> bool:
    if sub.applied:
        return True
    pub.publish()
    time.sleep(0.02)
    return False


def test_subscriber_mirrors_a_stream_and_recovers_what_it_joined_too_late_for(
        publisher: Publisher) -> None:
    index = KVIndex()
    sub = connect(publisher, index)
    try:
        # The first batch (block 1) went out before the subscription: replay brought it back.
        wait_for(lambda: index.match(PROMPT) == {W0: 4})
        assert publisher.replays[0] == 0 and sub.gaps == 0
        replays = len(publisher.replays)
        publisher.publish(stored([2], 1, PROMPT[4:8]))
        publisher.publish(stored([3], 2, PROMPT[8:12]), drop=True)  # lost on the way
        publisher.publish(stored([4], 3, PROMPT[12:16]))
        wait_for(lambda: index.match(PROMPT) == {W0: 16})
        assert len(publisher.replays) == replays + 1 and sub.gaps == 0
        publisher.publish(BlockRemoved(block_hashes=[2], medium=None))
        wait_for(lambda: index.match(PROMPT) == {W0: 4})
    finally:
        sub.close()
    assert sub._thread is not None and not sub._thread.is_alive()


def test_a_bad_payload_is_skipped_and_the_stream_goes_on(publisher: Publisher) -> None:
    index = KVIndex()
    sub = connect(publisher, index)
    try:
        publisher.publish(payload=b"\xc1 not msgpack")
        publisher.publish(payload=b"")
        publisher.publish(stored([2], 1, PROMPT[4:8]))
        wait_for(lambda: index.match(PROMPT) == {W0: 8})
        assert sub.bad_payloads == 2
    finally:
        sub.close()


def test_without_replay_a_gap_is_counted_and_skipped() -> None:
    pub = Publisher(replay=False)
    index = KVIndex()
    sub = connect(pub, index)
    try:
        assert index.match(PROMPT) == {W0: 0} and sub.gaps >= 1  # block 1 is lost for good
        pub.publish(stored([3], 2, PROMPT[8:12]), drop=True)
        seq = pub.publish(stored([9], None, [5] * 4))
        wait_for(lambda: index.match([5] * 4) == {W0: 4})
        assert sub.gaps >= 2 and sub._next_seq == seq + 1
    finally:
        sub.close()
        pub.close()


def test_a_publisher_restart_clears_the_mirror(publisher: Publisher) -> None:
    index = KVIndex()
    sub = connect(publisher, index)
    try:
        wait_for(lambda: index.match(PROMPT) == {W0: 4})
        with publisher._lock:
            publisher.seq, publisher.buffer = 0, []  # a new process: seqs from 0, empty cache
        publisher.publish(stored([7], None, [6] * 4))
        wait_for(lambda: index.match([6] * 4) == {W0: 4})
        assert index.match(PROMPT) == {W0: 0}
    finally:
        sub.close()


def test_other_topics_are_not_heard(publisher: Publisher) -> None:
    index = KVIndex()
    sub = KVEventSubscriber(index, W0, publisher.endpoint, None, topic="other")
    sub.start()
    try:
        for _ in range(20):
            publisher.publish(stored([1], None, PROMPT[:4]))
            time.sleep(0.01)
        assert sub.applied == 0 and index.workers() == set()
    finally:
        sub.close()


def test_close_is_prompt_even_when_nothing_arrives() -> None:
    sub = KVEventSubscriber(KVIndex(), W0, "tcp://127.0.0.1:9", "tcp://127.0.0.1:9")
    sub.start()
    t0 = time.monotonic()
    sub.close()
    assert time.monotonic() - t0 < 1.0
    assert sub._thread is not None and not sub._thread.is_alive()
