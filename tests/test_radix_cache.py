"""RadixCache: tree operations, locking, eviction, request hooks, and a randomized
scheduler-like simulation with check_integrity after every step."""

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
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in req_to_token
    target: list[int] = field(default_factory=list)  # the whole prompt


def make(ps: int = 1, pages: int = 64, reqs: int = 8, ctx: int = 256):
    pool = ReqToTokenPool(reqs, ctx)
    alloc = PagedTokenAllocator(pages * ps, ps, debug=True)
    return pool, alloc, RadixCache(pool, alloc, ps)


def put(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert key with fresh slots, freeing the duplicates like a caller must."""
    slots = cache.allocator.alloc(len(key))
    present = cache.insert(key, slots)
    cache.allocator.free(slots[:present])
    aligned = len(key) // cache.page_size * cache.page_size
    if aligned < len(key):
        cache.allocator.free(slots[aligned:])
    return slots


# ---- match / insert / split ----------------------------------------------------------


def test_insert_and_match():
    _pool, _a, c = make()
    slots = put(c, [1, 2, 3, 4, 5])
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.device_indices.tolist() == slots.tolist()
    assert c.match_prefix([9, 1]).device_indices.numel() == 0
    assert c.match_prefix([]).last_node is c.root_node
    assert c.total_size() == 5 == c.evictable_size() and c.protected_size() == 0


def test_match_splits_node():
    pool, a, c = make()
    slots = put(c, [1, 2, 3, 4, 5])
    m = c.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == slots[:3].tolist()
    assert m.last_node.key == [1, 2, 3] and next(iter(m.last_node.children.values())).key == [4, 5]
    assert c.total_size() == 5 and len(c.root_node.children) == 1
    assert c.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == slots.tolist()
    check_integrity(pool, a, c, [])


def test_duplicate_insert_returns_present_length():
    pool, a, c = make()
    first = put(c, [1, 2, 3])
    dup = a.alloc(5)
    assert c.insert([1, 2, 3, 4, 5], dup) == 3
    a.free(dup[:3])
    assert c.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == first.tolist() + dup[3:].tolist()
    assert c.insert([1, 2, 3, 4, 5], dup) == 5
    # A branch in the middle of a node splits it.
    branch = a.alloc(4)
    assert c.insert([1, 2, 7, 8], branch) == 2
    a.free(branch[:2])
    assert c.total_size() == 7
    check_integrity(pool, a, c, [])
    c.pretty_print()


def test_page_size_16_alignment():
    ps = 16
    pool, a, c = make(ps=ps, pages=16)
    key = list(range(40))  # 2.5 pages: only 32 tokens go in
    slots = a.alloc(40)
    assert c.insert(key, slots) == 0
    a.free(slots[32:])
    assert c.total_size() == 32
    assert c.match_prefix(key[:20]).device_indices.tolist() == slots[:16].tolist()
    assert c.match_prefix(key[:15]).device_indices.numel() == 0
    # Shares 20 tokens: only the first whole page counts as present.
    other = key[:20] + [99] * 12
    slots2 = a.alloc(32)
    assert c.insert(other, slots2) == 16
    a.free(slots2[:16])
    assert c.total_size() == 48
    assert c.match_prefix(other).device_indices.tolist() == slots[:16].tolist() + slots2[16:].tolist()
    for node in c._nodes():
        assert len(node.key) % ps == 0
    check_integrity(pool, a, c, [])


# ---- locking and eviction ---------------------------------------------------------


def test_lock_ref_accounting_and_protection():
    pool, a, c = make()
    put(c, [1, 2, 3, 4])
    put(c, [1, 2, 5, 6, 7])
    m = c.match_prefix([1, 2, 5, 6, 7])
    c.inc_lock_ref(m.last_node)
    assert c.protected_size() == 5 and c.evictable_size() == 2
    c.inc_lock_ref(m.last_node)
    assert c.protected_size() == 5
    assert c.evict(100) == 2  # only [3, 4] may go
    assert c.match_prefix([1, 2, 5, 6, 7]).device_indices.numel() == 5
    assert c.flush() is False and c.reset() is False
    c.dec_lock_ref(m.last_node)
    c.dec_lock_ref(m.last_node)
    with pytest.raises(RuntimeError):
        c.dec_lock_ref(m.last_node)
    assert c.protected_size() == 0 and c.evictable_size() == 5
    check_integrity(pool, a, c, [])
    assert c.flush() is True
    assert c.total_size() == 0 and a.available_size() == a.size


def test_evict_lru_order():
    pool, a, c = make()
    put(c, [1, 1])
    put(c, [2, 2])
    put(c, [3, 3])
    c.match_prefix([1, 1])  # touch: now [2, 2] is the least recently used
    assert c.evict(1) == 2
    assert c.match_prefix([2, 2]).device_indices.numel() == 0
    assert c.match_prefix([3, 3]).device_indices.numel() == 2  # touch [3, 3]
    assert c.evict(1) == 2
    assert c.match_prefix([1, 1]).device_indices.numel() == 0
    assert c.total_size() == 2
    check_integrity(pool, a, c, [])


def test_evict_reaches_parents_that_become_leaves():
    pool, a, c = make()
    put(c, [1, 2, 3])
    put(c, [1, 2, 4])
    put(c, [1, 2, 5])  # a shared [1, 2] with three leaves
    assert c.evict(5) == 5  # three leaves (3), then the parent (2)
    assert c.total_size() == 0 and a.available_size() == a.size
    check_integrity(pool, a, c, [])


def test_evict_frees_whole_pages():
    ps = 4
    pool, a, c = make(ps=ps, pages=8)
    put(c, list(range(8)))
    put(c, list(range(100, 112)))
    assert a.available_size() == 3 * ps
    assert c.evict(1) == 8
    assert a.available_size() == 5 * ps
    check_integrity(pool, a, c, [])


def test_disabled_radix_cache_shares_nothing():
    pool = ReqToTokenPool(2, 32)
    a = PagedTokenAllocator(32, 1, debug=True)
    c = RadixCache(pool, a, 1, disable=True)
    req = start(c, pool, list(range(10)))
    extend(c, req, 6)
    c.cache_unfinished_req(req, req.tokens)
    extend(c, req, 10)
    c.cache_finished_req(req, req.tokens)
    assert c.total_size() == 0 and a.available_size() == a.size
    check_integrity(pool, a, c, [])


# ---- request hooks ------------------------------------------------------------------


def start(c: Any, pool: ReqToTokenPool, prompt: list[int]) -> FakeReq:
    """Like the scheduler: match (leaving at least one token to compute), lock, take a row."""
    m = c.match_prefix(prompt[:-1])
    req = FakeReq(pool.alloc(), m.device_indices, m.last_node, target=prompt)
    c.inc_lock_ref(m.last_node)
    n = m.device_indices.numel()
    pool.req_to_token[req.req_pool_idx, :n] = m.device_indices
    req.tokens = prompt[:n]
    return req


def extend(c: Any, req: FakeReq, new_len: int, tokens: list[int] | None = None) -> bool:
    """Allocate KV for positions [len(req.tokens), new_len), evicting if needed."""
    pool, a = c.req_to_token_pool, c.allocator
    row = pool.req_to_token[req.req_pool_idx]
    old = len(req.tokens)
    last = int(row[old - 1]) if old else -1
    slots = a.alloc_extend([old], [new_len], [last])
    if slots is None:
        c.evict(new_len - old + c.page_size)
        slots = a.alloc_extend([old], [new_len], [last])
        if slots is None:
            return False
    row[old:new_len] = slots
    req.tokens = req.tokens + (tokens if tokens is not None else req.target[old:new_len])
    return True


def live_of(reqs: list[FakeReq]) -> list[tuple[int, int]]:
    return [(r.req_pool_idx, len(r.tokens)) for r in reqs]


@pytest.mark.parametrize("ps", [1, 4])
def test_finished_req_shares_prefix_and_frees_duplicates(ps):
    pool, a, c = make(ps=ps, pages=32)
    prompt = list(range(3 * ps + 1))
    aligned = len(prompt) // ps * ps
    r1 = start(c, pool, prompt)
    r2 = start(c, pool, prompt)  # nothing cached yet: computes the same prefix again
    for r in (r1, r2):
        extend(c, r, len(prompt))
    check_integrity(pool, a, c, live_of([r1, r2]))
    c.cache_finished_req(r1, r1.tokens)
    assert c.total_size() == aligned and r1.req_pool_idx is None
    check_integrity(pool, a, c, live_of([r2]))
    c.cache_finished_req(r2, r2.tokens)  # all of r2's aligned part is a duplicate
    assert c.total_size() == aligned
    check_integrity(pool, a, c, [])
    assert a.available_size() == a.size - aligned
    with pytest.raises(RuntimeError, match="released"):
        c.cache_finished_req(r2, r2.tokens)
    r3 = start(c, pool, prompt + [7, 7])
    assert len(r3.tokens) == aligned and c.protected_size() == aligned
    check_integrity(pool, a, c, live_of([r3]))


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_chunked_prefill_moves_lock_and_keeps_tail(ps):
    pool, a, c = make(ps=ps, pages=32)
    prompt = [5] * (3 * ps + ps // 2 + 1)
    req = start(c, pool, prompt)
    extend(c, req, ps + ps // 2 + 1)  # first chunk ends inside a page (for ps > 1)
    c.cache_unfinished_req(req, req.tokens)
    assert req.prefix_indices.numel() == len(req.tokens)
    assert c.protected_size() == len(req.tokens) // ps * ps and c.evictable_size() == 0
    check_integrity(pool, a, c, live_of([req]))
    twin = start(c, pool, prompt)  # shares the first chunk's whole pages
    assert len(twin.tokens) == ps * ((ps + ps // 2 + 1) // ps)
    extend(c, req, len(prompt))
    c.cache_unfinished_req(req, req.tokens)
    check_integrity(pool, a, c, live_of([req, twin]))
    extend(c, twin, len(prompt))
    c.cache_unfinished_req(twin, twin.tokens)  # twin's new pages duplicate req's
    assert torch.equal(twin.prefix_indices[: 3 * ps], req.prefix_indices[: 3 * ps])
    check_integrity(pool, a, c, live_of([req, twin]))
    for r in (req, twin):
        c.cache_finished_req(r, r.tokens)
    check_integrity(pool, a, c, [])
    assert c.protected_size() == 0 and c.evictable_size() == c.total_size() == len(prompt) // ps * ps


# ---- randomized simulation ------------------------------------------------------------


class Sim:
    """Drives a cache like a scheduler: admits, prefills in chunks, decodes, finishes,
    evicts under memory pressure; checks every invariant after each step."""

    def __init__(self, cache_kind: str, ps: int, seed: int):
        self.rng = random.Random(seed)
        self.ps = ps
        self.pool = ReqToTokenPool(6, 160)
        self.alloc = PagedTokenAllocator(24 * ps if ps > 1 else 96, ps, debug=True)
        kind = RadixCache if cache_kind == "radix" else ChunkCache
        self.cache = kind(self.pool, self.alloc, ps)
        self.live: list[FakeReq] = []
        self.cached_tokens = 0  # prefix hits at admission
        self.prefixes = [[self.rng.randrange(4) for _ in range(self.rng.randint(0, 3 * ps))] for _ in range(4)]

    def prompt(self) -> list[int]:
        suffix = [self.rng.randrange(4) for _ in range(self.rng.randint(1, 2 * ps_or(self.ps)))]
        return self.rng.choice(self.prefixes) + suffix

    def step(self) -> None:
        actions = [self.admit, self.chunk, self.decode, self.finish, self.evict]
        self.rng.choice(actions)()
        check_integrity(self.pool, self.alloc, self.cache, live_of(self.live))

    def admit(self) -> None:
        if self.pool.available_size() and len(self.live) < 5:
            self.live.append(start(self.cache, self.pool, self.prompt()))
            self.cached_tokens += len(self.live[-1].tokens)

    def chunk(self) -> None:
        prefilling = [r for r in self.live if len(r.tokens) < len(r.target)]
        if not prefilling:
            return
        req = self.rng.choice(prefilling)
        new_len = min(len(req.target), len(req.tokens) + self.rng.randint(1, 2 * self.ps))
        if not extend(self.cache, req, new_len):
            return self.abort(req)
        if new_len < len(req.target):
            self.cache.cache_unfinished_req(req, req.tokens)

    def decode(self) -> None:
        running = [r for r in self.live if len(r.tokens) >= len(r.target)]
        if running:
            req = self.rng.choice(running)
            if len(req.tokens) + 1 >= self.pool.max_context_len:
                return self.abort(req)
            if not extend(self.cache, req, len(req.tokens) + 1, [self.rng.randrange(4)]):
                self.abort(req)

    def finish(self) -> None:
        if self.live:
            self.abort(self.rng.choice(self.live))

    def abort(self, req: FakeReq) -> None:
        self.live.remove(req)
        self.cache.cache_finished_req(req, req.tokens)

    def evict(self) -> None:
        self.cache.evict(self.rng.randint(1, 4 * self.ps))

    def drain(self) -> None:
        for req in list(self.live):
            self.abort(req)
        check_integrity(self.pool, self.alloc, self.cache, [])
        assert self.cache.protected_size() == 0
        assert self.cache.flush() is True
        assert self.alloc.available_size() == self.alloc.size
        assert self.pool.available_size() == self.pool.size


def ps_or(ps: int) -> int:
    return max(ps, 4)


@pytest.mark.parametrize("cache_kind", ["radix", "chunk"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_requests_keep_integrity(cache_kind, ps, seed):
    sim = Sim(cache_kind, ps, seed)
    for _ in range(250):
        sim.step()
    if cache_kind == "radix":
        assert sim.cached_tokens > 0  # sharing actually happened
    sim.drain()
