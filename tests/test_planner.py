"""The planner's pure decision on synthetic load snapshots, its window and its cost model."""

from __future__ import annotations

import math
import os
import random

import msgspec

import pytest

from tidal.planner.decide import PlannerState, decide, floor_warning, layout_problem, pool_counts
from tidal.planner.predict import NEVER, CostPredictor, PoolLoad
from tidal.planner.schema import DECODE, NULL, PREFILL, PlannerConfig, Traffic, WorkerLoad
from tidal.planner.window import (Observation, StreamTally, TrafficWindow, body_token_counts, censored_mean,
                                  stream_observation)
from tidal.profile.cost import CostModel

KV = 65536
# a toy server: 1 ms per prompt token; a decode step of 20 ms + 0.5 ms per extra request + 1 us per KV token
PROFILE = {
    "version": 1, "server": {"max_total_tokens": KV},
    "prefill": [{"tokens": 1, "seconds": 0.001}, {"tokens": 1000, "seconds": 1.0}],
    "decode": [{"batch": b, "context_tokens": c, "step_seconds": 0.02 + 0.0005 * (b - 1) + 1e-6 * c}
               for b in (1, 64) for c in (0, KV)],
    "kv_transfer": [{"tokens": 1, "bytes": 1, "seconds": 0.001}, {"tokens": 1000, "bytes": 1, "seconds": 0.01}],
    "switch": [],
}
COST = CostModel.from_dict(PROFILE)
NOW = 1000.0

LONG_PROMPTS = Traffic(arrival_rate=1.5, mean_input_tokens=1000, mean_output_tokens=20)  # prefill-bound
LONG_ANSWERS = Traffic(arrival_rate=3.0, mean_input_tokens=100, mean_output_tokens=500)  # decode-bound
LIGHT = Traffic(arrival_rate=0.5, mean_input_tokens=300, mean_output_tokens=100)


def cfg(**kw) -> PlannerConfig:
    return PlannerConfig(**{"mode": "sla", "ttft_slo_s": 3.0, "tpot_slo_s": 0.1, "interval_s": 5.0,
                            "cooldown_s": 30.0, **kw})


def layout(p: int, d: int, n: int, **per_mode: dict) -> list[WorkerLoad]:
    out = []
    for mode, k in ((PREFILL, p), (DECODE, d), (NULL, n)):
        out += [WorkerLoad(url=f"http://{mode}{i}", mode=mode, kv_tokens_total=KV, **per_mode.get(mode, {}))
                for i in range(k)]
    return out


STARVED_PREFILL = layout(1, 2, 0, prefill={"queued_prefill_tokens": 5000, "waiting_reqs": 5})
STARVED_DECODE = layout(2, 1, 0, decode={"running_reqs": 60})


# ---------------------------------------------------------------- direction


def test_a_hold_says_where_the_current_layout_is_none_the_planner_heads_for():
    """All decode workers (a forced move by hand leads there; they prefill locally) is no layout the planner heads
    for, and it may predict better than every one it does: the hold says why the better-looking current layout is
    not the best one named."""
    d = decide(NOW, cfg(), PlannerState(), layout(0, 3, 0), LONG_PROMPTS, COST)
    assert d.kind == "hold" and d.current.capacity > d.target.capacity, d.reason
    assert d.reason.startswith("the best layout the planner may head for (not the current one: it has no prefill "
                               "and decode pair nor null worker) gains too little"), d.reason
    held = decide(NOW, cfg(), PlannerState(), layout(2, 1, 0), LIGHT, COST)
    assert held.why == "at_best" and held.reason.startswith("the layout it heads for is the best one: capacity")


def test_from_all_decode_workers_the_planner_walks_back_to_a_pair_without_hysteresis():
    """All decode workers (moves on the workers themselves led there) predict a little less than 2:1 under light
    traffic: the planner heads back without the hysteresis a layout of its own keeps, and may start the walk
    although no prefill and decode pair serves while the first worker moves (the other decode workers prefill
    alone); a walk that would leave no worker at all is still refused. From all prefill workers, which serve
    nothing, the walk starts too."""
    d = decide(NOW, cfg(), PlannerState(), layout(0, 3, 0), LIGHT, COST)
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL), d.reason
    assert d.target.capacity < d.current.capacity * 1.3 and "never heads for" in d.reason
    assert layout_problem({PREFILL: 0, DECODE: 1, NULL: 0}, DECODE, PREFILL, 0).startswith("no usable path")
    assert layout_problem({PREFILL: 1, DECODE: 1, NULL: 0}, DECODE, NULL, 0).startswith("no usable path")
    stuck = decide(NOW, cfg(), PlannerState(), layout(3, 0, 0), LIGHT, COST)  # all prefill: nothing served
    assert stuck.kind == "move" and (stuck.src, stuck.dst) == (PREFILL, DECODE), stuck.reason


def test_starved_prefill_pool_gets_a_decode_worker():
    d = decide(NOW, cfg(), PlannerState(), STARVED_PREFILL, LONG_PROMPTS, COST)
    assert d.kind == "move", d.reason
    assert (d.src, d.dst) == (DECODE, PREFILL)
    assert d.best.prediction.score < d.current.score
    assert d.current.paths["pd"].ttft_s > 3.0 > d.best.prediction.paths["pd"].ttft_s - 3.0


def test_starved_prefill_pool_gets_a_null_worker():
    loads = layout(1, 1, 1, prefill={"queued_prefill_tokens": 4000})
    d = decide(NOW, cfg(), PlannerState(), loads, Traffic(arrival_rate=1.8, mean_input_tokens=1000,
                                                          mean_output_tokens=20), COST)
    assert d.kind == "move" and (d.src, d.dst) == (NULL, PREFILL), d.reason


def test_starved_decode_pool_gets_a_worker():
    d = decide(NOW, cfg(), PlannerState(), STARVED_DECODE, LONG_ANSWERS, COST)
    assert d.kind == "move" and (d.src, d.dst) == (PREFILL, DECODE), d.reason
    assert d.current.paths["pd"].tpot_s > 0.1 > d.best.prediction.paths["pd"].tpot_s


def test_starved_decode_pool_gets_a_null_worker():
    loads = layout(1, 1, 1, decode={"running_reqs": 100})
    d = decide(NOW, cfg(), PlannerState(), loads, LONG_ANSWERS, COST)
    assert d.kind == "move" and (d.src, d.dst) == (NULL, DECODE), d.reason


def test_pools_at_the_best_layout_hold():
    first = decide(NOW, cfg(min_per_pool=1), PlannerState(), layout(2, 2, 0), LIGHT, COST)
    best = first.target.pools
    d = decide(NOW, cfg(min_per_pool=1), PlannerState(), layout(best[PREFILL], best[DECODE], best[NULL]), LIGHT, COST)
    assert d.kind == "hold" and d.why == "at_best" and "the layout it heads for is the best one" in d.reason, d.reason
    assert d.current.score < 1.0 and d.target.pools == best


def test_static_never_moves():
    for loads, traffic in ((STARVED_PREFILL, LONG_PROMPTS), (STARVED_DECODE, LONG_ANSWERS)):
        d = decide(NOW, cfg(mode="static"), PlannerState(), loads, traffic, COST)
        assert d.kind == "hold" and d.reason == "planner is static"


# ---------------------------------------------------------------- safety


def test_no_move_undoing_a_move_inside_the_cooldown_then_moves():
    """A worker went prefill -> decode 10 s ago; now prefill starves. Moving one back (decode -> prefill,
    or anything into prefill / out of decode) waits for the cooldown: no flapping."""
    c, state = cfg(cooldown_s=30.0), PlannerState()
    state.started(NOW - 40, "http://elsewhere", PREFILL, DECODE)
    state.finished(NOW - 10, "http://elsewhere", True, c)
    d = decide(NOW, c, state, STARVED_PREFILL, LONG_PROMPTS, COST)
    assert d.kind == "hold" and "no legal move toward the target" in d.reason and "cooldown" in d.reason, d.reason
    assert d.target is not None and d.target.pools[PREFILL] > 1  # it knows where it would go
    undo = [x for x in d.candidates if x.dst == PREFILL or x.src == DECODE]
    assert undo and all(not x.legal and "cooldown after a move prefill->decode" in x.reason for x in undo)
    assert decide(NOW + 21, c, state, STARVED_PREFILL, LONG_PROMPTS, COST).kind == "move"


def test_an_overloaded_layout_is_not_held_by_the_reversal_cooldown():
    """5 s after a decode worker moved to prefill, the decode pool is swamped: with 60 running requests
    its TPOT misses the SLO at any arrival rate (capacity 0), and a move back meets it at some rate: at
    today's (0.5 requests/s), or only below it (10/s, where no layout of 4 workers serves today's rate).
    The reversal cooldown yields there; with 20 running requests (capacity above 0) it holds."""
    for rate, running, moves in ((0.5, 60, True), (10.0, 60, True), (0.5, 20, False)):
        traffic = Traffic(arrival_rate=rate, mean_input_tokens=100, mean_output_tokens=200)
        state = PlannerState()
        state.started(NOW - 10, "http://decode9", DECODE, PREFILL)
        state.finished(NOW - 5, "http://decode9", True, cfg())
        d = decide(NOW, cfg(tpot_slo_s=0.06), state, layout(3, 1, 0, decode={"running_reqs": running}), traffic,
                   COST)
        if moves:
            assert d.current.capacity == 0 and d.target.capacity >= (1 if rate < 1 else 0.5), d.reason
            assert d.kind == "move" and (d.src, d.dst) == (PREFILL, DECODE) and "overloaded" in d.reason, d.reason
        else:
            assert d.current.capacity > 0 and d.kind == "hold" and "cooldown" in d.reason, d.reason


def test_an_overloaded_layout_is_not_held_by_the_workers_own_cooldowns():
    """Every prefill worker moved in 5 s ago (a walk toward a code-like mix) and now the decode pool is swamped
    by a chat-like one: overloaded, a worker goes back inside its own cooldown; not overloaded, the cooldown
    holds it; a failed move's backoff holds it either way."""
    traffic = Traffic(arrival_rate=0.5, mean_input_tokens=100, mean_output_tokens=200)
    c = cfg(tpot_slo_s=0.06, worker_cooldown_s=60.0)
    for running, failed, moves in ((60, False, True), (20, False, False), (60, True, False)):
        state = PlannerState()
        for i in range(3):
            state.started(NOW - 10, f"http://prefill{i}", DECODE, PREFILL)
            state.finished(NOW - 5, f"http://prefill{i}", not failed, c)
        d = decide(NOW, c, state, layout(3, 1, 0, decode={"running_reqs": running}), traffic, COST)
        if moves:
            assert d.kind == "move" and (d.src, d.dst) == (PREFILL, DECODE) and "overloaded" in d.reason, d.reason
        else:
            assert d.kind == "hold" and ("worker cooldown" in d.reason or "backoff" in d.reason), d.reason


def test_moves_the_same_way_go_on_inside_the_cooldown():
    """A worker just went decode -> prefill and prefill still starves: the next one follows at once."""
    c, state = cfg(cooldown_s=30.0), PlannerState()
    loads = layout(2, 4, 0, prefill={"queued_prefill_tokens": 10000})
    state.started(NOW - 20, "http://elsewhere", DECODE, PREFILL)
    state.finished(NOW - 5, "http://elsewhere", True, c)
    d = decide(NOW, c, state, loads, LONG_PROMPTS, COST)
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL), d.reason


def test_a_moved_worker_keeps_its_own_cooldown():
    c, state = cfg(cooldown_s=10.0, worker_cooldown_s=100.0), PlannerState()
    state.started(NOW - 50, "http://decode0", PREFILL, DECODE)
    state.finished(NOW - 40, "http://decode0", True, c)
    d = decide(NOW, c, state, STARVED_PREFILL, LONG_PROMPTS, COST)
    assert d.kind == "move" and d.url == "http://decode1"
    blocked = [x for x in d.candidates if x.url == "http://decode0"]
    assert blocked and all(not x.legal and "worker cooldown" in x.reason for x in blocked)


def test_a_worker_handing_over_moves_only_back_to_the_role_it_finishes():
    """A prefill worker that was null and still finishes its null requests (a handover) would wait for them out of
    every pool if moved to decode: the planner moves the other prefill worker there; the move back to null stays
    legal (it goes at once)."""
    loads = layout(2, 1, 0, decode={"running_reqs": 60})
    loads[0] = msgspec.structs.replace(loads[0], handing_over_from=NULL)
    d = decide(NOW, cfg(), PlannerState(), loads, LONG_ANSWERS, COST)
    assert d.kind == "move" and (d.url, d.src, d.dst) == ("http://prefill1", PREFILL, DECODE), d.reason
    mine = {x.dst: x for x in d.candidates if x.url == "http://prefill0"}
    assert not mine[DECODE].legal and mine[DECODE].reason.startswith("handing over: it finishes its null requests")
    assert mine[NULL].legal, mine[NULL].reason
    first = decide(NOW, cfg(), PlannerState(), layout(2, 1, 0, decode={"running_reqs": 60}), LONG_ANSWERS, COST)
    assert first.url == "http://prefill0"  # without the handover, the first of equals moves


def test_at_most_the_allowed_moves_in_flight():
    state = PlannerState()
    state.started(NOW - 100, "http://other", DECODE, PREFILL)
    c = cfg(cooldown_s=0.0)
    assert decide(NOW, c, state, STARVED_PREFILL, LONG_PROMPTS, COST).reason.startswith("1 move(s) in flight")
    d = decide(NOW, cfg(cooldown_s=0.0, max_concurrent_moves=2), state, STARVED_PREFILL, LONG_PROMPTS, COST)
    assert d.kind == "move"


def test_never_below_the_minimum_per_pool():
    """1 prefill : 2 decode, prefill starved, minimum 2: the only allowed layout is this one."""
    d = decide(NOW, cfg(min_per_pool=2), PlannerState(), STARVED_PREFILL, LONG_PROMPTS, COST)
    assert d.kind == "hold" and d.why == "at_best", d.reason
    assert d.target.pools == pool_counts(STARVED_PREFILL)
    assert all("below --planner-min-per-pool 2" in x.reason for x in d.candidates if x.src == DECODE)
    free = decide(NOW, cfg(min_per_pool=1), PlannerState(), STARVED_PREFILL, LONG_PROMPTS, COST)
    assert free.kind == "move" and free.src == DECODE, free.reason


def test_starting_pools_below_the_minimum_are_named():
    assert floor_warning({NULL: 3, PREFILL: 0, DECODE: 0}, 1) == ""  # a colocated start under the default floor
    assert floor_warning({NULL: 0, PREFILL: 2, DECODE: 2}, 2) == ""
    said = floor_warning({NULL: 1, PREFILL: 1, DECODE: 0}, 2)
    assert "prefill pool has 1 worker and the decode pool has 0 workers" in said, said
    assert said.startswith("--planner-min-per-pool 2: ")


