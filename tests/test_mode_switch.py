"""Runtime role switching on the KV-reading fake model: every direction, every refusal,
every injected failure rolls back, and outputs after each switch equal the reference."""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading

import pytest

from fakes import FakeModelRunner, reference_generate
from tidal.config import ServerArgs
from tidal.messages import GenerateReq, ModeStatusReq, PrepareModeReq, SwitchModeReq
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler
from test_pd_scheduler import run_pair
from servers import free_port

pytestmark = pytest.mark.timeout(180)
_calls = itertools.count(1)


def make(port: int, mode: str = "null", **kw) -> Scheduler:
    args = ServerArgs(model_path="fake", disaggregation_mode=mode, disaggregation_transfer_backend="tcp",
                      disaggregation_bootstrap_port=port, chunked_prefill_size=16, num_reserved_decode_tokens=16,
                      enable_dynamic_disaggregation=kw.pop("enabled", True), **kw)
    return Scheduler(args, FakeModelRunner(max_total_tokens=4096), tokenizer=None)


def switch(s: Scheduler, mode: str, **kw):
    s.handle(SwitchModeReq(call_id=next(_calls), mode=mode, **kw))
    replies = s.take_replies()
    return replies[0] if replies else None


def serve_colocated(s: Scheduler, n: int = 3) -> None:
    rng = random.Random(n)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    for i, p in enumerate(prompts):
        s.handle(GenerateReq(rid=f"c{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=8, temperature=0)))
    out = {}
    while True:
        did = s.step()
        s.check_integrity()
        for o in s.take_outbox():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        if not did and s.is_idle():
            break
    assert [out[f"c{i}"] for i in range(n)] == [reference_generate(p, 8) for p in prompts]


def serve_pd(prefill: Scheduler, decode: Scheduler, port: int, n: int = 4) -> None:
    rng = random.Random(port + n)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    for i, p in enumerate(prompts):
        f = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=rng.randrange(2**63))
        for s in (prefill, decode):
            s.handle(GenerateReq(rid=f"pd{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=8, temperature=0), **f))
    _, dout = run_pair(prefill, decode)
    assert [dout[f"pd{i}"][0] for i in range(n)] == [reference_generate(p, 8) for p in prompts]


@pytest.fixture
def pair():
    pa, pb = free_port(), free_port()
    a, b = make(pa), make(pb)
    yield a, b, pa, pb
    a.shutdown()
    b.shutdown()


def test_all_six_directions_keep_outputs_exact(pair):
    a, b, pa, pb = pair
    serve_colocated(a)
    assert switch(a, "prefill").status_code == 200          # null -> prefill
    assert switch(b, "decode").status_code == 200           # null -> decode
    serve_pd(a, b, pa)
    assert switch(a, "decode").status_code == 200           # prefill -> decode
    assert switch(b, "prefill").status_code == 200          # decode -> prefill
    serve_pd(b, a, pb)
    r = switch(a, "null")                                   # decode -> null
    assert r.status_code == 200 and r.current_mode == "null" and r.epoch == 3
    assert switch(b, "null").status_code == 200             # prefill -> null
    serve_colocated(a)
    serve_colocated(b)
    assert a.mem.tree_cache.total_size() > 0  # leaving decode restored the radix cache


def test_refusals(pair):
    a, b, pa, _ = pair
    assert switch(a, "sideways").status_code == 400
    off = make(free_port(), enabled=False)
    try:
        r = switch(off, "prefill")
        assert r.status_code == 400 and "--enable-dynamic-disaggregation" in r.message
    finally:
        off.shutdown()
    a.handle(GenerateReq(rid="busy", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=50)))
    r = switch(a, "prefill")
    assert r.status_code == 503 and "queues not empty" in r.message
    assert a.role.name == "null" and a.controller.epoch == 0
    assert switch(a, "null").status_code == 200  # already there: nothing to do


def test_drain_then_switch_and_conflicts(pair):
    a, b, pa, _ = pair
    a.handle(GenerateReq(rid="long", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=30, temperature=0)))
    a.step()
    assert switch(a, "prefill", drain=True, timeout_s=30) is None  # answered after draining
    assert switch(a, "decode").status_code == 409
    a.handle(GenerateReq(rid="late", input_ids=[4, 5], sampling=SamplingParams(max_new_tokens=3)))
    late = [o for o in a.take_outbox() if o.rid == "late"]
    assert late and late[0].finish_reason.status_code == 503
    replies, out = [], []
    for _ in range(200):
        a.step()
        out += a.take_outbox()
        replies += a.take_replies()
        if replies:
            break
    assert replies[0].status_code == 200 and replies[0].timings_ms["drain"] > 0
    assert a.role.name == "prefill"
    done = [o for o in out if o.rid == "long" and o.finish_reason is not None]
    assert done and done[0].finish_reason.type == "length"  # the in-flight request finished


def test_drain_timeout_rolls_back(pair):
    a, *_ = pair
    a.handle(GenerateReq(rid="long", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2000)))
    a.step()
    assert switch(a, "decode", drain=True, timeout_s=0.05) is None
    import time
    time.sleep(0.1)
    a.step()
    (r,) = a.take_replies()
    assert r.status_code == 504 and a.role.name == "null" and a.controller.admitting


