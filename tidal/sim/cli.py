"""`tidal sim` (one simulated run) and `tidal sim goodput` (the goodput comparison)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, NoReturn, Optional

import msgspec

from tidal.config import ServerArgs
from tidal.planner.decide import floor_warning, has_path
from tidal.planner.flags import add_planner_args, planner_config_from_namespace
from tidal.profile.cost import flat_curves, prefill_extrapolation
from tidal.profile.schema import profile_error
from tidal.router.policies import POLICIES
from tidal.sim.engine import Cluster, SimConfig
from tidal.sim.instance import Limits
from tidal.sim.report import plot, report
from tidal.sim.workload import (CLOCKS, EVEN, PHASE_MIXES, WORKLOADS, WorkloadSpec, check, clock_of,
                                even_phase_rate_ratio, make_workload, phase_period, virtual_span)

# flags only one action, or the workloads with phases, read (dest: default): set elsewhere they are refused, not
# ignored
GOODPUT_ONLY = {"target_attainment": 0.9, "rate_tolerance": 0.03, "rate_samples": 1, "split_step": 1,
                "layouts": "colocated,static,planner"}
CALIBRATE_ONLY = {"moves": "live", "tolerance": 0.25}
PHASED_ONLY = {"phase_s": 120.0, "phase_rate_ratio": 1.0}

DEFAULT_PROFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profile", "data",
                               "smollm2_cpu_2core.json")


def add_sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=("run", "goodput", "calibrate"), default="run",
                   help="run: one simulated run; goodput: the highest rate meeting the SLOs, for colocated, "
                        "every static P:D split and the planner; calibrate: replay a live `tidal bench` run "
                        "(--bench-json) and compare its TTFT/TPOT with the simulation's (default: run)")
    p.add_argument("--instances", type=int, default=16, help="simulated servers (default: 16)")
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill servers at the start (default: half of those not --null)")
    p.add_argument("--decode", type=int, default=None, help="decode servers at the start (default: the rest)")
    p.add_argument("--null", type=int, default=0, help="null (colocated) servers at the start (default: 0)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="the `tidal profile` JSON giving every step's cost (default: the shipped "
                        "tidal/profile/data/smollm2_cpu_2core.json); the planner uses it too unless "
                        "--planner-profile is given")
    p.add_argument("--workload", choices=WORKLOADS, default="azure-code",
                   help="azure-code|azure-conv: the Azure LLM inference trace 2023; shift: synthetic code-like and "
                        "chat-like phases; azure-shift: the two traces alternating (default: azure-code)")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="an Azure trace CSV for azure-code/azure-conv (default: the copy shipped in tidal/bench/data)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="arrival rate multiplier: the trace's clock is divided by it (default: 1)")
    p.add_argument("--duration-s", type=float, default=300.0,
                   help="on the trace clock: seconds of workload at rate scale 1 (the run's arrivals span "
                        "duration / rate scale virtual seconds); on the wall clock: virtual seconds at every rate "
                        "(default: 300)")
    p.add_argument("--phase-s", type=float, default=PHASED_ONLY["phase_s"],
                   help="shift / azure-shift: seconds per phase, on the --clock (default: 120)")
    p.add_argument("--clock", "--phase-clock", dest="clock", choices=CLOCKS, default=None,
                   help="wall: --phase-s and --duration-s are virtual seconds at every rate (a shifting mix shifts "
                        "every phase-s seconds of the cluster's time; a higher rate brings more requests: a single "
                        "trace replays rate scale x duration seconds of itself, wrapping around its end); trace: "
                        "seconds of workload at rate scale 1, divided by the rate scale (the same requests at every "
                        "rate, a shorter run and shorter phases at higher rates) (default: wall for shift and "
                        "azure-shift, trace for azure-code and azure-conv)")
    p.add_argument("--phase-rate-ratio", type=phase_rate_ratio_arg, default=PHASED_ONLY["phase_rate_ratio"],
                   help="shift / azure-shift: the chat phases run this many times as fast as the code phases "
                        "(azure-shift replays ratio x as much of the conversation trace per phase), so "
                        "that both kinds of phase can load the cluster alike; 'even': both kinds of phase at "
                        "the same mean request rate (azure-shift: the code trace's mean rate over the "
                        "conversation trace's, 0.4641 on the shipped traces) (default: 1)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="prompt and output token counts multiplied by this (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed (synthetic arrivals, random policies) (default: 0)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="the router's load-balancing policy in every pool (default: cache_aware)")
    d = ServerArgs()
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help=f"per server, as `tidal serve` (default: {d.chunked_prefill_size})")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help=f"per server, as `tidal serve` (default: {d.max_running_requests})")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help=f"per server, as `tidal serve` (default: {d.max_prefill_tokens})")
    p.add_argument("--output", default=None, metavar="PATH", help="write the JSON report here (default: stdout)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="run: a PNG of pools over time and latency vs SLO (default: none)")
    p.add_argument("--host-cores", type=float, default=None,
                   help="all instances share one host with this many cores: while more instances compute at once "
                        "than the cores hold (each with the profile's torch threads), their steps stretch "
                        "(processor sharing) (default: none, every instance has its own cores)")
    c = p.add_argument_group("calibrate")
    c.add_argument("--bench-json", default=None, metavar="PATH",
                   help="the `tidal bench --output-file` JSON of the live run to replay (default: none; required "
                        "by calibrate, whose layout is --null/--prefill/--decode: prefill and decode not given are 1 "
                        "each, or 0 each where only --null is given, a colocated run)")
    c.add_argument("--moves", choices=("live", "planner"), default=CALIBRATE_ONLY["moves"],
                   help="a live run whose workers moved (scripts/live_shift.py's JSON): replay its moves at their "
                        "live start times (live), or let the simulator's planner decide with the live router's "
                        "planner settings (planner) (default: live; a run without moves replays none)")
    c.add_argument("--tolerance", type=float, default=CALIBRATE_ONLY["tolerance"],
                   help="calibrate passes (exit 0, else 1) when the simulated TTFT and TPOT p50 are within this "
                        "relative error of the live ones (default: 0.25)")
    g = p.add_argument_group("goodput search")
    g.add_argument("--target-attainment", type=float, default=GOODPUT_ONLY["target_attainment"],
                   help="fraction of requests meeting both SLOs that counts as good (default: 0.9, DistServe's)")
    g.add_argument("--rate-tolerance", type=float, default=GOODPUT_ONLY["rate_tolerance"],
                   help="the rate multipliers searched are powers of 1 + this: the search's precision (default: 0.03)")
    g.add_argument("--rate-samples", type=int, default=GOODPUT_ONLY["rate_samples"],
                   help="each probe pools this many runs at rates spread evenly over 0.5%% around it (one "
                        "attainment over all their requests): near its goodput a planner's attainment moves by "
                        "tens of points with a change of the rate as small as 1e-9, so one run is one sample of a "
                        "noisy curve (default: 1, one run at the probe's rate)")
    g.add_argument("--split-step", type=int, default=GOODPUT_ONLY["split_step"],
                   help="static splits tried: every this-many prefill counts, then around the best one at half "
                        "the step, a quarter, ... 1 (default: 1, every split)")
    g.add_argument("--layouts", default=GOODPUT_ONLY["layouts"],
                   help="which of colocated, static (the splits), planner, phases (--phase-layouts), lookahead (a "
                        "planner that sees the future, --lookahead-splits) to search "
                        "(default: colocated,static,planner)")
    k = p.add_argument_group("lookahead: a planner that sees the future (simulator only)")
    k.add_argument("--lookahead", action="store_true",
                   help="run: instead of the planner, every --lookahead-interval-s head for the split whose copy of "
                        "the cluster has missed the fewest requests --lookahead-horizon-s later (goodput: "
                        "--layouts lookahead): what knowing the arrivals ahead is worth, paying drains and switches "
                        "like any move")
    k.add_argument("--lookahead-splits", default=LOOKAHEAD_ONLY["lookahead_splits"], metavar="P,P,...",
                   help="the prefill counts of the splits it tries (default: every split up to 16 instances; beyond, "
                        "every instances/16-th and the last)")
    k.add_argument("--lookahead-interval-s", type=float, default=LOOKAHEAD_ONLY["lookahead_interval_s"],
                   help="seconds between looks (default: 10)")
    k.add_argument("--lookahead-horizon-s", type=float, default=LOOKAHEAD_ONLY["lookahead_horizon_s"],
                   help="how far each look runs its copies (default: 30)")
    k.add_argument("--lookahead-forecast", choices=("trace", "recent"), default=LOOKAHEAD_ONLY["lookahead_forecast"],
                   help="the arrivals each copy runs on: trace (the future itself) or recent (the last horizon's "
                        "arrivals again: a planner that simulates its candidates on the traffic it has seen) "
                        "(default: trace)")
    k.add_argument("--jobs", type=int, default=LOOKAHEAD_ONLY["jobs"],
                   help="copies run at once (forked processes) (default: the CPUs this process may use)")
    p.add_argument("--phase-layouts", default=None, metavar="P:D:N,P:D:N",
                   help="instead of the planner, head for these layouts (prefill:decode:null workers) in turn, one "
                        "per workload phase (shift, azure-shift), every move at once from the phase's start: what a "
                        "planner that knew the phases could do, paying the same drains and switches "
                        "(default: none)")
    add_planner_args(p, profile_help="the `tidal profile` JSON the planner predicts with (default: --profile's; "
                                     "another to simulate a planner whose cost model is off)")


# the flags only a lookahead reads, and their defaults
LOOKAHEAD_ONLY = {"lookahead_splits": None, "lookahead_interval_s": 10.0, "lookahead_horizon_s": 30.0,
                  "lookahead_forecast": "trace", "jobs": None}
LAYOUT_NAMES = ("colocated", "static", "planner", "phases", "lookahead")


def fail(message: str) -> NoReturn:
    sys.stderr.write(f"tidal sim: error: {message}\n")
    raise SystemExit(2)


def layout_names(ns: argparse.Namespace) -> list[str]:
    """The entries of --layouts, spaces around the commas ignored."""
    return [x.strip() for x in ns.layouts.split(",")]


def static_layouts(ns: argparse.Namespace) -> list[tuple[int, int]]:
    """The PREFILL:DECODE entries of --layouts (static splits searched one by one)."""
    out = []
    for name in layout_names(ns):
        if name in LAYOUT_NAMES:
            continue
        try:
            p, d = (int(x) for x in name.split(":"))
        except ValueError:
            fail(f"--layouts: {name!r} is none of {', '.join(LAYOUT_NAMES)} and not PREFILL:DECODE")
        if min(p, d) < 1 or p + d > ns.instances:
            fail(f"--layouts: {name!r} needs a prefill and a decode worker and at most --instances {ns.instances}")
        out.append((p, d))
    return out


def lookahead_splits(ns: argparse.Namespace) -> tuple[int, ...]:
    """The prefill counts of --lookahead-splits, or by default every split (beyond 16 instances every
    instances/16-th, and the last)."""
    n = ns.instances
    if ns.lookahead_splits is None:
        step = max(1, n // 16)
        return tuple(sorted(set(range(step, n, step)) | {n - 1})) if n > 1 else ()
    out = set()
    for item in ns.lookahead_splits.split(","):
        try:
            p = int(item.strip())
        except ValueError:
            fail(f"--lookahead-splits: {item.strip()!r} is not a number of prefill workers")
        if not 1 <= p < n:
            fail(f"--lookahead-splits: {p} leaves no prefill or no decode worker of --instances {n}")
        out.add(p)
    return tuple(sorted(out))


def check_args(ns: argparse.Namespace) -> None:
    """Bad flags as one line and exit status 2, before anything runs."""
    if ns.instances < 1:
        fail("--instances must be >= 1")
    for name in ("null", "prefill", "decode"):
        if getattr(ns, name) is not None and getattr(ns, name) < 0:
            fail(f"--{name} must be >= 0")
    if ns.host_cores is not None and ns.host_cores <= 0:
        fail("--host-cores must be > 0 (leave it out: every instance has its own cores)")
    if not 0 < ns.target_attainment <= 1:
        fail("--target-attainment must be in (0, 1]")
    for flag, value in (("--rate-tolerance", ns.rate_tolerance), ("--tolerance", ns.tolerance)):
        if not value > 0:
            fail(f"{flag} must be > 0")
    for flag, value in (("--split-step", ns.split_step), ("--max-prefill-tokens", ns.max_prefill_tokens),
                        ("--rate-samples", ns.rate_samples)):
        if value < 1:
            fail(f"{flag} must be >= 1")
    for action, flags in (("goodput", GOODPUT_ONLY), ("calibrate", CALIBRATE_ONLY)):
        given = flags_given(ns, flags)
        if given and ns.action != action:
            fail(f"{', '.join(given)}: read by `tidal sim {action}` only")
    phased = flags_given(ns, PHASED_ONLY)
    if phased and ns.action != "calibrate" and ns.workload not in PHASE_MIXES:
        fail(f"{', '.join(phased)}: {ns.workload} has no phases ({', '.join(PHASE_MIXES)} have)")
    if ns.action == "goodput" and "phases" in layout_names(ns) and not ns.phase_layouts:
        fail("--layouts phases needs --phase-layouts")
    try:
        limits(ns)
        planner_config_from_namespace(ns)
    except ValueError as e:  # a simulated server has the default page size: no --page-size to name
        fail(str(e).replace("--page-size (", "the page size ("))
    for flag, path in (("--output", ns.output), ("--plot", ns.plot)):
        if path:
            check_writable(flag, path)
    if ns.plot and os.path.splitext(ns.plot)[1].lower() not in PLOT_SUFFIXES:
        fail(f"--plot {ns.plot}: name a {', '.join(PLOT_SUFFIXES)} file")
    if ns.trace and ns.workload not in ("azure-code", "azure-conv"):
        fail(f"--trace replays one Azure trace: --workload azure-code or azure-conv, not {ns.workload} "
             "(azure-shift takes the shipped traces)")
    if ns.trace and not os.path.exists(ns.trace):
        fail(f"--trace {ns.trace}: not found (an Azure trace CSV, or the directory holding it)")
    if ns.plot and ns.action != "run":
        fail("--plot draws one run: `tidal sim run`")
    if ns.bench_json and ns.action != "calibrate":
        fail("--bench-json is read by `tidal sim calibrate` only")
    if ns.action == "calibrate" and ns.planner != "static":
        fail("calibrate replays the live run's layout as it was: leave --planner out")
    if ns.action == "calibrate" and not ns.bench_json:
        fail("calibrate needs --bench-json, a `tidal bench --output-file` JSON")
    if ns.action == "calibrate" and not os.path.isfile(ns.bench_json):
        fail(f"--bench-json {ns.bench_json}: not found")
    static_layouts(ns)
    lookahead_splits(ns)
    for flag, value in (("--lookahead-interval-s", ns.lookahead_interval_s),
                        ("--lookahead-horizon-s", ns.lookahead_horizon_s)):
        if not value > 0:
            fail(f"{flag} must be > 0")
    if ns.jobs is not None and ns.jobs < 1:
        fail("--jobs must be >= 1")
    if ns.lookahead and ns.action == "run" and (ns.planner != "static" or ns.phase_layouts):
        fail("--lookahead replaces the planner in a run: leave --planner and --phase-layouts out")
    if ns.lookahead and ns.action != "run":
        fail("--lookahead is for one run; `tidal sim goodput` searches it with --layouts lookahead")
    looks = (ns.lookahead and ns.action == "run") or (ns.action == "goodput" and "lookahead" in layout_names(ns))
    given = lookahead_only_flags_given(ns)
    if given and not looks:
        fail(f"{', '.join(given)}: no lookahead runs (add --lookahead to a run, lookahead to goodput's --layouts)")
    if ns.instances < 2 and looks:
        fail("the lookahead tries prefill:decode splits: it needs --instances 2 or more")
    if ns.phase_layouts is not None:
        if not phase_layouts(ns):
            fail("--phase-layouts: no layout given (P:D:N,P:D:N, one per phase)")
        if ns.workload not in PHASE_MIXES:
            fail(f"--phase-layouts needs a workload with phases ({', '.join(PHASE_MIXES)}), not {ns.workload}")
        if ns.action == "run" and ns.planner != "static":
            fail("--phase-layouts replaces the planner in a run: leave --planner out")


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_writable(flag: str, path: str) -> None:
    """The report can be written at `path`: checked before a run that may take minutes, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        fail(f"{flag} {path}: no directory {folder}")
    if os.path.isdir(path):
        fail(f"{flag} {path}: is a directory; name a file")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        fail(f"{flag} {path}: not writable")


