"""Speculative decoding in the scheduler, on the fake model whose every prediction reads the
KV it was given (so a guess's KV kept or freed wrongly changes the output): outputs equal
the reference with guesses right, wrong and partly right, across page sizes, memory
pressure, stop tokens and aborts; pool integrity is checked after every step."""

from __future__ import annotations

import random

import pytest

from fakes import reference_generate
from test_scheduler import greedy, make_sched, prompts, run_to_end
from tidal.messages import AbortReq, GenerateReq

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}


class Oracle:
    """Guesses the true continuation, corrupted at a random position with probability `wrong`."""

    def __init__(self, k: int, wrong: float, seed: int = 0):
        self.k, self.wrong, self.rng = k, wrong, random.Random(seed)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        n = min(limit, self.k)
        if n <= 0:
            return []
        guess = reference_generate(tokens, n)
        if self.rng.random() < self.wrong:
            at = self.rng.randrange(n)
            guess[at] = 1 + (guess[at] % 499)
        return guess


def spec_sched(wrong: float, page_size: int = 1, **kw):
    sched = make_sched(page_size=page_size, **SPEC, **kw)
    sched.speculator.proposer = Oracle(4, wrong)
    sched.speculator.cost.fixed_over_per_token = lambda: 1000.0  # the fake's pass times mean nothing: guess freely
    return sched


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("wrong", [0.0, 0.5, 1.0])
def test_outputs_equal_the_reference_whatever_the_guesses(page_size, wrong):
    sched = spec_sched(wrong, page_size, chunked_prefill_size=max(16, page_size))
    ps = prompts(8, seed=page_size)
    for i, p in enumerate(ps):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=p, sampling=greedy(23)))
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        toks, fin = res[f"r{i}"]
        assert toks == reference_generate(p, 23), f"r{i}"
        assert fin.completion_tokens == 23 and fin.finish_reason.type == "length"
    st = sched.speculator.stats()
    assert st["spec_verify_steps"] > 0
    if wrong == 0.0:
        assert st["spec_accept_length"] > 3.0  # 4 guesses all kept, but for the last steps of each request
    if wrong == 1.0:
        assert st["spec_accept_rate"] < 0.7


def test_memory_pressure_retracts_and_stays_exact():
    sched = spec_sched(0.3, page_size=4, max_total_tokens=320, chunked_prefill_size=64)
    ps = prompts(10, lo=10, hi=20, seed=3)
    for i, p in enumerate(ps):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=p, sampling=greedy(40)))
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        assert res[f"r{i}"][0] == reference_generate(p, 40), f"r{i}"


def test_a_stop_token_inside_kept_guesses_ends_the_request_there():
    p = prompts(1, seed=9)[0]
    ref = reference_generate(p, 30)
    stop = ref[6]
    plain, spec = make_sched(), spec_sched(0.0)
    for s in (plain, spec):
        s.handle(GenerateReq(rid="r", input_ids=p, sampling=greedy(30, stop_token_ids=[stop])))
    a, b = run_to_end(plain)["r"], run_to_end(spec)["r"]
    assert a[0] == b[0] == ref[: ref.index(stop) + 1]
    assert b[1].finish_reason.type == "stop"


def test_an_abort_mid_decode_frees_everything():
    sched = spec_sched(0.2)
    for i, p in enumerate(prompts(4, seed=5)):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=p, sampling=greedy(200)))
    for _ in range(12):
        sched.step()
        sched.check_integrity()
    sched.handle(AbortReq(rid="r1"))
    res = run_to_end(sched)
    assert res["r1"][1].finish_reason.type == "abort"
    assert all(res[f"r{i}"][1].completion_tokens == 200 for i in (0, 2, 3))


def test_real_ngram_proposals_on_repetitive_output():
    """The real proposer: the fake model's continuation of a prompt that is one block repeated
    is not repetitive, so guesses are mostly wrong; outputs stay exact either way."""
    sched = make_sched(**SPEC)
    block = [7, 8, 9, 10, 11]
    sched.handle(GenerateReq(rid="r", input_ids=block * 6, sampling=greedy(25)))
    res = run_to_end(sched)
    assert res["r"][0] == reference_generate(block * 6, 25)
    assert sched.speculator.stats()["spec_draft_tokens"] > 0
