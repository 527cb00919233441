"""The planner's loop inside a real router (uvicorn, in-process) over mock workers
(tests/mock_worker.py, real HTTP servers that can switch roles): it moves a worker toward
the starved pool through the drain-switch-verify path, reports it on /planner/status and
/metrics, and does not loop on a worker whose switch fails."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from mock_worker import MockWorker
from test_planner import PROFILE
from router_server import RouterServer, wait_for
from tidal.planner.schema import PlannerConfig

pytestmark = pytest.mark.timeout(60)

STARVED = {"num_reqs": 6, "num_waiting_reqs": 5, "num_tokens": 100, "num_queued_prefill_tokens": 50000,
           "max_total_tokens": 65536}


@pytest.fixture
def workers():
    ws = {"p1": MockWorker("prefill", "p1"), "d1": MockWorker("decode", "d1"), "d2": MockWorker("decode", "d2")}
    try:
        yield {name: w.start() for name, w in ws.items()}
    finally:
        for w in ws.values():
            w.stop()


def router(ws: dict, tmp_path, **planner) -> RouterServer:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    cfg = PlannerConfig(**{"mode": "sla", "ttft_slo_s": 3.0, "tpot_slo_s": 0.1, "interval_s": 0.2,
                           "cooldown_s": 0.3, "worker_cooldown_s": 0.3, **planner})
    return RouterServer(prefill=[(ws["p1"].url, 8998)], decode=[ws["d1"].url, ws["d2"].url], planner=cfg,
                        planner_profile=str(profile))


def send_traffic(r: RouterServer, n: int = 6) -> None:
    for i in range(n):
        body = {"text": f"hello {i}", "sampling_params": {"max_new_tokens": 3}, "stream": i % 2 == 0}
        assert httpx.post(r.url + "/generate", json=body, timeout=10).status_code == 200


def test_planner_moves_a_decode_worker_to_the_starved_prefill_pool(workers, tmp_path):
    workers["p1"].load = dict(STARVED)
    with router(workers, tmp_path) as r:
        send_traffic(r)
        wait_for(lambda: len(r.state.registry.pool("prefill")) == 2, 10, "a worker moved to prefill")
        moved = [w for w in (workers["d1"], workers["d2"]) if w.role == "prefill"]
        assert len(moved) == 1 and moved[0].epoch == 1
        send_traffic(r, 2)  # still served, now by the new layout
        time.sleep(1.0)  # a few more intervals: the decode pool is at its minimum, nothing else moves
        assert len(r.state.planner.window.open) == 0  # every request's ticket closed as it ended
        status = httpx.get(r.url + "/planner/status").json()
        metrics = httpx.get(r.url + "/metrics").text
    assert sum(w.switches for w in workers.values()) == 1
    assert status["mode"] == "sla" and status["cost_model"].endswith("profile.json")
    assert sorted(status["pools"]["prefill"]) == sorted([workers["p1"].url, moved[0].url])
    moves = [d for d in status["decisions"] if d["kind"] == "move"]
    assert len(moves) == 1 and moves[0]["outcome"] == "ok" and moves[0]["dst"] == "prefill"
    assert moves[0]["timings_ms"] == {"drain": 0.0, "switch": 1.5}  # the worker's, as it answered the switch
    assert moves[0]["worker_message"] == "switched to prefill"
    assert moves[0]["current"]["paths"]["pd"]["ttft_s"] > 3.0
    assert status["decisions"][0]["kind"] == "hold" and status["traffic"]["arrival_rate"] > 0
    assert abs(moves[0]["at_unix"] - time.time()) < 60  # the wall clock's, to match the log lines
    assert moves[0]["why"] == "" and status["decisions"][0]["why"]
    assert status["current"]["pools"] == {"null": 0, "prefill": 2, "decode": 1}
    assert 'tidal_router:planner_moves_total{from="decode",outcome="ok",to="prefill"} 1.0' in metrics
    assert 'tidal_router:planner_predicted_ttft_seconds{pool="prefill"}' in metrics
    assert 'tidal_router:planner_decisions_total{kind="hold"}' in metrics


def test_the_planner_takes_the_workers_counters_as_it_starts(workers, tmp_path):
    """Before its first round (an interval later) the planner snapshots every worker's prompt counters: the
    baseline its first round counts the prompts received from."""
    workers["p1"].load = {"num_reqs": 0, "prompts_received_total": 40, "prompt_tokens_received_total": 12000}
    with router(workers, tmp_path, interval_s=30.0) as r:
        received = r.state.planner.window.received
        wait_for(lambda: workers["p1"].url in received.last, 10, "the baseline snapshot")
        assert received.last[workers["p1"].url] == ("prefill", 40, 12000)
        assert r.state.planner.last is None  # no round yet


def test_a_pool_below_the_floor_as_the_planner_starts_is_warned_of(workers, tmp_path, caplog):
    def warned() -> bool:
        return any("--planner-min-per-pool 2: the prefill pool has 1 worker;" in x.getMessage()
                   for x in caplog.records if x.levelname == "WARNING")

    with router(workers, tmp_path, interval_s=30.0, min_per_pool=2):
        wait_for(warned, 10, "the warning, as the planner takes its baseline")


def test_advise_reports_the_move_it_would_make_and_moves_nothing(workers, tmp_path):
    """--planner advise: the same decisions as sla, each move reported (kind "advise": status, metrics, log)
    and not started, round after round (one entry of the status's history, counting the repeats)."""
    workers["p1"].load = dict(STARVED)
    with router(workers, tmp_path, mode="advise") as r:
        send_traffic(r)
        wait_for(lambda: any(d.kind == "advise" and d.repeats >= 1 for d in r.state.planner.decisions), 10,
                 "the move advised twice")
        status = httpx.get(r.url + "/planner/status").json()
        metrics = httpx.get(r.url + "/metrics").text
        assert len(r.state.registry.pool("prefill")) == 1 and len(r.state.registry.pool("decode")) == 2
    assert sum(w.switches for w in workers.values()) == 0
    advised = [d for d in status["decisions"] if d["kind"] == "advise"]
    assert status["mode"] == "advise" and advised[0]["src"] == "decode" and advised[0]["dst"] == "prefill"
    assert advised[0]["reason"].endswith("->prefill") and advised[0]["outcome"] == ""
    assert 'tidal_router:planner_decisions_total{kind="advise"}' in metrics
    assert "tidal_router:planner_moves_total{" not in metrics


def test_a_walk_of_two_moves_does_not_wait_an_interval_between_them(tmp_path):
    """One move at a time and a 4-s interval: the second move toward 3P:1D starts as the first lands."""
    ws = {name: MockWorker(role, name).start() for name, role in
          (("p1", "prefill"), ("d1", "decode"), ("d2", "decode"), ("d3", "decode"))}
    try:
        ws["p1"].load = dict(STARVED)
        cfg = PlannerConfig(mode="sla", ttft_slo_s=3.0, tpot_slo_s=0.1, interval_s=4.0, cooldown_s=0.3,
                            worker_cooldown_s=0.3, max_concurrent_moves=1)
        profile = tmp_path / "profile.json"
        profile.write_text(json.dumps(PROFILE))
        with RouterServer(prefill=[(ws["p1"].url, 8998)], decode=[ws[d].url for d in ("d1", "d2", "d3")],
                          planner=cfg, planner_profile=str(profile)) as r:
            send_traffic(r)
            wait_for(lambda: len(r.state.registry.pool("prefill")) == 3, 20, "two workers moved to prefill")
            status = httpx.get(r.url + "/planner/status").json()
    finally:
        for w in ws.values():
            w.stop()
    moves = sorted((d for d in status["decisions"] if d["kind"] == "move"), key=lambda d: d["at"])
    assert len(moves) == 2 and all(m["outcome"] == "ok" for m in moves), moves
    assert moves[1]["at"] - moves[0]["at"] < 2.0, [m["at"] for m in moves]


def test_failed_switch_leaves_the_worker_and_is_not_retried_within_its_backoff(workers, tmp_path):
    workers["p1"].load = dict(STARVED)
    for w in (workers["d1"], workers["d2"]):
        w.fail_switch = True
    with router(workers, tmp_path, backoff_base_s=60.0) as r:
        send_traffic(r)
        wait_for(lambda: workers["d1"].switches + workers["d2"].switches >= 2, 10, "both decode workers tried")
        time.sleep(1.5)  # many intervals and cooldowns later
        status = httpx.get(r.url + "/planner/status").json()
        assert [w.switches for w in (workers["d1"], workers["d2"])] == [1, 1]
        assert len(r.state.registry.pool("decode")) == 2 and len(r.state.registry.pool("prefill")) == 1
        send_traffic(r, 2)
    moves = [d for d in status["decisions"] if d["kind"] == "move"]
    assert len(moves) == 2 and all(m["outcome"].startswith("failed") for m in moves)
    assert status["decisions"][0]["reason"].startswith("no legal move toward the target (backoff after 1 failed")
    memory = status["cooldown"]["workers"].values()
    assert all(v["failures"] == 1 and v["blocked"].startswith("backoff") for v in memory)


def test_a_batched_request_counts_each_item_toward_the_window(workers):
    with RouterServer(prefill=[(workers["p1"].url, 8998)], decode=[workers["d1"].url, workers["d2"].url]) as r:
        body = {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 3}}
        resp = httpx.post(r.url + "/generate", json=body, timeout=10)
        assert resp.status_code == 200 and len(resp.json()) == 3
        window = r.state.planner.window
        assert len(window.arrivals) == 3 and len(window.completions) == 3
        traffic = window.traffic(time.monotonic())
    # each item: 4 prompt tokens and 3 answer tokens (the mock's), not the batch's 12 and 9
    assert traffic.completed == 3 and traffic.mean_input_tokens == 4 and traffic.mean_output_tokens == 3
    # a whole answer's TTFT and TPOT: the server's own (the mock's meta_info)
    assert traffic.ttft_s == {"pd": pytest.approx(0.01)} and traffic.tpot_s == {"pd": pytest.approx(0.01)}


