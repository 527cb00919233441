"""The verification pass: every running request's last token and its guesses in one
target extend, one sampled row per position, and what of the guesses the target keeps."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tidal.model.forward_batch import ForwardMode
from tidal.scheduler.memory import KVMemory
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import RowSpan, ScheduleBatch, extend_forward_batch


def reserve_verify_slots(reqs: list[Req], counts: list[int], mem: KVMemory) -> torch.Tensor:
    """KV slots for `counts[i]` positions from request i's kv_len on, written to req_to_token (kv_len
    unchanged); the caller has checked memory."""
    table = mem.req_to_token
    dev = table.device
    kv_lens = [r.kv_len for r in reqs]
    seq_lens = [n + c for n, c in zip(kv_lens, counts, strict=True)]
    idx = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
    last_locs = table[idx, torch.tensor(kv_lens, dtype=torch.int64, device=dev) - 1].tolist()
    out_loc = mem.alloc_extend(kv_lens, seq_lens, last_locs)
    offset = 0
    for r, kv, s in zip(reqs, kv_lens, seq_lens, strict=True):
        table[r.req_pool_idx, kv:s] = out_loc[offset : offset + s - kv]
        offset += s - kv
    return out_loc


def build_verify_batch(reqs: list[Req], drafts: list[list[int]], mem: KVMemory, kv_pool,
                       out_loc: Optional[torch.Tensor] = None) -> ScheduleBatch:
    """An extend of [last output token, *guesses] per request on top of its resident KV,
    logits at every position; the caller has checked memory for every token (or reserved the
    slots: `out_loc`, from reserve_verify_slots)."""
    if out_loc is None:
        out_loc = reserve_verify_slots(reqs, [1 + len(d) for d in drafts], mem)
    table = mem.req_to_token
    dev = table.device
    kv_lens = [r.kv_len for r in reqs]
    seq_lens = [n + 1 + len(d) for n, d in zip(kv_lens, drafts, strict=True)]
    input_ids: list[int] = []
    positions, spans, offset = [], [], 0
    for r, kv, s, d in zip(reqs, kv_lens, seq_lens, drafts, strict=True):
        n = s - kv
        r.kv_len = s
        input_ids += [r.output_ids[-1], *d]
        positions.append(torch.arange(kv, s, dtype=torch.int64, device=dev))
        spans.append(RowSpan(first=offset, count=n, first_pos=kv))
        offset += n
    fb = extend_forward_batch(reqs, input_ids, torch.cat(positions), out_loc, kv_lens, seq_lens, table, kv_pool)
    batch = ScheduleBatch(reqs, ForwardMode.EXTEND, spans, fb, torch.arange(offset, dtype=torch.int64, device=dev))
    batch.drafts = drafts
    return batch


def row_outputs(reqs: Sequence[Req], drafts: Sequence[list[int]]) -> list[list[int]]:
    """The output ids as each verification row sees them: row j of a request follows its
    first j guesses (so its penalties, min_new_tokens and seed step are those of that position)."""
    return [r.output_ids + d[:j] for r, d in zip(reqs, drafts, strict=True) for j in range(len(d) + 1)]


def accepted(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a request gains: its guesses while each equals the target's sample at
    that row, then the first differing sample (or, all kept, the sample after the last)."""
    out = []
    for guess, token in zip(draft, sampled):
        out.append(token)
        if token != guess:
            return out
    out.append(sampled[len(draft)])
    return out
