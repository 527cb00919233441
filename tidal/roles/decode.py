"""DecodeRole: receive the prompt's KV from a prefill server, then decode to the end.

Queues: prealloc (the KV receiver bootstraps; when memory allows, KV slots for the
prompt are pre-allocated and their pages sent to prefill as the destination) ->
transfer (polled until the pages and the first token's metadata landed) -> the
running batch, as a prebuilt request whose prefill is not recomputed. Requests
without bootstrap fields (the router's fallback) and retracted requests are
prefilled locally through the scheduler's waiting queue.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from tidal.roles.pd_common import (
    PDState,
    TransferComponents,
    bootstrap_addr_of,
    fail_request,
    failure_reason,
    page_indices,
)
from tidal.scheduler.batching import finish_if_prompt_only, grammar_step
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tidal.roles.loop import RoleLoop

logger = logging.getLogger(__name__)


class DecodeRole:
    name = "decode"

    def __init__(self, sched: RoleLoop):
        self.s = sched
        self.transfer = TransferComponents(sched, "decode", None)
        self.prealloc_queue: list[Req] = []
        self.transfer_queue: list[Req] = []
        self._polls = 0

    def accept(self, req: Req) -> None:
        if req.bootstrap_room is None or not req.bootstrap_host:
            self.s.waiting_queue.append(req)  # no prefill partner: prefill locally
            return
        from tidal.transfer import create_kv_receiver

        peer = create_kv_receiver(self.transfer.manager, bootstrap_addr_of(req, self.s.args), req.bootstrap_room)
        req.pd = PDState(peer=peer, room=req.bootstrap_room)
        self.prealloc_queue.append(req)

    # ------------------------------------------------------------------ the loop

    def advance_queues(self) -> None:
        self._polls += 1
        if self._polls % max(self.s.args.disaggregation_decode_polling_interval, 1) and self.s.running:
            return
        self._poll_prealloc()
        self._poll_transfer()

    def next_batch(self) -> Optional[ScheduleBatch]:
        return self.s.planner.prefill_or_decode()

    def process_result(self, batch: ScheduleBatch, result) -> None:
        self.s.planner.process_result(batch, result)

    def _poll_prealloc(self) -> None:
        from tidal.transfer import KVPoll, poll_and_all_reduce

        keep, blocked = [], False
        self.s.priority.order(self.prealloc_queue)  # memory goes to the higher priority first
        polls = poll_and_all_reduce([r.pd.peer for r in self.prealloc_queue], self.s.tp)  # agreed by every TP rank
        for req, poll in zip(self.prealloc_queue, polls):
            if poll == KVPoll.Failed and req.pd.extra.get("bootstrapped"):  # waited for KV room: a full server's 503
                fail_request(self.s, req, failure_reason(req.pd.peer, "KV not pre-allocated"), status_code=503)
            elif poll == KVPoll.Failed:
                fail_request(self.s, req, failure_reason(req.pd.peer, "KV transfer bootstrap failed"))
            elif poll >= KVPoll.WaitingForInput and not blocked and self._preallocate(req):
                self.transfer_queue.append(req)
            else:
                blocked = blocked or poll >= KVPoll.WaitingForInput  # keep arrival order
                req.pd.extra["bootstrapped"] = req.pd.extra.get("bootstrapped") or poll >= KVPoll.WaitingForInput
                keep.append(req)
        self.prealloc_queue = keep

    def _allocatable_tokens(self) -> int:
        """Free KV minus decode room reserved for requests already here (SGLang's estimate)."""
        s = self.s
        holders = len(s.running) + len(self.transfer_queue) + len(s.waiting_queue)
        return s.mem.available_tokens() - s.args.num_reserved_decode_tokens * holders

    def _preallocate(self, req: Req) -> bool:
        s, mem = self.s, self.s.mem
        n = len(req.origin_input_ids)
        need = -(-n // mem.page_size) * mem.page_size + mem.page_size
        busy = s.running or self.transfer_queue
        if need > (self._allocatable_tokens() if busy else mem.available_tokens()):
            return False
        if len(self.transfer_queue) >= s.max_running_requests or mem.req_to_token_pool.available_size() == 0:
            return False
        idx = self.transfer.metadata.alloc()
        if idx is None:
            return False
        mem.alloc_req_slot(req)
        slots = mem.alloc_extend([0], [n], [-1])
        mem.req_to_token[req.req_pool_idx, :n] = slots
        req.kv_len = n
        req.fill_ids = req.origin_input_ids
        req.last_node = s.tree_cache.root_node
        req.pd.metadata_idx = idx
        req.pd.peer.init(page_indices(s, req, 0, n, include_partial=True), idx)
        return True

    def _poll_transfer(self) -> None:
        from tidal.transfer import KVPoll, poll_and_all_reduce

        keep = []
        self.s.priority.order(self.transfer_queue)  # running slots go to the higher priority first
        polls = poll_and_all_reduce([r.pd.peer for r in self.transfer_queue], self.s.tp)  # agreed by every TP rank
        for req, poll in zip(self.transfer_queue, polls):
            if poll == KVPoll.Success and len(self.s.running) < self.s.max_running_requests \
                    and self.s.lora.fits(req, self.s.running):
                self._start_decoding(req)
            elif poll == KVPoll.Failed:
                self._free_metadata(req)
                fail_request(self.s, req, failure_reason(req.pd.peer, "KV transfer failed"))
            else:
                keep.append(req)
        self.transfer_queue = keep

    def _start_decoding(self, req: Req) -> None:
        s = self.s
        rec = self.transfer.metadata.get(req.pd.metadata_idx)
        self._free_metadata(req)
        if rec.bootstrap_room != req.pd.room:
            fail_request(s, req, f"KV metadata room mismatch: got {rec.bootstrap_room}, expected {req.pd.room}")
            return
        req.first_prefill_done = True
        req.cached_tokens = rec.cached_tokens
        if self.transfer.carries_draft:  # the prefill server's draft model ran on the prompt too
            req.draft_kv_len = req.kv_len
        s.stats.on_prompt(len(req.origin_input_ids), req.cached_tokens)
        if finish_if_prompt_only(req):  # the prefill side's first token is not an output
            req.pd = None
            s.planner.start_decoding(req)
            return
        req.output_ids.append(rec.output_id)
        if req.return_logprob:
            req.output_logprobs.append((rec.logprob, rec.output_id))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(list(zip(rec.top_logprobs_val, rec.top_logprobs_idx)))
        if req.grammar is not None:  # the prefill side drew the first token under the same grammar
            ok = req.grammar.consume_token(rec.output_id)
            grammar_step(req, rec.output_id, refused=not ok, done=ok and req.grammar.is_stopped())
        s.stop.check(req)
        req.pd = None
        s.planner.start_decoding(req)

    def _free_metadata(self, req: Req) -> None:
        if req.pd.metadata_idx is not None:
            self.transfer.metadata.free(req.pd.metadata_idx)
            req.pd.metadata_idx = None

    # ------------------------------------------------------------------ aborts and accounting

    def abort(self, rid: str, abort_all: bool) -> None:
        for req in [r for r in self.prealloc_queue if abort_all or r.rid == rid]:
            self.prealloc_queue.remove(req)
            req.pd.peer.abort()
            fail_request(self.s, req, "Request aborted.", status_code=499)
        for req in self.transfer_queue:
            if abort_all or req.rid == rid:
                req.pd.peer.abort()  # Failed once prefill stopped writing; then its pages are freed

    def on_dequeued_abort(self, req: Req) -> None:
        return None

    def extra_live_reqs(self) -> list[Req]:
        return list(self.transfer_queue)

    def queued_reqs(self) -> list[Req]:
        return self.prealloc_queue

    def queued_prefill_tokens(self) -> int:
        return 0  # their KV comes from a prefill server

    def is_idle(self) -> bool:
        return not self.prealloc_queue and not self.transfer_queue

    def queue_sizes(self) -> dict:
        return {"prealloc": len(self.prealloc_queue), "transfer": len(self.transfer_queue)}

    def activate(self) -> None:
        return None

    def deactivate(self) -> None:
        return None

    def shutdown(self) -> None:
        self.transfer.shutdown()
