"""Paged attention in plain torch: gather each request's KV slots, then SDPA.

`init_forward_metadata` builds, once per forward pass, what every layer reuses.

DECODE (the hot path) is fully batched over a padded slot table [B, L] (padding -> slot 0,
the dummy page), in one of two ways, chosen per pass by the batch's KV size and the thread count:

- "sdpa": gather all requests' K/V at once into a workspace, then SDPA with a [B, 1, 1, L]
  mask hiding the padding. The query heads that share a kv head are folded into the
  query-length axis, so GQA needs no K/V expansion. Best while the gathered K/V stays in cache.
- "bag": decode attention is memory-bound, and gathering K/V writes and re-reads a copy of
  everything attention reads. Here V is never copied: the output is a weighted sum of V rows,
  which F.embedding_bag(per_sample_weights=softmax probabilities) reads in place from the
  pool. K is gathered a few requests at a time into a small workspace that stays in cache
  while one bmm per kv head turns it into scores. It runs more, smaller ops than "sdpa",
  so it pays only on large batches and with one intra-op thread (see BAG_MIN_TOKENS).

EXTEND loops over requests: padding ragged prompts to the longest one wastes up to Bx the
attention work, and on CPU torch's flash kernel is several times slower with an explicit mask
than with is_causal. A fresh prompt (no cached prefix) attends to its new k/v directly with
is_causal; a prompt on top of a cached prefix (prefix cache hit, or the previous chunk of a
chunked prefill) gathers its slots and uses a bottom-right-aligned causal mask. A batch of
short extends on cached prefixes (speculative verification: each request's last token and
its few guesses) is batched like DECODE instead, E query rows per request over the padded
slot table with a [B, 1, E, L] causal mask (`ShortExtend`), since a loop of B small
attention calls per layer cost more than the padding.

Sliding-window layers (`layer_windows`, set by the model) get their own metadata per window,
built the same way over fewer keys: a request's keys start at the oldest position its first
query sees (decode: its last W positions, unmasked once every request has W), and the masks add
`key > query - W`. A fresh prompt longer than its window needs an explicit mask, not is_causal.
Where the pool keeps the windowed layers in buffers of their own (`swa_page_map`, tidal/kvcache/swa.py),
that metadata's slots, and the slots the pass stores its K/V at (`out_loc`), are those buffers'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from tidal.kvcache.swa import swa_slots
from tidal.model.forward_batch import ForwardBatch, ForwardMode


@dataclass
class ExtendSegment:
    start: int  # first flat token of the request in this pass
    end: int
    kv_index: Optional[torch.Tensor] = None  # [seq_len] KV slots; None for a fresh prompt
    mask: Optional[torch.Tensor] = None  # bool [ext_len, seq_len]; None for a fresh prompt


@dataclass
class BagDecode:
    """What the "bag" decode path reuses in every layer (Hkv kv heads, G query heads per kv head)."""
    k_chunk_rows: int  # requests whose K is gathered at once
    score_bias: Optional[torch.Tensor]  # [1, B, 1, L] 0 / -inf, or None when no row is padded
    # built by the pass's first layer, which knows G:
    v_rows: Optional[torch.Tensor] = None  # [Hkv * B * G * L] rows of the pool's V viewed as [slots * Hkv, D]
    v_offsets: Optional[torch.Tensor] = None  # [Hkv * B * G + 1] start of each (kv head, request, query head) bag


@dataclass
class ShortExtend:
    """EXTEND of at most SHORT_EXTEND_MAX new tokens per request, every one on a cached prefix."""
    kv_index: torch.Tensor  # [B, L] KV slots, padding -> 0
    mask: torch.Tensor  # bool [B, 1, E, L]: query i of request b sees keys j <= prefix_b + i
    q_index: torch.Tensor  # [B, E] flat token of each query row (padding rows -> the request's first)
    out_rows: torch.Tensor  # [T] row of [B * E] that holds each flat token's output


SHORT_EXTEND_MAX = 8


def _key_slots(fb: ForwardBatch, firsts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request b's keys are positions [firsts[b], seq_len_b): their slots [B, L] (padding -> slot 0, the
    dummy page), positions [B, L] and validity [B, L], L the most keys of a request."""
    dev = fb.req_to_token.device
    n_keys = max(n - f for n, f in zip(fb.seq_lens_cpu, firsts))
    first = torch.tensor(firsts, dtype=torch.int64, device=dev)
    pos = first[:, None] + torch.arange(n_keys, device=dev)[None, :]
    valid = pos < fb.seq_lens[:, None]
    if not any(firsts):
        slots = fb.req_to_token[fb.req_pool_indices, :n_keys]
    else:
        col = pos.clamp(max=fb.req_to_token.shape[1] - 1)
        slots = fb.req_to_token[fb.req_pool_indices[:, None], col]
    return torch.where(valid, slots, torch.zeros_like(slots)), pos, valid


