"""KV transfer between a prefill and a decode manager in one process, over a real
bootstrap server: data bit for bit, metadata, aborts, timeouts, failure injection,
pairing refusals, duplicate rooms, stray messages, and leak-free manager cycles."""

from __future__ import annotations

import gc
import importlib.util
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import zmq

from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.transfer import (
    BootstrapServer,
    KVArgs,
    KVPoll,
    KVReceiver,
    KVSender,
    MetadataBuffers,
    MetadataRecord,
    TransferConfig,
    create_kv_manager,
)
from tidal.transfer.common import (
    AbortRoom,
    RoomAck,
    RoomDone,
    RoomFailed,
    TransferInfo,
    encode_msg,
    http_json,
)

pytestmark = pytest.mark.timeout(60)

LAYERS, HEADS, HEAD_DIM, POOL_TOKENS = 2, 2, 8, 1024
FAST = TransferConfig(bootstrap_timeout=10, waiting_timeout=10, heartbeat_interval=0.2, abort_grace=2,
                      transfer_threads=2)
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def have(pkg: str) -> bool:
    return importlib.util.find_spec(pkg) is not None


REAL_BACKENDS = [
    "shm",
    "tcp",
    pytest.param("mooncake", marks=pytest.mark.skipif(not have("mooncake"), reason="mooncake not installed")),
    pytest.param("nixl", marks=pytest.mark.skipif(not have("nixl"), reason="nixl not installed")),
]


# ---------------------------------------------------------------- helpers


def make_pool(page_size: int, shm: bool = False, fill: bool = False, dtype=torch.float16) -> MHATokenToKVPool:
    name = f"tidal_test_{os.getpid()}_{uuid.uuid4().hex[:8]}" if shm else None
    pool = MHATokenToKVPool(POOL_TOKENS, page_size, dtype, LAYERS, HEADS, HEAD_DIM, shm_name=name)
    if fill:
        gen = torch.Generator().manual_seed(0)
        for buf in pool.k_buffer + pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    return pool


def num_pages(pool: MHATokenToKVPool) -> int:
    return pool.k_buffer[0].shape[0] // pool.page_size