@pytest.mark.parametrize("step", ["check", "cache", "init", "bootstrap", "commit"])
def test_injected_failure_at_each_step_rolls_back(pair, step):
    a, b, pa, pb = pair
    assert switch(a, "prefill").status_code == 200
    assert switch(b, "decode").status_code == 200
    serve_pd(a, b, pa, n=2)
    tree_before = a.mem.tree_cache.total_size()
    a.controller.faults.step = step
    r = switch(a, "decode")
    assert r.status_code >= 500 and step in r.message and "rolled back" in r.message
    assert a.role.name == "prefill" and a.controller.epoch == 1
    assert a.mem.tree_cache.total_size() == tree_before  # cache as before
    a.controller.faults.step = None
    serve_pd(a, b, pa, n=2)  # still serving as prefill, bootstrap server still up
    st = a.controller.status(1)
    assert st.last_error and st.transition_state == "IDLE"


def test_bootstrap_port_in_use_rolls_back():
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    a = make(port)
    try:
        r = switch(a, "prefill")
        assert r.status_code == 500 and a.role.name == "null" and a.controller.epoch == 0
        serve_colocated(a)
    finally:
        blocker.close()
        a.shutdown()


def test_a_switchable_server_holds_its_bootstrap_port_until_it_becomes_prefill():
    """An outgoing connection could take the port between start and a switch minutes later
    (a CI run lost a switch that way): a plain bind is refused while the server is null,
    the switch to prefill binds beside the hold, and shutdown frees the port."""
    port = free_port()
    a, b = make(port), make(free_port())

    def plain_bind_refused() -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return True
            return False

    try:
        assert plain_bind_refused()
        assert switch(a, "prefill").status_code == 200 and switch(b, "decode").status_code == 200
        serve_pd(a, b, port, n=2)  # the bootstrap server listens beside the hold
        assert switch(a, "null").status_code == 200 and plain_bind_refused()
        assert switch(a, "prefill").status_code == 200
        serve_pd(a, b, port, n=1)
    finally:
        a.shutdown()
        b.shutdown()
    assert not plain_bind_refused()
    off = make(port, enabled=False)  # only a switchable server holds it
    assert off.bootstrap_port_hold is None
    off.shutdown()


def test_to_decode_needs_empty_cache_unless_flushed(pair):
    a, *_ = pair
    serve_colocated(a)
    r = switch(a, "decode", flush_cache=False)
    assert r.status_code == 409 and a.role.name == "null"
    assert a.mem.tree_cache.total_size() > 0
    assert switch(a, "decode", flush_cache=True).status_code == 200
    a.check_integrity()


def test_expected_mode_mismatch_is_409(pair):
    a, *_ = pair
    a.handle(GenerateReq(rid="x", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), expected_mode="decode"))
    (out,) = a.take_outbox()
    assert out.finish_reason.status_code == 409
    a.handle(GenerateReq(rid="y", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), expected_epoch=7))
    (out,) = a.take_outbox()
    assert out.finish_reason.status_code == 409


