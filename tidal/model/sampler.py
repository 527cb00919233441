"""Batched next-token sampling for a batch of B requests with logits [B, V].

Pipeline for sampled rows: penalties -> min_new_tokens mask -> temperature -> top_k ->
top_p -> min_p -> softmax -> draw. Greedy rows (temperature below GREEDY_TEMPERATURE, or
top_k 1) take the argmax of the penalised logits.

Degenerate numbers: a penalty that overflows (0 * inf) bans the token (NaN -> -inf); a
penalised logit that becomes +inf wins (it is clamped to the largest float before the
softmax, so the softmax stays finite). A row left with no usable candidate (every
penalised logit -inf or NaN, e.g. min_new_tokens masking a vocabulary made only of stop
ids, or NaN logits from the model) takes the argmax of its raw logits, NaN counted as
-inf: never an id drawn from a NaN distribution. Everything stays on the logits' device; the only
host transfers are the per-row top-logprob lists at the very end.

Logprobs are taken from log_softmax of the *raw* logits, before penalties, masks and
temperature (vLLM's default): they describe the model, not the sampling policy.

The draw is an "exponential race": with q ~ Exp(1) i.i.d. per token,
argmax(p / q) is distributed exactly as Categorical(p). Unlike torch.multinomial
it needs no device sync, is invariant to the scale of p (masked rows need no
renormalisation before the draw), and lets seeded rows bring their own noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional, Sequence

import torch

from tidal.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_NEG_INF = -math.inf
# Repetition penalties in this range cannot overflow float32 for logits below 1e29 even at
# temperature 1e-5 (1e29 * 1e4 * 1e5 < 3.4e38); outside it the penalised logits are sanitised.
_SAFE_REPETITION = (1e-4, 1e4)


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a well-spread 64-bit generator seed per draw."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _flat_token_index(id_lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Flat indices row * V + id into a [len(id_lists), V] matrix (CPU, int64).

    Ids outside [0, V) are dropped (e.g. tokenizer-only ids beyond the logits vocab).
    """
    lens = torch.tensor([len(x) for x in id_lists], dtype=torch.int64)
    ids = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(id_lists), dtype=torch.int64), lens)
    valid = (ids >= 0) & (ids < vocab_size)
    return (rows * vocab_size + ids)[valid]


def _token_counts(id_lists: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """[len(id_lists), V] float32 occurrence counts, built with one scatter_add."""
    counts = torch.zeros(len(id_lists) * vocab_size, dtype=torch.float32)
    flat = _flat_token_index(id_lists, vocab_size)
    counts.scatter_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32))
    return counts.view(len(id_lists), vocab_size).to(device)


