"""The simulator's workloads: (arrival seconds, prompt tokens, output tokens) per request.

- azure-code / azure-conv: the Azure LLM inference trace 2023 shipped in tidal/bench/data
  (CC-BY 4.0, attribution in its README), its arrivals divided by the rate scale: on the trace
  clock (their default) its first `duration_s` seconds (the same requests at every scale; the run
  lasts duration_s / rate_scale virtual seconds), on the wall clock `duration_s` virtual seconds
  of it from its start, wrapping around its end as often as that takes;
- shift: synthetic Poisson arrivals (1 request/s at scale 1, times the rate scale) alternating every
  `phase_s` seconds between a code-like mix (long prompts, short answers) and a chat-like mix
  (short prompts, long answers);
- azure-shift: the two Azure traces alternating every `phase_s` seconds (code first), each phase
  replaying its trace at the rate scale.

Two clocks (`clock`; None: "wall" for the shifting mixes, "trace" for the single traces):
- "wall": `phase_s` and `duration_s` are virtual seconds at every rate scale: the mix
  shifts every `phase_s` seconds of the cluster's time, as a service's traffic does, and a higher
  rate brings more requests in the same time. An azure-shift phase k replays `scale` x `phase_s`
  seconds of its trace from trace second k * phase_s (wrapping around its end as often as needed),
  played `scale` times as fast: a phase at a higher rate holds the same requests as at a lower one,
  closer together, and more after them (were the window to start at k * phase_s * scale, each rate
  would replay other bursts, and attainment would jump up and down with the rate: 0.89, 0.88, 0.97
  at scales 2.0, 2.25, 2.5 for one split). A single trace on the wall clock is one such phase that
  lasts the whole run: a run as long at a high rate as at a low one, so that a cluster that serves
  many requests a second is measured past its first minute, as the shifting mixes are.
- "trace": `phase_s` and `duration_s` are seconds of workload at rate scale 1, then divided by the
  rate scale like the single traces: the same requests at every rate, phases shorter as the rate
  rises (at 64 instances a 480-s phase lasts ~27 virtual seconds at the rates they serve, shorter
  than the planner's window).

`phase_rate_ratio` R (shift, azure-shift) runs the second kind of phase R times as fast as the
first: a chat phase of azure-shift replays R times as much of the conversation trace in the same
time (from R times the phase's start). The two traces cost very different amounts per request (at
the same rate a code phase saturates a cluster that a conversation phase leaves mostly idle); R
makes both phases load it alike, the case where one static split cannot suit both. R = "even"
(`even_phase_rate_ratio`) gives both kinds of phase the same mean request rate: on azure-shift the code
trace's mean rate over the conversation trace's (0.4641 on the shipped traces, whose conversation trace
brings 2.15x the requests a second), so that the mix shifts while the request rate holds; 1 on shift.

On the trace clock the single traces give the same requests at every rate scale, only closer
together: the goodput search's attainment then moves with the rate alone, not with which slice of a
bursty trace a rate happens to pick. On the wall clock they too bring, at a higher rate, the same
requests closer together and more after them.

Deterministic: the same seed gives the same requests.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from typing import Optional

from tidal.bench.datasets import load_azure_trace, resolve_trace_file

WORKLOADS = ("azure-code", "azure-conv", "shift", "azure-shift")
EVEN = "even"  # --phase-rate-ratio: both kinds of phase at one mean request rate (even_phase_rate_ratio)
CLOCKS = ("wall", "trace")
PHASE_MIXES = {"shift": ("code-like", "chat-like"), "azure-shift": ("code", "conversation")}  # even, odd phases
# one hour of trace at most: the shipped files hold 8,819 (code) and 19,366 (conv) rows
MAX_TRACE_ROWS = 20000
# the synthetic mixes at rate scale 1, requests per second, and their lengths (lognormal medians)
SHIFT_BASE_RATE = 1.0
CODE_LIKE = (1500, 16)  # prompt, output tokens (the Azure code trace's medians: 1469, 13)
CHAT_LIKE = (250, 250)
LENGTH_SIGMA = 0.6


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival: float
    input_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    name: str = "azure-code"
    rate_scale: float = 1.0  # arrivals per second multiplied by this
    duration_s: float = 300.0  # seconds of workload at rate scale 1
    phase_s: float = 120.0  # shift / azure-shift: seconds per phase at rate scale 1
    length_scale: float = 1.0  # prompt and output tokens multiplied by this (at least 1)
    trace: Optional[str] = None  # a CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or the trace directory
    seed: int = 0
    phase_rate_ratio: float = 1.0  # shift / azure-shift: the chat phases' rate over the code phases'
    clock: Optional[str] = None  # "wall" (phase_s, duration_s virtual) or "trace" (at scale 1); None: per workload


def _scaled(n: int, scale: float) -> int:
    return max(1, int(round(n * scale)))


@functools.lru_cache(maxsize=8)
def _trace_rows(kind: str, path: Optional[str]) -> list[tuple[float, int, int]]:
    return load_azure_trace(resolve_trace_file(kind, path), MAX_TRACE_ROWS)


def replay(rows: list[tuple[float, int, int]], spec: WorkloadSpec, start: float = 0.0,
           end: float = math.inf) -> list[TraceRequest]:
    """The trace's first duration_s seconds, its clock divided by the rate scale, arriving in [start, end)."""
    out = []
    for t, prompt, output in rows:
        if t >= spec.duration_s:
            break
        at = t / spec.rate_scale
        if start <= at < end:
            out.append(TraceRequest(at, _scaled(prompt, spec.length_scale), _scaled(output, spec.length_scale)))
    return out