def test_prepare_and_keep_components():
    port = free_port()
    a = make(port, keep_role_components=True)
    try:
        a.handle(PrepareModeReq(call_id=1, mode="decode"))
        (r,) = a.take_replies()
        assert r.status_code == 200
        a.handle(ModeStatusReq(call_id=2))
        (st,) = a.take_replies()
        assert st.initialized_roles == ["decode", "null"]
        assert switch(a, "decode").status_code == 200
        assert switch(a, "prefill").status_code == 200
        assert set(a.controller.status(3).initialized_roles) == {"null", "decode", "prefill"}
        assert switch(a, "null").status_code == 200
        assert switch(a, "prefill").status_code == 200  # kept prefill role, bootstrap server restarted
    finally:
        a.shutdown()


def test_switch_cycles_leak_no_threads_or_fds():
    port = free_port()
    a = make(port)
    try:
        def cycle():
            for mode in ("prefill", "decode", "null"):
                assert switch(a, mode).status_code == 200

        cycle()
        threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
        for _ in range(30):
            cycle()
        assert threading.active_count() <= threads + 1
        assert len(os.listdir("/proc/self/fd")) <= fds + 4
        assert a.controller.epoch == 93
    finally:
        a.shutdown()


# ------------------------------------------------ handover: decode -> prefill / null, null -> prefill at once


def run_all(scheds: list, out: dict, until, timeout: float = 60.0) -> None:
    """Step every scheduler (checking pool integrity) until `until()`; out[id(scheduler)][rid]: its outputs."""
    import time

    deadline = time.time() + timeout
    while not until():
        assert time.time() < deadline, [s.role.queue_sizes() for s in scheds]
        busy = False
        for s in scheds:
            busy |= s.step()
            s.check_integrity()
            mine = out.setdefault(id(s), {})
            for o in s.take_outbox():
                toks, reason = mine.get(o.rid, ([], None))
                mine[o.rid] = (toks + o.new_token_ids, o.finish_reason or reason)
        if not busy:
            time.sleep(0.002)


def pd_prompts(port: int, n: int, tag: str, seed: int) -> list[tuple[str, list[int], dict]]:
    rng = random.Random(seed)
    return [(f"{tag}{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 40))],
             dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=rng.randrange(2**63)))
            for i in range(n)]


def send_pd(prefill: Scheduler, decode: Scheduler, reqs, max_new: int) -> None:
    for rid, p, f in reqs:
        for s in (prefill, decode):
            s.handle(GenerateReq(rid=rid, input_ids=p, sampling=SamplingParams(max_new_tokens=max_new, temperature=0),
                                 **f))


def decoding(prefill: Scheduler, decode: Scheduler, reqs, max_new: int) -> dict:
    """Send `reqs` to the pair and run both until every one of them decodes on `decode`; the outputs so far."""
    send_pd(prefill, decode, reqs, max_new)
    out: dict = {}
    run_all([prefill, decode], out, lambda: len(decode.running) == len(reqs))
    return out


def finished(out: dict, sched: Scheduler, reqs) -> bool:
    """Every one of `reqs` ended on `sched` (its decode side)."""
    mine = out.get(id(sched), {})
    return all(rid in mine and mine[rid][1] is not None for rid, *_ in reqs)


@pytest.fixture(params=["started", "switched"])
def trio(request):
    """P (prefill), D (decode: started as decode, radix cache; or switched from null, no prefix sharing), X
    (decode)."""
    ports = [free_port() for _ in range(3)]
    scheds = [make(ports[0], "prefill"), make(ports[1], "decode" if request.param == "started" else "null"),
              make(ports[2], "decode")]
    if request.param == "switched":
        assert switch(scheds[1], "decode").status_code == 200
    yield scheds, ports
    for s in scheds:
        s.shutdown()


