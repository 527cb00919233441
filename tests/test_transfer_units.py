"""Transfer parts on their own: metadata slots, KVPoll reduction, TCP framing checks,
backend construction errors."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.transfer import (
    KVArgs,
    KVPoll,
    MetadataBuffers,
    MetadataRecord,
    TransferConfig,
    create_kv_manager,
    poll_and_all_reduce,
)
from tidal.transfer.base import page_bytes
from tidal.transfer.tcp import PagesFrame, TcpTransport

pytestmark = pytest.mark.timeout(60)


def make_pool(page_size: int) -> MHATokenToKVPool:
    return MHATokenToKVPool(64, page_size, torch.float16, 2, 2, 8)


def test_metadata_buffers():
    meta = MetadataBuffers(2, max_top_logprobs=3)
    a, b = meta.alloc(), meta.alloc()
    assert {a, b} == {0, 1} and meta.alloc() is None and meta.available_size() == 0
    rec = MetadataRecord(output_id=5, cached_tokens=2, logprob=-0.5, top_logprobs_val=[-0.5, -2.0],
                         top_logprobs_idx=[5, 9], bootstrap_room=2**63 + 1)
    meta.set(a, rec)
    assert meta.get(a) == rec
    with pytest.raises(ValueError):
        meta.set(b, MetadataRecord(output_id=1, top_logprobs_val=[0.0] * 4, top_logprobs_idx=[0] * 4))
    meta.free(a)
    with pytest.raises(ValueError):
        meta.free(a)
    assert meta.available_size() == 1


def test_kvpoll_order_and_all_reduce():
    assert KVPoll.Failed < KVPoll.Bootstrapping < KVPoll.WaitingForInput < KVPoll.Transferring < KVPoll.Success

    class P:
        def __init__(self, v):
            self.v = v

        def poll(self):
            return self.v

    pollers = [P(KVPoll.Success), P(KVPoll.Failed), P(KVPoll.Transferring)]
    assert poll_and_all_reduce(pollers) == [KVPoll.Success, KVPoll.Failed, KVPoll.Transferring]
    from tidal.parallel import SingleRank

    assert poll_and_all_reduce(pollers, SingleRank()) == [KVPoll.Success, KVPoll.Failed, KVPoll.Transferring]


def test_shm_backend_needs_a_shared_pool():
    pool = make_pool(4)
    with pytest.raises(ValueError, match="shared memory"):
        create_kv_manager("shm", KVArgs(0, pool, MetadataBuffers(2), 4, "float16"), "decode", None, TransferConfig())


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown transfer backend"):
        create_kv_manager("carrier-pigeon", KVArgs(0, make_pool(4), MetadataBuffers(2), 4, "float16"), "decode")


class RecordingSink:
    def __init__(self):
        self.writes: list[tuple[int, list[int]]] = []
        self.inband: list[bytes] = []

    def begin_write(self, room, prefill_id, pages):
        self.writes.append((room, pages.tolist()))
        return room

    def end_write(self, token):
        pass

    def on_inband(self, data):
        self.inband.append(data)


def test_tcp_messages_are_size_layout_and_checksum_checked():
    pool = make_pool(4)  # 2 layers: blocks K0, V0, K1, V1 of one page each
    tr = TcpTransport(KVArgs(0, pool, MetadataBuffers(2), 4, "float16"), "prefill")
    try:
        sink = RecordingSink()
        page = page_bytes(pool, 4)
        block = page // 4
        payload = np.arange(page, dtype=np.uint8) % 251
        blocks = [memoryview(payload[i : i + block]) for i in range(0, page, block)]
        good = {"room": 1, "prefill_id": "p", "dst_pages": np.array([3], np.int64).tobytes(), "nbytes": page,
                "crc": zlib.crc32(payload)}

        def frame(**kw) -> PagesFrame:
            return PagesFrame(**{**good, **kw})

        tr.apply(sink, frame(nbytes=page - 2), [*blocks[:-1], blocks[-1][:-2]])  # short message
        tr.apply(sink, frame(crc=zlib.crc32(payload) ^ 1), blocks)  # corrupted
        tr.apply(sink, frame(dst_pages=np.array([3, 4], np.int64).tobytes()), blocks)  # wrong size
        tr.apply(sink, frame(), [memoryview(payload[: 2 * block]), memoryview(payload[2 * block :])])  # spans blocks
        assert sink.writes == []
        tr.apply(sink, frame(), blocks)
        assert sink.writes == [(1, [3])]
        landed = [b[12:16].reshape(-1).view(torch.uint8) for b in (pool.k_buffer[0], pool.v_buffer[0])]
        assert torch.cat(landed).numpy().tolist() == payload[: 2 * block].tolist()  # page 3 of K0, V0
        half = [memoryview(payload[i : i + block // 2]) for i in range(0, page // 2, block // 2)]
        tr.apply(sink, frame(nbytes=page // 2, crc=-1, head_start=1, num_heads=2), half)  # heads 1, 2 of 2
        tr.apply(sink, frame(nbytes=page // 2, crc=-1, head_start=0, num_heads=2), half)  # all heads, half the size
        assert sink.writes == [(1, [3])]
        tr.apply(sink, frame(nbytes=page // 2, crc=-1, head_start=1, num_heads=1), half)  # head 1 only
        assert sink.writes == [(1, [3]), (1, [3])]
        k0 = pool.k_buffer[0][12:16].view(torch.uint8)  # [token, head, bytes]
        assert k0[:, 1].reshape(-1).numpy().tolist() == payload[: block // 2].tolist()
    finally:
        tr.close()
