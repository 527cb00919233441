"""Goodput as in DistServe: the highest request rate at which at least 90% of requests meet
both the TTFT and the TPOT SLO, searched on a grid of rate multipliers (`search_rate`), for
colocated (all null), the static P:D splits, and the planner (starting from --prefill/--decode)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable, Optional

from tidal.sim.cli import (layout, layout_names, lookahead_flags, phase_layouts, planner_flags, simulate,
                           static_layouts, workload_spec)
from tidal.sim.workload import TraceRequest, make_workload, virtual_span

MAX_DOUBLINGS = 12
# --rate-samples: the rates a probe pools span this fraction of its rate, centred on it (a sixth of the 3% grid
# step: the same rate for the search, and runs that share no decision once the planner's thresholds split them)
RATE_SAMPLE_SPAN = 0.005
# after bisecting, the grid rates above the highest that attains are probed until this many in a row do not
SCAN_ABOVE = 3


def sample_rates(scale: float, samples: int) -> list[float]:
    """The rates a probe at `scale` pools: `scale` alone for one sample, else `samples` rates spread evenly over
    RATE_SAMPLE_SPAN of it, centred on it."""
    if samples <= 1:
        return [scale]
    return [scale * (1 + RATE_SAMPLE_SPAN * (j / (samples - 1) - 0.5)) for j in range(samples)]


def search_rate(attains: Callable[[float], bool], start: float, tolerance: float,
                scan_above: int = SCAN_ABOVE, hopeless: Optional[Callable[[], bool]] = None) -> float:
    """The highest rate scale on the grid (1 + tolerance)^k that attains, of those the search reaches (0 if none
    does down to 12 halvings of `start`, or where `hopeless()` says after the first halving that none will): doubling
    or halving from `start` (snapped to the grid) to a bracket, bisection on
    the grid, then upward from the highest rate found until `scan_above` grid rates in a row do not attain.
    On a bursty trace attainment is not monotonic in the rate: a bisection alone ends below the first rate that
    fails, wherever it probed, and its result moved with the first probe by as much as the layouts differ
    (the conversation trace at 64 instances: 111.57 requests/s for the planner from one first probe, 119.70
    from another). On the grid every search probes the same rates near the answer."""
    step = math.log1p(tolerance)
    memo: dict[int, bool] = {}

    def ok(k: int) -> bool:
        if k not in memo:
            memo[k] = attains(math.exp(k * step))
        return memo[k]

    octave = max(1, round(math.log(2) / step))  # grid steps in a doubling
    k0 = round(math.log(start) / step)
    if ok(k0):
        lo = k0
        for _ in range(MAX_DOUBLINGS):
            if not ok(lo + octave):
                break
            lo += octave
        else:
            return math.exp(lo * step)
        hi = lo + octave
    else:
        hi = k0
        for halvings in range(MAX_DOUBLINGS):
            if ok(hi - octave):
                break
            hi -= octave
            if halvings == 0 and hopeless is not None and hopeless():
                return 0.0
        else:
            return 0.0
        lo = hi - octave
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    misses, k = 0, lo + 1
    while misses < scan_above:
        if ok(k):
            lo, misses = k, 0
        else:
            misses += 1
        k += 1
    return math.exp(lo * step)


class Layout:
    def __init__(self, name: str, null: int, prefill: int, decode: int, mode: str) -> None:
        self.name, self.null, self.prefill, self.decode, self.mode = name, null, prefill, decode, mode

    def paths(self) -> tuple[str, ...]:
        """The paths its requests may take: a PD pair, a null server (a planner or a schedule may make either)."""
        if self.mode != "static":
            return ("pd", "null")
        return ("pd",) * bool(self.prefill and self.decode) + ("null",) * bool(self.null)


def alone_trace(trace: list[TraceRequest], cost: Any) -> list[TraceRequest]:
    """The requests one after another, each arriving once the one before has ended on an idle server (twice what
    the cost model says its prefill, KV hand-off and decode steps take, and a second more)."""
    out, t = [], 0.0
    for r in trace:
        out.append(TraceRequest(t, r.input_tokens, r.output_tokens))
        steps = r.output_tokens * cost.decode_step_seconds(1, r.input_tokens + r.output_tokens)
        t += 2 * (cost.prefill_seconds(r.input_tokens) + cost.kv_transfer_seconds(r.input_tokens) + steps) + 1.0
    return out


class AloneAttainment:
    """Per path, the share of the workload's requests that meet both SLOs each alone on an idle server (a PD pair, a
    null server): no layout whose requests take those paths meets more at any rate. Simulated once per path, when
    a search first asks."""

    def __init__(self, ns: argparse.Namespace, cost: Any, rate_scale: float) -> None:
        self.ns, self.cost, self.rate_scale = ns, cost, rate_scale
        self.by_path: dict[str, float] = {}

    def __call__(self, path: str) -> float:
        if path not in self.by_path:
            trace = alone_trace(make_workload(workload_spec(self.ns, self.rate_scale)), self.cost)
            k, p, d = (1, 0, 0) if path == "null" else (0, 1, 1)
            c = simulate(self.ns, k, p, d, "static", self.rate_scale, self.cost, trace=trace)
            self.by_path[path] = (c.ended - c.missed) / max(1, len(trace))
        return self.by_path[path]


def goodput_of(ns: argparse.Namespace, lay: Layout, cost: Any, planner_cost: Any, start: float,
               alone: Optional[AloneAttainment] = None) -> dict:
    probed: list[dict] = []  # every probe: where attainment is not monotonic in the rate, they show it
    largest_batch = [0]  # over every probe: what the extrapolation warning tests

    def attains(scale: float) -> bool:
        rates = sample_rates(scale, ns.rate_samples)
        requests = [len(make_workload(workload_spec(ns, r))) for r in rates]
        met = missed = 0
        stopped = False
        for r, n in zip(rates, requests):
            # the misses left of those all the samples together may have, as a fraction of this run's requests
            # (one sample: exactly 1 - target, as the engine compares it)
            left = (1 - ns.target_attainment) * (sum(requests) / max(1, n)) - missed / max(1, n)
            c = simulate(ns, lay.null, lay.prefill, lay.decode, lay.mode, r, cost, planner_cost,
                         stop_after_miss=max(0.0, left))
            largest_batch[0] = max(largest_batch[0], c.largest_decode_batch)
            good = c.ended - c.missed  # the requests that ended meeting both SLOs
            met, missed = met + good, missed + len(c.requests) - good
            if c.stopped_early:  # past the misses allowed: the probe fails whatever the other samples say
                stopped = True
                break
        attainment = round(met / sum(requests), 6) if sum(requests) else None
        ok = not stopped and attainment is not None and attainment >= ns.target_attainment
        probe = {"rate_scale": round(scale, 6), "slo_attainment": attainment, "met": ok, "stopped_early": stopped}
        if len(rates) > 1:
            probe["samples"] = len(rates)
        probed.append(probe)
        return ok

    best_alone: list[float] = []

    def hopeless() -> bool:
        if alone is None:
            return False
        best_alone.append(max(alone(path) for path in lay.paths()))
        return best_alone[0] < ns.target_attainment

    t0 = time.perf_counter()
    scale = search_rate(attains, start, ns.rate_tolerance, hopeless=hopeless)
    spec = workload_spec(ns, scale)
    rate = len(make_workload(spec)) / virtual_span(spec) if scale > 0 else 0.0
    out = {"layout": lay.name, "null": lay.null, "prefill": lay.prefill, "decode": lay.decode, "planner": lay.mode,
           "rate_scale": round(scale, 6), "goodput_rps": round(rate, 4), "probes": len(probed),
           "seconds": round(time.perf_counter() - t0, 2), "largest_decode_batch": largest_batch[0],
           "probed": sorted(probed, key=lambda p: p["rate_scale"])}
    if best_alone:
        out["alone_attainment"] = round(best_alone[0], 6)
    if scale == 0 and best_alone and best_alone[0] < ns.target_attainment:
        out["never_met"] = True
        sys.stderr.write(f"tidal sim goodput: {lay.name} meets the SLOs at no rate: {best_alone[0]:.1%} of the "
                         f"requests meet both even each alone on an idle server; its goodput is 0\n")
    elif scale == 0:  # not even start / 2^12 met them: a layout that cannot serve this workload at all
        out["never_met"] = True
        sys.stderr.write(f"tidal sim goodput: {lay.name} met the SLOs at no rate tried (down to rate scale "
                         f"{min(p['rate_scale'] for p in probed):g}); its goodput is 0\n")
    if all(p["met"] for p in probed):  # every probe met the SLOs: the workload is too small to load it
        out["at_search_limit"] = True
        sys.stderr.write(f"tidal sim goodput: {lay.name} met the SLOs up to the search's limit (rate scale "
                         f"{scale:g}); its goodput is a lower bound: give a longer --duration-s\n")
    if lay.mode in ("sla", "phases", "lookahead") and scale > 0:
        c = simulate(ns, lay.null, lay.prefill, lay.decode, lay.mode, scale, cost, planner_cost)
        if lay.mode == "lookahead":
            out["splits_at_goodput"] = splits_headed_for(c.lookahead)
        out["moves_at_goodput"] = len(c.moves)
        out["moves_failed"] = sum(1 for m in c.moves if m.outcome != "ok")
        final = dict(c.pools[-1])
        final["since_s"] = final.pop("t")  # the pools at the end, as they were from since_s
        out["final_pools"] = final
    return out


def splits_headed_for(looks: list[dict]) -> list[list]:
    """The lookahead's looks as [from second, split] where the split it heads for changes."""
    out: list[list] = []
    for look in looks:
        if not out or out[-1][1] != look["split"]:
            out.append([look["t"], look["split"]])
    return out


