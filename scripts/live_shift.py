"""A live phase-shift run (issue 10, item 5): `tidal cluster --prefill 1 --decode 1 --worker 1
--planner sla` on this machine, driven by `tidal bench` through phases that alternate
prefill-heavy traffic (long prompts, short answers) and decode-heavy traffic (short prompts,
long answers), while GET /planner/status is polled to record the pools over time. Each phase's
rate is, unless given, what the planner's cost model says loads the 3 servers (`auto_rate`): pass
a profile of this host.

    PYTHONPATH=$PWD python3 scripts/live_shift.py --planner-profile PROFILE.json --output live_shift.json

Writes a JSON (phases with their bench summary and SLO attainment, pools and the planner's traffic
view over time, every move decision with its reason, outcome and start time, each worker's handover,
every request's record with its send time from the run's start) and prints a table of pools over
time and one of the phases. `tidal sim calibrate --bench-json` replays that JSON
(docs/elasticity.md, "Calibration with moves").

`--layout P:D:N --planner static` runs the same load on a fixed layout: with the phases' rates
given (the first run prints them), the runs compare the planner with each static layout by the share
of requests that met both SLOs (docs/elasticity.md, "Live run").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import msgspec

from tidal.bench.metrics import RequestRecord, meets_slos
from tidal.planner.decide import best_layout, make_predictor
from tidal.planner.flags import add_planner_args, planner_config_from_namespace
from tidal.planner.loop import load_cost_model
from tidal.planner.predict import PoolLoad
from tidal.planner.schema import PlannerConfig, Traffic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(REPO, "tidal", "profile", "data", "smollm2_cpu_2core.json")
MODES = ("prefill", "decode", "null")
AUTO_HEADROOM = 2.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="prefill,decode,prefill",
                   help="the phases in order, each prefill or decode (default: prefill,decode,prefill)")
    p.add_argument("--phase-s", type=float, default=90.0, help="seconds of arrivals per phase (default: 90)")
    p.add_argument("--prefill-heavy", nargs=3, default=("768", "4", "auto"), metavar=("IN", "OUT", "RATE"),
                   help="prefill phase: prompt tokens, output tokens, requests/s or auto (default: 768 4 auto)")
    p.add_argument("--decode-heavy", nargs=3, default=("32", "256", "auto"), metavar=("IN", "OUT", "RATE"),
                   help="decode phase: prompt tokens, output tokens, requests/s or auto (default: 32 256 auto)")
    p.add_argument("--rate-headroom", type=float, default=AUTO_HEADROOM,
                   help="an auto RATE is the rate at which the layout the planner heads for from 1:1:1 keeps this "
                        "multiple of it in predicted capacity, by --planner-profile and the planner flags of "
                        f"--cluster-args (default: {AUTO_HEADROOM:g})")
    p.add_argument("--planner-profile", default=PROFILE,
                   help="the planner's cost model, which also sets auto rates: measure this host's (docs/"
                        "elasticity.md, Calibration) (default: the shipped tidal/profile/data/smollm2_cpu_2core.json)")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between /planner/status polls (default: 2)")
    p.add_argument("--port", type=int, default=18600, help="router port; servers on the next three (default: 18600)")
    p.add_argument("--cluster-args", default="--ttft-slo-ms 3000 --tpot-slo-ms 150 --planner-interval-s 2 "
                   "--planner-cooldown-s 20 --planner-window-s 20",
                   help="extra `tidal cluster` flags (default: SLOs 3000/150 ms, interval 2 s, cooldown 20 s, "
                        "window 20 s: a few-minute run's; the cooldown as long as the window, which holds the "
                        "traffic from before a move for that long)")
    p.add_argument("--layout", default="1:1:1", metavar="P:D:N",
                   help="the servers the cluster starts with: prefill, decode and null (default: 1:1:1)")
    p.add_argument("--planner", choices=("sla", "static"), default="sla",
                   help="sla: the planner moves roles; static: the layout stays (default: sla)")
    p.add_argument("--output", default="live_shift.json", help="the JSON written (default: live_shift.json)")
    ns = p.parse_args(argv)
    if not ns.rate_headroom > 0:
        p.error("--rate-headroom must be > 0")
    ns.layout = parse_layout(p, ns.layout)
    if "--planner-profile" in ns.cluster_args:
        p.error("give the cluster's profile as --planner-profile, not in --cluster-args (auto rates use it too)")
    for flag in ("prefill_heavy", "decode_heavy"):
        setattr(ns, flag, phase_traffic(p, flag, *getattr(ns, flag)))
    return ns


def parse_layout(p: argparse.ArgumentParser, text: str) -> tuple[int, int, int]:
    try:
        layout = tuple(int(x) for x in text.split(":"))
    except ValueError:
        layout = ()
    if len(layout) != 3 or min(layout) < 0 or not (layout[2] > 0 or min(layout[:2]) > 0):
        p.error(f"--layout {text!r}: P:D:N server counts, with a prefill and a decode server or a null one")
    return layout


def phase_traffic(p: argparse.ArgumentParser, flag: str, inp: str, out: str, rate: str) -> tuple:
    try:
        parsed = (int(inp), int(out), rate if rate == "auto" else float(rate))
    except ValueError:
        parsed = None
    if parsed is None or min(parsed[:2]) < 1 or (rate != "auto" and not (math.isfinite(parsed[2]) and parsed[2] > 0)):
        p.error(f"--{flag.replace('_', '-')}: IN and OUT are token counts, RATE requests/s (> 0) or auto")
    return parsed


def cluster_planner(cluster_args: str) -> PlannerConfig:
    """The planner `tidal cluster` runs with these --cluster-args (its defaults for the flags they lack)."""
    p = argparse.ArgumentParser(add_help=False)
    add_planner_args(p)
    known, _ = p.parse_known_args(shlex.split(cluster_args))
    return msgspec.structs.replace(planner_config_from_namespace(known), mode="sla")


def auto_rate(inp: int, out: int, cost: Any, cfg: PlannerConfig, headroom: float) -> float:
    """The arrival rate at which the layout the planner heads for from 1:1:1 is predicted to serve `headroom`
    times it. The bench's lengths are uniform over [0.8, 1] x the given ones."""
    traffic = Traffic(arrival_rate=1.0, mean_input_tokens=0.9 * inp, mean_output_tokens=0.9 * out, completed=1)
    start = {"prefill": 1, "decode": 1, "null": 1}
    best = best_layout(make_predictor(cfg, cost, start), start, PoolLoad([]), traffic, cfg.min_per_pool)
    if best is None or not best.capacity:
        raise SystemExit(f"live_shift: no layout serves {inp}/{out} tokens by the profile; give RATE")
    return round(best.capacity / headroom, 3)


