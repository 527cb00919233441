"""HandoverRole: a server that switched role without draining what it held.

A decode server switches to prefill or null this way, and a null server to prefill. The new
role serves from the switch on (new requests, the router's new pool, the epoch); the role it
replaced accepts nothing more and keeps only what it already holds: a decode role the PD
requests still waiting for their prompt's KV (its prealloc and transfer queues, polled as
before) and, through the scheduler's running batch, the answers being decoded; a null role
its answers and the prompts it had not prefilled yet, which the prefill role prefills and
decodes here as requests without a PD partner. The controller drops the old role once it
holds nothing (`retired`).

Under null the running batch is null's own: null decodes it as it decodes every request.
Under prefill, which runs prefill passes only, the handed-over answers get as much time as
the prompts while prompts wait (after a prefill pass, decode passes until they have taken
as long), and every pass when none do: a prefill pass takes many decode steps' time, so
alternating pass for pass would stretch their time per token by that much. A handed-over
request that goes back to the waiting queue (retracted) is prefilled and decoded here
(PrefillRole serves a request without a PD partner that way).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from tidal.model.forward_batch import ForwardMode
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tidal.roles.loop import RoleLoop


class HandoverRole:
    def __init__(self, sched: RoleLoop, new: Any, old: Any) -> None:
        self.s, self.new, self.old = sched, new, old
        self.name = new.name
        self.answers_owed_s = 0.0  # prefill: decode time the handed-over answers are owed
        self.replaced_cache = False  # the switch put a new kind of prefix cache under the requests (reroot)
        self._batch_started = 0.0

    def reroot(self, root: Any) -> None:
        """Under a new radix cache (the decode role's had no sharing) every request held owns all its KV.
        (A null role's radix cache stays under prefill: its requests keep their prefix locks.)"""
        s = self.s
        self.replaced_cache = True
        for req in [*s.live_reqs(), *s.waiting_queue, *self.old.queued_reqs()]:
            req.last_node = root
            req.prefix_indices = req.prefix_indices[:0]

    @property
    def transfer(self) -> Any:
        return getattr(self.new, "transfer", None)

    def accept(self, req: Req) -> None:
        self.new.accept(req)

    def advance_queues(self) -> None:
        self.old.advance_queues()
        self.new.advance_queues()

    def next_batch(self) -> Optional[ScheduleBatch]:
        if self.name == "null":
            return self.new.next_batch()
        self._batch_started = time.monotonic()
        planner = self.s.planner
        batch = planner.new_decode_batch() if self._answers_first() else None
        if batch is None:
            batch = self.new.next_batch() or planner.new_decode_batch()
        if not self.s.running:
            self.answers_owed_s = 0.0
        return batch

    def _answers_first(self) -> bool:
        """The answers are owed time; with TP, rank 0's clock decides (every rank builds the same batch)."""
        owed = self.answers_owed_s > 0
        if self.s.tp.size == 1:
            return owed
        return bool(self.s.tp.all_gather_ints([int(owed)])[0, 0])

    def process_result(self, batch: ScheduleBatch, result) -> None:
        took = time.monotonic() - self._batch_started  # the pass ran in between (prefill: never overlapped)
        if batch.mode is ForwardMode.DECODE:
            self.s.planner.process_result(batch, result)
            if self.name != "null":
                self.answers_owed_s = max(self.answers_owed_s - took, 0.0)
        else:
            self.new.process_result(batch, result)
            if self.s.running:
                self.answers_owed_s += took

    def retired(self) -> bool:
        """The old role holds nothing, and (under prefill) no handed-over request is left: a request
        without a PD partner that is not an embedding (those are computed here in every role)."""
        if not self.old.is_idle():
            return False
        if self.name == "null":
            return True
        s = self.s
        chunked = s.chunked_req
        mine = [r for r in s.waiting_queue + ([chunked] if chunked is not None else []) if not r.is_embedding]
        return not s.running and all(r.pd is not None for r in mine)

    def abort(self, rid: str, abort_all: bool) -> None:
        self.old.abort(rid, abort_all)
        self.new.abort(rid, abort_all)

    def on_dequeued_abort(self, req: Req) -> None:
        self.new.on_dequeued_abort(req)

    def extra_live_reqs(self) -> list[Req]:
        return self.old.extra_live_reqs() + self.new.extra_live_reqs()

    def queued_reqs(self) -> list[Req]:
        return self.old.queued_reqs() + self.new.queued_reqs()

    def queued_prefill_tokens(self) -> int:
        return self.new.queued_prefill_tokens()

    def is_idle(self) -> bool:
        return self.old.is_idle() and self.new.is_idle()

    def queue_sizes(self) -> dict:
        return {**self.new.queue_sizes(), **{f"handover_{k}": v for k, v in self.old.queue_sizes().items()}}

    def activate(self) -> None:
        self.new.activate()

    def deactivate(self) -> None:
        self.new.deactivate()

    def shutdown(self) -> None:
        self.old.shutdown()
        self.new.shutdown()