def layout(ns: argparse.Namespace) -> tuple[int, int, int]:
    n, k = ns.instances, ns.null
    p, d = ns.prefill, ns.decode
    if p is None and d is None:
        p = (n - k) // 2
    if p is None:
        p = n - k - d
    if d is None:
        d = n - k - p
    if ns.prefill is not None and ns.decode is None and k + p > n:
        fail(f"--null {k} + --prefill {p} are more than --instances {n}")
    if ns.decode is not None and ns.prefill is None and k + d > n:
        fail(f"--null {k} + --decode {d} are more than --instances {n}")
    if min(n, k, p, d) < 0 or k + p + d != n:
        fail(f"--null {k} + --prefill {p} + --decode {d} must add up to --instances {n}, none below 0")
    if not has_path({"null": k, "prefill": p, "decode": d}):
        fail(f"the layout {p}:{d} (+ {k} null) serves no request: it needs a null server (--null), or a prefill and "
             "a decode server (--prefill, --decode)")
    return k, p, d


def load_cost(path: str, flag: str = "--profile") -> Any:
    from tidal.profile.cost import CostModel

    try:
        return CostModel.from_file(path)
    except (OSError, ValueError) as e:  # ProfileFormatError is a ValueError, its message names the file
        fail(profile_error(flag, path, e))