def clock_of(spec: WorkloadSpec) -> str:
    """The spec's clock: the one it names, else the wall for the shifting mixes and the trace's own for
    the single traces."""
    if spec.clock is not None:
        return spec.clock
    return "wall" if spec.name in PHASE_MIXES else "trace"


def clock_divisor(spec: WorkloadSpec) -> float:
    """Virtual seconds = the workload's own seconds (phase_s, duration_s) divided by this."""
    return 1.0 if clock_of(spec) == "wall" else spec.rate_scale


def synthetic_shift(spec: WorkloadSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    divisor = clock_divisor(spec)
    speed = spec.rate_scale / divisor  # arrivals per workload second, relative to scale 1
    out, t = [], 0.0
    while True:
        chat = int(t // spec.phase_s) % 2 == 1
        t += rng.expovariate(SHIFT_BASE_RATE * speed * (spec.phase_rate_ratio if chat else 1.0))
        if t >= spec.duration_s:
            return out
        prompt, output = CODE_LIKE if int(t // spec.phase_s) % 2 == 0 else CHAT_LIKE
        out.append(TraceRequest(t / divisor,
                                _scaled(rng.lognormvariate(math.log(prompt), LENGTH_SIGMA), spec.length_scale),
                                _scaled(rng.lognormvariate(math.log(output), LENGTH_SIGMA), spec.length_scale)))


def compressed_window(rows: list[tuple[float, int, int]], start: float, span: float, speed: float,
                      phase_start: float, spec: WorkloadSpec) -> list[TraceRequest]:
    """The rows of trace seconds [start, start + span * speed) (wrapping around the trace's last row as
    often as that takes), their clock divided by `speed`, placed from `phase_start` (workload seconds),
    then divided by the clock divisor."""
    period = rows[-1][0] if rows and rows[-1][0] > 0 else 1.0
    length = span * speed
    first = start % period
    laps = math.ceil((length + first) / period)  # lap 0 from `first` to the trace's end, then whole laps
    divisor = clock_divisor(spec)
    out = []
    for lap in reversed(range(laps)):
        for t, prompt, output in rows:
            offset = t - first + lap * period
            if 0 <= offset < length:
                out.append(TraceRequest((phase_start + offset / speed) / divisor,
                                        _scaled(prompt, spec.length_scale), _scaled(output, spec.length_scale)))
    return sorted(out, key=lambda r: r.arrival)


def mean_rate(rows: list[tuple[float, int, int]]) -> float:
    """A trace's requests a second, over the span from its first arrival to its last."""
    return len(rows) / rows[-1][0] if rows and rows[-1][0] > 0 else 0.0


def even_phase_rate_ratio(workload: str) -> float:
    """The phase rate ratio at which both kinds of phase bring the same mean request rate ("even"): on
    azure-shift the code trace's mean rate over the conversation trace's; 1 elsewhere (the synthetic shift's
    phases share SHIFT_BASE_RATE)."""
    if workload != "azure-shift":
        return 1.0
    code, conv = mean_rate(_trace_rows("azure-code", None)), mean_rate(_trace_rows("azure-conv", None))
    return code / conv if code > 0 and conv > 0 else 1.0


def azure_shift(spec: WorkloadSpec) -> list[TraceRequest]:
    """Phase k from the code trace (k even) or the conv trace (k odd, R times as fast): s x phase_s seconds
    of its trace from R k phase_s, played s times as fast (s = R x the rate scale on the wall clock; R on
    the trace clock, whose workload seconds are then divided by the rate scale). The start does not move
    with the rate, so a higher rate replays the same requests closer together, and more after them."""
    traces = (_trace_rows("azure-code", None), _trace_rows("azure-conv", None))
    clock_speed = spec.rate_scale / clock_divisor(spec)
    out: list[TraceRequest] = []
    k = 0
    while k * spec.phase_s < spec.duration_s:
        span = min(spec.phase_s, spec.duration_s - k * spec.phase_s)
        ratio = spec.phase_rate_ratio if k % 2 else 1.0
        out += compressed_window(traces[k % 2], k * spec.phase_s * ratio, span, clock_speed * ratio,
                                 k * spec.phase_s, spec)
        k += 1
    return out


def check(spec: WorkloadSpec) -> None:
    """ValueError naming the flag when the spec cannot make a workload."""
    for flag, value in (("--rate-scale", spec.rate_scale), ("--duration-s", spec.duration_s),
                        ("--phase-s", spec.phase_s), ("--phase-rate-ratio", spec.phase_rate_ratio),
                        ("--length-scale", spec.length_scale)):
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{flag} must be a positive number, not {value:g}")
    if spec.clock is not None and spec.clock not in CLOCKS:
        raise ValueError(f"unknown clock {spec.clock!r}: expected one of {', '.join(CLOCKS)}")


def make_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    check(spec)
    if spec.name in ("azure-code", "azure-conv"):
        rows = _trace_rows(spec.name, spec.trace)
        if clock_of(spec) == "wall":
            return compressed_window(rows, 0.0, spec.duration_s, spec.rate_scale, 0.0, spec)
        return replay(rows, spec)
    if spec.name == "shift":
        return synthetic_shift(spec)
    if spec.name == "azure-shift":
        return azure_shift(spec)
    raise ValueError(f"unknown workload {spec.name!r}: expected one of {', '.join(WORKLOADS)}")


def virtual_span(spec: WorkloadSpec) -> float:
    """Virtual seconds over which the workload's requests arrive."""
    return spec.duration_s / clock_divisor(spec)


def phase_period(spec: WorkloadSpec) -> float:
    """Virtual seconds per phase of a shifting mix."""
    return spec.phase_s / clock_divisor(spec)
