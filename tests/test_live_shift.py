"""scripts/live_shift.py: its bookkeeping (pools over time, the planner's decisions, each once) and its auto rates."""

from __future__ import annotations

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("live_shift", os.path.join(REPO, "scripts", "live_shift.py"))
live_shift = importlib.util.module_from_spec(spec)
spec.loader.exec_module(live_shift)


def pools(t, p, d, n, moving=0):
    return {"t": t, "prefill": p, "decode": d, "null": n, "moving": moving}


def test_pool_changes_keeps_the_first_last_and_every_change():
    polls = [pools(0, 1, 1, 1), pools(2, 1, 1, 1), pools(4, 1, 1, 0, 1), pools(6, 1, 1, 0, 1), pools(8, 1, 2, 0),
             pools(10, 1, 2, 0)]
    assert [p["t"] for p in live_shift.pool_changes(polls)] == [0, 4, 8, 10]


def test_a_decision_is_kept_once_with_the_time_it_was_first_seen():
    """One planner interval may hold two moves and a hold (same clock): each is kept once."""
    seen = {}
    move = {"at": 50.0, "kind": "move", "reason": "r", "url": "u", "src": "null", "dst": "decode", "outcome": ""}
    move2 = {**move, "url": "v", "src": "prefill"}
    hold = {"at": 50.0, "kind": "hold", "reason": "2 move(s) in flight"}
    earlier = {"at": 48.0, "kind": "hold", "reason": "cooldown"}
    live_shift.merge_decisions(seen, [hold, move2, move, earlier], t=10.0)
    landed = {**move, "outcome": "ok", "timings_ms": {"drain": 0.0, "switch": 3.2}, "worker_message": "switched"}
    live_shift.merge_decisions(seen, [hold, {**move2, "outcome": "ok"}, landed, earlier], t=12.0)
    assert seen[50.0, "move", "u"] == {"seen_t": 10.0, "kind": "move", "reason": "r", "url": "u", "src": "null",
                                       "dst": "decode", "outcome": "ok", "timings_ms": {"drain": 0.0, "switch": 3.2},
                                       "worker_message": "switched"}
    assert seen[50.0, "move", "v"]["src"] == "prefill" and seen[50.0, "move", "v"]["outcome"] == "ok"
    assert seen[50.0, "hold", ""] == {"seen_t": 10.0, "kind": "hold", "reason": "2 move(s) in flight"}
    assert seen[48.0, "hold", ""] == {"seen_t": 10.0, "kind": "hold", "reason": "cooldown"}


def test_a_moves_start_is_kept_from_the_runs_start():
    seen = {}
    move = {"at": 50.0, "at_unix": 1000.25, "kind": "move", "reason": "r", "url": "u", "src": "decode",
            "dst": "prefill", "outcome": ""}
    live_shift.merge_decisions(seen, [move], t=40.0, t0=960.0)
    assert seen[50.0, "move", "u"]["at_s"] == 40.25 and seen[50.0, "move", "u"]["seen_t"] == 40.0


def test_a_phases_requests_are_timed_from_the_runs_start():
    records = [{"start": 0.0, "success": True, "ttft": 0.1}, {"start": 1.5, "success": False, "ttft": 0.0}]
    out = live_shift.phase_records(records, 2, 120.0)
    assert [(r["start"], r["phase"], r["success"]) for r in out] == [(120.0, 2, True), (121.5, 2, False)]
    assert records[0]["start"] == 0.0  # the bench's own records are left as they were


def test_a_handover_is_timed_from_the_workers_status_polls():
    handovers = []
    idle = {"transition_state": "IDLE", "current_mode": "decode", "last_switch_timings_ms": {}}
    live_shift.track_handover(handovers, "u", idle, 10.0)
    assert handovers == []
    live_shift.track_handover(handovers, "u", {"transition_state": "HANDOVER", "current_mode": "prefill"}, 12.0)
    live_shift.track_handover(handovers, "u", {"transition_state": "HANDOVER", "current_mode": "prefill"}, 14.0)
    live_shift.track_handover(handovers, "v", idle, 14.0)
    live_shift.track_handover(handovers, "u", {"transition_state": "IDLE", "current_mode": "prefill",
                                               "last_switch_timings_ms": {"switch": 5.0, "handover": 3120.5}}, 16.0)
    assert handovers == [{"url": "u", "mode": "prefill", "seen_t": 12.0, "ended_t": 16.0, "handover_ms": 3120.5}]


