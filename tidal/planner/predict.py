"""Next-interval TTFT and TPOT for a pool layout.

A layout is the number of workers per mode (P prefill, D decode, N null). The router
sends a request down the PD path (a prefill+decode pair) or the whole path (one null
worker; a decode worker when there is no prefill worker and no null one). Its
join-the-shorter-queue rule keeps about as many requests on each decode worker as on
each null worker, so the arrivals split D : N between the two paths.

With a cost model (a profile; lambda = arrival rate, I and O = mean input and output
tokens over the window, T = the planner interval):

- prefill worker (PD path): a queue. Each takes lambda_w = lambda * share / P requests per
  second of p seconds each, p = the mean of prefill_seconds over the window's prompt-length
  deciles (prefill is convex in the length: a heavy-tailed mix costs more than its mean
  prompt; prefill_seconds(I) when no deciles). One prompt at a time: wait = lambda_w *
  E[s^2] / (2(1-rho)), rho = lambda_w * p (M/G/1, the second moment over the same deciles),
  capped at T, and T*rho once rho >= 1 (the queue grows through the interval). A loaded
  worker batches: the prompts that arrive during a step run in the next one, a step of k
  prompts costs T(k) = k p - (k-1) s (s: what a step pays once, from the profile's batch
  points), so k = lambda_w T(k), up to the step's token budget over I; a prompt then waits
  for the step in progress (T(k)/2) and runs in the next, and a queue grows only once full
  steps fall behind (M/D/1 of full steps). The wait is the smaller of the two; when even
  the mean rate outruns full steps, its excess E over their pace adds H * E (H below: the
  queue grows while that rate lasts, whatever the TTFT SLO). TTFT =
  backlog + wait + T(k) + kv_transfer_seconds(I), where backlog = the pool's queued
  prefill tokens (from /get_load) / P, passed in full steps.
- decode worker (PD path): TPOT = decode_step_seconds(B, B*(I + O/2)) at the batch B that
  Little's law gives, B = lambda_w * O * TPOT (solved by iteration), at least the pool's
  running requests / D now, at most the KV capacity max_total_tokens / (I + O) and the
  profile's max_running_requests (when it records it). At that
  cap the pool is saturated and the excess waits for a slot, mu = B_max / (O * TPOT) requests
  per second: the mean rate's excess for as long as that rate lasts, E = max(0, lambda_mean_w/mu - 1),
  TTFT += H * E with H = SATURATED_HORIZON_S (300 s: a pool short of the mean rate never
  catches up), and a burst's beyond it for one interval, TTFT += T * max(0, lambda_w/mu - 1 - E).
- null worker: both at once. Prefill runs first and stalls decode, so its TPOT is the
  decode step divided by (1 - rho_prefill), and its TTFT is the prefill queue above
  (plus one decode step, the batch it waits behind), with the same KV cap.

Bursts: every prefill queue above runs at lambda * Traffic.prefill_peak_ratio (the rate 90% of
the burst history's prompts met within a TTFT SLO, or the window's rate when that is higher); a
PD decode worker at the mean lambda (a burst of short answers only grows its batch), or, with
`decode_bursts` set (the planner's robustness test of near-best layouts), at the decodes' burst
rate capped by what the prefill pool passes on (P k / T(k) at full batched steps); a null
worker's decode stall and batch at the peak scaled down for answers that outlast the TTFT SLO
at the TPOT SLO (`_decode_peak`).

A path's score is max(TTFT / TTFT SLO, TPOT / TPOT SLO); a layout's is its worst path's
(below 1: both SLOs met). Without a cost model the observed latencies of each path are
scaled by the change of the per-worker arrival rate (TTFT by the prefill side's, TPOT by
the decode side's; linear, which overstates small changes near idle and understates
queueing near saturation); a path with no observation borrows the other's.

A moved worker's queued prefill tokens and running requests count as spread over its old
pool's remaining workers (pessimistic: it drains them itself before it switches).

Not modelled: prefix-cache hits (I counts whole prompts), chunked prefill's interleaving
on PD prefill workers, TP pairing, the capacity lost while a worker drains and switches.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional, Sequence

from tidal.config import ServerArgs, prefill_step_tokens
from tidal.planner.schema import (
    DECODE,
    NULL,
    NULL_PATH,
    PD_PATH,
    PREFILL,
    PathPrediction,
    Prediction,
    Traffic,
    WorkerLoad,
)

UNSERVABLE = 1e9  # score of a layout that serves nothing
NEVER = 1e9  # recovery_s of a layout whose prefill side passes no more prompts than arrive
# a prefill step's token budget when the cost model does not record the server's: the server's default
DEFAULT_PREFILL_STEP_TOKENS = prefill_step_tokens(ServerArgs.chunked_prefill_size, ServerArgs.max_prefill_tokens)
MAX_STALL = 0.95  # a null worker never spends more than this fraction prefilling, in the model
# a decode pool saturated at the window's *mean* rate stays saturated while that rate lasts, so its excess queues
# for this long (a constant, as long as the default --planner-burst-window-s), not one interval: charged one
# interval, a pool 11% short of a chat mix's decodes added 0.6 s to the TTFT and ranked 2.2x today's rate in
# capacity
SATURATED_HORIZON_S = 300.0
FIXED_POINT_ITERATIONS = 30


class PoolLoad:
    """The sums over each mode's workers that the prediction needs (from the snapshots)."""

    def __init__(self, loads: list[WorkerLoad]) -> None:
        self.count = {m: 0 for m in (PREFILL, DECODE, NULL)}
        self.queued_prefill_tokens = dict.fromkeys(self.count, 0)
        self.waiting = dict.fromkeys(self.count, 0)
        # the waiting requests' whole prompts; None where a worker of the mode does not report them
        self.waiting_prompt_tokens: dict[str, Optional[int]] = dict.fromkeys(self.count, 0)
        self.running = dict.fromkeys(self.count, 0)
        self.kv_tokens_total = 0
        for w in loads:
            self.count[w.mode] += 1
            self.queued_prefill_tokens[w.mode] += w.queued_prefill_tokens
            self.waiting[w.mode] += w.waiting_reqs
            known = self.waiting_prompt_tokens[w.mode]
            self.waiting_prompt_tokens[w.mode] = (None if known is None or w.waiting_prompt_tokens < 0
                                                  else known + w.waiting_prompt_tokens)
            # a decode server's PD requests waiting for their KV hold memory but are not in its batch
            self.running[w.mode] += w.decoding_reqs if w.decoding_reqs >= 0 else w.running_reqs
            self.kv_tokens_total = max(self.kv_tokens_total, w.kv_tokens_total)


