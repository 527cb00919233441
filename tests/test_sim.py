"""`tidal sim`: determinism, conservation, hand-computed latencies, the planner's direction,
the shipped trace, the live code it shares, and the CLI."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tidal.cli import main
from tidal.planner.schema import PlannerConfig
from tidal.profile.cost import CostModel
from tidal.sim.engine import Cluster, SimConfig
from tidal.sim.goodput import search_rate
from tidal.sim.instance import Limits
from tidal.sim.workload import (CHAT_LIKE, CODE_LIKE, TraceRequest, WorkloadSpec, clock_of, even_phase_rate_ratio,
                                 make_workload, phase_period, virtual_span)


FIXED_PROFILE = os.path.join(os.path.dirname(__file__), "data", "profile_2core_2026-11-24a.json")


def flat_cost(prefill_s: float = 1.0, step_s: float = 0.1, transfer_s: float = 0.5, kv: int = 100000,
              switch_s: float = 0.25) -> CostModel:
    """Constant costs: a prefill batch takes prefill_s whatever its size, a decode step step_s."""
    return CostModel.from_dict({
        "version": 1, "server": {"max_total_tokens": kv},
        "prefill": [{"tokens": 1, "seconds": prefill_s}, {"tokens": 100000, "seconds": prefill_s}],
        "decode": [{"batch": b, "context_tokens": c, "step_seconds": step_s} for b in (1, 64) for c in (0, kv)],
        "kv_transfer": [{"tokens": 1, "bytes": 1, "seconds": transfer_s},
                        {"tokens": 100000, "bytes": 1, "seconds": transfer_s}],
        "switch": [{"src": s, "dst": d, "seconds": switch_s} for s in ("null", "prefill", "decode")
                   for d in ("null", "prefill", "decode") if s != d],
    })


def run(trace: list[TraceRequest], cost: CostModel, **kw) -> Cluster:
    return Cluster(SimConfig(**kw), cost, trace).run()


def latencies(c: Cluster) -> list[tuple[float, float]]:
    return [tuple(round(x, 9) for x in c.ttft_tpot(r)) for r in c.requests]


def sim_json(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["sim", *args, "--output", str(out)]) == 0
    return json.loads(out.read_text())


# ---------------------------------------------------------------- hand-computed cases


def test_null_server_queues_and_stalls_decode_as_computed_by_hand():
    """One null server, 1 s per prefill, 0.1 s per decode step. A arrives at 0, B at 0.5, two tokens
    each. A prefills [0, 1]; at 1 the scheduler prefers B's prefill [1, 2] (A's decode waits);
    one decode step [2, 2.1] ends both."""
    c = run([TraceRequest(0.0, 100, 2), TraceRequest(0.5, 100, 2)], flat_cost(), null=1, prefill=0, decode=0)
    assert latencies(c) == [(1.0, 1.1), (1.5, 0.1)]
    assert [r.finished_at for r in c.requests] == pytest.approx([2.1, 2.1])


def test_requests_arriving_together_share_one_prefill_batch():
    c = run([TraceRequest(0.0, 100, 3)] * 3, flat_cost(), null=1, prefill=0, decode=0)
    assert latencies(c) == [(1.0, 0.1)] * 3


def test_a_prefill_batch_costs_what_the_profiles_batch_points_say():
    """Alone 1 s per 100 tokens; 3 x 100 together measured at 2.4 s. Without the batch point the
    step costs as one prompt of 300 tokens, 3 s."""
    profile = {"version": 1, "server": {"max_total_tokens": 100000},
               "prefill": [{"tokens": 100, "seconds": 1.0}, {"tokens": 300, "seconds": 3.0}],
               "decode": [{"batch": 1, "context_tokens": 0, "step_seconds": 0.1}]}
    trace = [TraceRequest(0.0, 100, 2)] * 3
    batch_point = {"prefill_batch": [{"batch": 3, "tokens": 100, "seconds": 2.4}]}
    for cost, ttft in [(CostModel.from_dict({**profile, **batch_point}), 2.4), (CostModel.from_dict(profile), 3.0)]:
        c = run(trace, cost, null=1, prefill=0, decode=0)
        assert [t for t, _ in latencies(c)] == [ttft] * 3


def test_pd_request_pays_prefill_transfer_then_decodes():
    """Prefill [0, 1], KV transfer [1, 1.5], first token when it joins the decode batch at 1.5,
    two decode steps to 1.7."""
    c = run([TraceRequest(0.0, 100, 3)], flat_cost(), null=0, prefill=1, decode=1)
    assert latencies(c) == [(1.5, 0.1)]
    assert c.requests[0].finished_at == pytest.approx(1.7)
    assert c.requests[0].path == "pd"


def test_admission_is_the_live_prefill_adder_under_the_running_limit():
    """--max-running-requests 2: the third request waits for a slot (live admission code), so it
    prefills only after the first two finish."""
    from tidal.config import ServerArgs

    trace = [TraceRequest(0.0, 100, 3)] * 3
    c = Cluster(SimConfig(null=1, prefill=0, decode=0), flat_cost(), trace,
                Limits(ServerArgs(max_running_requests=2))).run()
    assert latencies(c)[:2] == [(1.0, 0.1)] * 2
    assert latencies(c)[2] == (2.2, 0.1)  # after [0,1] prefill and two decode steps to 1.2


def test_chunked_prefill_splits_a_long_prompt():
    from tidal.config import ServerArgs

    c = Cluster(SimConfig(null=1, prefill=0, decode=0), flat_cost(), [TraceRequest(0.0, 5000, 2)],
                Limits(ServerArgs(chunked_prefill_size=2048))).run()
    assert latencies(c) == [(3.0, 0.1)]  # three chunks of 1 s each


def test_an_input_longer_than_the_kv_pool_is_rejected_as_the_server_does():
    """A live server refuses (HTTP 400) an input of more than max_total_tokens - 1 tokens; the others run."""
    trace = [TraceRequest(0.0, 1000, 2), TraceRequest(0.0, 999, 2), TraceRequest(0.5, 100, 2)]
    c = Cluster(SimConfig(null=1, prefill=0, decode=0), flat_cost(kv=1000), trace).run()
    assert [r.outcome for r in c.requests] == ["rejected", "finished", "finished"]


def test_a_workload_past_twice_the_profiles_grid_is_warned_of():
    """Prompts by the workload, before the run; decode batches by what the simulated servers ran, after it (not by
    the running-request limit, which a light run never reaches)."""
    from tidal.sim.cli import decode_batch_warning, extrapolation_warnings

    cost = flat_cost()  # prefill measured up to 100000 tokens, decode up to batch 64
    assert extrapolation_warnings(cost, [TraceRequest(0.0, 250000, 2)]) == [
        "prefill was measured up to 100000 tokens; the workload's prompts reach 250000"]
    assert extrapolation_warnings(cost, [TraceRequest(0.0, 150000, 2)]) == []  # within twice the grid
    assert decode_batch_warning(cost, 200) == ("warning: decode steps were measured up to batch 64; the simulated "
                                               "servers ran batches of up to 200; the cost model extrapolates")
    assert decode_batch_warning(cost, 128) is None
    light = Cluster(SimConfig(null=0, prefill=1, decode=1), cost, [TraceRequest(10.0 * i, 100, 5) for i in range(3)])
    assert light.run().largest_decode_batch == 1  # one request at a time: far below the limit of 64
    crowd = Cluster(SimConfig(null=0, prefill=1, decode=1), cost, [TraceRequest(0.0, 10, 50) for _ in range(8)])
    assert 1 < crowd.run().largest_decode_batch <= 8


# ---------------------------------------------------------------- determinism and conservation


SHIFT_ARGS = ["--instances", "6", "--workload", "shift", "--phase-s", "90", "--rate-scale", "3",
              "--duration-s", "180", "--length-scale", "0.25", "--planner", "sla", "--planner-cooldown-s", "5",
              "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200"]


def test_same_seed_same_json_other_seed_other_json(tmp_path):
    a = sim_json(tmp_path, "a", *SHIFT_ARGS, "--seed", "7")
    b = sim_json(tmp_path, "b", *SHIFT_ARGS, "--seed", "7")
    c = sim_json(tmp_path, "c", *SHIFT_ARGS, "--seed", "8")
    assert a == b
    assert a["summary"] != c["summary"]


def test_every_request_ends_exactly_once_across_moves():
    spec = WorkloadSpec(name="shift", rate_scale=3, duration_s=180, phase_s=90, length_scale=0.25, seed=1)
    trace = make_workload(spec)
    planner = PlannerConfig(mode="sla", ttft_slo_s=8, tpot_slo_s=0.2, cooldown_s=5)
    # a fixed measured profile (not the shipped one, which is re-measured): under it this load
    # makes the planner move more than once
    c = Cluster(SimConfig(prefill=3, decode=3, planner=planner), CostModel.from_file(FIXED_PROFILE),
                trace).run()
    assert len(c.moves) >= 2 and any(m.outcome == "ok" for m in c.moves)
    assert sorted(r.rid for r in c.requests) == list(range(len(trace)))
    assert c.ended == len(trace) and all(r.outcome == "finished" for r in c.requests)
    assert all(r.generated == r.output_len for r in c.requests)
    for inst in c.instances.values():  # nothing held, nothing leaked
        assert (inst.kv_used, inst.assigned, inst.sending) == (0, 0, 0)
        assert not (inst.waiting or inst.running or inst.arrived or inst.chunked)
    assert all(w.in_flight == 0 and not w.switching for w in c.registry.all())


def test_a_drain_longer_than_the_switch_timeout_fails_and_the_worker_stays():
    """A null worker busy with a 1000-token answer (100 s at 0.1 s/step) cannot drain in 60 s to decode."""
    c = Cluster(SimConfig(null=2, prefill=0, decode=0), flat_cost(), [TraceRequest(0.0, 100, 1000)])
    c.at(5.0, lambda _: c._start_move(c.requests[0].decode_url, "decode"))
    c.run()
    (move,) = c.moves
    assert move.outcome.startswith("failed") and move.ended == pytest.approx(65.0)
    assert c.registry.get(move.worker).mode == "null" and c.requests[0].outcome == "finished"


def test_a_move_waits_for_the_drain_then_pays_the_switch():
    c = Cluster(SimConfig(null=2, prefill=0, decode=0), flat_cost(), [TraceRequest(0.0, 100, 30)])
    c.at(2.0, lambda _: c._start_move(c.requests[0].decode_url, "decode"))
    c.run()
    (move,) = c.moves
    # finished at 1.0 (prefill) + 29 * 0.1 = 3.9; switch 0.25 s
    assert (move.outcome, move.drained, move.ended) == ("ok", pytest.approx(3.9), pytest.approx(4.15))
    assert c.registry.get(move.worker).mode == "decode"


def test_a_null_worker_hands_its_requests_over_to_prefill():
    """Null -> prefill drains nothing (the live router asks for a handover): the worker switches at once and
    finishes its answer as a prefill server, as a move from decode does; one that must drain (null -> decode,
    above) waits out its 1000-token answer."""
    c = Cluster(SimConfig(null=2, prefill=0, decode=1), flat_cost(), [TraceRequest(0.0, 100, 1000)])
    worker = []
    c.at(5.0, lambda _: (worker.append(c.requests[0].decode_url), c._start_move(worker[0], "prefill")))
    c.run()
    (move,) = c.moves
    r = c.requests[0]
    assert (move.src, move.outcome, move.drained, move.ended) == ("null", "ok", 5.0, pytest.approx(5.25))
    assert r.outcome == "finished" and r.generated == 1000 and move.handed_over == r.finished_at
    assert c.registry.get(worker[0]).mode == "prefill"
    assert all((inst.null_reqs, inst.pd_decodes, inst.kv_used) == (0, 0, 0) for inst in c.instances.values())


def decode_worker_moved_twice(first: tuple[float, str], second: tuple[float, str]) -> tuple[Cluster, str]:
    """One PD request (100-token prompt, 60-token answer) on 1 prefill : 2 decode; its decode worker is moved to
    first[1] at first[0] s, then to second[1] at second[0] s. The run, and the worker moved."""
    c = Cluster(SimConfig(prefill=1, decode=2), flat_cost(), [TraceRequest(0.0, 100, 60)])
    worker = []
    c.at(first[0], lambda _: (worker.append(c.requests[0].decode_url), c._start_move(worker[0], first[1])))
    c.at(second[0], lambda _: c._start_move(worker[0], second[1]))
    c.run()
    return c, worker[0]


def test_a_decode_worker_hands_its_answer_over_and_a_move_to_a_third_role_waits_for_it():
    """Decode -> prefill drains nothing (the live router asks for a handover): the worker switches at once
    and finishes its answer as a prefill server; a move of it to null before then waits for the answer, as a
    drain (the live worker holds a drained switch until its handover ends)."""
    c, worker = decode_worker_moved_twice((2.0, "prefill"), (3.0, "null"))
    first, second = c.moves
    assert (first.outcome, first.drained, first.ended) == ("ok", 2.0, pytest.approx(2.25))
    r = c.requests[0]
    assert r.outcome == "finished" and r.generated == 60
    assert first.handed_over == r.finished_at  # the move's handover lasted until its answer ended
    assert (second.outcome, second.drained, second.reversal) == ("ok", r.finished_at, False)
    assert second.ended == pytest.approx(r.finished_at + 0.25)
    assert c.registry.get(worker).mode == "null"
    assert all(inst.pd_decodes == 0 for inst in c.instances.values())


def test_a_move_back_during_a_handover_goes_at_once_and_ends_it():
    """Decode -> prefill, then back to decode a second later, while the handed-over answer still runs: the
    prefill role took no prompt of its own, so the move back switches at once (live: ModeController's switch
    back), the handover ends with it, and the answer ends under decode."""
    c, worker = decode_worker_moved_twice((2.0, "prefill"), (3.0, "decode"))
    first, second = c.moves
    r = c.requests[0]
    assert (second.outcome, second.reversal, second.drained, second.ended) == ("ok", True, 3.0, pytest.approx(3.25))
    assert first.handed_over == pytest.approx(3.25) and first.handed_over < r.finished_at
    assert r.outcome == "finished" and r.generated == 60 and c.registry.get(worker).mode == "decode"
    assert all(inst.pd_decodes == 0 for inst in c.instances.values())


def test_a_handing_over_instance_says_so_in_its_load_as_the_live_server_does():
    """What the planner reads to keep a handing-over worker from a third role (live: /get_load's
    handing_over_from): the role whose requests it still finishes, while it does."""
    c = Cluster(SimConfig(prefill=1, decode=2), flat_cost(), [TraceRequest(0.0, 100, 60)])
    worker, said = [], []
    c.at(2.0, lambda _: (worker.append(c.requests[0].decode_url), c._start_move(worker[0], "prefill")))
    c.at(3.0, lambda _: said.append(c.instances[worker[0]].load()["handing_over_from"]))
    c.run()
    assert c.requests[0].finished_at > 3.0 and said == ["decode"]
    assert c.instances[worker[0]].load()["handing_over_from"] == ""


def test_a_move_back_waits_for_the_prefill_roles_own_prompts():
    from tidal.sim.instance import SimInstance

    inst = SimInstance("p", "prefill", flat_cost(), Limits())
    inst.assigned, inst.pd_decodes = 2, 1  # a handed-over answer and a PD prompt to prefill for another server
    assert not inst.reversible()
    inst.assigned = 1  # the prompt's KV was sent
    assert inst.reversible()


def test_a_decode_worker_moved_to_null_hands_over_only_the_requests_still_waiting_for_their_kv():
    """Decode -> null: the answers in the running batch are null's own from the switch on (live: the decode role's
    queues alone keep the handover open), so a move of the worker to prefill a second later starts at once and
    hands the answer over again."""
    c, worker = decode_worker_moved_twice((2.0, "null"), (3.0, "prefill"))
    first, second = c.moves
    r = c.requests[0]
    assert (first.src, first.outcome, first.drained, first.handed_over) == ("decode", "ok", 2.0, pytest.approx(2.25))
    assert (second.src, second.handover, second.outcome, second.drained) == ("null", True, "ok", 3.0)
    assert second.handed_over == r.finished_at and r.outcome == "finished" and r.generated == 60
    assert c.registry.get(worker).mode == "prefill"
    assert all((inst.pd_decodes, inst.pd_awaiting_kv) == (0, 0) for inst in c.instances.values())


def test_a_handover_asked_during_a_handover_waits_for_it():
    """Decode -> null while a PD request's prompt is still prefilled elsewhere: the null worker's handover lasts
    until that KV joins its batch (prefill 1 s, transfer 0.5 s). A null -> prefill move asked meanwhile would hand
    over too, but waits for the first handover to end (the live worker queues it), then switches at once."""
    c, worker = decode_worker_moved_twice((0.5, "null"), (1.0, "prefill"))
    first, second = c.moves
    r = c.requests[0]
    assert (first.src, first.outcome, first.drained, first.handed_over) == ("decode", "ok", 0.5, 1.5)
    assert (second.src, second.handover, second.outcome, second.drained) == ("null", True, "ok", 1.5)
    assert second.ended == pytest.approx(1.75) and second.handed_over == r.finished_at
    assert c.registry.get(worker).mode == "prefill"


def test_a_prefill_server_whose_running_batch_is_full_of_handed_over_answers_still_prefills_pd_prompts():
    """Max 2 running: two handed-over answers fill the batch. A handed-over prompt waits for a slot, and the PD
    prompt behind it (sent to another decode server) is prefilled at once, as by the live admission."""
    from tidal.config import ServerArgs
    from tidal.sim.instance import SimInstance, SimReq

    inst = SimInstance("p", "prefill", flat_cost(), Limits(ServerArgs(max_running_requests=2)))
    for i in range(2):
        r = SimReq(i, 0.0, 10, 50)
        r.decode_url, r.generated, r.kv_len, r.computed, r.req_pool_idx = "p", 5, 15, 15, 0
        inst.running.append(r)
        inst.kv_used += r.kv_len
    held, pd = SimReq(2, 0.0, 10, 50), SimReq(3, 1.0, 10, 50)
    held.decode_url, pd.decode_url = "p", "d"
    inst.waiting = [held, pd]
    step = inst._prefill_step()
    assert step.kind == "prefill" and step.reqs == [pd] and inst.waiting == [held]


def test_a_decode_worker_set_to_drain_switches_once_its_answer_ends():
    """`--planner-decode-move drain`: the decode worker leaves its pool, finishes its answer, then switches."""
    cfg = SimConfig(prefill=1, decode=2, planner=PlannerConfig(decode_move="drain"))
    c = Cluster(cfg, flat_cost(), [TraceRequest(0.0, 100, 60)])
    c.at(2.0, lambda _: c._start_move(c.requests[0].decode_url, "prefill"))
    c.run()
    (move,) = c.moves
    r = c.requests[0]
    assert r.outcome == "finished" and r.generated == 60
    assert (move.outcome, move.drained, move.handover, move.handed_over) == ("ok", r.finished_at, False, None)
    assert move.ended == pytest.approx(r.finished_at + 0.25)


# ---------------------------------------------------------------- the planner in the sim


def default_profile() -> str:
    from tidal.sim.cli import DEFAULT_PROFILE

    return DEFAULT_PROFILE


def test_planner_moves_toward_prefill_in_a_code_like_phase(tmp_path):
    d = sim_json(tmp_path, "code", "--instances", "8", "--workload", "shift", "--phase-s", "240", "--rate-scale",
                 "4", "--duration-s", "240", "--length-scale", "0.25", "--planner", "sla",
                 "--planner-cooldown-s", "10", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    assert d["moves"] and (d["moves"][0]["src"], d["moves"][0]["dst"]) == ("decode", "prefill")
    assert d["moves"][0]["started"] < 60  # inside the code-like phase


def test_phase_layouts_follow_the_phases_with_every_move_at_once(tmp_path):
    """--phase-layouts 3:1:0,0:0:4 on 4 servers: at each phase start the cluster heads for that phase's
    layout with all the moves it takes at once, drains and switches paid; every request ends once."""
    d = sim_json(tmp_path, "phases", "--instances", "4", "--null", "4", "--workload", "shift", "--phase-s", "60",
                 "--duration-s", "240", "--length-scale", "0.25", "--phase-layouts", "3:1:0,0:0:4",
                 "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    s = d["summary"]
    assert s["finished"] + s["rejected"] + s["unfinished"] == s["requests"] > 0
    starts = sorted({round(m["started"]) for m in d["moves"]})
    assert starts[0] == 0 and all(m["outcome"] == "ok" for m in d["moves"])
    at = lambda t: [p for p in d["pools"] if p["t"] <= t][-1]  # noqa: E731
    assert (at(55)["prefill"], at(55)["decode"], at(55)["null"]) == (3, 1, 0)
    assert (at(115)["prefill"], at(115)["decode"], at(115)["null"]) == (0, 0, 4)
    assert (at(175)["prefill"], at(175)["decode"], at(175)["null"]) == (3, 1, 0)
    assert max(p["moving"] for p in d["pools"]) >= 3  # moved together, not one per interval


@pytest.mark.parametrize("clock, first_moves, not_then", [("wall", [0, 60, 120, 180], [25, 50, 75]),
                                                           ("trace", [0, 25, 50, 75], [60, 120, 180])])
def test_phase_layouts_follow_the_phases_of_the_clock(tmp_path, clock, first_moves, not_then):
    """At rate scale 2.5, 60-s phases last 60 virtual seconds on the wall clock and 24 on the trace clock;
    the phase layouts turn at the first planner tick (every 5 s) of each."""
    d = sim_json(tmp_path, clock, "--instances", "4", "--null", "4", "--workload", "shift", "--phase-s", "60",
                 "--duration-s", "240", "--length-scale", "0.25", "--phase-layouts", "3:1:0,0:0:4",
                 "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200", "--rate-scale", "2.5", "--phase-clock", clock)
    starts = sorted({round(m["started"]) for m in d["moves"]})
    assert [t for t in first_moves if t in starts] == first_moves
    assert [t for t in starts if t % 5] == [] and not set(not_then) & set(starts)


def test_a_single_trace_on_the_wall_clock_runs_its_duration_from_the_cli(tmp_path):
    """`--clock wall` on the conversation trace: 60 virtual seconds at rate scale 3 and at 6 (about twice the
    requests); the report names the clock, the trace clock's by default."""
    base = ["--instances", "4", "--prefill", "2", "--decode", "2", "--workload", "azure-conv", "--duration-s", "60",
            "--length-scale", "0.25", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200"]
    slow = sim_json(tmp_path, "slow", *base, "--rate-scale", "3", "--clock", "wall")
    fast = sim_json(tmp_path, "fast", *base, "--rate-scale", "6", "--clock", "wall")
    trace = sim_json(tmp_path, "trace", *base, "--rate-scale", "3")
    assert slow["config"]["workload"]["clock"] == "wall" and trace["config"]["workload"]["clock"] == "trace"
    assert 1.5 < fast["summary"]["requests"] / slow["summary"]["requests"] < 2.5
    assert trace["summary"]["requests"] < slow["summary"]["requests"] / 2  # 60 s of trace in 20 virtual seconds


def sim_error(capsys, argv: list[str]) -> str:
    """`tidal sim` refuses the flags: exit status 2 and one `tidal sim: error:` line, which it returns."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tidal sim: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_phase_layouts_are_checked(capsys):
    assert "adding up to --instances 4" in sim_error(capsys, ["sim", "--instances", "4", "--phase-layouts", "3:0:0"])
    # a negative count is the flag's value, not an unknown option (argparse's own reading)
    said = sim_error(capsys, ["sim", "--instances", "4", "--workload", "shift", "--phase-layouts", "-1:3:2"])
    assert "--phase-layouts: '-1:3:2' must be counts of 0 or more" in said, said


def test_a_starting_pool_below_the_planners_floor_is_warned_of(capsys):
    run = ["sim", "--instances", "4", "--prefill", "1", "--decode", "3", "--planner-min-per-pool", "2",
           "--duration-s", "5", "--output", "/dev/null"]
    assert main(run + ["--planner", "sla"]) == 0
    assert "warning: --planner-min-per-pool 2: the prefill pool has 1 worker;" in capsys.readouterr().err
    assert main(run) == 0  # without the planner the floor means nothing
    assert "--planner-min-per-pool" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--instances", "-3"], "--instances must be >= 1"),
    (["--prefill", "-1"], "--prefill must be >= 0"),
    (["--profile", "/nonexistent.json"], "profile /nonexistent.json"),
    (["--planner-profile", "/nonexistent.json"], "--planner-profile: cannot read profile /nonexistent.json"),
    (["--instances", "1"], "the layout 0:1 (+ 0 null) serves no request: it needs a null server (--null)"),
    (["--ttft-slo-ms", "-1"], "--ttft-slo-ms"),
    (["--planner-interval-s", "0"], "--planner-interval-s"),
    (["--planner-max-concurrent-moves", "0"], "--planner-max-concurrent-moves"),
    (["--planner-hysteresis", "-1"], "--planner-hysteresis"),
    (["--host-cores", "0"], "--host-cores must be > 0"),
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--target-attainment", "2"], "--target-attainment"),
    (["--split-step", "0"], "--split-step"),
    (["--output", "/nonexistent-dir/x.json"], "no directory /nonexistent-dir"),
    (["--trace", "/nonexistent.csv"], "--trace /nonexistent.csv: not found"),
    (["goodput", "--layouts", "planer"], "'planer' is none of"),
    (["goodput", "--layouts", "3:3", "--instances", "4"], "at most --instances 4"),
    (["goodput", "--plot", "x.png"], "--plot draws one run"),
    (["calibrate"], "calibrate needs --bench-json"),
    (["calibrate", "--bench-json", "/nonexistent.json"], "--bench-json /nonexistent.json: not found"),
    (["calibrate", "--bench-json", "x.json", "--planner", "sla"], "calibrate replays the live run's layout"),
    (["--bench-json", "x.json"], "--bench-json is read by `tidal sim calibrate` only"),
    (["--workload", "shift", "--trace", "x.csv"], "--trace replays one Azure trace"),
    (["--tpot-slo-ms", "nan"], "--tpot-slo-ms must be a positive number, got nan"),
    (["--planner-hysteresis", "nan"], "--planner-hysteresis must be >= 0"),
    (["--planner-cooldown-s", "nan"], "--planner-cooldown-s must be >= 0"),
    (["--planner-interval-s", "1e-6"], "--planner-interval-s must be at least 0.1 s"),
    (["--planner-min-per-pool", "-1"], "--planner-min-per-pool must be >= 0, got -1"),
    (["--rate-tolerance", "0"], "--rate-tolerance must be > 0"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1"),
    (["--instances", "4", "--prefill", "5"], "--null 0 + --prefill 5 are more than --instances 4"),
    (["--plot", "run.json"], "--plot run.json: name a .png, .svg, .pdf file"),
    (["--workload", "shift", "--phase-layouts", ",,"], "--phase-layouts: no layout given"),
    (["--phase-layouts", "2:2:0,3:1:0", "--instances", "4"], "--phase-layouts needs a workload with phases"),
    (["--workload", "shift", "--phase-layouts", "2:2:0,3:1:0", "--instances", "4", "--planner", "sla"],
     "--phase-layouts replaces the planner in a run"),
    (["--layouts", "planner"], "--layouts: read by `tidal sim goodput` only"),
    (["--rate-samples", "3", "--split-step", "2"], "--rate-samples, --split-step: read by `tidal sim goodput` only"),
    (["goodput", "--tolerance", "0.1"], "--tolerance: read by `tidal sim calibrate` only"),
    (["--moves", "planner"], "--moves: read by `tidal sim calibrate` only"),
    (["--workload", "azure-code", "--phase-s", "10"], "--phase-s: azure-code has no phases"),
    (["goodput", "--workload", "azure-conv", "--phase-rate-ratio", "even"], "--phase-rate-ratio: azure-conv has no"),
    (["goodput", "--workload", "shift", "--layouts", "phases"], "--layouts phases needs --phase-layouts"),
])
def test_bad_flags_are_one_clear_line_before_anything_runs(capsys, flags, says):
    argv = ["sim"] + flags if flags[0] in ("goodput", "calibrate") else ["sim", "run"] + flags
    assert says in sim_error(capsys, argv)


def test_bad_files_are_one_clear_line_not_a_traceback(tmp_path, capsys):
    """Output paths that cannot be written are refused before the run; a trace or a bench JSON that is not
    one is named with what is wrong."""
    run = ["sim", "run", "--instances", "4", "--duration-s", "30"]
    assert f"--output {tmp_path}: is a directory" in sim_error(capsys, run + ["--output", str(tmp_path)])
    assert f"--plot {tmp_path}: is a directory" in sim_error(capsys, run + ["--plot", str(tmp_path)])
    files = {"passwd.csv": "root:x:0:0:root:/root:/bin/bash\n",
             "bad_time.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\nnotatime,10,10\n",
             "header.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    says = {"passwd.csv": "passwd.csv: not an Azure LLM trace (its header needs", "bad_time.csv": "line 2: not an Azure LLM trace row",
            "header.csv": "the workload has no request in its first 30 s"}
    for name, message in says.items():
        assert message in sim_error(capsys, run + ["--trace", str(tmp_path / name)])
    benches = {"list.json": "[1, 2]", "not.json": "root:x", "empty.json": '{"requests": []}',
               "field.json": '{"requests": [{"start": "x", "success": true, "prompt_tokens": 1, "output_tokens": 1}]}',
               "failed.json": '{"requests": [{"start": 0.0, "success": false, "prompt_tokens": 1, "output_tokens": 1}]}'}
    for name, text in benches.items():
        (tmp_path / name).write_text(text)
    says = {"list.json": "not a `tidal bench --output-file` JSON (Expected `object`, got `array`)",
            "not.json": "not a `tidal bench --output-file` JSON (JSON is malformed",
            "empty.json": "no per-request records", "field.json": "at `$.requests[0].start`",
            "failed.json": "no live request succeeded: no latency to compare"}
    for name, message in says.items():
        assert message in sim_error(capsys, ["sim", "calibrate", "--bench-json", str(tmp_path / name)])


def test_the_run_at_a_glance_counts_one_move_as_one():
    from tidal.sim.cli import one_line

    s = {"requests": 3, "finished": 3, "rejected": 0, "unfinished": 0, "slo_attainment": 1.0,
         "ttft_ms": {"p50": 10.0}, "tpot_ms": {"p50": None}}
    assert one_line(s, 1).endswith("TPOT p50 n/a; 1 move (simulated)") and "; 2 moves" in one_line(s, 2)


def test_a_run_of_phase_layouts_says_so_in_its_report(tmp_path, capsys):
    d = sim_json(tmp_path, "phases", "--instances", "4", "--workload", "shift", "--phase-s", "20", "--duration-s", "60",
                 "--phase-layouts", "3:1:0,1:3:0")
    assert d["config"]["planner"] == "phases" and d["config"]["phase_layouts"] == "3:1:0,1:3:0"
    assert d["moves"]
    s, err = d["summary"], capsys.readouterr().err  # and the run at a glance on stderr, from the same numbers
    assert (f"tidal sim: {s['requests']} requests ({s['finished']} finished, 0 rejected, 0 unfinished), "
            f"{s['slo_attainment']:.1%} met both SLOs") in err
    assert f"; {len(d['moves'])} moves (simulated)" in err


def test_layouts_that_never_meet_the_slos_are_marked_and_none_is_best(tmp_path, capsys):
    d = sim_json(tmp_path, "never", "goodput", "--instances", "4", "--duration-s", "30", "--ttft-slo-ms", "0.001",
                 "--layouts", "2:2,colocated")
    assert [r["goodput_rps"] for r in d["results"]] == [0, 0] and all(r["never_met"] for r in d["results"])
    assert d["best_static"] is None and not any(r.get("best_static") for r in d["results"])
    assert all(r["alone_attainment"] == 0 and r["probes"] == 2 for r in d["results"])  # no 12 halvings
    err = capsys.readouterr().err
    assert "static 2:2 meets the SLOs at no rate: 0.0% of the requests meet both even each alone" in err
    assert "no layout meets the SLOs at any rate: give lengths and SLOs the profile can meet" in err


def test_a_layout_whose_requests_miss_even_alone_is_not_searched_down_twelve_halvings():
    """Without the check, a search halves the rate 12 times (on the trace clock 4096x the virtual time; with a
    lookahead, tens of minutes): after the first halving it asks whether enough requests meet the SLOs each alone
    on an idle server, which no rate can beat."""
    probes = []

    def attains(scale: float) -> bool:
        probes.append(scale)
        return False

    assert search_rate(attains, 1.0, 0.03, hopeless=lambda: True) == 0 and len(probes) == 2
    probes.clear()
    assert search_rate(attains, 1.0, 0.03, hopeless=lambda: False) == 0 and len(probes) == 13


def test_alone_requests_meet_the_slos_where_a_loaded_cluster_does_not(tmp_path):
    """The alone bound of a layout that meets the SLOs at some rate is at least the target: its search goes on."""
    import argparse

    from tidal.sim.cli import add_sim_args
    from tidal.sim.goodput import AloneAttainment, alone_trace

    trace = [TraceRequest(0.0, 100, 30), TraceRequest(0.0, 100, 30)]
    spaced = alone_trace(trace, flat_cost())
    assert spaced[0].arrival == 0 and spaced[1].arrival == pytest.approx(2 * (1.0 + 0.5 + 30 * 0.1) + 1)
    parser = argparse.ArgumentParser()
    add_sim_args(parser)
    ns = parser.parse_args(["goodput", "--instances", "4", "--duration-s", "30", "--length-scale", "0.25",
                            "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200"])
    alone = AloneAttainment(ns, CostModel.from_file(default_profile()), 1.0)
    assert alone("pd") >= 0.9 and alone("null") >= 0.9 and set(alone.by_path) == {"pd", "null"}


def test_goodput_searches_a_split_named_in_layouts(tmp_path):
    d = sim_json(tmp_path, "named", "goodput", "--instances", "4", "--layouts", "1:2, planner", "--duration-s", "60",
                 "--rate-tolerance", "0.2", "--length-scale", "0.25", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    assert [r["layout"] for r in d["results"]] == ["static 1:2 + 1 null", "planner from 2:2"]
    assert d["results"][0]["goodput_rps"] > 0 and d["results"][0]["null"] == 1
    assert d["best_static"] == "static 1:2 + 1 null"


@pytest.mark.parametrize("flag, value", [("--phase-s", "0"), ("--phase-s", "-5"), ("--duration-s", "0"),
                                         ("--duration-s", "-10"), ("--rate-scale", "0"), ("--phase-rate-ratio", "0"),
                                         ("--phase-s", "nan")])
@pytest.mark.parametrize("workload", ["azure-shift", "shift"])
def test_a_workload_that_cannot_be_made_is_an_error_naming_its_flag(capsys, workload, flag, value):
    """Before: --phase-s 0 looped for ever on azure-shift, --duration-s 0 divided by zero after the run."""
    for action in ("run", "goodput"):
        assert f"{flag} must be a positive number" in sim_error(
            capsys, ["sim", action, "--instances", "2", "--workload", workload, flag, value])


def test_planner_starts_the_moves_toward_its_target_together(tmp_path):
    """With --planner-max-concurrent-moves 3 the moves toward one target start in the same interval
    (the live loop decides until it holds, as the simulator does), never more than 3 in flight."""
    d = sim_json(tmp_path, "together", "--instances", "8", "--workload", "shift", "--phase-s", "240", "--rate-scale",
                 "4", "--duration-s", "240", "--length-scale", "0.25", "--planner", "sla",
                 "--planner-max-concurrent-moves", "3", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    starts = [m["started"] for m in d["moves"]]
    assert starts and max(starts.count(t) for t in starts) >= 2, starts
    assert max(p["moving"] for p in d["pools"]) <= 3


def test_a_move_that_lands_mid_walk_starts_the_next_one_at_once(tmp_path):
    """With one move at a time, the walk toward a target does not wait for the next interval (5 s) after each
    move: the next decision comes as the last move lands, as in the live loop."""
    d = sim_json(tmp_path, "walk", "--instances", "8", "--workload", "shift", "--phase-s", "240", "--rate-scale",
                 "4", "--duration-s", "240", "--length-scale", "0.25", "--planner", "sla",
                 "--planner-max-concurrent-moves", "1", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    moves = d["moves"]
    assert len(moves) >= 2 and moves[0]["started"] == 5.0, moves
    assert all(m["outcome"] == "ok" for m in moves)
    assert moves[1]["started"] == pytest.approx(moves[0]["ended"]) and moves[1]["started"] % 5, moves


def test_planner_moves_toward_decode_in_a_chat_like_phase(tmp_path):
    d = sim_json(tmp_path, "chat", "--instances", "8", "--prefill", "6", "--decode", "2", "--workload", "shift",
                 "--phase-s", "120", "--rate-scale", "3", "--duration-s", "480", "--length-scale", "0.25",
                 "--planner", "sla", "--planner-cooldown-s", "10", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    to_decode = [m for m in d["moves"] if m["dst"] == "decode"]
    assert any(int(m["started"] // 40) % 2 == 1 for m in to_decode)  # odd phases (40 virtual s) are chat-like


def test_static_planner_never_moves(tmp_path):
    d = sim_json(tmp_path, "static", *[a if a != "sla" else "static" for a in SHIFT_ARGS])
    assert d["moves"] == [] and len(d["pools"]) == 1


def test_an_advising_planner_decides_as_sla_and_never_moves(tmp_path):
    """The code-like phase where the sla planner moves a decode worker to prefill: advise counts the move it would
    make, and makes none."""
    d = sim_json(tmp_path, "advise", "--instances", "8", "--workload", "shift", "--phase-s", "240", "--rate-scale",
                 "4", "--duration-s", "240", "--length-scale", "0.25", "--planner", "advise",
                 "--planner-cooldown-s", "10", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    assert d["moves"] == [] and len(d["pools"]) == 1 and d["decisions"].get("advise", 0) > 0


# ---------------------------------------------------------------- workloads


def test_shipped_azure_traces_load_with_their_attribution():
    for name in ("azure-code", "azure-conv"):
        reqs = make_workload(WorkloadSpec(name=name, duration_s=120))
        assert len(reqs) > 50 and all(r.input_tokens > 0 and r.output_tokens > 0 for r in reqs)
        assert reqs == sorted(reqs, key=lambda r: r.arrival) and reqs[-1].arrival < 120
    import tidal.bench.datasets as ds

    folder = ds.default_azure_dir()
    readme = open(os.path.join(folder, "README.md")).read()
    assert "Creative Commons Attribution 4.0" in readme and "Azure" in readme
    assert "Attribution 4.0 International" in open(os.path.join(folder, "LICENSE")).read()


def test_rate_scale_compresses_the_same_requests():
    one = make_workload(WorkloadSpec(name="azure-conv", duration_s=60))
    four = make_workload(WorkloadSpec(name="azure-conv", duration_s=60, rate_scale=4))
    assert [(r.input_tokens, r.output_tokens) for r in one] == [(r.input_tokens, r.output_tokens) for r in four]
    assert [r.arrival / 4 for r in one] == pytest.approx([r.arrival for r in four])


def test_shift_alternates_long_prompts_and_long_answers():
    reqs = make_workload(WorkloadSpec(name="shift", duration_s=600, phase_s=100, rate_scale=1))
    code = [r for r in reqs if int(r.arrival // 100) % 2 == 0]
    chat = [r for r in reqs if int(r.arrival // 100) % 2 == 1]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean([r.input_tokens for r in code]) > 3 * mean([r.input_tokens for r in chat])
    assert mean([r.output_tokens for r in chat]) > 5 * mean([r.output_tokens for r in code])
    assert CODE_LIKE[0] > CHAT_LIKE[0] and CHAT_LIKE[1] > CODE_LIKE[1]


def test_azure_shift_takes_each_trace_in_turn_and_on_the_trace_clock_scales_like_the_others():
    mixed = make_workload(WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60))
    code = make_workload(WorkloadSpec(name="azure-code", duration_s=240))
    conv = make_workload(WorkloadSpec(name="azure-conv", duration_s=240))
    assert mixed == [r for r in code if r.arrival < 60] + [r for r in conv if 60 <= r.arrival < 120] + \
        [r for r in code if 120 <= r.arrival < 180] + [r for r in conv if 180 <= r.arrival < 240]
    assert make_workload(WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60, clock="trace")) == mixed
    fast = make_workload(WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60, rate_scale=2.5,
                                      clock="trace"))
    assert [r.input_tokens for r in fast] == [r.input_tokens for r in mixed]
    assert [r.arrival * 2.5 for r in fast] == pytest.approx([r.arrival for r in mixed])


def test_on_the_wall_clock_phases_keep_their_length_and_a_higher_rate_replays_more_trace():
    """Scale 2.5 on the wall clock: 60-s phases at every rate, each replaying 150 s of its trace (from the
    phase's start on the trace's clock) 2.5 times as fast; the run still lasts 240 virtual seconds."""
    spec = WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60, rate_scale=2.5)
    fast = make_workload(spec)
    assert virtual_span(spec) == 240 and phase_period(spec) == 60
    assert fast == sorted(fast, key=lambda r: r.arrival) and 230 < fast[-1].arrival < 240
    code = make_workload(WorkloadSpec(name="azure-code", duration_s=600))
    conv = make_workload(WorkloadSpec(name="azure-conv", duration_s=600))
    slow = make_workload(WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60, rate_scale=1.5))
    for k, trace in enumerate((code, conv, code, conv)):
        window = [r for r in trace if 60 * k <= r.arrival < 60 * k + 150]
        got = [r for r in fast if 60 * k <= r.arrival < 60 * (k + 1)]
        assert [(r.input_tokens, r.output_tokens) for r in got] == [(r.input_tokens, r.output_tokens) for r in window]
        assert [r.arrival for r in got] == pytest.approx([60 * k + (r.arrival - 60 * k) / 2.5 for r in window])
        # a lower rate: the same requests from the phase's start, fewer of them, further apart
        fewer = [(r.input_tokens, r.output_tokens) for r in slow if 60 * k <= r.arrival < 60 * (k + 1)]
        assert 0 < len(fewer) <= len(got) and fewer == [(r.input_tokens, r.output_tokens) for r in got][:len(fewer)]
    assert len(slow) < len(fast)
    trace_clock = WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60, rate_scale=2.5, clock="trace")
    assert virtual_span(trace_clock) == 96 and phase_period(trace_clock) == 24


def test_a_phase_longer_than_its_trace_wraps_around_it_as_often_as_needed():
    code = make_workload(WorkloadSpec(name="azure-code", duration_s=4000))
    period = code[-1].arrival  # the shipped code trace spans about an hour
    phase = make_workload(WorkloadSpec(name="azure-shift", duration_s=100, phase_s=100, rate_scale=3 * period / 100))
    assert len(phase) == pytest.approx(3 * len(code), abs=3)  # three laps of the trace in one phase
    assert all(0 <= r.arrival < 100 for r in phase) and phase == sorted(phase, key=lambda r: r.arrival)


def test_a_single_trace_on_the_wall_clock_lasts_its_duration_at_every_rate_and_wraps_around_its_end():
    """On the wall clock a single trace replays rate scale x duration seconds of itself from its start: the
    same requests as on the trace clock while they last, then the trace again from its first row."""
    code = make_workload(WorkloadSpec(name="azure-code", duration_s=4000))
    period = code[-1].arrival
    assert clock_of(WorkloadSpec(name="azure-code")) == "trace" and clock_of(WorkloadSpec(name="shift")) == "wall"
    for scale in (2.0, 5.0):
        spec = WorkloadSpec(name="azure-code", duration_s=300, rate_scale=scale, clock="wall")
        wall = make_workload(spec)
        assert virtual_span(spec) == 300 and 290 < wall[-1].arrival < 300
        on_trace = make_workload(WorkloadSpec(name="azure-code", duration_s=300 * scale, rate_scale=scale))
        assert wall == on_trace  # 300 x 5 trace seconds: still within the hour, one lap
    laps = make_workload(WorkloadSpec(name="azure-code", duration_s=100, rate_scale=2.001 * period / 100,
                                      clock="wall"))
    assert 2 * len(code) <= len(laps) < 2 * len(code) + 50  # two laps and the first seconds of a third
    lap_s = 100 / 2.001  # virtual seconds per lap; a lap's last row arrives with the next one's first
    two_laps = Counter((r.input_tokens, r.output_tokens) for r in laps if r.arrival < 2 * lap_s - 1e-6)
    rows = [(r.input_tokens, r.output_tokens) for r in code]
    assert two_laps == Counter(rows) + Counter(rows[:-1])


def test_the_synthetic_shift_on_the_wall_clock_brings_more_requests_at_a_higher_rate():
    slow = make_workload(WorkloadSpec(name="shift", duration_s=600, phase_s=100))
    fast = make_workload(WorkloadSpec(name="shift", duration_s=600, phase_s=100, rate_scale=4))
    assert 3.3 < len(fast) / len(slow) < 4.7 and fast[-1].arrival < 600 and fast[-1].arrival > 590
    with pytest.raises(ValueError, match="unknown clock"):
        make_workload(WorkloadSpec(name="shift", clock="tide"))


def test_phase_rate_ratio_plays_the_chat_phases_faster():
    """Ratio 3: a conversation phase replays three phase lengths of its trace (from three times the phase's
    start) in one phase; code phases are unchanged. The synthetic shift's chat phases arrive 3x as often."""
    base = make_workload(WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60))
    fast = make_workload(WorkloadSpec(name="azure-shift", duration_s=240, phase_s=60, phase_rate_ratio=3))
    conv = make_workload(WorkloadSpec(name="azure-conv", duration_s=720))
    in_phase = lambda reqs, k: [r for r in reqs if k * 60 <= r.arrival < (k + 1) * 60]  # noqa: E731
    assert in_phase(fast, 0) == in_phase(base, 0) and in_phase(fast, 2) == in_phase(base, 2)
    window = [r for r in conv if 180 <= r.arrival < 360]  # phase 1: trace seconds [3 * 60, 3 * 120)
    assert [(r.input_tokens, r.output_tokens) for r in in_phase(fast, 1)] == \
        [(r.input_tokens, r.output_tokens) for r in window]
    assert [r.arrival for r in in_phase(fast, 1)] == pytest.approx([60 + (r.arrival - 180) / 3 for r in window])
    syn = make_workload(WorkloadSpec(name="shift", duration_s=4000, phase_s=500, phase_rate_ratio=3))
    chat = sum(1 for r in syn if int(r.arrival // 500) % 2)
    assert 2.5 < chat / (len(syn) - chat) < 3.5


def test_an_even_phase_rate_ratio_gives_both_phases_one_request_rate(tmp_path, capsys):
    """'even': the code trace's mean rate over the conversation trace's (the shipped conversation trace brings
    2.15x the requests a second). With a phase that replays one whole lap of the conversation trace, the code phase
    before it brings as many requests (to the partial lap's unevenness); at ratio 1 it brings 0.46x as many."""
    ratio = even_phase_rate_ratio("azure-shift")
    assert ratio == pytest.approx(0.4641, abs=1e-4) and even_phase_rate_ratio("shift") == 1.0
    conv = make_workload(WorkloadSpec(name="azure-conv", duration_s=1e6))  # the whole trace on its own clock
    phase = max(r.arrival for r in conv) / ratio  # the conversation phase replays the trace's span once
    for r, share in ((ratio, 1.0), (1.0, ratio)):
        reqs = make_workload(WorkloadSpec(name="azure-shift", duration_s=2 * phase, phase_s=phase, phase_rate_ratio=r))
        code = sum(1 for x in reqs if x.arrival < phase)
        assert code / (len(reqs) - code) == pytest.approx(share, rel=0.03)
    d = sim_json(tmp_path, "even", "run", "--instances", "2", "--workload", "azure-shift", "--phase-rate-ratio",
                 "even", "--duration-s", "20", "--phase-s", "10", "--length-scale", "0.25")
    assert d["config"]["workload"]["phase_rate_ratio"] == pytest.approx(ratio)
    g = sim_json(tmp_path, "even_goodput", "goodput", "--instances", "2", "--workload", "azure-shift", "--layouts",
                 "1:1", "--phase-rate-ratio", "even", "--duration-s", "20", "--phase-s", "10", "--length-scale", "0.25",
                 "--rate-tolerance", "0.5")
    assert g["phase_rate_ratio"] == pytest.approx(ratio)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse's own error: the usage, then the line
        main(["sim", "run", "--phase-rate-ratio", "odd"])
    assert e.value.code == 2 and "--phase-rate-ratio: 'odd' is neither a number nor 'even'" in capsys.readouterr().err


# ---------------------------------------------------------------- goodput search and CLI


def test_search_rate_finds_the_threshold():
    assert search_rate(lambda x: x <= 3.3, 1.0, 0.01) == pytest.approx(3.3, rel=0.011)
    assert search_rate(lambda x: x <= 0.2, 1.0, 0.01) == pytest.approx(0.2, rel=0.011)
    assert search_rate(lambda x: False, 1.0, 0.01) == 0.0
    assert search_rate(lambda x: True, 1.0, 0.03) > 1000  # the search's limit: every probe met


def test_search_rate_is_the_highest_grid_rate_that_attains_past_a_narrow_dip():
    """Attainment that dips below the target over a few percent of rate (a bursty trace) and recovers: the search
    scans past the dip, from any first probe, and every first probe gives the same grid rate. A dip wider than
    SCAN_ABOVE grid rates ends it."""
    from tidal.sim.goodput import SCAN_ABOVE

    def dip(x: float) -> bool:
        return x <= 2.0 or 2.1 <= x <= 2.5  # fails in (2.0, 2.1): one or two grid rates at 3%
    found = {search_rate(dip, start, 0.03) for start in (0.3, 1.0, 1.7, 2.05, 2.3, 3.0, 40.0)}
    assert len(found) == 1 and 2.5 / 1.03 < found.pop() <= 2.5
    probes = []

    def wide(x: float) -> bool:
        probes.append(x)
        return x <= 1.5 or 1.8 <= x <= 1.9  # a dip of 20%: more than SCAN_ABOVE = 3 grid rates
    assert SCAN_ABOVE == 3 and 1.5 / 1.03 < search_rate(wide, 1.0, 0.03) <= 1.5
    assert len(probes) == len(set(probes))  # no rate probed twice


def test_cli_writes_json_and_png(tmp_path):
    png = tmp_path / "run.png"
    d = sim_json(tmp_path, "run", *SHIFT_ARGS, "--duration-s", "40", "--plot", str(png))
    assert png.stat().st_size > 10000 and png.read_bytes()[:4] == b"\x89PNG"
    s = d["summary"]
    assert s["requests"] == s["finished"] > 0 and 0 <= s["slo_attainment"] <= 1
    assert set(s["ttft_ms"]) == {"p50", "p99"} and d["config"]["simulated"] is True
    assert d["pools"][0] == {"t": 0.0, "null": 0, "prefill": 3, "decode": 3, "moving": 0}


def test_a_shifting_mix_reports_attainment_per_phase(tmp_path):
    """5 prefill servers and 1 decode server at 3 requests/s: the code-like phase is served, the chat-like
    phase after it overloads the decode server."""
    d = sim_json(tmp_path, "phases", "--instances", "6", "--prefill", "5", "--decode", "1", "--workload", "shift",
                 "--phase-s", "60", "--rate-scale", "3", "--duration-s", "240", "--length-scale", "0.25",
                 "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200")
    s = d["summary"]
    phases = s["slo_attainment_by_phase"]
    assert [p["start_s"] for p in phases] == [0, 60, 120, 180]
    assert sum(p["requests"] for p in phases) == s["requests"]
    met = sum(p["requests"] * p["slo_attainment"] for p in phases)
    assert met / s["requests"] == pytest.approx(s["slo_attainment"], abs=1e-5)
    assert phases[0]["slo_attainment"] > 0.95 and phases[1]["slo_attainment"] < 0.5
    assert [p["mix"] for p in phases] == ["code-like", "chat-like", "code-like", "chat-like"]


def test_every_phase_of_the_workload_is_listed_even_without_arrivals():
    from types import SimpleNamespace

    from tidal.sim.report import by_phase

    reqs = [SimpleNamespace(arrival=t, outcome="finished") for t in (1.0, 2.0, 65.0)]  # none in [30, 60) nor past 90
    c = SimpleNamespace(requests=reqs, meets_slo=lambda r: r.arrival < 60)
    phases = by_phase(c, 30.0, ("code", "chat"), span_s=120.0)
    assert [(p["phase"], p["mix"], p["requests"], p["slo_attainment"]) for p in phases] == [
        (0, "code", 2, 1.0), (1, "chat", 0, None), (2, "code", 1, 0.0), (3, "chat", 0, None)]
    assert all(set(p) == {"phase", "mix", "start_s", "requests", "slo_attainment"} for p in phases)


def test_cli_goodput_compares_colocated_static_splits_and_planner(tmp_path, capsys):
    d = sim_json(tmp_path, "goodput", "goodput", "--instances", "3", "--workload", "azure-conv",
                 "--duration-s", "60", "--length-scale", "0.25", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200",
                 "--rate-tolerance", "0.1")
    names = [r["layout"] for r in d["results"]]
    assert names == ["colocated", "static 1:2", "static 2:1", "planner from 1:2"]
    assert sum(1 for r in d["results"] if r.get("best_static")) == 1
    assert all(r["goodput_rps"] > 0 for r in d["results"])
    # with the JSON in a file, stderr still shows the comparison: a line per layout, the best split marked
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tidal sim goodput: ")]
    assert [x.split(": ")[1] for x in lines] == names
    best = next(r for r in d["results"] if r.get("best_static"))
    assert sum("the best static split" in x and "x the best" not in x for x in lines) == 1
    assert f"{best['layout']}: {best['goodput_rps']:g} requests/s" in "\n".join(lines)
    assert f"{d['planner_vs_best_static']:g}x the best static split" in lines[-1]
    assert "moves at its goodput" in lines[-1]
    for r in d["results"]:  # every probe by rate; the goodput is the highest rate probed that met the SLOs
        probed = r["probed"]
        assert len(probed) == r["probes"] and probed == sorted(probed, key=lambda p: p["rate_scale"])
        assert max(p["rate_scale"] for p in probed if p["met"]) == r["rate_scale"]
        assert all(p["met"] == (p["slo_attainment"] >= 0.9) for p in probed)
        assert all(not p["met"] for p in probed if p["stopped_early"])
    final = d["results"][-1]["final_pools"]  # the planner's pools at the end of its run at its goodput
    assert set(final) == {"null", "prefill", "decode", "moving", "since_s"} and final["moving"] == 0
    assert final["null"] + final["prefill"] + final["decode"] == 3


def test_goodput_rate_samples_pool_the_runs_at_rates_spread_around_each_probe(tmp_path, capsys):
    """--rate-samples K: each probe's attainment is that of all the requests of K runs at rates spread evenly over
    RATE_SAMPLE_SPAN of the probe's rate (one run each, as `tidal sim run` gives it), the probe met where the pooled
    attainment meets the target; one sample is the probe's rate alone. A planner's attainment near its goodput moves
    by tens of points with a change of the rate as small as 1e-9 (the even mix at 64 instances at TTFT 16 s: 0.910
    at rate scale 31.76547, 0.712 at 31.76547036506039), so one run is one sample of a noisy curve."""
    import argparse

    from tidal.sim.cli import add_sim_args, load_cost, simulate
    from tidal.sim.goodput import RATE_SAMPLE_SPAN, sample_rates

    assert sample_rates(2.0, 1) == [2.0]
    three = sample_rates(2.0, 3)
    assert three == pytest.approx([2.0 * (1 - RATE_SAMPLE_SPAN / 2), 2.0, 2.0 * (1 + RATE_SAMPLE_SPAN / 2)])
    flags = ["--instances", "3", "--workload", "azure-conv", "--duration-s", "60", "--length-scale", "0.25",
             "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200", "--rate-tolerance", "0.1", "--layouts", "planner"]
    one = sim_json(tmp_path, "one", "goodput", *flags)
    pooled = sim_json(tmp_path, "pooled", "goodput", *flags, "--rate-samples", "3")
    assert one["rate_samples"] == 1 and pooled["rate_samples"] == 3
    assert all("samples" not in p for p in one["results"][0]["probed"])
    ns = argparse.ArgumentParser()
    add_sim_args(ns)
    ns = ns.parse_args(flags)
    cost = load_cost(ns.profile)
    probe = next(p for p in pooled["results"][0]["probed"] if p["met"])
    assert probe["samples"] == 3 and not probe["stopped_early"]
    runs = [simulate(ns, 0, 1, 2, "sla", r, cost) for r in sample_rates(probe["rate_scale"], 3)]
    met = sum(sum(1 for q in c.requests if q.outcome == "finished" and c.meets_slo(q)) for c in runs)
    assert probe["slo_attainment"] == pytest.approx(met / sum(len(c.requests) for c in runs), abs=1e-6)
    alone = next(p for p in one["results"][0]["probed"] if p["met"])
    c = simulate(ns, 0, 1, 2, "sla", alone["rate_scale"], cost)
    assert alone["slo_attainment"] == pytest.approx(
        sum(1 for q in c.requests if q.outcome == "finished" and c.meets_slo(q)) / len(c.requests), abs=1e-6)
    for p in pooled["results"][0]["probed"]:
        assert p["met"] == (not p["stopped_early"] and p["slo_attainment"] >= 0.9)
    capsys.readouterr()  # the searches' summaries
    assert "--rate-samples must be >= 1" in sim_error(capsys, ["sim", "goodput", "--rate-samples", "0"])


def test_cli_refuses_a_layout_that_does_not_add_up(capsys):
    assert "must add up to --instances 4" in sim_error(capsys, ["sim", "--instances", "4", "--prefill", "3",
                                                                 "--decode", "3"])


def test_split_step_refines_around_the_best_split():
    import argparse

    from tidal.sim.goodput import static_splits

    tried = []

    def measure(p: int) -> dict:
        tried.append(p)
        return {"goodput_rps": -abs(p - 22)}

    out = static_splits(argparse.Namespace(instances=64, split_step=8), measure)
    assert max(out, key=lambda r: r["goodput_rps"]) == {"goodput_rps": 0}
    assert len(tried) == len(set(tried)) <= 9 + 6
    assert sorted(tried)[:2] == [1, 9] and 63 in tried


def test_cli_goodput_layouts_picks_what_to_search(tmp_path):
    d = sim_json(tmp_path, "only", "goodput", "--instances", "3", "--null", "1", "--prefill", "1", "--decode", "1",
                 "--workload", "azure-conv", "--duration-s", "60", "--length-scale", "0.25", "--ttft-slo-ms", "8000",
                 "--tpot-slo-ms", "200", "--rate-tolerance", "0.1", "--layouts", "planner")
    assert [r["layout"] for r in d["results"]] == ["planner from 1:1 + 1 null"]
    assert d["planner_vs_best_static"] is None and d["planner_flags"]["planner_hysteresis"] == 0.3


def test_a_run_where_most_requests_miss_says_what_to_try(tmp_path, capsys):
    """The defaults (full-length code prompts, a 2-s TTFT SLO) on 3 servers meet almost nothing: the summary
    line is followed by a hint; a run that meets the SLOs gets none."""
    sim_json(tmp_path, "missed", "--instances", "3", "--duration-s", "20")
    err = capsys.readouterr().err
    assert "0.0% met both SLOs" in err and "most requests missed an SLO: try a lower --rate-scale" in err
    sim_json(tmp_path, "met", "--instances", "3", "--duration-s", "60", "--length-scale", "0.25", "--ttft-slo-ms",
             "8000", "--tpot-slo-ms", "200", "--rate-scale", "0.05")
    err = capsys.readouterr().err
    assert "100.0% met both SLOs" in err and "most requests missed" not in err


# ---------------------------------------------------------------- the lookahead (a planner that sees the future)


def test_known_misses_count_what_has_missed_or_must_by_now():
    """One null server, 1 s per prefill chunk, 0.1 s per decode step, TTFT SLO 2 s, TPOT SLO 50 ms. A's 5000-token
    prompt takes three chunks, so at 2.5 s it has waited past the TTFT SLO with no first token: a miss known before it
    ends. B arrives at 2.4: not yet. At 3.25 A decodes at 0.1 s a token, past the TPOT SLO."""
    from tidal.config import ServerArgs

    cfg = SimConfig(null=1, prefill=0, decode=0, planner=PlannerConfig(ttft_slo_s=2.0, tpot_slo_s=0.05))
    c = Cluster(cfg, flat_cost(), [TraceRequest(0.0, 5000, 4), TraceRequest(2.4, 100, 2)],
                Limits(ServerArgs(chunked_prefill_size=2048)))
    c.start()
    c.run_until(1.9)
    assert c.known_misses() == 0
    c.run_until(2.5)
    assert (c.missed, c.known_misses()) == (0, 1)
    c.run_until(100)
    assert c.ended == 2 and c.known_misses() == c.missed == 2  # A late, B's decode stalled behind A's chunks


def test_the_lookahead_heads_for_the_split_whose_copy_missed_fewest_and_is_deterministic():
    """Each look forks one copy of the cluster per split, runs it to the horizon headed for that split, and heads for
    the fewest known misses (ties: the split headed for, then the nearest). A copy of a cluster already at the split
    it tries moves nothing: at t = 0 its count is the static layout's at the horizon. The copies are processes: one
    at a time or two at once, the looks are the same."""
    spec = WorkloadSpec("shift", rate_scale=3.0, duration_s=120.0, phase_s=30.0, length_scale=0.25)
    trace = make_workload(spec)
    cost = CostModel.from_file(FIXED_PROFILE)
    planner = PlannerConfig(ttft_slo_s=8.0, tpot_slo_s=0.2)
    looks = []
    for jobs in (1, 2):
        cfg = SimConfig(prefill=2, decode=2, planner=planner, lookahead_splits=(1, 2, 3), lookahead_jobs=jobs,
                        lookahead_interval_s=10.0, lookahead_horizon_s=20.0)
        c = Cluster(cfg, cost, trace).run()
        assert c.ended == len(trace) and all(r.outcome == "finished" for r in c.requests)
        looks.append(c.lookahead)
    assert looks[0] == looks[1] and len(looks[0]) >= 12
    for look in looks[0]:
        fewest = min(look["misses"].values())
        assert look["misses"][look["split"]] == fewest
    static = Cluster(SimConfig(prefill=2, decode=2, planner=planner), cost, trace)
    static.start()
    static.run_until(20.0)
    assert looks[0][0]["t"] == 0 and looks[0][0]["misses"]["2:2"] == static.known_misses()
    assert {look["split"] for look in looks[0]} != {"2:2"}  # the phases make it move


def test_the_recent_forecast_replays_the_last_horizon_of_arrivals_in_a_copy():
    """--lookahead-forecast recent: a copy at t runs to t + h on the arrivals of [t - h, t] again, each shifted h
    on, instead of the trace's own (a planner that simulates its candidates knows only the traffic it has seen)."""
    from tidal.sim.lookahead import forecast_recent

    trace = [TraceRequest(float(t), 100 + t, 2 + t) for t in range(0, 40, 3)]  # arrivals at 0, 3, ..., 39
    c = Cluster(SimConfig(prefill=1, decode=1, planner=PlannerConfig(ttft_slo_s=8.0, tpot_slo_s=0.2)),
                CostModel.from_file(FIXED_PROFILE), trace)
    c.start()
    c.run_until(20.0)
    assert c.now == 20.0  # a health check's
    forecast_recent(c, 30.0)
    ahead = [(r.arrival, r.input_len, r.output_len) for r in c.requests if r.arrival > 20.0]
    assert ahead == [(t + 10.0, 100 + t, 2 + t) for t in (12, 15, 18)]  # not the trace's 21, 24, 27, 30
    assert len({r.rid for r in c.requests}) == len(c.requests) and [r.arrival for r in c.requests][:7] == [
        0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
    c.run_until(60.0)
    assert c.ended == len(c.requests) == 10  # the shifted arrivals come and end; the trace's later ones never come
    c = Cluster(c.cfg, c.cost, trace)
    c.start()
    c.run_until(10.0)
    assert c.now == 10.0  # a health check's
    forecast_recent(c, 25.0)  # a horizon longer than the past: the 10 s that have passed, repeated
    assert [r.arrival for r in c.requests if r.arrival > 10.0] == [13.0, 16.0, 19.0, 20.0, 23.0]


def test_cli_lookahead_run_and_goodput(tmp_path, capsys):
    flags = ["--instances", "4", "--workload", "shift", "--duration-s", "60", "--phase-s", "15", "--length-scale",
             "0.25", "--ttft-slo-ms", "8000", "--tpot-slo-ms", "200"]
    d = sim_json(tmp_path, "look", *flags, "--lookahead", "--lookahead-splits", "1,2,3", "--rate-scale", "3")
    assert d["config"]["planner"] == "lookahead" and d["lookahead"] and d["moves"]
    assert all(set(look["misses"]) == {"1:3", "2:2", "3:1"} for look in d["lookahead"])
    g = sim_json(tmp_path, "look_goodput", "goodput", *flags, "--layouts", "static,lookahead", "--rate-tolerance",
                 "0.1")
    look = g["results"][-1]
    assert look["planner"] == "lookahead" and look["goodput_rps"] > 0
    assert look["splits_at_goodput"][0][0] == 0 and look["moves_at_goodput"] >= 0
    best = next(r for r in g["results"] if r.get("best_static"))
    err = capsys.readouterr().err
    assert f"lookahead from 2:2: {look['goodput_rps']:g} requests/s" in err
    assert f"{round(look['goodput_rps'] / best['goodput_rps'], 3):g}x the best static split" in err
    d = sim_json(tmp_path, "look_recent", *flags, "--lookahead", "--lookahead-splits", "1,3", "--rate-scale", "3",
                 "--lookahead-forecast", "recent")
    assert d["lookahead"] and d["config"]["lookahead"]["forecast"] == "recent"


def test_a_costly_lookahead_is_warned_of(tmp_path, capsys):
    flags = ["--instances", "4", "--workload", "shift", "--duration-s", "4", "--phase-s", "2", "--rate-scale", "1"]
    sim_json(tmp_path, "costly", *flags, "--lookahead", "--lookahead-interval-s", "1", "--lookahead-horizon-s", "40")
    assert "the lookahead simulates each virtual second ~120 times (--lookahead-horizon-s 40 / " \
           "--lookahead-interval-s 1 x 3 splits)" in capsys.readouterr().err
    sim_json(tmp_path, "cheap", *flags, "--lookahead")
    assert "warning: the lookahead" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--lookahead-splits", "2,x"], "--lookahead-splits: 'x' is not a number of prefill workers"),
    (["--instances", "4", "--lookahead-splits", "4"], "--lookahead-splits: 4 leaves no prefill or no decode"),
    (["--lookahead-horizon-s", "0"], "--lookahead-horizon-s must be > 0"),
    (["--lookahead-interval-s", "-1"], "--lookahead-interval-s must be > 0"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--lookahead", "--planner", "sla"], "--lookahead replaces the planner in a run"),
    (["goodput", "--lookahead"], "--lookahead is for one run"),
    (["--lookahead", "--instances", "1", "--null", "1"], "it needs --instances 2 or more"),
    (["--lookahead-horizon-s", "60", "--jobs", "2"], "--lookahead-horizon-s, --jobs: no lookahead runs"),
    (["goodput", "--lookahead-splits", "1"], "--lookahead-splits: no lookahead runs"),
])
def test_bad_lookahead_flags_are_one_clear_line(capsys, flags, says):
    argv = ["sim"] + flags if flags[0] == "goodput" else ["sim", "run"] + flags
    assert says in sim_error(capsys, argv)
