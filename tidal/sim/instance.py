"""One simulated server: a role, a KV budget, a waiting queue, a running batch, and steps.

Each step is what the live scheduler's loop does once (tidal/scheduler/batching.py): a
prefill batch when one can be formed, chosen by the live admission code
(`PrefillAdder` + `admit_waiting`, chunked at --chunked-prefill-size), else one decode step
of the running batch. A prefill-mode server only prefills: a prefilled request's KV goes
to its decode server (kv_transfer_seconds) and is freed here once sent; one that was a
decode or null server finishes the requests it held (a handover), with as much time as its prompts. A decode-mode
server admits transferred requests into its running batch while KV and the running limit
allow (the first token is emitted then). Step durations come from the cost model.

No prefix cache (the trace has no text): the admission sees an empty radix cache.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tidal.config import ServerArgs
from tidal.scheduler.policy import CLIP_MAX_NEW_TOKENS, PrefillAdder, admit_waiting, request_slots

PREFILL, DECODE, NULL = "prefill", "decode", "null"


class SimReq:
    """A request as the live admission code sees it (the attributes PrefillAdder reads)."""

    __slots__ = ("rid", "arrival", "input_len", "output_len", "generated", "computed", "kv_len", "path",
                 "prefill_url", "decode_url", "first_token_at", "finished_at", "outcome", "fill_ids",
                 "prefix_indices", "extend_input_len", "req_pool_idx", "last_node", "retractions", "ticket")

    def __init__(self, rid: int, arrival: float, input_len: int, output_len: int) -> None:
        self.rid, self.arrival, self.input_len, self.output_len = rid, arrival, input_len, output_len
        self.generated = 0  # output tokens so far (the first one comes from the prefill)
        self.computed = 0  # tokens whose KV is resident on the server holding it
        self.kv_len = 0
        self.path = ""  # "pd" or "null"
        self.prefill_url = self.decode_url = ""
        self.first_token_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.outcome = ""  # "", then "finished", "rejected" or "unfinished"
        self.retractions = 0
        self.ticket: Any = None  # the planner window's InFlight (its answer tokens so far)
        self.fill_ids: range = range(0)
        self.prefix_indices: range = range(0)
        self.extend_input_len = 0
        self.req_pool_idx: Optional[int] = None
        self.last_node = None

    @property
    def all_len(self) -> int:
        return self.input_len + self.generated

    def reserved_decode_tokens(self, clip: int) -> int:
        return min(self.output_len - self.generated, clip)

    def match(self) -> None:
        """The prefix match of an empty cache: what this server already computed of the request."""
        self.fill_ids = range(self.all_len)
        self.prefix_indices = range(self.computed)
        self.extend_input_len = self.all_len - self.computed

    def init_next_round_input(self) -> None:
        self.match()

    @property
    def prefill_tokens_left(self) -> int:
        return self.all_len - self.computed


class NoCache:
    """The radix cache of a server with nothing cached."""

    def evictable_size(self) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass


NO_CACHE = NoCache()


class Limits:
    """The live server's scheduling limits (ServerArgs defaults unless given)."""

    def __init__(self, args: Optional[ServerArgs] = None) -> None:
        a = args or ServerArgs()
        self.chunk: Optional[int] = None if a.chunked_prefill_size in (-1, 0) else a.chunked_prefill_size
        self.max_prefill_tokens = a.max_prefill_tokens
        self.max_running = a.max_running_requests
        self.page_size = a.page_size
        self.init_ratio = min(a.init_new_token_ratio * a.schedule_conservativeness, 1.0)
        self.min_ratio = self.init_ratio * a.min_new_token_ratio_factor
        self.ratio_decay = (self.init_ratio - self.min_ratio) / max(a.new_token_ratio_decay_steps, 1)


class Step:
    """One step in progress: its kind, its requests, and (prefill) the chunked one."""

    __slots__ = ("kind", "reqs", "chunked", "seconds")

    def __init__(self, kind: str, reqs: list, chunked: Optional[SimReq], seconds: float) -> None:
        self.kind, self.reqs, self.chunked, self.seconds = kind, reqs, chunked, seconds


