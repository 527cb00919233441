"""NullRole: colocated serving. Prefill first, then decode the running batch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tidal.messages import FinishReason
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tidal.roles.loop import RoleLoop


class NullRole:
    name = "null"

    def __init__(self, sched: RoleLoop):
        self.s = sched

    def accept(self, req: Req) -> None:
        if req.bootstrap_room is not None:
            # a prefill/decode pairing sent here would leave its partner waiting for KV
            req.finish(FinishReason(type="abort", status_code=503,
                                    message="this server is in null mode, not a prefill/decode partner"))
            self.s.emit(req)
            return
        self.s.waiting_queue.append(req)

    def advance_queues(self) -> None:
        return None

    def next_batch(self) -> Optional[ScheduleBatch]:
        return self.s.planner.prefill_or_decode()

    def process_result(self, batch: ScheduleBatch, result) -> None:
        self.s.planner.process_result(batch, result)

    def abort(self, rid: str, abort_all: bool) -> None:
        return None

    def on_dequeued_abort(self, req: Req) -> None:
        return None

    def extra_live_reqs(self) -> list[Req]:
        return []

    def queued_reqs(self) -> list[Req]:
        return []

    def queued_prefill_tokens(self) -> int:
        return 0

    def is_idle(self) -> bool:
        return True

    def queue_sizes(self) -> dict:
        return {}

    def activate(self) -> None:
        return None

    def deactivate(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