def phase_rate_ratio_arg(text: str) -> Any:
    """--phase-rate-ratio: a number, or EVEN (resolved per workload by `workload_spec`)."""
    if text.strip().lower() == EVEN:
        return EVEN
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor {EVEN!r}") from None


def workload_spec(ns: argparse.Namespace, rate_scale: Optional[float] = None) -> WorkloadSpec:
    ratio = even_phase_rate_ratio(ns.workload) if ns.phase_rate_ratio == EVEN else ns.phase_rate_ratio
    spec = WorkloadSpec(name=ns.workload, rate_scale=ns.rate_scale if rate_scale is None else rate_scale,
                        duration_s=ns.duration_s, phase_s=ns.phase_s, length_scale=ns.length_scale,
                        trace=ns.trace, seed=ns.seed, phase_rate_ratio=ratio, clock=ns.clock)
    return dataclasses.replace(spec, clock=clock_of(spec))


def limits(ns: argparse.Namespace) -> Limits:
    args = ServerArgs(chunked_prefill_size=ns.chunked_prefill_size, max_running_requests=ns.max_running_requests,
                      max_prefill_tokens=ns.max_prefill_tokens)
    args.validate()
    return Limits(args)


def phase_layouts(ns: argparse.Namespace) -> tuple[dict, ...]:
    """--phase-layouts as {mode: workers} dicts, each adding up to --instances."""
    out = []
    for item in (ns.phase_layouts or "").split(","):
        if not item.strip():
            continue
        try:
            p, d, n = (int(x) for x in item.split(":"))
        except ValueError:
            fail(f"--phase-layouts: {item!r} is not PREFILL:DECODE:NULL")
        lay = {"prefill": p, "decode": d, "null": n}
        if min(p, d, n) < 0 or p + d + n != ns.instances or not has_path(lay):
            fail(f"--phase-layouts: {item!r} must be counts of 0 or more adding up to --instances {ns.instances}, "
                 "with a null worker or a prefill and a decode one")
        out.append(lay)
    return tuple(out)


