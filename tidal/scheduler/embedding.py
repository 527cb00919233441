"""Embedding requests in the scheduler (`--is-embedding`): a prefill pass, pooled, then freed.

An embedding request goes straight to the scheduler's waiting queue in every role (null,
prefill, decode): it needs only its own prefill, so no KV is transferred. The pass that
contains embedding requests runs `runner.forward_with_hidden`; each request's rows are pooled
into its `PoolState` chunk by chunk; after its last chunk the request finishes with its
embedding and its KV and req slot are released at once (the server runs with the radix cache
disabled, so nothing is kept or reused).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tidal.messages import FinishReason
from tidal.model.pooling import PoolingConfig, PoolState
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tidal.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

NOT_EMBEDDING_SERVER = "this server is not an embedding model; start it with --is-embedding"


class Embedder:
    def __init__(self, sched: "Scheduler", pooling: PoolingConfig):
        self.s = sched
        self.pooling = pooling
        logger.info("embedding model: pooling %s", pooling.describe())

    def pool(self, batch: ScheduleBatch, hidden: torch.Tensor) -> None:
        """Add each embedding request's rows of this pass (hidden [T, H]) to its pool."""
        fb = batch.forward_batch
        offset = 0
        for req, prefix, n in zip(batch.reqs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            if req.is_embedding:
                if req.pool_state is None:
                    req.pool_state = PoolState(self.pooling.method)
                req.pool_state.add(hidden[offset : offset + n], prefix)
            offset += n

    def finish(self, req: Req) -> None:
        """After its last chunk (the planner handled the earlier ones): finish with the pooled
        embedding, or the abort asked for, and free everything at once."""
        if req.to_abort:
            req.finish(FinishReason(type="abort", message=req.to_abort))
        else:
            req.embedding = req.pool_state.result(self.pooling.normalize)
            req.finish(FinishReason(type="length", length=0))
        req.pool_state = None
        self.s.mem.release(req)
        self.s.emit(req)
