"""The role strategy interface: what one scheduler loop delegates to its active role.

(What a role may use of the loop in turn is `tidal.roles.loop.RoleLoop`.)"""

from __future__ import annotations

from typing import Optional, Protocol

from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch


class Role(Protocol):
    name: str

    def accept(self, req: Req) -> None:
        """Take a validated new request."""

    def advance_queues(self) -> None:
        """Move requests between the role's own queues (bootstrap, transfer, ...)."""

    def next_batch(self) -> Optional[ScheduleBatch]:
        """The batch to run now, or None when there is nothing to run."""

    def process_result(self, batch: ScheduleBatch, result) -> None:
        """Apply one forward pass's result."""

    def abort(self, rid: str, abort_all: bool) -> None:
        """Abort requests held in the role's own queues."""

    def on_dequeued_abort(self, req: Req) -> None:
        """A waiting request was aborted before it held memory."""

    def extra_live_reqs(self) -> list[Req]:
        """Requests holding memory in the role's own queues."""

    def queued_reqs(self) -> list[Req]:
        """Requests in the role's own queues (reported as waiting); the queue itself, not to be changed."""

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens in the role's own queues that this server will still prefill."""

    def is_idle(self) -> bool:
        """True when the role's own queues are empty."""