def simulate(ns: argparse.Namespace, null: int, prefill: int, decode: int, mode: str, rate_scale: float,
             cost: Any, planner_cost: Any = None, stop_after_miss: Optional[float] = None,
             trace: Optional[list] = None) -> Cluster:
    """One run; mode: static, sla (the planner), phases (--phase-layouts) or lookahead (--lookahead-splits). `trace`:
    these requests instead of the workload's."""
    schedule = phase_layouts(ns) if mode == "phases" else ()
    look = lookahead_splits(ns) if mode == "lookahead" else ()
    spec = workload_spec(ns, rate_scale)
    planner = msgspec.structs.replace(planner_config_from_namespace(ns),
                                      mode="static" if schedule or look else mode)
    cfg = SimConfig(null=null, prefill=prefill, decode=decode, planner=planner, policy=ns.policy, seed=ns.seed,
                    stop_after_miss_fraction=stop_after_miss, host_cores=ns.host_cores,
                    instance_threads=cost.profile.server.torch_threads or 1, phase_layouts=schedule,
                    phase_period_s=phase_period(spec), lookahead_splits=look,
                    lookahead_interval_s=ns.lookahead_interval_s, lookahead_horizon_s=ns.lookahead_horizon_s,
                    lookahead_jobs=ns.jobs or len(os.sched_getaffinity(0)), lookahead_forecast=ns.lookahead_forecast)
    trace = make_workload(spec) if trace is None else trace
    return Cluster(cfg, cost, trace, limits(ns), planner_cost=planner_cost).run()