def test_never_leaves_pd_unusable():
    loads = layout(1, 1, 0, prefill={"queued_prefill_tokens": 20000})
    d = decide(NOW, cfg(min_per_pool=0), PlannerState(), loads, LONG_PROMPTS, COST)
    assert d.kind == "hold" or d.dst == NULL, d.reason  # a worker may become null: that path serves alone
    pd_breaking = [x for x in d.candidates if x.dst != NULL]
    assert pd_breaking and all(not x.legal and "no usable path" in x.reason for x in pd_breaking)


def test_random_snapshots_respect_minimum_and_usable_path():
    rng = random.Random(7)
    for _ in range(300):
        p, d, n = rng.randint(0, 3), rng.randint(0, 3), rng.randint(0, 3)
        if not n and not (p and d):
            continue
        loads = layout(p, d, n, prefill={"queued_prefill_tokens": rng.randint(0, 20000)},
                       decode={"running_reqs": rng.randint(0, 120)}, null={"running_reqs": rng.randint(0, 60)})
        traffic = Traffic(arrival_rate=rng.uniform(0.1, 5), mean_input_tokens=rng.uniform(10, 2000),
                          mean_output_tokens=rng.uniform(5, 800))
        minimum = rng.randint(0, 2)
        dec = decide(NOW, cfg(min_per_pool=minimum, hysteresis=0.0), PlannerState(), loads, traffic, COST)
        if dec.kind != "move":
            continue
        before, after = pool_counts(loads), pool_counts(loads)
        after[dec.src] -= 1
        after[dec.dst] += 1
        if dec.src in (PREFILL, DECODE):
            assert after[dec.src] >= minimum
        during = dict(after, **{dec.dst: after[dec.dst] - 1})  # the moving worker serves no pool
        assert during[NULL] or (during[PREFILL] and during[DECODE]), (before, during)


def test_no_move_leaves_nothing_to_route_to_while_it_drains():
    """A decode worker died: 1 prefill, 0 decode, 1 null, answers starving. Moving the null worker to decode
    leaves only the prefill worker routable while it drains (a live trial's 503s); the planner does not take
    it, and the prefill worker may go instead (the null worker serves meanwhile)."""
    loads = layout(1, 0, 1, null={"running_reqs": 60})
    d = decide(NOW, cfg(min_per_pool=0), PlannerState(), loads, LONG_ANSWERS, COST)
    null_to_decode = [x for x in d.candidates if (x.src, x.dst) == (NULL, DECODE)]
    assert null_to_decode and all(not x.legal and "while it moves" in x.reason for x in null_to_decode)
    assert d.kind == "hold" or (d.src, d.dst) != (NULL, DECODE), d.reason
    prefill_out = [x for x in d.candidates if x.src == PREFILL]
    assert prefill_out and all(x.legal for x in prefill_out)


def test_failed_move_backs_off_exponentially_and_is_not_looped():
    c, state = cfg(cooldown_s=0.0, worker_cooldown_s=0.0, backoff_base_s=30.0, backoff_max_s=100.0), PlannerState()
    loads = layout(1, 1, 1, prefill={"queued_prefill_tokens": 4000})
    traffic = Traffic(arrival_rate=1.8, mean_input_tokens=1000, mean_output_tokens=20)
    first = decide(NOW, c, state, loads, traffic, COST)
    assert first.kind == "move" and first.url == "http://null0"
    state.started(NOW, first.url, first.src, first.dst)
    state.finished(NOW + 1, first.url, False, c)
    held = decide(NOW + 2, c, state, loads, traffic, COST)
    assert held.kind == "hold" and "no legal move toward the target" in held.reason, held.reason
    assert "backoff" in held.reason  # the only worker to move is backing off
    assert all("backoff after 1 failed" in x.reason for x in held.candidates if x.url == "http://null0")
    assert decide(NOW + 30, c, state, loads, traffic, COST).kind == "hold"
    retry = decide(NOW + 31.5, c, state, loads, traffic, COST)
    assert retry.kind == "move" and retry.url == "http://null0"
    state.started(NOW + 31.5, retry.url, retry.src, retry.dst)
    state.finished(NOW + 32, retry.url, False, c)
    assert decide(NOW + 32 + 59, c, state, loads, traffic, COST).kind == "hold"  # 60 s after the second
    assert decide(NOW + 32 + 61, c, state, loads, traffic, COST).kind == "move"
    for k in range(3, 8):  # capped at backoff_max_s
        state.finished(NOW + 1000 * k, "http://null0", False, c)
        assert state.workers["http://null0"].retry_at == NOW + 1000 * k + min(100.0, 30.0 * 2 ** (k - 1))
    state.finished(NOW + 9000, "http://null0", True, c)
    assert state.workers["http://null0"].failures == 0


def test_no_traffic_holds():
    d = decide(NOW, cfg(), PlannerState(), STARVED_PREFILL, Traffic(), COST)
    assert d.kind == "hold"


# ---------------------------------------------------------------- without a cost model


def test_observed_latencies_drive_the_move_without_a_profile():
    loads = layout(1, 2, 0)
    slow_ttft = Traffic(arrival_rate=1.0, mean_input_tokens=500, mean_output_tokens=50,
                        ttft_s={"pd": 9.0}, tpot_s={"pd": 0.02})
    d = decide(NOW, cfg(), PlannerState(), loads, slow_ttft, cost=None)
    assert d.kind == "move" and d.src == DECODE and d.dst in (PREFILL, NULL), d.reason  # both halve prefill's load
    assert d.best.prediction.paths["pd"].ttft_s == pytest.approx(4.5)
    assert "observed" in d.current.note
    slow_tpot = Traffic(arrival_rate=1.0, mean_input_tokens=500, mean_output_tokens=50,
                        ttft_s={"pd": 0.2}, tpot_s={"pd": 0.3})
    d = decide(NOW, cfg(), PlannerState(), layout(2, 1, 0), slow_tpot, cost=None)
    assert d.kind == "move" and d.src == PREFILL and d.dst in (DECODE, NULL), d.reason  # both halve decode's load
    assert d.best.prediction.paths["pd"].tpot_s == pytest.approx(0.15)


def test_without_a_profile_or_observations_it_holds():
    d = decide(NOW, cfg(), PlannerState(), STARVED_PREFILL, LONG_PROMPTS, cost=None)
    assert d.kind == "hold" and "no --planner-profile" in d.reason


# ---------------------------------------------------------------- window and cost model


def test_window_rate_lengths_and_latencies():
    w = TrafficWindow(window_s=10.0, started_at=0.0)
    for t in range(20):
        w.arrival(float(t))
    w.completion(15.0, Observation(path="pd", prompt_tokens=100, completion_tokens=11, ttft_s=0.5, tpot_s=0.05))
    w.completion(16.0, Observation(path="pd", prompt_tokens=300, completion_tokens=31, ttft_s=1.5, tpot_s=0.15))
    w.completion(17.0, Observation(path="null", prompt_tokens=200, completion_tokens=21))
    t = w.traffic(19.5)
    assert t.arrival_rate == pytest.approx(1.0)  # arrivals at 10..19 over 10 s
    assert t.mean_input_tokens == pytest.approx(200) and t.mean_output_tokens == pytest.approx(21)
    assert t.ttft_s == {"pd": pytest.approx(1.0)} and t.tpot_s == {"pd": pytest.approx(0.1)}
    assert w.traffic(40.0).arrival_rate == 0 and w.traffic(40.0).completed == 0


def test_censored_mean_counts_open_requests_as_longer_than_so_far():
    assert censored_mean([1, 3], []) == pytest.approx(2)  # nothing open: the plain mean
    assert censored_mean([], []) == 0
    # one of three still open after 100 tokens: the two finished at 5 keep 1/3 surviving to 101
    assert censored_mean([5, 5], [100]) == pytest.approx(5 + 96 / 3)
    assert censored_mean([5, 5], [2]) == pytest.approx(5)  # open but shorter than every end: no information


def test_first_window_mean_answer_counts_the_requests_still_streaming():
    """A filling cluster's first completions are its shortest answers; the open requests' tokens so far say
    the rest are longer. Tickets dropped without completion (a failed request) stop counting."""
    w = TrafficWindow(window_s=30.0, started_at=0.0)
    tickets = [w.arrival(k * 0.1) for k in range(40)]
    for k, ticket in enumerate(tickets[:20]):
        w.completion(3.0, Observation(path="pd", prompt_tokens=50, completion_tokens=10, arrived_at=k * 0.1),
                     ticket)
    for ticket in tickets[20:]:
        ticket.tokens = 150
    assert w.traffic(4.0).mean_output_tokens == pytest.approx(10 + 0.5 * 141)
    assert w.traffic(31.0).mean_output_tokens == pytest.approx(10)  # past the first window: the finished alone
    del tickets[20:], ticket  # the open ones fail: only the finished remain
    assert w.traffic(4.0).mean_output_tokens == pytest.approx(10)
    few = TrafficWindow(window_s=30.0, started_at=0.0)
    held = [few.arrival(0.0) for _ in range(10)]
    few.completion(1.0, Observation(path="pd", prompt_tokens=50, completion_tokens=10, arrived_at=0.0), held[0])
    for ticket in held[1:]:
        ticket.tokens = 500
    assert few.traffic(2.0).mean_output_tokens == pytest.approx(10)  # too few finished: completions alone


def test_a_turn_to_longer_answers_shows_in_the_newest_arrivals_before_they_finish():
    """Past the first window the finished requests set the mean answer, unless the last ANSWER_COHORT_S seconds'
    arrivals, the open ones counting as longer than their tokens so far, say ANSWER_SHIFT times more: at a
    turn to long answers the short ones of the old mix finish first and the window keeps saying them."""
    from tidal.planner.window import ANSWER_COHORT_S, ANSWER_SHIFT

    def window(open_tokens: int, cohort_finished: int = 20) -> tuple[TrafficWindow, list]:
        w = TrafficWindow(window_s=30.0, started_at=0.0)
        for k in range(120):  # a steady short-answer mix, 2 a second
            t = k * 0.5
            w.completion(t + 0.5, Observation(path="pd", prompt_tokens=400, completion_tokens=5, arrived_at=t),
                         w.arrival(t))
        held = []
        for k in range(40):  # the last 10 s: the old mix's short answers finish, the new mix's long ones stream
            t = 60.1 + k * 0.2
            ticket = w.arrival(t)
            if k % 2 and k // 2 < cohort_finished:
                w.completion(t + 0.1, Observation(path="pd", prompt_tokens=400, completion_tokens=5, arrived_at=t),
                             ticket)
            else:
                ticket.tokens = open_tokens
                held.append(ticket)
        return w, held

    assert ANSWER_COHORT_S == 10.0 and ANSWER_SHIFT == 1.5
    turned, held = window(open_tokens=40)
    assert turned.traffic(70.0).mean_output_tokens == pytest.approx(5 + 0.5 * 36)  # Kaplan-Meier over the cohort
    assert turned.traffic(70.0).recent_answers  # the newest arrivals' own answers
    steady, held2 = window(open_tokens=6)  # open, but not longer enough than the finished: the window's
    assert steady.traffic(70.0).mean_output_tokens == pytest.approx(5) and not steady.traffic(70.0).recent_answers
    few, held3 = window(open_tokens=40, cohort_finished=19)  # too few of the cohort finished to tell
    assert few.traffic(70.0).mean_output_tokens == pytest.approx(5) and not few.traffic(70.0).recent_answers
    del held[:]  # the long ones fail: nothing open says longer
    assert turned.traffic(70.0).mean_output_tokens == pytest.approx(5) and not turned.traffic(70.0).recent_answers


def test_the_first_windows_prompts_are_those_the_workers_received_not_the_first_to_finish():
    """Over the router's first window the mean prompt is that of the requests the prefill and null workers counted
    as they arrived (differences of their counters between snapshots), the finished requests' deciles scaled to it:
    the short prompts finish first. Not counted: a decode worker's (a PD request reaches both), a worker's across a
    move or a restart; fewer than MIN_RECEIVED_SAMPLES, or a worker that does not count, leave the finished mean,
    as does the end of the first window (the answers are the finished requests' then)."""
    from tidal.planner.received import MIN_RECEIVED_SAMPLES

    def counts(mode: str, url: str, prompts: int, tokens: int) -> WorkerLoad:
        return WorkerLoad(url=url, mode=mode, prompts_received=prompts, prompt_tokens_received=tokens)

    before = [counts(PREFILL, "p0", 500, 90_000), counts(NULL, "n0", 0, 0), counts(DECODE, "d0", 500, 90_000)]

    def mean_prompt(after: list[WorkerLoad]) -> tuple[float, TrafficWindow]:
        w = TrafficWindow(window_s=30.0, started_at=0.0, burst_window_s=300.0)
        for k in range(30):  # the short prompts, finished first
            w.completion(8.0, Observation(path="pd", prompt_tokens=100 + k % 3, completion_tokens=20, arrived_at=6.0),
                         w.arrival(6.0))
        assert w.traffic(5.0, before).mean_input_tokens == pytest.approx(101)  # the first snapshot: a baseline
        return w.traffic(10.0, after).mean_input_tokens, w

    p0 = counts(PREFILL, "p0", 540, 90_000 + 40 * 300)  # 40 prompts of 300 tokens
    n0 = counts(NULL, "n0", 20, 20 * 200)  # 20 of 200
    d0 = counts(DECODE, "d0", 540, 90_000 + 40 * 9999)
    both, w = mean_prompt([p0, n0, d0])
    assert both == pytest.approx((40 * 300 + 20 * 200) / 60) and MIN_RECEIVED_SAMPLES == 20
    t = w.traffic(12.0)  # no snapshot (/planner/status): the last ones
    assert t.mean_input_tokens == pytest.approx(both) and t.input_tokens_deciles[0] == round(100 * both / 101)
    assert w.traffic(14.0, [p0, n0, d0]).mean_input_tokens == pytest.approx(both)  # none since: the window's
    assert w.traffic(30.0, [p0, n0, d0]).mean_input_tokens == pytest.approx(101)  # the first window is over
    assert mean_prompt([msgspec.structs.replace(p0, mode=NULL), n0, d0])[0] == pytest.approx(200)  # moved
    assert mean_prompt([counts(PREFILL, "p0", 5, 1500), n0, d0])[0] == pytest.approx(200)  # restarted
    assert mean_prompt([counts(PREFILL, "p0", -1, -1), n0, d0])[0] == pytest.approx(101)  # does not count
    assert mean_prompt([counts(PREFILL, "p0", 500, 90_000), counts(NULL, "n0", 19, 19 * 200)])[0] \
        == pytest.approx(101)  # too few


