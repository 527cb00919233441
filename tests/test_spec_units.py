"""Speculative decoding's parts: prompt-lookup proposals, which guesses a verification
keeps, and that keeping them preserves the target's sampling distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.model.sampler import Sampler, SamplingBatchInfo
from tidal.sampling_params import SamplingParams
from tidal.spec.ngram import NgramProposer
from tidal.spec.verify import accepted, row_outputs


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(4, min_window=1, max_window=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], limit=10) == [4, 5, 1, 2]
    assert p.propose([7, 1, 2, 9, 3, 1, 2], limit=10) == [9, 3, 1, 2]  # the 2-gram [1, 2] beats a later 1-gram
    assert p.propose([1, 5, 2, 1, 6, 1], limit=10) == [6, 1]  # the latest earlier [1] wins
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], limit=2) == [4, 5]
    assert p.propose([1, 2, 3], limit=10) == [] and p.propose([1, 2, 3, 1], limit=0) == []
    assert NgramProposer(4, min_window=2).propose([1, 2, 3, 1], limit=4) == []  # a 1-gram is too short
    with pytest.raises(ValueError):
        NgramProposer(0)


def test_accepted_keeps_guesses_up_to_the_first_disagreement():
    assert accepted([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]  # all kept, plus the token after them
    assert accepted([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accepted([1, 2], [9, 2, 3]) == [9]
    assert accepted([], [7]) == [7]


def test_rows_see_the_outputs_before_them():
    class R:
        output_ids = [5, 6]

    assert row_outputs([R(), R()], [[1, 2], []]) == [[5, 6], [5, 6, 1], [5, 6, 1, 2], [5, 6]]


def _verify_many(logits: torch.Tensor, draft: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    """n verifications of one request: every row sampled by the target's own sampler, as the scheduler does."""
    sampler, rows = Sampler(), logits.shape[0]
    outs = []
    for _ in range(n):
        info = SamplingBatchInfo.build([params] * rows, [[0] * j for j in range(rows)], [[0]] * rows,
                                       logits.shape[1], "cpu")
        sampled = sampler.sample(logits, info).next_token_ids.tolist()
        outs.append(accepted(draft, sampled))
    return outs


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["t1", "t0.7_top_p0.9"])
def test_kept_tokens_follow_the_target_distribution(params):
    """On a 6-token vocabulary: the first emitted token is distributed as the target's row 0,
    and the second (emitted only when the first guess was kept) as row 1."""
    torch.manual_seed(0)
    vocab, draft = 6, [2, 4]
    logits = torch.tensor([[0.5, 1.0, 1.5, 0.0, -1.0, 0.2],
                           [1.2, 0.1, 0.3, 0.0, 0.9, -0.5],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n = 4000
    outs = _verify_many(logits, draft, params, n)
    target = [_target_probs(logits[j], params) for j in range(2)]
    first = np.bincount([o[0] for o in outs], minlength=vocab)
    assert _chi2(first, target[0]) < 25.0  # 5 degrees of freedom: p < 1e-4 by chance
    second = np.bincount([o[1] for o in outs if o[0] == draft[0]], minlength=vocab)
    assert second.sum() > 500 and _chi2(second, target[1]) < 25.0
    kept = sum(o[0] == draft[0] for o in outs) / n
    assert abs(kept - target[0][draft[0]]) < 0.05  # a guess is kept with the target's probability of it


def _target_probs(row: torch.Tensor, params: SamplingParams) -> np.ndarray:
    p = torch.softmax(row / params.temperature, dim=-1)
    if params.top_p < 1.0:
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]
        cut = order[before >= params.top_p]
        p[cut] = 0
        p = p / p.sum()
    return p.numpy()


def test_greedy_verification_is_the_argmax_chain():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    (out,) = _verify_many(logits, [1, 0], SamplingParams(temperature=0.0), 1)
    assert out == [1, 0, 2]
    (out,) = _verify_many(logits, [1, 2], SamplingParams(temperature=0.0), 1)
    assert out == [1, 0]


def test_guesses_are_made_only_where_they_pay():
    from types import SimpleNamespace

    from tidal.spec.speculator import EXPLORE_EVERY, Speculator

    args = SimpleNamespace(speculative_guesses=4, speculative_ngram_min_match_window_size=1,
                           speculative_ngram_max_match_window_size=12)
    spec = Speculator(args, 4096)
    spec.cost.fixed_over_per_token = lambda: 4.0

    def req(kept: float, refused: float, idle: int = 0):
        return SimpleNamespace(spec_kept=kept, spec_refused=refused, spec_idle=idle)

    good = [req(9, 1)]  # 0.9 of its guesses kept: all four pay alone in a pass
    assert spec._worth_it(good, [[1, 2, 3, 4]]) == [[1, 2, 3, 4]]
    coin = [req(1, 1) for _ in range(8)]  # a coin flip per guess does not pay beside 7 others
    assert spec._worth_it(coin, [[1, 2]] * 8) == [[]] * 8
    stale = [req(1, 1, idle=EXPLORE_EVERY) for _ in range(8)]  # ... unless its record is stale: one guess each
    assert spec._worth_it(stale, [[1, 2]] * 8) == [[1]] * 8
    assert all(r.spec_idle == 0 for r in stale) and all(r.spec_idle == 1 for r in coin)