def run_config(ns: argparse.Namespace) -> dict:
    k, p, d = layout(ns)
    return {"instances": ns.instances, "null": k, "prefill": p, "decode": d,
            "planner": "phases" if ns.phase_layouts else "lookahead" if ns.lookahead else ns.planner,
            "phase_layouts": ns.phase_layouts,
            "ttft_slo_ms": ns.ttft_slo_ms, "tpot_slo_ms": ns.tpot_slo_ms, "profile": os.path.basename(ns.profile),
            "workload": dataclasses.asdict(workload_spec(ns)), "policy": ns.policy,
            "limits": vars(limits(ns)), "host_cores": ns.host_cores, "simulated": True,
            "planner_flags": planner_flags(ns), "lookahead": lookahead_flags(ns) if ns.lookahead else None}


def flags_given(ns: argparse.Namespace, defaults: dict) -> list[str]:
    """The flags among `defaults` (dest: default) that this command line sets to another value."""
    return [f"--{dest.replace('_', '-')}" for dest, default in defaults.items() if getattr(ns, dest) != default]


def lookahead_only_flags_given(ns: argparse.Namespace) -> list[str]:
    """The flags only a lookahead reads that this command line sets."""
    return flags_given(ns, LOOKAHEAD_ONLY)


def lookahead_flags(ns: argparse.Namespace) -> dict:
    """What a lookahead run tried, for its report."""
    return {"splits": list(lookahead_splits(ns)), "interval_s": ns.lookahead_interval_s,
            "horizon_s": ns.lookahead_horizon_s, "forecast": ns.lookahead_forecast}


