"""KV cache events (issue 66, part 2): the radix cache's BlockStored / BlockRemoved / AllBlocksCleared, the ZMQ
publisher with sequence numbers and replay, and the router-side index that follows them. The index must equal
each cache exactly after a random workload with evictions, namespaces and flushes, also when its subscriber
loses messages (replay) or joins late or falls behind the buffer (snapshot)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
import zmq

from fakes import FakeModelRunner
from servers import free_port
from tidal.config import ServerArgs
from tidal.kvcache import PagedTokenAllocator, RadixCache, ReqToTokenPool
from tidal.kvevents.events import (
    BATCH_DECODER, KVEventBatch, KVEventSink, KVEventsConfig, block_hashes, parse_kv_events_config,
)
from tidal.kvevents.publisher import ERROR_SEQ, KVEventPublisher, pack_seq, unpack_seq
from tidal.kvevents.subscriber import KVBlockIndex, WorkerSubscription
from tidal.messages import FlushCacheReq, GenerateReq
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.timeout(60)


def make_cache(ps: int, pages: int = 96) -> tuple[RadixCache, KVEventSink]:
    sink = KVEventSink(ps)
    alloc = PagedTokenAllocator(pages * ps, ps, debug=True)
    return RadixCache(ReqToTokenPool(8, 512), alloc, ps, events=sink), sink


def put(cache: RadixCache, key: list[int], namespace=None) -> None:
    aligned = len(key) // cache.page_size * cache.page_size
    if cache.allocator.available_size() < aligned:
        cache.evict(aligned - cache.allocator.available_size())
    slots = cache.allocator.alloc(aligned)
    if slots is None:
        return
    present = cache.insert(key[:aligned], slots, namespace)
    cache.allocator.free(slots[:present])


def tree_hashes(cache: RadixCache) -> set[int]:
    """Every page's hash, recomputed from the tree's own paths (what a router hashing a prompt would get)."""
    out: set[int] = set()
    stack = [(c, [], c.namespace) for c in cache.root_node.children.values()]
    while stack:
        node, path, ns = stack.pop()
        ns = node.namespace if node.namespace is not None else ns
        full = path + node.key
        out.update(block_hashes(full, cache.page_size, namespace=ns))
        stack.extend((c, full, ns) for c in node.children.values())
    return out


def random_workload(cache: RadixCache, rng: random.Random, steps: int, on_step=None) -> None:
    """Inserts of shared-prefix prompts (some under a LoRA namespace), matches that split nodes, evictions,
    a namespace dropped and flushes."""
    stems = [[rng.randrange(1, 50) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    for step in range(steps):
        op = rng.random()
        if op < 0.6:
            key = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randint(0, 30))]
            put(cache, key, rng.choice([None, None, "adapter-a"]))
        elif op < 0.75:
            cache.match_prefix(rng.choice(stems)[: rng.randint(1, 40)])  # may split a node
        elif op < 0.9:
            cache.evict(rng.randint(1, 60))
        elif op < 0.95:
            cache.drop_namespace("adapter-a")
        else:
            cache.flush()
        if on_step is not None:
            on_step(step)


@pytest.mark.parametrize("ps", [1, 4])
def test_events_applied_in_order_equal_the_cache_after_a_random_workload(ps):
    cache, sink = make_cache(ps)
    index = KVBlockIndex()
    rng = random.Random(ps)

    def check(step: int) -> None:
        index.apply("w", KVEventBatch(float(step), sink.take()))
        assert index.blocks("w") == tree_hashes(cache), f"step {step}"

    random_workload(cache, rng, 400, check)
    assert tree_hashes(cache), "the workload left something cached"
    # a prompt's matched blocks, by the index, are the cache's own match
    for _ in range(50):
        stem = [rng.randrange(1, 50) for _ in range(rng.randint(1, 60))]
        expect = cache.match_prefix(stem).device_indices.numel() // ps
        assert index.matched_blocks("w", block_hashes(stem, ps)) == expect


def test_no_sink_no_hashes():
    cache = RadixCache(ReqToTokenPool(8, 128), PagedTokenAllocator(256, 1, debug=True), 1)
    put(cache, [1, 2, 3])
    assert all(not n.hashes for n in cache._nodes())


# ---------------------------------------------------------------- over ZMQ


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def publish_workload(pub: KVEventPublisher, cache: RadixCache, sink: KVEventSink, rng, steps: int) -> None:
    def step(_: int) -> None:
        pub.publish(sink.take())
        time.sleep(0.001)

    random_workload(cache, rng, steps, step)


@pytest.mark.parametrize("buffer_steps", [10_000, 3])
def test_a_subscriber_that_loses_messages_recovers_by_replay_or_snapshot(buffer_steps):
    """Every fifth live batch is lost on the way: with a large buffer the hole is replayed; with a buffer of 3
    batches the older holes are gone and the subscriber resyncs from a snapshot. Either way its index ends equal
    to the cache. A subscriber that joins mid-stream starts from a snapshot."""
    ep, rep = endpoints()
    pub = KVEventPublisher(KVEventsConfig(publisher="zmq", endpoint=ep, replay_endpoint=rep,
                                          buffer_steps=buffer_steps, topic="kv"))
    index = KVBlockIndex()
    lossy = WorkerSubscription("w", ep, rep, index, topic="kv", drop=lambda seq: seq % 5 == 2)
    try:
        time.sleep(0.3)  # the SUB socket joins
        cache, sink = make_cache(4)
        rng = random.Random(7)
        publish_workload(pub, cache, sink, rng, 200)
        late = WorkerSubscription("late", ep, rep, index, topic="kv")
        time.sleep(0.3)
        publish_workload(pub, cache, sink, rng, 40)
        put(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # one more batch, so each subscriber sees the newest number
        pub.publish(sink.take())
        final = tree_hashes(cache)
        assert wait_until(lambda: index.blocks("w") == final and index.blocks("late") == final), \
            (len(index.blocks("w")), len(index.blocks("late")), len(final))
        assert index.synced("w") and index.synced("late")
        if buffer_steps > 100:
            assert lossy.replays > 0 and lossy.snapshots == 1  # the snapshot it joined with, no other
        else:
            assert lossy.snapshots > 1
        assert late.snapshots >= 1  # it joined mid-stream from a snapshot
        late.close()
    finally:
        lossy.close()
        pub.close()


def test_bad_replay_requests_get_an_error_and_the_publisher_keeps_serving():
    ep, rep = endpoints()
    pub = KVEventPublisher(KVEventsConfig(publisher="zmq", endpoint=ep, replay_endpoint=rep, buffer_steps=4))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rep)
    try:
        cache, sink = make_cache(1)
        for i in range(6):
            put(cache, [i + 1, 99])
            pub.publish(sink.take())
        assert wait_until(lambda: pub.next_seq == 6)

        def ask(request: bytes) -> list[tuple[int, bytes]]:
            sock.send(request)
            out = []
            while sock.poll(2000):
                seq, payload = sock.recv_multipart()
                out.append((unpack_seq(seq), payload))
                if unpack_seq(seq) in (-1, ERROR_SEQ):
                    break
            return out

        for bad in (pack_seq(0), pack_seq(99), b"nonsense", b'{"snapshot": 1}'):  # too old, future, malformed
            (reply,) = ask(bad)
            assert reply[0] == ERROR_SEQ and "error" in json.loads(reply[1]), bad
        assert json.loads(ask(pack_seq(0))[0][1])["oldest"] == 2
        good = ask(pack_seq(4))
        assert [s for s, _ in good] == [4, 5, -1]
        snapshot = ask(b'{"snapshot": true}')
        assert snapshot[0][0] == 6 and len(BATCH_DECODER.decode(snapshot[0][1]).events) == 1 + 2 * 6
    finally:
        sock.close(0)
        pub.close()


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("text,why", [
    ("{not json", "--kv-events-config"),
    ('{"publisher": "kafka"}', "kafka"),
    ('{"publisher": "zmq", "endpoint": "http://x"}', "endpoint"),
    ('{"publisher": "zmq", "colour": 1}', "colour"),
    ('{"publisher": "zmq", "buffer_steps": 0}', "buffer_steps"),
    ('{"publisher": "zmq", "endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}', "differ"),
    ("/no/such/file.json", "readable"),
])
def test_an_invalid_kv_events_config_is_refused_at_start_with_the_reason(text, why):
    with pytest.raises(ValueError, match=why):
        parse_kv_events_config(text)
    with pytest.raises(ValueError, match=why):
        ServerArgs(model_path="fake", kv_events_config=text).validate()


def test_sglang_defaults_and_star_is_the_servers_host():
    cfg = parse_kv_events_config('{"publisher": "zmq"}')
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.topic) == \
        ("tcp://*:5557", None, 10000, 100000, "")
    assert cfg.resolved("127.0.0.1").endpoint == "tcp://127.0.0.1:5557"
    assert not parse_kv_events_config('{"publisher": "null"}').enabled and parse_kv_events_config(None) is None


# ---------------------------------------------------------------- a scheduler


def test_a_schedulers_events_follow_its_radix_cache_through_requests_and_a_flush():
    ep, rep = endpoints()
    cfg = json.dumps({"publisher": "zmq", "endpoint": ep, "replay_endpoint": rep})
    args = ServerArgs(model_path="fake", page_size=4, kv_events_config=cfg)
    sched = Scheduler(args, FakeModelRunner(max_total_tokens=512, page_size=4), tokenizer=None)
    index = KVBlockIndex()
    sub = WorkerSubscription("w", sched.kv_events.info()["endpoint"], sched.kv_events.info()["replay_endpoint"],
                             index)
    try:
        rng = random.Random(3)
        stem = [rng.randrange(1, 400) for _ in range(24)]
        for i in range(6):
            prompt = stem + [rng.randrange(1, 400) for _ in range(rng.randint(1, 20))]
            sched.handle(GenerateReq(rid=f"r{i}", input_ids=prompt,
                                     sampling=SamplingParams(max_new_tokens=4, temperature=0.0)))
        for _ in range(400):
            if not sched.step() and sched.is_idle():
                break
        sched.step()  # publishes what the last pass cached
        expected = tree_hashes(sched.mem.tree_cache)
        assert expected and wait_until(lambda: index.blocks("w") == expected)
        assert index.matched_blocks("w", block_hashes(stem, 4)) == 6
        sched.handle(FlushCacheReq(call_id=1))
        sched.step()
        assert wait_until(lambda: index.blocks("w") == set())
    finally:
        sub.close()
        sched.shutdown()