def test_past_windows_mixes_are_remembered_across_shifts_and_the_last_seconds_rate_kept():
    """Traffic.past_mixes: the mean prompt and answer of the window's lengths (its finished requests reporting both,
    or the last MIN_LENGTH_SAMPLES since the shift where it has fewer; MIN_COHORT_SAMPLES or more), one per window
    length, newest first, at most MIX_MEMORY, kept when a shift of the mix restarts
    the length history. Traffic.recent_arrival_rate: the arrivals of the last ANSWER_COHORT_S seconds."""
    from tidal.planner.window import (ANSWER_COHORT_S, MIN_COHORT_SAMPLES, MIN_LENGTH_SAMPLES,
                                      MIX_MEMORY)

    w = TrafficWindow(30.0, 0.0, burst_window_s=300.0)
    for k in range(MIN_LENGTH_SAMPLES):
        w.completion(1.0 + k * 0.1, Observation(path="pd", prompt_tokens=400 + 20 * (k % 2), completion_tokens=5))
    w.completion(8.0, Observation(path="pd", prompt_tokens=0, completion_tokens=50))  # no prompt length: left out
    assert w.traffic(10.0).past_mixes == [[410.0, 5.0]]
    assert w.traffic(20.0).past_mixes == [[410.0, 5.0]]  # one per window length
    for k in range(MIN_LENGTH_SAMPLES):  # a new mix, 15x the answers: the history restarts, the past mixes stay
        w.completion(45.0 + k * 0.1, Observation(path="pd", prompt_tokens=60, completion_tokens=75))
    assert w.traffic(55.0).past_mixes == [[60.0, 75.0], [410.0, 5.0]] and w.mix_shifts == 1
    assert w.traffic(70.0).past_mixes == [[60.0, 75.0], [410.0, 5.0]]  # 15 s after the last: none new
    for t in range(MIX_MEMORY + 5):
        for k in range(MIN_LENGTH_SAMPLES):
            w.completion(100.0 + 30 * t, Observation(path="pd", prompt_tokens=60, completion_tokens=75))
        w.traffic(100.0 + 30 * t)
    assert len(w.traffic(100.0 + 30 * (MIX_MEMORY + 5)).past_mixes) == MIX_MEMORY
    # a small cluster: after the router's first window MIN_COHORT_SAMPLES finished in a window are a mix (three
    # servers at a request a second finish ~20 a window); fewer are not, nor over the first window (the shortest
    # finish first there)
    early = TrafficWindow(20.0, 0.0, burst_window_s=300.0)
    for k in range(MIN_COHORT_SAMPLES):
        early.completion(1.0 + k * 0.5, Observation(path="pd", prompt_tokens=768, completion_tokens=4))
    assert early.traffic(12.0).past_mixes == []
    small = TrafficWindow(20.0, 0.0, burst_window_s=300.0)
    for k in range(MIN_COHORT_SAMPLES - 1):
        small.completion(5.0 + k * 0.5, Observation(path="pd", prompt_tokens=768, completion_tokens=4))
    assert small.traffic(21.0).past_mixes == []
    small.completion(21.5, Observation(path="pd", prompt_tokens=768, completion_tokens=4))
    assert small.traffic(22.0).past_mixes == [[768.0, 4.0]]
    # a window with fewer of its own keeps the last MIN_LENGTH_SAMPLES since the shift (the window's lengths)
    for k in range(10):
        small.completion(40.0 + k, Observation(path="pd", prompt_tokens=700, completion_tokens=6))
    assert small.traffic(50.0).past_mixes == [[pytest.approx((20 * 768 + 10 * 700) / 30), pytest.approx(14 / 3)],
                                              [768.0, 4.0]]
    rush = TrafficWindow(30.0, 0.0)
    for k in range(180):  # 4 a second for 20 s, then 10 a second
        rush.arrival(0.125 + k * 0.25 if k < 80 else 20.05 + (k - 80) * 0.1)
    assert ANSWER_COHORT_S == 10.0
    assert rush.traffic(30.0).arrival_rate == pytest.approx(6.0)
    assert rush.traffic(30.0).recent_arrival_rate == pytest.approx(10.0)
    early = TrafficWindow(30.0, 0.0)
    for k in range(20):
        early.arrival(0.125 + k * 0.25)
    assert early.traffic(5.0).recent_arrival_rate == pytest.approx(4.0)  # the router's first seconds: over them


def test_token_counts_from_answers_and_streams():
    assert body_token_counts(b'{"text":"x","meta_info":{"prompt_tokens":7,"completion_tokens":3}}') == (7, 3)
    assert body_token_counts(b'{"usage":{"prompt_tokens":5,"completion_tokens":2}}') == (5, 2)
    assert body_token_counts(b'[{"meta_info":{"prompt_tokens":1,"completion_tokens":2}},'
                             b'{"meta_info":{"prompt_tokens":3,"completion_tokens":4}}]') == (4, 6)
    assert body_token_counts(b"not json") == (0, 0)
    ticket = TrafficWindow(window_s=10.0, started_at=0.0).arrival(9.5)
    tally = StreamTally(first_at=10.0, ticket=ticket)
    for k in range(1, 5):
        tally.feed(b'data: {"meta_info":{"prompt_tokens":9,"completion_tokens":%d}}\n\n' % k)
        assert ticket.tokens == k  # the open request's answer so far
    tally.feed(b"data: [DONE]\n\n")
    obs = stream_observation("pd", 9.5, tally, 10.3)
    assert (obs.prompt_tokens, obs.completion_tokens) == (9, 4)
    assert obs.ttft_s == pytest.approx(0.5) and obs.tpot_s == pytest.approx(0.1)
    plain = StreamTally(first_at=0.0)
    plain.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}\n\n')
    assert plain.token_counts() == (0, 2)


def test_a_body_that_makes_several_requests_counts_as_that_many():
    from tidal.router.dispatch import MAX_COUNTED_REQUESTS, requests_in

    assert requests_in("/generate", {"text": "hi"}) == 1
    assert requests_in("/generate", {"input_ids": [1, 2, 3]}) == 1
    assert requests_in("/generate", {"text": ["a", "b", "c"]}) == 3
    assert requests_in("/generate", {"input_ids": [[1], [2]]}) == 2
    assert requests_in("/generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2}}) == 6
    assert requests_in("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 3}, {}]}) == 4
    assert requests_in("/v1/completions", {"prompt": "hi", "n": 2}) == 2
    assert requests_in("/v1/completions", {"prompt": [5, 6, 7]}) == 1  # one prompt's token ids
    assert requests_in("/v1/completions", {"prompt": ["a", "b"], "n": 3}) == 6
    assert requests_in("/v1/completions", {"prompt": [[5], [6]]}) == 2
    assert requests_in("/v1/chat/completions", {"messages": [], "n": 4}) == 4
    for bad in ("2", 0, -1, True, None):  # the server refuses these; the router counts one
        assert requests_in("/v1/chat/completions", {"messages": [], "n": bad}) == 1
    assert requests_in("/v1/chat/completions", {"messages": [], "n": 10**12}) == MAX_COUNTED_REQUESTS
    assert requests_in("/generate", {"text": ["a"] * 300, "sampling_params": {"n": 10**12}}) == MAX_COUNTED_REQUESTS


def test_a_batch_counts_its_items_as_arrivals_each_with_its_share_of_the_tokens():
    w = TrafficWindow(window_s=10.0, started_at=0.0)
    assert w.arrival(1.0, 4) is None  # no ticket for a batch: its stream counts all items' tokens together
    assert w.arrival(1.0) is not None
    w.completion(2.0, Observation(path="pd", prompt_tokens=100, completion_tokens=20), requests=4)
    w.completion(2.0, Observation(path="pd", prompt_tokens=600, completion_tokens=70))
    t = w.traffic(5.0)
    assert t.arrival_rate == pytest.approx(5 / 5.0) and t.completed == 5
    assert t.mean_input_tokens == pytest.approx(200) and t.mean_output_tokens == pytest.approx(30)


def test_a_batched_stream_gives_one_items_tokens():
    generate = StreamTally(first_at=1.0)  # a batched /generate: each event is one item's, counts its own
    for k in range(1, 4):
        for i in range(2):
            generate.feed(b'data: {"index":%d,"meta_info":{"prompt_tokens":9,"completion_tokens":%d}}\n\n' % (i, k))
    assert generate.token_counts(requests=2) == (9, 3)
    usage = StreamTally(first_at=1.0)  # OpenAI, n=2: the usage chunk counts both choices
    usage.feed(b'data: {"choices":[],"usage":{"prompt_tokens":18,"completion_tokens":8}}\n\ndata: [DONE]\n\n')
    assert usage.token_counts(requests=2) == (9, 4)
    events = StreamTally(first_at=1.0)  # no counts: a token an event, over the choices
    events.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n' * 6)
    obs = stream_observation("pd", 0.5, events, 3.0, requests=2)
    assert (obs.prompt_tokens, obs.completion_tokens) == (0, 3) and obs.tpot_s == pytest.approx(1.0)


def test_a_whole_answer_gives_the_servers_own_ttft_and_tpot():
    from tidal.planner.window import whole_observation

    one = b'{"meta_info":{"prompt_tokens":7,"completion_tokens":5,"first_token_latency":0.5,"e2e_latency":2.5}}'
    obs = whole_observation("null", 1.0, one)
    assert (obs.prompt_tokens, obs.completion_tokens, obs.ttft_s, obs.tpot_s) == (7, 5, 0.5, 0.5)
    batch = (b'[{"meta_info":{"prompt_tokens":4,"completion_tokens":3,"first_token_latency":1.0,"e2e_latency":2.0}},'
             b'{"meta_info":{"prompt_tokens":6,"completion_tokens":1,"first_token_latency":2.0,"e2e_latency":2.0}}]')
    obs = whole_observation("pd", 1.0, batch, requests=2)
    assert (obs.prompt_tokens, obs.completion_tokens) == (5, 2)
    assert obs.ttft_s == pytest.approx(1.5) and obs.tpot_s == pytest.approx(0.5)  # one answer has no TPOT
    for says_nothing in (b'{"usage":{"prompt_tokens":5,"completion_tokens":2}}',
                         b'{"meta_info":{"prompt_tokens":5,"completion_tokens":2,"e2e_latency":1.0}}', b"not json"):
        obs = whole_observation("pd", 1.0, says_nothing)
        assert obs.ttft_s is None and obs.tpot_s is None
    w = TrafficWindow(window_s=10.0, started_at=0.0)
    w.arrival(1.0)
    w.completion(3.5, whole_observation("null", 1.0, one))
    t = w.traffic(4.0)
    assert t.ttft_s == {"null": 0.5} and t.tpot_s == {"null": 0.5}


def test_an_openai_whole_answer_gives_the_servers_ttft_and_tpot_by_its_server_timing_header():
    from tidal.planner.window import whole_observation
    from tidal.server_timing import format_server_timing, mean_latencies, parse_server_timing

    usage = b'{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":8}}'
    header = format_server_timing(*mean_latencies([(0.4, 1.1, 8), (0.6, 1.3, 1)]))  # n=2: one answer of 1 token
    assert header == "ttft;dur=500.000, tpot;dur=100.000"
    obs = whole_observation("pd", 1.0, usage, requests=2, server_timing=header)
    assert (obs.prompt_tokens, obs.completion_tokens) == (5, 4)
    assert obs.ttft_s == pytest.approx(0.5) and obs.tpot_s == pytest.approx(0.1)
    meta = b'{"meta_info":{"prompt_tokens":7,"completion_tokens":5,"first_token_latency":0.5,"e2e_latency":2.5}}'
    assert whole_observation("pd", 1.0, meta, server_timing="ttft;dur=9000").ttft_s == 0.5  # the body says it
    assert parse_server_timing('cache;desc="hit", TTFT;dur=12.5;desc=x, tpot;dur="3"') == (0.0125, 0.003)
    for unusable in (None, "", "ttft", "ttft;dur=abc, tpot;dur=-1", "ttft;dur=nan, tpot;dur=inf", ";;,,"):
        assert parse_server_timing(unusable) == (None, None)
    assert format_server_timing(None, None) is None and mean_latencies([(None, 1.0, 4)]) == (None, None)


def test_a_stream_that_reports_no_prompt_length_leaves_the_prompt_statistics_alone():
    w = TrafficWindow(window_s=10.0, started_at=0.0)
    for k in range(4):
        w.arrival(1.0)
        w.completion(2.0, Observation(path="pd", prompt_tokens=300, completion_tokens=10))
        w.arrival(1.0)
        w.completion(2.0, Observation(path="pd", prompt_tokens=0, completion_tokens=30))  # events only
    t = w.traffic(5.0)
    assert t.mean_input_tokens == 300 and set(t.input_tokens_deciles) == {300}
    assert t.mean_output_tokens == 20 and t.completed == 8


def test_cost_model_interpolates_and_extrapolates():
    assert COST.prefill_seconds(500) == pytest.approx(0.5, rel=1e-3)
    assert COST.prefill_seconds(2000) == pytest.approx(2.0, rel=1e-3)
    assert COST.decode_step_seconds(1, 0) == pytest.approx(0.02)
    assert COST.decode_step_seconds(32, 1000) == pytest.approx(0.02 + 0.0005 * 31 + 0.001)
    assert COST.kv_transfer_seconds(0) >= 0 and COST.switch_seconds(NULL, PREFILL) == 0.0
    assert COST.max_total_tokens == KV


def test_no_move_before_a_request_finished():
    d = decide(NOW, cfg(), PlannerState(), STARVED_PREFILL, Traffic(arrival_rate=2.0), COST)
    assert d.kind == "hold" and "lengths unknown" in d.reason


# ---------------------------------------------------------------- flags


def test_router_flags_build_the_planner_config():
    import argparse

    from tidal.router.cli import add_router_args, router_config_from_namespace

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    cfg_ = router_config_from_namespace(parser.parse_args([
        "--planner", "sla", "--ttft-slo-ms", "500", "--tpot-slo-ms", "40", "--planner-interval-s", "2",
        "--planner-cooldown-s", "10", "--planner-min-per-pool", "2", "--planner-max-concurrent-moves", "2",
        "--planner-profile", "/p.json"]))
    p = cfg_.planner
    assert (p.mode, p.ttft_slo_s, p.tpot_slo_s, p.interval_s, p.cooldown_s) == ("sla", 0.5, 0.04, 2.0, 10.0)
    assert (p.min_per_pool, p.max_concurrent_moves, p.per_worker_cooldown_s) == (2, 2, 30.0)
    assert cfg_.planner_profile == "/p.json"
    assert router_config_from_namespace(parser.parse_args([])).planner.mode == "static"
    with pytest.raises(ValueError):
        router_config_from_namespace(parser.parse_args(["--planner-max-concurrent-moves", "0"]))


def test_cluster_passes_planner_flags_to_its_router_and_lets_servers_switch():
    import argparse

    from tidal.cluster import _router_cmd, _server_cmd, add_cluster_args, plan_servers

    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    ns = parser.parse_args(["--prefill", "1", "--decode", "1", "--worker", "1", "--planner", "sla",
                            "--ttft-slo-ms", "800", "--planner-interval-s", "3"])
    plan = plan_servers(ns)
    cmd = _router_cmd(ns, plan)
    assert cmd[cmd.index("--planner") + 1] == "sla" and cmd[cmd.index("--ttft-slo-ms") + 1] == "800.0"
    assert cmd[cmd.index("--planner-interval-s") + 1] == "3.0"
    ports = [bport for _, _, _, bport in plan]
    assert None not in ports and len(set(ports)) == 3  # any server may become a prefill server
    assert all("--enable-dynamic-disaggregation" in _server_cmd(ns, m, port, b, 1, 3) for _, m, port, b in plan)
    static = parser.parse_args(["--prefill", "1", "--decode", "1"])
    assert "--enable-dynamic-disaggregation" not in _server_cmd(static, "decode", 1, None, 1, 2)
    assert [b for _, _, _, b in plan_servers(static)] == [8998, None]


def test_cluster_refuses_bad_planner_flags_before_starting_a_server(tmp_path, capsys, monkeypatch):
    import argparse

    import tidal.cluster as cluster

    parser = argparse.ArgumentParser()
    cluster.add_cluster_args(parser)
    started = []
    monkeypatch.setattr(cluster.subprocess, "Popen", lambda *a, **k: started.append(a))
    missing = str(tmp_path / "missing.json")
    unreadable = f"[cluster] error: --planner-profile: cannot read profile {missing}"
    for flags, says in ((["--planner-profile", missing], unreadable),
                        (["--planner-hysteresis", "-1"], "[cluster] error: planner: --planner-hysteresis")):
        assert cluster.run_cluster(parser.parse_args(["--planner", "sla", *flags])) == 2
        assert says in capsys.readouterr().err
    assert started == []


def test_router_refuses_an_unreadable_profile(tmp_path, capsys):
    import argparse

    from tidal.router.cli import add_router_args, run_router

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "prefill": "not a list"}')
    for path in (str(tmp_path / "missing.json"), str(bad)):
        assert run_router(parser.parse_args(["--planner", "sla", "--planner-profile", path])) == 2
        err = capsys.readouterr().err
        assert "tidal router: error: --planner-profile" in err and err.count(path) == 1, err  # the file named once


def test_ties_go_to_the_worker_with_least_to_drain_counting_router_in_flight():
    """A decode worker with nothing running may still hold PD requests queued at prefill (the router's
    in-flight count): moving it means waiting for them, so the planner moves another one."""
    loads = layout(2, 2, 0, prefill={"running_reqs": 60})
    busy_decode = loads[2]
    loads[2] = WorkerLoad(url=busy_decode.url, mode=DECODE, kv_tokens_total=KV, in_flight=40)
    loads[3] = WorkerLoad(url=loads[3].url, mode=DECODE, kv_tokens_total=KV, running_reqs=1)
    d = decide(NOW, cfg(), PlannerState(), loads, LONG_PROMPTS, COST)
    assert d.kind == "move" and d.src == DECODE, d.reason
    assert d.url == loads[3].url


def test_while_slos_are_met_it_moves_toward_more_capacity():
    """1 prefill : 3 decode at 0.4 long prompts/s meets the SLOs (TTFT ~1.3 s of 3), but a burst of twice
    the rate would break them; more prefill workers raise the rate the layout can take: the planner moves
    before the burst, not once it is there. Below the hysteresis it holds."""
    traffic = Traffic(arrival_rate=0.4, mean_input_tokens=1000, mean_output_tokens=20)
    loads = layout(1, 3, 0)
    d = decide(NOW, cfg(), PlannerState(), loads, traffic, COST)
    assert d.current.score < 1 and d.current.capacity < 2
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL) and "capacity" in d.reason, d.reason
    assert d.target.capacity > 1.3 * d.current.capacity
    held = decide(NOW, cfg(hysteresis=d.target.capacity / d.current.capacity), PlannerState(), loads, traffic, COST)
    assert held.kind == "hold" and "gains too little" in held.reason, held.reason