def static_splits(ns: argparse.Namespace, measure: Callable[[int], dict]) -> list[dict]:
    """Every split; with --split-step K every K-th (and the last), then around the best one at
    K/2, K/4, ... 1 (the goodput of a split is close to unimodal in P)."""
    n = ns.instances
    step = max(1, ns.split_step)
    results = {p: measure(p) for p in sorted(set(range(1, n, step)) | {n - 1})}
    while step > 1:
        step //= 2
        best = max(results, key=lambda p: results[p]["goodput_rps"])
        for p in (best - step, best + step):
            if 1 <= p < n and p not in results:
                results[p] = measure(p)
    return [results[p] for p in sorted(results)]


def run_goodput(ns: argparse.Namespace, cost: Any, planner_cost: Optional[Any]) -> dict:
    n = ns.instances
    _, p0, d0 = layout(ns)
    start = max(ns.rate_scale, 1e-3)
    which = set(layout_names(ns))
    results: list[dict] = []
    last = [start]
    alone = AloneAttainment(ns, cost, start)
    if "colocated" in which:
        results.append(goodput_of(ns, Layout("colocated", n, 0, 0, "static"), cost, planner_cost, start, alone))
        last[0] = results[-1]["rate_scale"] or start

    def measure(p: int) -> dict:
        r = goodput_of(ns, Layout(f"static {p}:{n - p}", 0, p, n - p, "static"), cost, planner_cost, last[0], alone)
        last[0] = r["rate_scale"] or start
        return r

    best = None
    statics = static_splits(ns, measure) if "static" in which else []
    for p, d in static_layouts(ns):  # splits named in --layouts (the rest of the workers null)
        name = f"static {p}:{d}" + (f" + {n - p - d} null" if p + d < n else "")
        statics.append(goodput_of(ns, Layout(name, n - p - d, p, d, "static"), cost, planner_cost, last[0], alone))
        last[0] = statics[-1]["rate_scale"] or start
    if statics:
        best = max(statics, key=lambda r: r["goodput_rps"])
        if best["goodput_rps"] > 0:  # no split is "best" where none meets the SLOs at any rate
            best["best_static"] = True
        else:
            best = None
        results += statics
    start_name = f"{p0}:{d0}" + (f" + {ns.null} null" if ns.null else "")
    if "planner" in which:
        results.append(goodput_of(ns, Layout(f"planner from {start_name}", ns.null, p0, d0, "sla"), cost,
                                  planner_cost, (best or {}).get("rate_scale") or last[0], alone))
    if "phases" in which:
        first = phase_layouts(ns)[0]
        results.append(goodput_of(ns, Layout(f"phase layouts {ns.phase_layouts}", first["null"], first["prefill"],
                                             first["decode"], "phases"), cost, planner_cost,
                                  (best or {}).get("rate_scale") or last[0], alone))
    if "lookahead" in which:
        seen = " on the recent arrivals" if ns.lookahead_forecast == "recent" else ""
        results.append(goodput_of(ns, Layout(f"lookahead{seen} from {start_name}", ns.null, p0, d0, "lookahead"),
                                  cost, planner_cost, (best or {}).get("rate_scale") or last[0], alone))
    ratio = None
    if best and best["goodput_rps"] and "planner" in which:
        ratio = round(next(r for r in results if r["planner"] == "sla")["goodput_rps"] / best["goodput_rps"], 3)
    spec = workload_spec(ns)
    return {"simulated": True, "instances": n, "workload": ns.workload, "duration_s": ns.duration_s,
            "phase_s": ns.phase_s, "clock": spec.clock, "phase_rate_ratio": spec.phase_rate_ratio,
            "length_scale": ns.length_scale,
            "profile": os.path.basename(ns.profile),
            "ttft_slo_ms": ns.ttft_slo_ms, "tpot_slo_ms": ns.tpot_slo_ms, "target_attainment": ns.target_attainment,
            "rate_samples": ns.rate_samples, "planner_flags": planner_flags(ns),
            "lookahead": lookahead_flags(ns) if "lookahead" in which else None,
            "results": results, "best_static": best["layout"] if best else None, "planner_vs_best_static": ratio}


def summary_lines(report: dict) -> list[str]:
    """The comparison at a glance, for stderr (the JSON report is long): one line per layout searched, the
    best static split marked, the planner's ratio to it."""
    out = []
    best = next((r["goodput_rps"] for r in report["results"] if r.get("best_static")), None)
    for r in report["results"]:
        line = f"tidal sim goodput: {r['layout']}: {r['goodput_rps']:g} requests/s (rate scale {r['rate_scale']:g})"
        if r.get("best_static"):
            line += ", the best static split"
        if r["planner"] in ("sla", "phases", "lookahead") and best:
            line += f", {round(r['goodput_rps'] / best, 3):g}x the best static split"
        if "moves_at_goodput" in r:
            n = r["moves_at_goodput"]
            line += f"; {n} move{'' if n == 1 else 's'} at its goodput ({r['moves_failed']} failed)"
        out.append(line + (" (simulated)" if r is report["results"][-1] else ""))
    if report["results"] and all(r.get("never_met") for r in report["results"]):
        out.append("tidal sim goodput: no layout meets the SLOs at any rate: give lengths and SLOs the profile can "
                   "meet (docs/elasticity.md's runs: --length-scale 0.25 --ttft-slo-ms 8000 --tpot-slo-ms 200)")
    return out