def test_a_decode_server_hands_its_answers_over_to_prefill_and_prefills_at_once(trio):
    """D holds answers being decoded (and two requests whose KV has not come yet) when it switches to
    prefill with handover: the switch answers at once, D prefills new requests for another decode server
    while it finishes the old answers, every output equals the reference, and the decode role goes once
    it holds nothing."""
    (p, d, x), (pp, pd_port, _) = trio
    old = pd_prompts(pp, 4, "old", 1)
    send_pd(p, d, old, 40)
    out: dict = {}
    run_all([p, d], out, lambda: len(d.running) == 4 and all(len(r.output_ids) >= 3 for r in d.running))
    late = pd_prompts(pp, 2, "late", 2)
    send_pd(p, d, late, 12)
    d.step()  # the late ones wait in D's queues for their KV, which P has not computed yet
    assert len(d.role.queued_reqs()) + len(d.role.extra_live_reqs()) == 2
    epoch = d.controller.epoch
    r = switch(d, "prefill", handover=True)
    assert r.status_code == 200 and r.current_mode == "prefill" and r.epoch == epoch + 1, r.message
    assert "6 requests" in r.message and "handover" in r.message
    assert d.controller.state.value == "HANDOVER" and d.role.name == "prefill"
    assert switch(d, "null").status_code == 409  # no second switch until the decode role is gone
    new = pd_prompts(pd_port, 3, "new", 3)
    send_pd(d, x, new, 10)  # D is a prefill server now, X its decode partner
    run_all([p, d, x], out, lambda: finished(out, x, new))
    assert not finished(out, d, old)  # the new requests finished while D still decoded the old answers
    run_all([p, d, x], out, lambda: finished(out, d, old + late) and d.controller.state.value == "IDLE")
    for rid, prompt, _ in old + late + new:
        n = 40 if rid.startswith("old") else 12 if rid.startswith("late") else 10
        assert out[id(x if rid.startswith("new") else d)][rid][0] == reference_generate(prompt, n), rid
    assert type(d.role).__name__ == "PrefillRole" and d.controller.last_timings_ms["handover"] > 0
    assert d.mem.tree_cache.total_size() > 0  # the handed-over answers' KV went to the radix cache
    d.check_integrity()


def test_a_decode_server_hands_its_answers_over_to_null_and_serves_whole_requests_at_once(trio):
    (p, d, _), (pp, _, _) = trio
    old = pd_prompts(pp, 3, "old", 4)
    out = decoding(p, d, old, 30)
    r = switch(d, "null", handover=True)
    assert r.status_code == 200 and r.current_mode == "null", r.message
    rng = random.Random(5)
    whole = [(f"w{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 30))]) for i in range(3)]
    for rid, prompt in whole:
        d.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=8, temperature=0)))
    run_all([p, d], out, lambda: finished(out, d, old + whole) and d.controller.state.value == "IDLE")
    assert all(out[id(d)][rid][0] == reference_generate(prompt, 30) for rid, prompt, _ in old)
    assert all(out[id(d)][rid][0] == reference_generate(prompt, 8) for rid, prompt in whole)
    assert type(d.role).__name__ == "NullRole"


def test_handover_where_the_new_role_cannot_finish_the_requests_is_the_usual_switch(pair):
    """A null server switching to decode cannot hand over (decode prefills nothing): busy, it refuses (503)
    or drains as before; so does a prefill server, whose requests' decode servers hold their answers."""
    a, b, *_ = pair
    a.handle(GenerateReq(rid="busy", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=50)))
    r = switch(a, "decode", handover=True)
    assert r.status_code == 503 and "queues not empty" in r.message and a.role.name == "null"
    assert "a handover applies to decode -> prefill, decode -> null, null -> prefill only" in r.message
    assert switch(b, "prefill").status_code == 200
    b.handle(GenerateReq(rid="pd", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=5),
                         bootstrap_host="127.0.0.1", bootstrap_port=free_port(), bootstrap_room=7))
    r = switch(b, "null", handover=True)
    assert r.status_code == 503 and "queues not empty" in r.message and b.role.name == "prefill"


OWN_LEN = 120  # long enough that 3 PD requests end first however the machine is loaded (40 raced in 1 full run)