@dataclass
class PenaltyInfo:
    """Penalties for the P rows that have any; other rows are untouched."""

    rows: Optional[torch.Tensor]  # [P] int64 row indices in the batch; None = all rows
    repetition: Optional[torch.Tensor]  # [P, 1] float32, or None if all 1.0
    seen_mask: Optional[torch.Tensor]  # [P, V] bool, token in prompt + output
    frequency: Optional[torch.Tensor]  # [P, 1] float32, or None if no freq/presence
    presence: Optional[torch.Tensor]  # [P, 1] float32
    output_counts: Optional[torch.Tensor]  # [P, V] float32, counts in output only
    extreme: bool = False  # a repetition penalty outside _SAFE_REPETITION: NaN / inf possible

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [B, V]."""
        sub = logits if self.rows is None else logits.index_select(0, self.rows)
        if self.repetition is not None:
            # HF: positive logits are divided by the penalty, negative multiplied.
            penalised = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
            sub = torch.where(self.seen_mask, penalised, sub)
        if self.frequency is not None:
            # OpenAI: subtract freq * count + presence * (count > 0), output tokens only.
            sub = sub - self.frequency * self.output_counts
            sub = sub - self.presence * (self.output_counts > 0).to(sub.dtype)
        if self.extreme:
            sub = sub.nan_to_num(nan=_NEG_INF, posinf=math.inf, neginf=_NEG_INF)  # 0 * inf: banned
        if self.rows is None:
            logits.copy_(sub)
        else:
            logits.index_copy_(0, self.rows, sub)


def _build_penalties(
    params: list[SamplingParams],
    output_ids: list[list[int]],
    prompt_ids: list[list[int]],
    vocab_size: int,
    device,
) -> Optional[PenaltyInfo]:
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return None
    ps = [params[i] for i in rows]
    outs = [output_ids[i] for i in rows]
    col = lambda v: torch.tensor(v, dtype=torch.float32, device=device).unsqueeze(1)  # noqa: E731
    out_counts = _token_counts(outs, vocab_size, device)
    rep = seen = freq = pres = None
    if any(p.repetition_penalty != 1.0 for p in ps):
        rep = col([p.repetition_penalty for p in ps])
        prompt_counts = _token_counts([prompt_ids[i] for i in rows], vocab_size, device)
        seen = (out_counts > 0) | (prompt_counts > 0)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in ps):
        freq = col([p.frequency_penalty for p in ps])
        pres = col([p.presence_penalty for p in ps])
    return PenaltyInfo(
        rows=None if len(rows) == len(params) else torch.tensor(rows, device=device),
        repetition=rep,
        seen_mask=seen,
        frequency=freq,
        presence=pres,
        output_counts=out_counts if freq is not None else None,
        extreme=any(not _SAFE_REPETITION[0] <= p.repetition_penalty <= _SAFE_REPETITION[1] for p in ps),
    )


def _build_min_tokens_mask(
    params: list[SamplingParams],
    output_ids: list[list[int]],
    vocab_size: int,
    device,
    eos_token_ids: Sequence[int],
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(rows, cols) to set to -inf: EOS and stop ids of rows still under min_new_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if len(output_ids[i]) >= p.min_new_tokens:
            continue
        banned = {t for t in chain(eos_token_ids, p.stop_token_ids) if 0 <= t < vocab_size}
        rows.extend([i] * len(banned))
        cols.extend(banned)
    if not rows:
        return None
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_t(rows), as_t(cols)


def _make_generators(
    params: list[SamplingParams], output_ids: list[list[int]], greedy: list[bool], device
) -> tuple[list[int], list[torch.Generator]]:
    """A generator per seeded sampled row, seeded from (seed, tokens generated so far)."""
    rows, gens = [], []
    for i, p in enumerate(params):
        if p.seed is not None and not greedy[i]:
            g = torch.Generator(device=device)
            g.manual_seed(_mix_seed(p.seed, len(output_ids[i])))
            rows.append(i)
            gens.append(g)
    return rows, gens


@dataclass
class SamplingBatchInfo:
    """Per-row sampling state for one batch, as device tensors plus host-side flags."""

    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32 (1.0 for greedy rows, never 0)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, V when disabled
    min_ps: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    filter_width: int  # candidates the filters look at: max top_k if every sampled row has one
    penalties: Optional[PenaltyInfo]
    min_tokens_mask: Optional[tuple[torch.Tensor, torch.Tensor]]  # (rows, cols)
    seeded_rows: list[int]  # sampled rows with a per-request seed
    generators: list[torch.Generator]  # one per seeded row, same order
    # grammar-constrained rows: (rows [G] int64, allowed [G, V] bool), set right before sampling
    allowed_tokens: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]],
        vocab_size: int,
        device,
        eos_token_ids: Sequence[int] = (),
    ) -> "SamplingBatchInfo":
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
        seeded_rows, generators = _make_generators(params, output_ids, greedy, device)
        sampled = [p for p, g in zip(params, greedy) if not g]
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        return cls(
            vocab_size=vocab_size,
            temperatures=f32(temperatures).unsqueeze(1),
            top_ps=f32([p.top_p for p in params]),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=f32([p.min_p for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            filter_width=max((k for k, g in zip(top_ks, greedy) if not g), default=vocab_size),
            penalties=_build_penalties(params, output_ids, prompt_ids, vocab_size, device),
            min_tokens_mask=_build_min_tokens_mask(
                params, output_ids, vocab_size, device, eos_token_ids
            ),
            seeded_rows=seeded_rows,
            generators=generators,
        )

    @property
    def needs_filter(self) -> bool:
        return self.need_top_k or self.need_top_p or self.need_min_p


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64, on the logits' device
    next_token_logprobs: Optional[torch.Tensor]  # [B] float32, raw log_softmax; None if not asked
    # per row: (logprob, token id), best first; [] where 0 were asked; None if not asked
    top_logprobs: Optional[list[list[tuple[float, int]]]]
    # constrained rows whose grammar refused the token / can take nothing but EOS after it
    grammar_refused: list[int] = field(default_factory=list)
    grammar_done: list[int] = field(default_factory=list)


def _candidates(probs: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, token ids) [B, W], best first, sorted once.

    When every sampled row has a top_k, only the best W = max(top_k) tokens can
    survive, so topk replaces the full sort and all later work is [B, W].
    """
    if info.filter_width < probs.shape[-1]:
        return probs.topk(info.filter_width, dim=-1)
    return probs.sort(dim=-1, descending=True, stable=True)


