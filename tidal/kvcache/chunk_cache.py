"""The prefix cache for `--disable-radix-cache`: RadixCache's interface, no sharing.

Every request owns all of its slots; nothing outlives a request.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.kvcache.allocator import PagedTokenAllocator
from tidal.kvcache.radix_cache import MatchResult, TreeNode, req_pool_idx_of
from tidal.kvcache.req_to_token_pool import ReqToTokenPool


class ChunkCache:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenAllocator, page_size: int):
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.disable = True
        self.root_node = TreeNode([], self._empty(), None, 0)
        self.root_node.lock_ref = 1

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def match_prefix(self, key: list[int], namespace: Any = None) -> MatchResult:
        return MatchResult(self._empty(), self.root_node)

    def insert(self, key: list[int], value: torch.Tensor, namespace: Any = None) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int, swa: bool = False) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return self._empty()

    def drop_namespace(self, namespace: Any) -> bool:
        return True

    def reset(self) -> bool:
        return True

    def flush(self) -> bool:
        return True

    def cache_finished_req(self, req: Any, token_ids: list[int]) -> None:
        idx = req_pool_idx_of(req)
        self.allocator.free(self.req_to_token_pool.req_to_token[idx, : len(token_ids)])
        self.req_to_token_pool.free(idx)
        req.req_pool_idx = None

    def shared_len(self, req: Any) -> int:
        return 0  # nothing is shared

    def free_window(self, req: Any, start: int, stop: int) -> None:
        """A sliding-window model's positions [start, stop) of the request's prefix, its own here."""
        self.allocator.free_swa(self.req_to_token_pool.req_to_token[req_pool_idx_of(req), start:stop])

    def cache_unfinished_req(self, req: Any, token_ids: list[int]) -> None:
        idx = req_pool_idx_of(req)
        req.prefix_indices = self.req_to_token_pool.req_to_token[idx, : len(token_ids)].clone()
        req.last_node = self.root_node

    def pretty_print(self) -> str:
        text = "ChunkCache (no sharing)"
        print(text)
        return text
