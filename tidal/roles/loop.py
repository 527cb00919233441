"""What a role may use of the scheduler loop: `RoleLoop`, and `ControllerLoop` for the mode controller.

The dependency runs one way: `tidal/scheduler/scheduler.py` builds the roles and hands them
itself, and no module under `tidal/roles` imports `tidal.scheduler.scheduler` (not even for
typing); a role sees the loop only through the protocols below, so this file is the whole of
what a role can touch (`tests/test_roles_protocol.py` checks both, and that `Scheduler`
provides every member). The loop runs one thread: a role is called between passes, never
beside one, and every TP rank calls it in the same order with the same requests.

Roles still import plain data and helper modules of `tidal/scheduler`: `req` (Req),
`schedule_batch` (ScheduleBatch), `batching` (the BatchPlanner's type and small per-request
helpers), `memory`, `priority`, `lora`, `stats`, `stop`. Those are data and the loop's parts,
reached here through the loop's members; they are not the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch

    from tidal.config import ServerArgs
    from tidal.messages import ReqOutput, ToApi
    from tidal.scheduler.batching import BatchPlanner
    from tidal.scheduler.lora import LoRAScheduling
    from tidal.scheduler.memory import KVMemory
    from tidal.scheduler.priority import PriorityRules
    from tidal.scheduler.req import Req
    from tidal.scheduler.stats import SchedulerStats
    from tidal.scheduler.stop import StopChecker


class RankGroup(Protocol):
    """This rank's tensor-parallel group (`tidal.parallel`: SingleRank or ShmComm), as roles use it."""

    rank: int  # this rank, 0 .. size - 1; rank 0 runs what runs once per server (the bootstrap server)
    size: int  # the number of TP ranks, 1 without TP

    def all_gather_ints(self, values: Sequence[int]) -> np.ndarray:
        """Every rank's `values`, [size, len(values)]; every rank must call it, in the same order."""

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, by rank; every rank must call it, in the same order."""


class RoleRunner(Protocol):
    """The model runner, as the PD roles read it to set up the KV transfer (nothing runs a pass)."""

    kv_pool: Any  # the KV pool (its buffers are what a transfer reads or writes)
    dtype: torch.dtype  # the KV dtype, which both sides of a transfer must share
    model_config: Any  # the model's config (`num_kv_heads`: the KV heads before TP sharding)


class RoleLoop(Protocol):
    """The scheduler loop as a role sees it; every member here, nothing else."""

    args: ServerArgs  # the server's flags; read only
    tp: RankGroup  # this rank's TP group (agreement on polls and batches)
    runner: RoleRunner  # read only, for the transfer's KV layout
    mem: KVMemory  # req slots, KV pages, their release and caching; the prefix cache through `tree_cache`
    planner: BatchPlanner  # the batch steps roles compose (new_prefill_batch, prefill_or_decode, ...)
    waiting_queue: list[Req]  # requests to prefill here, in order; roles append what they admit
    running: list[Req]  # the running batch (decoding); changed only through the planner
    max_running_requests: int  # --max-running-requests: the running batch's bound
    priority: PriorityRules  # `order(queue)`: sorts a role's queue by priority (a no-op when off)
    lora: LoRAScheduling  # `fits(req, running)`: whether its adapter fits beside the running batch
    stats: SchedulerStats  # `on_prompt(n, cached)`: counts a prompt prefilled elsewhere (decode)
    stop: StopChecker  # `check(req)`: ends a request on EOS, stop tokens or strings, or length
    transfer_pool: Any  # what a KV transfer moves: the runner's KV pool, a draft model's stacked under it

    @property
    def tree_cache(self) -> Any:
        """The prefix cache in use (a radix tree, or one without sharing); replaced only by `set_cache`."""

    @property
    def chunked_req(self) -> Optional[Req]:
        """The request whose chunked prefill is midway (the next prefill batch continues it), or None."""

    def emit(self, req: Req) -> None:
        """Queue the request's new output (its final one once finished) for the API process."""

    def live_reqs(self) -> list[Req]:
        """Every request holding KV or a req slot: running, chunked, in flight, and the role's own."""


class ControllerLoop(RoleLoop, Protocol):
    """The loop as the mode controller (`roles/controller.py`) sees it: a role's view, plus the role slot
    it swaps and the checks a switch needs."""

    role: Any  # the active role; only the controller replaces it, between iterations
    replies: list[ToApi]  # answers to control messages; the controller appends a switch's late answer
    outbox: list[ReqOutput]  # outputs for the API process; the migrator appends a moving request's tickets
    migrator: Any  # tidal.roles.migration.Migrator: running requests that move to another server
    inflight: Optional[Any]  # not None while a pass is in flight (overlap); read only

    def drain(self) -> bool:
        """Wait for the pass in flight and process its result; False if there was none."""

    def is_idle(self) -> bool:
        """No request anywhere: no pass in flight, queues empty, no live request, the role idle."""

    def set_cache(self, cache: Any) -> None:
        """Swap the prefix cache (everything that matches prefixes follows)."""
