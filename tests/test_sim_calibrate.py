"""`tidal sim calibrate` replays a live `tidal bench` run through the simulator, and the
simulator's host sharing (instances on one host with fewer cores than their threads)."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest

from tidal.cli import main as tidal_main
from tidal.profile.cost import CostModel
from tidal.sim.calibrate import calibrate, calibrate_layout, compare, replayed_trace
from tidal.sim.engine import Cluster, SimConfig
from tidal.sim.instance import Limits
from tidal.sim.workload import TraceRequest

# 1 s per prefill of up to 1000 tokens, 10 ms per decode step: easy to follow by hand
COST = {
    "version": 1, "server": {"max_total_tokens": 100000, "torch_threads": 1},
    "prefill": [{"tokens": 1, "seconds": 1.0}, {"tokens": 1000, "seconds": 1.0}],
    "decode": [{"batch": b, "context_tokens": c, "step_seconds": 0.01} for b in (1, 64) for c in (0, 100000)],
    "kv_transfer": [], "switch": [],
}


def record(start: float, ttft: float, out: int, success: bool = True, prompt: int = 100) -> dict:
    e2e = ttft + 0.02 * (out - 1)
    return {"success": success, "error": "" if success else "HTTP 500: x", "ttft": ttft if success else 0.0,
            "itl": [], "e2e": e2e if success else 0.0, "prompt_tokens": prompt,
            "output_tokens": out if success else 0, "start": start, "requested_output_tokens": out,
            "tpot": (e2e - ttft) / (out - 1) if success and out > 1 else None}


BENCH = {"config": {}, "requests": [record(0.5, 1.2, 4), record(0.0, 1.1, 8), record(3.0, 1.0, 1),
                                    record(4.0, 0.0, 6, success=False), record(6.0, 1.3, 10, prompt=40)]}


def test_replay_is_the_live_requests_in_send_order():
    trace = replayed_trace(BENCH)
    assert trace == [TraceRequest(0.0, 100, 8), TraceRequest(0.5, 100, 4), TraceRequest(3.0, 100, 1),
                     TraceRequest(4.0, 100, 6), TraceRequest(6.0, 40, 10)]  # the failed one: its asked length


def test_compare_reports_both_sides_and_the_relative_error():
    live = {"ttft": [1.0, 2.0, 3.0], "tpot": [0.1, 0.1]}
    sim = {"ttft": [1.5, 2.5, 3.5], "tpot": [0.1, 0.1]}
    out = compare(live, sim, 0.25)
    assert out["metrics"]["ttft_p50"] == pytest.approx({"live_ms": 2000.0, "sim_ms": 2500.0, "rel_err": 0.25})
    assert out["metrics"]["tpot_p90"]["rel_err"] == pytest.approx(0.0)
    assert out["passed"] is True
    assert compare(live, sim, 0.2)["passed"] is False
    assert compare(live, {"ttft": [], "tpot": []}, 0.25)["passed"] is False  # nothing simulated: NaN fails


def test_calibrate_simulates_every_live_request():
    cfg = SimConfig(null=1, prefill=0, decode=0)
    out = calibrate(BENCH, CostModel.from_dict(COST), cfg, Limits(), 0.25)
    assert out["requests"] == {"live": 5, "live_succeeded": 4, "replayed": 5, "sim_finished": 5, "sim_rejected": 0,
                               "sim_unfinished": 0}
    assert out["arrivals_s"] == [0.0, 0.5, 3.0, 4.0, 6.0]
    live = out["metrics"]["ttft_p50"]
    assert live["live_ms"] == pytest.approx(1150.0)  # the median of the 4 successful TTFTs
    assert all(math.isfinite(v) and v > 0 for row in out["metrics"].values() for v in (row["live_ms"], row["sim_ms"]))


def _ttfts(host_cores):
    """Three 1-token requests at t=0 on three null servers of one thread each."""
    cfg = SimConfig(null=3, prefill=0, decode=0, policy="round_robin", host_cores=host_cores, instance_threads=1)
    trace = [TraceRequest(0.0, 100, 1) for _ in range(3)]
    c = Cluster(cfg, CostModel.from_dict(COST), trace).run()
    assert [r.outcome for r in c.requests] == ["finished"] * 3
    return [c.ttft_tpot(r)[0] for r in c.requests]


def test_host_sharing_stretches_steps_computed_at_once():
    assert _ttfts(None) == pytest.approx([1.0] * 3)
    assert _ttfts(3) == pytest.approx([1.0] * 3)
    assert _ttfts(2) == pytest.approx([1.5] * 3)  # 3 one-thread prefills on 2 cores: 2/3 speed each


def test_on_a_shared_host_a_kv_copy_takes_a_cores_share():
    """One core; prefill 1 s a prompt, the KV copy 1 s. A's copy and B's prefill share the core from 1 s on and
    both end at 3 s; B's copy then runs alone until 4 s. Each first token comes once its KV is on the decode
    server (1-token answers: no decode step). With their own cores the copy is time on the wire."""
    cost = {**COST, "kv_transfer": [{"tokens": 1, "bytes": 1, "seconds": 1.0},
                                    {"tokens": 1000, "bytes": 1000, "seconds": 1.0}]}

    def ttfts(host_cores):
        cfg = SimConfig(null=0, prefill=1, decode=1, host_cores=host_cores, instance_threads=1)
        c = Cluster(cfg, CostModel.from_dict(cost), [TraceRequest(0.0, 100, 1), TraceRequest(1.0, 100, 1)]).run()
        assert [r.outcome for r in c.requests] == ["finished"] * 2
        assert all(inst.sending == 0 for inst in c.instances.values()) and not c._copying
        return [c.ttft_tpot(r)[0] for r in c.requests]

    assert ttfts(1) == pytest.approx([3.0, 3.0])
    assert ttfts(None) == pytest.approx([2.0, 2.0])


def test_host_sharing_speeds_up_when_a_neighbour_finishes():
    cfg = SimConfig(null=2, prefill=0, decode=0, policy="round_robin", host_cores=1, instance_threads=1)
    trace = [TraceRequest(0.0, 100, 1), TraceRequest(0.5, 100, 1)]
    c = Cluster(cfg, CostModel.from_dict(COST), trace).run()
    # alone 0-0.5 s (0.5 s of work), then half speed: the first ends at 1.5 s; the second did 0.5 s by
    # then and finishes its last 0.5 s alone, at 2.0 s
    assert [c.ttft_tpot(r)[0] for r in c.requests] == pytest.approx([1.5, 1.5])


def test_calibrate_command_writes_both_sides(tmp_path, capsys):
    bench, profile, out = tmp_path / "live.json", tmp_path / "profile.json", tmp_path / "calib.json"
    bench.write_text(json.dumps(BENCH))
    profile.write_text(json.dumps(COST))
    rc = tidal_main(["sim", "calibrate", "--bench-json", str(bench), "--profile", str(profile), "--null", "1",
                     "--prefill", "0", "--decode", "0", "--host-cores", "2", "--output", str(out)])
    result = json.loads(out.read_text())
    assert rc == (0 if result["passed"] else 1)
    assert result["config"]["host_cores"] == 2 and result["config"]["simulated"] is True
    assert result["requests"]["replayed"] == 5
    assert "ttft_p50" in capsys.readouterr().out


def shifting_run() -> dict:
    """scripts/live_shift.py's JSON, small: phase 0 long prompts (prefill-heavy), phase 1 long answers; the
    live planner moved the null worker to prefill at 2.5 s and the prefill worker to decode at 12 s (a
    third move failed)."""
    phase0 = [{**record(0.5 * i, 1.5, 2, prompt=900), "phase": 0} for i in range(8)]
    phase1 = [{**record(10.0 + 0.5 * i, 0.2, 40, prompt=20), "phase": 1} for i in range(8)]
    moves = [{"seen_t": 4.0, "at_s": 2.5, "kind": "move", "reason": "r", "url": "u1", "src": "null", "dst": "prefill",
              "outcome": "ok"},
             {"seen_t": 14.0, "at_s": 12.0, "kind": "move", "reason": "r", "url": "u2", "src": "prefill",
              "dst": "decode", "outcome": "ok"},
             {"seen_t": 16.0, "at_s": 15.0, "kind": "move", "reason": "r", "url": "u3", "src": "decode",
              "dst": "prefill", "outcome": "failed: x"}]
    config = {"mode": "sla", "ttft_slo_s": 3.0, "tpot_slo_s": 0.15, "interval_s": 2.0, "window_s": 20.0}
    handovers = [{"url": "u3", "mode": "prefill", "seen_t": 16.0, "ended_t": 18.0, "handover_ms": 1500.0}]
    return {"requests": phase1 + phase0, "moves": moves, "planner_config": config, "phases": [],
            "handovers": handovers}


def test_a_run_that_moved_is_replayed_with_its_moves_and_each_phases_latencies(tmp_path, capsys):
    live, profile, out = tmp_path / "live_shift.json", tmp_path / "profile.json", tmp_path / "calib.json"
    live.write_text(json.dumps(shifting_run()))
    profile.write_text(json.dumps(COST))
    args = ["sim", "calibrate", "--bench-json", str(live), "--profile", str(profile), "--null", "1", "--prefill", "1",
            "--decode", "1", "--output", str(out)]
    tidal_main(args)
    result = json.loads(out.read_text())
    assert result["config"]["moves"] == "live"
    sim = result["moves"]["sim"]
    assert [(m["at_s"], m["src"], m["dst"], m["outcome"]) for m in sim] == [
        (2.5, "null", "prefill", "ok"), (12.0, "prefill", "decode", "ok")]  # the failed live move is not replayed
    assert len(result["moves"]["live"]) == 3 and result["moves"]["live_handovers"][0]["handover_ms"] == 1500.0
    assert [(ph["phase"], ph["requests"]) for ph in result["phases"]] == [(0, 8), (1, 8)]
    for ph in result["phases"]:
        assert ph["metrics"]["ttft_p50"]["live_ms"] == pytest.approx(1500.0 if ph["phase"] == 0 else 200.0)
        assert math.isfinite(ph["metrics"]["ttft_p50"]["sim_ms"])
    printed = capsys.readouterr().out
    assert "phase 1 (8 requests)" in printed and "sim move at 12.0 s: prefill -> decode (ok" in printed
    assert "live handover to prefill seen at 16.0 s: 1.5 s" in printed

    tidal_main(args[:-2] + ["--moves", "planner", "--output", str(out)])  # the simulator's planner decides
    result = json.loads(out.read_text())
    assert result["config"]["moves"] == "planner" and result["config"]["planner"]["interval_s"] == 2.0
    assert result["config"]["planner"]["mode"] == "sla" and result["requests"]["sim_finished"] == 16


def test_moves_planner_needs_the_live_planners_settings(tmp_path, capsys):
    run = shifting_run()
    del run["planner_config"]
    live, profile = tmp_path / "live_shift.json", tmp_path / "profile.json"
    live.write_text(json.dumps(run))
    profile.write_text(json.dumps(COST))
    with pytest.raises(SystemExit):
        tidal_main(["sim", "calibrate", "--bench-json", str(live), "--profile", str(profile), "--moves", "planner"])
    assert "no planner_config" in capsys.readouterr().err


def test_a_replayed_move_waits_for_a_worker_of_its_pool():
    """The second move needs a null worker, which exists only once the first one has landed."""
    cfg = SimConfig(null=0, prefill=1, decode=2, replayed_moves=((1.0, "decode", "null"), (1.0, "null", "prefill")))
    c = Cluster(cfg, CostModel.from_dict(COST), [TraceRequest(0.0, 100, 400)]).run()
    first, second = c.moves
    assert (first.started, first.src, first.dst, first.outcome) == (1.0, "decode", "null", "ok")
    assert second.worker == first.worker and second.started == pytest.approx(1.1) and second.outcome == "ok"
    assert c.registry.get(first.worker).mode == "prefill" and c.requests[0].outcome == "finished"


def test_a_replayed_live_worker_is_the_same_simulated_worker_each_time():
    """Live worker "b" moves twice: both moves take the simulated worker that stood for it first, though
    the other decode worker has less to drain at the second."""
    moves = ((1.0, "decode", "prefill", "b"), (2.0, "prefill", "decode", "b"), (3.0, "decode", "null", "b"))
    cfg = SimConfig(null=0, prefill=1, decode=2, replayed_moves=moves)
    c = Cluster(cfg, CostModel.from_dict(COST), [TraceRequest(0.0, 100, 400), TraceRequest(2.5, 100, 400)]).run()
    assert len({m.worker for m in c.moves}) == 1 and [m.outcome for m in c.moves] == ["ok"] * 3
    assert c.registry.get(c.moves[0].worker).mode == "null"


@pytest.mark.parametrize("null, prefill, decode, layout", [
    (0, None, None, (0, 1, 1)), (1, None, None, (1, 0, 0)), (1, 1, 1, (1, 1, 1)), (1, 2, None, (1, 2, 1))])
def test_calibrate_layout_is_the_live_runs(null, prefill, decode, layout):
    """A live run of null servers alone needs only --null; prefill and decode not given are 1 each otherwise."""
    assert calibrate_layout(argparse.Namespace(null=null, prefill=prefill, decode=decode)) == layout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calibrate_replays_a_live_three_server_run(tmp_path):
    """A real `tidal cluster` (1 prefill, 1 decode, 1 null), a short Azure slice through `tidal bench`,
    then `tidal sim calibrate` on its JSON: the same requests, at the same offsets, on both sides."""
    from servers import Server, free_port, free_port_block

    port, base, bport = free_port(), free_port_block(3), free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1", "--worker", "1",
           "--port", str(port), "--base-port", str(base), "--bootstrap-base-port", str(bport),
           "--server-args", "--max-total-tokens 8192"]
    cluster = Server(cmd=cmd, port=port)
    live = tmp_path / "live.json"
    try:
        tidal_main(["bench", "--url", cluster.url, "--dataset", "azure-conv", "--num-prompts", "10",
                    "--trace-speedup", "2", "--max-input-len", "64", "--max-output-len", "8", "--warmup-requests", "1",
                    "--disable-tqdm", "--output-file", str(live)])
    finally:
        cluster.stop()
    bench = json.loads(live.read_text())
    assert bench["failed"] == 0 and len(bench["requests"]) == 10
    out = tmp_path / "calib.json"
    tidal_main(["sim", "calibrate", "--bench-json", str(live), "--null", "1", "--prefill", "1", "--decode", "1",
                "--host-cores", "2", "--output", str(out)])
    result = json.loads(out.read_text())
    sent = sorted(bench["requests"], key=lambda r: r["start"])
    assert result["arrivals_s"] == [r["start"] for r in sent]
    assert result["requests"]["replayed"] == 10 and result["requests"]["sim_finished"] == 10
    assert all(r["requested_output_tokens"] == r["output_tokens"] for r in sent)  # ignore_eos: lengths as asked
    for row in result["metrics"].values():
        assert math.isfinite(row["live_ms"]) and row["live_ms"] > 0
        assert math.isfinite(row["sim_ms"]) and row["sim_ms"] > 0


def test_the_cluster_settings_profile_is_shipped():
    """The profile the calibration uses: one server as `tidal cluster` starts 3 on 2 cores."""
    import os

    from tidal.sim.cli import DEFAULT_PROFILE

    path = os.path.join(os.path.dirname(DEFAULT_PROFILE), "smollm2_cpu_1thread.json")
    server = CostModel.from_file(path).profile.server
    assert (server.torch_threads, server.transfer_backend) == (1, "shm")
    assert CostModel.from_file(path).kv_transfer_seconds(512) > 0
    assert CostModel.from_file(path).profile.prefill_batch  # a burst's prompts are prefilled together
