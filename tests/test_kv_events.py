"""KV events: the radix cache's block stored / removed / cleared log and its chained hashes, the
engine's publisher (ZMQ PUB, replay ROUTER), wire compatibility with vLLM's structs, and a real
``tokenmill serve`` whose events a subscriber mirrors exactly."""

from __future__ import annotations

import json
import random
import time

import httpx
import msgspec
import pytest
import zmq

from tests.test_engine_unit import make_engine
from tests.test_server_support import start_server, stop_server
from tokenmill import kv_events as kv
from tokenmill.cache import BlockPool, CacheIntegrityError
from tokenmill.cache.events import chain_hashes
from tokenmill.cache.radix import NullPrefixCache, RadixPrefixCache
from tokenmill.cli import build_parser, engine_options
from tokenmill.config import EngineConfig, KVEventsConfig
from tokenmill.engine.kv_publisher import KVEventPublisher, _offset, advertised
from tokenmill.params import SamplingParams

BS = 4


# ----- vLLM's wire structs, written again from its documented format (not imported) -------------

class VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockStoredNewer(VllmEvent, tag="BlockStored"):  # a later release adds lora_name
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


class VllmBatchNewer(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStoredNewer | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


VLLM_DECODERS = [msgspec.msgpack.Decoder(VllmBatch), msgspec.msgpack.Decoder(VllmBatchNewer)]


# ----- a consumer's mirror ----------------------------------------------------------------------

class Mirror:
    """What a router holds from events alone: block hash -> (parent hash, its tokens). Checks
    what a consumer relies on: a stored run continues a block it has, a removed block is held
    and no block it holds continues it."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events) -> None:
        for event in events:
            name = type(event).__struct_config__.tag
            if name == "BlockStored":
                self._stored(event)
            elif name == "BlockRemoved":
                for h in event.block_hashes:
                    assert h in self.blocks, f"removed {h}, never stored"
                    del self.blocks[h]
                gone = set(event.block_hashes)
                assert not [h for h, (p, _) in self.blocks.items() if p in gone], "orphans"
            else:
                assert name == "AllBlocksCleared"
                self.blocks.clear()

    def _stored(self, event) -> None:
        parent, bs = event.parent_block_hash, event.block_size
        assert parent is None or parent in self.blocks, "stored under an unknown parent"
        assert len(event.token_ids) == len(event.block_hashes) * bs
        for i, h in enumerate(event.block_hashes):
            assert h not in self.blocks, f"block {h} stored twice"
            self.blocks[h] = (parent, tuple(event.token_ids[i * bs:(i + 1) * bs]))
            parent = h


def tree_blocks(cache: RadixPrefixCache, bs: int = BS) -> dict:
    """The cache's blocks as a mirror should hold them, hashed here from ``entries()`` (each
    node's whole path), independently of the hashes the nodes keep."""
    blocks = {}
    for salt, tokens, _ in cache.entries():
        hashes = chain_hashes(None, tokens, bs, salt)
        for i, h in enumerate(hashes):
            blocks[h] = (hashes[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs]))
    return blocks


def toks(*blocks: int) -> list[int]:
    return [b for b in blocks for _ in range(BS)]


def cache_with(num_blocks: int = 64) -> tuple[BlockPool, RadixPrefixCache]:
    pool = BlockPool(num_blocks)
    cache = RadixPrefixCache(pool, BS)
    cache.enable_events()
    return pool, cache


def put(pool: BlockPool, cache: RadixPrefixCache, tokens: list[int], salt=None) -> None:
    """Cache ``tokens`` as a finished request would (the tree keeps the only references)."""
    blocks = [pool.allocate() for _ in range(len(tokens) // BS)]
    cache.insert(tokens, blocks, salt)
    for b in blocks:
        pool.free(b)


# ----- the cache's log --------------------------------------------------------------------------

def test_insert_logs_one_chained_run_per_new_leaf():
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2, 3))
    (first,) = cache.take_events()
    assert first.parent_block_hash is None and first.block_size == BS
    assert first.token_ids == toks(1, 2, 3) and len(first.block_hashes) == 3
    put(pool, cache, toks(1, 2, 4, 5))  # shares two blocks: only the new run is stored
    (second,) = cache.take_events()
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == toks(4, 5)
    assert second.block_hashes == list(chain_hashes(None, toks(1, 2, 4, 5), BS)[2:])
    put(pool, cache, toks(1, 2))  # already cached: nothing new
    assert cache.take_events() == []