def resolve_rates(ns: argparse.Namespace) -> None:
    """Replace every auto RATE by `auto_rate` under --planner-profile and the cluster's planner flags."""
    if "auto" not in (ns.prefill_heavy[2], ns.decode_heavy[2]):
        return
    cost = load_cost_model(ns.planner_profile)
    cfg = cluster_planner(ns.cluster_args)
    for flag in ("prefill_heavy", "decode_heavy"):
        inp, out, rate = getattr(ns, flag)
        if rate == "auto":
            setattr(ns, flag, (inp, out, auto_rate(inp, out, cost, cfg, ns.rate_headroom)))


def cluster_cmd(ns: argparse.Namespace) -> list[str]:
    prefill, decode, null = ns.layout
    return [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", str(prefill), "--decode", str(decode),
            "--worker", str(null), "--planner", ns.planner, "--planner-profile", ns.planner_profile,
            "--port", str(ns.port), "--base-port", str(ns.port + 1), "--bootstrap-base-port", str(ns.port + 10),
            *shlex.split(ns.cluster_args)]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tidal cluster exited with {proc.returncode}")
        try:
            if httpx.get(url + "/planner/status", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("cluster not ready")


def merge_decisions(seen: dict[float, dict], decisions: list[dict], t: float, t0: float = 0.0) -> None:
    """Add the decisions of one /planner/status (the last 50) to `seen`, keyed by the planner's clock, kind
    and worker (one interval may hold several moves and a hold): seen_t is when one was first polled, at_s
    when it was taken (both from t0, the run's start); a move's outcome is updated on later polls."""
    for d in decisions:
        key = (d["at"], d["kind"], d.get("url") or "")
        rec = seen.setdefault(key, {"seen_t": t, "kind": d["kind"], "reason": d["reason"]})
        if "at_unix" in d:
            rec["at_s"] = round(d["at_unix"] - t0, 3)
        if d["kind"] == "move":
            rec.update(url=d["url"], src=d["src"], dst=d["dst"], outcome=d["outcome"],
                       timings_ms=d.get("timings_ms") or {}, worker_message=d.get("worker_message") or "")


def track_handover(handovers: list[dict], worker: str, status: dict, t: float) -> None:
    """A worker's handover from its /admin/disaggregation_status polls: opened when one shows HANDOVER, closed
    (with the worker's own `handover` ms) at the first poll after it that does not."""
    open_one = next((h for h in handovers if h["url"] == worker and h["ended_t"] is None), None)
    if status.get("transition_state") == "HANDOVER":
        if open_one is None:
            handovers.append({"url": worker, "mode": status.get("current_mode"), "seen_t": t, "ended_t": None,
                              "handover_ms": None})
    elif open_one is not None:
        open_one["ended_t"] = t
        open_one["handover_ms"] = (status.get("last_switch_timings_ms") or {}).get("handover")


class Poller(threading.Thread):
    """GET /planner/status every poll_s: the pool sizes, and every decision once (keyed by the planner's
    clock; seen_t is the first poll that showed it; a move's outcome is updated until it drops off)."""

    def __init__(self, url: str, poll_s: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.url, self.poll_s, self.t0 = url, poll_s, t0
        self.pools: list[dict] = []
        self.decisions: dict[tuple, dict] = {}
        self.handovers: list[dict] = []  # each worker's handover: first seen, seen ended, its own length
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(self.poll_s)
        self.poll()

    def poll(self) -> None:
        try:
            st = httpx.get(self.url + "/planner/status", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return
        t = round(time.time() - self.t0, 1)
        traffic = st["traffic"]
        self.pools.append({"t": t, **{m: len(st["pools"][m]) for m in MODES}, "moving": len(st["moving"]),
                           "rate": round(traffic.get("arrival_rate", 0.0), 3),
                           "in": round(traffic.get("mean_input_tokens", 0.0)),
                           "out": round(traffic.get("mean_output_tokens", 0.0)),
                           "peak": round(traffic.get("prefill_peak_ratio", 1.0), 2)})
        merge_decisions(self.decisions, st["decisions"], t, self.t0)
        for worker in sorted({u for m in MODES for u in st["pools"][m]}):
            try:
                ws = httpx.get(worker + "/admin/disaggregation_status", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            # the worker's own time: on a loaded host its answer can come seconds after the planner's
            track_handover(self.handovers, worker, ws, round(time.time() - self.t0, 1))


def bench_phase(ns: argparse.Namespace, kind: str, k: int, out_dir: str, start_s: float) -> tuple[dict, list[dict]]:
    """The phase's summary, and its request records with `start` from the run's start (the phase began at
    start_s) and the phase's number."""
    inp, out, rate = ns.prefill_heavy if kind == "prefill" else ns.decode_heavy
    path = os.path.join(out_dir, f"phase{k}_{kind}.json")
    cmd = [sys.executable, "-m", "tidal.cli", "bench", "--url", f"http://127.0.0.1:{ns.port}", "--dataset", "random",
           "--random-input-len", str(int(inp)), "--random-output-len", str(int(out)), "--random-range-ratio", "0.8",
           "--request-rate", str(rate), "--num-prompts", str(max(1, int(rate * ns.phase_s))),
           "--warmup-requests", "0", "--seed", str(k + 1), "--disable-tqdm", "--output-file", path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        res = json.load(f)
    summary = {"phase": k, "kind": kind, "input": int(inp), "output": int(out), "rate": rate,
               "requests": res["num_requests"], "failed": res["failed"],
               "errors": sorted({r["error"] for r in res["requests"] if r["error"]})[:3],
               "ttft_p50_ms": res["ttft_ms"]["p50"], "tpot_p50_ms": res["tpot_ms"]["p50"],
               "ttft_p90_ms": res["ttft_ms"]["p90"], "tpot_p90_ms": res["tpot_ms"]["p90"]}
    return summary, phase_records(res["requests"], k, start_s)


def phase_records(records: list[dict], k: int, start_s: float) -> list[dict]:
    return [{**r, "start": round(start_s + r["start"], 6), "phase": k} for r in records]


def slo_attainment(records: list[dict], cfg: PlannerConfig) -> float:
    """The share of the requests that succeeded within both of the planner's SLOs (TTFT, and TPOT where an
    answer has more than one token), as `tidal bench --goodput` counts them."""
    if not records:
        return 0.0
    slos = {"ttft": cfg.ttft_slo_s * 1000, "tpot": cfg.tpot_slo_s * 1000}
    fields = RequestRecord.__dataclass_fields__
    met = sum(meets_slos(RequestRecord(**{k: v for k, v in r.items() if k in fields}), slos) for r in records)
    return round(met / len(records), 4)


def pool_changes(pools: list[dict]) -> list[dict]:
    """The polls where the P/D/N/moving counts changed (and the first and last)."""
    out = []
    for i, p in enumerate(pools):
        key = tuple(p[m] for m in (*MODES, "moving"))
        if i == 0 or i == len(pools) - 1 or key != tuple(out[-1][m] for m in (*MODES, "moving")):
            out.append(p)
    return out


def print_tables(result: dict) -> None:
    print("| t (s) | P | D | N | moving | phase |\n|---|---|---|---|---|---|")
    for p in pool_changes(result["pools"]):
        print(f"| {p['t']:.0f} | {p['prefill']} | {p['decode']} | {p['null']} | {p['moving']} | {p.get('phase', '')} |")
    print("\n| phase | kind | in/out tokens | rate | requests | failed | TTFT p50 (ms) | TPOT p50 (ms) | SLOs met |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for ph in result["phases"]:
        print(f"| {ph['phase']} | {ph['kind']} | {ph['input']}/{ph['output']} | {ph['rate']} | {ph['requests']} | "
              f"{ph['failed']} | {ph['ttft_p50_ms']:.0f} | {ph['tpot_p50_ms']:.1f} | {ph['slo_met']:.3f} |")
    print(f"\nSLOs met over the run: {result['slo_met']:.3f} of {len(result['requests'])} requests")
    for m in result["moves"]:
        took = "".join(f", {k} {v:.0f} ms" for k, v in (m.get("timings_ms") or {}).items())
        said = f"; the worker: {m['worker_message']}" if m.get("worker_message") else ""
        print(f"move at {m['seen_t']} s: {m['src']} -> {m['dst']} ({m['outcome']}{took}): {m['reason']}{said}")
    for h in result.get("handovers", []):
        print(f"handover of {h['url']} to {h['mode']}: seen at {h['seen_t']} s, ended by {h['ended_t']} s, "
              f"{h['handover_ms']} ms by the worker")


def main(argv=None) -> int:
    ns = parse_args(argv)
    resolve_rates(ns)
    slos = cluster_planner(ns.cluster_args)
    print(f"phases at {ns.prefill_heavy[2]}/s (prefill-heavy) and {ns.decode_heavy[2]}/s (decode-heavy)", flush=True)
    url = f"http://127.0.0.1:{ns.port}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the cluster is stopped below
    log = open(os.path.splitext(ns.output)[0] + ".cluster.log", "w")
    proc = subprocess.Popen(cluster_cmd(ns), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, proc)
        t0 = time.time()
        poller = Poller(url, ns.poll_s, t0)
        poller.start()
        phases, marks, requests = [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            for k, kind in enumerate(ns.phases.split(",")):
                marks.append((time.time() - t0, k))
                summary, records = bench_phase(ns, kind, k, tmp, marks[-1][0])
                summary["slo_met"] = slo_attainment(records, slos)
                phases.append({**summary, "start_s": round(marks[-1][0], 1), "end_s": round(time.time() - t0, 1)})
                requests += records
        poller.stop.set()
        poller.join(30)
        final = httpx.get(url + "/planner/status", timeout=10).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
    for p in poller.pools:
        p["phase"] = max((k for s, k in marks if s <= p["t"]), default=0)
    result = {"command": cluster_cmd(ns), "phases": phases, "pools": poller.pools,
              "moves": [d for _, d in sorted(poller.decisions.items()) if d["kind"] == "move"],
              "decisions": [d for _, d in sorted(poller.decisions.items())],
              "final_pools": {m: len(final["pools"][m]) for m in MODES}, "planner_config": final["config"],
              "failed_total": sum(p["failed"] for p in phases), "handovers": poller.handovers,
              "slo_met": slo_attainment(requests, slos), "requests": requests}
    with open(ns.output, "w") as f:
        json.dump(result, f, indent=1)
    print_tables(result)
    return 0 if result["failed_total"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
