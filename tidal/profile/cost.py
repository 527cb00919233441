"""The cost model: a profile's measured points, interpolated piecewise-linearly.

Between points: linear; past the ends: the end segment's line, never below zero.
(A minimal copy written to the planner/profiler contract; the profiler's version wins.)
"""

from __future__ import annotations

import bisect
from typing import Sequence

import msgspec

from tidal.profile.schema import Profile, load_profile


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs sorted, distinct), extended linearly, floored at 0."""
    if not xs:
        return 0.0
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0]) if xs[0] else max(0.0, ys[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _curve(pairs: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    merged: dict[float, list[float]] = {}
    for x, y in pairs:
        merged.setdefault(float(x), []).append(float(y))
    xs = sorted(merged)
    return xs, [sum(merged[x]) / len(merged[x]) for x in xs]


class CostModel:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._prefill = _curve([(p.tokens, p.seconds) for p in profile.prefill])
        self._transfer = _curve([(p.tokens, p.seconds) for p in profile.kv_transfer])
        by_batch: dict[int, list[tuple[float, float]]] = {}
        for p in profile.decode:
            by_batch.setdefault(p.batch, []).append((p.context_tokens, p.step_seconds))
        self._batches = sorted(by_batch)
        self._decode = [_curve(by_batch[b]) for b in self._batches]
        self._switch = {(s.src, s.dst): s.seconds for s in profile.switch}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(msgspec.convert(d, Profile))

    @classmethod
    def from_file(cls, path: str) -> "CostModel":
        return cls(load_profile(path))

    @property
    def max_total_tokens(self) -> int:
        return self.profile.server.max_total_tokens

    def prefill_seconds(self, tokens: int) -> float:
        return interpolate(*self._prefill, tokens)

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        if not self._batches:
            return 0.0
        per_batch = [interpolate(xs, ys, context_tokens) for xs, ys in self._decode]
        return interpolate([float(b) for b in self._batches], per_batch, batch)

    def kv_transfer_seconds(self, tokens: int) -> float:
        return interpolate(*self._transfer, tokens)

    def switch_seconds(self, src: str, dst: str) -> float:
        return self._switch.get((src, dst), 0.0)
