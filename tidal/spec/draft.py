"""DraftModel: a smaller model of the target's vocabulary guesses a few tokens ahead (SGLang's STANDALONE).

The draft keeps its own KV pool with as many slots as the target's, indexed by the same slots: a
token's target KV at slot i has its draft KV at slot i of the draft pool, so the scheduler's one
allocation (req_to_token, the prefix cache, freeing) serves both. `Req.draft_kv_len` says how many
of a request's leading positions hold draft KV; the draft's KV of a position is written by

- `mirror`: after every prefill pass the draft runs the same pass (same tokens, same slots) into
  its pool, so a prefix the target computed has the draft's KV too;
- `propose`: its first pass catches up every position the draft has not seen (the last output token;
  also the guess after the last kept one when the target kept them all, and a prompt whose KV came
  from a prefill server that ran no draft), the next passes run one guess each. Guesses are the
  draft's argmax: a one-hot proposal, which the target's verification accepts with its own
  probability, so sampled output keeps the target's distribution (tidal/spec/verify.py).

The slots for the last token and the guesses are allocated before the draft runs (the verify
batch's), and a verification that refuses guesses frees their slots for both models
(`KVMemory.drop_tail` clamps `draft_kv_len`). A prefix cached by a request that ended right after a
pass whose guesses were all kept lacks the draft's KV of one position: a later request reading it
guesses worse, never wrongly (the target verifies every guess).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tidal.scheduler.req import Req
from tidal.scheduler.schedule_batch import ScheduleBatch, extend_forward_batch
from tidal.spec.cost import PassCost


class DraftModel:
    def __init__(self, runner, target_config) -> None:
        cfg = runner.model_config
        if cfg.vocab_size != target_config.vocab_size:
            raise ValueError(f"the draft model has a vocabulary of {cfg.vocab_size} tokens, the target "
                             f"{target_config.vocab_size}: a draft must share the target's tokenizer")
        self.runner = runner
        self.passes = 0  # draft passes run (mirrors and guesses)
        self.cost = PassCost()  # the guessing passes' times (the speculator weighs them against their guesses)

    @property
    def kv_pool(self):
        return self.runner.kv_pool

    def mirror(self, batch: ScheduleBatch) -> None:
        """The draft's KV of a prefill pass the target just ran (no logits: nothing is sampled)."""
        fb = dataclasses.replace(batch.forward_batch, kv_pool=self.runner.kv_pool)
        self.runner.forward(fb, torch.empty(0, dtype=torch.int64, device=fb.input_ids.device))
        self.passes += 1
        for r in batch.reqs:
            r.draft_kv_len = r.kv_len

    def propose(self, reqs: list[Req], counts: list[int], table: torch.Tensor) -> list[list[int]]:
        """`counts[i]` (>= 1) guesses for request i, whose slots for positions kv_len .. kv_len + counts[i]
        are allocated in `table` (kv_len not yet moved)."""
        guesses: list[list[int]] = [[] for _ in reqs]
        starts = [min(r.draft_kv_len, r.kv_len) for r in reqs]
        tokens = [r.all_ids[s:] for r, s in zip(reqs, starts)]  # the catch-up: every position the draft lacks
        live = list(range(len(reqs)))
        while live:
            picked = self._step([reqs[i] for i in live], [tokens[i] for i in live], [starts[i] for i in live], table)
            for i, g in zip(live, picked, strict=True):
                guesses[i].append(g)
                starts[i] += len(tokens[i])
                tokens[i] = [g]
            live = [i for i in live if len(guesses[i]) < counts[i]]
        for r, n in zip(reqs, counts, strict=True):
            r.draft_kv_len = r.kv_len + n  # positions kv_len .. kv_len + n - 1: the last token and n - 1 guesses
        return guesses

    def _step(self, reqs: list[Req], tokens: list[list[int]], starts: list[int], table: torch.Tensor) -> list[int]:
        """One draft pass: `tokens[i]` at positions starts[i] .. on top of request i's draft KV; the argmax
        after each request's last token."""
        dev = table.device
        seq_lens = [s + len(t) for s, t in zip(starts, tokens, strict=True)]
        idx = [r.req_pool_idx for r in reqs]
        out_loc = torch.cat([table[i, s:e] for i, s, e in zip(idx, starts, seq_lens, strict=True)])
        positions = torch.cat([torch.arange(s, e, dtype=torch.int64, device=dev) for s, e in zip(starts, seq_lens)])
        flat = [t for ts in tokens for t in ts]
        fb = extend_forward_batch(reqs, flat, positions, out_loc, starts, seq_lens, table, self.runner.kv_pool)
        fb.lora_names = None  # the draft has no adapters
        last = torch.tensor([len(t) for t in tokens], dtype=torch.int64, device=dev).cumsum(0) - 1
        t0 = time.perf_counter()
        picked = self.runner.forward(fb, last).argmax(dim=-1).tolist()
        self.cost.observe(len(flat), time.perf_counter() - t0)
        self.passes += 1
        return picked
