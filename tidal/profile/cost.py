"""CostModel: a profile's measured points as functions the planner and the simulator call.

Every function interpolates piecewise-linearly between measured points and extrapolates the
end segment linearly past either end; results are never below zero. Repeated points (the
same x measured twice) are averaged.

A prefill step of several prompts pays once what a step pays whatever its prompts (the
shared part) and each prompt's own work, attention included, per prompt. The batch points give
the shared part: k prompts of n tokens in T seconds against f(n) alone share
s(n) = (k f(n) - T) / (k - 1), piecewise-linear in n; a step of lengths l_1..l_k then costs
sum f(l_i) - (k - 1) s(mean l), which reproduces every measured batch point of a length
measured at one batch size. A profile without batch points costs a step as one prompt of
the total length (what it measured is a lone prompt).

Decode is 2-D. Points are grouped into rows by batch size; within a row the step time is
piecewise-linear in context_tokens (each row has its own measured contexts, since the
total context grows with the batch). Between rows it is linear in the batch size, each row
evaluated at the asked context first: bilinear on the measured grid. A cost of the form
a + b*batch + c*context_tokens is reproduced exactly, inside and outside the grid.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional, Sequence

from tidal.cpus import cpu_flags, simd_flags
from tidal.profile.schema import MODES, Profile, load_profile, profile_from_dict


def _averaged(points: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """(xs sorted and distinct, ys) with the ys of equal xs averaged."""
    by_x: dict[float, list[float]] = defaultdict(list)
    for x, y in points:
        by_x[x].append(y)
    xs = sorted(by_x)
    return xs, [statistics.fmean(by_x[x]) for x in xs]


def segment(xs: Sequence[float], x: float) -> int:
    """The index of the segment of sorted `xs` (at least two) that holds x, the end ones past the ends."""
    return min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)


def piecewise_linear(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The polyline through (xs, ys) at x, its end segments continued past the ends; unclamped.
    One point: that value everywhere."""
    if len(xs) == 1:
        return ys[0]
    i = segment(xs, x)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# results remembered per function (a pure function of its arguments: the points never change after construction);
# the planner asks the same few hundred (batch, context) steps of one traffic for every layout it predicts
MEMO_SIZE = 1 << 16


def _memo(memo: dict, key: Any, compute: Callable[[], float]) -> float:
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= MEMO_SIZE:
            memo.clear()
        hit = memo[key] = compute()
    return hit