@dataclass
class TorchNativeMetadata:
    kv_index: Optional[torch.Tensor] = None  # DECODE: [B, L] KV slots, padding -> 0
    mask: Optional[torch.Tensor] = None  # DECODE: bool [B, 1, 1, L], or None when no row is padded
    bag: Optional[BagDecode] = None  # DECODE: set when this pass takes the "bag" path
    segments: list[ExtendSegment] = field(default_factory=list)  # EXTEND: one per request
    short: Optional[ShortExtend] = None  # EXTEND of short runs on cached prefixes, batched
    # the metadata of the sliding-window layers, per window (the fields above serve full attention)
    windowed: dict[int, "TorchNativeMetadata"] = field(default_factory=dict)
    out_loc: Optional[torch.Tensor] = None  # where the pass stores K/V, when not fb.out_cache_loc


DECODE_PATHS = ("auto", "sdpa", "bag")
# "auto" takes the "bag" path from this many padded KV tokens (B * L) per pass, and only with one
# intra-op thread. Measured on a shared 2-core AVX2 CPU, SmolLM2-135M (3 kv heads x 64), float32,
# whole decode step, bag/sdpa: 1 thread: 0.78-0.88 from 8k tokens, 0.94-1.01 at 2k-4k, 0.91-1.06
# at 256-1k (noise); 2 threads: 1.35-3x, every small op of the K chunk loop being an OpenMP
# region that waits for a descheduled thread (unchunked: 0.99-1.06, no gain).
BAG_MIN_TOKENS = 4096
# K bytes gathered at once on the "bag" path: small enough to stay in a core's L2
BAG_K_CHUNK_BYTES = 1 << 20