def test_a_whole_openai_answer_gives_the_window_the_servers_server_timing_and_the_client_too(workers):
    for w in (workers["d1"], workers["d2"]):
        w.openai_answers, w.server_timing = True, "ttft;dur=20, tpot;dur=5"
    with RouterServer(prefill=[(workers["p1"].url, 8998)], decode=[workers["d1"].url, workers["d2"].url]) as r:
        resp = httpx.post(r.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=10)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert resp.headers["server-timing"] == "ttft;dur=20, tpot;dur=5"
        traffic = r.state.planner.window.traffic(time.monotonic())
    assert traffic.completed == 1 and traffic.mean_input_tokens == 4 and traffic.mean_output_tokens == 3
    assert traffic.ttft_s == {"pd": pytest.approx(0.02)} and traffic.tpot_s == {"pd": pytest.approx(0.005)}


def test_server_timing_survives_the_logprobs_merge_and_a_non_ascii_one_is_dropped_not_fatal(workers):
    with RouterServer(prefill=[(workers["p1"].url, 8998)], decode=[workers["d1"].url, workers["d2"].url]) as r:
        for w in (workers["d1"], workers["d2"]):
            w.server_timing = "ttft;dur=7"
        body = {"text": "a", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
        merged = httpx.post(r.url + "/generate", json=body, timeout=10)
        assert merged.status_code == 200 and merged.headers["server-timing"] == "ttft;dur=7"
        assert merged.json()["meta_info"]["input_token_logprobs"][0][1] == 11  # the prefill leg's, merged in
        for w in (workers["d1"], workers["d2"]):
            w.server_timing = "ttft;dur=7;desc=caf\u00e9"
        odd = httpx.post(r.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 3}}, timeout=10)
        assert odd.status_code == 200 and "server-timing" not in odd.headers


