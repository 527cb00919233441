"""Priority scheduling (--enable-priority-scheduling): queue order, preemption victims, the queue limit.

A request's `priority` is an int (absent: 0). By default larger values are served first (as
SGLang); --schedule-low-priority-values-first reverses that. Everything here is pure over its
arguments; the scheduler, the batch planner and the PD roles call it.
"""

from __future__ import annotations

from typing import Optional

from tidal.scheduler.req import Req


class PriorityRules:
    def __init__(self, args):
        self.enabled: bool = args.enable_priority_scheduling
        self.low_first: bool = args.schedule_low_priority_values_first
        self.max_queued: Optional[int] = args.max_queued_requests

    def rank(self, req: Req) -> int:
        """Smaller is served first."""
        return req.priority if self.low_first else -req.priority

    def order(self, queue: list[Req]) -> None:
        """Sort `queue` in place by priority; a stable sort, so within one priority the order
        the schedule policy (or arrival) gave stays."""
        if self.enabled:
            queue.sort(key=self.rank)

    def outranks(self, a: Req, b: Req) -> bool:
        """True when `a` is served strictly before `b`."""
        return self.enabled and self.rank(a) < self.rank(b)

    def preemption_victims(self, req: Req, running: list[Req]) -> list[Req]:
        """Running requests that `req` outranks, in the order to retract them: the lowest
        priority first and, within one priority, the one admitted last first (least work lost)."""
        candidates = [r for r in reversed(running) if self.outranks(req, r)]
        return sorted(candidates, key=lambda r: -self.rank(r))

    def displaced_by(self, req: Req, queued: list[Req]) -> Optional[Req]:
        """When the queue is full: the queued request `req` takes the place of (the lowest
        priority, the latest arrival among equals), or None when `req` outranks none."""
        victims = self.preemption_victims(req, queued)
        return victims[0] if victims else None

    def queue_full(self, num_queued: int) -> bool:
        return self.max_queued is not None and num_queued >= self.max_queued
