"""Finish conditions: length, stop token ids, EOS, stop strings, context length, abort."""

from __future__ import annotations

from typing import Any, Optional

from tidal.messages import FinishReason
from tidal.scheduler.req import Req


class StopChecker:
    def __init__(self, tokenizer: Optional[Any], eos_ids: list[int], context_length: int):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length

    def check(self, req: Req) -> None:
        """Set req.finished_reason if the last appended token ends the request."""
        if req.finished:
            return
        if req.to_abort:
            req.finish(FinishReason(type="abort", message=req.to_abort))
            return
        sp = req.sampling
        out = req.output_ids
        if len(out) >= sp.max_new_tokens:
            req.finish(FinishReason(type="length", length=sp.max_new_tokens))
            return
        if len(req.origin_input_ids) + len(out) >= self.context_length:
            req.finish(FinishReason(type="length", length=len(out)))
            return
        if len(out) < sp.min_new_tokens:
            return
        last = out[-1]
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_ids):
            req.finish(FinishReason(type="stop", matched=last))
            return
        if sp.stop and self.tokenizer is not None:
            matched = self._match_stop_string(req)
            if matched is not None:
                req.finish(FinishReason(type="stop", matched=matched))

    def ends_by_length(self, req: Req, pending: int = 0) -> bool:
        """True when the request ends on length once `pending` more output tokens are appended."""
        n = len(req.output_ids) + pending
        return n >= req.sampling.max_new_tokens or len(req.origin_input_ids) + n >= self.context_length

    def _match_stop_string(self, req: Req) -> Optional[str]:
        longest = max(len(s) for s in req.sampling.stop)
        # a token decodes to >= 1 char, so the last `longest + 1` tokens cover any new match
        tail_ids = req.output_ids[-(longest + 1):]
        tail = self.tokenizer.decode(tail_ids, skip_special_tokens=req.sampling.skip_special_tokens)
        for s in req.sampling.stop:
            if s in tail:
                return s
        return None
