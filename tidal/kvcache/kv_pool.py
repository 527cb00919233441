"""KV storage: one K and one V tensor per layer, indexed by token slot.

Slots [0, page_size) form a reserved dummy page: padding in gathered batches
points there, and the allocator never hands it out. Usable slots are
[page_size, page_size + size).
"""

from __future__ import annotations

import torch


class MHATokenToKVPool:
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: str | torch.device = "cpu",
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        total = size + page_size
        # torch.empty leaves untouched pages unbacked, so a large pool costs memory only as
        # it fills; every slot is written before it is read, except the dummy page, which
        # padding reads and must hold finite values (0 * NaN would poison attention).
        # [layer] -> [slot, kv_head, head_dim]
        self.k_buffer = [self._new_buffer(total) for _ in range(num_layers)]
        self.v_buffer = [self._new_buffer(total) for _ in range(num_layers)]

    def _new_buffer(self, total: int) -> torch.Tensor:
        buf = torch.empty((total, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        buf[: self.page_size].zero_()
        return buf

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; loc: [num_tokens] slots."""
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v.to(self.dtype))

    def get_k(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_v(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def bytes_per_token(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem
