"""The `Server-Timing` header (W3C Server Timing) of a non-streamed OpenAI answer: the server's own TTFT and
TPOT, which a whole answer otherwise hides (its `usage` has no timings). The router's planner reads it where a
/generate answer's `meta_info` would say the same.

    Server-Timing: ttft;dur=412.500, tpot;dur=38.100      (milliseconds, the mean over the answer's choices)

The parser is for this header as tidal writes it (metrics split at commas, parameters at semicolons): a
quoted `desc` holding either, from a proxy, may cost the metrics after it, never an exception.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

HEADER = "server-timing"
TTFT = "ttft"
TPOT = "tpot"


def mean_latencies(items: Iterable[tuple[Optional[float], float, int]]) -> tuple[Optional[float], Optional[float]]:
    """(TTFT, TPOT) in seconds, each the mean over the items that give it, from (first-token latency or None,
    end-to-end latency, completion tokens) per item; TPOT needs at least two tokens."""
    ttfts, tpots = [], []
    for first, e2e, tokens in items:
        if first is None:
            continue
        ttfts.append(first)
        if tokens > 1:
            tpots.append((e2e - first) / (tokens - 1))
    return (sum(ttfts) / len(ttfts) if ttfts else None), (sum(tpots) / len(tpots) if tpots else None)


def format_server_timing(ttft_s: Optional[float], tpot_s: Optional[float]) -> Optional[str]:
    """The header's value, or None when there is nothing to say."""
    parts = [f"{name};dur={value * 1000:.3f}" for name, value in ((TTFT, ttft_s), (TPOT, tpot_s))
             if value is not None]
    return ", ".join(parts) or None


def parse_server_timing(value: Optional[str]) -> tuple[Optional[float], Optional[float]]:
    """(TTFT, TPOT) in seconds from a header value; None for a metric it lacks or gives malformed. Other
    metrics (a proxy may add its own) are ignored."""
    found: dict[str, float] = {}
    for metric in (value or "").split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, raw = param.partition("=")
            if key.strip().lower() != "dur":
                continue
            try:
                dur = float(raw.strip().strip('"'))
            except ValueError:
                continue
            if math.isfinite(dur) and dur >= 0:
                found.setdefault(name.lower(), dur / 1000)
    return found.get(TTFT), found.get(TPOT)
