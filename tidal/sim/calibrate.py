"""`tidal sim calibrate`: does the simulator predict a live run?

It reads the JSON that `tidal bench --output-file` wrote for a live cluster, replays exactly
its requests (each one's send offset, the server's prompt token count, the output tokens it
generated, or asked for when it failed) through `tidal.sim.engine.Cluster` with the same
layout and a static planner, and sets the live and simulated TTFT and TPOT side by side
(p50, p90, the relative error of the simulation). The run passes when both p50s are within
the tolerance.

A run whose workers moved (`scripts/live_shift.py`'s JSON: request records numbered by phase,
the planner's moves with their start times and its settings) is replayed with its moves:
the live run's, each started at its live time (`--moves live`), or the simulator's planner's
under the live router's planner settings (`--moves planner`); the report adds each phase's
latencies and both runs' moves.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Optional, Sequence

import msgspec

from tidal.planner.decide import has_path
from tidal.profile.cost import host_mismatch
from tidal.sim.engine import Cluster, SimConfig
from tidal.sim.instance import Limits
from tidal.sim.report import percentile
from tidal.sim.workload import TraceRequest

METRICS = ("ttft", "tpot")
QUANTILES = (50, 90)


class BenchRecord(msgspec.Struct):
    """The fields of a `tidal bench --output-file` request record that a replay reads (others are ignored)."""
    start: float
    success: bool
    prompt_tokens: int
    output_tokens: int
    ttft: Optional[float] = None
    tpot: Optional[float] = None
    requested_output_tokens: Optional[int] = None
    phase: Optional[int] = None  # scripts/live_shift.py


class LiveMove(msgspec.Struct):
    """A move of scripts/live_shift.py's JSON: `at_s` when the planner started it, from the run's start."""
    src: str
    dst: str
    outcome: str = ""
    at_s: Optional[float] = None
    url: str = ""


class BenchFile(msgspec.Struct):
    requests: list[BenchRecord]
    moves: list[LiveMove] = []
    planner_config: Optional[dict] = None


def load_bench(path: str) -> dict:
    """The bench JSON as read, once its request records have the fields and types a replay needs."""
    from tidal.sim.cli import fail

    try:
        with open(path, "rb") as f:
            raw = f.read()
        bench = msgspec.json.decode(raw)
        msgspec.convert(bench, BenchFile)
    except OSError as e:
        fail(f"--bench-json {path}: {e.strerror or e}")
    except msgspec.MsgspecError as e:
        fail(f"--bench-json {path}: not a `tidal bench --output-file` JSON ({e})")
    if not bench["requests"]:
        fail(f"--bench-json {path}: no per-request records (a `tidal bench --output-file` JSON)")
    if any(r["success"] and r.get("ttft") is None for r in bench["requests"]):
        fail(f"--bench-json {path}: a successful request without its ttft")
    return bench


def replayed_trace(bench: dict) -> list[TraceRequest]:
    """The live requests in send order, as the simulator's trace."""
    out = []
    for r in sorted(bench["requests"], key=lambda r: r["start"]):
        generated = r["output_tokens"] if r["success"] else r.get("requested_output_tokens") or r["output_tokens"]
        out.append(TraceRequest(float(r["start"]), max(1, int(r["prompt_tokens"])), max(1, int(generated))))
    return out


def live_latencies(records: list[dict]) -> dict[str, list[float]]:
    """TTFT of every successful request, TPOT of those with more than one output token (seconds)."""
    ok = [r for r in records if r["success"]]
    return {"ttft": [r["ttft"] for r in ok], "tpot": [r["tpot"] for r in ok if r.get("tpot") is not None]}


def sim_latencies(c: Cluster, rids: Optional[set[int]] = None) -> dict[str, list[float]]:
    done = [r for r in c.requests if r.outcome == "finished" and (rids is None or r.rid in rids)]
    lat = [c.ttft_tpot(r) for r in done]
    return {"ttft": [x for x, _ in lat], "tpot": [y for (_, y), r in zip(lat, done) if r.generated > 1]}


