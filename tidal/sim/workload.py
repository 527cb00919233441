"""The simulator's workloads: (arrival seconds, prompt tokens, output tokens) per request.

- azure-code / azure-conv: the Azure LLM inference trace 2023 shipped in tidal/bench/data
  (CC-BY 4.0, attribution in its README): its first `duration_s` seconds, arrivals divided
  by the rate scale (the same requests at every scale, so a goodput search compares like
  with like; the run lasts duration_s / rate_scale virtual seconds);
- shift: synthetic Poisson arrivals (1 request/s at scale 1, same scaling) alternating every
  `phase_s` seconds (of the workload's own clock: phase_s / rate_scale virtual seconds)
  between a code-like mix (long prompts, short answers) and a chat-like mix (short prompts,
  long answers);
- azure-shift: the two Azure traces alternating every `phase_s` seconds of trace clock (code
  first), then divided by the rate scale like the others.

Every workload gives the same requests at every rate scale, only closer together: the
goodput search's attainment then moves with the rate alone, not with which slice of a
bursty trace a rate happens to pick.

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


def synthetic_shift(spec: WorkloadSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(SHIFT_BASE_RATE)
        if t >= spec.duration_s:
            return out
        prompt, output = CODE_LIKE if int(t // spec.phase_s) % 2 == 0 else CHAT_LIKE
        out.append(TraceRequest(t / spec.rate_scale,
                                _scaled(rng.lognormvariate(math.log(prompt), LENGTH_SIGMA), spec.length_scale),
                                _scaled(rng.lognormvariate(math.log(output), LENGTH_SIGMA), spec.length_scale)))


def azure_shift(spec: WorkloadSpec) -> list[TraceRequest]:
    """Phase k (trace seconds [k * phase_s, (k + 1) * phase_s)) from the code trace (k even) or the conv
    trace (k odd), then the clock divided by the rate scale."""
    traces = (_trace_rows("azure-code", None), _trace_rows("azure-conv", None))
    out: list[TraceRequest] = []
    k = 0
    while k * spec.phase_s < spec.duration_s:
        start, end = k * spec.phase_s / spec.rate_scale, (k + 1) * spec.phase_s / spec.rate_scale
        out += replay(traces[k % 2], spec, start, end)
        k += 1
    return out


def make_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    if spec.rate_scale <= 0:
        raise ValueError("--rate-scale must be positive")
    if spec.name in ("azure-code", "azure-conv"):
        return replay(_trace_rows(spec.name, spec.trace), spec)
    if spec.name == "shift":
        return synthetic_shift(spec)
    if spec.name == "azure-shift":
        return azure_shift(spec)
    raise ValueError(f"unknown workload {spec.name!r}: expected one of {', '.join(WORKLOADS)}")


def virtual_span(spec: WorkloadSpec) -> float:
    """Virtual seconds over which the workload's requests arrive."""
    return spec.duration_s / spec.rate_scale