def test_split_keeps_every_hash_and_logs_nothing():
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2, 3))
    mirror = Mirror()
    mirror.apply(cache.take_events())
    handle = cache.match(toks(1, 2, 9))
    cache.lock(handle)  # splits [1 2 3] into [1 2] + [3]
    put(pool, cache, toks(1, 7))  # splits [1 2] again
    mirror.apply(cache.take_events())
    assert len(cache.entries()) == 4
    assert mirror.blocks == tree_blocks(cache)
    cache.references()  # the integrity check counts hashes per node too
    cache.unlock(handle)


def test_evict_logs_the_leaf_removed():
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    put(pool, cache, toks(1, 3))
    mirror = Mirror()
    mirror.apply(cache.take_events())
    stored = set(mirror.blocks)
    cache.evict(1)  # least recently used leaf: [2] under [1]
    (removed,) = cache.take_events()
    assert removed.block_hashes == [chain_hashes(None, toks(1, 2), BS)[1]]
    mirror.apply([removed])
    assert set(mirror.blocks) == stored - set(removed.block_hashes) == set(tree_blocks(cache))


def test_flush_logs_all_cleared_and_a_partial_flush_the_removals():
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    put(pool, cache, toks(5, 6))
    mirror = Mirror()
    mirror.apply(cache.take_events())
    handle = cache.match(toks(5, 6, 7))
    cache.lock(handle)  # in use: a flush keeps it
    cache.flush()
    events = cache.take_events()
    assert [type(e) for e in events] == [kv.BlockRemoved]
    mirror.apply(events)
    assert mirror.blocks == tree_blocks(cache) and mirror.blocks
    cache.unlock(handle)
    put(pool, cache, toks(8))
    cache.flush()
    events = cache.take_events()
    assert [type(e) for e in events] == [kv.BlockStored, kv.AllBlocksCleared]
    mirror.apply(events)
    assert mirror.blocks == {} == tree_blocks(cache)


def test_salts_and_parents_separate_hashes():
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    put(pool, cache, toks(1, 2), salt="tenant-a")
    put(pool, cache, toks(2))
    a, b, c = cache.take_events()
    assert a.token_ids == b.token_ids and not set(a.block_hashes) & set(b.block_hashes)
    assert c.block_hashes[0] != a.block_hashes[1]  # block [2] at the root, not under [1]
    assert chain_hashes(None, toks(1, 2), BS, "tenant-a") == tuple(b.block_hashes)


def test_events_off_by_default_cost_nothing():
    pool = BlockPool(16)
    cache = RadixPrefixCache(pool, BS)
    put(pool, cache, toks(1, 2, 3))
    cache.lock(cache.match(toks(1, 9)))
    cache.flush()
    assert cache.take_events() == []
    assert all(node.hashes == () for node in cache._nodes())
    assert NullPrefixCache().take_events() == []
    with pytest.raises(CacheIntegrityError, match="empty"):
        cache.enable_events()  # blocks cached before would have no hash


@pytest.mark.parametrize("seed", range(6))
def test_random_inserts_and_evictions_mirror_the_tree(seed):
    """Random inserts (shared prefixes, two salts), locks, evictions and flushes: a mirror fed
    only the events equals the tree's blocks after every operation."""
    rng = random.Random(seed)
    pool, cache = cache_with(num_blocks=40)
    mirror, locked = Mirror(), []
    for _ in range(300):
        op = rng.random()
        if op < 0.55:
            tokens = toks(*[rng.randrange(3) for _ in range(rng.randint(1, 6))])
            salt = rng.choice([None, None, "s"])
            need = len(tokens) // BS
            if pool.num_free_blocks < need:
                cache.evict(need - pool.num_free_blocks)
            if pool.num_free_blocks >= need:
                put(pool, cache, tokens, salt)
        elif op < 0.7:
            handle = cache.match(toks(*[rng.randrange(3) for _ in range(4)]))
            cache.lock(handle)
            locked.append(handle)
        elif op < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.97:
            cache.evict(rng.randint(1, 4))
        else:
            cache.flush()
        mirror.apply(cache.take_events())
        assert mirror.blocks == tree_blocks(cache)
        cache.references()