def test_a_request_the_server_refuses_is_no_arrival(workers):
    workers["d1"].reject = workers["d2"].reject = True  # 400, the client's mistake
    with RouterServer(prefill=[(workers["p1"].url, 8998)], decode=[workers["d1"].url, workers["d2"].url]) as r:
        body = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3}}
        assert httpx.post(r.url + "/generate", json=body, timeout=10).status_code == 400
        window = r.state.planner.window
        assert len(window.arrivals) == 0 and len(window.arrival_history) == 0 and len(window.completions) == 0
        workers["d1"].reject = workers["d2"].reject = False
        assert httpx.post(r.url + "/generate", json=body, timeout=10).status_code == 200
        assert len(window.arrivals) == 2


def test_static_planner_serves_status_and_never_moves(workers, tmp_path):
    workers["p1"].load = dict(STARVED)
    with RouterServer(prefill=[(workers["p1"].url, 8998)], decode=[workers["d1"].url, workers["d2"].url]) as r:
        send_traffic(r)
        status = httpx.get(r.url + "/planner/status").json()
    assert status["mode"] == "static" and status["decisions"] == []
    assert status["traffic"]["arrival_rate"] > 0 and status["traffic"]["mean_output_tokens"] == 3
    assert sum(w.switches for w in workers.values()) == 0