class TorchNativeAttnBackend:
    """Attention over the paged KV pool with torch's scaled_dot_product_attention and embedding_bag.

    decode_path: "auto" (by batch size and thread count, see BAG_MIN_TOKENS), or always "sdpa" or
    "bag"; "bag" needs a float32 CPU pool and falls back to "sdpa" otherwise.
    """

    name = "torch"

    def __init__(self, decode_path: str = "auto") -> None:
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {DECODE_PATHS}, not {decode_path!r}")
        self.decode_path = decode_path
        # a padding mask on every decode batch of 2+ requests, even uniform ones: one compiled
        # graph serves both (set by --enable-torch-compile)
        self.mask_every_batch = False
        self._ws: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        # per layer, its sliding window or None (set by the model; empty: every layer full)
        self.layer_windows: list[Optional[int]] = []

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        meta = self._metadata(fb, None)
        meta.windowed = {w: self._windowed_metadata(fb, w) for w in set(self.layer_windows) if w is not None}
        fb.attn_metadata = meta

    def _windowed_metadata(self, fb: ForwardBatch, window: int) -> TorchNativeMetadata:
        meta = self._metadata(fb, window)
        page_map = fb.kv_pool.swa_page_map
        if page_map is None:  # the windowed layers share the full layers' slots
            return meta
        ps = fb.kv_pool.page_size

        def to_swa(slots: torch.Tensor) -> torch.Tensor:
            return swa_slots(page_map, slots, ps)

        meta.out_loc = to_swa(fb.out_cache_loc)
        if meta.kv_index is not None:
            meta.kv_index = to_swa(meta.kv_index)
        if meta.short is not None:
            meta.short.kv_index = to_swa(meta.short.kv_index)
        for seg in meta.segments:
            if seg.kv_index is not None:
                seg.kv_index = to_swa(seg.kv_index)
        return meta

    def _metadata(self, fb: ForwardBatch, window: Optional[int]) -> TorchNativeMetadata:
        if fb.forward_mode == ForwardMode.DECODE:
            return self._decode_metadata(fb, window)
        if self._is_short_extend(fb):
            return TorchNativeMetadata(short=self._short_metadata(fb, window))
        return self._extend_metadata(fb, window)

    @staticmethod
    def _is_short_extend(fb: ForwardBatch) -> bool:
        return (fb.batch_size > 1 and max(fb.extend_seq_lens_cpu) <= SHORT_EXTEND_MAX
                and min(fb.extend_prefix_lens_cpu) > 0)

    @staticmethod
    def _short_metadata(fb: ForwardBatch, window: Optional[int]) -> ShortExtend:
        dev = fb.req_to_token.device
        ext, prefix = fb.extend_seq_lens, fb.extend_prefix_lens
        e = max(fb.extend_seq_lens_cpu)
        # the keys of request b: positions [first_b, seq_len_b), the first query's window on
        firsts = [0 if window is None else max(0, p + 1 - window) for p in fb.extend_prefix_lens_cpu]
        slots, pos, valid = _key_slots(fb, firsts)  # [B, L]
        rows = torch.arange(e, device=dev)
        q_pos = (prefix[:, None] + rows[None, :])[:, :, None]  # [B, E, 1]
        mask = pos[:, None, :] <= q_pos  # [B, E, L]
        if window is not None:
            mask &= pos[:, None, :] > q_pos - window
        mask &= valid[:, None, :]
        starts = torch.cumsum(ext, 0) - ext  # each request's first flat token
        in_run = rows[None, :] < ext[:, None]  # [B, E]
        q_index = torch.where(in_run, starts[:, None] + rows[None, :], starts[:, None])
        out_rows = (torch.arange(fb.batch_size, device=dev)[:, None] * e + rows[None, :])[in_run]
        return ShortExtend(slots, mask[:, None], q_index, out_rows)

    def _decode_metadata(self, fb: ForwardBatch, window: Optional[int]) -> TorchNativeMetadata:
        """Each request's keys: its whole KV, or its last `window` positions (the order of keys is free)."""
        seen = fb.seq_lens_cpu if window is None else [min(n, window) for n in fb.seq_lens_cpu]
        uniform = min(seen) == max(seen)
        if window is None and uniform and not (self.mask_every_batch and fb.batch_size > 1):
            meta = TorchNativeMetadata(kv_index=fb.req_to_token[fb.req_pool_indices, :max(seen)])  # [B, L]
        else:
            firsts = [n - k for n, k in zip(fb.seq_lens_cpu, seen)]
            kv_index, _pos, valid = _key_slots(fb, firsts)
            masked = not uniform or (self.mask_every_batch and fb.batch_size > 1)
            meta = TorchNativeMetadata(kv_index=kv_index, mask=valid[:, None, None, :] if masked else None)
        if window is None and self._takes_bag_path(fb, meta.kv_index.numel()):
            meta.bag = self._bag_metadata(fb, meta)
        return meta

    def _takes_bag_path(self, fb: ForwardBatch, padded_tokens: int) -> bool:
        pool = fb.kv_pool
        if self.decode_path == "sdpa" or pool.dtype != torch.float32 or pool.device.type != "cpu":
            return False
        if self.decode_path == "bag":
            return True
        return padded_tokens >= BAG_MIN_TOKENS and torch.get_num_threads() == 1

    @staticmethod
    def _bag_metadata(fb: ForwardBatch, meta: TorchNativeMetadata) -> BagDecode:
        pool = fb.kv_pool
        bs, max_len = meta.kv_index.shape
        bias = None
        if meta.mask is not None:
            dev = meta.kv_index.device
            bias = torch.zeros(bs, max_len, device=dev).masked_fill_(~meta.mask.view(bs, max_len), float("-inf"))
            bias = bias[None, :, None, :]
        k_token_bytes = pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize
        return BagDecode(max(1, BAG_K_CHUNK_BYTES // (max_len * k_token_bytes)), bias)

    @staticmethod
    def _bag_v_rows(bag: BagDecode, kv_index: torch.Tensor, n_kv: int, group: int) -> None:
        """V row of (slot, kv head h) in V viewed as [slots * Hkv, D]; bags ordered (h, request, query head)."""
        bs, max_len = kv_index.shape
        heads = torch.arange(n_kv, device=kv_index.device)[:, None, None, None]
        bag.v_rows = (kv_index[None, :, None, :] * n_kv + heads).expand(n_kv, bs, group, max_len).reshape(-1)
        n_bags = n_kv * bs * group
        bag.v_offsets = torch.arange(0, (n_bags + 1) * max_len, max_len, device=kv_index.device)

    @staticmethod
    def _extend_metadata(fb: ForwardBatch, window: Optional[int]) -> TorchNativeMetadata:
        dev = fb.req_to_token.device
        pool_rows = fb.req_pool_indices.tolist()
        segments, start = [], 0
        for row, prefix, ext in zip(pool_rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            seg = ExtendSegment(start, start + ext)
            seq_len = prefix + ext
            first = 0 if window is None else max(0, prefix + 1 - window)  # the first query's oldest key
            if prefix > 0 or (window is not None and ext > window):
                # new token i sits at position prefix + i and sees keys j <= prefix + i (and j > prefix + i - W)
                q_pos = torch.arange(prefix, seq_len, device=dev)[:, None]
                k_pos = torch.arange(first, seq_len, device=dev)[None, :]
                seg.mask = k_pos <= q_pos  # [ext, seq_len - first]
                if window is not None:
                    seg.mask &= k_pos > q_pos - window
                if prefix > 0:  # else the keys are the pass's own new k/v
                    seg.kv_index = fb.req_to_token[row, first:seq_len]
            segments.append(seg)
            start += ext
        return TorchNativeMetadata(segments=segments)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]; stores k/v at fb.out_cache_loc first."""
        meta: TorchNativeMetadata = fb.attn_metadata
        if self.layer_windows and self.layer_windows[layer_id] is not None:
            meta = meta.windowed[self.layer_windows[layer_id]]
        fb.kv_pool.set_kv(layer_id, fb.out_cache_loc if meta.out_loc is None else meta.out_loc, k, v)
        if fb.forward_mode == ForwardMode.DECODE:
            return self._decode(q, layer_id, fb, meta)
        if meta.short is not None:
            return self._short_extend(q, layer_id, fb, meta.short)
        return self._extend(q, k, v, layer_id, fb, meta)

    def _short_extend(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, meta: ShortExtend) -> torch.Tensor:
        n_heads, head_dim = q.shape[1:]
        bs, e = meta.q_index.shape
        max_len = meta.kv_index.shape[1]
        k, v = self._gather(layer_id, fb, meta.kv_index)  # [B*L, Hkv, D]
        n_kv = k.shape[1]
        group = n_heads // n_kv
        k = k.view(bs, max_len, n_kv, head_dim).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        v = v.view(bs, max_len, n_kv, head_dim).transpose(1, 2).to(q.dtype)
        # [B, E, H, D] -> [B, Hkv, E * G, D]: a kv head's query heads of every row along the query axis
        qg = q[meta.q_index].view(bs, e, n_kv, group, head_dim).permute(0, 2, 1, 3, 4).reshape(bs, n_kv, e * group,
                                                                                              head_dim)
        mask = meta.mask[:, :, :, None, :].expand(bs, 1, e, group, max_len).reshape(bs, 1, e * group, max_len)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)  # [B, Hkv, E * G, D]
        out = out.view(bs, n_kv, e, group, head_dim).permute(0, 2, 1, 3, 4).reshape(bs * e, n_heads * head_dim)
        return out[meta.out_rows]

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
        if torch.compiler.is_compiling():  # the compiler plans its own buffers
            return kbuf.index_select(0, flat), vbuf.index_select(0, flat)
        k_out, v_out = self._workspace(flat.numel(), kbuf)
        return torch.index_select(kbuf, 0, flat, out=k_out), torch.index_select(vbuf, 0, flat, out=v_out)

    def _decode(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, meta: TorchNativeMetadata) -> torch.Tensor:
        if meta.bag is not None:
            return self._decode_bag(q, layer_id, fb, meta.kv_index, meta.bag)
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

    def _decode_bag(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch, kv_index: torch.Tensor,
                    bag: BagDecode) -> torch.Tensor:
        bs, n_heads, head_dim = q.shape
        max_len = kv_index.shape[1]
        kbuf, vbuf = fb.kv_pool.get_k(layer_id), fb.kv_pool.get_v(layer_id)
        n_kv = kbuf.shape[1]
        group = n_heads // n_kv
        if bag.v_rows is None:
            self._bag_v_rows(bag, kv_index, n_kv, group)
        # [B, H, D] -> [Hkv, B, G, D], pre-scaled so the scores need no extra pass
        qh = (q.to(kbuf.dtype) * head_dim ** -0.5).view(bs, n_kv, group, head_dim).transpose(0, 1)
        scores = q.new_empty(n_kv, bs, group, max_len, dtype=kbuf.dtype)
        step = bag.k_chunk_rows
        for b0 in range(0, bs, step):
            b1 = min(bs, b0 + step)
            k_ws, _ = self._workspace((b1 - b0) * max_len, kbuf)
            k = torch.index_select(kbuf, 0, kv_index[b0:b1].reshape(-1), out=k_ws)
            k = k.view(b1 - b0, max_len, n_kv, head_dim)
            for h in range(n_kv):
                torch.bmm(qh[h, b0:b1], k[:, :, h, :].transpose(1, 2), out=scores[h, b0:b1])  # [c, G, L]
        if bag.score_bias is not None:
            scores.add_(bag.score_bias)
        probs = torch.softmax(scores, dim=-1)
        out = F.embedding_bag(bag.v_rows, vbuf.view(-1, head_dim), bag.v_offsets, mode="sum",
                              per_sample_weights=probs.view(-1), include_last_offset=True)  # [Hkv*B*G, D]
        return out.view(n_kv, bs, group, head_dim).transpose(0, 1).reshape(bs, n_heads * head_dim).to(q.dtype)

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
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None,
                                                   enable_gqa=gqa)
            else:
                kc, vc = self._gather(layer_id, fb, seg.kv_index)  # [seq_len, Hkv, D]
                ks = kc.transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, seq_len, D]
                vs = vc.transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, enable_gqa=gqa)
            out[seg.start:seg.end] = o[0].transpose(0, 1)  # [1, H, ext, D] -> [ext, H, D]
        return out.view(n_tok, n_heads * head_dim)
