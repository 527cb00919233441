"""Speculative decoding with a draft model (STANDALONE) in the scheduler, on the KV-reading fake model.

The fake draft is a second fake model with its own KV pool: it guesses right exactly when its KV
holds the request's tokens at the right slots, so an accept rate of 1 proves the draft's KV is kept
in step with the target's (prefill mirrored, catch-up after all guesses were kept, slots freed with
the target's), while a noisy draft proves refused guesses cost nothing but time. Outputs equal the
reference; pools intact after every step; a PD decode server whose prefill ran no draft catches up."""

from __future__ import annotations

import random

import pytest

from fakes import VOCAB, FakeModelConfig, FakeModelRunner, reference_generate
from test_pd_scheduler import run_pair
from test_scheduler import greedy, prompts, run_to_end
from tidal.config import ServerArgs
from tidal.messages import GenerateReq
from tidal.scheduler.scheduler import Scheduler
from servers import free_port

SPEC = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "fake-draft",
        "speculative_num_steps": 3, "speculative_num_draft_tokens": 4}


class NoisyDraft(FakeModelRunner):
    """The fake model, wrong on a share of its predictions."""

    def __init__(self, wrong: float, **kw):
        super().__init__(**kw)
        self.wrong, self.rng = wrong, random.Random(1)

    def forward(self, fb, logit_rows):
        logits = super().forward(fb, logit_rows)
        for i in range(logits.shape[0]):
            if self.rng.random() < self.wrong:
                logits[i] = logits[i].roll(1)
        return logits


def spec_sched(page_size: int = 1, total: int = 4096, draft=None, **kw) -> Scheduler:
    args = ServerArgs(model_path="fake", page_size=page_size, max_total_tokens=total, **SPEC, **kw)
    runner = FakeModelRunner(max_total_tokens=total, page_size=page_size)
    draft = draft or FakeModelRunner(max_total_tokens=total, page_size=page_size)
    sched = Scheduler(args, runner, tokenizer=None, draft_runner=draft)
    sched.speculator.cost.fixed_over_per_token = lambda: 1000.0  # the fake's pass times mean nothing: guess freely
    sched.speculator._draft_round_cost = lambda: 0.0
    return sched


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_an_exact_draft_is_always_right_and_the_output_is_the_reference(page_size):
    sched = spec_sched(page_size, chunked_prefill_size=max(16, page_size))
    ps = prompts(8, seed=page_size)
    for i, p in enumerate(ps):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=p, sampling=greedy(31)))
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        assert res[f"r{i}"][0] == reference_generate(p, 31), f"r{i}"
    st = sched.speculator.stats()
    assert st["spec_accept_rate"] == 1.0 and st["spec_accept_length"] > 3.0, st


@pytest.mark.parametrize("wrong", [0.3, 1.0])
def test_a_noisy_draft_costs_only_time(wrong):
    sched = spec_sched(4, draft=NoisyDraft(wrong, page_size=4), chunked_prefill_size=16)
    ps = prompts(6, seed=7)
    for i, p in enumerate(ps):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=p, sampling=greedy(27)))
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        assert res[f"r{i}"][0] == reference_generate(p, 27), f"r{i}"
    assert sched.speculator.stats()["spec_accept_rate"] < (0.95 if wrong < 1 else 0.05)


def test_retraction_and_a_shared_prefix_keep_the_draft_in_step():
    sched = spec_sched(4, total=320, chunked_prefill_size=64)
    shared = prompts(1, lo=24, hi=25, seed=11)[0]
    ps = [shared + p for p in prompts(10, lo=3, hi=12, seed=3)]
    for i, p in enumerate(ps):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=p, sampling=greedy(40)))
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        assert res[f"r{i}"][0] == reference_generate(p, 40), f"r{i}"
    assert sched.stats.num_retracted > 0
    assert sched.speculator.stats()["spec_accept_rate"] > 0.9  # a cached prefix may miss one draft position


