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
    live_shift.merge_decisions(seen, [hold, {**move2, "outcome": "ok"}, {**move, "outcome": "ok"}, earlier], t=12.0)
    assert seen[50.0, "move", "u"] == {"seen_t": 10.0, "kind": "move", "reason": "r", "url": "u", "src": "null",
                                       "dst": "decode", "outcome": "ok"}
    assert seen[50.0, "move", "v"]["src"] == "prefill" and seen[50.0, "move", "v"]["outcome"] == "ok"
    assert seen[50.0, "hold", ""] == {"seen_t": 10.0, "kind": "hold", "reason": "2 move(s) in flight"}
    assert seen[48.0, "hold", ""] == {"seen_t": 10.0, "kind": "hold", "reason": "cooldown"}


def test_auto_rates_come_from_the_profile_and_the_clusters_slos():
    amx = os.path.join(REPO, "tidal", "profile", "data", "smollm2_cpu_1thread_amx.json")
    ns = live_shift.parse_args(["--planner-profile", amx, "--decode-heavy", "32", "256", "0.75"])
    assert ns.prefill_heavy == (768, 4, "auto") and ns.decode_heavy == (32, 256, 0.75)
    live_shift.resolve_rates(ns)
    rate = ns.prefill_heavy[2]
    assert 0.1 < rate < 20 and ns.decode_heavy == (32, 256, 0.75)  # a given rate stays
    halved = live_shift.parse_args(["--planner-profile", amx, "--rate-headroom", "4"])
    live_shift.resolve_rates(halved)
    assert halved.prefill_heavy[2] == pytest.approx(rate / 2, rel=0.02)
    loose = live_shift.parse_args(["--planner-profile", amx, "--cluster-args", "--ttft-slo-ms 30000"])
    live_shift.resolve_rates(loose)  # a looser TTFT SLO (TPOT at the cluster's default) takes more prompts
    assert loose.prefill_heavy[2] > rate
    assert live_shift.slos("--tpot-slo-ms 150 --planner-interval-s 2") == (2.0, 0.15)  # TTFT: the default
    for bad in (["--prefill-heavy", "768", "four", "1"], ["--decode-heavy", "32", "256", "fast"],
                ["--rate-headroom", "0"]):
        with pytest.raises(SystemExit):
            live_shift.parse_args(bad)
