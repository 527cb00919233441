"""The prompts the workers received, from their own counters: the arrivals' prompt lengths as they arrive.

The router learns a request's lengths when it ends, and the requests that end first are the short ones: on a
cluster filling up (64 workers, the conversation trace, t = 10 s) the finished requests' prompts averaged 216
tokens against 258 arrived. Each tidal worker counts the requests it accepts and their prompt tokens
(`/get_load`'s `prompts_received_total`, `prompt_tokens_received_total`); a PD request reaches one prefill and
one decode worker, a colocated one a null worker, so the prefill and null workers' counts are the arrivals, each
once.
"""

from __future__ import annotations

import collections
from typing import Optional

from tidal.planner.schema import DECODE, WorkerLoad

MIN_RECEIVED_SAMPLES = 20  # arrivals in the window before their mean prompt counts


class ReceivedPrompts:
    """At each observation, the requests that prefill and null workers accepted since the last one and their
    prompt tokens (the difference of each worker's counters); over the last `window_s`, their mean prompt. A
    worker seen for the first time, back from a move (in another mode) or whose counters went back (a restart)
    starts again from its counters."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.last: dict[str, tuple[str, int, int]] = {}  # url -> (mode, prompts, tokens) when last observed
        self.received: collections.deque[tuple[float, int, int]] = collections.deque()  # (at, prompts, tokens)
        self.every_worker_reports = False  # at the last observation, every prefill and null worker

    def observe(self, now: float, loads: list[WorkerLoad]) -> None:
        prompts = tokens = 0
        seen: dict[str, tuple[str, int, int]] = {}
        self.every_worker_reports = True
        for w in loads:
            if w.mode == DECODE:
                continue
            if w.prompts_received < 0 or w.prompt_tokens_received < 0:
                self.every_worker_reports = False
                continue
            seen[w.url] = (w.mode, w.prompts_received, w.prompt_tokens_received)
            before = self.last.get(w.url)
            if before is not None and before[0] == w.mode and before[1] <= w.prompts_received:
                prompts += w.prompts_received - before[1]
                tokens += w.prompt_tokens_received - before[2]
        self.last = seen
        if prompts:
            self.received.append((now, prompts, tokens))
        while self.received and self.received[0][0] <= now - self.window_s:
            self.received.popleft()

    def newest(self, since: float) -> tuple[int, float]:
        """(how many requests were received after `since`, their mean prompt); (0, 0.0) when none, or when a
        prefill or null worker does not count them."""
        recent = [(n, t) for at, n, t in self.received if at > since]
        prompts = sum(n for n, _ in recent)
        if not self.every_worker_reports or not prompts:
            return 0, 0.0
        return prompts, sum(t for _, t in recent) / prompts

    def mean_prompt(self, min_samples: int = MIN_RECEIVED_SAMPLES, since: float = float("-inf")) -> Optional[float]:
        """The mean prompt of the requests received over the window (those observed after `since`); None with
        fewer than `min_samples`, or when a prefill or null worker does not count them."""
        prompts, mean = self.newest(since)
        return mean if prompts and prompts >= min_samples else None
