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
    a.controller.fault_step = step
    r = switch(a, "decode")
    assert r.status_code >= 500 and step in r.message and "rolled back" in r.message
    assert a.role.name == "prefill" and a.controller.epoch == 1
    assert a.mem.tree_cache.total_size() == tree_before  # cache as before
    a.controller.fault_step = None
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
