"""What the prefill and decode roles share: their transfer components and per-request PD state."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from tidal.messages import FinishReason
from tidal.scheduler.req import Req

if TYPE_CHECKING:
    from tidal.roles.loop import RoleLoop

logger = logging.getLogger(__name__)

METADATA_SLOTS_PER_RUNNING_REQ = 2


@dataclass
class PDState:
    """A request's side of one prefill->decode KV transfer."""

    peer: Any  # KVSender on prefill, KVReceiver on decode
    room: int
    metadata_idx: Optional[int] = None
    pages_sent: int = 0  # prefill: whole pages handed to the sender so far
    extra: dict = field(default_factory=dict)


def kv_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class TransferComponents:
    """A KV manager and metadata slots for one role; `shutdown()` releases all of it."""

    def __init__(self, sched: RoleLoop, mode: str, bootstrap_port: Optional[int]):
        from tidal.transfer import KVArgs, MetadataBuffers, create_kv_manager

        args = sched.args
        self.metadata = MetadataBuffers(METADATA_SLOTS_PER_RUNNING_REQ * args.max_running_requests + 16,
                                        args.max_logprobs)
        kv_args = KVArgs(
            engine_rank=sched.tp.rank,  # the partner may run another TP size: heads are sliced (transfer.heads)
            tp_size=sched.tp.size,
            total_kv_heads=sched.runner.model_config.num_kv_heads,
            kv_pool=sched.transfer_pool,
            metadata=self.metadata,
            page_size=args.page_size,
            kv_dtype=kv_dtype_name(sched.runner.dtype),
            host=args.host if args.host not in ("0.0.0.0", "") else "127.0.0.1",
            bootstrap_key=args.disaggregation_bootstrap_key,
        )
        self.manager = create_kv_manager(args.disaggregation_transfer_backend, kv_args, mode, bootstrap_port)
        # a draft model's KV arrives with the target's (tidal/kvcache/kv_pool.py StackedKVPool)
        self.carries_draft = getattr(sched.transfer_pool, "draft_layers", 0) > 0

    def register(self, bootstrap_port: int) -> None:
        """Announce this prefill rank to the bootstrap server (rank 0's; retried while it comes up)."""
        self.manager.register(bootstrap_port)  # a no-op for the fake backend

    def forget_registration(self) -> None:
        if hasattr(self.manager, "forget_registration"):
            self.manager.forget_registration()

    def stats(self) -> dict:
        return self.manager.stats()

    def shutdown(self) -> None:
        self.manager.shutdown()


def bootstrap_addr_of(req: Req, args: Any) -> str:
    port = req.bootstrap_port if req.bootstrap_port is not None else args.disaggregation_bootstrap_port
    return f"{req.bootstrap_host}:{port}"


def page_indices(sched: RoleLoop, req: Req, first_page: int, end_token: int, include_partial: bool) -> np.ndarray:
    """Page ids holding the request's tokens from page `first_page` up to `end_token`."""
    ps = sched.mem.page_size
    last_page = -(-end_token // ps) if include_partial else end_token // ps
    if last_page <= first_page:
        return np.empty(0, dtype=np.int64)
    slots = sched.mem.req_to_token[req.req_pool_idx, first_page * ps : last_page * ps : ps]
    return (slots // ps).numpy().astype(np.int64)


def fail_request(sched: RoleLoop, req: Req, reason: str, status_code: int = 500) -> None:
    """End a PD request with a clear error; its KV goes back (both sides free theirs)."""
    logger.warning("request %s failed: %s", req.rid, reason)
    req.finish(FinishReason(type="abort", message=reason, status_code=status_code))
    sched.mem.release(req)
    sched.emit(req)


def failure_reason(peer: Any, default: str) -> str:
    exc = peer.failure_exception()
    return f"{default}: {exc}" if exc is not None else default