def _filter_sorted(sorted_p: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the candidates (sorted best first) cut by top_k -> top_p -> min_p."""
    ranks = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
    keep = ranks.unsqueeze(0) < info.top_ks.unsqueeze(1)
    if info.need_top_p:
        # top_p is measured on the top-k renormalised distribution; the token that
        # crosses the threshold is kept, so the first token always survives.
        p = sorted_p.masked_fill(~keep, 0.0)
        p = p / p.sum(dim=-1, keepdim=True)
        before = p.cumsum(dim=-1) - p
        top_ps = info.top_ps.unsqueeze(1)
        keep &= (before < top_ps) | (top_ps >= 1.0)
    if info.need_min_p:
        # Relative to the most likely token: invariant to renormalisation.
        keep &= sorted_p >= info.min_ps.unsqueeze(1) * sorted_p[:, :1]
    # No renormalisation needed: the exponential race ignores each row's scale.
    return sorted_p.masked_fill(~keep, 0.0)


def _race(
    probs: torch.Tensor,
    info: SamplingBatchInfo,
    vocab: int,
    token_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Column index of argmax(probs / q), q ~ Exp(1): one Categorical(probs) draw per row.

    Unseeded rows share one global-RNG call. A seeded row draws noise for the whole
    vocab from its own generator, indexed by token id (token_ids [B, W] maps the
    columns of probs to ids; None means columns are ids), so its draw depends only
    on its own distribution, not on batch neighbours or on how candidates were cut.
    """
    q = torch.empty_like(probs).exponential_()
    for row, gen in zip(info.seeded_rows, info.generators):
        noise = torch.empty(vocab, device=probs.device).exponential_(generator=gen)
        q[row] = noise if token_ids is None else noise[token_ids[row]]
    return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def _sample_rows(logits: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from the temperature/top-k/top-p/min-p distribution.

    Returns (token ids [B], usable [B] bool): a row is unusable when its drawn
    probability is 0 or NaN (no finite candidate was left).
    """
    scaled = logits / info.temperatures
    if info.penalties is not None and info.penalties.extreme:  # a penalised +inf wins, finitely
        scaled = scaled.nan_to_num_(nan=_NEG_INF, posinf=torch.finfo(scaled.dtype).max, neginf=_NEG_INF)
    probs = torch.softmax(scaled, dim=-1)
    if not info.needs_filter:
        pick = _race(probs, info, probs.shape[-1])
        return pick, _drawn_prob(probs, pick) > 0
    sorted_p, token_ids = _candidates(probs, info)
    filtered = _filter_sorted(sorted_p, info)
    pick = _race(filtered, info, probs.shape[-1], token_ids)
    return token_ids.gather(1, pick.unsqueeze(1)).squeeze(1), _drawn_prob(filtered, pick) > 0


def _drawn_prob(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    return values.gather(1, cols.unsqueeze(1)).squeeze(1)


def _raw_argmax_where_unusable(ids: torch.Tensor, usable: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Rows that had no usable candidate take the argmax of their raw logits (NaN as -inf).

    Host sync on `usable.all()`: the caller reads the ids on the host right after anyway.
    """
    if bool(usable.all()):
        return ids
    bad = (~usable).nonzero().squeeze(1)
    ids = ids.clone()
    ids[bad] = raw.index_select(0, bad).nan_to_num(nan=_NEG_INF).argmax(dim=-1)
    return ids


def _top_logprobs(logprobs: torch.Tensor, nums: Sequence[int]) -> list[list[tuple[float, int]]]:
    k = min(max(nums, default=0), logprobs.shape[-1])
    if k <= 0:
        return [[] for _ in nums]
    vals, idx = logprobs.topk(k, dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    return [list(zip(vals[i][:n], idx[i][:n])) for i, n in enumerate(nums)]


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        top_logprobs_nums: Optional[list[int]] = None,
        return_logprob: bool = False,
    ) -> SampleOutput:
        """logits [B, V] float32 (not modified). Logprobs come from the raw logits.

        A row left with no usable candidate falls back to the argmax of its grammar-masked
        logits (the raw ones when it has no grammar), so a constrained row stays in its grammar."""
        allowed = self._constrain(logits, info)
        penalised = self._penalise(allowed, info)
        if info.all_greedy:
            next_ids = penalised.argmax(dim=-1)
            if penalised is not allowed:  # else nothing to fall back to
                next_ids = _raw_argmax_where_unusable(next_ids, _drawn_prob(penalised, next_ids) > _NEG_INF, allowed)
        else:
            next_ids, usable = _sample_rows(penalised, info)
            if info.any_greedy:
                greedy_ids = penalised.argmax(dim=-1)
                next_ids = torch.where(info.is_greedy, greedy_ids, next_ids)
                usable = torch.where(info.is_greedy, _drawn_prob(penalised, greedy_ids) > _NEG_INF, usable)
            next_ids = _raw_argmax_where_unusable(next_ids, usable, allowed)
        if not return_logprob:
            return SampleOutput(next_ids, None, None)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token_lp = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        nums = top_logprobs_nums if top_logprobs_nums is not None else [0] * logits.shape[0]
        return SampleOutput(next_ids, token_lp, _top_logprobs(logprobs, nums))

    @staticmethod
    def _penalise(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Penalties and the min_new_tokens mask, on a copy only when there are any."""
        if info.penalties is None and info.min_tokens_mask is None:
            return logits
        out = logits.clone()
        if info.penalties is not None:
            info.penalties.apply(out)
        if info.min_tokens_mask is not None:
            out.index_put_(info.min_tokens_mask, torch.tensor(float("-inf"), device=out.device))
        return out

    @staticmethod
    def _constrain(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Grammar masks (tokens the grammar forbids -> -inf), on a copy only when there are any."""
        if info.allowed_tokens is None:
            return logits
        rows, allowed = info.allowed_tokens
        out = logits.clone()
        out.index_copy_(0, rows, out.index_select(0, rows).masked_fill_(~allowed, _NEG_INF))
        return out


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, top_k: int = 0
) -> tuple[list[float], Optional[list[list[tuple[float, int]]]]]:
    """Input-token logprobs: row i of logits [N, V] predicts target_ids[i].

    Returns (logprob of each target, top_k (logprob, id) per row or None if top_k <= 0).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = logprobs.gather(1, target_ids.to(logprobs.device, torch.int64).unsqueeze(1))
    tops = _top_logprobs(logprobs, [top_k] * logits.shape[0]) if top_k > 0 else None
    return target.squeeze(1).tolist(), tops
