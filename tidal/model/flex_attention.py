"""Paged attention with PyTorch's FlexAttention, straight over tidal's page table.

Every layer's K/V buffer [slots, Hkv, D] is shown to FlexAttention as one long sequence
[1, Hkv, slots, D]. A pass's block mask (built once, shared by every layer) gives each request's
query rows the physical pages of its logical pages, in order, read from `req_to_token` (its KV
block size is the pool's page size, so a KV block is a page); the mask_mod maps a physical slot
back to its logical position through the pass's page table and keeps the keys at or before the
query's position. One call serves every kind of pass the same way: a fresh prompt, a prompt on a
cached prefix, a chunk of a chunked prefill, several of these at once, decode, and speculative
verification (a short extend); the new tokens' K/V are stored first and read back from the pool
like the rest. Queries are laid out [B, H, Q, D], Q the longest extend of the pass; rows past a
request's extend repeat its first row's position and are dropped. A sliding-window layer's block
mask adds `key position > query position - W` to the same mask_mod (one block mask per window);
encoder inputs would be another mask_mod over the same logical positions. Where the pool keeps the
windowed layers in buffers of their own (`swa_page_map`, tidal/kvcache/swa.py), their block mask's page
table is those buffers' pages, a page whose windowed KV is gone (mapped to 0) hidden like padding.

`compile`: the call goes through torch.compile (FlexAttention's fused kernels; without it torch
evaluates the mask densely, which serves tests and small pools only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from tidal.kvcache.swa import swa_slots
from tidal.model.forward_batch import ForwardBatch

Q_BLOCK = 128  # query rows per block of the block mask


COMPILED_SHAPES = 64  # the recompile limit the flex call gets


def bucket(n: int) -> int:
    """n rounded up to a power of two, then to a multiple of Q_BLOCK past it: the shapes compiled."""
    return 1 << (n - 1).bit_length() if n <= Q_BLOCK else -(-n // Q_BLOCK) * Q_BLOCK


def flex_available() -> Optional[str]:
    """None when this torch has FlexAttention, else why not."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"this torch ({torch.__version__}) has no FlexAttention: {e}"
    return None


@dataclass
class FlexMetadata:
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask
    q_index: torch.Tensor  # [B, Q] flat token of each query row (padding rows -> the request's first)
    out_rows: torch.Tensor  # [T] row of [B * Q] that holds each flat token's output
    windowed: dict[int, "FlexMetadata"] = field(default_factory=dict)  # the sliding-window layers', per window
    out_loc: Optional[torch.Tensor] = None  # where the pass stores K/V, when not fb.out_cache_loc


