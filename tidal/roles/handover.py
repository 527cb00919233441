"""HandoverRole: a decode server that switched to prefill or null without draining its answers.

The new role serves from the switch on (new requests, the router's new pool, the epoch); the
decode role it replaced accepts nothing more and keeps only what it already holds: the PD
requests still waiting for their prompt's KV (its prealloc and transfer queues, polled as
before) and, through the scheduler's running batch, the answers being decoded. The
controller drops it once it holds nothing (`retired`).

Under null the running batch is null's own: null decodes it as it decodes every request.
Under prefill, which runs prefill passes only, the handed-over answers get every other
pass while prompts wait, and every pass when none do; a handed-over request that goes
back to the waiting queue (retracted) is prefilled and decoded here (PrefillRole serves a
request without a PD partner that way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from tidal.model.forward_batch import ForwardMode
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tidal.scheduler.scheduler import Scheduler

HANDOVER_SOURCES = ("decode",)
HANDOVER_TARGETS = ("prefill", "null")


class HandoverRole:
    def __init__(self, sched: "Scheduler", new: Any, old: Any) -> None:
        self.s, self.new, self.old = sched, new, old
        self.name = new.name
        self._answers_next = False  # prefill: the handed-over answers run the next pass

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
        planner = self.s.planner
        if self._answers_next:
            self._answers_next = False
            batch = planner.new_decode_batch()
            if batch is not None:
                return batch
        batch = self.new.next_batch()
        if batch is not None:
            self._answers_next = bool(self.s.running)
            return batch
        return planner.new_decode_batch()

    def process_result(self, batch: ScheduleBatch, result) -> None:
        if batch.mode is ForwardMode.DECODE:
            self.s.planner.process_result(batch, result)
        else:
            self.new.process_result(batch, result)

    def retired(self) -> bool:
        """The decode role holds nothing, and (under prefill) no handed-over request is left."""
        if not self.old.is_idle():
            return False
        if self.name == "null":
            return True
        s = self.s
        return not s.running and all(getattr(r, "pd", None) is not None for r in s.waiting_queue) \
            and (s.planner.chunked_req is None or s.planner.chunked_req.pd is not None)

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
