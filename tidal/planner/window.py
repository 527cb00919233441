"""What the router observes about its requests, over a sliding window (clock injected).

Every request counts as an arrival when the dispatcher takes it (a body that makes several, a
batched /generate or `n` samples, as that many; one the server refuses as the client's mistake
is withdrawn). A request that succeeds adds its prompt and completion token counts (from
`meta_info` or `usage` in its last JSON answer; a batch's shared out over its requests) and,
when it was streamed, its TTFT (first body bytes) and TPOT ((end - first) / (completion tokens
- 1)). A non-streamed answer arrives whole: its TTFT and TPOT are the server's own
(`meta_info.first_token_latency` and `e2e_latency` of /generate, an OpenAI answer's
Server-Timing header), else it gives lengths only. A stream without token counts (OpenAI's
without `usage`) gives its answer's length as its events and no prompt length (0: left out of
the prompt statistics). While a request is open, its `InFlight` ticket holds the answer tokens
streamed so far: a lower bound of its length, which keeps the mean answer over the router's
first window, and at a turn to longer answers, from counting only the quickest requests. Each
window's mix (mean prompt and answer) is kept for an hour, across shifts of the mix: what the
planner takes for the answers of queued prompts it has not seen finish. Over the first window the
mean prompt is that of the prompts the workers counted as they arrived, where they count them
(`received.py`).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import weakref
from typing import Any, Optional, Sequence

import msgspec

from tidal.planner.received import MIN_RECEIVED_SAMPLES, ReceivedPrompts
from tidal.planner.schema import Traffic, WorkerLoad
from tidal.server_timing import mean_latencies, parse_server_timing

MAX_TAIL_BYTES = 1 << 16  # of a stream: enough for its last event
MIN_GAPS = 8  # arrivals' burstiness is measured from at least this many gaps
PEAK_QUANTILE = 0.9  # of the rates that arrivals meet: DistServe's goodput counts 90% of requests
# the window's mean prompt or answer length this many times the burst history's (either way) is a new
# mix, and the history restarts empty (lengths are known at completion, so the window that shows the shift
# still holds arrivals of the old mix). The Azure code and conversation traces differ ~7x in their mean
# answer; the code trace's own 30-s windows stay within 2.4x of its preceding 270 s
MIX_SHIFT_RATIO = 3.0
MIN_MIX_SAMPLES = 8  # completions of the history before the window that the mix-shift test needs
# and of the window: in a lull the window holds few completions, often the long stragglers of the last
# burst, which look like a new mix
MIN_SHIFT_WINDOW_SAMPLES = 20
# the mean lengths and deciles come from the window's completions, or from the last this many of the history
# when the window has fewer (a lull's stragglers are not the mix)
MIN_LENGTH_SAMPLES = 64
# the mean answer counts the open requests too (`_mean_answer`), once this many of a cohort of arrivals have
# finished: in the router's first window, and when that mean is ANSWER_SHIFT times the finished requests' or more
MIN_COHORT_SAMPLES = 20
ANSWER_SHIFT = 1.5
# after the first window, the requests that arrived in the last this many seconds are the cohort (a new mix
# shows in the newest arrivals first)
ANSWER_COHORT_S = 10.0
# windows' mixes remembered (Traffic.past_mixes): an hour of 30-s windows
MIX_MEMORY = 120


class InFlight:
    """An open request as the window counts it: when it arrived and the answer tokens it has so far."""

    __slots__ = ("arrived_at", "tokens", "__weakref__")

    def __init__(self, arrived_at: float) -> None:
        self.arrived_at = arrived_at
        self.tokens = 0


class Observation(msgspec.Struct, kw_only=True):
    path: str  # PD_PATH or NULL_PATH
    prompt_tokens: int = 0
    completion_tokens: int = 0
    arrived_at: Optional[float] = None  # on the window's clock; None: unknown
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


def decode_answer(body: bytes) -> Any:
    """A JSON answer or event, None when it is not JSON."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None


def body_token_counts(body: bytes) -> tuple[int, int]:
    return token_counts(decode_answer(body))