def pages_of(buf: torch.Tensor, ps: int) -> torch.Tensor:
    return buf[: (buf.shape[0] // ps) * ps].view(-1, ps, *buf.shape[1:])


class Pair:
    """A bootstrap server, a prefill and a decode manager of one backend."""

    def __init__(self, backend: str, page_size: int, config: TransferConfig | None = FAST,
                 decode_page_size: int | None = None, decode_dtype: str = "float16",
                 server: BootstrapServer | None = None, fill: bool = True):
        self.backend = backend
        self.page_size = page_size
        self.own_server = server is None
        self.server = server or BootstrapServer("127.0.0.1", 0)
        if self.own_server:
            self.server.start()
        self.addr = f"127.0.0.1:{self.server.port}"
        dps = decode_page_size or page_size
        self.ppool = make_pool(page_size, fill=fill)
        self.dpool = make_pool(dps, shm=backend == "shm")
        self.prefill = create_kv_manager(backend, KVArgs(0, self.ppool, MetadataBuffers(16), page_size, "float16"),
                                         "prefill", self.server.port, config)
        self.decode = create_kv_manager(backend, KVArgs(0, self.dpool, MetadataBuffers(16), dps, decode_dtype),
                                        "decode", None, config)

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()
        self.dpool.close()
        if self.own_server:
            self.server.stop()


@pytest.fixture
def pairs():
    made: list[Pair] = []

    def make(*a, **kw) -> Pair:
        made.append(Pair(*a, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


@dataclass
class Req:
    room: int
    src: np.ndarray
    dst: np.ndarray
    chunks: list[np.ndarray]
    sender: KVSender
    receiver: KVReceiver
    pmeta: int = -1
    dmeta: int = -1
    sent_chunks: int = 0
    record: MetadataRecord | None = None


def make_reqs(pair: Pair, n: int, rng: random.Random) -> list[Req]:
    free_src = list(range(1, num_pages(pair.ppool)))
    free_dst = list(range(1, num_pages(pair.dpool)))
    rng.shuffle(free_src)
    rng.shuffle(free_dst)
    reqs = []
    for _ in range(n):
        k = rng.randint(1, 12)
        src = np.array(sorted(free_src[:k]) if rng.random() < 0.5 else free_src[:k], dtype=np.int64)
        dst = np.array(free_dst[:k], dtype=np.int64)
        del free_src[:k], free_dst[:k]
        cuts = sorted(rng.randint(0, k) for _ in range(2))
        chunks = [src[: cuts[0]], src[cuts[0] : cuts[1]], src[cuts[1] :]]
        room = rng.getrandbits(63)
        reqs.append(Req(room, src, dst, chunks, KVSender(pair.prefill, pair.addr, room),
                        KVReceiver(pair.decode, pair.addr, room)))
    return reqs


def step(pair: Pair, r: Req) -> None:
    """What the prefill and decode schedulers do for one request in one loop iteration."""
    if r.dmeta < 0 and r.receiver.poll() == KVPoll.WaitingForInput:
        r.dmeta = pair.decode.args.metadata.alloc()
        r.receiver.init(r.dst, r.dmeta)
    if r.pmeta < 0 and r.sender.poll() == KVPoll.WaitingForInput:
        r.pmeta = pair.prefill.args.metadata.alloc()
        r.record = MetadataRecord(output_id=r.room % 1000, cached_tokens=len(r.src), logprob=-0.25,
                                  top_logprobs_val=[-0.25, -1.5], top_logprobs_idx=[r.room % 1000, 7],
                                  bootstrap_room=r.room)
        pair.prefill.args.metadata.set(r.pmeta, r.record)
        r.sender.init(len(r.src), r.pmeta)
    elif r.pmeta >= 0 and r.sent_chunks < len(r.chunks):
        last = r.sent_chunks == len(r.chunks) - 1
        r.sender.send(r.chunks[r.sent_chunks], is_last=last)
        r.sent_chunks += 1


def wait_for(pred, timeout: float = 10.0, tick=None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def both_done(r: Req) -> bool:
    return r.sender.poll() in TERMINAL and r.receiver.poll() in TERMINAL


def run(pair: Pair, reqs: list[Req], timeout: float = 15.0) -> None:
    ok = wait_for(lambda: all(both_done(r) for r in reqs), timeout,
                  tick=lambda: [step(pair, r) for r in reqs])
    assert ok, [(r.sender.poll(), r.receiver.poll()) for r in reqs]


def assert_landed(pair: Pair, r: Req) -> None:
    assert r.sender.poll() == KVPoll.Success, r.sender.failure_exception()
    assert r.receiver.poll() == KVPoll.Success, r.receiver.failure_exception()
    ps = pair.page_size
    for d, p in zip(pair.dpool.k_buffer + pair.dpool.v_buffer, pair.ppool.k_buffer + pair.ppool.v_buffer, strict=True):
        assert torch.equal(pages_of(d, ps)[r.dst], pages_of(p, ps)[r.src])
    assert pair.decode.args.metadata.get(r.dmeta) == r.record


def bootstrapped(pair: Pair, r: Req) -> None:
    assert wait_for(lambda: r.receiver.poll() == KVPoll.WaitingForInput), r.receiver.failure_exception()


# ---------------------------------------------------------------- transfers


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_concurrent_chunked_transfers_are_bit_exact(pairs, backend, page_size):
    pair = pairs(backend, page_size)
    reqs = make_reqs(pair, 6, random.Random(page_size))
    run(pair, reqs)
    for r in reqs:
        assert_landed(pair, r)
    pstats, dstats = pair.prefill.stats(), pair.decode.stats()
    expect = sum(len(r.src) for r in reqs) * pair.ppool.bytes_per_token() * page_size
    assert pstats["transferred_bytes"] == expect == dstats["transferred_bytes"]
    assert pstats["succeeded"] == dstats["succeeded"] == len(reqs)
    assert len(dstats["latencies_s"]) == len(reqs) and pstats["failed_transfers"] == 0
    assert sum(dstats["latency_histogram"].values()) == len(reqs)


def test_fake_backend_succeeds_without_moving_anything():
    pool = make_pool(4)
    meta = MetadataBuffers(4)
    prefill = create_kv_manager("fake", KVArgs(0, pool, meta, 4, "float16"), "prefill", 1)
    decode = create_kv_manager("fake", KVArgs(0, pool, meta, 4, "float16"), "decode")
    s, r = KVSender(prefill, "10.0.0.1:1", 5), KVReceiver(decode, "10.0.0.1:1", 5)
    assert s.poll() == r.poll() == KVPoll.WaitingForInput
    idx = meta.alloc()
    r.init(np.array([1, 2]), idx)
    s.init(2, 0)
    s.send(np.array([1]), False)
    assert s.poll() == KVPoll.WaitingForInput
    s.send(np.array([2]), True)
    assert s.poll() == r.poll() == KVPoll.Success
    assert meta.get(idx).bootstrap_room == 5
    assert prefill.stats()["succeeded"] == 1
    prefill.shutdown()
    decode.shutdown()


def test_fake_host_needs_no_network(pairs):
    pair = pairs("tcp", 4)
    s, r = KVSender(pair.prefill, "2.2.2.2:8998", 9), KVReceiver(pair.decode, "2.2.2.2:8998", 9)
    r.init(np.array([3]), pair.decode.args.metadata.alloc())
    s.init(1, 0)
    s.send(np.array([3]), True)
    assert s.poll() == r.poll() == KVPoll.Success
    assert s.failure_exception() is None


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_abort_fails_both_sides(pairs, backend, side):
    pair = pairs(backend, 4)
    (r,) = make_reqs(pair, 1, random.Random(1))
    bootstrapped(pair, r)
    step(pair, r)  # decode init
    assert wait_for(lambda: r.sender.poll() == KVPoll.WaitingForInput)
    (r.sender if side == "prefill" else r.receiver).abort()
    assert wait_for(lambda: both_done(r), 5)
    assert r.sender.poll() == r.receiver.poll() == KVPoll.Failed
    assert "abort" in str(r.sender.failure_exception()) and "abort" in str(r.receiver.failure_exception())


def test_abort_before_prefill_request_arrives(pairs):
    pair = pairs("tcp", 4)
    room = 77
    r = KVReceiver(pair.decode, pair.addr, room)
    assert wait_for(lambda: r.poll() == KVPoll.WaitingForInput)
    r.abort()
    assert r.poll() == KVPoll.Failed
    time.sleep(0.1)  # the abort reaches prefill before its request does
    s = KVSender(pair.prefill, pair.addr, room)
    assert s.poll() == KVPoll.Failed and "aborted by decode" in str(s.failure_exception())


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_abort_while_the_prefill_is_looked_up_still_reaches_it(pairs, backend):
    """A decode room aborted before its prefill's address has resolved tells that prefill once it has: the
    prefill fails the room at once, not at its bootstrap timeout (10 s here, 30 s by default)."""
    pair = pairs(backend, 4)
    room = 78
    s = KVSender(pair.prefill, pair.addr, room)  # the router sends the request to both sides at once
    r = KVReceiver(pair.decode, pair.addr, room)
    assert r.poll() == KVPoll.Bootstrapping  # the lookup runs on the bootstrap client's thread
    r.abort()
    assert r.poll() == KVPoll.Failed
    assert wait_for(lambda: s.poll() == KVPoll.Failed, 5)
    assert "aborted by decode" in str(s.failure_exception())


def test_bootstrap_timeouts(pairs, monkeypatch):
    monkeypatch.setenv("TIDAL_DISAGG_BOOTSTRAP_TIMEOUT", "0.3")
    pair = pairs("tcp", 4, config=None)
    s = KVSender(pair.prefill, pair.addr, 1)  # no decode ever comes
    closed = BootstrapServer("127.0.0.1", 0)
    closed.start()
    dead_addr = f"127.0.0.1:{closed.port}"
    closed.stop()
    r = KVReceiver(pair.decode, dead_addr, 2)  # nothing listens there
    assert wait_for(lambda: s.poll() == KVPoll.Failed and r.poll() == KVPoll.Failed, 5)
    assert "bootstrap timeout" in str(s.failure_exception())
    assert "bootstrap timeout" in str(r.failure_exception()) and "unreachable" in str(r.failure_exception())
    assert pair.prefill.stats()["failed_bootstraps"] == 1 and pair.decode.stats()["failed_bootstraps"] == 1


def test_a_room_decode_never_preallocates_fails_on_both_sides_at_the_bootstrap_deadline(pairs, monkeypatch):
    """A decode server whose KV pool stays full never inits the room: before, the request sat in its prealloc
    queue for good (no init, so no waiting timeout) while its prefill had long given up."""
    monkeypatch.setenv("TIDAL_DISAGG_BOOTSTRAP_TIMEOUT", "1.0")
    pair = pairs("tcp", 4, config=None)
    (r,) = make_reqs(pair, 1, random.Random(4))
    bootstrapped(pair, r)
    started = time.monotonic()
    assert wait_for(lambda: both_done(r), 5)
    assert r.receiver.poll() == r.sender.poll() == KVPoll.Failed
    assert "no KV room" in str(r.receiver.failure_exception()), r.receiver.failure_exception()
    assert time.monotonic() - started < 2.0


def test_waiting_timeout(pairs, monkeypatch):
    monkeypatch.setenv("TIDAL_DISAGG_WAITING_TIMEOUT", "0.3")
    pair = pairs("tcp", 4, config=None)
    (r,) = make_reqs(pair, 1, random.Random(2))
    bootstrapped(pair, r)
    step(pair, r)  # decode init; prefill gets its destination but never sends
    assert wait_for(lambda: r.sender.poll() == KVPoll.WaitingForInput)
    r.sender.init(len(r.src), 0)
    assert wait_for(lambda: both_done(r), 5)
    assert r.receiver.poll() == r.sender.poll() == KVPoll.Failed
    assert "waiting timeout" in str(r.receiver.failure_exception())
    assert pair.decode.stats()["failed_transfers"] == 1


def test_failure_injection(pairs, monkeypatch):
    monkeypatch.setenv("DISAGGREGATION_TEST_FAILURE_PROB", "1.0")
    pair = pairs("shm", 4, config=None)
    reqs = make_reqs(pair, 3, random.Random(3))
    run(pair, reqs, timeout=8)
    for r in reqs:
        assert r.sender.poll() == r.receiver.poll() == KVPoll.Failed
        reasons = str(r.sender.failure_exception()) + str(r.receiver.failure_exception())
        assert "injected" in reasons


@pytest.mark.parametrize("mismatch", ["page_size", "kv_dtype"])
def test_pairing_refused_on_layout_mismatch(pairs, mismatch):
    kw = {"decode_page_size": 1} if mismatch == "page_size" else {"decode_dtype": "bfloat16"}
    pair = pairs("tcp", 16, **kw)
    r = KVReceiver(pair.decode, pair.addr, 5)
    assert wait_for(lambda: r.poll() == KVPoll.Failed, 5)
    reason = str(r.failure_exception())
    assert "refusing to pair" in reason and mismatch.replace("_", " ") in reason


def test_page_count_mismatch_fails_clearly(pairs):
    pair = pairs("tcp", 4)
    (r,) = make_reqs(pair, 1, random.Random(4))
    bootstrapped(pair, r)
    step(pair, r)
    assert wait_for(lambda: r.sender.poll() == KVPoll.WaitingForInput)
    r.sender.init(len(r.src) + 1, 0)
    assert r.sender.poll() == KVPoll.Failed and "page count mismatch" in str(r.sender.failure_exception())
    assert wait_for(lambda: r.receiver.poll() == KVPoll.Failed, 5)


def test_prefill_shutdown_fails_the_partner(pairs):
    pair = pairs("shm", 4)
    (r,) = make_reqs(pair, 1, random.Random(5))
    bootstrapped(pair, r)
    step(pair, r)
    assert wait_for(lambda: r.sender.poll() == KVPoll.WaitingForInput)
    pair.prefill.shutdown()
    assert r.sender.poll() == KVPoll.Failed
    assert wait_for(lambda: r.receiver.poll() == KVPoll.Failed, 5)
    assert "shut down" in str(r.receiver.failure_exception())


def test_heartbeats_reach_the_bootstrap_server_and_detect_a_gone_prefill(pairs):
    pair = pairs("tcp", 4)
    (r,) = make_reqs(pair, 1, random.Random(6))
    run(pair, [r])
    assert wait_for(lambda: pair.decode.id in pair.server.decode_peers(), 3)
    r2 = KVReceiver(pair.decode, pair.addr, 4242)
    bootstrapped(pair, Req(0, r.src, r.dst, [], r.sender, r2))
    # the prefill rank leaves the bootstrap server while its process stays silent: only a heartbeat can notice
    query = f"/route?engine_rank=0&target_dp_group=0&target_pp_rank=0&prefill_id={pair.prefill.id}"
    assert http_json("DELETE", pair.addr, query)[0] == 200
    assert wait_for(lambda: r2.poll() == KVPoll.Failed, 5)
    assert "no longer registered" in str(r2.failure_exception())


def test_a_room_sent_to_a_prefill_that_left_goes_to_the_one_registered_after_it(pairs):
    """A server that leaves prefill and comes back within a few heartbeats registers anew
    (new id, new inbox) while decode still caches the old one: a room routed to it meanwhile
    reaches only the stale inbox, and the next heartbeat moves it to the new one, not fails it."""
    pair = pairs("tcp", 4)
    (r,) = make_reqs(pair, 1, random.Random(7))
    run(pair, [r])
    client = pair.decode._decode.client
    client._next_heartbeat = float("inf")  # no heartbeat until the room is on the stale target
    old_id = pair.prefill.id
    pair.prefill.shutdown()  # drained: it held no room
    pair.prefill = create_kv_manager("tcp", KVArgs(0, pair.ppool, MetadataBuffers(16), 4, "float16"),
                                     "prefill", pair.server.port, FAST)
    (r2,) = make_reqs(pair, 1, random.Random(8))
    bootstrapped(pair, r2)
    assert [c.prefill_id for c in r2.receiver._impl._room.conns] == [old_id]
    client._next_heartbeat = 0.0
    client._wake.set()
    run(pair, [r2])
    assert_landed(pair, r2)
    assert all(c.prefill_id == pair.prefill.id for c in r2.receiver._impl._room.conns)


# ---------------------------------------------------------------- isolation


def test_duplicate_room_does_not_disturb_the_first(pairs):
    pair = pairs("tcp", 4)
    (r,) = make_reqs(pair, 1, random.Random(7))
    dup_s, dup_r = KVSender(pair.prefill, pair.addr, r.room), KVReceiver(pair.decode, pair.addr, r.room)
    assert dup_s.poll() == dup_r.poll() == KVPoll.Failed
    assert "duplicate" in str(dup_s.failure_exception()) and "duplicate" in str(dup_r.failure_exception())
    run(pair, [r])
    assert_landed(pair, r)


def test_router_retry_new_room_old_partner_times_out(pairs, monkeypatch):
    monkeypatch.setenv("TIDAL_DISAGG_BOOTSTRAP_TIMEOUT", "0.4")
    pair = pairs("tcp", 4, config=None)
    old = KVSender(pair.prefill, pair.addr, 1000)  # its decode half never came
    (r,) = make_reqs(pair, 1, random.Random(8))  # the retry, with a new room
    run(pair, [r])
    assert_landed(pair, r)
    assert wait_for(lambda: old.poll() == KVPoll.Failed, 3)
    assert "bootstrap timeout" in str(old.failure_exception())


def test_stray_and_malformed_messages_are_ignored(pairs):
    pair = pairs("tcp", 4)
    ctx = zmq.Context()
    try:
        for endpoint in (pair.prefill.endpoint, pair.decode.endpoint):
            sock = ctx.socket(zmq.PUSH)
            sock.linger = 1000
            sock.connect(endpoint)
            sock.send(b"\x00garbage")
            for msg in (RoomDone(room=5, prefill_id="nobody", metadata=b"", num_pages=1),
                        RoomFailed(room=5, prefill_id="nobody", reason="x"), RoomAck(room=5, decode_id="nobody"),
                        AbortRoom(room=5, decode_id="nobody", endpoint="tcp://127.0.0.1:1", reason="x"),
                        TransferInfo(room=5, decode_id="nobody", endpoint="tcp://127.0.0.1:1",
                                     dst_pages=b"\x01" * 8, metadata_index=0)):
                sock.send(encode_msg(msg))
            sock.close()
    finally:
        ctx.term()
    reqs = make_reqs(pair, 2, random.Random(9))
    run(pair, reqs)
    for r in reqs:
        assert_landed(pair, r)


# ---------------------------------------------------------------- lifecycle


def test_register_later_and_deregister_on_shutdown():
    server = BootstrapServer("127.0.0.1", 0)
    server.start()
    try:
        addr, topo = f"127.0.0.1:{server.port}", "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"
        manager = create_kv_manager("tcp", KVArgs(0, make_pool(4), MetadataBuffers(2), 4, "float16"), "prefill")
        assert http_json("GET", addr, topo)[0] == 503
        manager.register(server.port)
        assert http_json("GET", addr, topo) == (200, {"prefill_attn_tp_size": 1, "prefill_dp_size": 1,
                                                      "prefill_pp_size": 1, "prefill_page_size": 4,
                                                      "prefill_kv_dtype": "float16", "prefill_num_kv_heads": HEADS})
        manager.shutdown()
        assert http_json("GET", addr, topo)[0] == 503
    finally:
        server.stop()


def _usage() -> tuple[int, int, int, int]:
    gc.collect()  # earlier tests' garbage (other libraries' agents) must not come and go mid-count
    shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"tidal_test_{os.getpid()}_")]
    return (threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), len(shm))


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_manager_cycles_leak_nothing(backend):
    server = BootstrapServer("127.0.0.1", 0)
    server.start()
    try:
        def cycle(i: int) -> None:
            pair = Pair(backend, 4, server=server, fill=i % 10 == 0)
            if i % 10 == 0:
                reqs = make_reqs(pair, 1, random.Random(i))
                run(pair, reqs)
                assert_landed(pair, reqs[0])
            pair.close()

        for i in range(2):
            cycle(i)
        before = _usage()
        for i in range(50):
            cycle(i)
        assert _usage() == before
    finally:
        server.stop()
