"""Paged attention in plain torch: gather each request's KV slots, then SDPA.

`init_forward_metadata` builds, once per forward pass, what every layer reuses.

DECODE (the hot path) is fully batched: a padded slot table [B, L] (padding -> slot 0, the
dummy page) gathers all requests' K/V at once and a [B, 1, 1, L] mask hides the padding.
The query heads that share a kv head are folded into the query-length axis, so GQA needs
no K/V expansion.

EXTEND loops over requests: padding ragged prompts to the longest one wastes up to Bx the
attention work, and on CPU torch's flash kernel is several times slower with an explicit mask
than with is_causal. A fresh prompt (no cached prefix) attends to its new k/v directly with
is_causal; a prompt on top of a cached prefix (prefix cache hit, or the previous chunk of a
chunked prefill) gathers its slots and uses a bottom-right-aligned causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from tidal.model.forward_batch import ForwardBatch, ForwardMode


@dataclass
class ExtendSegment:
    start: int  # first flat token of the request in this pass
    end: int
    kv_index: Optional[torch.Tensor] = None  # [seq_len] KV slots; None for a fresh prompt
    mask: Optional[torch.Tensor] = None  # bool [ext_len, seq_len]; None for a fresh prompt


@dataclass
class TorchNativeMetadata:
    kv_index: Optional[torch.Tensor] = None  # DECODE: [B, L] KV slots, padding -> 0
    mask: Optional[torch.Tensor] = None  # DECODE: bool [B, 1, 1, L], or None when no row is padded
    segments: list[ExtendSegment] = field(default_factory=list)  # EXTEND: one per request


class TorchNativeAttnBackend:
    """Attention over the paged KV pool with torch's scaled_dot_product_attention."""

    def __init__(self) -> None:
        self._ws: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode == ForwardMode.DECODE:
            fb.attn_metadata = self._decode_metadata(fb)
        else:
            fb.attn_metadata = self._extend_metadata(fb)

    @staticmethod
    def _decode_metadata(fb: ForwardBatch) -> TorchNativeMetadata:
        max_len = max(fb.seq_lens_cpu)
        dev = fb.req_to_token.device
        slots = fb.req_to_token[fb.req_pool_indices, :max_len]  # [B, L]
        if min(fb.seq_lens_cpu) == max_len:
            return TorchNativeMetadata(kv_index=slots)
        valid = torch.arange(max_len, device=dev)[None, :] < fb.seq_lens[:, None]  # [B, L]
        kv_index = torch.where(valid, slots, torch.zeros_like(slots))
        return TorchNativeMetadata(kv_index=kv_index, mask=valid[:, None, None, :])  # [B, 1, 1, L]

    @staticmethod
    def _extend_metadata(fb: ForwardBatch) -> TorchNativeMetadata:
        dev = fb.req_to_token.device
        pool_rows = fb.req_pool_indices.tolist()
        segments, start = [], 0
        for row, prefix, ext in zip(pool_rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            seg = ExtendSegment(start, start + ext)
            if prefix > 0:
                seq_len = prefix + ext
                seg.kv_index = fb.req_to_token[row, :seq_len]
                # new token i sits at position prefix + i and sees keys j <= prefix + i
                rows = torch.arange(prefix, seq_len, device=dev)
                seg.mask = torch.arange(seq_len, device=dev)[None, :] <= rows[:, None]  # [ext, seq_len]
            segments.append(seg)
            start += ext
        return TorchNativeMetadata(segments=segments)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]; stores k/v at fb.out_cache_loc first."""
        fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        meta: TorchNativeMetadata = fb.attn_metadata
        if fb.forward_mode == ForwardMode.DECODE:
            return self._decode(q, layer_id, fb, meta)
        return self._extend(q, k, v, layer_id, fb, meta)

    def _workspace(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable [n, Hkv, D] buffers for gathered K and V.

        Fresh multi-MB allocations every layer get returned to the OS and page-fault again:
        reusing one buffer made the decode gather ~3x faster on CPU.
        """
        shape = (n, *like.shape[1:])
        numel = n * like[0].numel()
        ws = self._ws
        if ws is None or ws[0].numel() < numel or ws[0].dtype != like.dtype or ws[0].device != like.device:
            ws = (torch.empty(shape, dtype=like.dtype, device=like.device),
                  torch.empty(shape, dtype=like.dtype, device=like.device))
            self._ws = ws
        return ws[0].view(-1)[:numel].view(shape), ws[1].view(-1)[:numel].view(shape)

    def _gather(self, layer_id: int, fb: ForwardBatch, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n, Hkv, D] of the n = slots.numel() slots, in slots' (flattened) order."""
        flat = slots.reshape(-1)
        kbuf, vbuf = fb.kv_pool.get_k(layer_id), fb.kv_pool.get_v(layer_id)
        k_out, v_out = self._workspace(flat.numel(), kbuf)
        return torch.index_select(kbuf, 0, flat, out=k_out), torch.index_select(vbuf, 0, flat, out=v_out)

    def _decode(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, meta: TorchNativeMetadata) -> torch.Tensor:
        bs, n_heads, head_dim = q.shape
        max_len = meta.kv_index.shape[1]
        k, v = self._gather(layer_id, fb, meta.kv_index)  # [B*L, Hkv, D]
        n_kv = k.shape[1]
        k = k.view(bs, max_len, n_kv, head_dim).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        v = v.view(bs, max_len, n_kv, head_dim).transpose(1, 2).to(q.dtype)
        # the G = H / Hkv query heads of a kv head become G query rows: [B, H, D] -> [B, Hkv, G, D]
        qg = q.view(bs, n_kv, n_heads // n_kv, head_dim)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.mask)  # [B, Hkv, G, D]
        return out.reshape(bs, n_heads * head_dim)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, meta: TorchNativeMetadata) -> torch.Tensor:
        n_tok, n_heads, head_dim = q.shape
        gqa = n_heads != k.shape[1]
        out = q.new_empty(n_tok, n_heads, head_dim)
        for seg in meta.segments:
            qs = q[seg.start:seg.end].transpose(0, 1)[None]  # [ext, H, D] -> [1, H, ext, D]
            if seg.kv_index is None:
                ks = k[seg.start:seg.end].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, ext, D]
                vs = v[seg.start:seg.end].transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            else:
                kc, vc = self._gather(layer_id, fb, seg.kv_index)  # [seq_len, Hkv, D]
                ks = kc.transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, seq_len, D]
                vs = vc.transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, enable_gqa=gqa)
            out[seg.start:seg.end] = o[0].transpose(0, 1)  # [1, H, ext, D] -> [ext, H, D]
        return out.view(n_tok, n_heads * head_dim)
