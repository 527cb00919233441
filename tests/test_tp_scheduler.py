"""Tensor-parallel schedulers (2 ranks per server, threads joined by a real ShmComm) on the
KV-reading fake model: every rank makes the same decisions, PD pairs rank to rank,
every switch direction works, and a switch that fails on any one rank at any step
rolls every rank back."""

from __future__ import annotations

import itertools
import random
import socket
import time

import pytest

from fakes import FakeModelRunner, reference_generate
from servers import free_port
from tidal.config import ServerArgs
from tidal.messages import AbortReq, GenerateReq, SwitchModeReq
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler
from tidal.transfer import KVPoll, poll_and_all_reduce
from tp_ranks import RankGroup

pytestmark = pytest.mark.timeout(180)
TP = 2
_calls = itertools.count(1)


def server(port: int, mode: str = "null", **kw) -> RankGroup:
    args = ServerArgs(model_path="fake", tp_size=TP, disaggregation_mode=mode, disaggregation_transfer_backend="tcp",
                      disaggregation_bootstrap_port=port, chunked_prefill_size=16, num_reserved_decode_tokens=16,
                      enable_dynamic_disaggregation=True, enable_integrity_check=True, **kw)

    def make(comm):
        runner = FakeModelRunner(max_total_tokens=4096)
        runner.tp = comm
        return Scheduler(args, runner, tokenizer=None)

    return RankGroup(TP, make)


def switch(g: RankGroup, mode: str, **kw):
    g.handle(SwitchModeReq(call_id=next(_calls), mode=mode, **kw))
    replies = g.replies()
    return replies[0] if replies else None


def run(groups: list[RankGroup], timeout: float = 60.0) -> list[dict]:
    """Step every server (all its ranks at once) until all are idle; per server, rank 0's
    tokens per request. Every rank must have produced exactly the same outputs."""
    outs: list[dict] = [{} for _ in groups]
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy = False
        for g, out in zip(groups, outs):
            busy |= any(g.each(lambda s: s.step()))
            g.each(lambda s: s.check_integrity())
            per_rank = [s.take_outbox() for s in g.ranks]
            # the same decisions everywhere; only a failure's wording is rank-local (rank 0's is sent)
            seen = [[(o.rid, o.new_token_ids, _kind(o.finish_reason)) for o in outs] for outs in per_rank]
            assert all(r == seen[0] for r in seen), "TP ranks disagree"
            for rid, toks, fin in ((o.rid, o.new_token_ids, o.finish_reason) for o in per_rank[0]):
                prev = out.get(rid, ([], None))
                out[rid] = (prev[0] + toks, fin or prev[1])
        if not busy and all(all(g.each(lambda s: s.is_idle())) for g in groups):
            return outs
        if not busy:
            time.sleep(0.002)
    raise AssertionError("servers did not finish")


def _kind(fin):
    return None if fin is None else (fin.type, fin.status_code)


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def serve_colocated(g: RankGroup, n: int = 3, seed: int = 0) -> None:
    prompts = prompts_for(seed, n)
    for i, p in enumerate(prompts):
        g.handle(GenerateReq(rid=f"c{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=8, temperature=0)))
    (out,) = run([g])
    assert [out[f"c{i}"][0] for i in range(n)] == [reference_generate(p, 8) for p in prompts]


def serve_pd(prefill: RankGroup, decode: RankGroup, port: int, n: int = 4, seed: int = 1) -> dict:
    prompts = prompts_for(seed, n)
    rng = random.Random(seed)
    for i, p in enumerate(prompts):
        f = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=rng.randrange(2**63))
        for g in (prefill, decode):
            g.handle(GenerateReq(rid=f"pd{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=8, temperature=0),
                                 **f))
    _, dout = run([prefill, decode])
    return {"prompts": prompts, "out": dout}


def assert_pd_exact(result: dict) -> None:
    prompts, out = result["prompts"], result["out"]
    assert [out[f"pd{i}"][0] for i in range(len(prompts))] == [reference_generate(p, 8) for p in prompts]


def modes(g: RankGroup) -> list[tuple[str, int]]:
    return g.each(lambda s: (s.role.name, s.controller.epoch))


@pytest.fixture
def pair():
    pa, pb = free_port(), free_port()
    a, b = server(pa), server(pb)
    yield a, b, pa, pb
    a.close()
    b.close()


def test_tp_ranks_agree_and_outputs_are_exact(pair):
    g, _, _, _ = pair
    serve_colocated(g, n=5)
    g.handle(GenerateReq(rid="x", input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=200, temperature=0)))
    g.each(lambda s: s.step())
    g.handle(AbortReq(rid="x"))
    (out,) = run([g])
    assert out["x"][1].type == "abort"
    assert all(s.mem.used_tokens() == 0 for s in g.ranks)


