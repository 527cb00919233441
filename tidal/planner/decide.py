"""The planner's decision: pure, clock injected (`now`), no I/O.

Every interval `decide` looks at each legal single move (any worker to any other mode),
predicts the layout after it, and picks the one with the lowest score. It moves only when
that beats the current layout by the hysteresis (or, while the SLOs are met, when it
beats it by the hysteresis at `headroom` times the arrival rate), and never:
- inside the global cooldown after a move (started or finished), nor moves a worker again
  inside its own cooldown;
- with `max_concurrent_moves` moves already in flight;
- below `min_per_pool` workers in the prefill or the decode pool (the null pool may empty);
- to a layout without a usable path: with no null worker, both a prefill and a decode
  worker must remain;
- a worker whose last move failed, before its backoff (base * 2^(failures-1), capped) ends.

`PlannerState` is the memory between intervals; the caller reports each move's start and
end (`started`, `finished`), again with `now`, so that a simulator can drive it in virtual time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import msgspec

from tidal.planner.predict import CostPredictor, ObservedPredictor, PoolLoad
from tidal.planner.schema import (
    DECODE,
    MODES,
    NULL,
    PREFILL,
    Candidate,
    Decision,
    PlannerConfig,
    Prediction,
    Traffic,
    WorkerLoad,
)

MIN_RELATIVE_GAIN = 0.1  # a move must also lower the score by this fraction of it


@dataclasses.dataclass
class WorkerMemory:
    last_move_at: Optional[float] = None
    failures: int = 0  # consecutive failed moves
    retry_at: float = float("-inf")


class PlannerState:
    def __init__(self) -> None:
        self.last_move_at: Optional[float] = None  # start or end of the latest move
        self.in_flight: dict[str, str] = {}  # url -> target mode
        self.workers: dict[str, WorkerMemory] = {}

    def memory(self, url: str) -> WorkerMemory:
        return self.workers.setdefault(url, WorkerMemory())

    def started(self, now: float, url: str, dst: str) -> None:
        self.in_flight[url] = dst
        self.last_move_at = now
        self.memory(url).last_move_at = now

    def finished(self, now: float, url: str, ok: bool, cfg: PlannerConfig) -> None:
        self.in_flight.pop(url, None)
        self.last_move_at = now
        m = self.memory(url)
        m.last_move_at = now
        if ok:
            m.failures, m.retry_at = 0, float("-inf")
        else:
            m.failures += 1
            m.retry_at = now + min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (m.failures - 1))

    def cooldown_left(self, now: float, cfg: PlannerConfig) -> float:
        if self.last_move_at is None:
            return 0.0
        return max(0.0, self.last_move_at + cfg.cooldown_s - now)

    def worker_blocked(self, now: float, url: str, cfg: PlannerConfig) -> str:
        """Why this worker may not move now ("" when it may)."""
        if url in self.in_flight:
            return "moving"
        m = self.workers.get(url)
        if m is None:
            return ""
        if now < m.retry_at:
            return f"backoff after {m.failures} failed move(s), {m.retry_at - now:.1f} s left"
        if m.last_move_at is not None and now < m.last_move_at + cfg.per_worker_cooldown_s:
            return f"worker cooldown, {m.last_move_at + cfg.per_worker_cooldown_s - now:.1f} s left"
        return ""

    def to_dict(self, now: float, cfg: PlannerConfig) -> dict:
        return {"cooldown_left_s": round(self.cooldown_left(now, cfg), 3), "in_flight": dict(self.in_flight),
                "workers": {url: {"blocked": self.worker_blocked(now, url, cfg), "failures": m.failures,
                                  "last_move_age_s": None if m.last_move_at is None
                                  else round(now - m.last_move_at, 3)}
                            for url, m in self.workers.items()}}


def pool_counts(loads: list[WorkerLoad]) -> dict[str, int]:
    counts = {m: 0 for m in MODES}
    for w in loads:
        counts[w.mode] += 1
    return counts


def after_move(pools: dict[str, int], src: str, dst: str) -> dict[str, int]:
    out = dict(pools)
    out[src] -= 1
    out[dst] += 1
    return out


def layout_problem(after: dict[str, int], src: str, min_per_pool: int) -> str:
    """Why the layout `after` (one worker out of `src`) is not allowed ("" when it is)."""
    if src in (PREFILL, DECODE) and after[src] < min_per_pool:
        return f"{src} pool would fall below --planner-min-per-pool {min_per_pool}"
    if not after[NULL] and not (after[PREFILL] and after[DECODE]):
        return "no usable path would remain (a prefill and a decode worker, or a null one)"
    return ""


def make_predictor(cfg: PlannerConfig, cost: Any, current: dict[str, int]) -> Any:
    if cost is not None:
        return CostPredictor(cost, cfg.ttft_slo_s, cfg.tpot_slo_s, cfg.interval_s)
    return ObservedPredictor(current, cfg.ttft_slo_s, cfg.tpot_slo_s)


def drain_work(w: WorkerLoad) -> int:
    """Requests a move of `w` must wait for: what it reports, or what the router has open on it when
    that is more (a decode worker holds PD requests whose prefill has not finished yet)."""
    return max(w.running_reqs + w.waiting_reqs, w.in_flight)


def along(predictor: Any, pools: dict[str, int], load: PoolLoad, traffic: Traffic, src: str, dst: str,
          min_per_pool: int) -> tuple[Optional[Prediction], int]:
    """The best legal layout after k = 1, 2, 4, ... workers move src -> dst, and its k. In a large
    cluster one worker changes the score by about 1/N, too little to pass the hysteresis even when
    the layout is far from the best one; the gain that counts is the direction's."""
    best: Optional[Prediction] = None
    best_k, k = 1, 1
    while k <= pools[src]:
        layout = dict(pools)
        layout[src] -= k
        layout[dst] += k
        if layout_problem(layout, src, min_per_pool):
            break
        pred = predictor.predict(layout, load, traffic)
        if pred is not None and (best is None or pred.score < best.score):
            best, best_k = pred, k
        k *= 2
    return best, best_k


