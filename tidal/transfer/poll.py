"""Transfer status of one request, ordered so that several ranks agree with MIN."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Optional, Protocol, Sequence


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


# a request's transfer ends in one of these; nothing changes afterwards
TERMINAL_POLLS = (KVPoll.Success, KVPoll.Failed)


class Pollable(Protocol):
    def poll(self) -> KVPoll: ...


def poll_and_all_reduce(pollers: Sequence[Pollable], comm: Optional[Any] = None) -> list[KVPoll]:
    """Poll every sender/receiver; with a TP communicator (tidal.parallel), agree across ranks.

    Every rank must call it with the same requests in the same order. Success needs every
    rank's Success; otherwise the least advanced state wins (MIN), except for failures:
    once any rank failed a request, the ranks where it still runs abort their side, and
    the agreed state is Failed only when every rank's side has stopped (Failed), so no
    rank frees pages a partner may still be writing into. Until then it reads
    Bootstrapping (not done, not progressing).
    """
    polls = [int(p.poll()) for p in pollers]
    if comm is None or comm.size == 1 or not polls:
        return [KVPoll(p) for p in polls]
    every = comm.all_gather_ints(polls)  # [ranks, n]
    lowest, highest = every.min(axis=0), every.max(axis=0)
    agreed = []
    for poller, mine, lo, hi in zip(pollers, polls, lowest, highest):
        if lo != KVPoll.Failed:
            agreed.append(KVPoll(int(lo)))
            continue
        if mine != KVPoll.Failed and hasattr(poller, "abort"):
            poller.abort()
        agreed.append(KVPoll.Failed if hi == KVPoll.Failed else KVPoll.Bootstrapping)
    return agreed
