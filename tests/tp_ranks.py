"""Test harness: the TP ranks of one server as threads of this process, joined by a real
ShmComm, each rank a whole Scheduler. Every call runs on all ranks at once (their
collectives must meet), and every message reaches each rank as its own decoded copy,
as the scheduler loop delivers it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tidal.messages import decode_to_scheduler, encode
from tidal.parallel import ShmComm, create_segment, unlink_segment

SLOT_BYTES = 1 << 20


class RankGroup:
    def __init__(self, size: int, make_rank: Callable[[Any], Any], timeout_s: float = 30.0):
        self.size = size
        self.segment = create_segment(size, SLOT_BYTES)
        self.comms = [ShmComm(self.segment, r, size, SLOT_BYTES, timeout_s=timeout_s) for r in range(size)]
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="tp-rank")
        self.ranks = self.each_comm(make_rank)

    def each_comm(self, fn: Callable[[Any], Any]) -> list:
        return list(self.pool.map(fn, self.comms))

    def each(self, fn: Callable[[Any], Any]) -> list:
        """fn(scheduler) on every rank concurrently; the results in rank order."""
        return list(self.pool.map(fn, self.ranks))

    def handle(self, msg) -> None:
        data = encode(msg)
        self.each(lambda s: s.handle(decode_to_scheduler(data)))

    def replies(self) -> list:
        """Rank 0's replies (the others' are dropped, as the loop does)."""
        out = [s.take_replies() for s in self.ranks]
        return out[0]

    @property
    def lead(self):
        return self.ranks[0]

    def close(self) -> None:
        for s in self.ranks:
            s.shutdown()
        self.pool.shutdown()
        for c in self.comms:
            c.close()
        unlink_segment(self.segment)