def candidates(now: float, cfg: PlannerConfig, state: PlannerState, loads: list[WorkerLoad],
               predictor: Any, load: PoolLoad, traffic: Traffic) -> list[Candidate]:
    """Every single move, the fastest workers to drain first (they win ties)."""
    pools = pool_counts(loads)
    predictions: dict[tuple[str, str], Optional[Prediction]] = {}
    targets: dict[tuple[str, str], tuple[Optional[Prediction], int]] = {}
    out = []
    for w in sorted(loads, key=lambda w: (drain_work(w), w.url)):
        blocked = state.worker_blocked(now, w.url, cfg)
        for dst in MODES:
            if dst == w.mode:
                continue
            layout = after_move(pools, w.mode, dst)
            reason = blocked or layout_problem(layout, w.mode, cfg.min_per_pool)
            if (w.mode, dst) not in predictions:
                predictions[w.mode, dst] = predictor.predict(layout, load, traffic)
                targets[w.mode, dst] = (along(predictor, pools, load, traffic, w.mode, dst, cfg.min_per_pool)
                                        if not layout_problem(layout, w.mode, cfg.min_per_pool) else (None, 1))
            pred = predictions[w.mode, dst]
            target, k = targets[w.mode, dst]
            out.append(Candidate(url=w.url, src=w.mode, dst=dst, legal=not reason, reason=reason, prediction=pred,
                                 target=target, target_moves=k))
    return out


def goal(c: Candidate) -> Prediction:
    """What a move heads for: the best layout along its direction, or the move alone."""
    return c.target if c.target is not None and c.target.score < c.prediction.score else c.prediction


