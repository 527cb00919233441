"""PrefillRole: prefill only, then send the KV to the paired decode server.

Queues: bootstrap (waiting for the decode side's destination) -> the scheduler's
waiting queue (normal PrefillAdder, chunked prefill; each finished chunk's whole
pages are sent at once) -> inflight (last pages + metadata sent, polled until the
transfer succeeds or fails). The response goes out only after Success.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from tidal.messages import FinishReason
from tidal.roles.pd_common import (
    PDState,
    TransferComponents,
    bootstrap_addr_of,
    fail_request,
    failure_reason,
    page_indices,
)
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tidal.roles.loop import RoleLoop

logger = logging.getLogger(__name__)


class PrefillRole:
    name = "prefill"

    def __init__(self, sched: RoleLoop):
        from tidal.transfer import BootstrapServer

        self.s = sched
        args = sched.args
        self.bootstrap_port = args.disaggregation_bootstrap_port
        # one bootstrap server per prefill server, run by TP rank 0; every rank registers with it
        self.bootstrap_server = BootstrapServer(args.host, self.bootstrap_port, args.disaggregation_bootstrap_key) if sched.tp.rank == 0 else None
        self.transfer = TransferComponents(sched, "prefill", None)
        self.active = False
        self.bootstrap_queue: list[Req] = []
        self.inflight_queue: list[Req] = []

    # ------------------------------------------------------------------ requests in

    def accept(self, req: Req) -> None:
        if req.bootstrap_room is None or not req.bootstrap_host:
            # a switchable server may just have become prefill: tell the client to go elsewhere
            code = 503 if self.s.args.enable_dynamic_disaggregation else 400
            req.finish(FinishReason(
                type="abort", status_code=code,
                message="This is a prefill server: requests need bootstrap_host and bootstrap_room "
                        "(send them through the router, e.g. `tidal router`)."))
            self.s.emit(req)
            return
        from tidal.transfer import create_kv_sender

        req.sampling.max_new_tokens = 1  # prefill produces the first token; decode does the rest
        req.pd = PDState(peer=create_kv_sender(self.transfer.manager, bootstrap_addr_of(req, self.s.args),
                                               req.bootstrap_room), room=req.bootstrap_room)
        self.bootstrap_queue.append(req)

    # ------------------------------------------------------------------ the loop

    def advance_queues(self) -> None:
        self._poll_bootstrap()
        self._poll_inflight()

    def next_batch(self) -> Optional[ScheduleBatch]:
        return self.s.planner.new_prefill_batch()

    def process_result(self, batch: ScheduleBatch, result) -> None:
        self.s.planner.process_extend_result(batch, result, on_prefilled=self._on_prefilled, on_chunk=self._send_chunk)

    def _poll_bootstrap(self) -> None:
        from tidal.transfer import KVPoll, poll_and_all_reduce

        keep = []
        self.s.priority.order(self.bootstrap_queue)  # higher priority takes metadata slots first
        polls = poll_and_all_reduce([r.pd.peer for r in self.bootstrap_queue], self.s.tp)  # agreed by every TP rank
        for req, poll in zip(self.bootstrap_queue, polls):
            if poll == KVPoll.Failed:
                fail_request(self.s, req, failure_reason(req.pd.peer, "KV transfer bootstrap failed"))
            elif poll >= KVPoll.WaitingForInput and self._start(req):
                self.s.waiting_queue.append(req)
            else:
                keep.append(req)
        self.bootstrap_queue = keep

    def _start(self, req: Req) -> bool:
        idx = self.transfer.metadata.alloc()
        if idx is None:
            return False  # every metadata slot is in flight; try again next iteration
        req.pd.metadata_idx = idx
        ps = self.s.mem.page_size
        req.pd.peer.init(-(-len(req.origin_input_ids) // ps), idx)
        return True

    def _send_chunk(self, req: Req) -> None:
        """A chunk finished: send its whole pages now, so transfer overlaps the next chunk."""
        if req.pd is None:
            return  # handed over by a decode role (roles/handover.py): its KV stays here
        pages = page_indices(self.s, req, req.pd.pages_sent, req.kv_len, include_partial=False)
        if len(pages):
            req.pd.peer.send(pages, is_last=False)
            req.pd.pages_sent += len(pages)

    def _on_prefilled(self, req: Req) -> None:
        """The last chunk is done: record the first token, send the rest, wait in inflight."""
        from tidal.transfer import MetadataRecord

        s = self.s
        if req.pd is None:  # handed over by a decode role (roles/handover.py) and retracted: decoded here
            s.planner.start_decoding(req)
            return
        s.mem.cache_unfinished(req)
        if req.to_abort:
            self._release_metadata(req)
            req.pd.peer.abort()
            fail_request(s, req, req.to_abort, status_code=499)
            return
        rec = MetadataRecord(output_id=req.output_ids[0], cached_tokens=req.cached_tokens, bootstrap_room=req.pd.room)
        if req.output_logprobs:
            rec.logprob = req.output_logprobs[0][0]
        if req.output_top_logprobs:
            rec.top_logprobs_val = [v for v, _ in req.output_top_logprobs[0]]
            rec.top_logprobs_idx = [i for _, i in req.output_top_logprobs[0]]
        self.transfer.metadata.set(req.pd.metadata_idx, rec)
        req.pd.peer.send(page_indices(s, req, req.pd.pages_sent, req.kv_len, include_partial=True), is_last=True)
        self.inflight_queue.append(req)

    def _poll_inflight(self) -> None:
        from tidal.transfer import KVPoll, poll_and_all_reduce

        keep = []
        polls = poll_and_all_reduce([r.pd.peer for r in self.inflight_queue], self.s.tp)  # agreed by every TP rank
        for req, poll in zip(self.inflight_queue, polls):
            if poll == KVPoll.Success:
                self._release_metadata(req)
                self.s.mem.release(req)  # the prefix stays in the radix cache
                self.s.emit(req)
            elif poll == KVPoll.Failed:
                self._release_metadata(req)
                fail_request(self.s, req, failure_reason(req.pd.peer, "KV transfer failed"))
            else:
                keep.append(req)
        self.inflight_queue = keep

    def _release_metadata(self, req: Req) -> None:
        if req.pd.metadata_idx is not None:
            self.transfer.metadata.free(req.pd.metadata_idx)
            req.pd.metadata_idx = None

    # ------------------------------------------------------------------ aborts and accounting

    def abort(self, rid: str, abort_all: bool) -> None:
        for req in [r for r in self.bootstrap_queue if abort_all or r.rid == rid]:
            self.bootstrap_queue.remove(req)
            req.pd.peer.abort()
            fail_request(self.s, req, "Request aborted.", status_code=499)
        for req in self.inflight_queue:
            if abort_all or req.rid == rid:
                req.pd.peer.abort()  # the poll turns Failed and frees it on the next iteration

    def on_dequeued_abort(self, req: Req) -> None:
        if getattr(req, "pd", None) is not None:
            self._release_metadata(req)
            req.pd.peer.abort()

    def extra_live_reqs(self) -> list[Req]:
        return list(self.inflight_queue)

    def queued_reqs(self) -> list[Req]:
        return self.bootstrap_queue

    def queued_prefill_tokens(self) -> int:
        return sum(len(r.origin_input_ids) for r in self.bootstrap_queue)

    def is_idle(self) -> bool:
        return not self.bootstrap_queue and not self.inflight_queue

    def queue_sizes(self) -> dict:
        return {"bootstrap": len(self.bootstrap_queue), "inflight": len(self.inflight_queue)}

    def start_bootstrap(self) -> None:
        """Rank 0: start the bootstrap server (a taken port raises). Other ranks: nothing."""
        if self.bootstrap_server is not None and not self.bootstrap_server.running:
            self.bootstrap_server.start()

    def activate(self) -> None:
        """Start the bootstrap server (rank 0) and register this rank with it."""
        if self.active:
            return
        self.start_bootstrap()
        try:
            self.transfer.register(self.bootstrap_port)
        except BaseException:
            self._stop_bootstrap()
            raise
        self.active = True

    def deactivate(self) -> None:
        """Unreachable again: the bootstrap server stops (a half-done activation too).

        Every rank's registration lives in rank 0's bootstrap server and goes with it, so
        no rank deregisters: with TP, rank 0 may already have stopped it, and a DELETE to
        a closing server would wait out its timeout."""
        self._stop_bootstrap()
        self.transfer.forget_registration()
        self.active = False

    def _stop_bootstrap(self) -> None:
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()

    def shutdown(self) -> None:
        self.deactivate()
        self.transfer.shutdown()