def test_tp_all_six_directions_with_pd_between_tp_servers(pair):
    a, b, pa, pb = pair
    serve_colocated(a)
    assert switch(a, "prefill").status_code == 200          # null -> prefill
    assert switch(b, "decode").status_code == 200           # null -> decode
    assert_pd_exact(serve_pd(a, b, pa))
    assert switch(a, "decode").status_code == 200           # prefill -> decode
    assert switch(b, "prefill").status_code == 200          # decode -> prefill
    assert_pd_exact(serve_pd(b, a, pb))
    assert switch(a, "null").status_code == 200             # decode -> null
    assert switch(b, "null").status_code == 200             # prefill -> null
    serve_colocated(a)
    serve_colocated(b)
    assert modes(a) == [("null", 3)] * TP and modes(b) == [("null", 3)] * TP


@pytest.mark.parametrize("rank", range(TP))
@pytest.mark.parametrize("step", ["check", "cache", "init", "bootstrap", "commit"])
def test_a_fault_on_one_rank_rolls_back_every_rank(pair, step, rank):
    a, b, pa, _ = pair
    assert switch(b, "decode").status_code == 200
    a.ranks[rank].controller.faults.step = step
    r = switch(a, "prefill")
    assert r.status_code == 500, r.message
    assert f"TP rank {rank}" in r.message and step in r.message and "rolled back" in r.message
    assert modes(a) == [("null", 0)] * TP
    assert all(s.controller.state.value == "IDLE" for s in a.ranks)
    with socket.socket() as probe:  # rank 0's bootstrap server is down again (or never started)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger
        probe.bind(("127.0.0.1", pa))
        probe.listen()
    serve_colocated(a)
    a.ranks[rank].controller.faults.step = None
    assert switch(a, "prefill").status_code == 200
    assert modes(a) == [("prefill", 1)] * TP
    assert_pd_exact(serve_pd(a, b, pa, n=2))


def test_bootstrap_port_taken_fails_on_rank_0_and_all_roll_back(pair):
    a, _, pa, _ = pair
    with socket.socket() as blocker:  # another listener: rank 0's hold on its bootstrap port does not stop one
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", pa))
        blocker.listen()
        r = switch(a, "prefill")
    assert r.status_code == 500 and "TP rank 0" in r.message and "bootstrap" in r.message
    assert modes(a) == [("null", 0)] * TP
    serve_colocated(a)


def test_drain_timeout_is_agreed_by_every_rank(pair):
    a, _, _, _ = pair
    a.handle(GenerateReq(rid="long", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=500, temperature=0,
                                                                                 ignore_eos=True)))
    a.each(lambda s: s.step())
    assert switch(a, "decode", drain=True, timeout_s=0.05) is None
    time.sleep(0.1)
    a.each(lambda s: s.step())
    (r,) = a.replies()
    assert r.status_code == 504
    assert modes(a) == [("null", 0)] * TP and all(s.controller.admitting for s in a.ranks)
    a.handle(AbortReq(rid="long"))
    run([a])


def test_a_transfer_failing_on_one_rank_fails_the_request_on_every_rank(pair):
    a, b, pa, _ = pair
    assert switch(a, "prefill").status_code == 200
    assert switch(b, "decode").status_code == 200
    b.ranks[1].role.transfer.manager._decode.config = _failing(b.ranks[1].role.transfer.manager._decode.config)
    result = serve_pd(a, b, pa, n=3)
    for i in range(3):
        toks, fin = result["out"][f"pd{i}"]
        assert fin.type == "abort" and fin.status_code == 500
    for g in (a, b):  # nothing leaked on any rank
        assert all(s.is_idle() and s.mem.used_tokens() == 0 for s in g.ranks)
    b.ranks[1].role.transfer.manager._decode.config = _failing(b.ranks[1].role.transfer.manager._decode.config, 0.0)
    assert_pd_exact(serve_pd(a, b, pa, n=2, seed=7))