def test_a_window_younger_than_its_span_asks_a_larger_capacity_gain():
    """Over the router's first seconds the rate and mix are measured over less than the window: a capacity gain
    must pass the hysteresis times sqrt(window / seconds measured). The same gain moves once the window is
    whole, or where the window's span is not reported."""
    from tidal.planner.decide import young_hysteresis

    traffic = Traffic(arrival_rate=0.4, mean_input_tokens=1000, mean_output_tokens=20)
    loads = layout(1, 3, 0)
    whole = decide(NOW, cfg(), PlannerState(), loads, traffic, COST)
    assert whole.kind == "move", whole.reason
    gain = whole.target.capacity / whole.current.capacity - 1
    hysteresis = gain * 0.9  # passed by the gain over a whole window
    for span, kind in ((None, "move"), (30.0, "move"), (60.0, "move"), (5.0, "hold"), (20.0, "hold")):
        t = msgspec.structs.replace(traffic, span_s=span)
        assert young_hysteresis(hysteresis, t, 30.0) == (hysteresis if span is None or span >= 30 else
                                                       pytest.approx(hysteresis * math.sqrt(30.0 / span)))
        d = decide(NOW, cfg(hysteresis=hysteresis, window_s=30.0), PlannerState(), loads, t, COST)
        assert d.kind == kind, (span, d.reason)
    young = decide(NOW, cfg(hysteresis=hysteresis, window_s=30.0), PlannerState(), loads,
                   msgspec.structs.replace(traffic, span_s=5.0), COST)
    assert "over the window's first 5 s" in young.reason, young.reason


def test_a_heavy_tailed_prompt_mix_costs_more_than_its_mean_prompt():
    """Same mean prompt (1000 tokens); on a convex prefill curve the spread mix takes longer per request
    and waits longer (M/G/1), so its predicted TTFT is higher and the rate it can take lower."""
    convex = dict(PROFILE, prefill=[{"tokens": 1, "seconds": 0.001}, {"tokens": 1000, "seconds": 1.0},
                                    {"tokens": 4000, "seconds": 10.0}])
    cost = CostModel.from_dict(convex)
    even = Traffic(arrival_rate=0.4, mean_input_tokens=1000, mean_output_tokens=20, input_tokens_deciles=[1000] * 10)
    spread = Traffic(arrival_rate=0.4, mean_input_tokens=1000, mean_output_tokens=20,
                     input_tokens_deciles=[250] * 8 + [4000] * 2)
    loads = layout(1, 3, 0)
    a = decide(NOW, cfg(), PlannerState(), loads, even, cost)
    b = decide(NOW, cfg(), PlannerState(), loads, spread, cost)
    assert b.current.paths["pd"].ttft_s > 2 * a.current.paths["pd"].ttft_s
    assert b.current.capacity < 0.7 * a.current.capacity
    assert b.kind == "move" and b.src == DECODE and b.dst in (PREFILL, NULL), b.reason  # a worker that prefills


def test_window_reports_prompt_length_deciles():
    w = TrafficWindow(30.0, 0.0)
    for n in range(1, 101):
        w.completion(1.0, Observation(path="pd", prompt_tokens=n, completion_tokens=5))
    assert w.traffic(2.0).input_tokens_deciles == [6, 16, 26, 36, 46, 56, 66, 76, 86, 96]
    assert TrafficWindow(30.0, 0.0).traffic(1.0).input_tokens_deciles == []


def test_in_a_large_cluster_the_planner_heads_for_the_best_layout_not_the_best_single_move():
    """32:32 under long prompts: one more prefill worker raises the capacity by only ~3% (below the
    hysteresis), the best layout by much more. The planner starts moving toward it, one worker at a
    time, and goes on with the next interval while its first move is in flight (max 2 at once)."""
    loads = layout(32, 32, 0)
    traffic = Traffic(arrival_rate=20, mean_input_tokens=1000, mean_output_tokens=20)
    c, state = cfg(max_concurrent_moves=2), PlannerState()
    d = decide(NOW, c, state, loads, traffic, COST)
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL), d.reason
    assert d.best.prediction.capacity < 1.1 * d.current.capacity < 1.3 * d.current.capacity < d.target.capacity
    assert d.target.pools[PREFILL] > 40 and "move(s) away" in d.reason
    state.started(NOW, d.url, d.src, d.dst)
    moving = [w for w in loads if w.url != d.url]
    nxt = decide(NOW + 5, c, state, moving, traffic, COST)
    assert nxt.kind == "move" and (nxt.src, nxt.dst) == (DECODE, PREFILL) and nxt.url != d.url, nxt.reason
    assert nxt.current.pools == {PREFILL: 33, DECODE: 31, NULL: 0}  # counts the move in flight as landed
    # from the layout it heads for, no move back
    there = decide(NOW, c, PlannerState(), layout(**dict(zip(("p", "d", "n"), (d.target.pools[PREFILL],
                   d.target.pools[DECODE], d.target.pools[NULL])))), traffic, COST)
    assert there.kind == "hold", there.reason


def test_among_near_best_layouts_one_whose_decode_pool_takes_the_bursts_wins():
    """Long prompts in bursts (twice the mean rate): 63:1 has the most capacity, with its one decode worker
    predicted at the mean rate; at the burst rate that worker is far short. Among the layouts within 5% of
    the best, the planner heads for one whose decode pool also takes the burst (61:3). Without bursts
    the target is the best layout, as before."""
    import tidal.planner.decide as decide_module
    from tidal.planner.predict import CostPredictor, PoolLoad

    current = {NULL: 0, PREFILL: 32, DECODE: 32}
    bursty = Traffic(arrival_rate=20, mean_input_tokens=1000, mean_output_tokens=20, prefill_peak_ratio=2.0)
    d = decide(NOW, cfg(max_concurrent_moves=2), PlannerState(), layout(32, 32, 0), bursty, COST)
    assert d.target.pools == {NULL: 0, PREFILL: 61, DECODE: 3}, d.target.pools
    pred = CostPredictor(COST, 3.0, 0.1, 5.0)
    best = max((decide_module.rated(pred, {NULL: 0, PREFILL: 64 - k, DECODE: k}, PoolLoad([]), bursty)
                for k in range(1, 8)), key=lambda x: x.capacity)
    assert best.pools[DECODE] == 1 and not decide_module.robust(pred.with_decode_bursts(), best, PoolLoad([]), bursty)
    assert d.target.capacity >= best.capacity * 0.95
    steady = msgspec.structs.replace(bursty, prefill_peak_ratio=1.0)
    assert decide_module.best_layout(pred, current, PoolLoad([]), steady, 1).pools == {NULL: 0, PREFILL: 61,
                                                                                      DECODE: 3}


def test_a_layout_short_of_todays_rate_moves_below_the_hysteresis_to_one_that_meets_it():
    """6 prefill : 2 decode on long prompts: at 4.5 requests/s both it and 7:1 meet the SLOs and 7:1 gains 17%
    of capacity, below the hysteresis: hold. At 5.0 the same gain separates a layout that misses today's rate
    from one that meets it: the planner moves."""
    loads = layout(6, 2, 0)
    met = decide(NOW, cfg(), PlannerState(), loads, Traffic(arrival_rate=4.5, mean_input_tokens=1000,
                                                           mean_output_tokens=20), COST)
    assert met.kind == "hold" and "gains too little" in met.reason, met.reason
    assert 1 <= met.current.capacity < met.target.capacity < 1.3 * met.current.capacity
    short = decide(NOW, cfg(), PlannerState(), loads, Traffic(arrival_rate=5.0, mean_input_tokens=1000,
                                                             mean_output_tokens=20), COST)
    assert short.current.capacity < 1 <= short.target.capacity < 1.3 * short.current.capacity
    assert short.kind == "move" and (short.src, short.dst) == (DECODE, PREFILL), short.reason
    assert "meets today's rate" in short.reason


def test_short_of_todays_rate_a_layout_that_meets_the_tpot_slo_pays_against_one_that_misses_it():
    """Neither layout meets today's rate and the current one has the larger capacity (0.85x against 0.83x), but its
    decode side misses the TPOT SLO now and the target's meets it: heading there pays, for a capacity down by the
    hysteresis at most. Either side of that, the capacities decide."""
    from tidal.planner.decide import gain_enough
    from tidal.planner.schema import PD_PATH, PathPrediction, Prediction

    def pred(pools: tuple[int, int], capacity: float, ttft_s: float, tpot_s: float) -> Prediction:
        score = max(ttft_s / 8.0, tpot_s / 0.2)
        return Prediction(pools={NULL: 0, PREFILL: pools[0], DECODE: pools[1]}, score=score, capacity=capacity,
                          paths={PD_PATH: PathPrediction(share=1.0, ttft_s=ttft_s, tpot_s=tpot_s, score=score)})

    missing = pred((61, 3), 0.85, 36.7, 0.327)
    meeting = pred((60, 4), 0.83, 13.9, 0.062)
    pays, why = gain_enough(missing, meeting, 0.3, tpot_slo_s=0.2)
    assert pays and "meets the TPOT SLO at today's rate, which the current layout misses" in why, why
    assert not gain_enough(missing, meeting, 0.3)[0]  # no TPOT SLO given: the capacities alone
    assert not gain_enough(pred((61, 3), 0.85, 36.7, 0.15), meeting, 0.3, tpot_slo_s=0.2)[0]  # both meet it
    assert not gain_enough(missing, pred((60, 4), 0.83, 13.9, 0.25), 0.3, tpot_slo_s=0.2)[0]  # both miss it
    assert gain_enough(missing, pred((60, 4), 0.6, 13.9, 0.062), 0.3, tpot_slo_s=0.2)[0]  # 0.3 down: still pays
    assert not gain_enough(missing, pred((60, 4), 0.59, 13.9, 0.062), 0.3, tpot_slo_s=0.2)[0]  # further: not


def test_in_overload_a_decode_pool_that_meets_the_tpot_slo_is_not_traded_for_one_that_misses_it():
    """4 prefill : 2 decode with 5000 prompt tokens queued: no layout meets the SLOs at any rate (the backlog).
    5:1 scores best (TTFT 4.7 s against 5.8 s), but with 100-token answers its one decode worker misses the
    30-ms TPOT SLO at today's rate (33 ms) where 4:2's two meet it (25 ms): every request would pay, while
    the backlog drains. The planner holds. With 50-token answers 5:1 meets it too, and the planner moves."""
    loads = layout(4, 2, 0, prefill={"queued_prefill_tokens": 5000})
    c = cfg(tpot_slo_s=0.03)

    def at(answer_tokens: int):
        return decide(NOW, c, PlannerState(), loads, Traffic(arrival_rate=4.0, mean_input_tokens=500,
                                                             mean_output_tokens=answer_tokens), COST)

    long = at(100)
    assert long.current.capacity == 0 and long.current.paths["pd"].tpot_s <= 0.03
    assert long.kind == "hold" and long.target.pools[DECODE] == 2, long.reason
    short = at(50)
    assert short.kind == "move" and (short.src, short.dst) == (DECODE, PREFILL), short.reason
    assert short.target.pools[DECODE] == 1 and short.target.paths["pd"].tpot_s <= 0.03


