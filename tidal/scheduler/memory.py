"""The scheduler's memory: req slots, KV pages and the prefix cache, allocated together."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tidal.kvcache import (
    ChunkCache,
    PagedTokenAllocator,
    RadixCache,
    ReqToTokenPool,
    check_integrity,
)
from tidal.kvcache.swa import SWALayout, SWAPagedAllocator
from tidal.scheduler.req import Req


class KVMemory:
    """Owns ReqToTokenPool + PagedTokenAllocator + the cache; allocation evicts on demand.

    swa: the KV pool's windowed buffers (a sliding-window model), whose pages a second allocator
    hands out beside the full ones (tidal/kvcache/swa.py); every budget here is then the smaller
    of the two pools'.
    """

    def __init__(
        self,
        max_total_tokens: int,
        page_size: int,
        max_reqs: int,
        max_context_len: int,
        disable_radix_cache: bool,
        device: torch.device | str = "cpu",
        debug: bool = False,
        events: Any = None,
        swa: Optional[SWALayout] = None,
    ):
        self.page_size = page_size
        self.events = events  # a KVEventSink every radix cache made here reports to (None: no KV events)
        self.max_total_tokens = max_total_tokens
        # extra rows so a retracted/aborted request's slot never blocks a new one
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        self.swa: Optional[SWAPagedAllocator] = None
        if swa is not None:
            self.swa = SWAPagedAllocator(max_total_tokens, swa.size, page_size, swa.window, swa.page_map,
                                         device, debug=debug)
        self.allocator = self.swa or PagedTokenAllocator(max_total_tokens, page_size, device, debug=debug)
        self.tree_cache = self.make_cache(radix=not disable_radix_cache)

    def make_cache(self, radix: bool):
        """A new, empty prefix cache over these pools (radix tree, or no sharing)."""
        if radix:
            return RadixCache(self.req_to_token_pool, self.allocator, self.page_size, events=self.events)
        return ChunkCache(self.req_to_token_pool, self.allocator, self.page_size)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def available_tokens(self) -> int:
        """Tokens allocatable now, counting what eviction could free (in both pools with SWA)."""
        full = self.allocator.available_size() + self.tree_cache.evictable_size()
        return full if self.swa is None else min(full, self.swa_available_tokens())

    def swa_available_tokens(self) -> int:
        return self.swa.swa_available_size() + self.tree_cache.swa_evictable_size()

    def used_tokens(self) -> int:
        return self.max_total_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()

    def _ensure(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        if self.swa is not None:
            short = num_tokens - self.swa.swa_available_size()
            if short > 0:
                self.tree_cache.evict(short, swa=True)

    def free_out_of_window(self, reqs: list[Req], keep_match_end: bool = False) -> None:
        """Free the SWA pages of positions no query still to come can see (older than the last
        window), among those each request alone holds: from `swa_freed_to` (past what it matched from
        or gave to the tree) on. kv_len must not count unverified guesses.

        keep_match_end: keep what a query at the page-aligned end of a match of kv_len - 1 tokens (the
        same prompt sent again) sees, too."""
        if self.swa is None:
            return
        ps, window, rows = self.page_size, self.swa.window, []
        for r in reqs:
            end = (r.kv_len - window) // ps * ps
            if keep_match_end:
                end = min(end, ((r.kv_len - 1) // ps * ps - window + 1) // ps * ps)
                r.swa_chunk_windows = [(a, min(b, end)) for a, b in r.swa_chunk_windows if a < min(b, end)]
            if r.req_pool_idx is None:
                continue
            if end > r.swa_freed_to:
                rows.append(self.req_to_token[r.req_pool_idx, r.swa_freed_to:end])
                r.swa_freed_to = end
            while r.swa_chunk_windows and r.swa_chunk_windows[0][1] <= end:
                self.tree_cache.free_window(r, *r.swa_chunk_windows.pop(0))
        if rows:
            self.swa.free_swa(torch.cat(rows))

    def hold_in_tree(self, req: Req) -> None:
        """The request's positions the tree holds now (its locked path, matched or given to it) are never
        freed through it."""
        if self.swa is not None:
            req.swa_freed_to = max(req.swa_freed_to, self.tree_cache.shared_len(req))

    def alloc_req_slot(self, req: Req) -> None:
        if req.req_pool_idx is None:
            idx = self.req_to_token_pool.alloc()
            if idx is None:
                raise RuntimeError("req_to_token pool exhausted; admission should have prevented this")
            req.req_pool_idx = idx

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor:
        need = sum(s - p for p, s in zip(prefix_lens, seq_lens)) + len(seq_lens) * self.page_size
        self._ensure(need)
        out = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if out is None:
            raise RuntimeError(f"KV pool out of memory for a prefill of {need} tokens")
        return out

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> Optional[torch.Tensor]:
        self._ensure(len(seq_lens) * self.page_size)
        return self.allocator.alloc_decode(seq_lens, last_locs)

    def decode_tokens_needed(self, kv_lens: list[int]) -> int:
        """KV tokens one decode step of these requests may take (whole new pages)."""
        if self.page_size == 1:
            return len(kv_lens)
        return sum(self.page_size for n in kv_lens if n % self.page_size == 0)

    def release(self, req: Req) -> None:
        """Give the request's KV to the cache (its prefix stays shareable) and free its slot."""
        if req.req_pool_idx is None:
            return
        self.free_out_of_window([req])
        token_ids = req.all_ids[: req.kv_len]
        self.tree_cache.cache_finished_req(req, token_ids)
        req.req_pool_idx = None

    def drop_last_slot(self, req: Req) -> None:
        """Forget the KV of the request's last position (a pass computed it after the request
        ended); frees its page when that position was the page's first."""
        req.kv_len -= 1
        req.draft_kv_len = min(req.draft_kv_len, req.kv_len)
        pos = req.kv_len
        if pos % self.page_size == 0:
            self.allocator.free(self.req_to_token[req.req_pool_idx, pos : pos + 1].clone())

    def drop_tail(self, req: Req, keep: int) -> None:
        """Forget the KV of positions keep .. kv_len - 1 (guesses the target rejected): frees
        the pages that start there; a page shared with a kept position stays (its stale tail
        is overwritten as decoding goes on)."""
        ps = self.page_size
        first = -(-keep // ps) * ps  # the first page boundary at or after keep
        if first < req.kv_len:
            self.allocator.free(self.req_to_token[req.req_pool_idx, first : req.kv_len : ps].clone())
        req.kv_len = keep
        req.draft_kv_len = min(req.draft_kv_len, keep)  # the draft model's KV shares the slots

    def cache_unfinished(self, req: Req) -> None:
        self.free_out_of_window([req], keep_match_end=not req.is_chunked)
        self.tree_cache.cache_unfinished_req(req, req.fill_ids[: req.kv_len])
        if self.swa is not None and req.is_chunked:  # a chunk boundary, not the prompt's end
            start = max(req.swa_freed_to, (req.kv_len - self.swa.window) // self.page_size * self.page_size)
            aligned = req.kv_len // self.page_size * self.page_size
            if start < aligned:  # the window the next chunk reads: the tree's now, given back after it
                req.swa_chunk_windows.append((start, aligned))
        self.hold_in_tree(req)

    def check_integrity(self, live: list[Req]) -> None:
        pairs = [(r.req_pool_idx, r.kv_len) for r in live if r.req_pool_idx is not None]
        check_integrity(self.req_to_token_pool, self.allocator, self.tree_cache, pairs)

    def flush(self) -> bool:
        return bool(self.tree_cache.flush())
