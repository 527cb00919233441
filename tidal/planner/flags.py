"""The planner's flags, shared by `tidal router` and `tidal cluster` (which passes them on)."""

from __future__ import annotations

import argparse

from tidal.planner.decide import MEETS_TODAY_GAIN
from tidal.planner.schema import DECODE_MOVES, MIN_INTERVAL_S, PLANNER_MODES, PlannerConfig

# (flag, namespace attribute) of every planner flag that takes a value, for the pass-through
VALUE_FLAGS = (("--planner", "planner"), ("--ttft-slo-ms", "ttft_slo_ms"), ("--tpot-slo-ms", "tpot_slo_ms"),
               ("--planner-interval-s", "planner_interval_s"), ("--planner-cooldown-s", "planner_cooldown_s"),
               ("--planner-worker-cooldown-s", "planner_worker_cooldown_s"),
               ("--planner-min-per-pool", "planner_min_per_pool"),
               ("--planner-max-concurrent-moves", "planner_max_concurrent_moves"),
               ("--planner-window-s", "planner_window_s"),
               ("--planner-burst-window-s", "planner_burst_window_s"), ("--planner-hysteresis", "planner_hysteresis"),
               ("--planner-decode-move", "planner_decode_move"),
               ("--planner-migrate-after-s", "planner_migrate_after_s"), ("--planner-profile", "planner_profile"))


PROFILE_HELP = ("a `tidal profile` JSON: predict with its cost model (default: none; then the planner scales the "
                "observed latencies by load)")


def add_planner_args(parser: argparse.ArgumentParser, profile_help: str = PROFILE_HELP) -> None:
    d = PlannerConfig()
    g = parser.add_argument_group("planner (moves workers between the prefill, decode and null pools)")
    g.add_argument("--planner", choices=PLANNER_MODES, default=d.mode,
                   help=f"static: the pools stay as given; sla: move workers toward the TTFT/TPOT SLOs; advise: "
                        f"decide as sla and report each move it would make (log, /planner/status, metrics) "
                        f"without making it (default: {d.mode})")
    g.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_s * 1000,
                   help=f"time-to-first-token SLO the planner aims for (default: {d.ttft_slo_s * 1000:g})")
    g.add_argument("--tpot-slo-ms", type=float, default=d.tpot_slo_s * 1000,
                   help=f"time-per-output-token SLO the planner aims for (default: {d.tpot_slo_s * 1000:g})")
    g.add_argument("--planner-interval-s", type=float, default=d.interval_s,
                   help=f"seconds between planner decisions, at least {MIN_INTERVAL_S:g} (default: {d.interval_s:g})")
    g.add_argument("--planner-cooldown-s", type=float, default=d.cooldown_s,
                   help=f"for this long after a move starts or ends, no move undoes it: none out of the pool it "
                        f"grew nor into the pool it shrank; moves the same way go on. It yields when overloaded, "
                        f"and when the prompts queued for prefill show another kind of mix than the move was "
                        f"decided on (default: {d.cooldown_s:g})")
    g.add_argument("--planner-worker-cooldown-s", type=float, default=None,
                   help="a moved worker does not move again for this long (default: 3x --planner-cooldown-s)")
    g.add_argument("--planner-min-per-pool", type=int, default=d.min_per_pool,
                   help=f"the prefill and decode pools never shrink below this many workers; the null pool "
                        f"may empty (default: {d.min_per_pool})")
    g.add_argument("--planner-max-concurrent-moves", type=int, default=d.max_concurrent_moves,
                   help=f"moves in flight at once (default: {d.max_concurrent_moves})")
    g.add_argument("--planner-window-s", type=float, default=d.window_s,
                   help=f"the sliding window of observed arrivals and latencies, seconds (default: {d.window_s:g})")
    g.add_argument("--planner-burst-window-s", type=float, default=d.burst_window_s,
                   help=f"how far back the arrivals' bursts are remembered (the prefill queues are predicted at "
                        f"the rate 90%% of prompts meet within a TTFT SLO), seconds; a shift of the mix of "
                        f"prompt and answer lengths starts the history again, with the peak of that mix's last history "
                        f"when the mix comes back (default: {d.burst_window_s:g})")
    g.add_argument("--planner-hysteresis", type=float, default=d.hysteresis,
                   help=f"the best layout must raise the predicted capacity (the arrival-rate multiple at which "
                        f"both SLOs hold) by this fraction before the planner heads for it (times "
                        f"sqrt(window / seconds seen) over the router's first window); "
                        f"{MEETS_TODAY_GAIN * 100:g}%% when it meets today's rate and the current layout does not "
                        f"(default: {d.hysteresis:g})")
    g.add_argument("--planner-decode-move", choices=DECODE_MOVES, default=d.decode_move,
                   help=f"how a decode worker moves to prefill or null, and a null worker to prefill, by the planner "
                        f"or by hand: handover switches it at once and it finishes what it held in the new role "
                        f"beside the new work; drain switches it once that has ended; migrate drains it for "
                        f"--planner-migrate-after-s, then moves what still runs, KV and all, to the other decode "
                        f"workers (default: {d.decode_move})")
    g.add_argument("--planner-migrate-after-s", type=float, default=d.migrate_after_s,
                   help=f"--planner-decode-move migrate: how long a worker drains before its running requests move "
                        f"(default: {d.migrate_after_s:g})")
    g.add_argument("--planner-profile", default=None, metavar="PATH", help=profile_help)


def planner_config_from_namespace(ns: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(mode=ns.planner, ttft_slo_s=ns.ttft_slo_ms / 1000, tpot_slo_s=ns.tpot_slo_ms / 1000,
                         interval_s=ns.planner_interval_s, cooldown_s=ns.planner_cooldown_s,
                         worker_cooldown_s=ns.planner_worker_cooldown_s, min_per_pool=ns.planner_min_per_pool,
                         max_concurrent_moves=ns.planner_max_concurrent_moves, window_s=ns.planner_window_s,
                         burst_window_s=ns.planner_burst_window_s, hysteresis=ns.planner_hysteresis,
                         decode_move=ns.planner_decode_move, migrate_after_s=ns.planner_migrate_after_s)


def planner_argv(ns: argparse.Namespace) -> list[str]:
    """The planner flags given to `tidal cluster`, for its router's command line."""
    out = []
    for flag, attr in VALUE_FLAGS:
        value = getattr(ns, attr)
        if value is not None:
            out += [flag, str(value)]
    return out