def test_the_decision_log_line_of_a_layout_with_no_usable_path_says_so():
    from tidal.planner.loop import _brief
    from tidal.planner.predict import UNSERVABLE
    from tidal.planner.schema import Prediction

    assert _brief(Prediction(pools={"null": 0, "prefill": 0, "decode": 0}, paths={}, score=UNSERVABLE)) == \
        "nothing (no usable path)"


def test_a_hand_move_starts_the_planners_cooldowns_and_drops_its_target(workers, tmp_path):
    """A move through /admin/set_worker_role is known to the planner as its own moves are: the reversal and
    the worker cooldowns run from it (so the next round does not undo it), and the layout the planner had
    committed to is dropped."""
    with router(workers, tmp_path, interval_s=60.0, cooldown_s=30.0, worker_cooldown_s=None) as r:
        planner = r.state.planner
        planner.state.committed = {"null": 0, "prefill": 2, "decode": 1}
        d2 = workers["d2"].url
        resp = r.post("/admin/set_worker_role", {"url": d2, "mode": "prefill"})
        assert resp.status_code == 200, resp.text
        now, cfg = planner.clock(), planner.cfg
        assert planner.state.committed is None and planner.state.in_flight == {}
        assert "cooldown after a move decode->prefill" in planner.state.reversal(now, "prefill", "decode", cfg)
        assert planner.state.worker_blocked(now, d2, cfg).startswith("worker cooldown")
        assert planner.heading_layout() == {"null": 0, "prefill": 2, "decode": 1}
        status = httpx.get(r.url + "/planner/status").json()
        assert "decode->prefill" in status["cooldown"]["recent_moves"]
        assert status["config"]["worker_cooldown_s"] == 90.0  # as it applies: the default, 3x the cooldown
        assert status["cooldown"]["workers"][d2]["blocked"].startswith("worker cooldown")
        workers["d1"].fail_switch = True  # a failed hand move backs the worker off, as a failed planner move
        resp = r.post("/admin/set_worker_role", {"url": workers["d1"].url, "mode": "null"})
        assert resp.status_code == 500 and planner.state.workers[workers["d1"].url].failures == 1
        status = httpx.get(r.url + "/planner/status").json()
        metrics = httpx.get(r.url + "/metrics").text
        # removed, the worker's backoff goes with it: added again (a new server perhaps), it starts afresh
        assert httpx.post(r.url + "/remove_worker", params={"url": workers["d1"].url}).status_code == 200
        assert workers["d1"].url not in planner.state.workers
    workers["d1"].fail_switch = False
    # both moves are in the status's history, newest first, and in the metrics (none is the planner's own)
    hand = [(d["url"], d["src"], d["dst"], d["outcome"][:7]) for d in status["decisions"] if d["kind"] == "hand"]
    assert hand == [(workers["d1"].url, "decode", "null", "failed:"), (d2, "decode", "prefill", "ok")]
    assert "set_worker_role" in status["decisions"][0]["reason"]
    assert 'tidal_router:hand_moves_total{from="decode",outcome="ok",route="router",to="prefill"} 1.0' in metrics
    assert 'tidal_router:hand_moves_total{from="decode",outcome="failed",route="router",to="null"} 1.0' in metrics
    assert "tidal_router:planner_moves_total{" not in metrics