class CostModel:
    """Seconds per unit of work on the profiled server (see docs/elasticity.md, "Profile")."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._prefill_memo: dict[int, float] = {}
        self._shared_memo: dict[float, float] = {}
        self._decode_memo: dict[tuple[float, float], float] = {}
        self._prefill = _averaged((p.tokens, p.seconds) for p in profile.prefill)
        self._prefill_shared = _averaged(
            (p.tokens, (p.batch * self.prefill_seconds(p.tokens) - p.seconds) / (p.batch - 1))
            for p in profile.prefill_batch)
        self._transfer = _averaged((p.tokens, p.seconds) for p in profile.kv_transfer)
        rows: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for p in profile.decode:
            rows[p.batch].append((p.context_tokens, p.step_seconds))
        self._batches = sorted(rows)
        self._decode_rows = [_averaged(rows[b]) for b in self._batches]
        switches: dict[tuple[str, str], list[float]] = defaultdict(list)
        for s in profile.switch:
            switches[(s.src, s.dst)].append(s.seconds)
        self._switch = {k: statistics.fmean(v) for k, v in switches.items() if k[0] != k[1]}

    @classmethod
    def from_file(cls, path: str) -> "CostModel":
        return cls(load_profile(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        return cls(profile_from_dict(d))

    def prefill_seconds(self, tokens: int) -> float:
        """One prompt of `tokens` new (uncached) tokens, alone in its batch; 0 for none."""
        if tokens <= 0:
            return 0.0
        return _memo(self._prefill_memo, tokens, lambda: max(0.0, piecewise_linear(*self._prefill, tokens)))

    def prefill_step_seconds(self, lengths: Sequence[int]) -> float:
        """One prefill step over prompts of these new (uncached) token counts; 0 for none."""
        lens = [n for n in lengths if n > 0]
        if len(lens) <= 1 or not self.has_prefill_batches:
            return self.prefill_seconds(sum(lens))
        alone = [self.prefill_seconds(n) for n in lens]
        shared = min(self.prefill_shared_seconds(statistics.fmean(lens)), min(alone))
        return sum(alone) - (len(lens) - 1) * shared

    @property
    def has_prefill_batches(self) -> bool:
        return bool(self._prefill_shared[0])

    def prefill_shared_seconds(self, tokens: float) -> float:
        """What a prefill step of prompts of about `tokens` new tokens each pays once, however many
        it holds (between 0 and one such prompt's time alone); 0 without batch points."""
        if tokens <= 0 or not self.has_prefill_batches:
            return 0.0
        return _memo(self._shared_memo, tokens, lambda: min(max(piecewise_linear(*self._prefill_shared, tokens), 0.0),
                                                            self.prefill_seconds(int(tokens))))

    def decode_step_seconds(self, batch: float, context_tokens: float) -> float:
        """One decode step of `batch` running requests whose KV lengths sum to context_tokens. Past the
        largest batch measured: the line through the two largest batches at the same context per request,
        never below the largest's step (a line through them at the same total context compounds the
        context's slope with the batch's: at batch 64 x 528 tokens it gave 3.5x the measured step)."""
        if batch <= 0:
            return 0.0
        return _memo(self._decode_memo, (batch, context_tokens), lambda: self._decode_step(batch, context_tokens))

    def _decode_step(self, batch: float, context_tokens: float) -> float:
        if batch > self._batches[-1] and len(self._batches) > 1:
            (b1, b2), per_request = self._batches[-2:], context_tokens / batch
            s1, s2 = self.decode_step_seconds(b1, per_request * b1), self.decode_step_seconds(b2, per_request * b2)
            return max(s2, s2 + (s2 - s1) * (batch - b2) / (b2 - b1))
        return max(0.0, self._between_rows(batch, context_tokens))

    def _between_rows(self, batch: float, context_tokens: float) -> float:
        """`piecewise_linear` across the batch rows, each row at `context_tokens`: only the two rows that
        bracket `batch` (the end segment's past the ends) are interpolated; the planner calls this a
        million times a minute at 64 workers."""
        rows, batches = self._decode_rows, self._batches
        if len(batches) == 1:
            return piecewise_linear(*rows[0], context_tokens)
        i = segment(batches, batch)
        pair = [piecewise_linear(*rows[j], context_tokens) for j in (i, i + 1)]
        return piecewise_linear(batches[i:i + 2], pair, batch)

    def kv_transfer_seconds(self, tokens: int) -> float:
        """The prefill->decode KV hand-off of one request of `tokens` tokens; 0 when the
        profile did not measure transfers (kv_transfer is [])."""
        if tokens <= 0 or not self._transfer[0]:
            return 0.0
        return max(0.0, piecewise_linear(*self._transfer, tokens))

    def switch_seconds(self, src: str, dst: str) -> float:
        """A role switch of a drained server. 0 for src == dst; a direction the profile did not
        measure costs the slowest measured one (0 when none was measured)."""
        for mode in (src, dst):
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}; modes are {list(MODES)}")
        if src == dst:
            return 0.0
        if (src, dst) in self._switch:
            return self._switch[(src, dst)]
        return max(self._switch.values(), default=0.0)

    @property
    def drain_seconds_idle(self) -> float:
        """What a drained switch adds on an idle server (0 when not measured)."""
        return self.profile.drain.seconds_idle if self.profile.drain else 0.0

    @property
    def max_total_tokens(self) -> int:
        """KV capacity of one server, tokens."""
        return self.profile.server.max_total_tokens

    @property
    def max_running_requests(self) -> int:
        """The most requests one server decodes at once (0: the profile does not say)."""
        return self.profile.server.max_running_requests

    @property
    def prefill_step_tokens(self) -> int:
        """The most new tokens one prefill step takes (0: the profile does not say)."""
        return self.profile.server.prefill_step_tokens


def host_mismatch(profile: Profile, host_flags: Optional[list[str]] = None) -> Optional[str]:
    """A warning when the profile was measured on a CPU whose SIMD flags are not this host's
    (other kernels, other speeds: a profile is a property of its host); None when they match
    or either side is unknown."""
    mine = set(simd_flags(cpu_flags() if host_flags is None else host_flags))
    theirs = set(simd_flags(profile.server.cpu_flags))
    if not mine or not theirs or mine == theirs:
        return None
    parts = [f"{label} {' '.join(sorted(flags))}" for label, flags in
             (("it had", theirs - mine), ("it lacked", mine - theirs)) if flags]
    return (f"the profile was measured on another CPU ({'; '.join(parts)} against this host); its times may not "
            f"hold here: measure this host with `tidal profile`")


def flat_curves(profile: Profile) -> Optional[str]:
    """Where the profile measured prefill at one prompt length or decode at one batch size: with no second point
    to draw a line through, the cost model gives that one time at every length or batch; None with two or more."""
    lengths = sorted({x.tokens for x in profile.prefill})
    batches = sorted({x.batch for x in profile.decode})
    parts = [f"prefill at one prompt length ({lengths[0]} tokens): every prompt costs its time"] * (len(lengths) == 1)
    parts += [f"decode at one batch size ({batches[0]}): a step of any batch costs its time"] * (len(batches) == 1)
    if not parts:
        return None
    return f"the profile measured {'; and '.join(parts)} (measure two or more with `tidal profile`)"


def prefill_extrapolation(profile: Profile, longest_prompt: int) -> Optional[str]:
    """Where prompts take the cost model past twice the longest prefill its profile measured (it extrapolates
    linearly there: predictions rest on that line); None within it, and where it measured one length (no line:
    `flat_curves` says so)."""
    lengths = {x.tokens for x in profile.prefill}
    measured = max(lengths, default=0)
    if len(lengths) > 1 and longest_prompt > 2 * measured:
        return f"prefill was measured up to {measured} tokens; the prompts reach {longest_prompt}"
    return None
