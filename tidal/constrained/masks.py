"""GrammarBatch: the token masks of one batch's constrained rows, and the matchers' advance.

Built when the batch is built; `allowed_tokens` runs right before sampling and `accept`
right after, in the thread that samples (with the overlap schedule, the forward thread, whose
passes run one after another), so a matcher has always consumed the previous pass's token
before it computes the next mask.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch

_executor: Any = None


def _mask_executor() -> Any:
    """One llguidance executor per process: masks of a batch are computed in parallel."""
    global _executor
    if _executor is None:
        from llguidance import LLExecutor

        _executor = LLExecutor(num_threads=max(1, min(4, len(os.sched_getaffinity(0)))))
    return _executor


class GrammarBatch:
    def __init__(self, rows: list[int], matchers: list[Any], vocab_size: int):
        self.rows = rows  # batch rows whose sampled token is kept and constrained
        self.matchers = matchers
        self.vocab_size = vocab_size

    @classmethod
    def of(cls, reqs: list[Any], sampled_is_output: list[bool], vocab_size: int) -> Optional["GrammarBatch"]:
        rows = [i for i, (r, kept) in enumerate(zip(reqs, sampled_is_output)) if kept and r.grammar is not None]
        if not rows:
            return None
        return cls(rows, [reqs[i].grammar for i in rows], vocab_size)

    def allowed_tokens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [G] int64, allowed [G, V] bool) for the sampler."""
        from llguidance.torch import fill_next_token_bitmask_par

        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(self.rows), words, dtype=torch.int32)
        fill_next_token_bitmask_par(_mask_executor(), [(m, j) for j, m in enumerate(self.matchers)], bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        allowed = torch.from_numpy(bits.astype(np.bool_))
        return torch.tensor(self.rows, dtype=torch.int64, device=device), allowed.to(device)

    def accept(self, next_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """Advance every matcher by its row's token. Returns the rows whose token the grammar
        refused, and the rows whose grammar is complete after it (only EOS could follow)."""
        ids = next_ids.tolist()
        refused, done = [], []
        for row, m in zip(self.rows, self.matchers):
            if not m.consume_token(ids[row]):
                refused.append(row)
            elif m.is_stopped():
                done.append(row)
        return refused, done
