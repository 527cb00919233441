"""KV transfer between a prefill server of M TP ranks and a decode server of N (M != N),
every rank a manager of its own as in a TP server: each decode rank receives exactly its
KV heads, from only the prefill ranks that hold them, bit for bit; head maps; refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from test_transfer import FAST, REAL_BACKENDS, pages_of, wait_for
from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.transfer import (
    BootstrapServer,
    KVArgs,
    KVPoll,
    KVReceiver,
    KVSender,
    MetadataBuffers,
    MetadataRecord,
    create_kv_manager,
)
from tidal.transfer.common import http_json
from tidal.transfer.heads import HeadLayout, readers, sources

pytestmark = pytest.mark.timeout(120)

LAYERS, HEAD_DIM, SLOTS = 2, 8, 256


class Servers:
    """One prefill server of M rank managers and one decode server of N, over one bootstrap server."""

    def __init__(self, backend: str, m: int, n: int, total: int, page_size: int = 4, decode_total: int | None = None):
        self.page_size, self.total = page_size, total
        self.server = BootstrapServer("127.0.0.1", 0)
        self.server.start()
        self.addr = f"127.0.0.1:{self.server.port}"
        gen = torch.Generator().manual_seed(m * 10 + n)
        # the model's KV for every head: [layer] -> [slot, head, dim]; prefill rank r holds its heads of it
        self.full_k = [torch.randn(SLOTS + page_size, total, HEAD_DIM, generator=gen).half() for _ in range(LAYERS)]
        self.full_v = [torch.randn(SLOTS + page_size, total, HEAD_DIM, generator=gen).half() for _ in range(LAYERS)]
        self.playout, self.dlayout = HeadLayout(total, m), HeadLayout(decode_total or total, n)
        self.ppools = [self._pool(self.playout, r, fill=True) for r in range(m)]
        self.dpools = [self._pool(self.dlayout, r, shm=backend == "shm") for r in range(n)]
        self.prefill = [create_kv_manager(backend, self._args(p, r, self.playout), "prefill", self.server.port, FAST)
                        for r, p in enumerate(self.ppools)]
        self.decode = [create_kv_manager(backend, self._args(p, r, self.dlayout), "decode", None, FAST)
                       for r, p in enumerate(self.dpools)]

    def _pool(self, layout: HeadLayout, rank: int, fill: bool = False, shm: bool = False) -> MHATokenToKVPool:
        heads = layout.heads_of(rank)
        name = f"tidal_test_mn_{random.getrandbits(40):x}" if shm else None
        pool = MHATokenToKVPool(SLOTS, self.page_size, torch.float16, LAYERS, len(heads), HEAD_DIM, shm_name=name)
        if fill:
            for buf, full in zip(pool.k_buffer + pool.v_buffer, self.full_k + self.full_v, strict=True):
                buf.copy_(full[:, heads.start : heads.stop])
        return pool

    def _args(self, pool: MHATokenToKVPool, rank: int, layout: HeadLayout) -> KVArgs:
        return KVArgs(rank, pool, MetadataBuffers(8), self.page_size, "float16", tp_size=layout.tp_size,
                      total_kv_heads=layout.total_heads)

    def close(self) -> None:
        for m in self.decode + self.prefill:
            m.shutdown()
        for p in self.dpools:
            p.close()
        self.server.stop()


@pytest.fixture
def servers():
    made: list[Servers] = []

    def make(*a, **kw) -> Servers:
        made.append(Servers(*a, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


class Request:
    """One request's sender on every prefill rank and receiver on every decode rank (same pages on all ranks)."""

    def __init__(self, s: Servers, src: np.ndarray, dst: np.ndarray, room: int):
        self.s, self.src, self.dst, self.room = s, src, dst, room
        self.senders = [KVSender(m, s.addr, room) for m in s.prefill]
        self.receivers = [KVReceiver(m, s.addr, room) for m in s.decode]
        self.pmeta = [-1] * len(s.prefill)
        self.dmeta = [-1] * len(s.decode)
        self.record = MetadataRecord(output_id=room % 997, cached_tokens=3, logprob=-0.5, bootstrap_room=room)

    def step(self) -> None:
        for r, (recv, m) in enumerate(zip(self.receivers, self.s.decode, strict=True)):
            if self.dmeta[r] < 0 and recv.poll() == KVPoll.WaitingForInput:
                self.dmeta[r] = m.args.metadata.alloc()
                recv.init(self.dst, self.dmeta[r])
        half = len(self.src) // 2
        for r, (snd, m) in enumerate(zip(self.senders, self.s.prefill, strict=True)):
            if self.pmeta[r] < 0 and snd.poll() == KVPoll.WaitingForInput:
                self.pmeta[r] = m.args.metadata.alloc()
                m.args.metadata.set(self.pmeta[r], self.record)
                snd.init(len(self.src), self.pmeta[r])
                snd.send(self.src[:half], is_last=False)  # two chunks
                snd.send(self.src[half:], is_last=True)

    def polls(self) -> list[KVPoll]:
        return [x.poll() for x in self.senders + self.receivers]

    def done(self) -> bool:
        return all(p in (KVPoll.Success, KVPoll.Failed) for p in self.polls())


