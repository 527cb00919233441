"""A fake model runner whose outputs depend on the KV it reads, so KV bookkeeping bugs show."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.model.forward_batch import ForwardBatch

VOCAB = 512
EOS = 0


@dataclass
class FakeModelConfig:
    vocab_size: int = VOCAB
    context_length: int = 4096
    eos_token_ids: list[int] = field(default_factory=lambda: [EOS])
    num_kv_heads: int = 1


def reference_next(tokens: list[int]) -> int:
    """The token the fake model predicts after `tokens` (never EOS)."""
    h = sum((i + 1) * t for i, t in enumerate(tokens))
    return 1 + h % (VOCAB - 1)


def reference_generate(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(reference_next(seq))
    return seq[len(prompt):]


class FakeModelRunner:
    """Stores each token id as its "K" and predicts from the whole KV of the request."""

    def __init__(self, max_total_tokens: int = 4096, page_size: int = 1, context_length: int = 4096):
        self.model_config = FakeModelConfig(context_length=context_length)
        self.max_total_tokens = max_total_tokens
        self.page_size = page_size
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.kv_pool = MHATokenToKVPool(max_total_tokens, page_size, torch.float32, 1, 1, 1)
        self.forward_calls: list[tuple[str, int]] = []

    def forward(self, fb: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        self.forward_calls.append((fb.forward_mode.value, fb.batch_size))
        vals = fb.input_ids.to(torch.float32).view(-1, 1, 1)
        self.kv_pool.set_kv(0, fb.out_cache_loc, vals, vals)
        k = self.kv_pool.get_k(0).view(-1)
        preds = []
        offset = 0
        for b in range(fb.batch_size):
            n_new = fb.extend_seq_lens_cpu[b]
            prefix = fb.extend_prefix_lens_cpu[b]
            slots = fb.req_to_token[fb.req_pool_indices[b], : fb.seq_lens_cpu[b]]
            tokens = k[slots].long().tolist()
            for j in range(n_new):
                preds.append(reference_next(tokens[: prefix + j + 1]))
            offset += n_new
        logits = torch.full((len(preds), VOCAB), -10.0)
        logits[torch.arange(len(preds)), torch.tensor(preds)] = 10.0
        return logits[logit_rows]