def test_in_overload_the_layout_whose_prefill_side_falls_behind_least_wins():
    """4 prefill : 4 decode, 40 prompts of 500 tokens queued (20 s of one worker's prefill), 9 requests/s: no
    layout meets the SLOs at any rate. Each prefill worker passes 2 prompts/s, so 4 fall behind by 1/s, 5 work
    the backlog off in 40 s and 6 in 13 s; 7:1's one decode worker misses the 30-ms TPOT SLO. The planner heads
    for 6:2 and says why in backlog terms."""
    loads = layout(4, 4, 0, prefill={"queued_prefill_tokens": 5000})  # 20000 in all
    d = decide(NOW, cfg(tpot_slo_s=0.03, max_concurrent_moves=2), PlannerState(), loads,
               Traffic(arrival_rate=9.0, mean_input_tokens=500, mean_output_tokens=40), COST)
    assert d.current.capacity == 0 and d.current.drain_rate == pytest.approx(-1.0)
    assert d.current.recovery_s == NEVER
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL), d.reason
    assert (d.target.pools[PREFILL], d.target.pools[DECODE]) == (6, 2), d.reason
    assert d.target.recovery_s == pytest.approx(40 / 3) and "backlog" in d.reason


def test_in_overload_a_null_path_without_a_backlog_that_falls_behind_does_not_recover():
    """6 prefill : 2 decode, 10 prompts of 500 tokens queued on each prefill worker, 9 requests/s; a worker passes
    ~2 prompts/s. Null workers start with no backlog, but the router sends them a share of the arrivals: one null
    beside one decode worker takes half (4.5/s) and falls behind from the start, so 6:1:1 never recovers, while
    4 null workers beside one decode take 7.2/s, which they pass, and only the PD path's backlog counts. A planner
    that counted backlogs only where they are today moved a backlogged prefill worker to null in a code burst and
    back 15 s later (the shifting mix, shipped profile). With a TPOT SLO that every path meets, the prefill side
    decides: the planner heads for 7:1, which works the backlog off soonest."""
    loads = layout(6, 2, 0, prefill={"queued_prefill_tokens": 5000})
    c = cfg(tpot_slo_s=5.0, max_concurrent_moves=4)
    traffic = Traffic(arrival_rate=9.0, mean_input_tokens=500, mean_output_tokens=40)
    predictor = CostPredictor(COST, c.ttft_slo_s, c.tpot_slo_s, c.interval_s)
    load = PoolLoad(loads)
    behind = predictor.predict({PREFILL: 6, DECODE: 1, NULL: 1}, load, traffic)
    assert behind.recovery_s == NEVER and behind.drain_rate < 0
    keeps_up = predictor.predict({PREFILL: 3, DECODE: 1, NULL: 4}, load, traffic)
    assert 0 < keeps_up.recovery_s < NEVER and keeps_up.drain_rate > 0
    d = decide(NOW, c, PlannerState(), loads, traffic, COST)
    assert d.kind == "move" and d.target.pools == {PREFILL: 7, DECODE: 1, NULL: 0}, d.reason


def test_in_overload_with_no_layout_catching_up_the_target_falls_behind_least():
    """64 workers, a backlog that no layout meeting the TPOT SLO works off: the planner heads for the one that
    falls behind least, the most prefill workers whose decode pool still meets the TPOT SLO, the same as a
    search of every layout finds (the coarse grid's best misses the TPOT SLO; the refinement centres on the
    best that may be chosen)."""
    c = cfg(tpot_slo_s=0.03)
    traffic = Traffic(arrival_rate=70.0, mean_input_tokens=500, mean_output_tokens=170)
    loads = layout(12, 52, 0, prefill={"queued_prefill_tokens": 10000})
    d = decide(NOW, c, PlannerState(), loads, traffic, COST)
    assert d.current.recovery_s == NEVER and d.target.recovery_s == NEVER
    predictor = CostPredictor(COST, c.ttft_slo_s, c.tpot_slo_s, c.interval_s)
    load = PoolLoad([w for w in loads])
    feasible = [p for p in range(1, 64)
                if predictor.predict({PREFILL: p, DECODE: 64 - p, NULL: 0}, load, traffic).paths["pd"].tpot_s <= 0.03]
    assert d.target.pools[PREFILL] == max(feasible), d.reason
    assert d.kind == "move" and "backlog grows" in d.reason


def test_moves_toward_a_committed_target_go_on_below_the_hysteresis():
    """Once a target has passed the hysteresis, the next moves toward it do not have to pass it again:
    one worker short of the target the remaining gain is small, and a planner re-testing it would stop
    there. A planner that has not committed (fresh state) holds at that same layout."""
    traffic = Traffic(arrival_rate=20, mean_input_tokens=1000, mean_output_tokens=20)
    c, state = cfg(max_concurrent_moves=1), PlannerState()
    loads = layout(32, 32, 0)
    d = decide(NOW, c, state, loads, traffic, COST)
    assert d.kind == "move" and "(committed)" not in d.reason
    target = d.target.pools
    p, dd = 32, 32
    for step in range(64):  # land every move, one at a time, until the target is reached
        if d.kind != "move":
            break
        state.started(NOW + step, d.url, d.src, d.dst)
        p, dd = p + (d.dst == PREFILL) - (d.src == PREFILL), dd + (d.dst == DECODE) - (d.src == DECODE)
        state.finished(NOW + step, d.url, True, c)
        d = decide(NOW + step + 0.5, cfg(max_concurrent_moves=1, cooldown_s=0, worker_cooldown_s=0), state,
                   layout(p, dd, 0), traffic, COST)
    assert {PREFILL: p, DECODE: dd} == {PREFILL: target[PREFILL], DECODE: target[DECODE]}
    assert d.kind == "hold" and state.committed is None
    # one move short of the target, a fresh planner finds the last move's gain below the hysteresis
    short = decide(NOW, c, PlannerState(), layout(p - 1, dd + 1, 0), traffic, COST)
    assert short.kind == "hold" and "hysteresis" in short.reason, short.reason


