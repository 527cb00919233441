"""The scheduler: one loop, requests, memory, and the active role strategy."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from tidal.config import ServerArgs
from tidal.messages import (
    AbortReq,
    FinishReason,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    ModeStatusReq,
    PrepareModeReq,
    ReqOutput,
    StatsReq,
    StatsResp,
    SwitchModeReq,
    ToApi,
    ToScheduler,
)
from tidal.model.sampler import Sampler, SamplingBatchInfo
from tidal.scheduler.batching import BatchPlanner
from tidal.scheduler.memory import KVMemory
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch
from tidal.scheduler.stats import SchedulerStats
from tidal.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns every live Req, the KV memory and the runner; the role decides what runs."""

    def __init__(self, args: ServerArgs, runner: Any, tokenizer: Any = None):
        from tidal.parallel import SingleRank

        self.args = args
        self.runner = runner
        self.tp = getattr(runner, "tp", None) or SingleRank()  # every rank runs this same loop
        cfg = runner.model_config
        self.context_length = args.context_length or cfg.context_length
        self.max_running_requests = args.max_running_requests
        self.mem = KVMemory(
            max_total_tokens=runner.max_total_tokens,
            page_size=args.page_size,
            # a second set of rows for decode's pre-allocated (transferring) requests
            max_reqs=2 * args.max_running_requests + 8,
            max_context_len=self.context_length + args.page_size + 8,
            disable_radix_cache=args.disable_radix_cache,
            device=runner.device,
            debug=args.enable_integrity_check,
        )
        self.max_req_input_len = min(self.context_length - 1, runner.max_total_tokens - 1)
        self.stop = StopChecker(tokenizer, list(cfg.eos_token_ids), self.context_length)
        self.sampler = Sampler()
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.planner = BatchPlanner(self)
        self.stats = SchedulerStats()
        self.outbox: list[ReqOutput] = []
        self.replies: list[ToApi] = []
        from tidal.roles import create_role
        from tidal.roles.controller import ModeController

        self.role = create_role(args.disaggregation_mode, self)
        self.controller = ModeController(self)

    # ------------------------------------------------------------------ inputs

    def handle(self, msg: ToScheduler) -> None:
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.abort_all)
        elif isinstance(msg, FlushCacheReq):
            ok = self.flush_cache()
            text = "Cache flushed." if ok else "Cache not flushed: requests are running or waiting."
            self.replies.append(FlushCacheResp(call_id=msg.call_id, success=ok, message=text))
        elif isinstance(msg, StatsReq):
            self.replies.append(self.make_stats(msg.call_id))
        elif isinstance(msg, SwitchModeReq):
            reply = self.controller.on_switch(msg)
            if reply is not None:
                self.replies.append(reply)
        elif isinstance(msg, PrepareModeReq):
            self.replies.append(self.controller.on_prepare(msg))
        elif isinstance(msg, ModeStatusReq):
            self.replies.append(self.controller.status(msg.call_id))

    def add_request(self, msg: GenerateReq) -> None:
        req = Req(msg)
        error = self._validate(req)
        refusal = self._refusal(msg) if error is None else None
        if error or refusal:
            message, code = (error, 400) if error else refusal
            req.finish(FinishReason(type="abort", message=message, status_code=code))
            self.outbox.append(req.take_output(final=True))
            return
        self.role.accept(req)

    def _refusal(self, msg: GenerateReq) -> Optional[tuple[str, int]]:
        """Why this server will not take the request now (the client should go elsewhere)."""
        if not self.controller.admitting:
            return f"the server is draining for a switch to {self.controller.target} mode; retry elsewhere", 503
        mode, epoch = self.role.name, self.controller.epoch
        if msg.expected_mode is not None and msg.expected_mode != mode:
            return f"the server is in {mode} mode (epoch {epoch}), not {msg.expected_mode}", 409
        if msg.expected_epoch is not None and msg.expected_epoch != epoch:
            return f"the server is at epoch {epoch} ({mode} mode), not {msg.expected_epoch}", 409
        return None

    def _validate(self, req: Req) -> Optional[str]:
        n = len(req.origin_input_ids)
        if n == 0:
            return "The input is empty."
        if n > self.max_req_input_len:
            return (
                f"The input ({n} tokens) is longer than the maximum allowed "
                f"({self.max_req_input_len} tokens, context length {self.context_length})."
            )
        vocab = self.runner.model_config.vocab_size
        if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= vocab:
            return f"Input token ids must be in [0, {vocab})."
        try:
            req.sampling.validate(vocab)
        except ValueError as e:
            return str(e)
        room = self.context_length - n
        if req.sampling.max_new_tokens > room:
            req.sampling.max_new_tokens = room
        return None

    def abort(self, rid: str, abort_all: bool = False) -> None:
        def match(r: Req) -> bool:
            return abort_all or r.rid == rid

        for r in [r for r in self.waiting_queue if match(r)]:
            self.waiting_queue.remove(r)
            self.role.on_dequeued_abort(r)
            r.finish(FinishReason(type="abort", message="Request aborted."))
            self.outbox.append(r.take_output(final=True))
        for r in self.live_reqs():
            if match(r):
                r.to_abort = "Request aborted."
        self.role.abort(rid, abort_all)

    def flush_cache(self) -> bool:
        if self.waiting_queue or self.live_reqs():
            return False
        return self.mem.flush()

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to run."""
        self.controller.on_iteration()
        self.role.advance_queues()
        batch = self.role.next_batch()
        if batch is None:
            return False
        result = self.run_batch(batch)
        self.role.process_result(batch, result)
        return True

    def run_batch(self, batch: ScheduleBatch):
        logits = self.runner.forward(batch.forward_batch, batch.logit_rows)
        last_rows = torch.tensor([s.last for s in batch.spans], dtype=torch.int64)
        sample_logits = logits if len(last_rows) == logits.shape[0] else logits[last_rows]
        reqs = batch.reqs
        info = SamplingBatchInfo.build(
            [r.sampling for r in reqs],
            [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs],
            self.runner.model_config.vocab_size,
            sample_logits.device,
            list(self.stop.eos_ids),
        )
        out = self.sampler.sample(
            sample_logits,
            info,
            [r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            any(r.return_logprob for r in reqs),
        )
        if self.tp.size > 1:  # rank 0's draw, so every rank's requests continue identically
            out.next_token_ids = self.tp.broadcast_tensor(out.next_token_ids)
        self.stats.on_batch(batch)
        return logits, out

    def live_reqs(self) -> list[Req]:
        """Requests that hold KV or a req slot (for integrity checks and aborts)."""
        live = list(self.running)
        if self.planner.chunked_req is not None:
            live.append(self.planner.chunked_req)
        return live + self.role.extra_live_reqs()

    def is_idle(self) -> bool:
        return not self.waiting_queue and not self.live_reqs() and self.role.is_idle()

    def set_cache(self, cache) -> None:
        """Swap the prefix cache (role switches); everything that matches prefixes follows."""
        self.mem.tree_cache = cache
        self.planner.policy.tree_cache = cache

    def shutdown(self) -> None:
        self.controller.shutdown()
        self.role.shutdown()
        pool = getattr(self.runner, "kv_pool", None)
        if pool is not None and hasattr(pool, "close"):
            pool.close()

    def check_integrity(self) -> None:
        self.mem.check_integrity(self.live_reqs())

    # ------------------------------------------------------------------ outputs

    def emit(self, req: Req) -> None:
        if req.finished:
            self.outbox.append(req.take_output(final=True))
        elif req.stream and len(req.output_ids) - req.sent_len >= self.args.stream_interval:
            self.outbox.append(req.take_output(final=False))

    def take_outbox(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out

    def take_replies(self) -> list[ToApi]:
        out, self.replies = self.replies, []
        return out

    def make_stats(self, call_id: int) -> StatsResp:
        used = self.mem.used_tokens()
        total = self.mem.max_total_tokens
        s = self.stats
        return StatsResp(
            call_id=call_id,
            num_running_reqs=len(self.live_reqs()),
            num_waiting_reqs=len(self.waiting_queue) + self.role.num_queued(),
            num_used_tokens=used,
            max_total_tokens=total,
            token_usage=used / max(total, 1),
            cache_hit_rate=s.cache_hit_rate(),
            gen_throughput=s.gen_throughput(time.monotonic()),
            num_retracted_total=s.num_retracted,
            num_prefill_batches=s.num_prefill_batches,
            num_decode_batches=s.num_decode_batches,
            max_decode_batch_size=s.max_decode_batch_size,
            total_prompt_tokens=s.total_prompt_tokens,
            total_cached_tokens=s.total_cached_tokens,
            disaggregation_mode=self.role.name,
            epoch=self.controller.epoch,
            queue_sizes={"waiting": len(self.waiting_queue), "running": len(self.running),
                         **self.role.queue_sizes()},
            **self._transfer_stats(),
        )

    def _transfer_stats(self) -> dict:
        transfer = getattr(self.role, "transfer", None)
        if transfer is None:
            return {}
        t = transfer.stats()
        return {
            "transfer_bytes": t["transferred_bytes"],
            "transfer_succeeded": t["succeeded"],
            "failed_bootstraps": t["failed_bootstraps"],
            "failed_transfers": t["failed_transfers"],
            "transfer_latency_histogram": t["latency_histogram"],
            "transfer_latency_sum": float(sum(t["latencies_s"])),
        }
