"""Req: the scheduler's mutable view of one request. Only the scheduler mutates it."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tidal.messages import FinishReason, GenerateReq, ReqOutput
from tidal.sampling_params import SamplingParams

_EMPTY = torch.empty(0, dtype=torch.int64)


class Req:
    """Token state, KV ownership and output bookkeeping of one request.

    Invariants (asserted in `check_invariants`):
    - `kv_len` tokens of `all_ids` have KV in `req_to_token[req_pool_idx, :kv_len]`;
    - `len(prefix_indices) <= kv_len` and those slots are the request's prefix
      (shared with the cache tree, plus an unaligned tail the request owns);
    - in decode, `kv_len == len(all_ids) - 1` (the last token is the next input).
    """

    def __init__(self, msg: GenerateReq):
        self.rid = msg.rid
        self.origin_input_ids: list[int] = list(msg.input_ids)
        self.sampling: SamplingParams = msg.sampling
        self.stream = msg.stream
        self.return_logprob = msg.return_logprob
        self.logprob_start_len = msg.logprob_start_len
        self.top_logprobs_num = msg.top_logprobs_num
        self.arrival_time = msg.arrival_time
        self.priority = msg.priority if msg.priority is not None else 0
        self.bootstrap_host = msg.bootstrap_host
        self.bootstrap_port = msg.bootstrap_port
        self.bootstrap_room = msg.bootstrap_room
        self.lora_name: Optional[str] = msg.lora_name  # its KV is cached under this adapter only
        self.pd: Any = None  # PDState while a prefill/decode role transfers this request's KV
        # llguidance matcher of a constrained request: it has consumed every output token so far
        # (advanced in the thread that samples; see tidal/constrained/masks.py)
        self.grammar: Any = None
        self.is_embedding = msg.embedding
        self.pool_state: Any = None  # PoolState while an embedding request's prompt is prefilled
        self.embedding: Optional[list[float]] = None

        self.output_ids: list[int] = []
        # tokens whose KV this prefill round makes resident (prompt, or prompt+output after retraction)
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.req_pool_idx: Optional[int] = None
        self.kv_len = 0

        self.finished_reason: Optional[FinishReason] = None
        self.to_abort: Optional[str] = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (first prefill only)
        self.is_chunked = 0  # >0 while a chunked prefill of this request is unfinished
        self.num_retractions = 0
        self.sent_len = 0  # output tokens already sent to the API process
        self.first_prefill_done = False
        # speculative decoding: its guesses kept and refused, decayed (a prior of one each)
        self.spec_kept = 1.0
        self.spec_refused = 1.0
        self.spec_idle = 1 << 20  # steps since it last guessed (its first chance explores)
        self.draft_kv_len = 0  # leading positions whose KV the draft model holds (tidal/spec/draft.py)
        # sliding-window models: positions below this no longer free their SWA pages through this
        # request (freed already, or the prefix tree's; tidal/kvcache/swa.py)
        self.swa_freed_to = 0
        # the windows it left in the tree at its chunk boundaries, (start, stop): given back once passed
        self.swa_chunk_windows: list[tuple[int, int]] = []

        self.output_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[tuple[Optional[float], int]] = []
        self.input_top_logprobs: list[Optional[list[tuple[float, int]]]] = []

    # ------------------------------------------------------------------ views

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    def prefix_match_limit(self) -> int:
        """How many leading tokens may come from the cache.

        At least one token must be computed to sample from; prompt logprobs need
        logits from position `logprob_start_len - 1` on.
        """
        limit = len(self.fill_ids) - 1
        if self.wants_input_logprobs and not self.first_prefill_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)

    def reserved_decode_tokens(self, clip: int) -> int:
        return min(self.sampling.max_new_tokens - len(self.output_ids), clip)

    # ------------------------------------------------------------------ transitions

    def init_next_round_input(self) -> None:
        """Prepare a (re-)prefill: fill_ids is everything whose KV must be resident."""
        self.fill_ids = self.all_ids
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.req_pool_idx = None
        self.kv_len = 0
        self.draft_kv_len = 0
        self.swa_freed_to = 0
        self.swa_chunk_windows = []
        self.extend_input_len = 0
        self.is_chunked = 0
        self.num_retractions += 1

    def finish(self, reason: FinishReason) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason

    def take_output(self, final: bool) -> ReqOutput:
        """The increment since the previous take_output."""
        new = self.output_ids[self.sent_len:]
        start = self.sent_len
        self.sent_len = len(self.output_ids)
        out = ReqOutput(
            rid=self.rid,
            new_token_ids=new,
            finish_reason=self.finished_reason if final else None,
            prompt_tokens=len(self.origin_input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
        )
        if final and self.embedding is not None:
            out.embedding = self.embedding
        if self.return_logprob:
            out.output_logprobs = self.output_logprobs[start:]
            if self.top_logprobs_num > 0:
                out.output_top_logprobs = self.output_top_logprobs[start:]
            if start == 0 and self.wants_input_logprobs:
                out.input_logprobs = self.input_logprobs
                if self.top_logprobs_num > 0:
                    out.input_top_logprobs = self.input_top_logprobs
        return out

    def check_invariants(self) -> None:
        assert len(self.prefix_indices) <= self.kv_len or self.req_pool_idx is None, self.rid
        if self.req_pool_idx is not None and not self.is_chunked and self.first_prefill_done:
            assert self.kv_len == len(self.all_ids) - 1, (self.rid, self.kv_len, len(self.all_ids))

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
            f"kv={self.kv_len}, prefix={len(self.prefix_indices)}, pool={self.req_pool_idx})"
        )
