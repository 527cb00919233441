"""How the time of a decode or verification pass grows with its tokens, fitted online, so
the speculator makes only the guesses that pay for the extra tokens they put in a pass."""

from __future__ import annotations

from collections import deque

import numpy as np

# a pass's fixed cost over its cost per token when the fit has too little to go on; measured on a
# 2-core AVX-512 CPU, SmolLM2-135M bfloat16: 3 at one request, 7.6 at eight
DEFAULT_FIXED_OVER_PER_TOKEN = 4.0


class PassCost:
    """seconds ~ fixed + per_token * tokens over the last passes."""

    def __init__(self, keep: int = 256):
        self._passes: deque[tuple[int, float]] = deque(maxlen=keep)

    def observe(self, tokens: int, seconds: float) -> None:
        self._passes.append((tokens, seconds))

    def fit(self) -> "tuple[float, float] | None":
        """(fixed, per_token) seconds, or None while the passes seen say too little."""
        if len(self._passes) < 16:
            return None
        t = np.array([p[0] for p in self._passes], dtype=np.float64)
        s = np.array([p[1] for p in self._passes], dtype=np.float64)
        if t.std() < 1.0:
            return None
        per_token, fixed = np.polyfit(t, s, 1)
        if per_token <= 0 or fixed <= 0:
            return None
        return float(fixed), float(per_token)

    def fixed_over_per_token(self) -> float:
        """fixed / per_token: how many tokens' worth of work every pass costs anyway."""
        fit = self.fit()
        if fit is None:
            return DEFAULT_FIXED_OVER_PER_TOKEN
        return float(min(fit[0] / fit[1], 64.0))

    def mean_seconds(self) -> "float | None":
        return float(np.mean([p[1] for p in self._passes])) if len(self._passes) >= 16 else None
