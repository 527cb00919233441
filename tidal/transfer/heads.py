"""Which KV heads each TP rank's pool holds, and where a decode rank reads them from when
prefill and decode run different TP sizes (M:N).

A model's KV heads are split over the ranks as tidal.parallel.sharding does: with at
least as many heads as ranks each rank holds a contiguous block; with fewer, each head is
replicated on size / heads ranks. A decode rank reads each of its heads from one prefill
rank that holds it (replicas are spread over the decode ranks), so it reads only the
ranks and head ranges it needs; every prefill rank knows from the same function which
decode ranks read from it. A prefill rank whose heads nobody reads (a replica, when
prefill has more ranks than heads) is still paired with one decode rank through an
empty slice, so that every prefill rank learns when the request's transfer is over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def split_problem(total_heads: int, tp_size: int) -> Optional[str]:
    """Why `tp_size` ranks cannot hold `total_heads` KV heads, or None."""
    if total_heads < 1 or tp_size < 1:
        return f"need at least one KV head and one rank, got {total_heads} heads over {tp_size} ranks"
    if total_heads % tp_size and tp_size % total_heads:
        return f"{total_heads} KV heads cannot be split over {tp_size} ranks (need a multiple or a divisor)"
    return None


@dataclass(frozen=True)
class HeadLayout:
    total_heads: int
    tp_size: int

    def __post_init__(self):
        problem = split_problem(self.total_heads, self.tp_size)
        if problem:
            raise ValueError(problem)

    def heads_of(self, rank: int) -> range:
        """The model's KV heads in rank's pool, in pool order."""
        if self.total_heads >= self.tp_size:
            per = self.total_heads // self.tp_size
            return range(rank * per, (rank + 1) * per)
        head = rank * self.total_heads // self.tp_size
        return range(head, head + 1)

    def owners(self, head: int) -> list[int]:
        return [r for r in range(self.tp_size) if head in self.heads_of(r)]


@dataclass(frozen=True)
class HeadSlice:
    """Heads [src_start, src_start + count) of a prefill rank's pool go to heads
    [dst_start, dst_start + count) of a decode rank's pool."""

    src_start: int
    dst_start: int
    count: int
    src_heads: int  # heads in the prefill rank's pool
    dst_heads: int  # heads in the decode rank's pool

    @property
    def whole(self) -> bool:
        """Every head of both pools, in place: pages move as they are."""
        return self.src_start == self.dst_start == 0 and self.count == self.src_heads == self.dst_heads

    @staticmethod
    def all_of(heads: int) -> "HeadSlice":
        return HeadSlice(0, 0, heads, heads, heads)


def _reads(prefill: HeadLayout, decode: HeadLayout, decode_rank: int) -> dict[int, HeadSlice]:
    mine = decode.heads_of(decode_rank)
    picked: dict[int, list[int]] = {}
    for head in mine:
        owners = prefill.owners(head)
        picked.setdefault(owners[decode_rank % len(owners)], []).append(head)
    out = {}
    for rank, heads in picked.items():
        theirs = prefill.heads_of(rank)
        out[rank] = HeadSlice(heads[0] - theirs.start, heads[0] - mine.start, len(heads), len(theirs), len(mine))
    return out


def sources(prefill: HeadLayout, decode: HeadLayout, decode_rank: int) -> dict[int, HeadSlice]:
    """prefill rank -> the slice decode_rank reads from it (count 0: only the completion), ranks in order."""
    if prefill.total_heads != decode.total_heads:
        raise ValueError(f"prefill has {prefill.total_heads} KV heads, decode {decode.total_heads}")
    out = _reads(prefill, decode, decode_rank)
    read = {p for d in range(decode.tp_size) for p in _reads(prefill, decode, d)}
    mine = len(decode.heads_of(decode_rank))
    for rank in range(prefill.tp_size):
        if rank not in read and rank % decode.tp_size == decode_rank:
            out[rank] = HeadSlice(0, 0, 0, len(prefill.heads_of(rank)), mine)
    return dict(sorted(out.items()))


def readers(prefill: HeadLayout, decode: HeadLayout, prefill_rank: int) -> list[int]:
    """The decode ranks paired with prefill_rank (at least one)."""
    return [d for d in range(decode.tp_size) if prefill_rank in sources(prefill, decode, d)]
