"""What the scheduler asks of speculative decoding: guesses for a decode step (or none,
and the step decodes as usual), and the accept-length statistics."""

from __future__ import annotations

from typing import Any, Optional

from tidal.scheduler.memory import KVMemory
from tidal.scheduler.req import Req
from tidal.spec.ngram import NgramProposer


class Speculator:
    def __init__(self, args: Any, context_length: int):
        self.proposer = NgramProposer(args.speculative_num_draft_tokens,
                                      args.speculative_ngram_min_match_window_size,
                                      args.speculative_ngram_max_match_window_size)
        self.context_length = context_length
        self.verify_steps = 0  # requests x verification passes
        self.draft_tokens = 0
        self.accepted_tokens = 0  # guesses the target kept
        self.emitted_tokens = 0  # kept guesses plus the target's own token of each step

    def drafts(self, reqs: list[Req], mem: KVMemory) -> Optional[list[list[int]]]:
        """Guesses per request for this step, or None: decode as usual (nothing guessed, a
        constrained request in the batch, or too little KV for the guesses)."""
        if any(r.grammar is not None for r in reqs):
            return None  # its matcher would have to follow every guess
        drafts = [self.proposer.propose(r.all_ids, self._room(r)) for r in reqs]
        if not any(drafts):
            return None
        need = sum(1 + len(d) for d in drafts) + len(reqs) * mem.page_size
        return drafts if need <= mem.available_tokens() else None

    def _room(self, req: Req) -> int:
        """Guesses that can still become output: the target's own token comes after them."""
        left = min(req.sampling.max_new_tokens - len(req.output_ids),
                   self.context_length - len(req.origin_input_ids) - len(req.output_ids))
        return left - 1

    def record(self, drafts: list[list[int]], gained: list[list[int]]) -> None:
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