def test_a_null_server_hands_its_requests_over_to_prefill_and_prefills_at_once():
    """N (null) decodes answers, is midway through a chunked prefill and holds prompts it has not prefilled
    when it switches to prefill with handover: the switch answers at once, N prefills new PD requests for X
    while it finishes its own requests (the prompts too, prefilled and decoded there), every output equals
    the reference, its radix cache and the prefixes in it stay, and the null role goes once N holds none of
    its requests."""
    pn, px = free_port(), free_port()
    n, x = make(pn, "null"), make(px, "decode")
    try:
        rng = random.Random(11)
        own = [(f"own{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 16))]) for i in range(5)]
        for rid, prompt in own[:3]:
            n.handle(GenerateReq(rid=rid, input_ids=prompt,
                                 sampling=SamplingParams(max_new_tokens=OWN_LEN, temperature=0)))
        out: dict = {}
        run_all([n], out, lambda: len(n.running) == 3 and all(len(r.output_ids) >= 3 for r in n.running))
        long = ("long", [rng.randrange(1, 500) for _ in range(45)])  # three chunks of 16
        n.handle(GenerateReq(rid="long", input_ids=long[1],
                             sampling=SamplingParams(max_new_tokens=12, temperature=0)))
        n.step()
        assert n.planner.chunked_req is not None and n.planner.chunked_req.rid == "long"
        for rid, prompt in own[3:]:  # not prefilled yet when N switches
            n.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=12, temperature=0)))
        own.append(long)
        cached = n.mem.tree_cache.total_size()
        r = switch(n, "prefill", handover=True)  # the chunked prefill goes on: the radix cache stays
        assert r.status_code == 200 and r.current_mode == "prefill" and r.epoch == 1, r.message
        assert "6 requests the null role held" in r.message and "handover" in r.message
        assert n.controller.state.value == "HANDOVER" and n.role.name == "prefill"
        assert n.mem.tree_cache.total_size() == cached > 0
        refused = switch(n, "decode")
        assert refused.status_code == 409 and "null role is still finishing" in refused.message
        new = pd_prompts(pn, 3, "new", 12)
        send_pd(n, x, new, 10)
        run_all([n, x], out, lambda: finished(out, x, new))
        assert not finished(out, n, own[:3])  # the new requests finished while N still decoded its own
        run_all([n, x], out, lambda: finished(out, n, own) and n.controller.state.value == "IDLE")
        for rid, prompt in own:
            assert out[id(n)][rid][0] == reference_generate(prompt, OWN_LEN if rid in ("own0", "own1", "own2") else 12)
        for rid, prompt, _ in new:
            assert out[id(x)][rid][0] == reference_generate(prompt, 10), rid
        assert type(n.role).__name__ == "PrefillRole" and n.controller.last_timings_ms["handover"] > 0
        n.check_integrity()
        x.check_integrity()
    finally:
        n.shutdown()
        x.shutdown()


def test_a_running_batch_full_of_handed_over_answers_does_not_hold_back_the_pd_prompts():
    """N (null, at most 2 running) hands 2 answers and 2 queued prompts over to prefill: the queued prompts wait for
    a running slot, and the PD prompts that come after are prefilled and sent meanwhile (they take none)."""
    pn, px = free_port(), free_port()
    n, x = make(pn, "null", max_running_requests=2), make(px, "decode")
    try:
        rng = random.Random(31)
        own = [(f"own{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 16))]) for i in range(4)]
        for rid, prompt in own:
            n.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=60, temperature=0)))
        out: dict = {}
        run_all([n], out, lambda: len(n.running) == 2 and all(len(r.output_ids) >= 3 for r in n.running))
        assert len(n.waiting_queue) == 2
        assert switch(n, "prefill", handover=True).status_code == 200
        new = pd_prompts(pn, 2, "new", 32)
        send_pd(n, x, new, 4)
        run_all([n, x], out, lambda: finished(out, x, new))
        assert not any(finished(out, n, [req]) for req in own)  # none of the held requests has ended yet
        run_all([n, x], out, lambda: finished(out, n, own) and n.controller.state.value == "IDLE")
        assert all(out[id(n)][rid][0] == reference_generate(prompt, 60) for rid, prompt in own)
        assert all(out[id(x)][rid][0] == reference_generate(prompt, 4) for rid, prompt, _ in new)
        n.check_integrity()
    finally:
        n.shutdown()
        x.shutdown()