def pd_pair(prefill_spec: bool):
    port = free_port()
    common = dict(model_path="fake", disaggregation_transfer_backend="tcp", disaggregation_bootstrap_port=port,
                  chunked_prefill_size=16)
    prefill = Scheduler(ServerArgs(disaggregation_mode="prefill", **common, **(SPEC if prefill_spec else {})),
                        FakeModelRunner(), tokenizer=None, draft_runner=FakeModelRunner() if prefill_spec else None)
    decode = Scheduler(ServerArgs(disaggregation_mode="decode", **common, **SPEC), FakeModelRunner(),
                       tokenizer=None, draft_runner=FakeModelRunner())
    decode.speculator.cost.fixed_over_per_token = lambda: 1000.0
    decode.speculator._draft_round_cost = lambda: 0.0
    return prefill, decode, port


def send_pd(prefill, decode, port, ps, n):
    rng = random.Random(5)
    for i, p in enumerate(ps):
        f = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=rng.randrange(2**63))
        for s in (prefill, decode):
            s.handle(GenerateReq(rid=f"pd{i}", input_ids=p, sampling=greedy(n), **f))
    return run_pair(prefill, decode)[1]


def test_pd_the_prefill_servers_draft_kv_travels_with_the_targets():
    prefill, decode, port = pd_pair(prefill_spec=True)
    try:
        ps = prompts(4, lo=20, hi=40, seed=5)
        out = send_pd(prefill, decode, port, ps, 20)
        for i, p in enumerate(ps):
            assert out[f"pd{i}"][0] == reference_generate(p, 20), i
        assert decode.speculator.stats()["spec_accept_rate"] == 1.0  # the draft read the prompt's KV it was sent
        # nothing caught up on decode: every draft pass there ran one or two tokens per request
        assert max(tokens for tokens, _ in decode.speculator.draft.cost._passes) <= 2 * len(ps)
        assert prefill.speculator.draft.passes > 0  # the prefill server ran the draft's prefill
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_pd_a_prefill_server_without_the_draft_is_refused_with_the_reason():
    prefill, decode, port = pd_pair(prefill_spec=False)
    try:
        out = send_pd(prefill, decode, port, prompts(1, seed=2), 8)
        tokens, fin = out["pd0"]
        assert fin is not None and fin.type == "abort" and "draft_layers" in fin.message, fin
        assert "--speculative-draft-model-path" in fin.message
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_request_whose_draft_saw_nothing_catches_up_in_its_first_guess():
    sched = spec_sched(4, chunked_prefill_size=16)
    sched.speculator.after_extend = lambda batch: None  # as a decode server whose prefill ran no draft
    ps = prompts(3, lo=30, hi=50, seed=8)
    for i, p in enumerate(ps):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=p, sampling=greedy(25)))
    res = run_to_end(sched)
    for i, p in enumerate(ps):
        assert res[f"r{i}"][0] == reference_generate(p, 25), f"r{i}"
    assert sched.speculator.stats()["spec_accept_rate"] == 1.0
    assert max(tokens for tokens, _ in sched.speculator.draft.cost._passes) >= 30  # a whole prompt in one pass


def test_a_draft_of_another_vocabulary_is_refused():
    other = FakeModelRunner()
    other.model_config = FakeModelConfig(vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="vocabulary"):
        Scheduler(ServerArgs(model_path="fake", **SPEC), FakeModelRunner(), tokenizer=None, draft_runner=other)


@pytest.mark.parametrize("fields, why", [
    ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
    ({**SPEC, "speculative_num_draft_tokens": 1}, "must be >= 2"),
    ({**SPEC, "speculative_num_steps": 0}, "--speculative-num-steps must be >= 1"),
    ({**SPEC, "tp_size": 2}, "--tp 1 only"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"}, "apply to --speculative-algorithm"),
])
def test_bad_draft_flags_are_clear_errors(fields, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace("+", r"\+")):
        ServerArgs(model_path="fake", **fields).validate()


def test_guesses_follow_sglang_num_steps_and_num_draft_tokens():
    base = dict(model_path="fake", speculative_algorithm="STANDALONE", speculative_draft_model_path="d")
    assert ServerArgs(**base).speculative_guesses == 3  # num_draft_tokens 4 - 1
    assert ServerArgs(**base, speculative_num_steps=5, speculative_num_draft_tokens=6).speculative_guesses == 5
    assert ServerArgs(**base, speculative_num_steps=5, speculative_num_draft_tokens=3).speculative_guesses == 2
    assert ServerArgs(model_path="fake", speculative_algorithm="NGRAM").speculative_guesses == 4