def planner_flags(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in sorted(vars(ns).items()) if k.startswith("planner_")}


def write_json(obj: Any, path: Optional[str]) -> None:
    data = msgspec.json.format(msgspec.json.encode(obj), indent=2)
    if path:
        try:
            with open(path, "wb") as f:
                f.write(data + b"\n")
        except OSError as e:
            fail(f"--output {path}: {e.strerror or e}")
    else:
        sys.stdout.write(data.decode() + "\n")


def extrapolation_warnings(cost: Any, trace: list) -> list[str]:
    """Where the workload's prompts take the cost model past twice what its profile measured (the run's numbers
    rest on its linear extrapolation there)."""
    warning = prefill_extrapolation(cost.profile, max(t.input_tokens for t in trace))
    return [warning.replace("the prompts", "the workload's prompts")] if warning else []


def decode_batch_warning(cost: Any, largest_batch: int) -> Optional[str]:
    """Where the runs' decode steps went past twice the profile's largest measured batch (known after a run)."""
    batches = {x.batch for x in cost.profile.decode}
    measured = max(batches)
    if len(batches) > 1 and largest_batch > 2 * measured:  # one batch measured: no line (flat_curves says so)
        return (f"warning: decode steps were measured up to batch {measured}; the simulated servers ran batches of "
                f"up to {largest_batch}; the cost model extrapolates")
    return None


def check_workload(ns: argparse.Namespace, spec: WorkloadSpec, cost: Any) -> None:
    """A workload with requests (a malformed --trace is a TraceFormatError), and a warning for each place where
    it takes the cost model past what the profile measured."""
    try:
        trace = make_workload(spec)
    except ValueError as e:
        fail(str(e))
    if not trace:
        fail(f"the workload has no request in its first {ns.duration_s:g} s"
             + (f" (--trace {ns.trace})" if ns.trace else ""))
    for warning in extrapolation_warnings(cost, trace):
        sys.stderr.write(f"warning: --profile {ns.profile}: {warning}; the cost model extrapolates\n")
    flat = flat_curves(cost.profile)
    if flat:
        sys.stderr.write(f"warning: --profile {ns.profile}: {flat}\n")


def warn_decode_batch(ns: argparse.Namespace, cost: Any, largest_batch: int) -> None:
    warning = decode_batch_warning(cost, largest_batch)
    if warning is not None:
        sys.stderr.write(warning.replace("warning: ", f"warning: --profile {ns.profile}: ", 1) + "\n")


def warn_floor(ns: argparse.Namespace) -> None:
    """Where the planner runs, a starting pool below --planner-min-per-pool."""
    if ns.action == "goodput":
        planner_runs = "planner" in layout_names(ns)
    else:
        planner_runs = ns.planner == "sla" and not ns.phase_layouts
    if planner_runs:
        k, p, d = layout(ns)
        warning = floor_warning({"null": k, "prefill": p, "decode": d}, ns.planner_min_per_pool)
        if warning:
            sys.stderr.write(f"warning: {warning}\n")