# ----- the engine drains the log once per step --------------------------------------------------

class RecordingPublisher:
    def __init__(self) -> None:
        self.batches: list[list] = []
        self.closed = False

    def publish(self, events) -> None:
        self.batches.append(list(events))

    def close(self) -> None:
        self.closed = True


def test_engine_publishes_once_per_step_and_on_flush_abort_shutdown():
    engine = make_engine(num_blocks=24, block_size=BS, budget=32, max_seqs=4)
    cache = engine.scheduler.block_manager.prefix_cache
    cache.enable_events()
    engine.kv_publisher = publisher = RecordingPublisher()
    mirror, rng = Mirror(), random.Random(0)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(24):  # shared prefixes, and more blocks than the pool: evictions
        prefix = [10 + rng.randrange(3)] * 8
        engine.add_request(f"r{i}", prefix + [20 + i] * rng.randint(1, 9), params)
        while engine.has_unfinished_requests() and rng.random() < 0.8:
            steps = len(publisher.batches)
            engine.step()
            assert len(publisher.batches) - steps <= 1  # one batch per step at most
            for batch in publisher.batches[steps:]:
                mirror.apply(batch)
            assert mirror.blocks == tree_blocks(cache)
    engine.add_request("gone", [30] * 12, params)
    engine.step()
    engine.abort_request("gone")  # its blocks reach the cache: published without a step
    while engine.has_unfinished_requests():
        engine.step()
    for batch in publisher.batches:
        assert batch  # no empty batches
    mirror = Mirror()
    for batch in publisher.batches:
        mirror.apply(batch)
    assert mirror.blocks == tree_blocks(cache) and mirror.blocks
    assert any(type(e) is kv.BlockRemoved for b in publisher.batches for e in b)
    engine.flush_prefix_cache()
    assert [type(e) for e in publisher.batches[-1]] == [kv.AllBlocksCleared]
    engine.shutdown()
    assert publisher.closed


# ----- wire format ------------------------------------------------------------------------------

def test_vllm_structs_read_tokenmills_batches_and_tokenmill_reads_vllms():
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    cache.evict(1)
    cache.flush()
    events = cache.take_events()
    payload = kv.encode_batch(kv.KVEventBatch(1.5, events, 3))
    for decoder in VLLM_DECODERS:
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 3
        assert [type(e).__struct_config__.tag for e in batch.events] == \
            ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        assert batch.events[0].block_hashes == events[0].block_hashes
        assert batch.events[0].token_ids == toks(1, 2) and batch.events[0].lora_id is None
    theirs = VllmBatch(2.0, [VllmBlockStored([7, 8], None, toks(1, 2), BS, None, "GPU"),
                             VllmBlockRemoved([8], None), VllmAllBlocksCleared()])
    ours = kv.decode_batch(msgspec.msgpack.encode(theirs))
    assert ours.events[0] == kv.BlockStored([7, 8], None, toks(1, 2), BS, medium="GPU")
    assert ours.events[1] == kv.BlockRemoved([8]) and ours.data_parallel_rank is None


# ----- config and flag --------------------------------------------------------------------------

