"""Priority scheduling on the fake-runner scheduler: queue order, preemption, the queue limit."""

from __future__ import annotations

import pytest

from fakes import FakeModelRunner, reference_generate
from tidal.config import ServerArgs
from tidal.messages import GenerateReq
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler


def make_sched(max_total_tokens=4096, priority=True, **kw) -> Scheduler:
    args = ServerArgs(model_path="fake", enable_priority_scheduling=priority, **kw)
    return Scheduler(args, FakeModelRunner(max_total_tokens=max_total_tokens), tokenizer=None)


def submit(sched: Scheduler, rid: str, prompt: list[int], n: int, priority=None) -> None:
    sched.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=n, temperature=0.0),
                             priority=priority))


class Run:
    """Steps a scheduler, checking pool integrity after every step; records tokens and finish order."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict = {}
        self.order: list[str] = []

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.sched.step()
            self._collect()

    def _collect(self) -> None:
        self.sched.check_integrity()
        for out in self.sched.take_outbox():
            self.tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finished[out.rid] = out.finish_reason
                self.order.append(out.rid)

    def to_end(self, max_steps: int = 5000) -> "Run":
        self._collect()
        for _ in range(max_steps):
            did = self.sched.step()
            self._collect()
            if not did and self.sched.is_idle():
                return self
        raise AssertionError("scheduler did not finish")


P0 = [7, 8, 9, 10]


def queue_behind_a_running_request(sched: Scheduler, first_priority: int) -> Run:
    run = Run(sched)
    submit(sched, "first", P0, 3, priority=first_priority)
    run.step()  # "first" is prefilled and holds the only running slot
    return run


def test_waiting_queue_orders_by_priority_then_arrival():
    sched = make_sched(max_running_requests=1)
    run = queue_behind_a_running_request(sched, first_priority=100)  # outranks all: no preemption
    for rid, p in [("a", 1), ("b", 5), ("c", 5), ("d", None), ("e", -3)]:
        submit(sched, rid, [1 + len(rid), 2, 3], 2, priority=p)
    run.to_end()
    assert run.order == ["first", "b", "c", "a", "d", "e"]  # None counts as 0; equal ones by arrival
    assert sched.stats.num_retracted == 0


def test_low_priority_values_first_reverses_the_order():
    sched = make_sched(max_running_requests=1, schedule_low_priority_values_first=True)
    run = queue_behind_a_running_request(sched, first_priority=-100)
    for rid, p in [("a", 1), ("b", 5), ("c", 5), ("d", None), ("e", -3)]:
        submit(sched, rid, [1 + len(rid), 2, 3], 2, priority=p)
    run.to_end()
    assert run.order == ["first", "e", "d", "a", "b", "c"]


def test_without_the_flag_priority_is_ignored():
    sched = make_sched(priority=False, max_running_requests=1)
    run = queue_behind_a_running_request(sched, first_priority=0)
    for rid, p in [("a", 1), ("b", 5), ("c", 9)]:
        submit(sched, rid, [1 + len(rid), 2, 3], 2, priority=p)
    run.to_end()
    assert run.order == ["first", "a", "b", "c"]


def test_schedule_policy_orders_within_one_priority():
    # lof: longest output first, but only among requests of the same priority
    sched = make_sched(max_running_requests=1, schedule_policy="lof")
    run = queue_behind_a_running_request(sched, first_priority=100)
    for rid, p, n in [("short1", 1, 2), ("long1", 1, 6), ("short2", 2, 3), ("long2", 2, 5)]:
        submit(sched, rid, [len(rid), 2, 3], n, priority=p)
    run.to_end()
    assert run.order == ["first", "long2", "short2", "long1", "short1"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_higher_priority_preempts_when_max_running_requests_is_reached(overlap):
    sched = make_sched(max_running_requests=2, disable_overlap_schedule=not overlap)
    run = Run(sched)
    lows = {"low1": [11, 12, 13, 14, 15], "low2": [21, 22, 23]}
    for rid, p in lows.items():
        submit(sched, rid, p, 30, priority=0)
    run.step(5)  # both decode; the batch is full
    assert len(sched.running) == 2
    submit(sched, "high", [5, 6, 7], 4, priority=1)
    run.step()
    assert [r.rid for r in sched.running] == ["low1", "high"]  # the one admitted last went back
    assert [r.rid for r in sched.waiting_queue] == ["low2"]
    run.to_end()
    assert run.order.index("high") < run.order.index("low1") < run.order.index("low2")
    assert sched.stats.num_retracted == 1
    assert run.tokens["high"] == reference_generate([5, 6, 7], 4)
    for rid, p in lows.items():  # the preempted request resumes with the same tokens
        assert run.tokens[rid] == reference_generate(p, 30), rid
        assert run.finished[rid].type == "length"
    assert sched.mem.req_to_token_pool.available_size() == sched.mem.req_to_token_pool.size


def test_equal_priority_does_not_preempt():
    sched = make_sched(max_running_requests=1)
    run = queue_behind_a_running_request(sched, first_priority=3)
    submit(sched, "same", [5, 6, 7], 2, priority=3)
    run.to_end()
    assert run.order == ["first", "same"] and sched.stats.num_retracted == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_higher_priority_preempts_when_kv_memory_is_exhausted(overlap):
    sched = make_sched(max_total_tokens=200, max_running_requests=8, disable_overlap_schedule=not overlap)
    run = Run(sched)
    lows = {f"low{i}": [30 + i] * 50 + [i + 1] for i in range(3)}
    for rid, p in lows.items():
        submit(sched, rid, p, 40, priority=-1)
    run.step(3)
    running_before = len(sched.running)
    high = [2, 3, 4] * 20
    submit(sched, "high", high, 8, priority=2)
    run.step()
    assert any(r.rid == "high" for r in sched.running), "high was not admitted at once"
    assert len(sched.running) < running_before + 1  # room came from retracted low requests
    run.to_end()
    assert run.order[0] == "high"
    assert sched.stats.num_retracted >= 1
    assert run.tokens["high"] == reference_generate(high, 8)
    for rid, p in lows.items():
        assert run.tokens[rid] == reference_generate(p, 40), rid


@pytest.mark.parametrize("priority", [True, False], ids=["priority", "no-priority"])
def test_decode_memory_retraction_takes_the_lowest_priority_first(priority):
    # both fit at admission (a low new-token ratio); decode later runs out of KV and must retract one:
    # by default the youngest (here the high-priority one), with priority scheduling the low one
    sched = make_sched(priority=priority, max_total_tokens=140, schedule_conservativeness=0.3)
    run = Run(sched)
    low, high = [3] * 40, [4] * 30
    submit(sched, "low", low, 100, priority=0 if priority else None)
    run.step(3)
    submit(sched, "high", high, 45, priority=5 if priority else None)
    run.step()
    assert len(sched.running) == 2, "both should be admitted"
    while sched.stats.num_retracted == 0:
        run.step()
    assert [r.rid for r in sched.waiting_queue] == (["low"] if priority else ["high"])
    run.to_end()
    assert run.tokens["low"] == reference_generate(low, 100)
    assert run.tokens["high"] == reference_generate(high, 45)


def test_without_the_flag_memory_pressure_makes_the_high_priority_request_wait():
    sched = make_sched(priority=False, max_total_tokens=200, max_running_requests=8)
    run = Run(sched)
    for i in range(3):
        submit(sched, f"low{i}", [30 + i] * 50 + [i + 1], 40)
    run.step(3)
    submit(sched, "high", [2, 3, 4] * 20, 8, priority=2)
    run.step()
    assert not any(r.rid == "high" for r in sched.running)


def test_queue_limit_refuses_with_503():
    sched = make_sched(priority=False, max_running_requests=1, max_queued_requests=2)
    run = queue_behind_a_running_request(sched, first_priority=None)
    for rid in ("q1", "q2", "q3"):
        submit(sched, rid, [4, 5, 6], 2)
    run._collect()
    assert run.finished["q3"].type == "abort" and run.finished["q3"].status_code == 503
    assert "--max-queued-requests" in run.finished["q3"].message
    assert sched.num_queued() == 2
    stats = sched.make_stats(1)
    assert (stats.num_waiting_reqs, stats.waiting_prompt_tokens) == (2, 6)  # q1 and q2, 3 prompt tokens each
    run.to_end()
    assert sorted(run.order) == ["first", "q1", "q2", "q3"]
    assert run.tokens["q1"] == reference_generate([4, 5, 6], 2)


def test_queue_limit_with_priority_displaces_the_lowest_queued_request():
    sched = make_sched(max_running_requests=1, max_queued_requests=2)
    run = queue_behind_a_running_request(sched, first_priority=100)
    submit(sched, "q_low", [4, 5, 6], 2, priority=0)
    submit(sched, "q_mid", [4, 5, 7], 2, priority=1)
    submit(sched, "q_equal", [4, 5, 8], 2, priority=0)  # outranks nothing queued: refused
    submit(sched, "q_high", [4, 5, 9], 2, priority=5)  # takes q_low's place
    run._collect()
    assert run.finished["q_equal"].status_code == 503
    assert run.finished["q_low"].status_code == 503 and "higher priority" in run.finished["q_low"].message
    assert [r.rid for r in sched.waiting_queue] == ["q_mid", "q_high"]
    run.to_end()
    assert run.order[-2:] == ["q_high", "q_mid"]
    assert run.tokens["q_high"] == reference_generate([4, 5, 9], 2)


# ---------------------------------------------------------------- prefill/decode roles


def test_decode_server_admits_transferred_requests_by_priority():
    """A decode server with one running slot: requests waiting for KV pre-allocation are taken
    by priority, and the prefill server serves them in the same order."""
    import time

    from test_pd_scheduler import free_port
    from tidal.messages import AbortReq
    from tidal.transfer import KVPoll

    port = free_port()

    def pd(mode: str) -> Scheduler:
        args = ServerArgs(model_path="fake", disaggregation_mode=mode, disaggregation_transfer_backend="tcp",
                          disaggregation_bootstrap_port=port, disable_radix_cache=(mode == "decode"),
                          num_reserved_decode_tokens=16, enable_priority_scheduling=True, max_running_requests=1)
        return Scheduler(args, FakeModelRunner(), tokenizer=None)

    p, d = pd("prefill"), pd("decode")
    runs = Run(p), Run(d)
    prompts = {"blocker": [9, 8, 7], "x": [4, 4, 4], "a": [5, 5, 5], "b": [6, 6, 6], "c": [7, 7, 7]}

    def send(rid: str, n: int, priority: int) -> None:
        for s in (p, d):
            s.handle(GenerateReq(rid=rid, input_ids=prompts[rid], sampling=SamplingParams(max_new_tokens=n, temperature=0),
                                 bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=len(rid) * 1000 + ord(rid[0]),
                                 priority=priority))

    def step_until(done, timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        while not done():
            assert time.time() < deadline, (p.role.queue_sizes(), d.role.queue_sizes())
            for run in runs:
                run.step()
            time.sleep(0.001)

    try:
        send("blocker", 4000, 0)
        step_until(lambda: len(d.running) == 1)
        send("x", 2, 0)  # pre-allocated at once: it fills the transfer queue (one slot)
        step_until(lambda: len(d.role.transfer_queue) == 1)
        for rid, priority in (("a", 0), ("b", 3), ("c", 1)):
            send(rid, 2, priority)
        # all three wait for pre-allocation (bootstrapped) before the blocker goes
        step_until(lambda: len(d.role.prealloc_queue) == 3
                   and all(r.pd.peer.poll() >= KVPoll.WaitingForInput for r in d.role.prealloc_queue))
        d.handle(AbortReq(rid="blocker"))
        step_until(lambda: len(runs[1].order) == 5)
        assert runs[1].order == ["blocker", "x", "b", "c", "a"]
        assert [rid for rid in runs[0].order if rid in "abc"] == ["b", "c", "a"]
        for rid in ("a", "b", "c"):
            assert runs[1].tokens[rid] == reference_generate(prompts[rid], 2)
    finally:
        d.shutdown()
        p.shutdown()