def test_two_hand_moves_of_one_worker_at_once_are_one_move(workers, tmp_path):
    """Two moves of d2 asked at the same instant, while the router reads d2's load (a handover's check): one
    moves it, the other is refused (409) before it starts anything, so the planner sees one move by hand, in
    flight for as long as it lasts, and counted once."""
    from concurrent.futures import ThreadPoolExecutor

    workers["d2"].load_delay_s, workers["d2"].switch_delay_s = 0.3, 0.6
    with router(workers, tmp_path, interval_s=60.0, cooldown_s=30.0) as r:
        planner, d2 = r.state.planner, workers["d2"].url
        with ThreadPoolExecutor(3) as pool:
            asked = [pool.submit(r.post, "/admin/set_worker_role", {"url": d2, "mode": mode})
                     for mode in ("prefill", "null")]
            in_flight, deadline = {}, time.time() + 5  # the winner's switch is under way (polled: a loaded
            while not in_flight and time.time() < deadline:  # machine may take more than a fixed sleep)
                in_flight = dict(planner.state.in_flight)
                time.sleep(0.01)
            codes = sorted(f.result().status_code for f in asked)
        status = httpx.get(r.url + "/planner/status").json()
        metrics = httpx.get(r.url + "/metrics").text
    assert codes == [200, 409] and workers["d2"].switches == 1
    assert list(in_flight) == [d2] and planner.state.in_flight == {}
    hand = [d for d in status["decisions"] if d["kind"] == "hand"]
    assert len(hand) == 1 and hand[0]["outcome"] == "ok", hand
    assert metrics.count("tidal_router:hand_moves_total{") == 1 and 'outcome="ok"' in metrics