def server_latencies(answer: Any) -> tuple[Optional[float], Optional[float]]:
    """(TTFT, TPOT) of a whole /generate answer by the server's own clock: `meta_info.first_token_latency`
    and (e2e_latency - it) / (completion_tokens - 1), the mean over a batch's items; None where it does not
    say (an OpenAI answer, or a server without the field)."""
    items = []
    for item in answer if isinstance(answer, list) else [answer]:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        first = meta.get("first_token_latency") if isinstance(meta, dict) else None
        if not isinstance(first, (int, float)):
            continue
        e2e, tokens = meta.get("e2e_latency"), meta.get("completion_tokens")
        complete = isinstance(e2e, (int, float)) and isinstance(tokens, int)
        # without both, the item gives its TTFT only: 0 tokens give mean_latencies no TPOT
        items.append((float(first), float(e2e), tokens) if complete else (float(first), 0.0, 0))
    return mean_latencies(items)


class StreamTally:
    """Counts a relayed SSE stream's events and keeps its tail, for the last event's counts."""

    def __init__(self, first_at: float, ticket: Optional[InFlight] = None) -> None:
        self.first_at = first_at
        self.events = 0
        self.tail = b""
        self.ticket = ticket  # its request's, kept current: one event carries at least one token

    def feed(self, chunk: bytes) -> None:
        self.events += chunk.count(b"data:") - chunk.count(b"data: [DONE]")
        self.tail = (self.tail + chunk)[-MAX_TAIL_BYTES:]
        if self.ticket is not None:
            self.ticket.tokens = max(self.events, 0)

    def token_counts(self, requests: int = 1) -> tuple[int, int]:
        """One request's (prompt, completion) tokens, of a stream that carries `requests` of them: the last
        event's counts (a /generate event's `meta_info` is its own item's; an OpenAI `usage` counts them
        all); else the events (a token each) over the requests."""
        for event in reversed(self.tail.split(b"data:")):
            event = event.strip()
            if not event.startswith(b"{"):
                continue
            answer = decode_answer(event)
            prompt, completion = token_counts(answer)
            if completion:
                if isinstance(answer, dict) and isinstance(answer.get("meta_info"), dict):
                    return prompt, completion
                return round(prompt / requests), round(completion / requests)
        return 0, round(max(self.events, 0) / requests)


def whole_observation(path: str, started_at: float, body: bytes, requests: int = 1,
                      server_timing: Optional[str] = None) -> Observation:
    """A non-streamed answer's observation, per request of the `requests` it carries: its share of the token
    counts, and the server's own TTFT and TPOT when it reports them: a /generate answer's `meta_info`
    (`server_latencies`), else the answer's Server-Timing header (an OpenAI answer's)."""
    answer = decode_answer(body)
    prompt, completion = token_counts(answer)
    ttft, tpot = server_latencies(answer)
    if ttft is None:
        ttft, tpot = parse_server_timing(server_timing)
    return Observation(path=path, prompt_tokens=round(prompt / requests),
                       completion_tokens=round(completion / requests), arrived_at=started_at, ttft_s=ttft, tpot_s=tpot)


def stream_observation(path: str, started_at: float, tally: StreamTally, ended_at: float,
                       requests: int = 1) -> Observation:
    prompt, completion = tally.token_counts(requests)
    tpot = (ended_at - tally.first_at) / (completion - 1) if completion > 1 else None
    return Observation(path=path, prompt_tokens=prompt, completion_tokens=completion, arrived_at=started_at,
                       ttft_s=tally.first_at - started_at, tpot_s=tpot)


