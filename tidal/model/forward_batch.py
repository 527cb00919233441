"""What the model runner hands the model for one forward pass."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tidal.kvcache.kv_pool import MHATokenToKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly on top of a cached prefix, possibly a chunk)
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    """Flat, ragged batch. B requests, T = sum(extend_seq_lens) new tokens.

    For request b, its new tokens occupy positions
    [extend_prefix_lens[b], seq_lens[b]) and its full KV after this pass lives in
    slots req_to_token[req_pool_indices[b], :seq_lens[b]] (the new tokens' slots
    are also in out_cache_loc, in the same flat order as input_ids).
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, KV length after this pass
    extend_prefix_lens: torch.Tensor  # [B] int64, KV length before this pass
    extend_seq_lens: torch.Tensor  # [B] int64, new tokens (1 in DECODE)
    req_to_token: torch.Tensor  # [max_reqs, max_context_len] int64 slot table
    kv_pool: MHATokenToKVPool
    # host copies, to avoid device syncs in Python-side bookkeeping
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    # per request, its LoRA adapter's name (None: the base model); None when no request has one
    lora_names: Optional[list[Optional[str]]] = None
    # filled by the attention backend's init_forward_metadata
    attn_metadata: Optional[Any] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
