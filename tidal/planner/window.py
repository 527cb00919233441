"""What the router observes about its requests, over a sliding window (clock injected).

Every request counts as an arrival when the dispatcher takes it. A request that succeeds
adds its prompt and completion token counts (from `meta_info` or `usage` in its last
JSON answer) and, when it was streamed, its TTFT (first body bytes) and TPOT ((end -
first) / (completion tokens - 1)). A non-streamed answer arrives whole, so it gives
lengths but no TTFT/TPOT.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import msgspec

from tidal.planner.schema import Traffic

MAX_TAIL_BYTES = 1 << 16  # of a stream: enough for its last event


class Observation(msgspec.Struct, kw_only=True):
    path: str  # PD_PATH or NULL_PATH
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None


def token_counts(answer: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of a decoded answer: /generate's meta_info (summed over a
    batch) or an OpenAI `usage`; (0, 0) when it has neither."""
    items = answer if isinstance(answer, list) else [answer]
    prompt = completion = 0
    for item in items:
        if not isinstance(item, dict):
            continue
        counts = item.get("meta_info") if isinstance(item.get("meta_info"), dict) else item.get("usage")
        if isinstance(counts, dict):
            p, c = counts.get("prompt_tokens"), counts.get("completion_tokens")
            prompt += p if isinstance(p, int) else 0
            completion += c if isinstance(c, int) else 0
    return prompt, completion


def body_token_counts(body: bytes) -> tuple[int, int]:
    try:
        return token_counts(msgspec.json.decode(body))
    except msgspec.DecodeError:
        return 0, 0


class StreamTally:
    """Counts a relayed SSE stream's events and keeps its tail, for the last event's counts."""

    def __init__(self, first_at: float) -> None:
        self.first_at = first_at
        self.events = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        self.events += chunk.count(b"data:") - chunk.count(b"data: [DONE]")
        self.tail = (self.tail + chunk)[-MAX_TAIL_BYTES:]

    def token_counts(self) -> tuple[int, int]:
        """The last event's counts; else the number of events as the completion tokens."""
        for event in reversed(self.tail.split(b"data:")):
            event = event.strip()
            if event.startswith(b"{"):
                prompt, completion = body_token_counts(event)
                if completion:
                    return prompt, completion
        return 0, max(self.events, 0)


def stream_observation(path: str, started_at: float, tally: StreamTally, ended_at: float) -> Observation:
    prompt, completion = tally.token_counts()
    tpot = (ended_at - tally.first_at) / (completion - 1) if completion > 1 else None
    return Observation(path=path, prompt_tokens=prompt, completion_tokens=completion,
                       ttft_s=tally.first_at - started_at, tpot_s=tpot)


class TrafficWindow:
    """Arrivals and completions of the last `window_s` seconds."""

    def __init__(self, window_s: float, started_at: float) -> None:
        self.window_s = window_s
        self.started_at = started_at
        self.arrivals: collections.deque[float] = collections.deque()
        self.completions: collections.deque[tuple[float, Observation]] = collections.deque()

    def arrival(self, now: float) -> None:
        self.arrivals.append(now)

    def completion(self, now: float, obs: Observation) -> None:
        self.completions.append((now, obs))

    def _trim(self, now: float) -> None:
        edge = now - self.window_s
        while self.arrivals and self.arrivals[0] <= edge:
            self.arrivals.popleft()
        while self.completions and self.completions[0][0] <= edge:
            self.completions.popleft()

    def traffic(self, now: float) -> Traffic:
        self._trim(now)
        span = max(1.0, min(self.window_s, now - self.started_at))
        done = [o for _, o in self.completions]
        counted = [o for o in done if o.completion_tokens > 0]
        ttft: dict[str, list[float]] = {}
        tpot: dict[str, list[float]] = {}
        for o in done:
            if o.ttft_s is not None:
                ttft.setdefault(o.path, []).append(o.ttft_s)
            if o.tpot_s is not None:
                tpot.setdefault(o.path, []).append(o.tpot_s)
        return Traffic(arrival_rate=len(self.arrivals) / span,
                       mean_input_tokens=_mean([o.prompt_tokens for o in counted]),
                       input_tokens_deciles=deciles([o.prompt_tokens for o in counted]),
                       mean_output_tokens=_mean([o.completion_tokens for o in counted]),
                       completed=len(done),
                       ttft_s={k: _mean(v) for k, v in ttft.items()},
                       tpot_s={k: _mean(v) for k, v in tpot.items()})


def deciles(values: list) -> list:
    """The middle value of each tenth of the sorted values (p5, p15, ... p95); [] when empty."""
    xs = sorted(values)
    return [xs[int((i + 0.5) * len(xs) / 10)] for i in range(10)] if xs else []


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else 0.0
