"""Prompt-lookup proposals (SGLang's NGRAM algorithm, vLLM's `ngram`): the request's
latest n tokens, found earlier in its prompt or output, propose the tokens that followed
them there."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Longest match first: n from max_window down to min_window; the latest earlier
    occurrence of the suffix wins; at most `num_draft_tokens` tokens follow it."""

    def __init__(self, num_draft_tokens: int, min_window: int = 1, max_window: int = 12):
        if num_draft_tokens < 1 or not 1 <= min_window <= max_window:
            raise ValueError("need num_draft_tokens >= 1 and 1 <= min_window <= max_window")
        self.num_draft_tokens = num_draft_tokens
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, num_draft_tokens) guessed next tokens; [] when nothing matches."""
        k = min(limit, self.num_draft_tokens)
        if k <= 0 or len(tokens) < self.min_window + 1:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_window, len(seq) - 1), self.min_window - 1, -1):
            start = _latest_match(seq, n)
            if start >= 0:
                follow = seq[start + n : start + n + k]
                if len(follow):
                    return follow.tolist()
        return []


def _latest_match(seq: np.ndarray, n: int) -> int:
    """Start of the latest occurrence of seq[-n:] that ends before the last token, or -1."""
    suffix = seq[-n:]
    body = seq[:-1]
    if len(body) < n:
        return -1
    hits = np.flatnonzero(body[: len(body) - n + 1] == suffix[0])
    for start in hits[::-1]:
        if np.array_equal(body[start : start + n], suffix):
            return int(start)
    return -1
