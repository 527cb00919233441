"""The planner's decision: pure, clock injected (`now`), no I/O.

What it maximizes is a layout's *capacity*: the largest multiple of the window's arrival rate,
with the window's mix of prompt and answer lengths, at which the layout is predicted to meet
both SLOs (the goodput notion, per layout). Every interval `decide` computes it for the layouts
the cluster could take (workers per mode: every layout up to GRID_FULL workers, a coarse grid
refined around its best one beyond), picks the best as its target (among near-ties, the fewest
moves away; a committed target stays while it is within NEAR_BEST of the best, `kept_target`)
and, when the target's capacity beats the layout the cluster is heading for by the
hysteresis (relative; MEETS_TODAY_GAIN when the target meets today's rate and the heading layout does
not), starts one move toward it: the legal single move whose layout predicts
best, ties to the worker with least to drain. The next intervals continue toward the target
while it stays the best layout (`PlannerState.committed`: without the hysteresis again, which
would stop the walk short where the remaining gain is smaller), up to `max_concurrent_moves` at once. Aiming at capacity
rather than at today's latency keeps headroom for bursts and makes the target depend on the
mix, not on how loaded the cluster happens to be; when no layout meets the SLOs even at a
small fraction of the rate (a backlog larger than the TTFT SLO), it ranks by how soon the layout works the
backlog off while today's rate keeps arriving, or where none does, by how slowly the backlog grows
(`Prediction.recovery_s`, `drain_rate`: every arrival until then misses), then by today's score. The prompt
lengths are the window's, or the queued prompts' when enough wait and they are another mix
(`queued.queued_mix`: the window learns a length only when its request finishes).
When no layout meets today's rate and the heading layout's decode side meets the TPOT SLO at it,
only layouts whose decode side also meets it are ranked (`meets_tpot`): a prefill backlog drains,
while a decode pool too small for today's rate makes every request it serves miss.

It never:
- moves a worker back the way a move went inside the cooldown after that move started or
  ended (no move into a pool that lost a worker, nor out of one that gained a worker, in the
  last `cooldown_s`), nor moves a worker again inside its own cooldown, unless overloaded (the
  layout it heads for misses the SLOs at every rate, and the target meets them at some rate); the
  reversal cooldown also yields where the queued prompts stand for another kind of answers than the
  move was decided on (`PlannerState.reversal`);
- starts a move with `max_concurrent_moves` moves already in flight;
- shrinks the prefill or the decode pool below `min_per_pool` workers (the null pool may empty);
- leaves no usable path, also while the worker moves (it serves no pool until it lands): with no null
  worker, both a prefill and a decode worker must remain;
- moves a worker whose last move failed before its backoff (base * 2^(failures-1), capped) ends.

`PlannerState` is the memory between intervals; the caller reports each move's start and
end (`started`, `finished`), again with `now`, so that a simulator can drive it in virtual time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional

import msgspec

from tidal.planner.predict import NEVER, CostPredictor, ObservedPredictor, PoolLoad
from tidal.planner.queued import queued_mix, same_kind
from tidal.planner.rank import NEAR_TIE, backlog_key, best_of, better, meets_tpot, near, recovers
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

MIN_RELATIVE_GAIN = 0.1  # ranking by score: a move must also lower it by this fraction of it
# a layout that misses today's rate (capacity < 1) heads for one that meets it for this relative gain, not the
# hysteresis: every request pays for the miss while it holds
MEETS_TODAY_GAIN = 0.1
GRID_FULL = 24  # up to this many workers every layout is predicted; beyond, a grid of ~16 steps refined
# layouts within this fraction of the best capacity are close enough for the model's error to reverse their
# order: among them, those whose decode pool also takes the burst (`robust`) are preferred
NEAR_BEST = 0.05
CAPACITY_LOG2 = (-6.0, 12.0)  # capacity is searched between 1/64 and 4096 times the rate
CAPACITY_STEPS = 10  # bisection steps in log2: about 1% precision


@dataclasses.dataclass
class WorkerMemory:
    last_move_at: Optional[float] = None
    last_move_answers: Optional[float] = None  # the mean answer its last move was decided on (None: unknown)
    failures: int = 0  # consecutive failed moves
    retry_at: float = float("-inf")


@dataclasses.dataclass
class Flow:
    """The latest move from one mode to another: when it started or ended, and the mean answer of the traffic it
    was decided on (None: unknown, a move by hand)."""
    src: str
    dst: str
    at: float
    answers: Optional[float] = None


def another_mix(queued_answers: Optional[float], decided_on: Optional[float]) -> bool:
    """Whether the queued prompts stand for another kind of answers (`queued_mix`) than a move was decided on:
    the cooldowns, which hold a layout against the noise of one mix, then yield. Unknown either way: no."""
    return queued_answers is not None and decided_on is not None and not same_kind(queued_answers, decided_on)


class PlannerState:
    def __init__(self) -> None:
        self.in_flight: dict[str, tuple[str, str]] = {}  # url -> (source mode, target mode)
        self.flows: dict[tuple[str, str], Flow] = {}
        self.workers: dict[str, WorkerMemory] = {}
        # the layout the last move headed for: passing the hysteresis once commits the moves toward it
        self.committed: Optional[dict[str, int]] = None
        self.version = 0  # counts the moves started and ended: a decision taken on a copy is stale once it moved on

    def memory(self, url: str) -> WorkerMemory:
        return self.workers.setdefault(url, WorkerMemory())

    def _touch(self, now: float, url: str, src: str, dst: str, answers: Optional[float]) -> None:
        m = self.memory(url)
        m.last_move_at, m.last_move_answers = now, answers
        self.flows[src, dst] = Flow(src, dst, now, answers)

    def started(self, now: float, url: str, src: str, dst: str, answers: Optional[float] = None) -> None:
        """A move began; `answers`: the mean answer of the traffic it was decided on (`Decision.answers`)."""
        self.version += 1
        self.in_flight[url] = (src, dst)
        self._touch(now, url, src, dst, answers)

    def finished(self, now: float, url: str, ok: bool, cfg: PlannerConfig) -> None:
        self.version += 1
        src, dst = self.in_flight.pop(url, ("", ""))
        if src:
            flow = self.flows.get((src, dst))
            self._touch(now, url, src, dst, flow.answers if flow is not None else None)
        m = self.memory(url)
        m.last_move_at = now
        if ok:
            m.failures, m.retry_at = 0, float("-inf")
        else:
            m.failures += 1
            m.retry_at = now + min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (m.failures - 1))

    def cooldown_left(self, now: float, cfg: PlannerConfig) -> float:
        """Seconds until no direction is blocked as a reversal any more."""
        return max([0.0] + [f.at + cfg.cooldown_s - now for f in self.flows.values()])

    def reversal(self, now: float, src: str, dst: str, cfg: PlannerConfig,
                 queued_answers: Optional[float] = None) -> str:
        """Why src -> dst would undo a recent move ("" when it would not): it takes a worker out of a
        pool that gained one, or puts one into a pool that lost one, inside the cooldown. A move decided on
        another kind of answers than `queued_answers` (those of the mix the queued prompts stand for,
        `queued_mix`) blocks nothing: the cooldown holds a layout against the noise of one mix, and the queue
        shows another (the even mix at 64 instances at TTFT 16 s, rate scale 28.22: at t = 365 s, in the last
        lull of a conversation phase, 8 workers moved to decode; at 370 s 593 code prompts waited, and the
        cooldown held 35:29 against 61:3 until 390 s, while the arrivals of t = 375-435 s met 0.25-0.70)."""
        for f in self.flows.values():
            if another_mix(queued_answers, f.answers):
                continue
            left = f.at + cfg.cooldown_s - now
            if left > 0 and (f.dst == src or f.src == dst):
                return f"cooldown after a move {f.src}->{f.dst}, {left:.1f} s left"
        return ""

    def worker_blocked(self, now: float, url: str, cfg: PlannerConfig, overloaded: bool = False,
                       queued_answers: Optional[float] = None) -> str:
        """Why this worker may not move now ("" when it may). `overloaded`: its own cooldown yields (a failed
        move's backoff does not)."""
        if url in self.in_flight:
            return "moving"
        m = self.workers.get(url)
        if m is None:
            return ""
        if now < m.retry_at:
            return f"backoff after {m.failures} failed move(s), {m.retry_at - now:.1f} s left"
        if (not overloaded and not another_mix(queued_answers, m.last_move_answers) and m.last_move_at is not None
                and now < m.last_move_at + cfg.per_worker_cooldown_s):
            return f"worker cooldown, {m.last_move_at + cfg.per_worker_cooldown_s - now:.1f} s left"
        return ""

    def to_dict(self, now: float, cfg: PlannerConfig) -> dict:
        return {"cooldown_left_s": round(self.cooldown_left(now, cfg), 3),
                "in_flight": {url: dst for url, (_, dst) in self.in_flight.items()},
                "recent_moves": {f"{f.src}->{f.dst}": round(now - f.at, 3) for f in self.flows.values()},
                "workers": {url: {"blocked": self.worker_blocked(now, url, cfg), "failures": m.failures,
                                  "last_move_age_s": None if m.last_move_at is None
                                  else round(now - m.last_move_at, 3)}
                            for url, m in self.workers.items()}}


def pool_counts(loads: list[WorkerLoad]) -> dict[str, int]:
    counts = {m: 0 for m in MODES}
    for w in loads:
        counts[w.mode] += 1
    return counts


def heading_for(pools: dict[str, int], state: PlannerState) -> dict[str, int]:
    """The layout once the moves in flight have landed (their workers are in no pool meanwhile)."""
    out = dict(pools)
    for _, dst in state.in_flight.values():
        out[dst] += 1
    return out


def after_move(pools: dict[str, int], src: str, dst: str) -> dict[str, int]:
    out = dict(pools)
    out[src] -= 1
    out[dst] += 1
    return out


def has_path(layout: dict[str, int]) -> bool:
    """Requests can be served: a null worker, or a prefill and a decode worker."""
    return bool(layout[NULL] or (layout[PREFILL] and layout[DECODE]))


def serves(layout: dict[str, int]) -> bool:
    """The router can send a request somewhere: `has_path`, or a decode worker, which prefills a request sent to it
    alone (unless the router enforces disaggregation: then such a layout served nothing before the move either)."""
    return has_path(layout) or bool(layout[DECODE])


def layout_problem(pools: dict[str, int], src: str, dst: str, min_per_pool: int) -> str:
    """Why moving one worker from `src` to `dst` out of `pools` (the workers serving now) is not allowed ("" when
    it is). A moving worker serves no pool until it lands, so a usable path must remain without it: from a layout
    the planner heads for, one of those; from one it never heads for (after moves by hand), what served before (a
    decode worker, where all are), so that the walk back to a prefill and decode pair can start."""
    after = after_move(pools, src, dst)
    if src in (PREFILL, DECODE) and after[src] < min_per_pool:
        return f"{src} pool would fall below --planner-min-per-pool {min_per_pool}"
    during = dict(after, **{dst: after[dst] - 1})
    kept = has_path(during) if has_path(pools) else serves(during) or not serves(pools)
    if not kept:
        return "no usable path would remain while it moves (a prefill and a decode worker, or a null one)"
    return ""


def target_allowed(layout: dict[str, int], current: dict[str, int], min_per_pool: int) -> bool:
    """A layout the planner may head for: a usable path, and no prefill or decode pool shrunk below the
    minimum (a pool already below it may stay there)."""
    if any(layout[m] < min(min_per_pool, current[m]) for m in (PREFILL, DECODE)):
        return False
    return has_path(layout)


def floor_warning(pools: dict[str, int], min_per_pool: int) -> str:
    """Why the starting pools sit below --planner-min-per-pool ("" when none does). Under the default floor of 1
    an empty pool is a colocated start, not worth a warning."""
    low = [f"the {m} pool has {pools[m]} worker{'s' * (pools[m] != 1)}" for m in (PREFILL, DECODE)
           if min_per_pool > 1 and pools[m] < min_per_pool]
    if not low:
        return ""
    return (f"--planner-min-per-pool {min_per_pool}: {' and '.join(low)}; the planner moves no worker out of a "
            "pool below the floor, and adds one only where that pays")


def make_predictor(cfg: PlannerConfig, cost: Any, current: dict[str, int]) -> Any:
    if cost is not None:
        return CostPredictor(cost, cfg.ttft_slo_s, cfg.tpot_slo_s, cfg.interval_s)
    return ObservedPredictor(current, cfg.ttft_slo_s, cfg.tpot_slo_s)


def handing_over(w: WorkerLoad, dst: str) -> str:
    """Why `w` may not move to `dst` now: it still finishes another role's requests (a handover), and a switch
    to a third role would wait for them out of every pool. The move back to that role goes at once."""
    if not w.handing_over_from or dst == w.handing_over_from:
        return ""
    return (f"handing over: it finishes its {w.handing_over_from} requests; until they end only a move back to "
            f"{w.handing_over_from} goes at once")


def drain_work(w: WorkerLoad) -> int:
    """Requests a move of `w` must wait for: what it reports, or what the router has open on it when
    that is more (a decode worker holds PD requests whose prefill has not finished yet)."""
    return max(w.running_reqs + w.waiting_reqs, w.in_flight)


def moves_between(a: dict[str, int], b: dict[str, int]) -> int:
    return sum(max(0, a[m] - b[m]) for m in MODES)


def grid(total: int, step: int, center: Optional[tuple[int, int]] = None) -> Iterable[dict[str, int]]:
    """Layouts (prefill, decode, rest null) on a grid of `step`, all of them or the 3x3 around `center`."""
    if center is None:
        ps = sorted(set(range(0, total + 1, step)) | {total})
        ds = ps
    else:
        ps = [center[0] + i * step for i in (-1, 0, 1)]
        ds = [center[1] + i * step for i in (-1, 0, 1)]
    for p in ps:
        for d in ds:
            if 0 <= p and 0 <= d and p + d <= total:
                yield {NULL: total - p - d, PREFILL: p, DECODE: d}


def capacity(predictor: Any, layout: dict[str, int], load: PoolLoad, traffic: Traffic) -> Optional[float]:
    """The largest multiple of the window's arrival rate at which `layout` is predicted to meet both SLOs
    (0 when it misses them even at the lowest multiple searched); None when it cannot be predicted."""
    if isinstance(predictor, ObservedPredictor):  # latencies linear in the load: the multiple is 1/score
        pred = predictor.predict(layout, load, traffic)
        return None if pred is None else (1.0 / pred.score if pred.score > 0 else 2.0 ** CAPACITY_LOG2[1])
    lo, hi = CAPACITY_LOG2
    if predictor.predict(layout, load, msgspec.structs.replace(traffic, arrival_rate=traffic.arrival_rate
                                                               * 2.0 ** lo)).score > 1:
        return 0.0
    for _ in range(CAPACITY_STEPS):
        mid = (lo + hi) / 2
        scaled = msgspec.structs.replace(traffic, arrival_rate=traffic.arrival_rate * 2.0 ** mid)
        lo, hi = (mid, hi) if predictor.predict(layout, load, scaled).score <= 1 else (lo, mid)
    return 2.0 ** lo


def rated(predictor: Any, layout: dict[str, int], load: PoolLoad, traffic: Traffic) -> Optional[Prediction]:
    """The layout's prediction at today's rate, with its capacity."""
    pred = predictor.predict(layout, load, traffic)
    if pred is None:
        return None
    pred.capacity = capacity(predictor, layout, load, traffic) or 0.0
    return pred


def best_layout(predictor: Any, current: dict[str, int], load: PoolLoad, traffic: Traffic,
                min_per_pool: int, current_rated: Optional[Prediction] = None) -> Optional[Prediction]:
    """The best allowed layout of the same workers (`better`), near-ties going to the fewest moves from
    `current` (`current_rated`: its prediction with capacity, when the caller has it already)."""
    total = sum(current.values())
    seen: dict[tuple[int, int], Prediction] = {}
    if current_rated is not None and target_allowed(current, current, min_per_pool):
        seen[current[PREFILL], current[DECODE]] = current_rated

    def visit(layouts: Iterable[dict[str, int]]) -> None:
        for lay in layouts:
            key = (lay[PREFILL], lay[DECODE])
            if key not in seen and target_allowed(lay, current, min_per_pool):
                pred = rated(predictor, lay, load, traffic)
                if pred is not None:
                    seen[key] = pred

    def ranked() -> tuple[list[Prediction], Prediction]:
        """The layouts seen that may be chosen, and the best of them."""
        pool = list(seen.values())
        best = best_of(pool)
        if best.capacity < 1.0 and current_rated is not None and meets_tpot(current_rated, predictor.tpot_slo_s):
            # overload: a prefill backlog drains; a decode pool past the TPOT SLO fails every request it serves
            keep = [x for x in pool if meets_tpot(x, predictor.tpot_slo_s)]
            if keep:
                return keep, best_of(keep)
        return pool, best

    step = 1 if total <= GRID_FULL else math.ceil(total / 16)
    visit(grid(total, step))
    visit([current])
    while step > 1 and seen:
        step = math.ceil(step / 2)
        _, best = ranked()  # refined around the best that may be chosen
        visit(grid(total, step, (best.pools[PREFILL], best.pools[DECODE])))
    if not seen:
        return None
    pool, best = ranked()
    if best.capacity and isinstance(predictor, CostPredictor):
        bursty = predictor.with_decode_bursts()
        sturdy = [x for x in pool if x.capacity >= best.capacity * (1 - NEAR_BEST) and robust(bursty, x, load,
                                                                                                traffic)]
        if sturdy:
            pool, best = sturdy, max(sturdy, key=lambda x: x.capacity)
    ties = [x for x in pool if near(x, best)]
    return min(ties, key=lambda x: (moves_between(current, x.pools), -x.capacity, backlog_key(x) or (0, 0.0), x.score))


def robust(bursty: CostPredictor, pred: Prediction, load: PoolLoad, traffic: Traffic) -> bool:
    """Whether the layout keeps (within NEAR_TIE) its capacity with its PD decode workers at the burst rate
    (`bursty`: a predictor with `decode_bursts` set). At 64 instances on the code trace 61:3 and 60:4 are
    within 3%, and in the simulator 3 decode workers miss the TPOT SLO in the bursts that 4 serve."""
    return (capacity(bursty, pred.pools, load, traffic) or 0.0) >= pred.capacity * (1 - NEAR_TIE)


def kept_target(predictor: Any, state: PlannerState, heading: dict[str, int], best: Prediction, load: PoolLoad,
                traffic: Traffic, min_per_pool: int) -> Prediction:
    """The committed target while it stays within NEAR_BEST of the best layout's capacity, else the best: a
    walk is not turned toward a layout the model cannot tell apart from its target (at 64 instances on the
    code trace the target went 59:5 -> 61:3, 3.5% apart, halfway there, in the first seconds of a burst)."""
    kept = state.committed
    if (kept is None or kept == best.pools or not best.capacity or sum(kept.values()) != sum(heading.values())
            or not target_allowed(kept, heading, min_per_pool)):
        return best
    pred = rated(predictor, kept, load, traffic)
    if pred is None or pred.capacity < best.capacity * (1 - NEAR_BEST):
        return best
    if isinstance(predictor, CostPredictor) and not robust(predictor.with_decode_bursts(), pred, load, traffic):
        return best  # the bursts seen since it was chosen sink its decode pool: the robust choice wins
    return pred


def young_hysteresis(hysteresis: float, traffic: Traffic, window_s: float) -> float:
    """The hysteresis a capacity gain must pass while the window holds fewer than `window_s` seconds of arrivals
    (the router's first seconds): a rate and mix measured over s seconds err sqrt(window_s / s) times as much as
    over the whole window. On the conversation trace at 64 instances and a TTFT SLO of 16 s, the first 5 s
    (81 requests/s of 230-token prompts, where 103-109 of 272-295 followed) ranked 22:42 2.39x the rate against
    32:32's 1.83x; the planner moved 10 workers to decode and, from t = 30 s, moved them back and 26 more after them."""
    span = traffic.span_s
    if span is None or span >= window_s:
        return hysteresis
    return hysteresis * math.sqrt(window_s / max(span, 1.0))


def gain_enough(current: Prediction, target: Prediction, hysteresis: float,
                capacity_hysteresis: Optional[float] = None, tpot_slo_s: Optional[float] = None) -> tuple[bool, str]:
    """Whether heading for `target` pays: capacity up by `capacity_hysteresis` (relative; default the
    hysteresis), or by MEETS_TODAY_GAIN when the target meets today's rate and the current layout does not, or
    at all (down by the hysteresis at most) when neither meets today's rate and the target's decode side meets
    the TPOT SLO (`tpot_slo_s`) at it where the current's does not: a decode pool past the TPOT SLO fails every
    request it serves, a prefill backlog only those it holds past the TTFT SLO (the even mix at 64 instances,
    rate scale 26.6, t = 395-420 s: 61:3 held against 60:4 at 0.71-0.84x and 0.70-0.83x of the rate, its TPOT
    predicted at 0.33-0.35 s in four of the six rounds against 60:4's 0.07-0.13 s, and the arrivals of t = 405-435 s
    met 0.63 and 0.62, 0.76 and 0.87 with the move);
    when neither meets the SLOs at any rate, the backlog worked off sooner by the hysteresis (relative; from
    never, at all), or where both recover as soon, the score down by the hysteresis (absolute) and by
    MIN_RELATIVE_GAIN of it."""
    if target.capacity:
        what = f"capacity {current.capacity:.2f}x -> {target.capacity:.2f}x the rate"
        if current.capacity < 1.0 <= target.capacity and target.capacity >= current.capacity * (1 + MEETS_TODAY_GAIN):
            return True, f"{what} (meets today's rate)"
        if (tpot_slo_s is not None and target.capacity < 1.0 and not meets_tpot(current, tpot_slo_s)
                and meets_tpot(target, tpot_slo_s) and target.capacity >= current.capacity * (1 - hysteresis)):
            return True, f"{what} (meets the TPOT SLO at today's rate, which the current layout misses)"
        needed = hysteresis if capacity_hysteresis is None else capacity_hysteresis
        ok = target.capacity >= current.capacity * (1 + needed) and target.capacity > current.capacity
        return ok, what
    if recovers(target, current):
        if target.recovery_s < NEVER:
            what = f"backlog worked off in {_seconds(current.recovery_s)} -> {_seconds(target.recovery_s)}"
            return target.recovery_s <= current.recovery_s * (1 - hysteresis), what
        what = f"backlog grows by {-current.drain_rate:.1f} -> {-target.drain_rate:.1f} prompts/s"
        return -target.drain_rate <= -current.drain_rate * (1 - hysteresis), what
    needed = max(hysteresis, MIN_RELATIVE_GAIN * current.score)
    return current.score - target.score >= needed, f"score {current.score:.3f} -> {target.score:.3f}"


def heading_pays(cfg: PlannerConfig, state: PlannerState, current: Prediction, target: Prediction,
                 traffic: Traffic, heading_allowed: bool = True) -> tuple[bool, str, str]:
    """(whether heading for `target` pays, why, the hysteresis applied as a hold names it): `gain_enough` with
    the router's first seconds' larger capacity hysteresis, or a committed target. From a layout the planner never
    heads for (`heading_allowed` false: no prefill and decode pair nor null worker, where moves by hand or on the
    workers themselves led), with no hysteresis: it guards the planner's own layouts against flapping, not one it
    would not have chosen."""
    if not heading_allowed:
        pays, what = gain_enough(current, target, 0.0, 0.0, cfg.tpot_slo_s)
        return pays, f"{what} (from a layout the planner never heads for)", "0"
    young = young_hysteresis(cfg.hysteresis, traffic, cfg.window_s)
    pays, what = gain_enough(current, target, cfg.hysteresis, young, cfg.tpot_slo_s)
    if state.committed == target.pools and not pays:
        pays, what = True, f"{what} (committed)"
    named = f"{cfg.hysteresis:g}"
    if young > cfg.hysteresis:
        named += f", {young:.2f} over the window's first {traffic.span_s:.0f} s"
    return pays, what, named


def candidates(now: float, cfg: PlannerConfig, state: PlannerState, loads: list[WorkerLoad],
               predictor: Any, load: PoolLoad, traffic: Traffic, overloaded: bool = False,
               queued_answers: Optional[float] = None) -> list[Candidate]:
    """Every single move, each predicted in the layout the cluster heads for; the fastest workers to
    drain first (they win ties). `overloaded`: the reversal cooldown yields; `queued_answers`: see
    `PlannerState.reversal`."""
    pools = pool_counts(loads)
    heading = heading_for(pools, state)
    predictions: dict[tuple[str, str], Optional[Prediction]] = {}
    out = []
    for w in sorted(loads, key=lambda w: (drain_work(w), w.url)):
        blocked = state.worker_blocked(now, w.url, cfg, overloaded, queued_answers)
        for dst in MODES:
            if dst == w.mode:
                continue
            reason = (blocked or handing_over(w, dst) or layout_problem(pools, w.mode, dst, cfg.min_per_pool)
                      or ("" if overloaded else state.reversal(now, w.mode, dst, cfg, queued_answers)))
            if (w.mode, dst) not in predictions:
                predictions[w.mode, dst] = rated(predictor, after_move(heading, w.mode, dst), load, traffic)
            out.append(Candidate(url=w.url, src=w.mode, dst=dst, legal=not reason, reason=reason,
                                 prediction=predictions[w.mode, dst]))
    return out


def toward(target: Prediction, heading: dict[str, int], legal: list[Candidate]) -> Optional[Candidate]:
    """The legal move that takes a worker from a pool above the target's size to one below it, the one
    whose layout ranks best (ties: least to drain, as `legal` is ordered)."""
    out = None
    for c in legal:
        if heading[c.src] > target.pools[c.src] and heading[c.dst] < target.pools[c.dst]:
            if out is None or better(c.prediction, out.prediction):
                out = c
    return out


def _hold(now: float, why: str, reason: str, current: Optional[Prediction] = None,
          cands: Optional[list[Candidate]] = None, best: Optional[Candidate] = None,
          target: Optional[Prediction] = None) -> Decision:
    return Decision(at=now, kind="hold", why=why, reason=reason, current=current, candidates=cands or [], best=best,
                    target=target)


def decide(now: float, cfg: PlannerConfig, state: PlannerState, loads: list[WorkerLoad], traffic: Traffic,
           cost: Any = None) -> Decision:
    """The decision for this interval. `loads`: the workers in a pool as the interval began (healthy, not
    switching); those whose move started since serve no pool, but their queued prompts still tell the mix."""
    if cfg.mode == "static":
        return _hold(now, "static", "planner is static")
    # the prompts waiting on a worker that moves are still arrivals of the mix: a move does not change what arrived
    traffic, queued_note = queued_mix(PoolLoad(loads), traffic)
    queued_answers = traffic.mean_output_tokens if queued_note else None
    loads = [w for w in loads if w.url not in state.in_flight]  # a moving worker serves no pool
    pools = pool_counts(loads)
    heading = heading_for(pools, state)
    load = PoolLoad(loads)
    predictor = make_predictor(cfg, cost, pools)
    current = predictor.predict(heading, load, traffic)
    if current is None:
        return _hold(now, "no_observations", "no --planner-profile, and the router has not yet timed both the TTFT "
                     "and the TPOT of requests on either path (a stream by its tokens, a whole answer by the "
                     "server's meta_info or Server-Timing; a TPOT needs answers of 2 tokens or more)")
    cands = candidates(now, cfg, state, loads, predictor, load, traffic, queued_answers=queued_answers)
    if traffic.arrival_rate <= 0:
        return _hold(now, "no_arrivals", "no arrivals in the window", current, cands)
    if cost is not None and traffic.mean_input_tokens <= 0:
        return _hold(now, "no_lengths", "no request finished in the window yet: lengths unknown", current, cands)
    current.capacity = capacity(predictor, heading, load, traffic) or 0.0
    target = best_layout(predictor, heading, load, traffic, cfg.min_per_pool, current)
    if target is None:
        return _hold(now, "no_layout", "no allowed layout", current, cands)
    target = kept_target(predictor, state, heading, target, load, traffic, cfg.min_per_pool)
    if target.pools == heading:
        state.committed = None
    # overloaded: the layout heading for misses the SLOs at every rate (its backlog alone breaks them) and the
    # target meets them at some rate. A reversal cooldown that kept the cluster there would cost every request
    # until it ends (a move toward code-like pools just before a conversation phase, say), so it yields; also
    # where the target does not meet today's rate (a conversation phase arriving on the backlog of a code
    # burst): it serves a share of the requests, the heading layout none
    overloaded = current.capacity == 0 and target.capacity > 0
    if overloaded:
        cands = candidates(now, cfg, state, loads, predictor, load, traffic, overloaded=True,
                           queued_answers=queued_answers)
    allowed = target_allowed(heading, heading, cfg.min_per_pool)
    pays, what, hysteresis = heading_pays(cfg, state, current, target, traffic, allowed)
    why = (f"{what} at {_brief(target.pools)}" + (" (overloaded: no reversal cooldown)" if overloaded else "")
           + queued_note)
    if not pays and target.pools == heading:
        return _hold(now, "at_best", f"the layout it heads for is the best one: {why}", current, cands, target=target)
    if not pays:
        best_what = "the best layout"
        if not allowed:  # a move by hand (forced) led there
            best_what = ("the best layout the planner may head for (not the current one: it has no prefill and "
                         "decode pair nor null worker)")
        return _hold(now, "gain_too_small", f"{best_what} gains too little: {why} (hysteresis {hysteresis})",
                     current, cands, target=target)
    legal = [c for c in cands if c.legal and c.prediction is not None]
    best = toward(target, heading, legal)
    if len(state.in_flight) >= cfg.max_concurrent_moves:
        return _hold(now, "moves_in_flight", f"{len(state.in_flight)} move(s) in flight; {why}", current, cands, best,
                     target)
    if best is None:
        blocked = sorted({c.reason for c in cands if not c.legal and heading[c.src] > target.pools[c.src]
                          and heading[c.dst] < target.pools[c.dst]})
        return _hold(now, "no_legal_move", f"no legal move toward the target ({'; '.join(blocked) or 'none'}); {why}",
                     current, cands, target=target)
    state.committed = target.pools
    # advise: the move reported, not started (callers start only a "move"); the next round decides from the same pools
    return Decision(at=now, kind="advise" if cfg.mode == "advise" else "move", url=best.url, src=best.src,
                    dst=best.dst, current=current, best=best, candidates=cands, target=target,
                    answers=traffic.mean_output_tokens,
                    reason=f"{why}, {moves_between(heading, target.pools)} move(s) away; "
                           f"{'would move' if cfg.mode == 'advise' else 'moving'} {best.url} {best.src}->{best.dst}")


def _seconds(recovery_s: float) -> str:
    return "never" if recovery_s >= NEVER else f"{recovery_s:.0f} s"


def _brief(pools: dict[str, int]) -> str:
    return f"{pools[PREFILL]}P:{pools[DECODE]}D:{pools[NULL]}N"