@pytest.mark.parametrize("step", ["check", "cache", "init", "bootstrap", "commit"])
def test_a_null_handover_that_fails_rolls_back_with_every_request(pair, step):
    """A busy null server whose handover to prefill fails at any step stays null with everything it held (answers,
    a chunked prefill, a queued prompt), and finishes each of them to the reference."""
    n, *_ = pair
    rng = random.Random(21)
    own = [(f"own{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 16))], 30) for i in range(3)]
    own += [("chunked", [rng.randrange(1, 500) for _ in range(45)], 8), ("queued", [7, 8, 9], 8)]
    out: dict = {}
    for rid, prompt, k in own[:3]:
        n.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=k, temperature=0)))
    run_all([n], out, lambda: len(n.running) == 3)
    for rid, prompt, k in own[3:]:
        n.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=k, temperature=0)))
        if rid == "chunked":
            n.step()
    assert n.planner.chunked_req is not None
    n.controller.faults.step = step
    r = switch(n, "prefill", handover=True)
    assert r.status_code >= 500 and step in r.message and "rolled back" in r.message, r.message
    assert n.role.name == "null" and n.controller.epoch == 0 and n.controller.state.value == "IDLE"
    n.controller.faults.step = None
    run_all([n], out, lambda: finished(out, n, own))
    assert all(out[id(n)][rid][0] == reference_generate(prompt, k) for rid, prompt, k in own)
    assert n.is_idle()
    n.check_integrity()


def test_handed_over_answers_retracted_under_prefill_are_prefilled_and_decoded_there():
    """A prefill server whose handed-over answers run out of KV retracts some: they are prefilled again
    from prompt and output so far and decoded there, to the reference."""
    pp, dp = free_port(), free_port()
    p = make(pp, "prefill")
    args = ServerArgs(model_path="fake", disaggregation_mode="decode", disaggregation_transfer_backend="tcp",
                      disaggregation_bootstrap_port=dp, chunked_prefill_size=16, num_reserved_decode_tokens=1,
                      enable_dynamic_disaggregation=True)
    d = Scheduler(args, FakeModelRunner(max_total_tokens=160), tokenizer=None)
    try:
        old = pd_prompts(pp, 4, "old", 6)
        send_pd(p, d, old, 60)
        out: dict = {}
        run_all([p, d], out, lambda: len(d.running) == 4)
        retracted = d.stats.num_retracted
        assert switch(d, "prefill", handover=True).status_code == 200
        run_all([p, d], out, lambda: finished(out, d, old) and d.controller.state.value == "IDLE")
        assert d.stats.num_retracted > retracted
        assert all(out[id(d)][rid][0] == reference_generate(prompt, 60) for rid, prompt, _ in old)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_drained_switch_asked_during_a_handover_waits_for_it_or_times_out(trio):
    """During a handover to prefill a switch to a third role without drain is 409; with drain it waits until
    the decode role is gone (a second one meanwhile is 409, a switch back to decode too), then drains and runs;
    one whose timeout passes first gets 504 and the handover goes on. (To null a handover ends as soon as the
    decode role's own queues are empty: null decodes the answers as its own.)"""
    import time

    (p, d, _), (pp, _, _) = trio
    old = pd_prompts(pp, 2, "old", 9)
    out = decoding(p, d, old, 60)
    assert d.make_stats(1).handing_over_from == ""
    assert switch(d, "prefill", handover=True).status_code == 200
    assert d.make_stats(1).handing_over_from == "decode"  # /get_load says it: the router refuses a third role
    assert switch(d, "null", drain=True, timeout_s=0.01) is None
    time.sleep(0.05)
    d.step()
    (r,) = d.take_replies()
    assert r.status_code == 504 and "handover" in r.message and d.controller.state.value == "HANDOVER"
    assert "a switch to null timed out" in d.controller.status(1).last_error
    r = switch(d, "prefill", drain=True, timeout_s=0.01)  # its own mode: said at once, the handover not waited for
    assert r.status_code == 200 and "already in prefill mode" in r.message and r.epoch == d.controller.epoch
    assert switch(d, "null", drain=True, timeout_s=60) is None
    st = d.controller.status(1)
    assert (st.transition_state, st.target_mode) == ("HANDOVER", "null")  # the switch waiting behind the handover
    for mode in ("null", "decode"):
        second = switch(d, mode, drain=True)
        assert second.status_code == 409 and "already waits" in second.message
    replies: list = []
    run_all([p, d], out, replied(d, replies))
    (r,) = replies
    assert r.status_code == 200 and r.current_mode == "null" and r.timings_ms["drain"] > 0, r.message
    assert finished(out, d, old) and type(d.role).__name__ == "NullRole" and d.make_stats(1).handing_over_from == ""
    assert all(out[id(d)][rid][0] == reference_generate(prompt, 60) for rid, prompt, _ in old)