def replayed_moves(bench: dict) -> tuple[tuple, ...]:
    """The live run's moves that landed, (start s, from mode, to mode, live worker URL), for
    SimConfig.replayed_moves: the same simulated worker moves each time the same live worker did."""
    moves = msgspec.convert(bench.get("moves") or [], list[LiveMove])
    return tuple((m.at_s, m.src, m.dst, m.url) if m.url else (m.at_s, m.src, m.dst)
                 for m in moves if m.outcome == "ok" and m.at_s is not None)


def phase_rows(bench: dict, c: Cluster, tolerance: float) -> list[dict]:
    """Each phase's live and simulated latencies (the requests replayed in send order: rid = rank)."""
    ordered = sorted(bench["requests"], key=lambda r: r["start"])
    phases = sorted({r["phase"] for r in ordered if r.get("phase") is not None})
    rows = []
    for k in phases:
        rids = {i for i, r in enumerate(ordered) if r.get("phase") == k}
        mine = [ordered[i] for i in sorted(rids)]
        rows.append({"phase": k, "requests": len(mine),
                     **compare(live_latencies(mine), sim_latencies(c, rids), tolerance)})
    return rows


def sim_moves(c: Cluster) -> list[dict]:
    return [{"at_s": round(m.started, 3), "src": m.src, "dst": m.dst, "outcome": m.outcome,
             "switched_s": None if m.ended is None else round(m.ended - m.started, 3),
             "handover_s": None if m.handed_over is None else round(m.handed_over - m.started, 3)} for m in c.moves]


def relative_error(sim: float, live: float) -> float:
    return (sim - live) / live if live > 0 else math.nan


def compare(live: dict[str, Sequence[float]], sim: dict[str, Sequence[float]], tolerance: float) -> dict:
    """Per metric and quantile: live ms, simulated ms, relative error; passed when every p50 is within tolerance."""
    rows: dict[str, dict] = {}
    for m in METRICS:
        for q in QUANTILES:
            lv, sv = percentile(live[m], q), percentile(sim[m], q)
            rows[f"{m}_p{q}"] = {"live_ms": lv * 1000, "sim_ms": sv * 1000, "rel_err": relative_error(sv, lv)}
    passed = all(abs(rows[f"{m}_p50"]["rel_err"]) <= tolerance for m in METRICS)  # NaN fails
    return {"metrics": rows, "tolerance": tolerance, "passed": passed}


def calibrate(bench: dict, cost: Any, cfg: SimConfig, limits: Limits, tolerance: float) -> dict:
    trace = replayed_trace(bench)
    c = Cluster(cfg, cost, trace, limits).run()
    outcomes = {k: sum(1 for r in c.requests if r.outcome == k) for k in ("finished", "rejected", "unfinished")}
    out = {"requests": {"live": len(bench["requests"]),
                        "live_succeeded": sum(1 for r in bench["requests"] if r["success"]),
                        "replayed": len(trace), **{f"sim_{k}": v for k, v in outcomes.items()}},
           "arrivals_s": [t.arrival for t in trace],
           **compare(live_latencies(bench["requests"]), sim_latencies(c), tolerance)}
    phases = phase_rows(bench, c, tolerance)
    if phases:
        out["phases"] = phases
    if bench.get("moves") or c.moves:
        out["moves"] = {"live": list(bench.get("moves") or []), "sim": sim_moves(c),
                        "live_handovers": list(bench.get("handovers") or [])}
    return out