# above it a lookahead's cost is warned of: each virtual second simulated this many times over
LOOKAHEAD_WORK_WARNED = 100


def warn_lookahead_work(ns: argparse.Namespace) -> None:
    """A lookahead simulates each virtual second about horizon / interval times per split it tries: a long
    horizon, short interval or many splits multiply a run's time by as much (over --jobs copies at once)."""
    if not ((ns.lookahead and ns.action == "run") or (ns.action == "goodput" and "lookahead" in layout_names(ns))):
        return
    splits = len(lookahead_splits(ns))
    times = ns.lookahead_horizon_s / ns.lookahead_interval_s * splits
    if times > LOOKAHEAD_WORK_WARNED:
        sys.stderr.write(f"warning: the lookahead simulates each virtual second ~{times:.0f} times (--lookahead-horizon-s "
                         f"{ns.lookahead_horizon_s:g} / --lookahead-interval-s {ns.lookahead_interval_s:g} x {splits} "
                         f"splits): a run takes as many times a plain one's, over the copies run at once\n")


OVERLOADED_ATTAINMENT = 0.5  # below it a run's summary line is followed by a hint


def one_line(s: dict, moves: int) -> str:
    """The run at a glance, for stderr: the JSON report can be long."""
    met = "n/a" if s["slo_attainment"] is None else f"{s['slo_attainment']:.1%}"

    def ms(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.0f} ms"

    return (f"tidal sim: {s['requests']} requests ({s['finished']} finished, {s['rejected']} rejected, "
            f"{s['unfinished']} unfinished), {met} met both SLOs; TTFT p50 {ms(s['ttft_ms']['p50'])}, "
            f"TPOT p50 {ms(s['tpot_ms']['p50'])}; {moves} move{'' if moves == 1 else 's'} (simulated)")


def run_sim(ns: argparse.Namespace) -> int:
    check_args(ns)
    spec = workload_spec(ns)
    try:
        check(spec)
    except ValueError as e:
        fail(str(e))
    cost = load_cost(ns.profile)
    planner_cost = load_cost(ns.planner_profile, "--planner-profile") if ns.planner_profile else None
    if ns.action != "calibrate":  # calibrate replays --bench-json, not the workload
        layout(ns)  # a bad --null/--prefill/--decode before the warnings below
        check_workload(ns, spec, cost)
        warn_floor(ns)
        warn_lookahead_work(ns)
    if ns.action == "calibrate":
        from tidal.sim.calibrate import run_calibrate

        return run_calibrate(ns, cost, limits(ns))
    if ns.action == "goodput":
        from tidal.sim.goodput import run_goodput, summary_lines

        out = run_goodput(ns, cost, planner_cost)
        write_json(out, ns.output)
        sys.stderr.write("".join(line + "\n" for line in summary_lines(out)))
        warn_decode_batch(ns, cost, max(r["largest_decode_batch"] for r in out["results"]))
        return 0
    k, p, d = layout(ns)
    config = run_config(ns)
    c = simulate(ns, k, p, d, config["planner"], ns.rate_scale, cost, planner_cost)
    mixes = PHASE_MIXES.get(ns.workload, ("", ""))
    phases = phase_period(spec) if ns.workload in PHASE_MIXES else None
    out = report(c, config, virtual_span(spec), phases, mixes)
    write_json(out, ns.output)
    sys.stderr.write(one_line(out["summary"], len(c.moves)) + "\n")
    warn_decode_batch(ns, cost, c.largest_decode_batch)
    met = out["summary"]["slo_attainment"]
    if met is not None and met < OVERLOADED_ATTAINMENT:
        sys.stderr.write("tidal sim: most requests missed an SLO: try a lower --rate-scale, or lengths and SLOs the "
                         "profile can meet (docs/elasticity.md's runs: --length-scale 0.25 --ttft-slo-ms 8000 "
                         "--tpot-slo-ms 200); `tidal sim goodput` finds the highest rate that meets them\n")
    if ns.plot:
        plot(c, ns.plot, f"tidal sim (simulated, profile {os.path.basename(ns.profile)}): {ns.workload}, "
                         f"{ns.instances} instances, planner {config['planner']}", phases, mixes, virtual_span(spec))
    return 0
