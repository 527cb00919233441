"""Request slots: one row of the token-slot table per running request."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`req_to_token[r, i]` is the KV slot of position i of the request in row r.

    Rows are handed out with `alloc()` and given back with `free()`; a row that is
    freed twice, or was never handed out, raises.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size < 1 or max_context_len < 1:
            raise ValueError("ReqToTokenPool needs size >= 1 and max_context_len >= 1")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        self._free: list[int] = []
        self._is_free: list[bool] = []
        self.clear()

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.pop()
        self._is_free[idx] = False
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.size:
            raise RuntimeError(f"req slot {idx} out of range [0, {self.size})")
        if self._is_free[idx]:
            raise RuntimeError(f"req slot {idx} freed twice")
        self._is_free[idx] = True
        self._free.append(idx)

    def available_size(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        """The free rows, for integrity checks."""
        return list(self._free)

    def clear(self) -> None:
        # Popped from the end, so row 0 goes out first.
        self._free = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size