def path_shares(pools: dict[str, int]) -> dict[str, float]:
    """How the router's dispatcher splits arrivals between the PD and the whole path."""
    p, d, n = pools[PREFILL], pools[DECODE], pools[NULL]
    if p and d:
        return {PD_PATH: d / (d + n), NULL_PATH: n / (d + n)} if n else {PD_PATH: 1.0}
    if n or (d and not p):
        return {NULL_PATH: 1.0}
    return {}


def whole_workers(pools: dict[str, int]) -> tuple[str, int]:
    """The mode and number of workers that take whole requests."""
    if pools[NULL]:
        return NULL, pools[NULL]
    return DECODE, pools[DECODE] if not pools[PREFILL] else 0


def path_score(ttft_s: float, tpot_s: float, ttft_slo_s: float, tpot_slo_s: float) -> float:
    return max(ttft_s / ttft_slo_s, tpot_s / tpot_slo_s)


def queue_wait(rho: float, service_s: float, interval_s: float) -> float:
    if rho >= 1.0:
        return interval_s * rho
    return min(rho * service_s / (2 * (1 - rho)), interval_s)


class CostPredictor:
    """The queueing model of the module docstring, on a cost model (duck-typed:
    prefill_seconds, decode_step_seconds, kv_transfer_seconds, max_total_tokens)."""

    def __init__(self, cost: Any, ttft_slo_s: float, tpot_slo_s: float, interval_s: float) -> None:
        self.cost = cost
        self.deciles: Sequence[int] = ()
        self.peak = 1.0  # the prefill queues' arrival rate over the mean (Traffic.prefill_peak_ratio)
        self.decode_peak = 1.0  # the decodes' (_decode_peak)
        self._moments: dict[tuple[int, ...], tuple[float, float]] = {}
        self.ttft_slo_s, self.tpot_slo_s, self.interval_s = ttft_slo_s, tpot_slo_s, interval_s
        # the most new tokens one prefill step takes (the server's chunked-prefill budget)
        self.prefill_step_tokens = getattr(cost, "prefill_step_tokens", 0) or DEFAULT_PREFILL_STEP_TOKENS
        # PD decode workers at the decodes' burst rate, capped by what the prefill pool passes (full steps), instead
        # of the mean rate: the planner's test of a near-best layout's decode pool (decide.robust)
        self.decode_bursts = False

    def predict(self, pools: dict[str, int], load: PoolLoad, traffic: Traffic) -> Prediction:
        shares = path_shares(pools)
        if not shares:
            return Prediction(pools=dict(pools), paths={}, score=UNSERVABLE, note="no path serves requests")
        inp = max(traffic.mean_input_tokens, 1.0)
        self.deciles = traffic.input_tokens_deciles
        self.peak = max(1.0, traffic.prefill_peak_ratio)
        out = max(traffic.mean_output_tokens, 1.0)
        self.decode_peak = self._decode_peak(out)
        paths = {}
        recovery, drain = 0.0, math.inf
        # a null worker prefills before it decodes (Batching.prefill_or_decode): with a backlog it runs full steps
        # while its KV and running-request limits admit more, its answers waiting (the TPOT the score sees)
        pace = self._full_step_pace(inp)  # one worker's, the same on every path
        for path, share in shares.items():
            lam = traffic.arrival_rate * share
            ttft, tpot = (self._pd(pools, load, lam, inp, out) if path == PD_PATH
                          else self._whole(pools, load, lam, inp, out))
            paths[path] = PathPrediction(share=share, ttft_s=ttft, tpot_s=tpot,
                                         score=path_score(ttft, tpot, self.ttft_slo_s, self.tpot_slo_s))
            mode, n = (PREFILL, pools[PREFILL]) if path == PD_PATH else whole_workers(pools)
            backlog = load.queued_prefill_tokens[mode]
            surplus = n * pace - lam
            if backlog > 0 or surplus <= 0:  # a path without a backlog that falls behind grows one
                drain = min(drain, surplus)
                recovery = max(recovery, min(NEVER, backlog / inp / surplus) if surplus > 0 else NEVER)
        return Prediction(pools=dict(pools), paths=paths, score=max(p.score for p in paths.values()),
                          recovery_s=recovery, drain_rate=None if drain == math.inf else drain, note="cost model")

    def _full_step_pace(self, inp: float) -> float:
        """Prompts a second one worker passes at full batched prefill steps (0 if a step costs nothing known)."""
        p, _ = self._prefill_moments(inp, self.deciles)
        batch, step = self._prefill_batch(math.inf, inp, p)
        return batch / step if step > 0 else 0.0

    def _prefill_queue(self, lam_w: float, backlog_tokens: float, inp: float,
                       deciles: Sequence[int] = (), mean_lam_w: float = 0.0) -> tuple[float, float]:
        """(TTFT without transfer or decode, fraction of the time prefilling) of one worker's prefill queue.

        One prompt at a time, as M/G/1 (with the prompt lengths' deciles: the mean and the second moment of
        the prefill time over them). Once prompts arrive faster than one step takes, the worker runs those
        that arrived during a step in its next one (`_prefill_batch`): a prompt then waits for the step in
        progress and runs in the next, and the queue grows only once a step is at the token budget and
        still too slow. The wait is the smaller of the two, so it rises with the rate. A queue that grows
        at the mean rate (`mean_lam_w`, the burst rate's `lam_w`) grows for as long as that rate lasts:
        its excess over the full steps' pace waits SATURATED_HORIZON_S, as a decode pool's does."""
        p, residual = self._prefill_moments(inp, deciles)
        batch, step = self._prefill_batch(lam_w, inp, p)
        full_batch, full_step = self._prefill_batch(math.inf, inp, p)
        if batch < full_batch:
            batched_wait = step / 2
        else:
            batched_wait = step / 2 + queue_wait(lam_w * full_step / full_batch, full_step, self.interval_s)
        wait = min(queue_wait(lam_w * p, 2 * residual, self.interval_s), batched_wait)
        wait += SATURATED_HORIZON_S * max(0.0, mean_lam_w * full_step / full_batch - 1.0)
        backlog_s = backlog_tokens * full_step / full_batch / inp if inp > 0 else 0.0
        return backlog_s + wait + step, lam_w * step / batch

    def _prefill_batch(self, lam_w: float, inp: float, p: float) -> tuple[float, float]:
        """(prompts per prefill step, that step's seconds) at lam_w arrivals a second: the prompts that
        arrive during one step make the next, k = lam_w T(k) with T(k) = k p - (k - 1) s (s: what a step
        pays once, the cost model's prefill_shared_seconds), so k = lam_w s / (1 - lam_w (p - s)); at
        least 1, at most the step's token budget over the mean prompt (all of it once lam_w (p - s) >= 1).
        Batching is what lets a loaded prefill worker pass more than 1/p prompts a second (at 64 instances
        on the conversation trace, ~290-token prompts: 1.3x)."""
        shared_fn = getattr(self.cost, "prefill_shared_seconds", None)
        shared = min(shared_fn(inp), p) if shared_fn is not None else 0.0
        most = max(1.0, self.prefill_step_tokens / inp)
        if shared <= 0 or most <= 1 or lam_w <= 0:
            return 1.0, p
        spare = 1.0 - lam_w * (p - shared)
        batch = most if spare <= 0 else min(most, max(1.0, lam_w * shared / spare))
        return batch, batch * p - (batch - 1) * shared

    def _prefill_moments(self, inp: float, deciles: Sequence[int]) -> tuple[float, float]:
        """(mean prefill time, mean residual service time): over the prompt-length deciles when known, else
        of the mean prompt (a deterministic service time)."""
        if deciles:
            return self._decile_moments(tuple(deciles))
        p = self.cost.prefill_seconds(int(inp))
        return p, p / 2

    def with_decode_bursts(self) -> "CostPredictor":
        """A view of this predictor (same cost model and memo) with `decode_bursts` set."""
        view = copy.copy(self)
        view.decode_bursts = True
        return view

    def _decode_peak(self, out: float) -> float:
        """The arrival rate over the mean that a null worker's decode sees (the prefills that stall it, the
        batch it joins): the prompts' peak for an answer that lasts no longer than the peak's span (the TTFT
        SLO) at the TPOT SLO, less as it lasts longer: a long answer averages over the bursts."""
        lasts_s = max(1.0, out) * self.tpot_slo_s
        return 1.0 + (self.peak - 1.0) * min(1.0, self.ttft_slo_s / lasts_s)

    def _decile_moments(self, deciles: tuple[int, ...]) -> tuple[float, float]:
        """(mean prefill time, mean residual service time) over the prompt-length deciles; memoized, as
        the planner predicts many layouts of one traffic."""
        if deciles not in self._moments:
            times = [self.cost.prefill_seconds(int(n)) for n in deciles]
            p = sum(times) / len(times)
            self._moments[deciles] = (p, sum(t * t for t in times) / len(times) / (2 * p) if p > 0 else 0.0)
        return self._moments[deciles]

    def _batch_cap(self, inp: float, out: float, load: PoolLoad) -> float:
        """The most requests one worker decodes at once: its KV capacity over a request's tokens, and its
        running-request limit when the profile records it."""
        capacity = getattr(self.cost, "max_total_tokens", 0) or load.kv_tokens_total
        cap = max(1.0, capacity / (inp + out)) if capacity else float("inf")
        running = getattr(self.cost, "max_running_requests", 0)
        return min(cap, float(running)) if running else cap

    def _decode(self, lam_w: float, floor_batch: float, inp: float, out: float, load: PoolLoad,
                stall: float, mean_lam_w: float) -> tuple[float, float]:
        """(TPOT, extra TTFT from a saturated KV or running-request limit) of one decoding worker at lam_w
        arrivals a second (a burst's rate, or the mean's, mean_lam_w); stall: the fraction of its time spent
        prefilling. The excess over what the worker passes queues for a slot: a burst's for one interval, the
        mean rate's for SATURATED_HORIZON_S."""
        ctx = inp + out / 2
        cap = self._batch_cap(inp, out, load)
        slow = 1.0 / (1.0 - min(stall, MAX_STALL))
        tpot = self.cost.decode_step_seconds(1, int(ctx)) * slow
        batch = 0.0
        for _ in range(FIXED_POINT_ITERATIONS):
            nxt = min(cap, max(1.0, floor_batch, lam_w * out * tpot))
            if abs(nxt - batch) < 1e-3 * nxt:
                break
            batch = nxt
            tpot = self.cost.decode_step_seconds(max(1, round(batch)), int(batch * ctx)) * slow
        extra_ttft = 0.0
        if batch >= cap and tpot > 0:
            mu = cap / (out * tpot)
            mean_excess = max(0.0, mean_lam_w / mu - 1.0)
            extra_ttft = (self.interval_s * max(0.0, lam_w / mu - 1.0 - mean_excess)
                          + SATURATED_HORIZON_S * mean_excess)
        return tpot, extra_ttft

    def _pd(self, pools: dict[str, int], load: PoolLoad, lam: float, inp: float, out: float) -> tuple[float, float]:
        n_p, n_d = pools[PREFILL], pools[DECODE]
        prefill_ttft, _ = self._prefill_queue(lam * self.peak / n_p, load.queued_prefill_tokens[PREFILL] / n_p,
                                              inp, self.deciles, lam / n_p)
        # at the mean rate: a burst of short answers only grows a decode worker's batch, whose steps stay short
        # (peak-rate decodes ranked 14:2 above the code trace's best split, 15:1, in the simulator)
        lam_d = lam
        if self.decode_bursts:
            pace = self._full_step_pace(inp)
            lam_d = max(lam, min(lam * self.decode_peak, n_p * pace if pace > 0 else lam))
        tpot, extra = self._decode(lam_d / n_d, load.running[DECODE] / n_d, inp, out, load, 0.0, lam / n_d)
        return prefill_ttft + self.cost.kv_transfer_seconds(int(inp)) + extra, tpot

    def _whole(self, pools: dict[str, int], load: PoolLoad, lam: float, inp: float, out: float) -> tuple[float, float]:
        mode, n = whole_workers(pools)
        lam_w = lam / n
        prefill_ttft, rho_peak = self._prefill_queue(lam_w * self.peak, load.queued_prefill_tokens[mode] / n, inp,
                                                     self.deciles, lam_w)
        rho_decode = rho_peak / self.peak * self.decode_peak
        tpot, extra = self._decode(lam_w * self.decode_peak, load.running[mode] / n, inp, out, load, rho_decode,
                                   lam_w)
        return prefill_ttft + tpot + extra, tpot