def test_a_hand_move_to_the_workers_own_mode_is_no_move(workers, tmp_path):
    """Asking for the mode a worker is in answers 200 with the worker's word for it, and starts no cooldown: the
    planner may still move that worker at its next round. A body with a field the route does not know (the
    worker's own switch takes `timeout_s` and `drain`, this one does not) is a 400, not silently ignored."""
    with router(workers, tmp_path, interval_s=60.0, cooldown_s=30.0, worker_cooldown_s=None) as r:
        planner = r.state.planner
        d2 = workers["d2"].url
        resp = r.post("/admin/set_worker_role", {"url": d2, "mode": "decode"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["mode"] == "decode" and "already in decode mode" in resp.json()["message"]
        now, cfg = planner.clock(), planner.cfg
        assert planner.state.worker_blocked(now, d2, cfg) == ""
        assert planner.state.reversal(now, "decode", "prefill", cfg) == ""
        assert httpx.get(r.url + "/planner/status").json()["cooldown"]["recent_moves"] == {}
        for extra in ({"timeout_s": -1}, {"drain": False}):
            resp = r.post("/admin/set_worker_role", {"url": d2, "mode": "prefill", **extra})
            assert resp.status_code == 400 and next(iter(extra)) in resp.json()["error"]["message"], resp.text
        assert workers["d2"].role == "decode" and planner.state.worker_blocked(now, d2, cfg) == ""


def test_repeated_advice_is_logged_once_at_info(caplog):
    """`--planner advise` gives the same advice every interval until someone moves: its repeats on the same pools
    are DEBUG lines; other advice is INFO again."""
    import logging
    from types import SimpleNamespace

    from tidal.planner.loop import PlannerLoop
    from tidal.planner.schema import Decision, Traffic, WorkerLoad
    from tidal.router.metrics import RouterMetrics

    loop = PlannerLoop(PlannerConfig(mode="advise"), SimpleNamespace(metrics=RouterMetrics()), clock=lambda: 0.0)
    loop.last_loads = [WorkerLoad(url="http://n", mode="null"), WorkerLoad(url="http://d", mode="decode")]
    to_prefill = Decision(at=0.0, kind="advise", reason="capacity 1x -> 2x", url="http://n", src="null", dst="prefill")
    to_decode = Decision(at=0.0, kind="advise", reason="capacity 1x -> 2x", url="http://n", src="null", dst="decode")
    caplog.set_level(logging.DEBUG, logger="tidal.planner.loop")
    for d in (to_prefill, to_prefill, to_prefill, to_decode):
        loop._record(d, Traffic())
    levels = [r.levelname for r in caplog.records if r.getMessage().startswith("planner: advise")]
    assert levels == ["INFO", "DEBUG", "DEBUG", "INFO"]


def test_the_status_history_keeps_one_entry_for_a_hold_repeated_on_the_same_pools():
    """An idle router holds every interval: those holds are one entry of the history, the newest, counting the
    rounds before it, so that 50 of them do not push the moves out. A move by hand between two holds, or other
    pools, starts a new entry."""
    from types import SimpleNamespace

    from tidal.planner.loop import PlannerLoop
    from tidal.planner.schema import Decision, Traffic, WorkerLoad
    from tidal.router.metrics import RouterMetrics

    loop = PlannerLoop(PlannerConfig(mode="sla"), SimpleNamespace(metrics=RouterMetrics()), clock=lambda: 0.0)
    loop.last_loads = [WorkerLoad(url="http://p", mode="prefill"), WorkerLoad(url="http://d", mode="decode")]

    def hold(at: float) -> None:
        d = Decision(at=at, kind="hold", why="no_arrivals", reason="no arrivals in the window")
        loop._keep(d, loop._record(d, Traffic()))

    for at in range(5):
        hold(float(at))
    assert [(x.kind, x.at, x.repeats) for x in loop.decisions] == [("hold", 4.0, 4)]
    loop._hand_record("http://d", "decode", "prefill", "moved by hand")
    hold(5.0)
    loop.last_loads = [WorkerLoad(url="http://p", mode="prefill"), WorkerLoad(url="http://d", mode="prefill")]
    hold(6.0)
    hold(7.0)
    assert [(x.kind, x.at, x.repeats) for x in loop.decisions] == [("hold", 4.0, 4), ("hand", 0.0, 0),
                                                                     ("hold", 5.0, 0), ("hold", 7.0, 1)]


def test_the_router_warns_once_where_the_prompts_outrun_the_profile(caplog):
    """As `tidal sim` does: prompts (the window's 95th percentile) past twice the profile's longest measured prefill
    make the planner's cost model extrapolate; the router says so once, not every interval."""
    import logging
    from types import SimpleNamespace

    from tidal.planner.loop import PlannerLoop
    from tidal.planner.schema import Traffic
    from tidal.profile.cost import CostModel

    cost = CostModel.from_dict(PROFILE)
    measured = max(x.tokens for x in cost.profile.prefill)
    loop = PlannerLoop(PlannerConfig(mode="sla"), SimpleNamespace(), cost=cost, profile_path="p.json")
    caplog.set_level(logging.WARNING, logger="tidal.planner.loop")
    within = Traffic(input_tokens_deciles=[10] * 9 + [2 * measured])
    loop._warn_extrapolation(within)
    assert not caplog.records
    past = Traffic(input_tokens_deciles=[10] * 9 + [2 * measured + 1])
    for _ in range(3):
        loop._warn_extrapolation(past)
    said = (f"--planner-profile p.json: prefill was measured up to {measured} tokens; the prompts reach "
            f"{2 * measured + 1} (the 95th percentile of the window's); the cost model extrapolates: measure longer "
            f"prompts with `tidal profile`")
    assert [r.getMessage() for r in caplog.records] == [said]


def test_a_repeated_hold_is_logged_once_at_info(caplog):
    """An idle router holds every interval for the same cause: the first such hold is an INFO line, its repeats on
    the same pools DEBUG lines; a new cause, or a move, is INFO again."""
    import logging
    from types import SimpleNamespace

    from tidal.planner.loop import PlannerLoop
    from tidal.planner.schema import Decision, Traffic, WorkerLoad
    from tidal.router.metrics import RouterMetrics

    loop = PlannerLoop(PlannerConfig(mode="sla"), SimpleNamespace(metrics=RouterMetrics()), clock=lambda: 0.0)
    loop.last_loads = [WorkerLoad(url="http://p", mode="prefill"), WorkerLoad(url="http://d", mode="decode")]
    idle = Decision(at=0.0, kind="hold", why="no_arrivals", reason="no arrivals in the window")
    busy = Decision(at=0.0, kind="hold", why="gain_too_small", reason="the best layout gains too little")
    caplog.set_level(logging.DEBUG, logger="tidal.planner.loop")
    for d in (idle, idle, idle, busy, idle):
        loop._record(d, Traffic())
    levels = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records
              if r.getMessage().startswith("planner: ")]
    assert levels == [("INFO", "planner: hold"), ("DEBUG", "planner: hold"), ("DEBUG", "planner: hold"),
                      ("INFO", "planner: hold"), ("INFO", "planner: hold")]


def test_the_decision_is_taken_off_the_event_loop_and_again_when_a_move_lands_meanwhile(monkeypatch):
    """`decide` predicts hundreds of layouts (~0.1 s at 64 workers): inline it would stall every stream the router
    proxies. It runs in a thread on a copy of the state; a move that starts or ends meanwhile makes it stale."""
    import asyncio
    from types import SimpleNamespace

    import tidal.planner.loop as planner_loop
    from tidal.planner.schema import Decision, Traffic, WorkerLoad

    registry = SimpleNamespace(pools={"prefill": ["http://p"], "decode": ["http://d1", "http://d2"]})
    loop = planner_loop.PlannerLoop(PlannerConfig(mode="sla"), SimpleNamespace(registry=registry), clock=lambda: 0.0)
    monkeypatch.setattr(planner_loop, "pool_loads", lambda reg: [WorkerLoad(url=u, mode=m) for m, us in
                                                               reg.pools.items() for u in us])
    loop.state.started(0.0, "http://d1", "decode", "prefill")
    loop.last_loads = planner_loop.pool_loads(registry)  # the interval's: d1 still decode as its move started
    calls = []

    def fake_decide(now, cfg, state, loads, traffic, cost):
        with pytest.raises(RuntimeError):
            asyncio.get_running_loop()  # not on the event loop's thread
        assert state is not loop.state
        calls.append((state.version, sorted(w.url for w in loads if w.mode == "decode")))
        if len(calls) == 1:  # d1's move lands while the first decision runs
            registry.pools = {"prefill": ["http://p", "http://d1"], "decode": ["http://d2"]}
            loop.state.finished(now, "http://d1", True, cfg)
        state.committed = {"prefill": len(calls), "decode": 1, "null": 0}
        return Decision(at=now, kind="hold", why="gain_too_small", reason="")

    monkeypatch.setattr(planner_loop, "decide", fake_decide)
    d = asyncio.run(loop._decide(0.0, Traffic()))
    # the second decision sees d1 in the prefill pool: on the interval's pools it would count d1 as decode and out
    # of flight, a decode worker too many
    assert d.kind == "hold" and calls == [(1, ["http://d1", "http://d2"]), (2, ["http://d2"])]
    assert loop.state.committed == {"prefill": 2, "decode": 1, "null": 0}  # the second decision's, not the stale one


def test_a_move_that_would_empty_a_pool_now_is_not_started(monkeypatch):
    """The last check before a move starts, on the registry's pools as they are: a decision that would take the last
    decode worker (one taken on pools that moved on) is recorded, not started."""
    import asyncio
    from types import SimpleNamespace

    import tidal.planner.loop as planner_loop
    from tidal.planner.schema import Decision, WorkerLoad
    from tidal.router.metrics import RouterMetrics

    registry = SimpleNamespace(pools={"prefill": ["http://p", "http://d1"], "decode": ["http://d2"]}, all=lambda: [])
    st = SimpleNamespace(registry=registry, metrics=RouterMetrics())
    loop = planner_loop.PlannerLoop(PlannerConfig(mode="sla"), st, clock=lambda: 0.0)
    monkeypatch.setattr(planner_loop, "pool_loads", lambda reg: [WorkerLoad(url=u, mode=m) for m, us in
                                                               reg.pools.items() for u in us])
    moves = {"http://d2": "decode", "http://d1": "decode"}  # d1's: it is no longer in the decode pool

    def stale(now, cfg, state, loads, traffic, cost):
        url = next(iter(moves))
        return Decision(at=now, kind="move", url=url, src=moves.pop(url), dst="prefill", reason="stale")

    monkeypatch.setattr(planner_loop, "decide", stale)
    for says in ("decode pool would fall below --planner-min-per-pool 1", "http://d1 is not serving in the decode"):
        d = asyncio.run(loop.tick())
        assert d.kind == "move" and d.outcome.startswith("not started: ") and says in d.outcome
        assert not loop.state.in_flight and not loop._moves


def test_a_switch_made_on_the_worker_itself_counts_as_a_move_by_hand(workers, tmp_path):
    """A worker switched on its own route (behind the router): the next health check finds its new mode, and the
    planner counts it as a move by hand, its cooldowns running from then, so the next round does not undo it."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    cfg = PlannerConfig(mode="sla", ttft_slo_s=3.0, tpot_slo_s=0.1, interval_s=60.0, cooldown_s=30.0)
    with RouterServer(prefill=[(workers["p1"].url, 8998)], decode=[workers["d1"].url, workers["d2"].url],
                      planner=cfg, planner_profile=str(profile), health_check_interval_s=0.2) as r:
        planner, d2 = r.state.planner, workers["d2"].url
        assert planner.state.worker_blocked(planner.clock(), d2, cfg) == ""  # the first checks moved nothing
        resp = httpx.post(d2 + "/admin/switch_disaggregation_mode", json={"mode": "prefill"}, timeout=5)
        assert resp.status_code == 200 and workers["d2"].role == "prefill"
        wait_for(lambda: r.state.registry.get(d2).mode == "prefill", 10, "the health check to learn the mode")
        now, cfg = planner.clock(), planner.cfg
        assert planner.state.worker_blocked(now, d2, cfg).startswith("worker cooldown")
        assert "cooldown after a move decode->prefill" in planner.state.reversal(now, "prefill", "decode", cfg)
        status = httpx.get(r.url + "/planner/status").json()
        metrics = httpx.get(r.url + "/metrics").text
    assert "decode->prefill" in status["cooldown"]["recent_moves"]
    hand = status["decisions"][0]
    assert (hand["kind"], hand["url"], hand["src"], hand["dst"], hand["outcome"]) == ("hand", d2, "decode", "prefill",
                                                                                      "ok")
    assert "worker's own route" in hand["reason"]
    assert 'tidal_router:hand_moves_total{from="decode",outcome="ok",route="worker",to="prefill"} 1.0' in metrics
