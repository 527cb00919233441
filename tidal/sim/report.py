"""A simulated run's numbers (JSON) and its picture (PNG)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

from tidal.bench.plot import save_figure
from tidal.sim.engine import Cluster


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float) -> Any:
    return None if math.isnan(x) else round(x * 1000, 3)


def summary(c: Cluster, duration_s: float) -> dict:
    done = [r for r in c.requests if r.outcome == "finished"]
    lat = [c.ttft_tpot(r) for r in done]
    ttft = [x for x, _ in lat]
    tpot = [y for (_, y), r in zip(lat, done) if r.generated > 1]
    met = sum(1 for r in done if c.meets_slo(r))
    n = len(c.requests)
    outcomes = {k: sum(1 for r in c.requests if r.outcome == k) for k in ("finished", "rejected", "unfinished")}
    return {
        "requests": n,
        **outcomes,
        "stopped_early": c.stopped_early,
        "slo_attainment": round(met / n, 6) if n else None,
        "goodput_rps": round(met / duration_s, 6),
        "ttft_ms": {"p50": _ms(percentile(ttft, 50)), "p99": _ms(percentile(ttft, 99))},
        "tpot_ms": {"p50": _ms(percentile(tpot, 50)), "p99": _ms(percentile(tpot, 99))},
        "retractions": sum(r.retractions for r in c.requests),
        "busy_fraction": {url: round(i.busy_s / max(c.now, 1e-9), 4) for url, i in c.instances.items()},
    }


def moves(c: Cluster) -> list[dict]:
    out = []
    for m in c.moves:
        d = dataclasses.asdict(m)
        d["drain_s"] = None if m.drained is None else round(m.drained - m.started, 6)
        d["total_s"] = None if m.ended is None else round(m.ended - m.started, 6)
        d["handover_s"] = None if m.handed_over is None else round(m.handed_over - m.started, 6)
        out.append(d)
    return out


def phase_count(span_s: float, phase_s: float) -> int:
    """The phases a workload of `span_s` virtual seconds starts (the last one may be cut short)."""
    return max(1, math.ceil(span_s / phase_s - 1e-9))


def by_phase(c: Cluster, phase_s: float, mixes: tuple[str, str], span_s: float = 0.0) -> list[dict]:
    """SLO attainment of the requests by the phase of a shifting mix they arrived in (phase k from k x phase_s;
    `mixes`: the names of the even and the odd phases' mix), every phase of the workload's `span_s` listed, one
    that no request arrived in with attainment None."""
    out: list[dict] = []

    def upto(k: int) -> None:
        while len(out) <= k:
            out.append({"phase": len(out), "mix": mixes[len(out) % 2], "start_s": round(len(out) * phase_s, 6),
                        "requests": 0, "met": 0})

    upto(phase_count(span_s, phase_s) - 1 if span_s > 0 else 0)
    for r in c.requests:
        k = int(r.arrival // phase_s)
        upto(k)
        out[k]["requests"] += 1
        out[k]["met"] += r.outcome == "finished" and c.meets_slo(r)
    for p in out:
        met = p.pop("met")
        p["slo_attainment"] = round(met / p["requests"], 6) if p["requests"] else None
    return out


def report(c: Cluster, config: dict, duration_s: float, phase_s: Optional[float] = None,
           mixes: tuple[str, str] = ("", "")) -> dict:
    """The run's JSON; `phase_s` (a shifting mix's virtual phase length) adds the attainment per phase."""
    out = {"config": config, "summary": summary(c, duration_s), "pools": c.pools, "moves": moves(c),
           "decisions": dict(sorted(c.decisions.items())), "end_s": round(c.now, 6)}
    if phase_s:
        out["summary"]["slo_attainment_by_phase"] = by_phase(c, phase_s, mixes, duration_s)
    if c.cfg.lookahead_splits:
        out["lookahead"] = c.lookahead
    return out


def plot(c: Cluster, path: str, title: str = "", phase_s: Optional[float] = None,
         mixes: tuple[str, str] = ("", ""), span_s: float = 0.0) -> str:
    """Pool sizes over time; each request's TTFT and TPOT against its SLO, by arrival time; a shifting
    mix's odd phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(12, 10), sharex=True)
    _pools(axes[0], c)
    done = [r for r in c.requests if r.outcome == "finished"]
    lat = [c.ttft_tpot(r) for r in done]
    arrivals = [r.arrival for r in done]
    slo = c.cfg.planner
    for ax, values, limit, label in ((axes[1], [x for x, _ in lat], slo.ttft_slo_s, "TTFT (s)"),
                                     (axes[2], [y for _, y in lat], slo.tpot_slo_s, "TPOT (s)")):
        ok = [v <= limit for v in values]
        ax.scatter([a for a, k in zip(arrivals, ok) if k], [v for v, k in zip(values, ok) if k], s=4,
                   color="tab:green", label="meets SLO")
        ax.scatter([a for a, k in zip(arrivals, ok) if not k], [v for v, k in zip(values, ok) if not k], s=4,
                   color="tab:red", label="misses SLO")
        ax.axhline(limit, color="k", linestyle="--", label=f"SLO {limit:g} s")
        ax.set_yscale("log")
        ax.set_ylabel(label)
        _legend_outside(ax)
    if phase_s:
        _shade_phases(axes, c, phase_s, mixes, span_s)
    axes[2].set_xlabel("virtual time (s); latencies at each request's arrival")
    return save_figure(fig, path, title)


def _shade_phases(axes: Any, c: Cluster, phase_s: float, mixes: tuple[str, str], span_s: float = 0.0) -> None:
    """The odd phases of the workload's `span_s` (else of the arrivals), none past it."""
    end = span_s or max([0.0] + [r.arrival for r in c.requests])
    for k in range(1, phase_count(end, phase_s), 2):
        for i, ax in enumerate(axes):
            ax.axvspan(k * phase_s, min((k + 1) * phase_s, end), color="tab:purple", alpha=0.08,
                       label=f"{mixes[1]} phases" if i == 0 and k == 1 and mixes[1] else None)
    _legend_outside(axes[0])


def _pools(ax: Any, c: Cluster) -> None:
    end = max(c.now, c.pools[-1]["t"] if c.pools else 0.0)
    ts = [p["t"] for p in c.pools] + [end]
    # widths and dashes apart: two pools of the same size draw on one line, each still seen
    for mode, color, width, dashes in (("null", "tab:gray", 3.5, "-"), ("prefill", "tab:blue", 2.5, "-"),
                                       ("decode", "tab:orange", 1.5, "--"), ("moving", "tab:red", 1.0, ":")):
        ax.step(ts, [p[mode] for p in c.pools] + [c.pools[-1][mode]], where="post", label=mode, color=color,
                linewidth=width, linestyle=dashes)
    for m in c.moves:
        ax.axvline(m.started, color="tab:red", alpha=0.2)
    ax.set_ylabel("instances")
    ax.set_title("pools over time")
    _legend_outside(ax)


def _legend_outside(ax: Any) -> None:
    """Right of the plot, where it hides no point."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
