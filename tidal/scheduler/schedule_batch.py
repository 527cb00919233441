"""ScheduleBatch: the requests of one forward pass, and their KV allocation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tidal.model.forward_batch import ForwardBatch, ForwardMode
from tidal.scheduler.memory import KVMemory
from tidal.scheduler.req import Req


@dataclass
class RowSpan:
    """Rows of the logits tensor that belong to one request; the last one is sampled."""

    first: int
    count: int
    first_pos: int  # sequence position of the first row

    @property
    def last(self) -> int:
        return self.first + self.count - 1


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    mode: ForwardMode
    spans: list[RowSpan] = field(default_factory=list)
    forward_batch: Optional[ForwardBatch] = None
    logit_rows: Optional[torch.Tensor] = None
    # a speculative verification pass (tidal/spec): each request's guesses, one logits row per
    # position of [last output token, *guesses]
    drafts: Optional[list[list[int]]] = None

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def is_empty(self) -> bool:
        return not self.reqs


def build_extend_batch(reqs: list[Req], mem: KVMemory, kv_pool) -> ScheduleBatch:
    """Allocate KV for each request's new tokens and lay out the flat batch."""
    for r in reqs:
        mem.alloc_req_slot(r)
    table = mem.req_to_token
    dev = table.device  # the batch's tensors live with the slot table: on the model's device
    prefix_lens = [len(r.prefix_indices) for r in reqs]
    extend_lens = [r.extend_input_len for r in reqs]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    for r, p in zip(reqs, prefix_lens):
        if p:
            table[r.req_pool_idx, :p] = r.prefix_indices
        mem.hold_in_tree(r)
    last_locs = [int(table[r.req_pool_idx, p - 1]) if p else -1 for r, p in zip(reqs, prefix_lens)]
    out_loc = mem.alloc_extend(prefix_lens, seq_lens, last_locs)

    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    spans: list[RowSpan] = []
    offset = 0
    for r, p, s in zip(reqs, prefix_lens, seq_lens):
        n = s - p
        table[r.req_pool_idx, p:s] = out_loc[offset : offset + n]
        r.kv_len = s
        input_ids += r.fill_ids[p:s]
        positions.append(torch.arange(p, s, dtype=torch.int64, device=dev))
        first_pos = _first_logit_pos(r, p, s)
        spans.append(RowSpan(first=sum(sp.count for sp in spans), count=s - first_pos, first_pos=first_pos))
        rows.append(torch.arange(offset + first_pos - p, offset + n, dtype=torch.int64, device=dev))
        offset += n

    fb = extend_forward_batch(reqs, input_ids, torch.cat(positions), out_loc, prefix_lens, seq_lens, table, kv_pool)
    return ScheduleBatch(reqs, ForwardMode.EXTEND, spans, fb, torch.cat(rows))


def extend_forward_batch(reqs: list[Req], input_ids: list[int], positions: torch.Tensor, out_loc: torch.Tensor,
                         prefix_lens: list[int], seq_lens: list[int], table: torch.Tensor, kv_pool) -> ForwardBatch:
    """The EXTEND pass of these requests: new tokens at [prefix_len, seq_len) of each, flat in request order."""
    dev = table.device
    extend_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=as_t(input_ids),
        positions=positions,
        out_cache_loc=out_loc,
        req_pool_indices=as_t([r.req_pool_idx for r in reqs]),
        seq_lens=as_t(seq_lens),
        extend_prefix_lens=as_t(prefix_lens),
        extend_seq_lens=as_t(extend_lens),
        req_to_token=table,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
    )
    fb.lora_names = lora_names(reqs)
    return fb


def lora_names(reqs: list[Req]) -> Optional[list[Optional[str]]]:
    """Each request's adapter for the forward pass; None when none has one (the base-only pass)."""
    names = [r.lora_name for r in reqs]
    return names if any(n is not None for n in names) else None


def _first_logit_pos(r: Req, prefix_len: int, seq_len: int) -> int:
    """First position whose logits are needed: the last one, or earlier for prompt logprobs."""
    if r.wants_input_logprobs and not r.first_prefill_done:
        want = max(r.logprob_start_len - 1, 0)
        return min(max(want, prefix_len), seq_len - 1)
    return seq_len - 1


def build_decode_batch(reqs: list[Req], mem: KVMemory, kv_pool) -> ScheduleBatch:
    """One new token per request; the caller has checked memory (or retracted)."""
    table = mem.req_to_token
    dev = table.device
    idx = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
    kv_lens = [r.kv_len for r in reqs]
    kv = torch.tensor(kv_lens, dtype=torch.int64, device=dev)
    last_locs = table[idx, kv - 1]
    seq_lens = [n + 1 for n in kv_lens]
    out_loc = mem.alloc_decode(seq_lens, last_locs.tolist())
    if out_loc is None:
        raise RuntimeError("KV pool out of memory in decode; the memory check should have retracted")
    table[idx, kv] = out_loc
    for r in reqs:
        r.kv_len += 1
    b = len(reqs)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=dev),
        positions=kv,
        out_cache_loc=out_loc,
        req_pool_indices=idx,
        seq_lens=kv + 1,
        extend_prefix_lens=kv,
        extend_seq_lens=torch.ones(b, dtype=torch.int64, device=dev),
        req_to_token=table,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=kv_lens,
        extend_seq_lens_cpu=[1] * b,
    )
    fb.lora_names = lora_names(reqs)
    spans = [RowSpan(first=i, count=1, first_pos=n) for i, n in enumerate(kv_lens)]
    return ScheduleBatch(reqs, ForwardMode.DECODE, spans, fb, torch.arange(b, dtype=torch.int64, device=dev))