class TrafficWindow:
    """Arrivals and completions of the last `window_s` seconds, and the burst history: arrival times and
    (prompt, answer) lengths over the last `burst_window_s`, since the last shift of the mix."""

    def __init__(self, window_s: float, started_at: float, burst_window_s: Optional[float] = None,
                 peak_span_s: Optional[float] = None) -> None:
        self.window_s = window_s
        self.burst_window_s = max(window_s, burst_window_s or window_s)
        self.peak_span_s = peak_span_s  # None: no peak measured (prefill_peak_ratio 1)
        self.started_at = started_at
        self.arrivals: collections.deque[float] = collections.deque()
        self.arrival_history: collections.deque[float] = collections.deque()  # over burst_window_s
        self.completions: collections.deque[tuple[float, Observation]] = collections.deque()
        # (completed at, prompt, answer, arrived at or None)
        self.length_history: collections.deque[tuple[float, int, int, Optional[float]]] = collections.deque()
        # the open requests' tickets; a ticket its caller drops (a failed or cancelled request) leaves by itself
        self.open: weakref.WeakSet[InFlight] = weakref.WeakSet()
        self.mix_shifts = 0
        self.shifted_at: Optional[float] = None  # the last shift of the mix
        # (mean prompt, mean answer, peak arrival rate) of the burst histories that shifts of the mix ended
        self.past_bursts: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=MIX_MEMORY)
        # (at, mean prompt, mean answer) of past windows' finished requests, one per window length
        self.past_mixes: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=MIX_MEMORY)
        self.received = ReceivedPrompts(window_s)

    def baseline(self, now: float, loads: list[WorkerLoad]) -> None:
        """The workers' counters when the planner starts: the prompts received from here on count at its first
        round. Without it the first round's snapshot is the baseline, and the first round decides on the
        finished requests' prompts, the short ones (64 instances on the conversation trace at rate scale 23: 189
        tokens at t = 5 s where 228 had arrived; it held 32:32 and met the SLOs for 0.57 of the requests, 0.81
        with this baseline)."""
        self.received.observe(now, loads)

    def arrival(self, now: float, requests: int = 1) -> Optional[InFlight]:
        """Counts `requests` arrivals (one body may carry several). For a single request, a ticket for its
        caller to keep current, open until `completion` or `forget`; else None (a batch's stream counts all
        its items' tokens together)."""
        self.arrivals.extend([now] * requests)
        self.arrival_history.extend([now] * requests)
        if requests != 1:
            return None
        ticket = InFlight(now)
        self.open.add(ticket)
        return ticket

    def withdraw(self, arrived_at: float, requests: int = 1) -> None:
        """Uncounts `requests` arrivals of `arrived_at` (a request the server refused as the client's mistake
        put no load on the cluster)."""
        for seq in (self.arrivals, self.arrival_history):  # one pass each: a refused batch may be large
            left, kept = requests, []
            for t in seq:
                if left and t == arrived_at:
                    left -= 1
                else:
                    kept.append(t)
            if left < requests:
                seq.clear()
                seq.extend(kept)

    def forget(self, ticket: Optional[InFlight]) -> None:
        if ticket is not None:
            self.open.discard(ticket)

    def completion(self, now: float, obs: Observation, ticket: Optional[InFlight] = None, requests: int = 1) -> None:
        """`requests` requests ended, each as `obs` says (one body's items share their observation)."""
        self.forget(ticket)
        self.completions.extend([(now, obs)] * requests)
        if obs.completion_tokens > 0:
            self.length_history.extend([(now, obs.prompt_tokens, obs.completion_tokens, obs.arrived_at)] * requests)

    def _trim(self, now: float) -> None:
        edge = now - self.window_s
        while self.arrivals and self.arrivals[0] <= edge:
            self.arrivals.popleft()
        while self.completions and self.completions[0][0] <= edge:
            self.completions.popleft()
        forget_before = now - self.burst_window_s
        if self._mix_shifted(edge):  # the window straddles the shift: keep none of it
            self.mix_shifts += 1
            self._remember_bursts(edge)
            self.shifted_at = forget_before = now
        while self.arrival_history and self.arrival_history[0] <= forget_before:
            self.arrival_history.popleft()
        while self.length_history and self.length_history[0][0] <= forget_before:
            self.length_history.popleft()

    def _mix_shifted(self, edge: float) -> bool:
        """Whether the window's mean prompt or answer differs from the burst history's before the window
        by MIX_SHIFT_RATIO or more: bursts of the old mix say little about the new one. The prompts are also
        compared as the workers received them (`_prompts_shifted`)."""
        before = self._lengths_before(edge)
        if len(before) < MIN_MIX_SAMPLES:
            return False
        if self._prompts_shifted(_mean([p for p, _ in before if p > 0])):
            return True
        # requests that arrived before the window and finished in it are the long tail of an older window
        # (after a burst, most of it), not a new mix
        window = [(p, c) for t, p, c, arrived in self.length_history
                  if t > edge and (arrived is None or arrived > edge)]
        if len(window) < MIN_SHIFT_WINDOW_SAMPLES:
            return False
        return any(_far_apart(_mean([x[k] for x in before if x[k] > 0]), _mean([x[k] for x in window if x[k] > 0]))
                   for k in (0, 1))

    def _lengths_before(self, edge: float) -> list[tuple[int, int]]:
        """(prompt, answer) of the burst history's requests that finished by `edge`."""
        return [(p, c) for t, p, c, _ in self.length_history if t <= edge]

    def _remember_bursts(self, edge: float) -> None:
        """Keeps the ending history's mix and peak arrival rate, for when that mix comes back."""
        before = self._lengths_before(edge)
        rate = peak_rate(self.arrival_history, self.peak_span_s)
        if rate is not None and before:
            self.past_bursts.append((_mean([p for p, _ in before if p > 0]), _mean([c for _, c in before]), rate))

    def _recalled_peak(self, now: float, prompt: float, answer: float) -> float:
        """The peak arrival rate of the last past history of this mix (within MIX_SHIFT_RATIO in both lengths)
        while the history since the shift is younger than the burst window; 0 if none."""
        if self.shifted_at is None or now - self.shifted_at >= self.burst_window_s:
            return 0.0
        for seen_prompt, seen_answer, rate in reversed(self.past_bursts):
            if not _far_apart(seen_prompt, prompt) and not _far_apart(seen_answer, answer):
                return rate
        return 0.0

    def _prompts_shifted(self, history_prompt: float) -> bool:
        """Whether the prompts the workers received over the window (MIN_MIX_SAMPLES or more) are MIX_SHIFT_RATIO
        times the history's mean prompt or a fraction of it. A request's lengths reach the window when it ends,
        so the completion test needs MIN_SHIFT_WINDOW_SAMPLES requests that arrived and ended within one window:
        at 0.63 requests/s of 256-token answers (a live run's chat phase) no window holds them, the lengths came
        from the last MIN_LENGTH_SAMPLES requests for 100 s after the shift, half of them the old mix's, and the
        planner moved a decode worker away inside the chat phase and back 50 s later. The prompts arrive
        counted."""
        received = self.received.mean_prompt(MIN_MIX_SAMPLES)
        return received is not None and _far_apart(history_prompt, received)

    def traffic(self, now: float, loads: Optional[list[WorkerLoad]] = None) -> Traffic:
        """The window's traffic; `loads`, the workers' snapshots just taken, add the prompts they received."""
        if loads is not None:
            self.received.observe(now, loads)
        self._trim(now)
        done = [o for _, o in self.completions]
        own = [(o.prompt_tokens, o.completion_tokens) for o in done if o.completion_tokens > 0]
        lengths = own
        if len(lengths) < MIN_LENGTH_SAMPLES and len(self.length_history) > len(lengths):
            lengths = [(p, c) for _, p, c, _ in itertools.islice(reversed(self.length_history), MIN_LENGTH_SAMPLES)]
        ttft: dict[str, list[float]] = {}
        tpot: dict[str, list[float]] = {}
        for o in done:
            if o.ttft_s is not None:
                ttft.setdefault(o.path, []).append(o.ttft_s)
            if o.tpot_s is not None:
                tpot.setdefault(o.path, []).append(o.tpot_s)
        rate = self._rate(now, self.window_s)
        prompts = [p for p, _ in lengths if p > 0]  # 0: not reported (an OpenAI stream without usage)
        mean_prompt, prompt_deciles = self._prompts(now, prompts)
        mean_answer, recent_answers = self._mean_answer(now, _mean([c for _, c in lengths]))
        recent_prompts, recent_prompt_mean = self.received.newest(since=now - ANSWER_COHORT_S)
        peak = peak_ratio(self.arrival_history, self.peak_span_s, over_rate=rate)
        recalled = self._recalled_peak(now, mean_prompt, mean_answer)
        if recalled and rate > 0:
            peak = max(peak, recalled / rate)
        return Traffic(arrival_rate=rate,
                       mean_input_tokens=mean_prompt,
                       input_tokens_deciles=prompt_deciles,
                       mean_output_tokens=mean_answer,
                       # over the window's rate: a calm window of a bursty history keeps the history's burst rate
                       prefill_peak_ratio=peak,
                       completed=len(done),
                       span_s=min(self.window_s, now - self.started_at),
                       recent_arrival_rate=self._rate(now, ANSWER_COHORT_S),
                       recent_input_tokens=recent_prompt_mean if recent_prompts >= MIN_RECEIVED_SAMPLES else 0.0,
                       recent_prompts=recent_prompts,
                       recent_prompt_mean=recent_prompt_mean,
                       recent_answers=recent_answers,
                       past_mixes=self._remember_mix(now, [(p, c) for p, c in lengths if p > 0]),
                       ttft_s={k: _mean(v) for k, v in ttft.items()},
                       tpot_s={k: _mean(v) for k, v in tpot.items()})

    def _prompts(self, now: float, finished: list[int]) -> tuple[float, list[int]]:
        """The mean prompt and its deciles: those of the `finished` requests' prompts, except over the router's
        first window, where the mean is that of the prompts the workers received (`ReceivedPrompts`), the
        finished deciles scaled to it. On a cluster filling up the short prompts finish first (64 workers on the
        conversation trace: 216 tokens finished by t = 10 s, 258 arrived), and the mean answer is the
        arrivals' too then (`_mean_answer`). Later the mean answer is the finished requests' unless the newest
        arrivals say more, so the prompts are theirs too: one mix. A received mean past the first window
        paired the new mix's prompts with the old mix's answers at a shift (a live run took 32-token prompts
        with 4-token answers for a phase of 256-token answers, none finished yet, and moved a decode worker
        away); at a shift the queued prompts stand for the mix, with a past window's answers
        (`queued.queued_mix`)."""
        mean = _mean(finished)
        received = self.received.mean_prompt()
        if received is None or mean <= 0 or now - self.started_at >= self.window_s:
            return mean, deciles(finished)
        return received, scaled(deciles(finished), received / mean)

    def _rate(self, now: float, span_s: float) -> float:
        """Arrivals a second over the last `span_s` seconds (at most the window; over the router's first seconds,
        over them)."""
        recent = len(self.arrivals) - bisect.bisect_right(self.arrivals, now - span_s)
        return recent / max(1.0, min(span_s, now - self.started_at))

    def _remember_mix(self, now: float, pairs: list[tuple[int, int]]) -> list[list[float]]:
        """Keeps the mix the window's lengths say (the mean prompt and answer of the finished requests that report
        both: the window's, or the last MIN_LENGTH_SAMPLES since the mix last shifted where the window has fewer),
        once per window length, when MIN_LENGTH_SAMPLES do, or MIN_COHORT_SAMPLES after the router's first window
        (over it the requests that finished are the shortest); returns the mixes kept, newest first. Until
        2026-12-05 it kept only windows of MIN_LENGTH_SAMPLES finished requests of their own: a live cluster of
        three servers at a request a second finishes 20 a window, kept none, and at a turn back to a past mix
        the queued or newly arrived prompts found no answers of theirs (live run 39). Kept from the first
        seconds on, 20 short answers moved the even mix at 64 instances (rate scale 26.60) from 0.905 to 0.893."""
        last = self.past_mixes[-1][0] if self.past_mixes else float("-inf")
        enough = len(pairs) >= MIN_LENGTH_SAMPLES or (len(pairs) >= MIN_COHORT_SAMPLES
                                                      and now - self.started_at >= self.window_s)
        if enough and now - last >= self.window_s:
            self.past_mixes.append((now, _mean([p for p, _ in pairs]), _mean([c for _, c in pairs])))
        return [[prompt, answer] for _, prompt, answer in reversed(self.past_mixes)]

    def _mean_answer(self, now: float, finished_mean: float) -> tuple[float, bool]:
        """The mean answer, and whether it is a cohort's: `finished_mean` (the requests that finished), or that of
        a cohort of arrivals, those still open counting as longer than their tokens so far (`censored_mean`), once
        MIN_COHORT_SAMPLES of them have finished: every arrival over the router's first window (the cluster
        filling up), and later the last ANSWER_COHORT_S seconds' whenever their mean is ANSWER_SHIFT times
        `finished_mean` or more (the mix turned to longer answers).
        The answers that finish first are the shortest: early on, 64 instances on the conversation trace saw
        29 tokens at t = 5 s against ~60, and at a turn to longer answers the finished requests keep the old
        mix's until the new ones end (a synthetic turn from 5- to 62-token answers: 5, 7, 12 and 23 tokens at 5,
        10, 15 and 20 s after it, where the last 10 s's cohort says 18, 55, 60 and 66). In a steady mix a
        window's completions are a fair sample (each length finishes at the rate it arrives), and the
        arrivals' mean on every window lost on 4 of 11 simulated runs and gained on 2 (docs/elasticity-log.md),
        hence the ANSWER_SHIFT test."""
        first = now - self.started_at < self.window_s
        edge = now - (self.window_s if first else ANSWER_COHORT_S)
        finished = [o.completion_tokens for _, o in self.completions
                    if o.completion_tokens > 0 and o.arrived_at is not None and o.arrived_at > edge]
        if len(finished) < MIN_COHORT_SAMPLES:
            return finished_mean, False
        cohort = censored_mean(finished, [t.tokens for t in self.open if t.arrived_at > edge])
        if first or cohort >= ANSWER_SHIFT * finished_mean:
            return cohort, True
        return finished_mean, False


