"""Counters the scheduler keeps for /metrics and /get_load."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from tidal.model.forward_batch import ForwardMode

THROUGHPUT_WINDOW_S = 5.0


@dataclass
class SchedulerStats:
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    num_overlapped_batches: int = 0  # decode passes launched while the previous one was in flight
    max_decode_batch_size: int = 0
    num_retracted: int = 0
    total_prompt_tokens: int = 0
    total_cached_tokens: int = 0
    _gen_events: collections.deque = field(default_factory=collections.deque)

    def on_batch(self, batch) -> None:
        now = time.monotonic()
        if batch.mode is ForwardMode.DECODE:
            self.num_decode_batches += 1
            self.max_decode_batch_size = max(self.max_decode_batch_size, len(batch.reqs))
            self._gen_events.append((now, len(batch.reqs)))
        else:
            self.num_prefill_batches += 1
            self._gen_events.append((now, len(batch.reqs)))
        while self._gen_events and now - self._gen_events[0][0] > THROUGHPUT_WINDOW_S:
            self._gen_events.popleft()

    def on_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.total_prompt_tokens += prompt_tokens
        self.total_cached_tokens += cached_tokens

    def cache_hit_rate(self) -> float:
        return self.total_cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def gen_throughput(self, now: float) -> float:
        """Generated tokens per second over the last few seconds."""
        events = [e for e in self._gen_events if now - e[0] <= THROUGHPUT_WINDOW_S]
        if not events:
            return 0.0
        span = max(now - events[0][0], 1e-3)
        return sum(n for _, n in events) / span
