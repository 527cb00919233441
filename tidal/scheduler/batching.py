"""BatchPlanner: builds prefill and decode batches and applies their results.

Roles compose these steps: null prefills then decodes, prefill (issue 3) only
prefills, decode only decodes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

import torch

from tidal.messages import FinishReason
from tidal.model.forward_batch import ForwardMode
from tidal.model.sampler import compute_prompt_logprobs
from tidal.scheduler.policy import (
    CLIP_MAX_NEW_TOKENS,
    PrefillAdder,
    SchedulePolicy,
    admit_waiting,
    match_prefix_for,
)
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import (
    ScheduleBatch,
    build_decode_batch,
    build_extend_batch,
)
from tidal.spec.verify import accepted

if TYPE_CHECKING:
    from tidal.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

RETRACT_DECODE_STEPS = 20  # decode room a retraction leaves for each remaining request


class BatchPlanner:
    def __init__(self, sched: "Scheduler"):
        self.s = sched
        args = sched.args
        self.policy = SchedulePolicy(args.schedule_policy, sched.mem.tree_cache, args.random_seed)
        self.chunk_size: Optional[int] = None if args.chunked_prefill_size in (-1, 0) else args.chunked_prefill_size
        self.chunked_req: Optional[Req] = None
        self.init_new_token_ratio = min(args.init_new_token_ratio * args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * args.min_new_token_ratio_factor
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / max(
            args.new_token_ratio_decay_steps, 1
        )
        self.new_token_ratio = self.init_new_token_ratio

    # ------------------------------------------------------------------ prefill

    def new_prefill_batch(self) -> Optional[ScheduleBatch]:
        s = self.s
        if not s.waiting_queue and self.chunked_req is None:
            return None
        self.policy.calc_priority(s.waiting_queue)
        s.priority.order(s.waiting_queue)
        adder = self._admit()
        if self._head_blocked(adder):
            adder = self._preempt_for_head(adder)
        if adder is None or not adder.can_run_list:
            return None
        mem = s.mem
        for r in adder.can_run_list:
            if not r.first_prefill_done and r.is_chunked == 0:
                r.cached_tokens = len(r.prefix_indices)
        admitted = {id(r) for r in adder.can_run_list}
        s.waiting_queue = [r for r in s.waiting_queue if id(r) not in admitted]
        self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        return build_extend_batch(adder.can_run_list, mem, s.runner.kv_pool)

    def _admit(self) -> Optional[PrefillAdder]:
        """An adder filled from the waiting queue, or None when the running batch is full (and every
        request joins it)."""
        s, mem = self.s, self.s.mem
        running_bs = len(s.running)
        decodes_here = self._decodes_here()
        if running_bs >= s.max_running_requests and self.chunked_req is None and decodes_here is None:
            return None
        adder = PrefillAdder(
            mem.tree_cache, mem.allocator, self._running_and_chunked(), self.new_token_ratio,
            s.args.max_prefill_tokens, self.chunk_size, mem.page_size,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        self._admit_waiting(adder, running_bs, decodes_here)
        return adder

    def _running_and_chunked(self) -> list[Req]:
        """The requests every new batch sits beside: the running batch and a chunked prefill."""
        return self.s.running + ([self.chunked_req] if self.chunked_req else [])

    # ------------------------------------------------------------------ priority preemption

    def _head_blocked(self, adder: Optional[PrefillAdder]) -> bool:
        """Priority scheduling: the first waiting request was not admitted because memory or
        the running batch is full (not for a chunked prefill in progress), and it outranks a
        running request."""
        s = self.s
        if not s.priority.enabled or not s.waiting_queue or self.chunked_req is not None:
            return False
        head = s.waiting_queue[0]
        if adder is not None and any(r is head for r in adder.can_run_list):
            return False
        return bool(self._victims(head))

    def _victims(self, head: Req) -> list[Req]:
        s = self.s
        return [r for r in s.priority.preemption_victims(head, s.running) if not s.in_flight(r)]

    def _preempt_for_head(self, adder: Optional[PrefillAdder]) -> Optional[PrefillAdder]:
        """Retract running requests of lower priority than the first waiting one until it is
        admitted (as SGLang's priority preemption). Retracts nothing when even all of them
        would not free enough; returns the adder to use."""
        s = self.s
        head = s.waiting_queue[0]
        victims = self._victims(head)
        take = self._victims_needed(head, victims)
        if not take:
            return adder
        for i, victim in enumerate(victims):
            self.retract(victim)
            s.running.remove(victim)
            s.waiting_queue.insert(0, victim)  # first among its priority (it started earlier); the head outranks it
            if i + 1 < take:
                continue
            s.priority.order(s.waiting_queue)
            adder = self._admit()
            if adder is not None and any(r is head for r in adder.can_run_list):
                break
        logger.info("priority %d request %s preempted %d running requests", head.priority, head.rid, i + 1)
        return adder

    def _victims_needed(self, head: Req, victims: list[Req]) -> int:
        """How many of `victims` (in order) must go for `head` to fit, by the admission
        estimate: 0 when retracting all of them would not be enough."""
        s, mem = self.s, self.s.mem
        if not victims:
            return 0
        match_prefix_for(head, mem.tree_cache)
        ps = mem.page_size
        # as PrefillAdder.add_one_req: the new request's whole decode room, the running ones' scaled
        need = -(-head.extend_input_len // ps) * ps + head.reserved_decode_tokens(CLIP_MAX_NEW_TOKENS)
        room = PrefillAdder(mem.tree_cache, mem.allocator, s.running, self.new_token_ratio,
                            s.args.max_prefill_tokens, self.chunk_size, ps).room()
        slots = s.max_running_requests - len(s.running)
        for n, v in enumerate(victims, start=1):
            room += -(-v.kv_len // ps) * ps + int(v.reserved_decode_tokens(CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
            slots += 1
            if slots >= 1 and need < room:
                return n
        return 0

    def _admit_waiting(self, adder: PrefillAdder, running_bs: int,
                       decodes_here: Optional[Callable[[Req], bool]]) -> None:
        s = self.s
        tree_cache = s.mem.tree_cache
        waiting = s.lora.admissible(s.waiting_queue, self._running_and_chunked())
        admit_waiting(adder, waiting, running_bs, s.max_running_requests,
                      s.mem.req_to_token_pool.available_size(), lambda req: match_prefix_for(req, tree_cache),
                      decodes_here)

    def _decodes_here(self) -> Optional[Callable[[Req], bool]]:
        """Which prefilled requests join the running batch: under prefill only those without a PD partner
        (handed over; an embedding is counted among them), so the answers handed over to it do not hold back
        its PD prompts; else all (None)."""
        if self.s.role.name != "prefill":
            return None
        return lambda req: req.pd is None

    def prefill_or_decode(self) -> Optional[ScheduleBatch]:
        """Prefill first (new or retracted requests), else one decode step of the running batch."""
        batch = self.new_prefill_batch()
        return batch if batch is not None else self.new_decode_batch()

    # ------------------------------------------------------------------ decode

    def new_decode_batch(self) -> Optional[ScheduleBatch]:
        s = self.s
        if not s.running:
            return None
        mem = s.mem
        # before the check (what the windows left behind is room) and before any guesses: kv_len is what is kept
        mem.free_out_of_window(s.running)
        if mem.decode_tokens_needed([r.kv_len for r in s.running]) > mem.available_tokens():
            self.retract_decode()
            # requests that migrate free their KV only once it arrived: until then the rest may not fit
            if not s.running or mem.decode_tokens_needed([r.kv_len for r in s.running]) > mem.available_tokens():
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        reqs = s.decode_candidates()
        if not reqs:
            return None
        batch = s.speculator.verify_batch(reqs, mem, s.runner.kv_pool) if s.speculator is not None else None
        return batch if batch is not None else build_decode_batch(reqs, mem, s.runner.kv_pool)

    def retract_decode(self) -> None:
        """Free KV by sending the youngest requests (of the lowest priority first, with priority
        scheduling) back to the waiting queue."""
        s, mem = self.s, self.s.mem
        # popped from the end: the lowest priority (with priority scheduling), then the fewest outputs
        order = sorted(s.running, key=lambda r: (-s.priority.rank(r) if s.priority.enabled else 0, len(r.output_ids),
                                                 -len(r.origin_input_ids)), reverse=True)
        retracted: list[Req] = []
        migrator = s.migrator if s.migrator.retracts_by_migration else None
        # KV tokens of requests that migrate: freed once they arrived elsewhere
        moving = s.migrator.moving_tokens()

        def short() -> bool:
            need = mem.decode_tokens_needed([r.kv_len for r in order]) + RETRACT_DECODE_STEPS * len(order)
            return need > mem.available_tokens() + moving

        while order and short() and len(order) > 1:
            req = order.pop()
            if migrator is not None and migrator.can_take(req):
                migrator.offer(req, "retract")  # its KV goes with it, not back into a prefill here
                moving += req.kv_len
                continue
            self.retract(req)
            retracted.append(req)
        if order and mem.decode_tokens_needed([r.kv_len for r in order]) > mem.available_tokens() + moving:
            victim = order.pop()
            victim.finish(FinishReason(type="abort", message="KV cache is too small for this request.", status_code=507))
            mem.release(victim)
            s.emit(victim)
        s.running = [r for r in s.running if r in order]
        s.waiting_queue = retracted[::-1] + s.waiting_queue
        total_decoded = sum(len(r.output_ids) for r in order)
        total_max = sum(r.sampling.max_new_tokens for r in order)
        self.new_token_ratio = min(1.0, (total_decoded + RETRACT_DECODE_STEPS * len(order)) / (total_max + 1))
        logger.warning("KV cache is full: retracted %d requests, migrating %d tokens of KV, new_token_ratio=%.3f",
                       len(retracted), moving, self.new_token_ratio)

    def retract(self, req: Req) -> None:
        """Free everything a running request holds (its KV goes to the prefix cache) so it can be
        prefilled again later from its prompt and the tokens it has produced; the caller moves
        it from the running batch to the waiting queue."""
        self.s.mem.release(req)
        req.reset_for_retract()
        self.s.stats.num_retracted += 1

    # ------------------------------------------------------------------ results

    def process_result(self, batch: ScheduleBatch, result) -> None:
        if batch.drafts is not None:
            self.process_verify_result(batch, result)
        elif batch.mode is ForwardMode.EXTEND:
            self.process_extend_result(batch, result)
        else:
            self.process_decode_result(batch, result)

    def process_extend_result(self, batch: ScheduleBatch, result, on_prefilled=None, on_chunk=None) -> None:
        """Apply a prefill pass. Roles hook in where a chunk or a whole prefill completes."""
        s = self.s
        logits, out = result
        next_ids = out.next_token_ids.tolist()
        for i, (req, span) in enumerate(zip(batch.reqs, batch.spans)):
            if req.wants_input_logprobs and not req.first_prefill_done:
                self._add_input_logprobs(req, span, logits)
            if req.kv_len < len(req.all_ids):  # an unfinished chunked prefill
                s.mem.cache_unfinished(req)
                if req.to_abort:
                    self._finish_abort_chunked(req)
                elif on_chunk is not None and not req.is_embedding:  # an embedding's KV goes nowhere
                    on_chunk(req)
                continue
            req.is_chunked = 0
            if not req.first_prefill_done:
                req.first_prefill_done = True
                s.stats.on_prompt(len(req.origin_input_ids), req.cached_tokens)
            if req.is_embedding:
                s.embedder.finish(req)
                continue
            if not finish_if_prompt_only(req):
                self.append_token(req, next_ids[i], out, i)
            (on_prefilled or self.start_decoding)(req)

    def start_decoding(self, req: Req) -> None:
        """Colocated: a prefilled request joins the running batch (or ends right away)."""
        s = self.s
        if req.finished:
            s.mem.release(req)
        else:
            s.mem.cache_unfinished(req)
            s.running.append(req)
        s.emit(req)

    def _finish_abort_chunked(self, req: Req) -> None:
        self.chunked_req = None if self.chunked_req is req else self.chunked_req
        req.is_chunked = 0
        req.finish(FinishReason(type="abort", message=req.to_abort))
        self.s.mem.release(req)
        self.s.emit(req)

    def process_decode_result(self, batch: ScheduleBatch, result) -> None:
        s = self.s
        _, out = result
        next_ids = out.next_token_ids.tolist()
        for i, req in enumerate(batch.reqs):
            if req.finished:  # it ended while this (overlapped) pass ran: the row was for nothing
                s.mem.drop_last_slot(req)
                s.mem.release(req)
                continue
            self.append_token(req, next_ids[i], out, i)
            if req.finished and not s.in_flight(req):  # else released when that pass is processed
                s.mem.release(req)
            s.emit(req)
        s.running = [r for r in s.running if not r.finished]

    def process_verify_result(self, batch: ScheduleBatch, result) -> None:
        """Apply a verification pass: each request gains its kept guesses and the target's next
        token (up to where it finishes), and the KV of the rest is freed."""
        s = self.s
        _, out = result
        sampled = out.next_token_ids.tolist()
        gained = []
        for req, span, draft in zip(batch.reqs, batch.spans, batch.drafts, strict=True):
            tokens = accepted(draft, sampled[span.first : span.first + span.count])
            kept = 0
            for j, token in enumerate(tokens):
                if req.finished:
                    break
                self.append_token(req, token, out, span.first + j)
                kept += 1
            gained.append(tokens[:kept])
            # KV stays for the last output token and the kept guesses before the newest one
            s.mem.drop_tail(req, span.first_pos + kept)
            if req.finished:
                s.mem.release(req)
            s.emit(req)
        s.speculator.record(batch.reqs, batch.drafts, gained)
        s.running = [r for r in s.running if not r.finished]

    def append_token(self, req: Req, token: int, out, row: int) -> None:
        req.output_ids.append(token)
        if req.return_logprob and out.next_token_logprobs is not None:
            req.output_logprobs.append((float(out.next_token_logprobs[row]), token))
            if req.top_logprobs_num > 0 and out.top_logprobs is not None:
                req.output_top_logprobs.append(out.top_logprobs[row])
        if req.grammar is not None:
            grammar_step(req, token, refused=row in out.grammar_refused, done=row in out.grammar_done)
        self.s.stop.check(req)

    def _add_input_logprobs(self, req: Req, span, logits: torch.Tensor) -> None:
        prompt = req.origin_input_ids
        if req.logprob_start_len == 0 and span.first_pos == 0 and not req.input_logprobs:
            req.input_logprobs.append((None, prompt[0]))
            req.input_top_logprobs.append(None)
        # row at position p predicts token p + 1; keep prompt targets only
        n = min(span.count, len(prompt) - 1 - span.first_pos)
        if n <= 0:
            return
        targets = torch.tensor(prompt[span.first_pos + 1 : span.first_pos + 1 + n], dtype=torch.int64)
        rows = logits[span.first : span.first + n]
        values, tops = compute_prompt_logprobs(rows, targets, req.top_logprobs_num)
        for j, v in enumerate(values):
            req.input_logprobs.append((v, int(targets[j])))
            req.input_top_logprobs.append(tops[j] if tops is not None else None)


def grammar_step(req: Req, token: int, refused: bool, done: bool) -> None:
    """A constrained request ends when its grammar is complete (only EOS could follow: the
    EOS pass is skipped), or fails if its matcher refused the token (a grammar engine bug)."""
    if refused:
        req.finish(FinishReason(type="abort", status_code=500,
                                message=f"the grammar refused token {token}: {req.grammar.get_error()}"))
    elif done:
        req.finish(FinishReason(type="stop", matched=token if token in req.sampling.stop_token_ids else None))


def finish_if_prompt_only(req: Req) -> bool:
    """max_new_tokens 0 (prompt scoring, as SGLang): the request ends after its prefill and the
    token sampled there is not an output. True when it ended here."""
    if req.sampling.max_new_tokens > 0:
        return False
    req.finish(FinishReason(type="length", length=0))
    return True