def censored_mean(finished: list[int], unfinished: list[int]) -> float:
    """The Kaplan-Meier mean of answer lengths (restricted to the longest seen): `finished` lengths, and the
    tokens so far of `unfinished` requests (each at least one longer). Without unfinished: the plain mean."""
    ends = collections.Counter(finished)
    at_least = sorted(finished + [c + 1 for c in unfinished])  # each request is at risk up to this length
    mean, survival, prev = 0.0, 1.0, 0
    for length in sorted(ends):
        at_risk = len(at_least) - bisect.bisect_left(at_least, length)
        mean += survival * (length - prev)
        survival *= 1 - ends[length] / at_risk
        prev = length
    return mean + survival * max(0, at_least[-1] - prev) if at_least else 0.0


def deciles(values: list) -> list:
    """The middle value of each tenth of the sorted values (p5, p15, ... p95); [] when empty."""
    xs = sorted(values)
    return [xs[int((i + 0.5) * len(xs) / 10)] for i in range(10)] if xs else []


def scaled(lengths: list[int], ratio: float) -> list[int]:
    """Token lengths (deciles) times `ratio`, at least 1: a mix's shape carried to another mean."""
    return [max(1, round(x * ratio)) for x in lengths]


def peak_rate(times: Sequence[float], span_s: Optional[float], quantile: float = PEAK_QUANTILE) -> Optional[float]:
    """The `quantile` (over arrivals) of the arrival rate within the `span_s`-long span centred on each
    arrival (`times` sorted); None without a span, with fewer than MIN_GAPS gaps, or when the times cover
    less than two spans."""
    n = len(times)
    if not span_s or n <= MIN_GAPS or times[-1] - times[0] < 2 * span_s:
        return None
    ts = list(times)
    counts = sorted(bisect.bisect_left(ts, t + span_s / 2) - bisect.bisect_left(ts, t - span_s / 2) for t in ts)
    return counts[min(n - 1, int(quantile * n))] / span_s


def peak_ratio(times: Sequence[float], span_s: Optional[float], quantile: float = PEAK_QUANTILE,
               over_rate: Optional[float] = None) -> float:
    """`peak_rate` divided by `over_rate` (default: the mean rate over all of `times`), at least 1; 1 where
    `peak_rate` is None."""
    peak = peak_rate(times, span_s, quantile)
    if peak is None:
        return 1.0
    return max(1.0, peak / (over_rate or (len(times) - 1) / (times[-1] - times[0])))


def _far_apart(a: float, b: float) -> bool:
    """Two mean lengths of different mixes: both known and MIX_SHIFT_RATIO or more apart, either way."""
    return a > 0 and b > 0 and max(a / b, b / a) >= MIX_SHIFT_RATIO


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else 0.0