def test_the_target_search_finds_the_best_layout_of_the_full_grid():
    """Beyond GRID_FULL workers the coarse grid refined around its best finds the same best score as
    predicting every layout."""
    from tidal.planner.decide import best_layout, capacity, make_predictor
    from tidal.planner.predict import PoolLoad

    rng = random.Random(3)
    for _ in range(3):
        n = rng.choice((32, 48))
        traffic = Traffic(arrival_rate=rng.uniform(2, 30), mean_input_tokens=rng.uniform(100, 1500),
                          mean_output_tokens=rng.uniform(10, 400))
        current = {PREFILL: n // 2, DECODE: n - n // 2, NULL: 0}
        predictor = make_predictor(cfg(), COST, current)
        found = best_layout(predictor, current, PoolLoad([]), traffic, 1)
        every = max(capacity(predictor, {PREFILL: p, DECODE: d, NULL: n - p - d}, PoolLoad([]), traffic)
                    for p in range(1, n + 1) for d in range(1, n + 1 - p))
        assert found.capacity >= every * 0.95, (n, traffic, found.pools)


def test_the_running_request_limit_caps_the_batch_and_the_excess_waits():
    """With the profile's max_running_requests, an overloaded decode worker runs at most that batch: TPOT
    stays the step of that batch, the excess shows as TTFT (waiting for a slot)."""
    capped = CostModel.from_dict(dict(PROFILE, server={"max_total_tokens": KV, "max_running_requests": 8}))
    heavy = Traffic(arrival_rate=6.0, mean_input_tokens=100, mean_output_tokens=500)
    loads = layout(2, 1, 0)
    free = decide(NOW, cfg(), PlannerState(), loads, heavy, COST).current.paths["pd"]
    tight = decide(NOW, cfg(), PlannerState(), loads, heavy, capped).current.paths["pd"]
    step8 = capped.decode_step_seconds(8, 8 * 350)
    assert tight.tpot_s == pytest.approx(step8, rel=0.01)
    assert tight.tpot_s < free.tpot_s
    assert tight.ttft_s > free.ttft_s + 5.0  # 6 req/s against 8 slots freed every 500 steps


def test_a_decode_pool_short_of_the_mean_rate_never_catches_up():
    """Saturated at the window's mean rate, a decode pool's queue for a slot grows while that rate lasts
    (SATURATED_HORIZON_S), not for one interval: 10% short, the layout misses the TTFT SLO at today's rate
    (charged one interval it added 0.5 s and ranked 1.4x today's rate in capacity). A burst's excess over
    the mean waits one interval."""
    from tidal.planner.predict import SATURATED_HORIZON_S, CostPredictor, PoolLoad

    capped = CostModel.from_dict(dict(PROFILE, server={"max_total_tokens": KV, "max_running_requests": 8}))
    mu = 8 / (500 * capped.decode_step_seconds(8, 8 * 350))  # requests a second one decode worker passes
    short = Traffic(arrival_rate=1.1 * mu, mean_input_tokens=100, mean_output_tokens=500)
    d = decide(NOW, cfg(), PlannerState(), layout(2, 1, 0), short, capped)
    assert d.current.paths["pd"].ttft_s > SATURATED_HORIZON_S * 0.09 > cfg().ttft_slo_s
    assert d.current.capacity < 1.0
    pred = CostPredictor(capped, 3.0, 0.1, 5.0)
    load = PoolLoad(layout(2, 1, 0))
    _, burst = pred._decode(2 * mu, 0.0, 100, 500, load, 0.0, 0.5 * mu)
    _, both = pred._decode(2 * mu, 0.0, 100, 500, load, 0.0, 1.1 * mu)
    assert burst == pytest.approx(5.0, rel=0.01)  # one interval of a burst twice what the worker passes
    assert both == pytest.approx(5.0 * 0.9 + SATURATED_HORIZON_S * 0.1, rel=0.01)
    # null workers too: colocated, 10% short of the mean rate's decodes (more once prefill stalls them)
    alone = decide(NOW, cfg(min_per_pool=0), PlannerState(), layout(0, 0, 1), short, capped)
    assert alone.current.paths["null"].ttft_s > SATURATED_HORIZON_S * 0.09 and alone.current.capacity < 1.0


def test_a_prefill_pool_short_of_the_mean_rate_never_catches_up_whatever_the_ttft_slo():
    """A prefill pool whose full steps pass fewer prompts than the mean rate brings grows its queue while that rate
    lasts (SATURATED_HORIZON_S), as a decode pool does: 20% short, it misses a TTFT SLO of 30 s. Charged one
    interval (5 s x 1.2) it met it, and a loose TTFT SLO ranked prefill pools past their pace: on the conversation
    trace at 16 instances and 16 s, 5:11 at 3.13x the rate (49 requests/s) where its 5 prefill workers pass ~21.
    A burst above the pace for one interval still waits one interval."""
    from tidal.planner.predict import SATURATED_HORIZON_S, CostPredictor

    pace = 1.0  # the toy profile: 1000-token prompts, 1 s each, one at a time
    loose = cfg(ttft_slo_s=30.0)
    short = Traffic(arrival_rate=1.2 * pace, mean_input_tokens=1000, mean_output_tokens=20)
    d = decide(NOW, loose, PlannerState(), layout(1, 3, 0), short, COST)
    assert d.current.paths["pd"].ttft_s > SATURATED_HORIZON_S * 0.19 > loose.ttft_slo_s
    assert d.current.capacity < 1.0
    pred = CostPredictor(COST, 30.0, 0.1, 5.0)
    burst, _ = pred._prefill_queue(1.2 * pace, 0.0, 1000, (), 0.8 * pace)
    assert burst == pytest.approx(5.0 * 1.2 + 1.0, rel=0.01)  # one interval's queue, then its own second


def test_a_walk_reads_the_prompts_queued_on_the_workers_it_moves_as_the_mix():
    """A code window (450-token prompts, 5-token answers); 24 chat prompts of 80 tokens queue on 6 prefill workers, 4
    each, with a past window's answers of such prompts at 300 tokens: the planner walks to 2:6, moving the prefill
    workers that hold them. A worker that moves serves no pool, but its queued prompts arrived all the same: the walk
    keeps reading 24 of them to the end. (Dropping each moved worker's 4 left 16 after two moves, under
    QUEUED_SAMPLE, and the next decision, back on the window's code mix, turned to 7:1.)"""
    code = Traffic(arrival_rate=10.0, mean_input_tokens=450, mean_output_tokens=5, past_mixes=[[80.0, 300.0]])
    loads = layout(6, 2, 0, prefill={"queued_prefill_tokens": 4 * 80, "waiting_reqs": 4})
    state, c = PlannerState(), cfg(max_concurrent_moves=8)
    moves = []
    for _ in range(8):
        d = decide(NOW, c, state, loads, code, COST)
        assert "prompts of 80 tokens as queued (24 waiting" in d.reason, d.reason
        assert d.target.pools == {NULL: 0, PREFILL: 2, DECODE: 6}, d.reason
        if d.kind != "move":
            break
        moves.append((d.src, d.dst))
        state.started(NOW, d.url, d.src, d.dst)
    assert moves == [(PREFILL, DECODE)] * 4


def test_prompts_queued_for_prefill_stand_for_a_new_mix_the_window_has_not_seen_finish():
    """After a chat phase the window's finished requests say 80-token prompts; 30 prompts of 450 tokens queue on the
    prefill workers (the new mix, waiting behind the backlog it causes): the planner heads for the prefill pool
    that mix needs, and says why. Fewer than QUEUED_SAMPLE waiting, or a queue of the window's mix, change nothing."""
    from tidal.planner.queued import QUEUED_SAMPLE, queued_mix
    from tidal.planner.predict import PoolLoad

    chat = Traffic(arrival_rate=4.0, mean_input_tokens=80, mean_output_tokens=80,
                   input_tokens_deciles=[40, 50, 60, 70, 80, 85, 90, 100, 110, 130])
    queued = decide(NOW, cfg(), PlannerState(), layout(2, 6, 0, prefill={"queued_prefill_tokens": 15 * 450,
                                                                         "waiting_reqs": 15}), chat, COST)
    few = decide(NOW, cfg(), PlannerState(), layout(2, 6, 0, prefill={"queued_prefill_tokens": 15 * 450,
                                                                      "waiting_reqs": 9}), chat, COST)
    assert 2 * 9 < QUEUED_SAMPLE <= 2 * 15
    assert queued.kind == "move" and "prompts of 450 tokens as queued (30 waiting; the window's 80)" in queued.reason
    assert queued.target.pools[PREFILL] > few.target.pools[PREFILL] > 2, (queued.reason, few.reason)
    assert "as queued" not in few.reason
    same_mix = layout(2, 6, 0, prefill={"queued_prefill_tokens": 15 * 90, "waiting_reqs": 15})
    assert queued_mix(PoolLoad(same_mix), chat) == (chat, "")
    queued_450 = layout(2, 6, 0, prefill={"queued_prefill_tokens": 15 * 450, "waiting_reqs": 15})
    longer, _ = queued_mix(PoolLoad(queued_450), chat)
    assert longer.mean_input_tokens == 450 and longer.input_tokens_deciles[0] == round(40 * 450 / 80)
    # exactly QUEUED_SAMPLE waiting is enough; a decode worker's waiting (PD requests waiting for KV) is no prompt
    at_sample = {"queued_prefill_tokens": QUEUED_SAMPLE // 2 * 450, "waiting_reqs": QUEUED_SAMPLE // 2}
    assert queued_mix(PoolLoad(layout(2, 6, 0, prefill=at_sample)), chat)[0].mean_input_tokens == 450
    with_decodes = layout(2, 6, 0, prefill=at_sample, decode={"queued_prefill_tokens": 9000, "waiting_reqs": 90})
    assert queued_mix(PoolLoad(with_decodes), chat)[0].mean_input_tokens == 450
    # the other way: a code-like window, chat-like prompts queued on null workers
    code = msgspec.structs.replace(chat, mean_input_tokens=450, input_tokens_deciles=[])
    queued_80 = layout(1, 1, 4, null={"queued_prefill_tokens": 6 * 80, "waiting_reqs": 6})
    shorter, note = queued_mix(PoolLoad(queued_80), code)
    assert shorter.mean_input_tokens == 80 and "prompts of 80 tokens as queued (24 waiting" in note
    # their answers: those of the past window whose prompts were nearest theirs, within QUEUED_SHIFT; their rate:
    # the last seconds' (the window's straddles the shift)
    seen = msgspec.structs.replace(chat, past_mixes=[[80.0, 80.0], [350.0, 5.0], [600.0, 9.0], [420.0, 6.0]],
                                   recent_arrival_rate=2.0)
    known, note = queued_mix(PoolLoad(queued_450), seen)
    assert (known.mean_output_tokens, known.arrival_rate) == (6.0, 2.0)
    assert "answers of 6 as a past window's of such prompts (the window's 80)" in note
    assert "2.0 requests/s over the last seconds (the window's 4.0)" in note
    unseen = msgspec.structs.replace(chat, past_mixes=[[80.0, 80.0], [300.0, 5.0], [700.0, 9.0]])  # 1.5x off and more
    assert queued_mix(PoolLoad(queued_450), unseen)[0].mean_output_tokens == 80
    assert queued_mix(PoolLoad(queued_450), unseen)[0].arrival_rate == 4.0  # no recent rate reported: the window's
    # prompts that came with the window's kind of answers before tell no other mix, wherever the nearest window is:
    # on azure-shift at t = 420 s 40 prompts of 279 tokens queued after a code window of 477 / 8, nearest a
    # conversation window's (316 / 75) and near code windows' (306 / 4) too; the conversation's answers had moved 4
    # workers to decode ahead of a code burst
    code_window = msgspec.structs.replace(chat, mean_input_tokens=477, mean_output_tokens=8, input_tokens_deciles=[],
                                          past_mixes=[[477.0, 7.0], [306.0, 4.0], [316.0, 75.0]])
    queued_279 = layout(1, 1, 4, null={"queued_prefill_tokens": 10 * 279, "waiting_reqs": 10})
    kept, note = queued_mix(PoolLoad(queued_279), code_window)
    assert (kept.mean_input_tokens, kept.mean_output_tokens) == (279, 8) and "past window" not in note, note
    # and where a conversation window is the nearest (16 (c) at 16 s, rate scale 3.5, t = 420 s, 2026-12-02: 290-token
    # code prompts, the nearest past window 296 / 69.5, a code window 306 / 4.5 close behind): the nearest alone
    # would head for 12:4 from 15:1
    nearest_chat = msgspec.structs.replace(code_window, mean_input_tokens=441, mean_output_tokens=7.1,
                                           past_mixes=[[441.0, 7.1], [318.0, 42.7], [311.0, 58.1], [296.0, 69.5],
                                                       [306.0, 4.5]])
    queued_290 = layout(1, 1, 4, null={"queued_prefill_tokens": 10 * 290, "waiting_reqs": 10})
    assert queued_mix(PoolLoad(queued_290), nearest_chat)[0].mean_output_tokens == 7.1
    chat_only = msgspec.structs.replace(code_window, past_mixes=[[350.0, 25.0], [316.0, 75.0]])  # 25: over 3x of 8
    assert queued_mix(PoolLoad(queued_279), chat_only)[0].mean_output_tokens == 75
    # at three times the rate, 80-token answers would need a second decode worker; 6-token ones do not
    busy, busy_seen = (msgspec.structs.replace(t, arrival_rate=12.0, recent_arrival_rate=12.0) for t in (chat, seen))
    backlog = {"queued_prefill_tokens": 15 * 450, "waiting_reqs": 15}
    assumed = decide(NOW, cfg(), PlannerState(), layout(2, 6, 0, prefill=backlog), busy, COST)
    short_answers = decide(NOW, cfg(), PlannerState(), layout(2, 6, 0, prefill=backlog), busy_seen, COST)
    assert short_answers.target.pools[DECODE] == 1 < assumed.target.pools[DECODE], (short_answers.reason,
                                                                                     assumed.reason)
    assert "answers of 6 as a past window's of such prompts" in short_answers.reason


def test_a_move_decided_on_another_kind_of_answers_than_the_queue_stands_for_holds_nothing():
    """A worker moved prefill -> decode 5 s ago, decided on chat answers (80 tokens); now 30 code prompts of 450 tokens
    queue, and a past window of such prompts had 6-token answers: the reversal cooldown, which holds a layout against
    the noise of one mix, yields to the new one, and decode workers go to prefill. The same move decided on code-like
    answers, a move by hand (no answers known), or no queue standing for the mix, and the cooldown holds."""
    chat = Traffic(arrival_rate=3.0, mean_input_tokens=80, mean_output_tokens=80, recent_arrival_rate=3.0,
                   input_tokens_deciles=[40, 50, 60, 70, 80, 85, 90, 100, 110, 130],
                   past_mixes=[[80.0, 80.0], [350.0, 5.0], [600.0, 9.0], [420.0, 6.0]])
    c = cfg(ttft_slo_s=20.0)  # the queue is no backlog past the SLO: not overloaded, where the cooldown yields anyway
    backlog = layout(2, 6, 0, prefill={"queued_prefill_tokens": 15 * 450, "waiting_reqs": 15})

    def after_a_move(answers, loads=backlog):
        state = PlannerState()
        state.started(NOW - 8, "http://prefill9", PREFILL, DECODE, answers)
        state.finished(NOW - 5, "http://prefill9", True, c)
        assert state.flows[PREFILL, DECODE].answers == answers  # kept from the decision through the move's end
        return decide(NOW, c, state, loads, chat, COST)

    d = after_a_move(80.0)
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL) and "overloaded" not in d.reason, d.reason
    assert d.current.capacity > 0 and d.answers == 6.0 and "answers of 6 as a past window's of such prompts" in d.reason
    for answers in (7.0, None):
        held = after_a_move(answers)
        assert held.kind == "hold" and "cooldown after a move prefill->decode" in held.reason, held.reason
        assert held.target.pools[PREFILL] > 2
    no_queue = after_a_move(80.0, layout(2, 6, 0, prefill={"queued_prefill_tokens": 5 * 450, "waiting_reqs": 5}))
    assert "as queued" not in no_queue.reason and (no_queue.kind == "hold" or no_queue.dst != PREFILL), no_queue.reason


def test_a_workers_own_cooldown_yields_to_a_queue_of_another_kind_than_its_move_was_decided_on():
    """Every decode worker moved prefill -> decode 40 s ago (past the reversal cooldown, inside each worker's own),
    decided on chat answers (80 tokens); now code prompts queue, and a past window of such prompts had 6-token
    answers: as the reversal cooldown (above), each worker's own cooldown, which keeps one worker from flapping on
    the noise of one mix, yields to the new mix. The even mix at 64 instances at TTFT 16 s, rate scale 31.765: at
    t = 370 s 629 code prompts waited after a conversation phase, and the workers moved to decode over it held
    36:28 at 54:10 against 61:3 (the arrivals of t = 390-435 s met 0.19-0.42). Decided on code-like answers, by
    hand (answers unknown), or with no queue standing for the mix, the worker cooldown holds."""
    chat = Traffic(arrival_rate=3.0, mean_input_tokens=80, mean_output_tokens=80, recent_arrival_rate=3.0,
                   input_tokens_deciles=[40, 50, 60, 70, 80, 85, 90, 100, 110, 130],
                   past_mixes=[[80.0, 80.0], [350.0, 5.0], [600.0, 9.0], [420.0, 6.0]])
    c = cfg(ttft_slo_s=20.0)  # no backlog past the SLO: not overloaded, where the worker cooldown yields anyway
    assert c.cooldown_s < 40 < c.per_worker_cooldown_s
    backlog = layout(2, 6, 0, prefill={"queued_prefill_tokens": 15 * 450, "waiting_reqs": 15})

    def after_moves(answers, loads=backlog):
        state = PlannerState()
        for w in loads:
            if w.mode == DECODE:
                state.started(NOW - 42, w.url, PREFILL, DECODE, answers)
                state.finished(NOW - 40, w.url, True, c)
        return decide(NOW, c, state, loads, chat, COST)

    d = after_moves(80.0)
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL) and "overloaded" not in d.reason, d.reason
    for answers in (7.0, None):
        held = after_moves(answers)
        assert held.kind == "hold" and "worker cooldown" in held.reason, held.reason
    no_queue = after_moves(80.0, layout(2, 6, 0, prefill={"queued_prefill_tokens": 5 * 450, "waiting_reqs": 5}))
    assert "as queued" not in no_queue.reason and (no_queue.kind == "hold" or no_queue.dst != PREFILL), no_queue.reason


def test_a_queue_is_no_new_mix_where_the_newest_arrivals_prompts_are_the_windows():
    """Traffic.recent_input_tokens: the mean prompt the prefill and null workers received over the last ANSWER_COHORT_S
    seconds (their counters' differences between snapshots). Where it lies within QUEUED_SHIFT of the window's mean
    prompt, short (or long) prompts queued are a biased sample of the window's mix, and the queue does not stand for
    it; where it agrees with the queue, or is unknown, the queue stands as before."""
    from tidal.planner.queued import queued_mix
    from tidal.planner.predict import PoolLoad
    from tidal.planner.window import ANSWER_COHORT_S

    def counts(prompts: int, tokens: int) -> list[WorkerLoad]:
        return [WorkerLoad(url="p0", mode=PREFILL, prompts_received=prompts, prompt_tokens_received=tokens)]

    w = TrafficWindow(window_s=30.0, started_at=0.0, burst_window_s=300.0)
    w.traffic(0.0, counts(0, 0))
    assert w.traffic(10.0, counts(30, 30 * 500)).recent_input_tokens == pytest.approx(500)
    assert w.traffic(15.0, counts(60, 30 * 500 + 30 * 200)).recent_input_tokens == pytest.approx(350)
    later = 15.0 + ANSWER_COHORT_S
    assert w.traffic(later, counts(90, 30 * 500 + 30 * 200 + 30 * 100)).recent_input_tokens == pytest.approx(100)
    too_few = counts(95, 30 * 500 + 30 * 200 + 30 * 100 + 5 * 100)  # 5 in the last seconds, under MIN_RECEIVED_SAMPLES
    assert w.traffic(later + ANSWER_COHORT_S, too_few).recent_input_tokens == 0.0

    code = Traffic(arrival_rate=40.0, mean_input_tokens=530, mean_output_tokens=7, recent_arrival_rate=45.0,
                   input_tokens_deciles=[20, 60, 150, 250, 340, 460, 580, 720, 1000, 1800],
                   past_mixes=[[530.0, 7.0], [230.0, 52.0]])
    short_queue = layout(60, 4, 0, prefill={"queued_prefill_tokens": 177, "waiting_reqs": 1})  # 60 prompts of 177
    for recent, stands in ((528.0, False), (400.0, False), (300.0, True), (0.0, True)):
        mixed, note = queued_mix(PoolLoad(short_queue), msgspec.structs.replace(code, recent_input_tokens=recent))
        assert ("as queued" in note) == stands, (recent, note)
        assert (mixed.mean_input_tokens, mixed.mean_output_tokens) == ((177, 52.0) if stands else (530, 7)), recent