def test_auto_rates_come_from_the_profile_and_the_clusters_planner():
    from tidal.planner.decide import make_predictor, rated
    from tidal.planner.loop import load_cost_model
    from tidal.planner.predict import PoolLoad
    from tidal.planner.schema import Traffic

    amx = os.path.join(REPO, "tidal", "profile", "data", "smollm2_cpu_1thread_amx.json")
    ns = live_shift.parse_args(["--planner-profile", amx, "--decode-heavy", "32", "256", "0.75"])
    assert ns.prefill_heavy == (768, 4, "auto") and ns.decode_heavy == (32, 256, 0.75)
    live_shift.resolve_rates(ns)
    assert ns.decode_heavy == (32, 256, 0.75)  # a given rate stays
    cfg = live_shift.cluster_planner(ns.cluster_args)
    assert (cfg.mode, cfg.ttft_slo_s, cfg.tpot_slo_s, cfg.interval_s, cfg.window_s) == ("sla", 3.0, 0.15, 2.0, 20.0)
    cost = load_cost_model(amx)
    traffic = Traffic(arrival_rate=1.0, mean_input_tokens=0.9 * 768, mean_output_tokens=0.9 * 4, completed=1)
    caps = {}
    for p, d, n in ((1, 1, 1), (2, 1, 0), (1, 2, 0)):  # what the planner may head for from 1:1:1
        pools = {"prefill": p, "decode": d, "null": n}
        caps[p, d, n] = rated(make_predictor(cfg, cost, pools), pools, PoolLoad([]), traffic).capacity
    # the prefill-heavy phase's premise: 2:1:0 serves it best; its rate leaves that layout 2x (the headroom)
    assert max(caps, key=caps.get) == (2, 1, 0) and caps[2, 1, 0] > 1.3 * caps[1, 1, 1]
    assert ns.prefill_heavy[2] == pytest.approx(caps[2, 1, 0] / 2, rel=0.01)
    loose = live_shift.parse_args(["--planner-profile", amx, "--cluster-args", "--ttft-slo-ms 30000"])
    live_shift.resolve_rates(loose)  # a looser TTFT SLO (TPOT at the cluster's default) takes more prompts
    assert loose.prefill_heavy[2] > ns.prefill_heavy[2]
    for bad in (["--prefill-heavy", "768", "four", "1"], ["--decode-heavy", "32", "256", "fast"],
                ["--decode-heavy", "32", "256", "-1"], ["--decode-heavy", "32", "256", "nan"],
                ["--prefill-heavy", "0", "4", "1"], ["--rate-headroom", "0"],
                ["--cluster-args", "--planner-profile x.json"]):
        with pytest.raises(SystemExit):
            live_shift.parse_args(bad)


def test_a_static_layout_is_started_as_given():
    ns = live_shift.parse_args(["--layout", "2:1:0", "--planner", "static", "--prefill-heavy", "768", "4", "1",
                                "--decode-heavy", "32", "256", "1"])
    cmd = live_shift.cluster_cmd(ns)
    flags = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
    assert (flags["--prefill"], flags["--decode"], flags["--worker"], flags["--planner"]) == ("2", "1", "0", "static")
    assert live_shift.cluster_cmd(live_shift.parse_args([]))[4:12] == ["--prefill", "1", "--decode", "1", "--worker",
                                                                        "1", "--planner", "sla"]


@pytest.mark.parametrize("layout", ["1:1", "1:0:0", "0:1:0", "a:1:1", "-1:2:1"])
def test_a_layout_without_a_path_or_of_the_wrong_shape_is_refused(layout, capsys):
    with pytest.raises(SystemExit):
        live_shift.parse_args(["--layout", layout])
    assert "--layout" in capsys.readouterr().err


def test_slo_attainment_counts_successes_within_both_slos():
    cfg = live_shift.cluster_planner("--ttft-slo-ms 1000 --tpot-slo-ms 100")
    records = [
        {"success": True, "ttft": 0.5, "e2e": 1.4, "output_tokens": 10, "start": 0.0, "phase": 0},  # tpot 0.1
        {"success": True, "ttft": 1.2, "e2e": 1.3, "output_tokens": 2, "start": 1.0, "phase": 0},  # TTFT missed
        {"success": True, "ttft": 0.2, "e2e": 2.2, "output_tokens": 11, "start": 2.0, "phase": 1},  # tpot 0.2
        {"success": True, "ttft": 0.9, "e2e": 0.9, "output_tokens": 1, "start": 3.0, "phase": 1},  # one token
        {"success": False, "error": "503", "ttft": 0.0, "e2e": 0.0, "output_tokens": 0, "start": 4.0, "phase": 1},
    ]
    assert live_shift.slo_attainment(records, cfg) == 0.4
    assert live_shift.slo_attainment([], cfg) == 0.0
