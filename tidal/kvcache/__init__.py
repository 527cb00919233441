"""KV cache: storage, request/token slot pools, prefix caches and their invariants."""

from tidal.kvcache.allocator import PagedTokenAllocator
from tidal.kvcache.chunk_cache import ChunkCache
from tidal.kvcache.integrity import check_integrity
from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.kvcache.radix_cache import MatchResult, RadixCache, TreeNode
from tidal.kvcache.req_to_token_pool import ReqToTokenPool

__all__ = [
    "ChunkCache",
    "MHATokenToKVPool",
    "MatchResult",
    "PagedTokenAllocator",
    "RadixCache",
    "ReqToTokenPool",
    "TreeNode",
    "check_integrity",
]