def test_the_newest_arrivals_stand_for_a_new_mix_where_too_few_prompts_queue():
    """On a small cluster a turn of the mix queues no QUEUED_SAMPLE prompts: three servers at one request a second,
    a chat phase (32-token prompts, 256-token answers) turning to code (768 / 4), and the one prefill server
    keeping up. The prompts the workers received over the last seconds (`Traffic.recent_prompts`, however few)
    stand for the mix once ARRIVALS_SAMPLE arrived and their mean lies beyond QUEUED_SHIFT and the window's
    sampling spread at so few: the planner heads back to the prefill-heavy layout at once (live run 27 held 1:2:0
    for 22 s until the window's finished requests said it). Fewer arrivals, arrivals of the window's mix, or a
    difference within the spread of a heavy-tailed window change nothing."""
    from tidal.planner.predict import PoolLoad
    from tidal.planner.queued import ARRIVALS_SAMPLE, QUEUED_SAMPLE, queued_mix, sampling_spread
    from tidal.planner.window import ANSWER_COHORT_S

    def counts(prompts: int, tokens: int) -> list[WorkerLoad]:
        return [WorkerLoad(url="p0", mode=PREFILL, prompts_received=prompts, prompt_tokens_received=tokens)]

    w = TrafficWindow(window_s=30.0, started_at=0.0, burst_window_s=300.0)
    w.traffic(0.0, counts(0, 0))
    newest = w.traffic(5.0, counts(3, 3 * 768))
    assert (newest.recent_prompts, newest.recent_prompt_mean) == (3, pytest.approx(768))
    assert newest.recent_input_tokens == 0.0  # under MIN_RECEIVED_SAMPLES: no veto of the queue
    gone = w.traffic(5.0 + ANSWER_COHORT_S, counts(3, 3 * 768))
    assert (gone.recent_prompts, gone.recent_prompt_mean) == (0, 0.0)

    chat = Traffic(arrival_rate=0.63, mean_input_tokens=32, mean_output_tokens=256, recent_arrival_rate=1.0,
                   input_tokens_deciles=[32] * 10, past_mixes=[[32.0, 256.0], [768.0, 4.0]])
    no_queue = layout(1, 2, 0, prefill={"queued_prefill_tokens": 768, "waiting_reqs": 1})
    turned = msgspec.structs.replace(chat, recent_prompts=ARRIVALS_SAMPLE, recent_prompt_mean=768.0)
    mixed, note = queued_mix(PoolLoad(no_queue), turned)
    assert (mixed.mean_input_tokens, mixed.mean_output_tokens, mixed.arrival_rate) == (768, 4.0, 1.0), note
    assert f"prompts of 768 tokens as received over the last seconds ({ARRIVALS_SAMPLE} arrived" in note
    d = decide(NOW, cfg(ttft_slo_s=3.0, tpot_slo_s=0.15), PlannerState(), no_queue, turned, COST)
    held = decide(NOW, cfg(ttft_slo_s=3.0, tpot_slo_s=0.15), PlannerState(), no_queue, chat, COST)
    assert d.kind == "move" and (d.src, d.dst) == (DECODE, PREFILL) and "as received" in d.reason, d.reason
    assert held.kind == "hold", held.reason
    # too few, or the window's own mix
    few = msgspec.structs.replace(turned, recent_prompts=ARRIVALS_SAMPLE - 1)
    assert queued_mix(PoolLoad(no_queue), few) == (few, "")
    same = msgspec.structs.replace(turned, recent_prompt_mean=40.0)
    assert queued_mix(PoolLoad(no_queue), same) == (same, "")
    # a heavy-tailed window: 4 prompts 1.6x its mean lie within the spread of so few, 16 do not; QUEUED_SAMPLE
    # arrivals or more leave it to the queue
    code = Traffic(arrival_rate=4.0, mean_input_tokens=500, mean_output_tokens=7,
                   input_tokens_deciles=[20, 60, 150, 250, 340, 460, 580, 720, 1000, 1420])
    assert sampling_spread(code.input_tokens_deciles, 4) > 1.6 > sampling_spread(code.input_tokens_deciles, 16)
    for n, stands in ((4, False), (16, True), (QUEUED_SAMPLE, False)):
        longer = msgspec.structs.replace(code, recent_prompts=n, recent_prompt_mean=800.0)
        assert ("as received" in queued_mix(PoolLoad(no_queue), longer)[1]) == stands, n


def test_the_newest_arrivals_answers_stand_for_the_queued_prompts_where_the_window_has_them():
    """Where the window's mean answer is the last ANSWER_COHORT_S seconds' arrivals' (`Traffic.recent_answers`: they
    say ANSWER_SHIFT times the finished requests' or more), those answers are the newest mix's own, seen, and the
    prompts queued with them (the newest arrivals too) keep them: a past window's answers are a guess by prompt
    length. The even mix at 64 instances, rate scale 27.401174, t = 190 s, 10 s into the first conversation phase
    (the tree of 7d63935): 126 prompts of 313 tokens queued after a code window of 514, the cohort said 42-token
    answers, and with no conversation window yet in the past mixes a code lull's 5-token answers stood for them: the
    planner headed for 58:6 and moved 2 workers to decode, reaching the conversation's layout only at t = 205 s.
    Where the answers are the finished requests' the lookup stands as before."""
    from tidal.planner.predict import PoolLoad
    from tidal.planner.queued import queued_mix

    turning = Traffic(arrival_rate=86.4, mean_input_tokens=514, mean_output_tokens=42.3, recent_arrival_rate=66.8,
                      input_tokens_deciles=[30, 90, 170, 260, 350, 450, 570, 720, 950, 1500],
                      past_mixes=[[520.0, 6.8], [313.0, 5.0], [495.0, 6.9]], recent_answers=True)
    queue = layout(60, 4, 0, prefill={"waiting_reqs": 2, "queued_prefill_tokens": 2 * 313,
                                      "waiting_prompt_tokens": 2 * 313})  # 120 prompts of 313 tokens
    mixed, note = queued_mix(PoolLoad(queue), turning)
    assert (mixed.mean_input_tokens, mixed.mean_output_tokens, mixed.arrival_rate) == (313, 42.3, 66.8), note
    assert "as queued" in note and "past window" not in note
    looked_up, note = queued_mix(PoolLoad(queue), msgspec.structs.replace(turning, recent_answers=False))
    assert (looked_up.mean_input_tokens, looked_up.mean_output_tokens) == (313, 5.0), note
    assert "answers of 5 as a past window's of such prompts" in note

    cfg = PlannerConfig(mode="sla", ttft_slo_s=8.0, tpot_slo_s=0.2, max_concurrent_moves=16)
    import tidal.profile

    cost = CostModel.from_file(os.path.join(os.path.dirname(tidal.profile.__file__), "data",
                                            "smollm2_cpu_2core_avx512.json"))
    seen = decide(190.0, cfg, PlannerState(), queue, turning, cost)
    guessed = decide(190.0, cfg, PlannerState(), queue, msgspec.structs.replace(turning, recent_answers=False), cost)
    assert seen.kind == "move" and (seen.src, seen.dst) == (PREFILL, DECODE), seen.reason
    assert seen.target.pools[DECODE] >= guessed.target.pools[DECODE] + 8, (seen.reason, guessed.reason)


def test_a_window_of_the_own_kind_vetoes_the_queued_lookup_only_as_near_as_the_queue_can_tell():
    """A long queue's mean prompt lies within a few percent of its kind's windows' by sampling alone, a short one's
    within tens of percent: windows of the window's own kind further off than that do not veto another kind's
    answers. The even mix at 64 instances, rate scale 25.828, t = 370 s (the tree of dadc3dd): 408 code prompts of 487
    tokens queue after a conversation window of 247 / 37.4; the nearest past window is code (493 / 6.7), conversation
    bursts lie 1.36x and 1.43x off. The lookup only ever returns another kind's answers: on the conversation trace
    alone (64 instances, wall clock, rate scale 15.17, t = 375 s) 214 prompts of 213 tokens after a window of 341 / 33
    found a lull window's 67 (2.03x: one kind's burst and lull) and moved 12 workers to decode."""
    from tidal.planner.predict import PoolLoad
    from tidal.planner.queued import QUEUED_SHIFT, queued_mix, sampling_radius, seen_answers

    conv_deciles = [60, 100, 140, 180, 220, 260, 300, 350, 400, 460]
    conv = Traffic(arrival_rate=100.0, mean_input_tokens=247, mean_output_tokens=37.4,
                   input_tokens_deciles=conv_deciles,
                   past_mixes=[[493.0, 6.7], [358.0, 33.9], [341.0, 45.5], [250.0, 40.0]])
    assert 1.0 < sampling_radius(conv_deciles, 408) < 1.06 < sampling_radius(conv_deciles, 20) < 1.3
    assert sampling_radius([], 408) == sampling_radius(conv_deciles, 0) == QUEUED_SHIFT  # no spread known: as before
    long_queue = layout(8, 8, 0, prefill={"waiting_reqs": 51, "queued_prefill_tokens": 51 * 487,
                                          "waiting_prompt_tokens": 51 * 487})
    code, note = queued_mix(PoolLoad(long_queue), conv)
    assert code.mean_output_tokens == 6.7 and "answers of 7 as a past window's" in note, note
    # 20 prompts of 487 tokens (2 waiting on each of 10 workers): a conversation window 1.16x off (420 / 36) lies
    # within their sampling error, so they may be a conversation burst's
    near = msgspec.structs.replace(conv, past_mixes=conv.past_mixes + [[420.0, 36.0]])
    short_queue = layout(10, 6, 0, prefill={"waiting_reqs": 2, "queued_prefill_tokens": 2 * 487,
                                            "waiting_prompt_tokens": 2 * 487})
    assert queued_mix(PoolLoad(short_queue), near)[0].mean_output_tokens == 37.4
    assert queued_mix(PoolLoad(long_queue), near)[0].mean_output_tokens == 6.7  # 408: 1.16x is beyond its error
    # the nearest past window of the window's own kind: no other kind's answers to take (33 / 67: one kind)
    assert seen_answers(213.0, [[215.0, 67.0], [300.0, 6.0]], 33.0, veto_radius=1.0) is None
    assert seen_answers(213.0, [[215.0, 67.0], [300.0, 6.0]], 6.0, veto_radius=1.0) == 67.0


def test_the_queued_prompts_are_the_waiting_requests_own_where_every_worker_reports_them():
    """A server reports its waiting requests' whole prompts (`num_waiting_prompt_tokens`): their mean is the queued
    prompt, whatever is left of a prompt being prefilled in chunks. Where a prefill or null worker does not
    report them (-1: another server), the tokens queued for prefill stand in."""
    from tidal.planner.queued import queued_mix
    from tidal.planner.predict import PoolLoad

    chat = Traffic(arrival_rate=4.0, mean_input_tokens=80, mean_output_tokens=80)
    # 10 waiting 90-token prompts a worker, behind a 4000-token prompt half prefilled
    chunked = {"queued_prefill_tokens": 10 * 90 + 2000, "waiting_reqs": 10}
    rough = layout(2, 6, 0, prefill=chunked)
    assert queued_mix(PoolLoad(rough), chat)[0].mean_input_tokens == 290  # a new mix, wrongly
    own = layout(2, 6, 0, prefill={**chunked, "waiting_prompt_tokens": 10 * 90})
    assert queued_mix(PoolLoad(own), chat) == (chat, "")  # the window's mix
    longer = layout(2, 6, 0, prefill={**chunked, "waiting_prompt_tokens": 10 * 450})
    assert queued_mix(PoolLoad(longer), chat)[0].mean_input_tokens == 450
    one_unknown = longer[:1] + layout(1, 6, 0, prefill=chunked)
    assert queued_mix(PoolLoad(one_unknown), chat)[0].mean_input_tokens == 290


def test_a_decode_servers_requests_waiting_for_kv_are_not_its_batch():
    """A decode server counts PD requests still waiting for their prefill's KV as running (they hold
    memory) but decodes only its batch: the prediction's batch floor is the batch it reports."""
    traffic = Traffic(arrival_rate=0.5, mean_input_tokens=300, mean_output_tokens=100)
    waiting_for_kv = layout(2, 1, 0, decode={"running_reqs": 60, "decoding_reqs": 2})
    unknown = layout(2, 1, 0, decode={"running_reqs": 60})
    a = decide(NOW, cfg(), PlannerState(), waiting_for_kv, traffic, COST).current.paths["pd"]
    b = decide(NOW, cfg(), PlannerState(), unknown, traffic, COST).current.paths["pd"]
    assert a.tpot_s < COST.decode_step_seconds(8, 8 * 350) < b.tpot_s


# ---------------------------------------------------------------- bursts: the prefill queues' peak rate