class ObservedPredictor:
    """No cost model: each path's observed TTFT/TPOT scaled by its per-worker load change."""

    def __init__(self, current: dict[str, int], ttft_slo_s: float, tpot_slo_s: float) -> None:
        self.current = dict(current)
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s

    @staticmethod
    def _per_worker(pools: dict[str, int], path: str) -> tuple[float, float]:
        """Arrival share per worker on the path's prefill side and decode side."""
        share = path_shares(pools).get(path, 0.0)
        if path == PD_PATH:
            return (share / pools[PREFILL], share / pools[DECODE]) if share else (0.0, 0.0)
        _, n = whole_workers(pools)
        return (share / n, share / n) if share else (0.0, 0.0)

    def _reference(self, path: str, traffic: Traffic) -> Optional[tuple[float, float, float, float]]:
        """(TTFT, TPOT, prefill-side load, decode-side load) observed now, own path first."""
        for ref in (path, NULL_PATH if path == PD_PATH else PD_PATH):
            if ref in traffic.ttft_s and ref in traffic.tpot_s:
                x_p, x_d = self._per_worker(self.current, ref)
                if x_p and x_d:
                    return traffic.ttft_s[ref], traffic.tpot_s[ref], x_p, x_d
        return None

    def predict(self, pools: dict[str, int], load: PoolLoad, traffic: Traffic) -> Optional[Prediction]:
        shares = path_shares(pools)
        if not shares:
            return Prediction(pools=dict(pools), paths={}, score=UNSERVABLE, note="no path serves requests")
        paths = {}
        for path, share in shares.items():
            ref = self._reference(path, traffic)
            if ref is None:
                return None
            ttft0, tpot0, x_p0, x_d0 = ref
            x_p, x_d = self._per_worker(pools, path)
            ttft, tpot = ttft0 * x_p / x_p0, tpot0 * x_d / x_d0
            paths[path] = PathPrediction(share=share, ttft_s=ttft, tpot_s=tpot,
                                         score=path_score(ttft, tpot, self.ttft_slo_s, self.tpot_slo_s))
        return Prediction(pools=dict(pools), paths=paths, score=max(p.score for p in paths.values()),
                          note="observed latencies scaled by load (no --planner-profile)")