def _failing(config, prob: float = 1.0):
    import dataclasses

    return dataclasses.replace(config, failure_prob=prob)


class _P:
    def __init__(self, v):
        self.v, self.aborted = v, False

    def poll(self):
        return KVPoll.Failed if self.aborted and self.v != KVPoll.Success else self.v

    def abort(self):
        self.aborted = True


class _Comm:
    """Two ranks: this one, and a peer whose polls are given."""

    size, rank = 2, 0

    def __init__(self, peer):
        self.peer = peer

    def all_gather_ints(self, values):
        import numpy as np

        return np.array([list(values), self.peer], dtype=np.int64)


def test_poll_agreement_fences_failures():
    F, B, T, S = KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.Transferring, KVPoll.Success
    mine = [_P(S), _P(T), _P(F), _P(T)]
    peer = [S, S, T, F]
    got = poll_and_all_reduce(mine, _Comm(peer))
    # Success needs both; MIN otherwise; a failure elsewhere aborts this rank's side, which
    # then reads Failed locally, but the agreed state waits until the peer's side stopped too
    assert got == [S, T, B, B]
    assert [p.aborted for p in mine] == [False, False, False, True]
    assert poll_and_all_reduce(mine, _Comm([S, S, F, F])) == [S, T, F, F]  # now both sides stopped
    assert poll_and_all_reduce(mine[:2], None) == [S, T]


def take_lead_outputs(g: RankGroup) -> dict:
    """Rank 0's tokens so far per request (the other ranks' outboxes emptied too)."""
    got: dict = {}
    for o in g.lead.take_outbox():
        got.setdefault(o.rid, []).extend(o.new_token_ids)
    for s in g.ranks[1:]:
        s.take_outbox()
    return got


def prefill_new_for(p: RankGroup, d: RankGroup, port: int, prompts: list, rng: random.Random, got: dict):
    """PD requests new0.. prefilled on p for d, run with everything else to the end; p's outputs with `got` (its
    tokens before) in front."""
    for i, prompt in enumerate(prompts):
        f = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=rng.randrange(2**63))
        for g in (p, d):
            g.handle(GenerateReq(rid=f"new{i}", input_ids=prompt,
                                 sampling=SamplingParams(max_new_tokens=8, temperature=0), **f))
    pout, dout = run([p, d])
    for rid, toks in got.items():
        pout[rid] = (toks + pout.get(rid, ([], None))[0], pout[rid][1])
    return pout, dout


def answers_decoding(a: RankGroup, b: RankGroup, pa: int, seed: int, n: int) -> tuple[list, random.Random, dict]:
    """A to prefill, B to decode; n PD requests of 40 tokens (old0..) run until B decodes them all. The prompts,
    the generator that drew their rooms (to draw more), and B's rank-0 tokens so far."""
    assert switch(a, "prefill").status_code == 200 and switch(b, "decode").status_code == 200
    old = prompts_for(seed, n)
    rng = random.Random(seed)
    for i, p in enumerate(old):
        f = dict(bootstrap_host="127.0.0.1", bootstrap_port=pa, bootstrap_room=rng.randrange(2**63))
        for g in (a, b):
            g.handle(GenerateReq(rid=f"old{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=40, temperature=0),
                                 **f))
    deadline = time.time() + 60
    while len(b.lead.running) < n:
        assert time.time() < deadline
        for g in (a, b):
            g.each(lambda s: s.step())
    return old, rng, take_lead_outputs(b)