def format_table(result: dict) -> str:
    lines = [f"{'metric':<10}{'live ms':>12}{'sim ms':>12}{'sim/live-1':>12}"]
    for name, row in result["metrics"].items():
        lines.append(f"{name:<10}{row['live_ms']:>12.1f}{row['sim_ms']:>12.1f}{row['rel_err']:>+12.1%}")
    n = result["requests"]
    verdict = "PASS" if result["passed"] else "FAIL"
    lay = result.get("config", {})
    if lay:
        lines.append(f"simulated layout: {lay['prefill']} prefill, {lay['decode']} decode, {lay['null']} null")
    lines.append(f"{n['replayed']} requests replayed ({n['live_succeeded']} succeeded live, {n['sim_finished']} "
                 f"finished simulated); p50 within {result['tolerance']:.0%}: {verdict}")
    for ph in result.get("phases", []):
        m = ph["metrics"]
        lines.append(f"phase {ph['phase']} ({ph['requests']} requests): " + ", ".join(
            f"{name} {m[name]['live_ms']:.1f} live / {m[name]['sim_ms']:.1f} sim ({m[name]['rel_err']:+.1%})"
            for name in ("ttft_p50", "tpot_p50")))
    moves = result.get("moves", {})
    for side in ("live", "sim"):
        for mv in moves.get(side, []):
            extra = "" if mv.get("handover_s") is None else f", handover {mv['handover_s']:.1f} s"
            lines.append(f"{side} move at {mv.get('at_s')} s: {mv['src']} -> {mv['dst']} ({mv.get('outcome')}{extra})")
    for h in moves.get("live_handovers", []):
        took = "?" if h.get("handover_ms") is None else f"{h['handover_ms'] / 1000:.1f} s"
        lines.append(f"live handover to {h.get('mode')} seen at {h.get('seen_t')} s: {took}")
    return "\n".join(lines)


def calibrate_layout(ns: Any) -> tuple[int, int, int]:
    """(null, prefill, decode) of the live run: the flags; prefill and decode not given are 1 each, or 0 each
    with null servers (a colocated run)."""
    k = ns.null
    default = 0 if k and ns.prefill is None and ns.decode is None else 1
    p = default if ns.prefill is None else ns.prefill
    d = default if ns.decode is None else ns.decode
    if min(k, p, d) < 0 or not has_path({"null": k, "prefill": p, "decode": d}):
        raise SystemExit("tidal sim calibrate: need a null server, or a prefill and a decode server")
    return k, p, d


def moving(ns: Any, bench: dict) -> dict:
    """SimConfig's fields for the live run's moves: none for a run that made none; else the moves as the
    live run made them (`--moves live`), or its planner settings for the simulator's planner (`planner`)."""
    from tidal.planner.schema import PlannerConfig
    from tidal.sim.cli import fail

    if ns.moves == "live":
        return {"replayed_moves": replayed_moves(bench)}
    if not bench.get("planner_config"):
        fail(f"--bench-json {ns.bench_json}: no planner_config (scripts/live_shift.py writes it) for --moves planner")
    try:
        planner = msgspec.convert(bench["planner_config"], PlannerConfig)
    except (msgspec.MsgspecError, ValueError) as e:
        fail(f"--bench-json {ns.bench_json}: planner_config: {e}")
    return {"planner": msgspec.structs.replace(planner, mode="sla")}


def run_calibrate(ns: Any, cost: Any, limits: Limits) -> int:
    from tidal.sim.cli import fail, write_json

    if not ns.bench_json:
        raise SystemExit("tidal sim calibrate: --bench-json is required")
    k, p, d = calibrate_layout(ns)
    bench = load_bench(ns.bench_json)
    if not any(r["success"] for r in bench["requests"]):
        fail(f"--bench-json {ns.bench_json}: no live request succeeded: no latency to compare")
    warning = host_mismatch(cost.profile)
    if warning:  # the live run was on this host
        print(f"warning: --profile {ns.profile}: {warning}", file=sys.stderr)
    threads = cost.profile.server.torch_threads or 1
    cfg = SimConfig(null=k, prefill=p, decode=d, policy=ns.policy, seed=ns.seed, host_cores=ns.host_cores,
                    instance_threads=threads, **moving(ns, bench))
    result = calibrate(bench, cost, cfg, limits, ns.tolerance)
    result["config"] = {"bench_json": os.path.basename(ns.bench_json), "profile": os.path.basename(ns.profile),
                        "null": k, "prefill": p, "decode": d, "host_cores": ns.host_cores,
                        "instance_threads": threads, "policy": ns.policy, "moves": ns.moves,
                        "planner": msgspec.to_builtins(cfg.planner), "simulated": True}
    if ns.output:
        write_json(result, ns.output)
    print(format_table(result))
    return 0 if result["passed"] else 1
