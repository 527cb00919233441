"""ReqToTokenPool, PagedTokenAllocator, ChunkCache and check_integrity."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tidal.kvcache import (
    ChunkCache,
    PagedTokenAllocator,
    RadixCache,
    ReqToTokenPool,
    check_integrity,
)


@dataclass
class FakeReq:
    req_pool_idx: int | None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def page_of(slots: torch.Tensor, ps: int) -> list[int]:
    return (slots // ps).tolist()


# ---- ReqToTokenPool ---------------------------------------------------------------


def test_req_pool_alloc_free_reuse():
    pool = ReqToTokenPool(3, 8)
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int64
    got = [pool.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and pool.alloc() is None and pool.available_size() == 0
    pool.free(got[1])
    assert pool.available_size() == 1 and pool.alloc() == got[1]
    pool.clear()
    assert pool.available_size() == 3


def test_req_pool_double_free_and_range():
    pool = ReqToTokenPool(2, 4)
    idx = pool.alloc()
    pool.free(idx)
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(idx)
    with pytest.raises(RuntimeError, match="out of range"):
        pool.free(5)


# ---- allocator ----------------------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_allocator_sizes_and_slot_range(ps):
    a = PagedTokenAllocator(10 * ps + ps - 1, ps, debug=True)  # rounded down to 10 pages
    assert a.size == 10 * ps and a.num_pages == 10 and a.available_size() == 10 * ps
    slots = a.alloc(10 * ps)
    assert slots is not None and slots.numel() == 10 * ps
    assert sorted(slots.tolist()) == list(range(ps, ps + 10 * ps))  # dummy page 0 never given
    assert a.available_size() == 0 and a.alloc(1) is None
    a.free(slots)
    assert a.available_size() == 10 * ps


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_allocator_exhaustion_is_all_or_nothing(ps):
    a = PagedTokenAllocator(4 * ps, ps, debug=True)
    first = a.alloc_extend([0], [2 * ps], [-1])
    assert first is not None
    # Two requests together need 3 pages, only 2 are free: nothing is taken.
    assert a.alloc_extend([0, 0], [ps, 2 * ps], [-1, -1]) is None
    assert a.available_size() == 2 * ps
    assert a.alloc_extend([0, 0], [ps, ps], [-1, -1]).numel() == 2 * ps
    assert a.alloc_decode([1], [-1]) is None
    assert a.available_size() == 0


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_allocator_free_reuses_pages(ps):
    a = PagedTokenAllocator(3 * ps, ps, debug=True)
    x = a.alloc(3 * ps)
    a.free(x[:1])  # frees the whole first page
    assert a.available_size() == ps
    y = a.alloc(ps)
    assert set(page_of(y, ps)) == {int(x[0]) // ps}


@pytest.mark.parametrize("ps", [4, 16])
def test_alloc_extend_continues_partial_page(ps):
    a = PagedTokenAllocator(8 * ps, ps, debug=True)
    prefix = a.alloc(ps + 2)  # one full page and 2 slots of a second
    assert prefix.numel() == ps + 2
    new = a.alloc_extend([ps + 2], [3 * ps + 1], [int(prefix[-1])])
    assert new.numel() == 2 * ps - 1
    # The rest of the partial page first, at the same offsets as the positions.
    assert new[: ps - 2].tolist() == list(range(int(prefix[-1]) + 1, int(prefix[-1]) + ps - 1))
    full = torch.cat([prefix, new])
    pos = torch.arange(full.numel())
    assert torch.equal(full % ps, pos % ps)
    pages = full // ps
    assert torch.equal(pages[(pos // ps) * ps], pages)  # one page per block of positions
    assert a.available_size() == 8 * ps - 4 * ps


@pytest.mark.parametrize("ps", [1, 4])
def test_alloc_extend_batch_and_empty_request(ps):
    a = PagedTokenAllocator(16 * ps, ps, debug=True)
    out = a.alloc_extend([0, 3, 0], [5, 3, 2], [-1, -1 if ps == 1 else 2 * ps + 2, -1])
    assert out.numel() == 7
    assert len(set(out.tolist())) == 7


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_alloc_decode_pages(ps):
    a = PagedTokenAllocator(8 * ps, ps, debug=True)
    slots = a.alloc(ps)  # a request holding exactly one full page
    before = a.available_size()
    s = a.alloc_decode([ps + 1], [int(slots[-1])])  # position ps starts a new page
    assert a.available_size() == before - ps
    t = a.alloc_decode([ps + 2], [int(s[0])])  # continues in that page (if there is room)
    if ps > 1:
        assert int(t[0]) == int(s[0]) + 1 and a.available_size() == before - ps


def test_alloc_extend_rejects_inconsistent_last_loc():
    a = PagedTokenAllocator(64, 4)
    with pytest.raises(ValueError):
        a.alloc_extend([2], [6], [-1])
    with pytest.raises(ValueError):
        a.alloc_extend([2], [6], [7])  # slot 7 ends a page, position 1 does not
    with pytest.raises(ValueError):
        a.alloc_extend([5], [3], [-1])


@pytest.mark.parametrize("ps", [1, 4])
def test_allocator_random_requests_keep_page_invariants(ps):
    rng = random.Random(ps)
    a = PagedTokenAllocator(40 * ps, ps, debug=True)
    reqs: list[list[int]] = [[] for _ in range(6)]
    for _ in range(150):
        batch = rng.sample(range(len(reqs)), 3)
        pre = [len(reqs[i]) for i in batch]
        seq = [p + rng.randint(0, 2 * ps) for p in pre]
        out = a.alloc_extend(pre, seq, [reqs[i][-1] if reqs[i] else -1 for i in batch])
        if out is None:
            victim = max(range(len(reqs)), key=lambda i: len(reqs[i]))
            a.free(torch.tensor(reqs[victim] or [], dtype=torch.int64))
            reqs[victim] = []
            continue
        out = out.tolist()
        for i, p, s in zip(batch, pre, seq):
            reqs[i] += out[: s - p]
            out = out[s - p :]
        owned = [set(page_of(torch.tensor(r, dtype=torch.int64), ps)) for r in reqs if r]
        assert sum(len(o) for o in owned) == len(set().union(*owned)) if owned else True
        assert sum(len(o) for o in owned) * ps + a.available_size() == a.size
        for r in reqs:
            assert all(slot % ps == pos % ps for pos, slot in enumerate(r))
    for r in reqs:
        a.free(torch.tensor(r, dtype=torch.int64))
    assert a.available_size() == a.size


def test_allocator_debug_double_free_raises():
    a = PagedTokenAllocator(16, 4, debug=True)
    x = a.alloc(8)
    a.free(x[:4])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(x[2:3])
    with pytest.raises(RuntimeError, match="outside"):
        a.free(torch.tensor([1]))  # the dummy page


def test_allocator_free_group():
    a = PagedTokenAllocator(16, 1, debug=True)
    x = a.alloc(16)
    a.free_group_begin()
    a.free(x[:3])
    a.free(x[5:7])
    assert a.available_size() == 0 and a.free_pages().numel() == 5
    a.free_group_end()
    assert a.available_size() == 5
    with pytest.raises(RuntimeError):
        a.free_group_end()


# ---- ChunkCache ---------------------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 4])
def test_chunk_cache_lifecycle(ps):
    pool, a = ReqToTokenPool(2, 64), PagedTokenAllocator(16 * ps, ps, debug=True)
    cache = ChunkCache(pool, a, ps)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.device_indices.numel() == 0 and m.last_node is cache.root_node
    req = FakeReq(pool.alloc(), m.device_indices, m.last_node)
    slots = a.alloc(2 * ps + 1)
    pool.req_to_token[req.req_pool_idx, : slots.numel()] = slots
    tokens = list(range(slots.numel()))
    cache.cache_unfinished_req(req, tokens)
    assert torch.equal(req.prefix_indices, slots)
    check_integrity(pool, a, cache, [(req.req_pool_idx, len(tokens))])
    cache.cache_finished_req(req, tokens)
    assert req.req_pool_idx is None
    check_integrity(pool, a, cache, [])
    assert a.available_size() == a.size and cache.evictable_size() == 0 and cache.evict(100) == 0
    with pytest.raises(RuntimeError, match="released"):
        cache.cache_finished_req(req, tokens)


# ---- check_integrity detects bugs ---------------------------------------------------


def _one_live_request(ps: int):
    pool, a = ReqToTokenPool(4, 64), PagedTokenAllocator(8 * ps, ps)
    cache = RadixCache(pool, a, ps)
    idx = pool.alloc()
    slots = a.alloc(2 * ps)
    pool.req_to_token[idx, : 2 * ps] = slots
    return pool, a, cache, idx, slots


@pytest.mark.parametrize("ps", [1, 4])
def test_integrity_detects_leak(ps):
    pool, a, cache, idx, _ = _one_live_request(ps)
    check_integrity(pool, a, cache, [(idx, 2 * ps)])
    with pytest.raises(AssertionError, match=r"1 pages leaked"):
        check_integrity(pool, a, cache, [(idx, ps)])  # forgot the second page
    a.alloc(ps)  # taken and dropped on the floor
    with pytest.raises(AssertionError, match="leaked"):
        check_integrity(pool, a, cache, [(idx, 2 * ps)])


def test_integrity_detects_req_slot_leak():
    pool, a, cache, _idx, slots = _one_live_request(1)
    a.free(slots)
    with pytest.raises(AssertionError, match="req slots leaked"):
        check_integrity(pool, a, cache, [])


@pytest.mark.parametrize("ps", [1, 4])
def test_integrity_detects_double_ownership(ps):
    pool, a, cache, idx, slots = _one_live_request(ps)
    other = pool.alloc()
    pool.req_to_token[other, :ps] = slots[:ps]  # two requests on one private page
    with pytest.raises(AssertionError, match=rf"page {int(slots[0]) // ps}: .*req"):
        check_integrity(pool, a, cache, [(idx, 2 * ps), (other, ps)])
    a.free(slots[ps:])  # freed while still in use
    with pytest.raises(AssertionError, match="owned more than once"):
        check_integrity(pool, a, cache, [(idx, 2 * ps), (other, 0)])


def test_integrity_detects_double_free_without_debug():
    pool, a, cache, idx, slots = _one_live_request(4)
    a.free(slots)
    pool.free(idx)
    a.free(slots[:1])  # debug is off: not raised here
    with pytest.raises(AssertionError, match="free x2"):
        check_integrity(pool, a, cache, [])


def test_integrity_detects_tree_accounting_error():
    pool, a, cache, idx, slots = _one_live_request(1)
    cache.insert([1, 2], slots)
    pool.free(idx)
    check_integrity(pool, a, cache, [])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="accounting"):
        check_integrity(pool, a, cache, [])
