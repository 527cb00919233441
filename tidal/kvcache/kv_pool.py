"""KV storage: one K and one V tensor per layer, indexed by token slot.

Slots [0, page_size) form a reserved dummy page: padding in gathered batches
points there, and the allocator never hands it out. Usable slots are
[page_size, page_size + size).

With `shm_name`, the buffers live in one POSIX shared-memory file
/dev/shm/<shm_name> (K of every layer, then V of every layer), so another process on
the host can write pages straight into them (the `shm` transfer backend). The pool
owns the file: `close()` unlinks it; the memory goes when the last mapping does.

With `swa_layers` (a sliding-window model's windowed layers), those layers' buffers have
`swa_size` usable slots of their own, indexed through `swa_page_map` (full page -> SWA page;
tidal/kvcache/swa.py), so they hold only the pages still inside a window.
"""

from __future__ import annotations

import os
from typing import Optional

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
        shm_name: Optional[str] = None,
        swa_layers: frozenset[int] = frozenset(),
        swa_size: int = 0,
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        total = size + page_size
        self.shm_path: Optional[str] = None
        self.swa_layers, self.swa_size = frozenset(swa_layers), swa_size if swa_layers else 0
        # full page -> the windowed layers' page (0: none); None without windowed buffers
        self.swa_page_map: Optional[torch.Tensor] = None
        if self.swa_layers:
            if shm_name is not None:
                raise ValueError("a KV pool with sliding-window buffers cannot live in shared memory")
            self.swa_page_map = torch.zeros(size // page_size + 1, dtype=torch.int64, device=self.device)
        if shm_name is not None:
            self.k_buffer, self.v_buffer = self._map_shm(shm_name, total)
            return
        # torch.empty leaves untouched pages unbacked, so a large pool costs memory only as
        # it fills; every slot is written before it is read, except the dummy page, which
        # padding reads and must hold finite values (0 * NaN would poison attention).
        # [layer] -> [slot, kv_head, head_dim]
        sizes = [self.swa_size + page_size if i in self.swa_layers else total for i in range(num_layers)]
        self.k_buffer = [self._new_buffer(n) for n in sizes]
        self.v_buffer = [self._new_buffer(n) for n in sizes]

    def _new_buffer(self, total: int) -> torch.Tensor:
        buf = torch.empty((total, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        buf[: self.page_size].zero_()
        return buf

    def _map_shm(self, name: str, total: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One shared file, zero-filled and lazily backed like torch.empty."""
        if self.device.type != "cpu":
            raise ValueError("a shared-memory KV pool must be on the CPU")
        per_layer = total * self.num_kv_heads * self.head_dim
        elem = self.dtype.itemsize
        path = os.path.join("/dev/shm", name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 2 * self.num_layers * per_layer * elem)
            numel = 2 * self.num_layers * per_layer
            flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=self.dtype)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.shm_path = path
        # [2 * layer] -> [slot, kv_head, head_dim]: K of every layer, then V
        views = [flat[i * per_layer : (i + 1) * per_layer].view(total, self.num_kv_heads, self.head_dim)
                 for i in range(2 * self.num_layers)]
        return views[: self.num_layers], views[self.num_layers :]

    def close(self) -> None:
        """Unlinks the shared-memory file, if any; the buffers stay usable. Idempotent."""
        path, self.shm_path = self.shm_path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; loc: [num_tokens] slots."""
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v.to(self.dtype))

    def get_k(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_v(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def bytes_per_token(self) -> int:
        """Bytes of one full slot in every layer (what a KV transfer moves per token)."""
        elem = self.dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def nbytes(self) -> int:
        """Bytes of every K and V buffer (windowed layers' smaller ones included)."""
        return sum(b.numel() * b.element_size() for b in (*self.k_buffer, *self.v_buffer))

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = dtype.itemsize
        return 2 * num_layers * num_kv_heads * head_dim * elem


class StackedKVPool:
    """Two pools of the same slots seen as one for a KV transfer: the target model's layers, then a
    draft model's (speculative decoding, tidal/spec/draft.py), so a prefill server's pages carry the
    draft's KV of the prompt too. Both pools must share slot count, page size, dtype, heads and head
    size; `draft_layers` tells the partner's layout check what is stacked."""

    def __init__(self, target: MHATokenToKVPool, draft: MHATokenToKVPool):
        problem = stack_problem(target, draft)
        if problem is not None:
            raise ValueError(f"cannot stack the draft model's KV pool under the target's: {problem}")
        self.target, self.draft = target, draft
        self.size, self.page_size, self.dtype = target.size, target.page_size, target.dtype
        self.num_kv_heads, self.head_dim, self.device = target.num_kv_heads, target.head_dim, target.device
        self.num_layers = target.num_layers + draft.num_layers
        self.draft_layers = draft.num_layers
        self.k_buffer = target.k_buffer + draft.k_buffer
        self.v_buffer = target.v_buffer + draft.v_buffer
        self.shm_path = None
        self.swa_page_map = None  # (a sliding-window pool does not travel: tidal/kvcache/swa.py)

    def bytes_per_token(self) -> int:
        return self.target.bytes_per_token() + self.draft.bytes_per_token()


def stack_problem(target: MHATokenToKVPool, draft: MHATokenToKVPool) -> Optional[str]:
    """Why the two pools cannot travel as one, or None."""
    for name in ("size", "page_size", "dtype", "num_kv_heads", "head_dim"):
        if getattr(target, name) != getattr(draft, name):
            return f"{name} {getattr(target, name)} != {getattr(draft, name)}"
    return None