def run(reqs: list[Request], timeout: float = 30.0) -> None:
    ok = wait_for(lambda: all(r.done() for r in reqs), timeout, tick=lambda: [r.step() for r in reqs])
    assert ok, [r.polls() for r in reqs]


def make_requests(s: Servers, count: int, rng: random.Random) -> list[Request]:
    pages = SLOTS // s.page_size
    src_free, dst_free = list(range(1, pages)), list(range(1, pages))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    out = []
    for _ in range(count):
        k = rng.randint(1, 8)
        out.append(Request(s, np.array(src_free[:k], np.int64), np.array(dst_free[:k], np.int64), rng.getrandbits(63)))
        del src_free[:k], dst_free[:k]
    return out


def assert_landed(s: Servers, r: Request) -> None:
    assert r.polls() == [KVPoll.Success] * len(r.polls()), [x.failure_exception() for x in r.senders + r.receivers]
    ps = s.page_size
    for rank, pool in enumerate(s.dpools):
        heads = s.dlayout.heads_of(rank)
        for got, full in zip(pool.k_buffer + pool.v_buffer, s.full_k + s.full_v, strict=True):
            want = pages_of(full, ps)[r.src][:, :, heads.start : heads.stop]
            assert torch.equal(pages_of(got, ps)[r.dst], want), f"decode rank {rank}"
        assert s.decode[rank].args.metadata.get(r.dmeta[rank]) == r.record


LAYOUTS = [(1, 3, 3), (3, 1, 3), (2, 4, 4), (4, 2, 4), (8, 2, 4), (2, 8, 4)]


@pytest.mark.parametrize("m,n,total", LAYOUTS, ids=[f"{m}to{n}_{t}heads" for m, n, t in LAYOUTS])
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_m_to_n_transfers_deliver_each_decode_rank_its_heads(servers, backend, m, n, total):
    s = servers(backend, m, n, total)
    reqs = make_requests(s, 4, random.Random(m * 7 + n))
    run(reqs)
    for r in reqs:
        assert_landed(s, r)
    sent = sum(p.stats()["transferred_bytes"] for p in s.prefill)
    landed = sum(d.stats()["transferred_bytes"] for d in s.decode)
    assert sent == landed == sum(len(r.src) for r in reqs) * s.dpools[0].bytes_per_token() * s.page_size * n


@pytest.mark.parametrize("m,n", [(1, 3), (3, 1)])
@pytest.mark.parametrize("backend", [b for b in REAL_BACKENDS if getattr(b, "values", [b])[0] in ("mooncake", "nixl")])
def test_m_to_n_over_one_sided_backends(servers, backend, m, n):
    s = servers(backend, m, n, 3, page_size=2)
    reqs = make_requests(s, 3, random.Random(m + n))
    run(reqs)
    for r in reqs:
        assert_landed(s, r)


def test_each_decode_rank_talks_only_to_the_prefill_ranks_it_reads(servers):
    s = servers("tcp", 4, 2, 4)
    (r,) = make_requests(s, 1, random.Random(3))
    run([r])
    assert_landed(s, r)
    for rank, recv in enumerate(r.receivers):
        legs = [leg.rank for leg in recv._impl._room.target.legs]
        assert legs == list(sources(s.playout, s.dlayout, rank)) == [2 * rank, 2 * rank + 1]


def test_head_maps():
    four = HeadLayout(4, 4)
    assert [list(four.heads_of(r)) for r in range(4)] == [[0], [1], [2], [3]]
    assert [list(HeadLayout(4, 8).heads_of(r)) for r in range(8)] == [[0], [0], [1], [1], [2], [2], [3], [3]]
    one_to_three = [sources(HeadLayout(3, 1), HeadLayout(3, 3), d) for d in range(3)]
    assert [{p: (h.src_start, h.dst_start, h.count) for p, h in x.items()} for x in one_to_three] == \
        [{0: (0, 0, 1)}, {0: (1, 0, 1)}, {0: (2, 0, 1)}]
    three_to_one = sources(HeadLayout(3, 3), HeadLayout(3, 1), 0)
    assert {p: (h.src_start, h.dst_start, h.count) for p, h in three_to_one.items()} == \
        {0: (0, 0, 1), 1: (0, 1, 1), 2: (0, 2, 1)}
    # more prefill ranks than heads: each head read from one replica, the others get only the completion
    p8, d2 = HeadLayout(4, 8), HeadLayout(4, 2)
    counts = {p: h.count for d in range(2) for p, h in sources(p8, d2, d).items()}
    assert sorted(counts) == list(range(8)) and sum(counts.values()) == 4
    assert all(len(readers(p8, d2, p)) == 1 for p in range(8))
    assert sources(HeadLayout(3, 3), HeadLayout(3, 3), 1)[1].whole
    with pytest.raises(ValueError, match="cannot be split"):
        HeadLayout(3, 2)


def test_a_decode_of_another_head_count_is_refused_clearly(servers):
    s = servers("tcp", 1, 1, 4, decode_total=2)
    (r,) = make_requests(s, 1, random.Random(1))
    run([r])
    assert r.receivers[0].poll() == KVPoll.Failed
    assert "4 KV heads, decode 2" in str(r.receivers[0].failure_exception())


def test_a_prefill_tp_size_no_slicing_serves_is_refused_clearly(servers):
    """A registration of 3 ranks for a model of 4 KV heads (no such server starts, but the route is open)."""
    s = servers("tcp", 1, 2, 4)
    for m in s.prefill:
        m.shutdown()
    reg = {"role": "Prefill", "rank_ip": "127.0.0.1", "rank_port": 9, "engine_rank": 0, "tp_size": 3,
           "page_size": 4, "kv_dtype": "float16", "num_kv_heads": 4}
    assert http_json("PUT", s.addr, "/route", reg)[0] == 200
    recv = KVReceiver(s.decode[0], s.addr, 12345)
    assert wait_for(lambda: recv.poll() == KVPoll.Failed, 5)
    assert "4 KV heads cannot be split over 3 ranks" in str(recv.failure_exception())


def test_a_failed_prefill_rank_fails_every_decode_rank_and_frees_the_others(servers):
    """3 -> 1: prefill rank 1 aborts; the decode rank fails (fenced by every leg) and the other prefill ranks stop."""
    s = servers("tcp", 3, 1, 3)
    (r,) = make_requests(s, 1, random.Random(5))
    assert wait_for(lambda: r.receivers[0].poll() == KVPoll.WaitingForInput, 10)
    r.receivers[0].init(r.dst, s.decode[0].args.metadata.alloc())  # its destination goes to every leg
    assert wait_for(lambda: all(x.poll() == KVPoll.WaitingForInput for x in r.senders), 10)
    r.senders[1].abort()
    assert wait_for(r.done, 10, tick=r.step)  # ranks 0 and 2 send; decode has failed
    assert all(p == KVPoll.Failed for p in r.polls())
    assert "aborted by prefill" in str(r.receivers[0].failure_exception())
    assert "aborted by decode" in str(r.senders[0].failure_exception())
