"""Tests for tidal.model.sampler (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.model.sampler import Sampler, SamplingBatchInfo, compute_prompt_logprobs
from tidal.sampling_params import SamplingParams

V = 8
EOS = 7


def build(params, output_ids=None, prompt_ids=None, vocab_size=V, eos=(EOS,)):
    b = len(params)
    output_ids = output_ids if output_ids is not None else [[] for _ in range(b)]
    prompt_ids = prompt_ids if prompt_ids is not None else [[] for _ in range(b)]
    return SamplingBatchInfo.build(params, output_ids, prompt_ids, vocab_size, "cpu", list(eos))


def sample(logits, params, **kw):
    build_keys = ("output_ids", "prompt_ids", "eos")
    info = build(params, **{k: v for k, v in kw.items() if k in build_keys})
    extra = {k: v for k, v in kw.items() if k not in build_keys}
    return Sampler().sample(logits, info, **extra)


def repeat_row(probs: list[float], n: int) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0).repeat(n, 1)


def histogram(ids: torch.Tensor, v: int = V) -> torch.Tensor:
    return torch.bincount(ids, minlength=v).float() / ids.numel()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def test_greedy_equals_argmax_and_fast_path():
    logits = torch.randn(5, V)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=1)] * 2
    info = build(params)
    assert info.all_greedy
    out = Sampler().sample(logits, info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids.dtype == torch.int64
    assert out.next_token_logprobs is None and out.top_logprobs is None


def test_all_greedy_fast_path_skips_sampling(monkeypatch):
    import tidal.model.sampler as mod

    def boom(*a, **k):
        raise AssertionError("sampling path used for an all-greedy batch")

    monkeypatch.setattr(mod, "_sample_rows", boom)
    logits = torch.randn(4, V)
    out = Sampler().sample(logits, build([SamplingParams(temperature=0.0)] * 4))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_top_k_1_equals_greedy_even_with_high_temperature():
    logits = torch.randn(64, V)
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=1)] * 64)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_temperature_one_matches_distribution_and_low_temperature_sharpens():
    probs = [0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]
    n = 4000
    logits = repeat_row(probs, n)
    h1 = histogram(sample(logits, [SamplingParams(temperature=1.0)] * n).next_token_ids)
    assert torch.allclose(h1[:4], torch.tensor(probs[:4]), atol=0.03)
    h_low = histogram(sample(logits, [SamplingParams(temperature=0.3)] * n).next_token_ids)
    # p ** (1/0.3) renormalised: token 0 gets ~0.70
    expected = torch.tensor(probs[:4]) ** (1 / 0.3)
    expected /= expected.sum()
    assert torch.allclose(h_low[:4], expected, atol=0.03)
    assert h_low[0] > h1[0] + 0.2


def test_top_p_keeps_only_nucleus():
    probs = [0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]
    n = 4000
    logits = repeat_row([p + 1e-12 for p in probs], n)
    # top_p=0.7: 0.5 < 0.7, 0.5+0.3 crosses -> keep {0, 1}
    ids = sample(logits, [SamplingParams(top_p=0.7)] * n).next_token_ids
    assert set(ids.tolist()) == {0, 1}
    h = histogram(ids)
    assert abs(h[0].item() - 0.5 / 0.8) < 0.03
    # top_p=0.5 exactly: first token alone reaches it
    ids = sample(logits[:500], [SamplingParams(top_p=0.5)] * 500).next_token_ids
    assert set(ids.tolist()) == {0}


def test_top_k_restricts_support():
    n = 3000
    logits = repeat_row([1 / V] * V, n) + torch.arange(V).float() * 1e-3  # top 3: 7, 6, 5
    ids = sample(logits, [SamplingParams(top_k=3)] * n).next_token_ids
    assert set(ids.tolist()) == {5, 6, 7}


def test_mixed_filters_per_row():
    """Rows with different top_k / top_p / none share one batch; each keeps its own support."""
    n = 1500
    logits = repeat_row([1 / V] * V, 3 * n) + torch.arange(V).float() * 1e-3  # order 7 > 6 > ...
    params = [SamplingParams(top_k=2)] * n + [SamplingParams(top_k=5, top_p=0.3)] * n
    params += [SamplingParams()] * n
    ids = sample(logits, params).next_token_ids
    assert set(ids[:n].tolist()) == {6, 7}
    assert set(ids[n : 2 * n].tolist()) == {6, 7}  # top_p 0.3 of 5 ~equal tokens -> 2
    assert set(ids[2 * n :].tolist()) == set(range(V))
    # every sampled row has a top_k: the filters rank only max(top_k) candidates
    assert build(params[: 2 * n]).filter_width == 5


def test_min_p():
    probs = [0.5, 0.2, 0.1, 0.09, 0.06, 0.05, 0, 0]
    n = 4000
    logits = repeat_row([p + 1e-12 for p in probs], n)
    # threshold 0.15 * 0.5 = 0.075 -> keep {0, 1, 2, 3}
    ids = sample(logits, [SamplingParams(min_p=0.15)] * n).next_token_ids
    assert set(ids.tolist()) == {0, 1, 2, 3}
    h = histogram(ids)
    assert abs(h[0].item() - 0.5 / 0.89) < 0.03


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 0.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    info = build([p], output_ids=[[1]], prompt_ids=[[0, 0]])
    out = Sampler._penalise(logits, info)
    expected = torch.tensor([[1.0, -4.0, 2.0, -2.0, 1.0, 0.0, 0.0, 0.0]])
    assert torch.equal(out, expected)
    assert logits[0, 0] == 2.0  # input untouched


def test_frequency_and_presence_penalties_openai_semantics():
    logits = torch.zeros(2, V)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # no penalties: row untouched
    ]
    info = build(params, output_ids=[[3, 3, 3, 4], [3]], prompt_ids=[[5, 5], [1]])
    out = Sampler._penalise(logits, info)
    expected = torch.zeros(2, V)
    expected[0, 3] = -(0.5 * 3 + 0.25)
    expected[0, 4] = -(0.5 * 1 + 0.25)
    assert torch.allclose(out, expected)  # prompt token 5 not penalised


def test_all_penalties_combined():
    logits = torch.tensor([[3.0, -1.0, 0.5, 0, 0, 0, 0, 0]])
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    info = build([p], output_ids=[[0, 0]], prompt_ids=[[1]])
    out = Sampler._penalise(logits, info)
    assert math.isclose(out[0, 0].item(), 3.0 / 1.5 - 2.0 - 0.5, abs_tol=1e-6)
    assert math.isclose(out[0, 1].item(), -1.5, abs_tol=1e-6)
    assert out[0, 2].item() == 0.5


def test_penalties_on_subset_of_rows_match_single_row():
    logits = torch.randn(3, V)
    p = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=-0.4)
    outs, prompts = [[1, 1, 2], [], [5]], [[3], [4], [0, 6]]
    batch = Sampler._penalise(logits, build([SamplingParams(), p, p], outs, prompts))
    for i in (1, 2):
        alone = Sampler._penalise(logits[i : i + 1], build([p], [outs[i]], [prompts[i]]))
        assert torch.equal(batch[i], alone[0])
    assert torch.equal(batch[0], logits[0])


def test_penalty_rows_ignore_out_of_vocab_ids():
    info = build([SamplingParams(frequency_penalty=1.0)], output_ids=[[2, V + 5, -1]])
    out = Sampler._penalise(torch.zeros(1, V), info)
    assert out[0, 2] == -1.0 and out.sum() == -1.0


def test_min_new_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    logits[:, 2] = 9.0
    logits[:, 1] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[2]),
        SamplingParams(temperature=0.0, min_new_tokens=3),
        SamplingParams(temperature=0.0, min_new_tokens=3),
    ]
    out = sample(logits, params, output_ids=[[0], [0], [0, 0, 0]])
    assert out.next_token_ids.tolist() == [1, 2, EOS]


@pytest.mark.parametrize(
    "seeded",
    [SamplingParams(temperature=1.0, seed=42), SamplingParams(top_k=5, top_p=0.9, seed=3)],
)
def test_per_request_seed_reproducible_across_batches(seeded):
    n_other = 6
    logits_row = torch.randn(V)

    def draw(position: int, neighbours: list[SamplingParams], n_generated: int) -> int:
        params = list(neighbours)
        params.insert(position, seeded)
        outs = [[0] * 3 for _ in params]
        outs[position] = [1] * n_generated
        logits = torch.randn(len(params), V)
        logits[position] = logits_row
        return sample(logits, params, output_ids=outs).next_token_ids[position].item()

    neigh_a = [SamplingParams(temperature=0.7)] * n_other
    neigh_b = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, seed=7)]
    seq_a = [draw(0, neigh_a, step) for step in range(20)]
    torch.manual_seed(999)  # different global RNG state must not matter
    seq_b = [draw(2, neigh_b, step) for step in range(20)]
    seq_c = [draw(0, [], step) for step in range(20)]
    seq_d = [draw(1, [SamplingParams(top_k=3)] * 2, step) for step in range(20)]
    assert seq_a == seq_b == seq_c == seq_d
    assert len(set(seq_a)) > 1  # noise depends on the step


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    infos = [build([SamplingParams(seed=s)], vocab_size=1000) for s in range(10)]
    draws = {Sampler().sample(logits, info).next_token_ids.item() for info in infos}
    assert len(draws) > 5


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0)]
    params += [SamplingParams(temperature=0.5, repetition_penalty=1.3)]
    params += [SamplingParams(top_k=2), SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    out = sample(
        logits, params, output_ids=[[1], [2], [3], [4]],
        top_logprobs_nums=[0, 3, 1, V + 4], return_logprob=True,
    )
    ref = torch.log_softmax(logits, -1)
    expected = ref.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    assert out.next_token_logprobs.dtype == torch.float32
    assert torch.allclose(out.next_token_logprobs, expected)
    tops = out.top_logprobs
    assert [len(t) for t in tops] == [0, 3, 1, V]
    for i, row in enumerate(tops):
        vals = [lp for lp, _ in row]
        assert vals == sorted(vals, reverse=True)
        for lp, tok in row:
            assert isinstance(tok, int) and math.isclose(lp, ref[i, tok].item(), abs_tol=1e-6)
    assert tops[1][0][1] == logits[1].argmax().item()


def test_top_logprobs_all_zero_gives_empty_lists():
    params = [SamplingParams()] * 2
    out = sample(torch.randn(2, V), params, top_logprobs_nums=[0, 0], return_logprob=True)
    assert out.top_logprobs == [[], []]
    assert out.next_token_logprobs.shape == (2,)


def test_mixed_greedy_and_sampled_rows():
    n = 200
    logits = torch.zeros(n, V)
    logits[:, 3] = 5.0
    logits[:, 6] = 5.0 - 1e-3
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0)
              for i in range(n)]
    ids = sample(logits, params).next_token_ids
    assert (ids[0::2] == 3).all()
    sampled = ids[1::2]
    assert (sampled == 6).any() and (sampled == 3).any()


def test_greedy_row_uses_penalised_logits_in_mixed_batch():
    logits = torch.zeros(2, V)
    logits[:, 3] = 1.0
    logits[:, 5] = 0.9
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(top_k=2)]
    ids = sample(logits, params, output_ids=[[3], []]).next_token_ids
    assert ids[0].item() == 5
    assert ids[1].item() in (3, 5)


def test_compute_prompt_logprobs():
    logits = torch.randn(5, V)
    targets = torch.tensor([1, 0, 7, 3, 3])
    lps, tops = compute_prompt_logprobs(logits, targets, top_k=2)
    ref = torch.log_softmax(logits, -1)
    assert lps == pytest.approx(ref[torch.arange(5), targets].tolist(), abs=1e-6)
    assert len(tops) == 5 and all(len(r) == 2 and r[0][0] >= r[1][0] for r in tops)
    assert tops[0][0][1] == logits[0].argmax().item()
    lps2, tops2 = compute_prompt_logprobs(logits, targets, top_k=0)
    assert tops2 is None and lps2 == lps


# ---------------------------------------------------------------- degenerate numbers


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 9e-6])
def test_tiny_temperature_is_greedy(temperature):
    logits = torch.randn(64, 1000) * 5  # gaps / temperature overflow float32
    out = sample(logits, [SamplingParams(temperature=temperature, seed=s) for s in range(64)],
                 prompt_ids=[[1]] * 64).next_token_ids
    assert torch.equal(out, logits.argmax(-1))
    mixed = [SamplingParams(temperature=temperature), SamplingParams(temperature=1.0)] * 32
    assert torch.equal(sample(logits, mixed).next_token_ids[0::2], logits[0::2].argmax(-1))


EXTREME_PENALTIES = [
    SamplingParams(temperature=0.7, repetition_penalty=1e-300),  # float32 0: x / 0 = inf
    SamplingParams(temperature=0.7, repetition_penalty=1e300),  # float32 inf: 0 * inf = NaN
    SamplingParams(temperature=0.7, repetition_penalty=3e38, frequency_penalty=2.0, presence_penalty=2.0),
    SamplingParams(temperature=1e-5, repetition_penalty=1e-30, frequency_penalty=-2.0, presence_penalty=-2.0),
    SamplingParams(temperature=0.0, repetition_penalty=1e300),
]


@pytest.mark.parametrize("p", EXTREME_PENALTIES)
def test_extreme_penalties_give_no_nan_and_sane_ids(p):
    logits = torch.randn(4, V) * 3
    logits[:, 2] = 0.0  # a seen token at exactly 0: 0 * inf
    outs, prompts = [[2, 3, 3], [2], [0, 1, 2, 4, 5], [2, 6]], [[2], [1, 2], [3], [7]]
    info = build([p] * 4, outs, prompts)
    penalised = Sampler._penalise(logits, info)
    assert not penalised.isnan().any()
    for _ in range(20):
        ids = Sampler().sample(logits, info).next_token_ids
        assert ((ids >= 0) & (ids < V)).all()
        assert torch.isfinite(logits.gather(1, ids.unsqueeze(1))).all()
        assert (penalised.gather(1, ids.unsqueeze(1)).squeeze(1) > -math.inf).all()


def test_tiny_repetition_penalty_makes_the_seen_positive_token_win():
    logits = torch.tensor([[1.0, 5.0, -1.0, 0, 0, 0, 0, 0]])
    p = SamplingParams(temperature=0.7, repetition_penalty=1e-300)
    for _ in range(20):  # token 0: 1.0 / 0 = +inf beats everything, sampled or not
        assert sample(logits, [p], output_ids=[[0]]).next_token_ids.item() == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_row_without_usable_candidate_falls_back_to_raw_argmax(temperature):
    # min_new_tokens masks EOS and every stop id: here, the whole vocabulary
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=temperature, min_new_tokens=5, stop_token_ids=list(range(V))),
              SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_k=3)]
    for _ in range(20):
        ids = sample(logits, params).next_token_ids
        assert ids[0].item() == logits[0].argmax().item()


@pytest.mark.parametrize("params", [[SamplingParams(temperature=1.0)] * 3,
                                    [SamplingParams(temperature=1.0, top_p=0.9)] * 3,
                                    [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0),
                                     SamplingParams(temperature=0.5, repetition_penalty=1.2)]])
def test_no_id_from_a_nan_or_inf_row(params):
    logits = torch.randn(3, V)
    logits[0] = float("nan")
    logits[1, 4] = float("nan")  # one NaN makes the whole softmax NaN
    logits[1, 5] = 9.0
    logits[2] = -math.inf
    logits[2, 6] = float("nan")
    for _ in range(20):
        ids = sample(logits, params, output_ids=[[1], [1], [1]]).next_token_ids
        assert ids[1].item() == 5  # the finite argmax, NaN counted as -inf
        assert ((ids >= 0) & (ids < V)).all()
