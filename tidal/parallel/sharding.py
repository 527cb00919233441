"""Megatron-style sharding of a Llama-family model over TP ranks.

Attention heads and the MLP's intermediate dimension are split (q/k/v and gate/up by
output rows, o/down by input columns, followed by an all-reduce); the vocabulary is
split for the embedding (masked lookup + all-reduce) and the LM head (all-gather of
the logits). When there are fewer KV heads than ranks, each KV head is replicated on
size / num_kv_heads ranks. Norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.model.config import ModelConfig


@dataclass(frozen=True)
class ModelShard:
    rank: int
    size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    kv_head_start: int
    intermediate_size: int  # this rank's share
    vocab_size: int  # the full vocabulary
    vocab_per_rank: int  # rows of this rank's embedding / LM head (the last rank's tail is padding)

    @staticmethod
    def of(config: ModelConfig, rank: int = 0, size: int = 1) -> "ModelShard":
        h, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
        problems = []
        if h % size:
            problems.append(f"{h} attention heads")
        if kv % size and size % kv:
            problems.append(f"{kv} KV heads (need a multiple or a divisor of the TP size)")
        if inter % size:
            problems.append(f"intermediate size {inter}")
        if problems:
            raise ValueError(f"--tp {size} does not divide this model: {', '.join(problems)}")
        kv_local = max(1, kv // size)
        kv_start = rank * kv // size  # with kv < size: the KV head this rank replicates
        per_rank = -(-config.vocab_size // size)
        return ModelShard(rank, size, h // size, kv_local, kv_start, inter // size, config.vocab_size, per_rank)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def rows_and_cols(self, hf_name: str, head_dim: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """(row range, column range) of this rank's part of an HF tensor; None = all of it."""
        q = self.num_heads * head_dim
        kv = self.num_kv_heads * head_dim
        inter = self.intermediate_size
        if ".self_attn.q_proj." in hf_name:
            return (self.rank * q, q), None
        if ".self_attn.k_proj." in hf_name or ".self_attn.v_proj." in hf_name:
            return (self.kv_head_start * head_dim, kv), None
        if ".self_attn.o_proj.weight" in hf_name:
            return None, (self.rank * q, q)
        if ".mlp.gate_proj." in hf_name or ".mlp.up_proj." in hf_name:
            return (self.rank * inter, inter), None
        if ".mlp.down_proj.weight" in hf_name:
            return None, (self.rank * inter, inter)
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (self.vocab_start, self.vocab_per_rank), None
        return None, None

    def take(self, hf_name: str, w: torch.Tensor, head_dim: int) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `hf_name` (vocab rows past the end are zero)."""
        if self.size == 1:
            return w
        rows, cols = self.rows_and_cols(hf_name, head_dim)
        if cols is not None:
            w = w.narrow(1, *cols)
        if rows is not None:
            start, n = rows
            if start + n > w.shape[0]:  # vocabulary padding on the last rank
                pad = w.new_zeros((start + n - w.shape[0], *w.shape[1:]))
                w = torch.cat([w, pad], dim=0)
            w = w.narrow(0, start, n)
        return w.contiguous()
