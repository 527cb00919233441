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


def poll_and_all_reduce(pollers: Sequence[Pollable], group: Optional[Any] = None) -> list[KVPoll]:
    """Poll every sender/receiver; with a torch.distributed group, agree across ranks with MIN.

    One Failed rank fails the request on every rank; Success needs every rank's Success.
    """
    polls = [int(p.poll()) for p in pollers]
    if group is not None:  # every rank must call it, even with nothing to poll
        import torch
        import torch.distributed as dist

        t = torch.tensor(polls, dtype=torch.uint8, device="cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        polls = t.tolist()
    return [KVPoll(p) for p in polls]
