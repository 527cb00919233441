"""Per-request records and the aggregate serving metrics computed from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

GOODPUT_KEYS = ("ttft", "tpot", "e2e")
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; ``start`` (when it was sent) is relative to the
    run start. ``prompt_tokens`` and ``output_tokens`` are the server's counts when it reports
    them; ``requested_output_tokens`` is the max_new_tokens asked for."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    requested_output_tokens: int = 0
    generated_text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first; None for single-token outputs."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self, keep_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        if not keep_text:
            d.pop("generated_text")
        return d


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: use ttft:MS tpot:MS e2e:MS")
        slos[key] = float(val)
    return slos


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """A successful request whose TTFT / TPOT / e2e (ms) are all within the given SLOs."""
    if not rec.success:
        return False
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2e": rec.e2e}
    return all(values[k] * 1000.0 <= v for k, v in slos.items())


def summarize(values_s: Sequence[float]) -> dict[str, float]:
    """mean / std / p50 / p90 / p99 / max of seconds, reported in milliseconds."""
    if len(values_s) == 0:
        return {k: 0.0 for k in ("mean", "std", "p50", "p90", "p99", "max")}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "std": float(a.std()), "p50": float(p50),
            "p90": float(p90), "p99": float(p99), "max": float(a.max())}


def _latency_lists(ok: Sequence[RequestRecord]) -> dict[str, list[float]]:
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2e": [r.e2e for r in ok],
    }


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    slos: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """Aggregate metrics of a run: counts, throughputs, latency stats, goodput."""
    ok = [r for r in records if r.success]
    dur = max(duration_s, 1e-9)
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(ok) / dur,
        "input_throughput": inp / dur,
        "output_throughput": out / dur,
        "total_throughput": (inp + out) / dur,
        "mean_concurrency": sum(r.e2e for r in ok) / dur,
    }
    for name, vals in _latency_lists(ok).items():
        m[f"{name}_ms"] = summarize(vals)
    if slos:
        good = sum(1 for r in records if meets_slos(r, slos))
        m["goodput"] = {"slos_ms": dict(slos), "good_requests": good,
                        "fraction": good / max(len(records), 1),
                        "request_rate": good / dur}
    return m


def format_table(m: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A fixed-width text summary of ``compute_metrics`` output."""
    lines = [f"{'=' * 18} {title} {'=' * 18}"]
    width = len(lines[0])

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<{width - 14}}{text:>14}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Input token throughput (tok/s):", m["input_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_throughput"])
    row("Mean concurrency:", m["mean_concurrency"])
    if "goodput" in m:
        g = m["goodput"]
        row("Goodput fraction:", g["fraction"])
        row("Goodput (req/s):", g["request_rate"])
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)",
             "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    for key in LATENCIES:
        lines.append(names[key].center(width, "-"))
        s = m[f"{key}_ms"]
        for stat in ("mean", "p50", "p99"):
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {key.upper()} (ms):",
                s[stat])
    lines.append("=" * width)
    return "\n".join(lines)