class FlexAttnBackend:
    name = "flex"

    def __init__(self, compile: bool = True) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.compiled = compile
        if compile:  # one graph per (batch, query rows) bucket
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, COMPILED_SHAPES)
        self._flex: Callable = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
        self.mask_every_batch = False  # the torch backend's compiled-decode knob; nothing to do here
        self.layer_windows: list[Optional[int]] = []  # per layer, its sliding window (set by the model)

    def use_eager(self) -> None:
        """FlexAttention without torch.compile (the mask evaluated densely): exact, for tests and small pools."""
        from torch.nn.attention.flex_attention import flex_attention

        self.compiled, self._flex = False, flex_attention

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._zero_once(fb.kv_pool)
        meta = self._metadata(fb, None)
        meta.windowed = {w: self._metadata(fb, w) for w in set(self.layer_windows) if w is not None}
        fb.attn_metadata = meta

    def _zero_once(self, pool) -> None:
        """FlexAttention multiplies the masked slots of a page too (by a weight of 0): a slot never written
        must hold a finite value, so a pool is zeroed before its first pass (its memory all resident)."""
        if getattr(pool, "zeroed_for_flex", False):
            return
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.zero_()
        pool.zeroed_for_flex = True

    def _metadata(self, fb: ForwardBatch, window: Optional[int]) -> FlexMetadata:
        from torch.nn.attention.flex_attention import BlockMask

        pool = fb.kv_pool
        ps, dev = pool.page_size, fb.req_to_token.device
        page_map = pool.swa_page_map if window is not None else None  # None: the full layers' slots
        buffer_slots = (pool.size if page_map is None else pool.swa_size) + ps  # the layers' buffer, dummy page in
        real = fb.batch_size
        # compiled kernels are specialised to shapes (torch 2.13's CPU template fails with dynamic ones):
        # the batch and the query rows are padded to buckets, so a few graphs serve every pass
        bs = bucket(real) if self.compiled else real
        q_len = bucket(max(fb.extend_seq_lens_cpu)) if self.compiled else max(fb.extend_seq_lens_cpu)
        pad = bs - real
        ext = F.pad(fb.extend_seq_lens, (0, pad))
        prefix = F.pad(fb.extend_prefix_lens, (0, pad))
        seq_lens = F.pad(fb.seq_lens, (0, pad), value=1)  # a padding request sees the dummy slot 0 only
        n_pages = buffer_slots // ps
        max_pages = -(-max(fb.seq_lens_cpu) // ps)
        # logical page j of request b -> its physical page (past its KV: whatever the table holds, masked)
        table = F.pad(fb.req_to_token[fb.req_pool_indices, : max_pages * ps : ps] // ps, (0, 0, 0, pad))  # [B, P]
        if page_map is not None:
            table = page_map[table]
        pages_used = (seq_lens + ps - 1) // ps  # [B]
        live = torch.arange(max_pages, device=dev)[None, :] < pages_used[:, None]
        if page_map is not None:  # a page whose windowed KV is gone is hidden; padding rows keep the dummy page
            live &= table != 0
            live[real:, 0] = True
        to_logical = torch.full((bs, n_pages), -1, dtype=torch.int64, device=dev)
        logical = torch.arange(max_pages, device=dev).expand(bs, max_pages)
        # entries past a request's pages write -1 to the dummy page 0, which no request's KV uses
        to_logical.scatter_(1, torch.where(live, table, 0), torch.where(live, logical, -1))
        to_logical[real:, 0] = 0
        rows = torch.arange(q_len, device=dev)
        in_run = rows[None, :] < ext[:, None]  # [B, Q]
        q_pos = prefix[:, None] + torch.where(in_run, rows[None, :], 0)  # padding rows: the first row's position
        starts = torch.cumsum(ext, 0) - ext
        q_index = (starts[:, None] + torch.where(in_run, rows[None, :], 0)).clamp(max=fb.num_tokens - 1)
        out_rows = (torch.arange(bs, device=dev)[:, None] * q_len + rows[None, :])[in_run]

        def mask_mod(b, h, q_idx, kv_idx):
            page = to_logical[b, kv_idx // ps]
            pos = page * ps + kv_idx % ps
            seen = (page >= 0) & (pos <= q_pos[b, q_idx])
            if window is not None:
                seen = seen & (pos > q_pos[b, q_idx] - window)
            return seen

        blocks, counts = table, pages_used
        if page_map is not None:  # the live pages first: fewer of them than the buffer's pages
            order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)
            blocks = torch.gather(torch.where(live, table, 0), 1, order)[:, :min(max_pages, n_pages)]
            counts = live.sum(1)
        q_blocks = -(-q_len // Q_BLOCK)
        kv_num = counts.to(torch.int32)[:, None, None].expand(bs, 1, q_blocks).contiguous()
        # indices are physical pages, so the row spans the pool's pages (only the first kv_num are read)
        kv_idx = torch.zeros(bs, 1, q_blocks, n_pages, dtype=torch.int32, device=dev)
        kv_idx[..., :blocks.shape[1]] = blocks.to(torch.int32)[:, None, None, :]
        # no block is marked full (every one goes through mask_mod); the CPU kernel needs the tensors anyway
        block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, torch.zeros_like(kv_num), torch.zeros_like(kv_idx),
                                              BLOCK_SIZE=(Q_BLOCK, ps), mask_mod=mask_mod,
                                              seq_lengths=(q_len, n_pages * ps))
        out_loc = None if page_map is None else swa_slots(page_map, fb.out_cache_loc, ps)
        return FlexMetadata(block_mask, q_index, out_rows, out_loc=out_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]; stores k/v at fb.out_cache_loc first."""
        meta: FlexMetadata = fb.attn_metadata
        if self.layer_windows and self.layer_windows[layer_id] is not None:
            meta = meta.windowed[self.layer_windows[layer_id]]
        fb.kv_pool.set_kv(layer_id, fb.out_cache_loc if meta.out_loc is None else meta.out_loc, k, v)
        n_tok, n_heads, head_dim = q.shape
        bs, q_len = meta.q_index.shape
        kbuf, vbuf = fb.kv_pool.get_k(layer_id), fb.kv_pool.get_v(layer_id)
        keys = kbuf.permute(1, 0, 2)[None].to(q.dtype)  # [1, Hkv, slots, D]
        values = vbuf.permute(1, 0, 2)[None].to(q.dtype)
        queries = q[meta.q_index].permute(0, 2, 1, 3)  # [B, H, Q, D]
        out = self._flex(queries, keys, values, block_mask=meta.block_mask, enable_gqa=n_heads != kbuf.shape[1])
        return out.permute(0, 2, 1, 3).reshape(bs * q_len, n_heads * head_dim)[meta.out_rows]