def test_tp_handover_every_rank_decodes_the_same_handed_over_answers(pair):
    """TP decode server B hands its answers over to prefill while they decode: every rank builds the same
    batches (rank 0's clock decides when the answers are owed time), B prefills for A (now decode) at once,
    and every output equals the reference."""
    a, b, pa, pb = pair
    old, rng, got = answers_decoding(a, b, pa, seed=7, n=3)
    r = switch(b, "prefill", handover=True)
    assert r.status_code == 200 and "handover" in r.message, r.message
    assert modes(b) == [("prefill", 2)] * TP
    reply = switch(a, "decode", drain=True, timeout_s=30)  # after its transfers in flight
    deadline = time.time() + 60
    while reply is None:
        assert time.time() < deadline
        for g in (a, b):
            g.each(lambda s: s.step())
        replies = a.replies()
        reply = replies[0] if replies else None
    assert reply.status_code == 200 and modes(a) == [("decode", 2)] * TP
    new = prompts_for(8, 2)
    bout, aout = prefill_new_for(b, a, pb, new, rng, got)
    assert [bout[f"old{i}"][0] for i in range(3)] == [reference_generate(p, 40) for p in old]
    assert [aout[f"new{i}"][0] for i in range(2)] == [reference_generate(p, 8) for p in new]
    assert b.each(lambda s: (s.controller.state.value, type(s.role).__name__)) == [("IDLE", "PrefillRole")] * TP


def test_tp_null_server_hands_its_requests_over_to_prefill_on_every_rank(pair):
    """TP null server B switches to prefill with handover while it decodes answers, is midway through a chunked
    prefill and holds a prompt not yet prefilled: every rank switches at once and builds the same batches, B
    prefills for A (decode) meanwhile, and every output equals the reference."""
    a, b, pa, pb = pair
    assert switch(a, "decode").status_code == 200
    own = prompts_for(9, 3)
    for i, p in enumerate(own):
        b.handle(GenerateReq(rid=f"own{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=30, temperature=0)))
    deadline = time.time() + 60
    while len(b.lead.running) < 3:
        assert time.time() < deadline
        b.each(lambda s: s.step())
    rng = random.Random(9)
    late = [[rng.randrange(1, 500) for _ in range(45)], [rng.randrange(1, 500) for _ in range(5)]]
    b.handle(GenerateReq(rid="late0", input_ids=late[0], sampling=SamplingParams(max_new_tokens=6, temperature=0)))
    b.each(lambda s: s.step())  # late0's first chunk
    b.handle(GenerateReq(rid="late1", input_ids=late[1], sampling=SamplingParams(max_new_tokens=6, temperature=0)))
    assert b.each(lambda s: s.planner.chunked_req is not None) == [True] * TP
    got = take_lead_outputs(b)
    r = switch(b, "prefill", handover=True)
    assert r.status_code == 200 and "5 requests the null role held" in r.message, r.message
    assert modes(b) == [("prefill", 1)] * TP
    new = prompts_for(10, 2)
    bout, aout = prefill_new_for(b, a, pb, new, rng, got)
    assert [bout[f"own{i}"][0] for i in range(3)] == [reference_generate(p, 30) for p in own]
    assert [bout[f"late{i}"][0] for i in range(2)] == [reference_generate(p, 6) for p in late]
    assert [aout[f"new{i}"][0] for i in range(2)] == [reference_generate(p, 8) for p in new]
    assert b.each(lambda s: (s.controller.state.value, type(s.role).__name__)) == [("IDLE", "PrefillRole")] * TP


@pytest.mark.parametrize("rank", range(TP))
def test_tp_switch_back_during_a_handover_fails_or_goes_on_every_rank_together(pair, rank):
    """TP decode server B hands its answers over to prefill; a switch back to decode that fails on one rank leaves
    every rank handing over, and the next one takes every rank back to decode at once, where the answers end
    equal to the reference."""
    a, b, pa, _ = pair
    old, rng, got = answers_decoding(a, b, pa, seed=11, n=2)
    assert switch(b, "prefill", handover=True).status_code == 200 and modes(b) == [("prefill", 2)] * TP
    b.ranks[rank].controller.faults.step = "cache"
    r = switch(b, "decode")
    assert r.status_code == 500 and f"TP rank {rank}" in r.message and "still serving as prefill" in r.message
    assert b.each(lambda s: (s.controller.state.value, s.role.name)) == [("HANDOVER", "prefill")] * TP
    b.ranks[rank].controller.faults.step = None
    r = switch(b, "decode")
    assert r.status_code == 200 and "switched back" in r.message, r.message
    assert modes(b) == [("decode", 3)] * TP
    assert b.each(lambda s: type(s.role).__name__) == ["DecodeRole"] * TP
    bout = run([b])[0]
    assert [got.get(f"old{i}", []) + bout[f"old{i}"][0] for i in range(2)] == [reference_generate(p, 40) for p in old]
