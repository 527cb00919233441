"""The scheduler: one loop, requests, memory, and the active role strategy."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from tidal.config import ServerArgs
from tidal.constrained.compiler import GrammarCompiler
from tidal.constrained.grammar import JsonStyle
from tidal.constrained.masks import GrammarBatch
from tidal.kvcache.kv_pool import StackedKVPool, stack_problem
from tidal.kvevents.publisher import KVEvents
from tidal.messages import (
    AbortReq,
    CancelMigrationReq,
    FinishReason,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    LoadLoRAReq,
    ModeStatusReq,
    PrepareModeReq,
    ReqOutput,
    StatsReq,
    StatsResp,
    SwitchModeReq,
    ToApi,
    ToScheduler,
    UnloadLoRAReq,
)
from tidal.model.forward_batch import ForwardMode
from tidal.model.sampler import Sampler, SamplingBatchInfo
from tidal.model.pooling import resolve_pooling
from tidal.spec.draft import DraftModel
from tidal.spec.speculator import Speculator
from tidal.spec.verify import row_outputs
from tidal.scheduler.batching import BatchPlanner
from tidal.scheduler.embedding import NOT_EMBEDDING_SERVER, Embedder
from tidal.scheduler.lora import LoRAScheduling
from tidal.scheduler.memory import KVMemory
from tidal.scheduler.overlap import PENDING, ForwardThread, InFlight, input_ids_from
from tidal.scheduler.policy import request_slots
from tidal.scheduler.priority import PriorityRules
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch
from tidal.scheduler.stats import SchedulerStats
from tidal.scheduler.step_timing import StepTiming, now
from tidal.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns every live Req, the KV memory and the runner; the role decides what runs.

    Roles see it only as `tidal.roles.loop.RoleLoop` (the controller as `ControllerLoop`): what they
    may use of it is listed there."""

    def __init__(self, args: ServerArgs, runner: Any, tokenizer: Any = None, draft_runner: Any = None):
        """`draft_runner`: the draft model's runner, for --speculative-algorithm STANDALONE."""
        from tidal.parallel import SingleRank

        if args.is_embedding:  # embedding requests neither reuse nor keep cached prefixes
            args = args.replace(disable_radix_cache=True)
        self.args = args
        self.runner = runner
        self.tp = getattr(runner, "tp", None) or SingleRank()  # every rank runs this same loop
        cfg = runner.model_config
        self.context_length = args.context_length or cfg.context_length
        self.max_running_requests = args.max_running_requests
        self.kv_events = KVEvents.create(args, self.tp.rank)
        self.mem = KVMemory(
            max_total_tokens=runner.max_total_tokens,
            page_size=args.page_size,
            max_reqs=request_slots(args.max_running_requests),
            max_context_len=self.context_length + args.page_size + 8,
            disable_radix_cache=args.disable_radix_cache,
            device=runner.device,
            debug=args.enable_integrity_check,
            events=self.kv_events.sink if self.kv_events is not None else None,
            swa=getattr(runner, "swa_layout", None),
        )
        self.max_req_input_len = min(self.context_length - 1, runner.max_total_tokens - 1)
        self.stop = StopChecker(tokenizer, list(cfg.eos_token_ids), self.context_length)
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(
            tokenizer, cfg.vocab_size, list(cfg.eos_token_ids), self.tp,
            JsonStyle(args.constrained_json_whitespace_pattern), args.grammar_compile_timeout_s,
        )
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.priority = PriorityRules(args)
        self.lora = LoRAScheduling(self)
        self.planner = BatchPlanner(self)
        self.stats = SchedulerStats()
        self.timing = StepTiming()
        self.last_batch_size = 0
        self.speculator = self._speculator(draft_runner) if args.speculative_algorithm else None
        self.transfer_pool = self._transfer_pool()
        # decode passes overlap the scheduler's work (not with TP: the ranks' collectives
        # would run from two threads; not with speculation: its guesses need the last token)
        self.overlap = not args.disable_overlap_schedule and self.tp.size == 1 and self.speculator is None
        self.forward_thread = ForwardThread()
        self.inflight: Optional[InFlight] = None
        self.outbox: list[ReqOutput] = []
        self.replies: list[ToApi] = []
        from tidal.roles import create_role
        from tidal.roles.controller import ModeController
        from tidal.roles.migration import Migrator

        self.embedder = Embedder(self, resolve_pooling(args)) if args.is_embedding else None
        self.bootstrap_port_hold = self._hold_bootstrap_port()
        self.role = create_role(args.disaggregation_mode, self)
        self.migrator = Migrator(self)
        self.controller = ModeController(self)

    def _speculator(self, draft_runner: Any) -> Speculator:
        draft = None
        if self.args.speculative_algorithm == "STANDALONE":
            if draft_runner is None:
                raise ValueError("--speculative-algorithm STANDALONE needs the draft model's runner")
            if draft_runner.max_total_tokens < self.runner.max_total_tokens:
                raise ValueError("the draft model's KV pool must have a slot for every slot of the target's")
            draft = DraftModel(draft_runner, self.runner.model_config)
        return Speculator(self.args, self.context_length, draft)

    def _transfer_pool(self) -> Any:
        """What a KV transfer moves: the KV pool, with a draft model's stacked under it so that a prefill
        server's draft KV of the prompt reaches decode (not with shm: its pages live in one shared file)."""
        pool = getattr(self.runner, "kv_pool", None)
        draft = self.speculator.draft if self.speculator is not None else None
        if draft is None or self.args.disaggregation_transfer_backend == "shm":
            return pool
        problem = stack_problem(pool, draft.kv_pool)
        if problem is not None:
            logger.warning("the draft model's KV stays out of KV transfers (%s): decode servers rebuild it", problem)
            return pool
        return StackedKVPool(pool, draft.kv_pool)

    def _hold_bootstrap_port(self):
        """A switchable server's rank 0 holds its bootstrap port from the start, so that when it
        becomes prefill minutes later no outgoing connection has taken the port meanwhile."""
        args = self.args
        if not args.enable_dynamic_disaggregation or self.tp.rank != 0 or not args.disaggregation_bootstrap_port:
            return None
        from tidal.transfer.bootstrap import hold_port

        return hold_port(args.host, args.disaggregation_bootstrap_port)

    # ------------------------------------------------------------------ inputs

    def handle(self, msg: ToScheduler) -> None:
        if isinstance(msg, (SwitchModeReq, PrepareModeReq)):
            # requests compiling their grammar join the current role's queues and move with them
            self.grammars.wait_all(min(msg.timeout_s if isinstance(msg, SwitchModeReq) else 5.0, 5.0))
            self.admit_compiled()
        if isinstance(msg, (FlushCacheReq, SwitchModeReq, PrepareModeReq, LoadLoRAReq, UnloadLoRAReq)):
            self.drain()  # these look for an idle scheduler: no pass may be left in flight
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.abort_all)
        elif isinstance(msg, CancelMigrationReq):
            self.migrator.cancel(msg.rid, msg.reason)
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
        elif isinstance(msg, LoadLoRAReq):
            self.replies.append(self.lora.load(msg))
        elif isinstance(msg, UnloadLoRAReq):
            self.replies.append(self.lora.unload(msg))

    def add_request(self, msg: GenerateReq) -> None:
        req = Req(msg)
        error = self._validate(req)
        refusal = self._refusal(msg) if error is None else None
        if error is None and refusal is None:
            refusal = self._make_queue_room(req)
        if error or refusal:
            message, code = (error, 400) if error else refusal
            self._end_unrun(req, message, code)
            return
        self.lora.on_accepted(req)
        if req.is_embedding:
            self.waiting_queue.append(req)  # computed here in every role: a prefill, no KV transfer
            return
        key = req.sampling.grammar_key
        if key is not None and not self.grammars.start(req, key):
            return  # in the grammar queue until its grammar compiles (admit_compiled)
        self.role.accept(req)

    def admit_compiled(self) -> None:
        """Requests whose grammar compiled go to the role; those whose grammar failed end (400)."""
        for req, error in self.grammars.take_ready():
            if error is not None:
                self._end_unrun(req, error, 400)
            else:
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

    def _end_unrun(self, req: Req, message: str, status_code: Optional[int] = None) -> None:
        """End a request that holds nothing (refused, or dropped from a queue) with an abort."""
        req.finish(FinishReason(type="abort", message=message, status_code=status_code))
        self.emit(req)

    def queued_reqs(self) -> list[Req]:
        """Requests waiting for admission: the grammar queue, the waiting queue and the role's own queues."""
        return [w.req for w in self.grammars.waiting] + self.waiting_queue + self.role.queued_reqs()

    def num_queued(self) -> int:
        return len(self.grammars.waiting) + len(self.waiting_queue) + len(self.role.queued_reqs())

    def _make_queue_room(self, req: Req) -> Optional[tuple[str, int]]:
        """None when `req` may queue (after displacing a queued request of lower priority if
        --max-queued-requests is reached), else why not (503: retry later or elsewhere)."""
        limit = self.priority.max_queued
        if not self.priority.queue_full(self.num_queued()):
            return None
        fresh = [r for r in self.waiting_queue if r.num_retractions == 0]  # retracted ones keep their place
        victim = self.priority.displaced_by(req, fresh)
        if victim is None:
            return f"The waiting queue is full ({limit} requests, --max-queued-requests); retry later.", 503
        self.waiting_queue.remove(victim)
        self.role.on_dequeued_abort(victim)
        self._end_unrun(victim, f"The waiting queue is full ({limit} requests, --max-queued-requests) and a "
                                f"request of higher priority took this one's place; retry later.", 503)
        return None

    def _validate(self, req: Req) -> Optional[str]:
        n = len(req.origin_input_ids)
        if n == 0:
            return "The input is empty."
        if req.is_embedding and self.embedder is None:
            return NOT_EMBEDDING_SERVER
        if n > self.max_req_input_len:
            return (
                f"The input ({n} tokens) is longer than the maximum allowed "
                f"({self.max_req_input_len} tokens, context length {self.context_length})."
            )
        lora_error = self.lora.check(req.lora_name)
        if lora_error:
            return lora_error
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
            self._end_unrun(r, "Request aborted.")
        for r in [w.req for w in self.grammars.waiting if match(w.req)]:
            self.grammars.drop(r)
            self._end_unrun(r, "Request aborted.")
        for r in self.live_reqs():
            if match(r):
                r.to_abort = "Request aborted."
        self.role.abort(rid, abort_all)

    def flush_cache(self) -> bool:
        self.drain()
        if self.waiting_queue or self.live_reqs():
            return False
        return self.mem.flush()

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to run."""
        if self.kv_events is not None:
            self.kv_events.publish()  # what the cache did since the last iteration, one batch
        if self.overlap:
            return self._step_overlapped()
        t0 = now()
        self.controller.on_iteration()
        self.migrator.poll()
        self.admit_compiled()
        self.role.advance_queues()
        batch = self.role.next_batch()
        self.timing.add("schedule", now() - t0)
        if batch is None:
            self.last_batch_size = 0
            return False
        result = self.run_batch(batch)
        t1 = now()
        self.role.process_result(batch, result)
        self.timing.add("process", now() - t1)
        self.last_batch_size = len(batch)
        return True

    def run_batch(self, batch: ScheduleBatch):
        t0 = now()
        if self.embedder is not None and any(r.is_embedding for r in batch.reqs):
            logits, hidden = self.runner.forward_with_hidden(batch.forward_batch, batch.logit_rows)
            self.embedder.pool(batch, hidden)
        else:
            logits = self.runner.forward(batch.forward_batch, batch.logit_rows)
        t1 = now()
        self.timing.add("forward", t1 - t0)
        if self.speculator is not None and batch.mode is ForwardMode.DECODE or batch.drafts is not None:
            self.speculator.cost.observe(batch.forward_batch.num_tokens, t1 - t0)
        if self.speculator is not None and batch.mode is ForwardMode.EXTEND and batch.drafts is None \
                and self.embedder is None:
            self.speculator.after_extend(batch)  # the draft model's KV of the same prompt tokens
        if batch.drafts is not None:
            out = self._sample(batch, logits, self._verify_sampling_info(batch), every_row=True)
        else:
            out = self._sample(batch, logits, self._sampling_info(batch), self._grammar_batch(batch))
        self.stats.on_batch(batch)
        self.timing.add("sample", now() - t1)
        return logits, out

    def _sampling_info(self, batch: ScheduleBatch, pending: Optional[list[bool]] = None) -> SamplingBatchInfo:
        """pending[i]: request i's last output token is still being sampled by the pass in flight."""
        reqs = batch.reqs
        outputs = [r.output_ids + PENDING if pending and pending[i] else r.output_ids for i, r in enumerate(reqs)]
        return SamplingBatchInfo.build(
            [r.sampling for r in reqs],
            outputs,
            [r.origin_input_ids for r in reqs],
            self.runner.model_config.vocab_size,
            self.runner.device,
            list(self.stop.eos_ids),
        )

    def _verify_sampling_info(self, batch: ScheduleBatch) -> SamplingBatchInfo:
        """One row per position of each request's guesses, sampled as if the guesses before it were output."""
        reqs, drafts = batch.reqs, batch.drafts
        rows = [(r, len(d) + 1) for r, d in zip(reqs, drafts, strict=True)]
        return SamplingBatchInfo.build(
            [r.sampling for r, n in rows for _ in range(n)],
            row_outputs(reqs, drafts),
            [r.origin_input_ids for r, n in rows for _ in range(n)],
            self.runner.model_config.vocab_size,
            self.runner.device,
            list(self.stop.eos_ids),
        )

    def _grammar_batch(self, batch: ScheduleBatch) -> Optional[GrammarBatch]:
        """The constrained rows whose sampled token is an output (not a chunk's or a prompt-only one)."""
        if all(r.grammar is None for r in batch.reqs):
            return None
        if batch.mode is ForwardMode.DECODE:
            kept = [True] * len(batch.reqs)
        else:
            kept = [r.kv_len >= len(r.all_ids) and r.sampling.max_new_tokens > 0 for r in batch.reqs]
        return GrammarBatch.of(batch.reqs, kept, self.runner.model_config.vocab_size)

    def _sample(self, batch: ScheduleBatch, logits: torch.Tensor, info: SamplingBatchInfo,
                grammar: Optional[GrammarBatch] = None, every_row: bool = False):
        """Runs in the thread that runs the pass; grammar masks are computed here, right before
        the draw, and the matchers advance right after it. every_row: a verification pass,
        whose every logits row is drawn (its requests have no grammar)."""
        last_rows = torch.tensor([s.last for s in batch.spans], dtype=torch.int64, device=logits.device)
        sample_logits = logits if every_row or len(last_rows) == logits.shape[0] else logits[last_rows]
        reqs = [r for r, s in zip(batch.reqs, batch.spans) for _ in range(s.count)] if every_row else batch.reqs
        if grammar is not None:
            info.allowed_tokens = grammar.allowed_tokens(sample_logits.device)
        out = self.sampler.sample(
            sample_logits,
            info,
            [r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            any(r.return_logprob for r in reqs),
        )
        if self.tp.size > 1:  # rank 0's draw, so every rank's requests continue identically
            out.next_token_ids = self.tp.broadcast_tensor(out.next_token_ids)
        if grammar is not None:
            out.grammar_refused, out.grammar_done = grammar.accept(out.next_token_ids)
        return out

    # ------------------------------------------------------------------ overlap

    def _step_overlapped(self) -> bool:
        """Launch decode pass N+1 behind pass N, then process N's result while N+1 runs."""
        t0 = now()
        self.controller.on_iteration()
        self.migrator.poll()
        self.admit_compiled()
        self.role.advance_queues()
        if self.inflight is not None and not self._can_schedule_behind():
            self.timing.add("schedule", now() - t0)
            self.drain()
            t0 = now()
        batch = self.role.next_batch()
        self.timing.add("schedule", now() - t0)
        if batch is None:
            self.last_batch_size = 0
            return self.drain()
        self.last_batch_size = len(batch)
        if batch.mode is ForwardMode.DECODE and self._role_overlaps():
            prev, self.inflight = self.inflight, self._launch(batch, self.inflight)
            if prev is not None:
                self._finish(prev)
            return True
        self.drain()  # not reached with a pass in flight (see _can_schedule_behind); kept safe
        result = self.run_batch(batch)
        t1 = now()
        self.role.process_result(batch, result)
        self.timing.add("process", now() - t1)
        return True

    def _role_overlaps(self) -> bool:
        return self.role.name in ("null", "decode")  # prefill runs prefill passes only

    def _can_schedule_behind(self) -> bool:
        """May the next batch be built before the in-flight pass's tokens are known?

        Not when it may be a prefill (serial prefills keep admission exactly as without
        overlap), when a request's penalties need its last token, or when decode memory
        is short (retraction must not release a request whose pass is in flight)."""
        s, mem = self, self.mem
        if not self._role_overlaps() or s.waiting_queue or self.planner.chunked_req is not None:
            return False
        if any(r.sampling.has_penalties for r in s.running):
            return False
        return mem.decode_tokens_needed([r.kv_len for r in s.running]) <= mem.available_tokens()

    def decode_candidates(self) -> list[Req]:
        """Running requests that need another decode pass: not those whose in-flight pass
        samples their last token (max_new_tokens or the context length ends them)."""
        if self.inflight is None:
            return list(self.running)  # a copy: the batch's requests must not change while it runs
        return [r for r in self.running if not (self.inflight.holds(r) and self.stop.ends_by_length(r, pending=1))]

    def _launch(self, batch: ScheduleBatch, prev: Optional[InFlight]) -> InFlight:
        pending = [prev is not None and prev.holds(r) for r in batch.reqs]
        info = self._sampling_info(batch, pending)
        grammar = self._grammar_batch(batch)
        resolve_inputs = input_ids_from(prev, batch)
        self.stats.on_batch(batch)
        self.stats.num_overlapped_batches += prev is not None

        def forward_and_sample():
            if resolve_inputs is not None:
                resolve_inputs()
            logits = self.runner.forward(batch.forward_batch, batch.logit_rows)
            return logits, self._sample(batch, logits, info, grammar)

        return InFlight(batch, self.forward_thread.submit(forward_and_sample))

    def _finish(self, done: InFlight) -> None:
        t0 = now()
        result = done.future.result()
        t1 = now()
        self.timing.add("forward", t1 - t0)  # the wait for the worker, not the pass
        self.role.process_result(done.batch, result)
        self.timing.add("process", now() - t1)

    def drain(self) -> bool:
        """Wait for the pass in flight and process its result; False if there was none."""
        done, self.inflight = self.inflight, None
        if done is None:
            return False
        self._finish(done)
        return True

    def in_flight(self, req: Req) -> bool:
        """True while a pass that computes a row for this request has not been processed."""
        return self.inflight is not None and self.inflight.holds(req)

    def live_reqs(self) -> list[Req]:
        """Requests that hold KV or a req slot (for integrity checks and aborts)."""
        live = list(self.running)
        if self.planner.chunked_req is not None:
            live.append(self.planner.chunked_req)
        if self.inflight is not None:  # ended, but a pass in flight still writes their KV
            live += [r for r in self.inflight.batch.reqs if r.finished and r.req_pool_idx is not None]
        return live + self.role.extra_live_reqs() + self.migrator.moving

    def is_idle(self) -> bool:
        return (self.inflight is None and not self.waiting_queue and not self.live_reqs()
                and not self.grammars.waiting and self.role.is_idle() and self.migrator.is_idle())

    @property
    def tree_cache(self):
        """The prefix cache in use; replaced only by set_cache."""
        return self.mem.tree_cache

    @property
    def chunked_req(self) -> Optional[Req]:
        """The request whose chunked prefill is midway, or None."""
        return self.planner.chunked_req

    def set_cache(self, cache) -> None:
        """Swap the prefix cache (role switches); everything that matches prefixes follows."""
        self.mem.tree_cache = cache
        self.planner.policy.tree_cache = cache

    def shutdown(self) -> None:
        self.forward_thread.stop()
        if self.kv_events is not None:
            self.kv_events.close()
        self.grammars.shutdown()
        self.controller.shutdown()
        self.migrator.shutdown()
        self.role.shutdown()
        if self.bootstrap_port_hold is not None:
            self.bootstrap_port_hold.close()
        pool = getattr(self.runner, "kv_pool", None)
        if pool is not None and hasattr(pool, "close"):
            pool.close()

    def check_integrity(self) -> None:
        self.mem.check_integrity(self.live_reqs())

    # ------------------------------------------------------------------ outputs

    def emit(self, req: Req) -> None:
        if req.finished:
            self.outbox.append(req.take_output(final=True))
        elif req.sent_len == 0 and req.output_ids:
            # the first token goes out at once, streamed or not: the API process times the TTFT by its arrival
            self.outbox.append(req.take_output(final=False))
        elif req.stream and len(req.output_ids) - req.sent_len >= self.args.stream_interval:
            self.outbox.append(req.take_output(final=False))

    def take_outbox(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        for o in out:
            if o.finish_reason is not None:
                self.lora.on_finished(o.rid)
        return out

    def take_replies(self) -> list[ToApi]:
        out, self.replies = self.replies, []
        return out

    def make_stats(self, call_id: int) -> StatsResp:
        used = self.mem.used_tokens()
        total = self.mem.max_total_tokens
        s = self.stats
        queued = self.queued_reqs()
        return StatsResp(
            call_id=call_id,
            num_running_reqs=len(self.live_reqs()),
            num_decoding_reqs=len(self.running),
            num_waiting_reqs=len(queued),
            waiting_prompt_tokens=sum(len(r.origin_input_ids) for r in queued),  # per snapshot, not per step
            num_used_tokens=used,
            max_total_tokens=total,
            token_usage=used / max(total, 1),
            cache_hit_rate=s.cache_hit_rate(),
            gen_throughput=s.gen_throughput(time.monotonic()),
            num_retracted_total=s.num_retracted,
            num_migrated_total=self.migrator.migrated,
            num_prefill_batches=s.num_prefill_batches,
            num_decode_batches=s.num_decode_batches,
            max_decode_batch_size=s.max_decode_batch_size,
            num_overlapped_batches=s.num_overlapped_batches,
            total_prompt_tokens=s.total_prompt_tokens,
            total_cached_tokens=s.total_cached_tokens,
            disaggregation_mode=self.role.name,
            epoch=self.controller.epoch,
            handing_over_from=self.controller.handing_over_from,
            queue_sizes={"waiting": len(self.waiting_queue), "running": len(self.running),
                         "grammar": len(self.grammars.waiting),
                         **self.role.queue_sizes(), **self.migrator.queue_sizes()},
            queued_prefill_tokens=self.queued_prefill_tokens(),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **self._transfer_stats(),
        )

    def queued_prefill_tokens(self) -> int:
        chunked = self.planner.chunked_req
        waiting = sum(len(r.all_ids) - r.kv_len for r in self.waiting_queue)
        left = len(chunked.all_ids) - chunked.kv_len if chunked is not None else 0
        return waiting + left + self.role.queued_prefill_tokens()

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