def test_config_takes_vllms_json_and_names_bad_keys():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:0",'
                                   ' "max_queue_size": 10}')
    assert cfg.publisher == "zmq" and cfg.publishing and cfg.topic == "kv-events"
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishing
    assert not KVEventsConfig(True, publisher="null").publishing
    with pytest.raises(ValueError, match="unknown kv events option.*endpont, topik"):
        KVEventsConfig.from_json('{"endpont": "x", "topik": "y"}')
    with pytest.raises(ValueError, match="buffer_steps must be int"):
        KVEventsConfig.from_json('{"buffer_steps": "10"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.from_json("{enable}")
    with pytest.raises(ValueError, match="zmq or null"):
        KVEventsConfig(True, publisher="kafka")
    config = EngineConfig.from_options(kv_events_config={"enable_kv_cache_events": True})
    assert config.kv_events_config.publishing
    assert not EngineConfig().kv_events_config.publishing


def test_cli_flag_parses_to_the_config_and_refuses_unknown_keys(capsys):
    args = build_parser().parse_args(
        ["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}'])
    options = engine_options(args)
    assert options["kv_events_config"] == KVEventsConfig(True, topic="t")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-events-config", '{"enabled": true}'])
    assert "unknown kv events option(s) enabled" in capsys.readouterr().err


# ----- the publisher ----------------------------------------------------------------------------

def publisher(**options) -> KVEventPublisher:
    cfg = dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
               replay_endpoint="tcp://127.0.0.1:0")
    return KVEventPublisher(KVEventsConfig(**{**cfg, **options}), BS)


def replay(endpoint: str, start: int, ctx: zmq.Context) -> list[tuple[int, bytes]]:
    """A DEALER's replay request from ``start``: (seq, payload) up to the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", kv.seq_bytes(start)])
    got = []
    try:
        while True:
            assert sock.poll(5000), "no replay answer"
            _, seq, payload = sock.recv_multipart()
            if seq == kv.END_OF_REPLAY:
                assert payload == b""
                return got
            got.append((kv.seq_of(seq), payload))
    finally:
        sock.close(linger=0)


def stored(i: int) -> list:
    return [kv.BlockStored([i], None, toks(i), BS)]


def test_publisher_sends_numbered_batches_and_replays_the_missed_ones():
    pub, ctx = publisher(buffer_steps=4, data_parallel_rank=2), zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(pub.endpoint)
    try:
        received = []
        for i in range(100):  # until the subscription is through (a PUB drops before it)
            pub.publish(stored(i))
            if sub.poll(100):
                received.append(sub.recv_multipart())
                break
        for i in range(100, 106):
            pub.publish(stored(i))
        while len(received) < 7:
            assert sub.poll(5000), "batches went missing"
            received.append(sub.recv_multipart())
        seqs = [kv.seq_of(seq) for _, seq, _ in received]
        assert seqs == list(range(seqs[0], seqs[0] + 7))
        assert {topic for topic, _, _ in received} == {b"kv-events"}
        last = kv.decode_batch(received[-1][2])
        assert last.events == stored(105) and last.data_parallel_rank == 2
        # the ring keeps the last 4 batches: a replay from before them starts where it can
        got = replay(pub.replay_endpoint, 0, ctx)
        assert [s for s, _ in got] == list(range(seqs[-1] - 3, seqs[-1] + 1))
        assert got[-1][1] == received[-1][2]
        assert [s for s, _ in replay(pub.replay_endpoint, seqs[-1], ctx)] == [seqs[-1]]
        assert replay(pub.replay_endpoint, seqs[-1] + 1, ctx) == []
    finally:
        sub.close(linger=0)
        pub.close()
        pub.close()  # idempotent


def test_publisher_replays_to_a_req_socket_and_ignores_junk():
    pub, ctx = publisher(), zmq.Context()
    pub.publish(stored(1))
    junk = ctx.socket(zmq.DEALER)
    junk.connect(pub.replay_endpoint)
    junk.send_multipart([b"", b"short"])  # not 8 bytes: ignored, the publisher goes on
    req = ctx.socket(zmq.REQ)
    req.connect(pub.replay_endpoint)
    try:
        req.send(kv.seq_bytes(0))
        assert req.poll(5000)
        seq, payload = req.recv_multipart()  # a REQ takes the first reply only
        assert kv.seq_of(seq) == 0 and kv.decode_batch(payload).events == stored(1)
    finally:
        req.close(linger=0)
        junk.close(linger=0)
        pub.close()
    pub.publish(stored(2))  # after close: dropped, never blocking the engine on a dead queue


def test_publisher_refuses_a_busy_port_by_name():
    first = publisher(endpoint="tcp://*:0")
    try:
        busy = first.endpoint.replace("0.0.0.0", "*")
        with pytest.raises(ValueError, match="cannot bind tcp://.*Address already in use"):
            publisher(endpoint=busy)
    finally:
        first.close()


def test_publisher_connects_to_a_named_host_as_vllms_does():
    """A specific host and port is a forwarder's address (vLLM's rule): connected, not bound."""
    ctx = zmq.Context()
    forwarder = ctx.socket(zmq.SUB)
    forwarder.setsockopt(zmq.SUBSCRIBE, b"")
    port = forwarder.bind_to_random_port("tcp://127.0.0.1")
    pub = publisher(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None)
    try:
        assert pub.describe()["endpoint"] == f"tcp://127.0.0.1:{port}"
        assert pub.replay_endpoint is None
        for i in range(100):
            pub.publish(stored(i))
            if forwarder.poll(100):
                break
        else:
            pytest.fail("nothing reached the forwarder")
    finally:
        forwarder.close(linger=0)
        pub.close()


def test_endpoints_for_replicas_and_for_clients():
    assert _offset("tcp://*:5557", 2) == "tcp://*:5559"
    assert _offset("tcp://*:5557", None) == _offset("tcp://*:5557", 0) == "tcp://*:5557"
    assert _offset("tcp://*:0", 3) == "tcp://*:0"
    assert _offset("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    info = {"endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://10.1.2.3:5558",
            "topic": "kv-events", "block_size": 16}
    assert advertised(info, "127.0.0.1")["endpoint"] == "tcp://127.0.0.1:5557"
    assert advertised(info, "0.0.0.0")["endpoint"] == "tcp://127.0.0.1:5557"
    assert advertised(info, "worker-3")["replay_endpoint"] == "tcp://10.1.2.3:5558"
    assert advertised(info, "::1")["endpoint"] == "tcp://[::1]:5557"
    assert advertised({**info, "replay_endpoint": None}, "h")["replay_endpoint"] is None
    assert advertised(None, "127.0.0.1") is None


# ----- a real server ----------------------------------------------------------------------------

SHARED = ("You are a careful assistant. Answer briefly and precisely, in one sentence, "
          "without any preamble or apology. Question: ")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "How many legs does a spider have?"]


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0", "topic": "kv-events"}
    server = start_server(tmp_path_factory, "--kv-events-config", json.dumps(config))
    yield server
    stop_server(server)


def receive_until(sub: zmq.Socket, mirror: Mirror, done, payloads: dict) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, "the mirror never caught up"
        if sub.poll(200):
            _, seq, payload = sub.recv_multipart()
            payloads[kv.seq_of(seq)] = payload
            for decoder in VLLM_DECODERS:  # what a vLLM consumer reads
                decoder.decode(payload)
            mirror.apply(kv.decode_batch(payload).events)


@pytest.mark.slow
def test_served_events_mirror_the_prefix_cache(kv_server):
    info = httpx.get(f"{kv_server.url}/server_info").json()["kv_events"]
    assert info["topic"] == "kv-events" and info["block_size"] == 16
    assert info["endpoint"].startswith("tcp://127.0.0.1:") and \
        info["replay_endpoint"].startswith("tcp://127.0.0.1:")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(info["endpoint"])
    time.sleep(0.5)  # a PUB sends nothing to a subscription it has not seen yet
    mirror, payloads = Mirror(), {}

    def cached() -> int:
        return httpx.get(f"{kv_server.url}/server_info").json()["kv_cache_blocks"][
            "prefix_cached"]

    try:
        for question in QUESTIONS:
            r = httpx.post(f"{kv_server.url}/v1/completions", timeout=120,
                           json={"prompt": SHARED + question, "max_tokens": 4,
                                 "temperature": 0})
            assert r.status_code == 200
        receive_until(sub, mirror, lambda: mirror.blocks and len(mirror.blocks) == cached(),
                      payloads)
        ids = httpx.post(f"{kv_server.url}/tokenize",
                         json={"prompt": SHARED + QUESTIONS[0]}).json()["tokens"]
        roots = [t for p, t in mirror.blocks.values() if p is None]
        assert roots == [tuple(ids[:16])]  # one shared first block, holding the prompt's start
        # a subscriber that missed everything asks the replay socket from seq 0
        replayed = replay(info["replay_endpoint"], 0, ctx)
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert {s: p for s, p in replayed if s in payloads} == payloads
        late = Mirror()
        for _, payload in replayed:
            late.apply(kv.decode_batch(payload).events)
        assert late.blocks == mirror.blocks
        assert httpx.post(f"{kv_server.url}/flush_cache").status_code == 200
        receive_until(sub, mirror, lambda: not mirror.blocks, payloads)
        last = kv.decode_batch(payloads[max(payloads)])
        assert [type(e) for e in last.events] == [kv.AllBlocksCleared] and cached() == 0
    finally:
        sub.close(linger=0)