def replied(sched: Scheduler, replies: list):
    """A `run_all` condition: `sched` answered a switch (collected into `replies`)."""
    def done() -> bool:
        replies.extend(sched.take_replies())
        return bool(replies)
    return done


# ------------------------------------------------ a switch back to the old role during a handover


def refused_now(sched: Scheduler, rid: str) -> int:
    """The status code a new request gets from `sched` at once (0: it was taken)."""
    sched.handle(GenerateReq(rid=rid, input_ids=[4, 5, 6], sampling=SamplingParams(max_new_tokens=3)))
    ended = [o for o in sched.take_outbox() if o.rid == rid and o.finish_reason is not None]
    return ended[0].finish_reason.status_code if ended else 0


def test_a_switch_back_during_a_handover_waits_for_the_new_roles_own_requests_only(trio):
    """D hands 2 long answers over to prefill and prefills PD prompts for X. A switch back to decode without
    drain is 503 while those prompts are D's; with drain D refuses new requests, finishes sending them, and is a
    decode server again long before the answers end, which it decodes on as its own; its cache is the one it had
    as decode, and every output equals the reference."""
    (p, d, x), (pp, pd_port, _) = trio
    cache_kind = type(d.mem.tree_cache)
    old = pd_prompts(pp, 2, "old", 41)
    out = decoding(p, d, old, 160)
    epoch = d.controller.epoch
    assert switch(d, "prefill", handover=True).status_code == 200
    new = pd_prompts(pd_port, 3, "new", 42)
    send_pd(d, x, new, 6)
    r = switch(d, "decode")
    assert r.status_code == 503 and "holds requests of its own" in r.message and d.role.name == "prefill", r.message
    assert switch(d, "decode", drain=True, timeout_s=60) is None
    assert refused_now(d, "late") == 503 and d.controller.state.value == "DRAINING"
    replies: list = []
    run_all([p, d, x], out, replied(d, replies))
    (r,) = replies
    assert r.status_code == 200 and r.current_mode == "decode" and r.epoch == epoch + 2, r.message
    assert "switched back" in r.message and r.timings_ms["drain"] > 0
    assert finished(out, d, new) and not finished(out, d, old)  # the prompts sent; the answers still run
    assert type(d.role).__name__ == "DecodeRole" and type(d.mem.tree_cache) is cache_kind
    d.check_integrity()
    more = pd_prompts(pp, 2, "more", 43)
    send_pd(p, d, more, 8)  # a decode server again: P's prompts decode here
    run_all([p, d, x], out, lambda: finished(out, d, old + more))
    for rid, prompt, _ in old + more:
        assert out[id(d)][rid][0] == reference_generate(prompt, 160 if rid.startswith("old") else 8), rid
    assert all(out[id(x)][rid][0] == reference_generate(prompt, 6) for rid, prompt, _ in new)
    assert d.controller.state.value == "IDLE" and d.is_idle()
    d.check_integrity()


def test_a_null_server_switched_back_during_its_handover_keeps_everything():
    """A null server that handed its answers over to prefill and took no PD prompt is null again at once, with
    its radix cache, and finishes every answer to the reference."""
    pn = free_port()
    n = make(pn, "null")
    try:
        rng = random.Random(51)
        own = [(f"own{i}", [rng.randrange(1, 500) for _ in range(rng.randint(3, 16))]) for i in range(3)]
        for rid, prompt in own:
            n.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=40, temperature=0)))
        out: dict = {}
        run_all([n], out, lambda: len(n.running) == 3)
        assert switch(n, "prefill", handover=True).status_code == 200
        cache, cached = n.mem.tree_cache, n.mem.tree_cache.total_size()
        r = switch(n, "null")
        assert r.status_code == 200 and r.current_mode == "null" and r.epoch == 2, r.message
        assert n.mem.tree_cache is cache and cache.total_size() == cached > 0
        assert type(n.role).__name__ == "NullRole" and n.controller.state.value == "IDLE"
        run_all([n], out, lambda: finished(out, n, own))
        assert all(out[id(n)][rid][0] == reference_generate(prompt, 40) for rid, prompt in own)
        n.check_integrity()
    finally:
        n.shutdown()


