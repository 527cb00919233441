"""How the planner orders predicted layouts: by capacity; where none meets the SLOs at any rate, by how soon the
backlog is worked off (or how slowly it grows), then by today's score (`decide` uses these)."""

from __future__ import annotations

from typing import Iterable, Optional

from tidal.planner.predict import NEVER
from tidal.planner.schema import Prediction

NEAR_TIE = 0.02  # layouts within this fraction of the best capacity (or score) count as ties


def better(a: Prediction, b: Prediction) -> bool:
    """a ranks above b: more capacity, or, when neither meets the SLOs at any rate, a sooner recovery from the
    backlog, or, at the same, a lower score."""
    if a.capacity or b.capacity:
        return a.capacity > b.capacity
    sooner = recovers(a, b)
    return a.score < b.score if sooner is None else sooner


def backlog_key(a: Prediction) -> Optional[tuple[int, float]]:
    """Lower is better: no backlog; one worked off, the sooner the better; one that grows, the slower the
    better. None where not predicted."""
    if a.recovery_s is None:
        return None
    if a.recovery_s == 0 or a.drain_rate is None:
        return 0, 0.0
    return (1, a.recovery_s) if a.recovery_s < NEVER else (2, -a.drain_rate)


def recovers(a: Prediction, b: Prediction) -> Optional[bool]:
    """Whether a does better than b with the backlog (`backlog_key`), where both predict it and differ; else None."""
    ka, kb = backlog_key(a), backlog_key(b)
    if ka is None or kb is None or ka == kb:
        return None
    return ka < kb


def best_of(preds: Iterable[Prediction]) -> Prediction:
    """The first of the predictions that no later one ranks above (`better`)."""
    out = None
    for x in preds:
        if out is None or better(x, out):
            out = x
    return out


def near(a: Prediction, best: Prediction) -> bool:
    if best.capacity:
        return a.capacity >= best.capacity * (1 - NEAR_TIE)
    if a.capacity:
        return False
    ka, kb = backlog_key(a), backlog_key(best)
    if ka is not None and kb is not None and ka != kb:  # near: the same kind, within NEAR_TIE
        return ka[0] == kb[0] and abs(ka[1] - kb[1]) <= NEAR_TIE * abs(kb[1])
    return a.score <= best.score * (1 + NEAR_TIE)


def meets_tpot(pred: Prediction, tpot_slo_s: float) -> bool:
    """Whether every path of the layout is predicted to meet the TPOT SLO at today's rate."""
    return all(p.tpot_s <= tpot_slo_s for p in pred.paths.values())
