"""What the scheduler asks of speculative decoding: a verification pass for a decode step (or none,
and the step decodes as usual), the draft model's share of prefill passes, and the accept-length
statistics."""

from __future__ import annotations

import heapq
from typing import Any, Optional

from tidal.scheduler.memory import KVMemory
from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch
from tidal.spec.cost import PassCost
from tidal.spec.draft import DraftModel
from tidal.spec.ngram import NgramProposer
from tidal.spec.verify import build_verify_batch, reserve_verify_slots

DECAY = 0.8  # weight of a request's earlier verifications against its latest
EXPLORE_EVERY = 8  # a request that has not guessed for this many steps guesses once anyway (its record may be stale)


class Speculator:
    def __init__(self, args: Any, context_length: int, draft: Optional[DraftModel] = None):
        """`draft`: STANDALONE's draft model (guesses from its passes), else NGRAM's prompt lookup."""
        self.guesses = args.speculative_guesses
        self.proposer = NgramProposer(self.guesses, args.speculative_ngram_min_match_window_size,
                                      args.speculative_ngram_max_match_window_size)
        self.draft = draft
        self.context_length = context_length
        self.cost = PassCost()
        self.verify_steps = 0  # requests x verification passes
        self.draft_tokens = 0
        self.accepted_tokens = 0  # guesses the target kept
        self.emitted_tokens = 0  # kept guesses plus the target's own token of each step

    def verify_batch(self, reqs: list[Req], mem: KVMemory, kv_pool: Any) -> Optional[ScheduleBatch]:
        """This step's verification pass, or None: decode as usual (nothing guessed, a constrained
        request in the batch, or too little KV for the guesses)."""
        if any(r.grammar is not None for r in reqs):
            return None  # its matcher would have to follow every guess
        if self.draft is None:
            drafts = self.drafts(reqs, mem)
            return None if drafts is None else build_verify_batch(reqs, drafts, mem, kv_pool)
        counts = [len(p) for p in self._worth_it(reqs, [[0] * min(self.guesses, self._room(r)) for r in reqs])]
        if not any(counts) or not self._fits(counts, mem):
            return None
        out_loc = reserve_verify_slots(reqs, [1 + n for n in counts], mem)
        guessing = [i for i, n in enumerate(counts) if n]
        drafts: list[list[int]] = [[] for _ in reqs]
        proposed = self.draft.propose([reqs[i] for i in guessing], [counts[i] for i in guessing], mem.req_to_token)
        for i, d in zip(guessing, proposed, strict=True):
            drafts[i] = d
        return build_verify_batch(reqs, drafts, mem, kv_pool, out_loc)

    def drafts(self, reqs: list[Req], mem: KVMemory) -> Optional[list[list[int]]]:
        """NGRAM's guesses per request for this step (none constrained), or None: decode as usual (nothing
        guessed, or too little KV for the guesses)."""
        drafts = self._worth_it(reqs, [self.proposer.propose(r.all_ids, self._room(r)) for r in reqs])
        if not any(drafts):
            return None
        return drafts if self._fits([len(d) for d in drafts], mem) else None

    @staticmethod
    def _fits(counts: list[int], mem: KVMemory) -> bool:
        return sum(1 + n for n in counts) + len(counts) * mem.page_size <= mem.available_tokens()

    def after_extend(self, batch: ScheduleBatch) -> None:
        """A prefill pass ran: the draft model computes its KV of the same tokens."""
        if self.draft is not None:
            self.draft.mirror(batch)

    def _worth_it(self, reqs: list[Req], proposals: list[list[int]]) -> list[list[int]]:
        """The proposals cut to the guesses that raise the pass's expected tokens per second.

        A request's j-th guess is kept with probability a^j, a being its guesses' record
        (kept / (kept + refused), decayed); a pass of T tokens costs fixed + per_token * T,
        and with a draft model each round of guesses (the j-th guesses of every request that
        makes j) one draft pass more, `round_cost` tokens' worth. Guesses are taken best first
        while the next one's expected tokens exceed what its cost yields at the rate reached so
        far: a^j * (fixed / per_token + T + D) > gained * (1 + c), D the draft rounds' cost so far,
        c the round this guess opens (0 if open). A request idle for EXPLORE_EVERY steps guesses
        once first, so a record can recover.
        """
        ratio = self.cost.fixed_over_per_token()
        round_cost = self._draft_round_cost()
        rate = [r.spec_kept / (r.spec_kept + r.spec_refused) for r in reqs]
        take = [1 if p and r.spec_idle >= EXPLORE_EVERY else 0 for r, p in zip(reqs, proposals, strict=True)]
        gained = len(reqs) + sum(a for a, k in zip(rate, take) if k)
        tokens = len(reqs) + sum(take)
        rounds = 1 if any(take) else 0
        drafting = round_cost * rounds
        heap = [(-a ** (k + 1), i) for i, (a, p, k) in enumerate(zip(rate, proposals, take, strict=True))
                if len(p) > k]
        heapq.heapify(heap)
        while heap:
            value, i = heapq.heappop(heap)
            value = -value
            opens = round_cost if take[i] + 1 > rounds else 0.0
            if value * (ratio + tokens + drafting) <= gained * (1 + opens):
                break  # the best guess left does not pay; no other does
            take[i] += 1
            rounds = max(rounds, take[i])
            drafting += opens
            gained += value
            tokens += 1
            if take[i] < len(proposals[i]):
                heapq.heappush(heap, (-value * rate[i], i))
        for r, k in zip(reqs, take, strict=True):
            r.spec_idle = 0 if k else r.spec_idle + 1
        return [p[:k] for p, k in zip(proposals, take, strict=True)]

    def _draft_round_cost(self) -> float:
        """A draft pass in target tokens' worth of time (0 without a draft model, or while either fit
        is unknown: guess freely until measured)."""
        if self.draft is None:
            return 0.0
        fit, draft_s = self.cost.fit(), self.draft.cost.mean_seconds()
        return 0.0 if fit is None or draft_s is None else draft_s / fit[1]

    def _room(self, req: Req) -> int:
        """Guesses that can still become output: the target's own token comes after them."""
        left = min(req.sampling.max_new_tokens - len(req.output_ids),
                   self.context_length - len(req.origin_input_ids) - len(req.output_ids))
        return left - 1

    def record(self, reqs: list[Req], drafts: list[list[int]], gained: list[list[int]]) -> None:
        for req, d, g in zip(reqs, drafts, gained, strict=True):
            if d:
                kept = min(len(g) - 1, len(d))
                req.spec_kept = req.spec_kept * DECAY + kept
                req.spec_refused = req.spec_refused * DECAY + (kept < len(d))
        self.verify_steps += len(drafts)
        self.draft_tokens += sum(len(d) for d in drafts)
        self.emitted_tokens += sum(len(g) for g in gained)
        self.accepted_tokens += sum(len(g) - 1 for g in gained)

    def stats(self) -> dict:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accept_length": self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0,
            "spec_accept_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
        }