def test_a_switch_back_from_null_waits_for_prefixes_null_holds_where_decode_shares_none(trio):
    """D (decode) hands a PD request still waiting for its KV over to null and serves a whole request. Back to
    decode: where D's decode role had a radix cache the switch goes at once; where it shared none (switched from
    null) it waits until no request holds a prefix in null's radix cache (the whole request has ended), then puts
    a cache without sharing back. Every output equals the reference."""
    (p, d, _), (pp, _, _) = trio
    shares = type(d.mem.tree_cache).__name__ == "RadixCache"
    waits = pd_prompts(pp, 1, "kv", 61)
    send_pd(p, d, waits, 20)
    d.step()  # its KV has not come: P has not run
    epoch = d.controller.epoch
    assert switch(d, "null", handover=True).status_code == 200 and d.controller.state.value == "HANDOVER"
    whole = ("whole", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    d.handle(GenerateReq(rid="whole", input_ids=whole[1], sampling=SamplingParams(max_new_tokens=30, temperature=0)))
    out: dict = {}
    run_all([d], out, lambda: len(d.running) == 1)
    r = switch(d, "decode", drain=True, timeout_s=60)
    replies: list = [] if r is None else [r]
    assert (r is not None) == shares
    run_all([p, d], out, replied(d, replies))
    (r,) = replies
    assert r.status_code == 200 and r.current_mode == "decode" and r.epoch == epoch + 2, r.message
    assert finished(out, d, [whole]) != shares  # the whole request ended first where decode shares none
    assert type(d.mem.tree_cache).__name__ == ("RadixCache" if shares else "ChunkCache")
    run_all([p, d], out, lambda: finished(out, d, waits + [whole]))
    assert out[id(d)]["kv0"][0] == reference_generate(waits[0][1], 20)
    assert out[id(d)]["whole"][0] == reference_generate(whole[1], 30)
    d.check_integrity()


@pytest.mark.parametrize("step", ["check", "cache", "commit"])
def test_a_switch_back_that_fails_leaves_the_handover_as_it_was(trio, step):
    (p, d, _), (pp, _, _) = trio
    old = pd_prompts(pp, 2, "old", 71)
    out = decoding(p, d, old, 40)
    epoch = d.controller.epoch
    assert switch(d, "prefill", handover=True).status_code == 200
    d.controller.faults.step = step
    r = switch(d, "decode")
    assert r.status_code >= 500 and step in r.message and "still serving as prefill" in r.message, r.message
    assert d.role.name == "prefill" and d.controller.state.value == "HANDOVER" and d.controller.epoch == epoch + 1
    d.controller.faults.step = None
    run_all([p, d], out, lambda: finished(out, d, old) and d.controller.state.value == "IDLE")
    assert all(out[id(d)][rid][0] == reference_generate(prompt, 40) for rid, prompt, _ in old)
    assert type(d.role).__name__ == "PrefillRole"
    d.check_integrity()


def test_a_switch_back_whose_drain_times_out_leaves_the_handover_going(trio):
    import time

    (p, d, x), (pp, pd_port, _) = trio
    old = pd_prompts(pp, 1, "old", 81)
    out = decoding(p, d, old, 40)
    assert switch(d, "prefill", handover=True).status_code == 200
    new = pd_prompts(pd_port, 1, "new", 82)
    send_pd(d, x, new, 4)  # X is not stepped: the prompt stays D's
    assert switch(d, "decode", drain=True, timeout_s=0.01) is None
    time.sleep(0.05)
    d.step()
    (r,) = d.take_replies()
    assert r.status_code == 504 and "still serving as prefill" in r.message, r.message
    assert d.controller.state.value == "HANDOVER" and d.controller.admitting
    run_all([p, d, x], out, lambda: finished(out, d, old) and finished(out, x, new)
            and d.controller.state.value == "IDLE")
    assert out[id(d)]["old0"][0] == reference_generate(old[0][1], 40)
    assert out[id(x)]["new0"][0] == reference_generate(new[0][1], 4)