class SimInstance:
    def __init__(self, url: str, mode: str, cost: Any, limits: Limits) -> None:
        self.url, self.mode, self.cost, self.limits = url, mode, cost, limits
        self.capacity = int(cost.max_total_tokens)
        self.kv_used = 0
        self.waiting: list[SimReq] = []  # to prefill here
        self.arrived: list[SimReq] = []  # decode mode: KV transferred, waiting for a running slot
        self.running: list[SimReq] = []
        self.chunked: Optional[SimReq] = None
        self.sending = 0  # prefill mode: requests whose KV is being transferred out
        self.assigned = 0  # requests the router sent here that this server still holds (drain waits for 0)
        self.pd_decodes = 0  # PD requests this server decodes (or will), not yet ended: a handover lasts while > 0
        self.pd_awaiting_kv = 0  # of those, the ones whose KV has not joined the running batch yet
        self.null_reqs = 0  # colocated requests sent here, not yet ended (and a handover from null while > 0)
        self.largest_decode_batch = 0  # the most requests one of its decode steps ran (against the profile's points)
        self.answers_owed_s = 0.0  # a prefill server finishing handed-over answers: decode time they are owed
        self.handover_move: Any = None  # the move whose answers this server still finishes
        self.prompts_received = self.prompt_tokens_received = 0  # as the live scheduler counts them
        self.new_token_ratio = limits.init_ratio
        self.step: Optional[Step] = None
        self.wake_pending = False
        self.busy_s = 0.0

    # ------------------------------------------------------------ KV

    def available_size(self) -> int:  # the allocator's view for PrefillAdder
        return self.capacity - self.kv_used

    def free(self, req: SimReq) -> None:
        self.kv_used -= req.kv_len
        req.kv_len = 0

    # ------------------------------------------------------------ load, as /get_load reports it

    def load(self) -> dict:
        waiting = len(self.waiting) + len(self.arrived)
        queued = sum(r.prefill_tokens_left for r in self.waiting)
        if self.chunked is not None:
            queued += self.chunked.prefill_tokens_left
        return {"num_reqs": waiting + len(self.running) + (self.chunked is not None), "num_waiting_reqs": waiting,
                "num_tokens": self.kv_used, "num_queued_prefill_tokens": queued, "max_total_tokens": self.capacity,
                "num_decoding_reqs": len(self.running),
                "num_waiting_prompt_tokens": sum(r.input_len for r in self.waiting + self.arrived),
                "prompts_received_total": self.prompts_received,
                "prompt_tokens_received_total": self.prompt_tokens_received,
                "handing_over_from": self.handover_move.src if self.handing_over() else ""}

    def receive(self, r: SimReq) -> None:
        """The router sent `r` here (to prefill, or a PD request to decode)."""
        self.assigned += 1
        self.prompts_received += 1
        self.prompt_tokens_received += r.input_len

    def idle(self) -> bool:
        return self.assigned == 0 and self.step is None

    # ------------------------------------------------------------ choosing the next step

    def handing_over(self) -> bool:
        """Switched with its old role's requests still to finish (live: roles/handover.py): a decode server's
        answers under prefill, a null server's requests under prefill; under null, a decode server's PD requests
        still waiting for their KV (the decode role's queues: once in the running batch they are null's own)."""
        if self.mode == PREFILL:
            return self.pd_decodes > 0 or self.null_reqs > 0
        return self.mode == NULL and self.pd_awaiting_kv > 0

    def reversible(self) -> bool:
        """A switch back to the role a handover replaced may go (live: ModeController._reversible): a prefill
        server holds no PD prompt of its own. (Under null, the live server waits for the prefixes its requests
        hold where its decode role shared none; no prefix cache here.)"""
        return self.mode != PREFILL or self.assigned == self.pd_decodes + self.null_reqs

    def next_step(self) -> Optional[Step]:
        if self.mode == DECODE or self.arrived:
            self._admit_arrived()
        if self.mode == PREFILL and self.running:
            return self._handover_step()
        self.answers_owed_s = 0.0
        step = self._prefill_step()
        if step is None and self.mode != PREFILL:
            step = self._decode_step()
        return step

    def _handover_step(self) -> Optional[Step]:
        """A prefill server's handed-over answers get as much time as the prompts while prompts wait (after a
        prefill step, decode steps until they have taken as long), every step when none do."""
        step = self._decode_step() if self.answers_owed_s > 0 else None
        if step is None:
            step = self._prefill_step()
        if step is None:
            step = self._decode_step()
        if step.kind == "prefill":
            self.answers_owed_s += step.seconds
        else:
            self.answers_owed_s = max(self.answers_owed_s - step.seconds, 0.0)
        return step

    def _prefill_step(self) -> Optional[Step]:
        lim = self.limits
        if not self.waiting and self.chunked is None:
            return None
        running_bs = len(self.running)
        # a prefill server's PD prompts leave once prefilled: answers handed over to it do not hold them back
        decodes_here = (lambda r: r.decode_url == self.url) if self.mode == PREFILL else None
        if running_bs >= lim.max_running and self.chunked is None and decodes_here is None:
            return None
        held = self.running + ([self.chunked] if self.chunked is not None else [])
        adder = PrefillAdder(NO_CACHE, self, held, self.new_token_ratio, lim.max_prefill_tokens, lim.chunk,
                             lim.page_size)
        if self.chunked is not None:
            adder.add_chunked_req(self.chunked)
        # request slots: the running batch's (where the running limit binds first), else the live table's rows
        free = lim.max_running - running_bs if decodes_here is None else request_slots(lim.max_running) - len(held)
        admit_waiting(adder, self.waiting, running_bs, lim.max_running, free, SimReq.match, decodes_here)
        if not adder.can_run_list:
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        for r in adder.can_run_list:
            r.req_pool_idx = 0
            self.kv_used += r.extend_input_len
            r.kv_len += r.extend_input_len
        self.chunked = adder.new_chunked_req
        seconds = self.cost.prefill_step_seconds([r.extend_input_len for r in adder.can_run_list])
        return Step("prefill", adder.can_run_list, self.chunked, seconds)

    def _decode_step(self) -> Optional[Step]:
        if not self.running:
            return None
        if len(self.running) > self.available_size():
            self._retract()
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.limits.ratio_decay, self.limits.min_ratio)
        reqs = list(self.running)
        context = sum(r.kv_len for r in reqs)
        for r in reqs:  # the step writes one KV slot per request
            r.kv_len += 1
        self.kv_used += len(reqs)
        self.largest_decode_batch = max(self.largest_decode_batch, len(reqs))
        return Step("decode", reqs, None, self.cost.decode_step_seconds(len(reqs), context))

    def _retract(self) -> None:
        """Out of KV for one more token each: the youngest requests go back to the waiting queue."""
        order = sorted(self.running, key=lambda r: (r.generated, -r.input_len), reverse=True)
        back = []
        while len(order) > 1 and len(order) > self.available_size():
            r = order.pop()
            self.free(r)
            r.computed, r.req_pool_idx, r.retractions = 0, None, r.retractions + 1
            back.append(r)
        self.running = order
        self.waiting = back[::-1] + self.waiting
        decoded = sum(r.generated for r in order)
        total = sum(r.output_len for r in order)
        self.new_token_ratio = min(1.0, (decoded + 20 * len(order)) / (total + 1))

    def _admit_arrived(self) -> None:
        """Decode mode: transferred requests join the batch while KV (with their decode room) and slots allow."""
        while self.arrived and len(self.running) < self.limits.max_running:
            r = self.arrived[0]
            reserve = int(sum(x.reserved_decode_tokens(CLIP_MAX_NEW_TOKENS) for x in self.running + [r])
                          * self.new_token_ratio)
            if self.running and r.all_len + reserve > self.available_size():
                return
            self.arrived.pop(0)
            self.pd_awaiting_kv -= 1
            r.kv_len = r.computed = r.all_len
            self.kv_used += r.kv_len
            self.running.append(r)
            self.on_first_token(r)

    # ------------------------------------------------------------ hooks the cluster sets

    on_first_token: Callable[[SimReq], None] = staticmethod(lambda r: None)