def feed_phase(w: TrafficWindow, start: float, end: float, prompt: int, answer: int, bursty: bool) -> None:
    """One arrival and one completion per second; when bursty, the arrivals come 20 at once every 20 s."""
    t = start
    while t < end:
        w.arrival(start + (t - start) // 20 * 20 if bursty else t)
        w.completion(t, Observation(path="pd", prompt_tokens=prompt, completion_tokens=answer))
        t += 1.0


def test_peak_ratio_is_the_rate_most_arrivals_meet_within_a_span_over_the_mean():
    from tidal.planner.window import peak_ratio

    even = [i * 0.5 for i in range(600)]
    assert peak_ratio(even, 8.0) == pytest.approx(1.0, abs=0.02)
    bursts = [(i // 20) * 20.0 + (i % 20) * 0.01 for i in range(600)]  # 20 at once every 20 s: 1/s on average
    # every arrival meets its burst's 20 within an 8-s span: 2.5/s, 2.5x the mean
    assert peak_ratio(bursts, 8.0) == pytest.approx(2.5, rel=0.05)
    assert peak_ratio(bursts, None) == 1.0 and peak_ratio(bursts[:5], 8.0) == 1.0
    assert peak_ratio([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 8.0) == 1.0  # under two spans


def test_a_new_mix_starts_a_new_burst_history():
    """Bursts of a code-like phase (long prompts, short answers) are forgotten once the window's answers
    are many times longer; the same lengths throughout never count as a shift."""
    w = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
    feed_phase(w, 0.0, 200.0, 1000, 5, bursty=True)
    assert w.traffic(200.0).prefill_peak_ratio > 2 and w.mix_shifts == 0
    feed_phase(w, 200.0, 240.0, 250, 60, bursty=False)
    w.traffic(240.0)
    assert w.mix_shifts == 1
    feed_phase(w, 240.0, 300.0, 250, 60, bursty=False)
    assert w.traffic(300.0).prefill_peak_ratio == pytest.approx(1.0, abs=0.2)
    same = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
    feed_phase(same, 0.0, 300.0, 1000, 5, bursty=True)
    for now in range(40, 300, 5):
        same.traffic(float(now))
    assert same.mix_shifts == 0 and same.traffic(299.0).prefill_peak_ratio > 2


def test_a_mix_that_comes_back_brings_back_its_bursts():
    """A shift back to a mix seen before restores that mix's peak arrival rate until the new history is a burst
    window old: the code trace's bursts are minutes apart, and its phase may come back in a lull. A mix never
    seen bursty gets its own history's peak only."""
    w = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
    seen = {}
    for start, end, prompt, answer, bursty in ((0.0, 200.0, 1000, 5, True), (200.0, 400.0, 250, 60, False),
                                               (400.0, 760.0, 1000, 5, False)):
        for t in range(int(start), int(end)):  # as feed_phase, a traffic reading every 5 s
            w.arrival(start + (t - start) // 20 * 20 if bursty else float(t))
            w.completion(float(t), Observation(path="pd", prompt_tokens=prompt, completion_tokens=answer))
            if (t + 1) % 5 == 0:
                seen[t + 1] = w.traffic(t + 1.0)
    peak = {t: tr.arrival_rate * tr.prefill_peak_ratio for t, tr in seen.items()}
    assert peak[200] == pytest.approx(2.5, rel=0.05)  # 20 at once every 20 s
    assert w.mix_shifts == 2
    assert peak[300] == pytest.approx(1.0, rel=0.1)  # the chat mix, steady: its own history
    assert peak[460] == pytest.approx(2.5, rel=0.05) and peak[700] == pytest.approx(2.5, rel=0.05)
    assert peak[760] == pytest.approx(1.0, rel=0.1)  # 300 s after the shift back: the new history's own


def test_a_slow_turn_to_long_answers_shows_in_the_prompts_the_workers_received():
    """Live run 19's chat phase: 0.63 requests/s of 32-token prompts and 256-token answers (25 s each) after
    90 s of 768 / 4. No window of 20 s holds 20 requests that arrived and finished in it, so the completion
    test never fires and the lengths were the last 64 finished, the old mix's for most of 100 s (in 496 / out
    71 tokens 55 s after the turn). The prefill worker's counters show the new prompts as they arrive."""
    def run(counted: bool) -> tuple[list[tuple[float, float, float]], int]:
        w = TrafficWindow(20.0, 0.0, burst_window_s=300.0)
        prompts = tokens = 0
        seen, finishing = [], []  # (at, window's mean prompt, mean answer); (ends at, arrived at, prompt, answer)
        for step in range(0, 2000):
            now = step * 0.1
            if step % 16 == 0:  # an arrival every 1.6 s
                chat = now >= 90.0
                prompt, answer, length = (32, 256, 25.0) if chat else (768, 4, 1.0)
                w.arrival(now)
                prompts, tokens = prompts + 1, tokens + prompt
                finishing.append((now + length, now, prompt, answer))
            for end in [f for f in finishing if f[0] <= now]:
                finishing.remove(end)
                w.completion(now, Observation(path="pd", prompt_tokens=end[2], completion_tokens=end[3],
                                              arrived_at=end[1]))
            if step % 20 == 0:  # the planner's 2-s interval
                loads = [WorkerLoad(url="p0", mode=PREFILL, prompts_received=prompts if counted else -1,
                                    prompt_tokens_received=tokens if counted else -1)]
                t = w.traffic(now, loads)
                seen.append((now, t.mean_input_tokens, t.mean_output_tokens))
        return seen, w.mix_shifts

    seen, shifts = run(counted=True)
    assert shifts == 1
    after = [(t, prompt, answer) for t, prompt, answer in seen if t >= 130.0]
    assert all(prompt == pytest.approx(32) and answer == pytest.approx(256) for _, prompt, answer in after)
    assert all(prompt == pytest.approx(768) for t, prompt, _ in seen if 20.0 <= t < 90.0)
    # without the counters (a worker that does not report them): the old mix for as long as run 19 saw it
    seen, shifts = run(counted=False)
    assert shifts == 0
    assert max(prompt for t, prompt, _ in seen if t >= 145.0) > 300


def test_the_counters_when_the_planner_starts_are_the_first_rounds_baseline():
    """Traffic from the router's first second: with the counters of the planner's start as the baseline, its first
    round (5 s on) has the prompts received since; without, that round's snapshot is only the baseline and the
    mean is the finished requests' (the short prompts, which finish first)."""
    def first_round(baseline: bool) -> float:
        w = TrafficWindow(30.0, 0.0, burst_window_s=300.0)
        if baseline:
            w.baseline(0.0, [WorkerLoad(url="p0", mode=PREFILL, prompts_received=0, prompt_tokens_received=0)])
        for k in range(30):  # 30 short prompts finished of 60 arrived
            w.completion(4.0, Observation(path="pd", prompt_tokens=100, completion_tokens=20, arrived_at=1.0),
                         w.arrival(1.0))
        for _ in range(30):
            w.arrival(2.0)
        loads = [WorkerLoad(url="p0", mode=PREFILL, prompts_received=60, prompt_tokens_received=30 * 100 + 30 * 500)]
        return w.traffic(5.0, loads).mean_input_tokens
    assert first_round(baseline=True) == pytest.approx(300) and first_round(baseline=False) == pytest.approx(100)


def test_a_lulls_stragglers_are_neither_a_new_mix_nor_the_mix():
    """After a burst, a window with no arrivals holds only the burst's long stragglers: too few to be a new
    mix (the burst history stays), and the lengths come from the history's last completions instead."""
    w = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
    feed_phase(w, 0.0, 200.0, 500, 7, bursty=True)
    for k in range(11):  # no arrival after 200 s; 11 long requests finish in the lull
        w.completion(215.0 + k, Observation(path="pd", prompt_tokens=1150, completion_tokens=73))
    t = w.traffic(232.0)
    assert w.mix_shifts == 0 and t.prefill_peak_ratio > 2
    # 64 lengths: the 11 stragglers and 53 of the burst before
    assert t.mean_output_tokens == pytest.approx((11 * 73 + 53 * 7) / 64)
    assert t.mean_input_tokens == pytest.approx((11 * 1150 + 53 * 500) / 64)
    busy = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
    feed_phase(busy, 0.0, 200.0, 500, 7, bursty=False)
    feed_phase(busy, 200.0, 230.0, 1150, 73, bursty=False)  # 30 completions of a new mix: a shift
    assert busy.traffic(230.0).mean_output_tokens > 40 and busy.mix_shifts == 1


def test_a_bursts_long_tail_finishing_later_is_not_a_new_mix():
    """A burst's long requests finish after it, many in a window that starts after they arrived: by
    completion time that window's answers are several times the history's, by arrival it is the old mix."""
    def tail(arrived_at):
        w = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
        feed_phase(w, 0.0, 200.0, 500, 7, bursty=True)
        for k in range(40):  # the burst's 40 longest requests, finishing in the next window
            w.completion(215.0 + k * 0.3, Observation(path="pd", prompt_tokens=500, completion_tokens=40,
                                                      arrived_at=arrived_at))
            w.arrival(215.0 + k * 0.3)  # while the arrivals go on
        w.traffic(232.0)
        return w.mix_shifts
    assert tail(arrived_at=195.0) == 0
    assert tail(arrived_at=None) == 1  # arrival unknown: counted as the window's own


def test_a_calm_window_keeps_its_historys_burst_rate():
    """The prefill queues are predicted at the burst history's burst rate even in a calm window: the
    window's rate times the peak ratio is that rate (not the window's rate times the history's ratio)."""
    w = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
    feed_phase(w, 0.0, 200.0, 1000, 5, bursty=True)  # 20 at once every 20 s: 2.5/s within an 8-s span
    for k in range(10):  # then calm: one arrival every 10 s
        w.arrival(200.0 + 10 * k)
    t = w.traffic(299.0)
    assert t.arrival_rate == pytest.approx(0.1)
    assert t.arrival_rate * t.prefill_peak_ratio == pytest.approx(2.5, rel=0.05)
    rush = TrafficWindow(30.0, 0.0, burst_window_s=300.0, peak_span_s=8.0)
    feed_phase(rush, 0.0, 200.0, 1000, 5, bursty=True)
    for k in range(150):  # a window busier than any burst of the history: 5/s
        rush.arrival(270.0 + k * 0.2)
    assert rush.traffic(300.0).prefill_peak_ratio == pytest.approx(1.0, abs=0.02)


def test_bursts_load_the_prefill_queues_not_the_decode_steps():
    from tidal.planner.predict import CostPredictor, PoolLoad

    """PD decode workers are predicted at the mean rate; a null worker's decodes see the burst's prefills
    when its answers are short (5 tokens: 1 s at the TPOT SLO, within the 8-s span), hardly when long."""
    pred = CostPredictor(COST, 8.0, 0.2, 5.0)
    load = PoolLoad(layout(2, 2, 1))
    pools = {PREFILL: 2, DECODE: 2, NULL: 1}
    for answer, null_tpot_grows in ((5, 1.3), (2000, 1.01)):
        even = Traffic(arrival_rate=1.0, mean_input_tokens=500, mean_output_tokens=answer)
        bursty = msgspec.structs.replace(even, prefill_peak_ratio=3.0)
        a, b = pred.predict(pools, load, even), pred.predict(pools, load, bursty)
        assert b.paths["pd"].ttft_s > a.paths["pd"].ttft_s and b.paths["pd"].tpot_s == a.paths["pd"].tpot_s
        assert b.paths["null"].ttft_s > a.paths["null"].ttft_s
        grows = b.paths["null"].tpot_s / a.paths["null"].tpot_s
        assert grows > null_tpot_grows if answer == 5 else grows < null_tpot_grows


def test_on_bursty_long_prompts_more_prefill_workers_rank_higher():
    """The code-trace shape: long prompts, answers of a few tokens, arrivals in bursts. At the burst's rate
    each extra prefill worker adds capacity down to a single decode worker, and every layout takes a smaller
    multiple of the mean rate than if the arrivals were even."""
    from tidal.planner.decide import capacity, make_predictor
    from tidal.planner.predict import PoolLoad

    even = Traffic(arrival_rate=1.0, mean_input_tokens=1000, mean_output_tokens=4, input_tokens_deciles=[1000] * 10)
    bursty = msgspec.structs.replace(even, prefill_peak_ratio=6.0)
    predictor = make_predictor(cfg(ttft_slo_s=8.0, tpot_slo_s=0.2), COST, {})
    load = PoolLoad(layout(8, 8, 0))

    def caps(traffic: Traffic) -> list:
        return [capacity(predictor, {PREFILL: p, DECODE: 16 - p, NULL: 0}, load, traffic) for p in (12, 13, 14, 15)]

    assert caps(bursty) == sorted(caps(bursty)) and caps(bursty)[0] < caps(bursty)[-1]
    assert all(b < e for b, e in zip(caps(bursty), caps(even)))


def test_a_committed_target_is_kept_while_it_stays_near_the_best():
    """Long prompts at 20/s: 61:3 is the best layout (2.42x the rate), 60:4 1% and 56:8 8% below it. A walk
    toward 60:4 keeps its target (the model cannot tell them apart); one toward 56:8 turns to 61:3."""
    traffic = Traffic(arrival_rate=20, mean_input_tokens=1000, mean_output_tokens=20)
    targets = {}
    for decode in (4, 8):
        state = PlannerState()
        state.committed = {NULL: 0, PREFILL: 64 - decode, DECODE: decode}
        d = decide(NOW, cfg(max_concurrent_moves=2), state, layout(32, 32, 0), traffic, COST)
        assert d.kind == "move", d.reason
        targets[decode] = d.target.pools
    assert targets == {4: {NULL: 0, PREFILL: 60, DECODE: 4}, 8: {NULL: 0, PREFILL: 61, DECODE: 3}}


def test_a_loaded_prefill_worker_batches_its_prompts_and_passes_more():
    """A prefill step of several prompts pays its shared part once (the profile's batch points): a loaded
    worker runs the prompts that arrived during a step in its next one, so it passes more than 1/p prompts a
    second. 100-token prompts, 0.1 s alone, four in 0.25 s (0.05 s shared): one prompt at a time a prefill
    worker takes under 10 a second within the 3 s TTFT SLO; batching, ~19 (the 2048-token step budget)."""
    batched = CostModel.from_dict(dict(PROFILE, prefill_batch=[{"tokens": 100, "batch": 4, "seconds": 0.25}]))
    assert batched.prefill_step_seconds([100] * 4) == pytest.approx(0.25)
    traffic = Traffic(arrival_rate=12.0, mean_input_tokens=100, mean_output_tokens=5)
    alone = decide(NOW, cfg(), PlannerState(), layout(1, 3, 0), traffic, COST)
    together = decide(NOW, cfg(), PlannerState(), layout(1, 3, 0), traffic, batched)
    assert alone.current.capacity < 0.85
    assert together.current.capacity > 1.4
    assert together.current.paths["pd"].ttft_s < cfg().ttft_slo_s < alone.current.paths["pd"].ttft_s
    # light load: no queue forms, no batch, the same prediction either way
    light = msgspec.structs.replace(traffic, arrival_rate=2.0)
    assert (decide(NOW, cfg(), PlannerState(), layout(1, 3, 0), light, batched).current.paths["pd"].ttft_s
            == pytest.approx(decide(NOW, cfg(), PlannerState(), layout(1, 3, 0), light, COST)
                             .current.paths["pd"].ttft_s))


def test_the_prefill_step_budget_bounds_the_batch():
    """Past the step's token budget a batch grows no more: the queue does, and the TTFT with it."""
    profile = dict(PROFILE, prefill_batch=[{"tokens": 100, "batch": 4, "seconds": 0.25}])
    small = CostModel.from_dict(dict(profile, server={"max_total_tokens": KV, "prefill_step_tokens": 400}))
    big = CostModel.from_dict(dict(profile, server={"max_total_tokens": KV, "prefill_step_tokens": 4096}))
    assert small.prefill_step_tokens == 400
    traffic = Traffic(arrival_rate=17.0, mean_input_tokens=100, mean_output_tokens=5)  # 400 tokens: 16 a second
    a = decide(NOW, cfg(), PlannerState(), layout(1, 3, 0), traffic, small)
    b = decide(NOW, cfg(), PlannerState(), layout(1, 3, 0), traffic, big)
    assert a.current.capacity < 1.0 < b.current.capacity



@pytest.mark.parametrize("field, value, says", [
    ("ttft_slo_s", float("nan"), "--ttft-slo-ms must be a positive number"),
    ("tpot_slo_s", float("inf"), "--tpot-slo-ms must be a positive number"),
    ("window_s", 0.0, "--planner-window-s must be a positive number"),
    ("interval_s", 1e-6, "--planner-interval-s must be at least 0.1 s"),
    ("interval_s", float("nan"), "--planner-interval-s must be at least 0.1 s"),
    ("hysteresis", float("nan"), "--planner-hysteresis must be >= 0"),
    ("cooldown_s", -1.0, "--planner-cooldown-s must be >= 0"),
    ("worker_cooldown_s", float("nan"), "--planner-worker-cooldown-s must be >= 0"),
    ("min_per_pool", -1, "--planner-min-per-pool must be >= 0"),
    ("max_concurrent_moves", 0, "--planner-max-concurrent-moves must be >= 1"),
])
def test_planner_config_names_the_one_bad_flag_nan_included(field, value, says):
    """The router, `tidal cluster` and `tidal sim` build their planner from this config: NaN passes a `<= 0`
    check, so it must be refused explicitly, and the message names only the flag at fault."""
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        PlannerConfig(mode="sla", **{field: value})
    assert PlannerConfig(mode="sla", cooldown_s=float("inf"), worker_cooldown_s=float("inf")).cooldown_s == math.inf


def test_tidal_cluster_passes_every_planner_flag_to_its_router():
    """`planner_argv` (the router's command line under `tidal cluster`) carries every planner setting."""
    import argparse

    from tidal.planner.flags import add_planner_args, planner_argv, planner_config_from_namespace

    def parse(argv: list[str]) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_planner_args(p)
        return p.parse_args(argv)

    ns = parse(["--planner", "sla", "--ttft-slo-ms", "900", "--tpot-slo-ms", "90", "--planner-interval-s", "2",
                "--planner-cooldown-s", "7", "--planner-worker-cooldown-s", "11", "--planner-min-per-pool", "2",
                "--planner-max-concurrent-moves", "3", "--planner-window-s", "20", "--planner-burst-window-s", "60",
                "--planner-hysteresis", "0.1", "--planner-decode-move", "drain"])
    want = planner_config_from_namespace(ns)
    assert want.decode_move == "drain" and want != PlannerConfig(mode="sla")
    assert planner_config_from_namespace(parse(planner_argv(ns))) == want