def headroom_move(now: float, cfg: PlannerConfig, pools: dict[str, int], load: PoolLoad, traffic: Traffic,
                  current: Prediction, legal: list[Candidate], predictor: Any) -> Optional[Decision]:
    """While the SLOs are met, the move that best prepares for a burst: layouts compared at
    `headroom` times the arrival rate, among moves that keep the SLOs at today's rate, with the
    same hysteresis. Without it the score is flat until a pool saturates, so the planner would
    only start moving (slowly: drain, switch, cooldown) once the burst is already there."""
    if cfg.headroom <= 1 or current.score >= 1:
        return None
    burst = msgspec.structs.replace(traffic, arrival_rate=traffic.arrival_rate * cfg.headroom)
    now_burst = predictor.predict(pools, load, burst)
    by_move: dict[tuple[str, str], Prediction] = {}
    best: Optional[tuple[float, Candidate]] = None
    for c in legal:
        if c.prediction.score >= 1:
            continue
        if (c.src, c.dst) not in by_move:
            by_move[c.src, c.dst] = along(predictor, pools, load, burst, c.src, c.dst, cfg.min_per_pool)[0]
        score = by_move[c.src, c.dst].score
        if best is None or score < best[0]:
            best = (score, c)
    if best is None:
        return None
    score, c = best
    if now_burst.score - score < max(cfg.hysteresis, MIN_RELATIVE_GAIN * now_burst.score):
        return None
    return Decision(at=now, kind="move", url=c.url, src=c.src, dst=c.dst, current=current, best=c,
                    reason=f"headroom: SLOs met; at {cfg.headroom:g}x the rate the score {now_burst.score:.3f} -> "
                           f"{score:.3f} moving {c.url} {c.src}->{c.dst}")


def _hold(now: float, reason: str, current: Optional[Prediction] = None,
          cands: Optional[list[Candidate]] = None, best: Optional[Candidate] = None) -> Decision:
    return Decision(at=now, kind="hold", reason=reason, current=current, candidates=cands or [], best=best)


def decide(now: float, cfg: PlannerConfig, state: PlannerState, loads: list[WorkerLoad], traffic: Traffic,
           cost: Any = None) -> Decision:
    """The decision for this interval. `loads`: the workers in a pool now (healthy, not switching)."""
    if cfg.mode != "sla":
        return _hold(now, "planner is static")
    pools = pool_counts(loads)
    load = PoolLoad(loads)
    predictor = make_predictor(cfg, cost, pools)
    current = predictor.predict(pools, load, traffic)
    if current is None:
        return _hold(now, "no observed TTFT/TPOT yet (streamed requests) and no --planner-profile")
    cands = candidates(now, cfg, state, loads, predictor, load, traffic)
    legal = [c for c in cands if c.legal and c.prediction is not None]
    # a first step must not make things worse on its own, whatever lies further along
    steps = [c for c in legal if c.prediction.score <= current.score or goal(c) is c.prediction]
    best = min(steps, key=lambda c: goal(c).score) if steps else None
    if len(state.in_flight) >= cfg.max_concurrent_moves:
        return _hold(now, f"{len(state.in_flight)} move(s) in flight", current, cands, best)
    cooldown = state.cooldown_left(now, cfg)
    if cooldown > 0:
        return _hold(now, f"cooldown, {cooldown:.1f} s left", current, cands, best)
    if traffic.arrival_rate <= 0:
        return _hold(now, "no arrivals in the window", current, cands, best)
    if cost is not None and traffic.mean_input_tokens <= 0:
        return _hold(now, "no request finished in the window yet: lengths unknown", current, cands, best)
    if best is None:
        return _hold(now, "no legal move", current, cands)
    gain = current.score - goal(best).score
    needed = max(cfg.hysteresis, MIN_RELATIVE_GAIN * current.score)
    if gain < needed:
        spare = headroom_move(now, cfg, pools, load, traffic, current, steps, predictor) if cost is not None else None
        if spare is not None:
            spare.candidates = cands
            return spare
        return _hold(now, f"best move {best.src}->{best.dst} lowers the score {current.score:.3f} by "
                          f"{gain:.3f} < {needed:.3f} (hysteresis)", current, cands, best)
    ahead = (f" (heading for {goal(best).score:.3f} after {best.target_moves} such moves)"
             if goal(best) is not best.prediction else "")
    return Decision(at=now, kind="move", url=best.url, src=best.src, dst=best.dst, current=current,
                    best=best, candidates=cands,
                    reason=f"score {current.score:.3f} -> {best.prediction.score:.3f}{ahead} moving {best.url} "
                           f"{best.src}->{best.dst}")
