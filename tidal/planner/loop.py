"""The planner inside the router: an asyncio task around the pure `decide`.

Every `interval_s` it refreshes each worker's `/get_load`, reads the pools from the
registry and the traffic from the window, decides, logs the decision, and runs a move
through the router's drain-switch-verify path (`RoleMover.move_result`) in the background.
A move that lands while a walk toward a target is unfinished starts the next round at once
(the walk's next moves need not wait out the interval); rounds never overlap.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time
from typing import Any, Callable, Optional

import msgspec

from tidal.planner.decide import PlannerState, decide, floor_warning, heading_for, layout_problem, pool_counts
from tidal.planner.schema import NULL_PATH, PD_PATH, Decision, PlannerConfig, Prediction, Traffic, WorkerLoad
from tidal.planner.window import TrafficWindow
from tidal.router.workers import HANDOVER_KEY, MODES, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

DECISIONS_KEPT = 50
DECIDE_TRIES = 3  # decisions in a thread made stale by a move meanwhile, before one inline


def worker_load(w: Worker) -> WorkerLoad:
    load = w.load or {}
    total, waiting = load.get("num_reqs", 0), load.get("num_waiting_reqs", 0)
    return WorkerLoad(url=w.url, mode=w.mode, running_reqs=max(0, total - waiting), waiting_reqs=waiting,
                      queued_prefill_tokens=load.get("num_queued_prefill_tokens", 0),
                      kv_tokens_used=load.get("num_tokens", 0), kv_tokens_total=load.get("max_total_tokens", 0),
                      in_flight=w.in_flight, decoding_reqs=load.get("num_decoding_reqs", -1),
                      waiting_prompt_tokens=load.get("num_waiting_prompt_tokens", -1),
                      prompts_received=load.get("prompts_received_total", -1),
                      prompt_tokens_received=load.get("prompt_tokens_received_total", -1),
                      handing_over_from=str(load.get(HANDOVER_KEY) or ""))


def pool_loads(registry: WorkerRegistry) -> list[WorkerLoad]:
    """Every worker in a pool now (healthy and not being moved)."""
    return [worker_load(w) for mode in MODES for w in registry.pool(mode)]


def load_cost_model(path: Optional[str]) -> Any:
    if not path:
        return None
    from tidal.profile.cost import CostModel, flat_curves, host_mismatch

    cost = CostModel.from_file(path)
    for warning in (host_mismatch(cost.profile), flat_curves(cost.profile)):
        if warning:
            logger.warning("--planner-profile %s: %s", path, warning)
    return cost


def _summary(d: Decision, wall_offset: float = 0.0) -> dict:
    """A decision without its candidate list (kept for the status's history); `at_unix`: its time on the wall
    clock (the planner's own, `at`, is monotonic), to match the router's log lines."""
    out = msgspec.to_builtins(d)
    out.pop("candidates", None)
    out["at_unix"] = round(d.at + wall_offset, 3)
    return out


class PlannerLoop:
    def __init__(self, cfg: PlannerConfig, st: Any, cost: Any = None, profile_path: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.st = st  # the router's state: registry, checker, metrics, and a `mover`
        self.cost = cost
        self.profile_path = profile_path
        self.clock = clock
        self.state = PlannerState()
        self.window = TrafficWindow(cfg.window_s, clock(), cfg.burst_window_s, cfg.ttft_slo_s)
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=DECISIONS_KEPT)
        self.last: Optional[Decision] = None
        self.last_loads: list[WorkerLoad] = []
        self._task: Optional[asyncio.Task] = None
        self._walk: Optional[asyncio.Task] = None  # a round started by a move that landed mid-walk
        self._moves: set[asyncio.Task] = set()
        self._round = asyncio.Lock()
        self._last_repeat: Optional[tuple] = None  # the last decision, when a hold or advice (`_record`)
        self._warned_extrapolation = False
        self._hand: dict[str, Decision] = {}  # the moves by hand in flight, by worker

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.cfg.mode != "static" and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._walk, *self._moves) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def _loop(self) -> None:
        await self._baseline()
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self._guarded_tick()

    async def _baseline(self) -> None:
        """The workers' counters as the planner starts (`TrafficWindow.baseline`)."""
        try:
            loads = await self._fresh_loads()
            self.window.baseline(self.clock(), loads)
            warning = floor_warning(pool_counts(loads), self.cfg.min_per_pool)
            if warning:
                logger.warning("planner: %s", warning)
        except Exception:  # the first round takes its own snapshot as the baseline instead
            logger.exception("planner baseline failed")

    async def _guarded_tick(self) -> None:
        try:
            await self.tick()
        except Exception:  # one bad round never stops the planner
            logger.exception("planner round failed")

    def _walk_on(self) -> None:
        """A move landed and the target is still ahead: the next round starts now."""
        if self.state.committed is not None and (self._walk is None or self._walk.done()):
            self._walk = asyncio.get_running_loop().create_task(self._guarded_tick())

    # ------------------------------------------------------------ one interval

    async def tick(self) -> Decision:
        """One round: refresh every load, then decide until the planner holds; the moves toward one
        target start together, up to --planner-max-concurrent-moves in flight. Returns the last decision."""
        async with self._round:
            return await self._tick()

    async def _fresh_loads(self) -> list[WorkerLoad]:
        """Every healthy worker's /get_load, refreshed now, as the planner reads them."""
        registry: WorkerRegistry = self.st.registry
        await asyncio.gather(*(self.st.checker.refresh_load(w) for w in registry.all() if w.healthy))
        return pool_loads(registry)

    async def _tick(self) -> Decision:
        loads = await self._fresh_loads()
        now = self.clock()
        self.last_loads = loads
        traffic = self.window.traffic(now, self.last_loads)
        self._warn_extrapolation(traffic)
        while True:
            d = await self._decide(now, traffic)
            self.last = d
            self._keep(d, repeated=self._record(d, traffic))
            if d.kind != "move":
                return d
            problem = self._problem_now(d)
            if problem:  # a decision taken on pools that moved on: never seen since decisions retake them
                d.outcome = f"not started: {problem}"
                logger.error("planner: move %s %s->%s %s", d.url, d.src, d.dst, d.outcome)
                return d
            self.state.started(now, d.url, d.src, d.dst, d.answers)
            task = asyncio.get_running_loop().create_task(self._move(d))
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)

    def _warn_extrapolation(self, traffic: Traffic) -> None:
        """Once: the window's prompts (their 95th percentile) past twice the profile's longest measured prefill."""
        if self.cost is None or self._warned_extrapolation or not traffic.input_tokens_deciles:
            return
        from tidal.profile.cost import prefill_extrapolation

        warning = prefill_extrapolation(self.cost.profile, max(traffic.input_tokens_deciles))
        if warning:
            self._warned_extrapolation = True
            logger.warning("--planner-profile %s: %s (the 95th percentile of the window's); the cost model "
                           "extrapolates: measure longer prompts with `tidal profile`", self.profile_path, warning)

    async def _decide(self, now: float, traffic: Traffic) -> Decision:
        """`decide` in a thread, on a copy of the state: it predicts hundreds of layouts (~0.1 s at 16 or 64
        workers), which inline would stall every stream the router proxies. A move that started or ended
        meanwhile (a move by hand too) makes the decision stale: it is taken again, on the pools as they are
        now, after a few tries inline. (Taken on the interval's pools instead, a landed move's worker would count
        in its old pool and out of flight: at 1P:2D with one decode worker moved, the planner saw 1P:2D again and
        moved the other one, leaving no decode worker.)"""
        for _ in range(DECIDE_TRIES):
            version, copy_ = self.state.version, copy.deepcopy(self.state)
            d = await asyncio.to_thread(decide, now, self.cfg, copy_, self.last_loads, traffic, self.cost)
            if self.state.version == version:
                self.state.committed = copy_.committed
                return d
            self.last_loads = pool_loads(self.st.registry)  # the loads as last refreshed, in today's pools
        return decide(now, self.cfg, self.state, self.last_loads, traffic, self.cost)

    def _problem_now(self, d: Decision) -> str:
        """Why the move decided may not start on the pools as the registry holds them now ("" when it may): the
        last check that no decision, stale or not, empties a pool or leaves no path."""
        serving = [w for w in pool_loads(self.st.registry) if w.url not in self.state.in_flight]
        if not any(w.url == d.url and w.mode == d.src for w in serving):
            return f"{d.url} is not serving in the {d.src} pool"
        return layout_problem(pool_counts(serving), d.src, d.dst, self.cfg.min_per_pool)

    async def _move(self, d: Decision) -> None:
        try:
            status, body = await self.st.mover.move_result(d.url, d.dst)
        except Exception as e:  # the mover already put the worker back
            status, body = 0, {"error": {"message": f"{type(e).__name__}: {e}"}}
        ok = status == 200
        self.state.finished(self.clock(), d.url, ok, self.cfg)
        _settle(d, status, body)
        self.st.metrics.planner_moves.labels(d.src, d.dst, "ok" if ok else "failed").inc()
        log = logger.info if ok else logger.warning
        log("planner: move %s %s->%s %s%s", d.url, d.src, d.dst, d.outcome, _took(d))
        if ok:
            self._walk_on()

    # ------------------------------------------------------------ moves by hand

    def heading_layout(self) -> dict[str, int]:
        """Workers per pool once every move in flight (the planner's and by hand) has landed."""
        return heading_for(pool_counts(pool_loads(self.st.registry)), self.state)

    def hand_move_started(self, url: str, src: str, dst: str, forced: bool = False) -> None:
        """A move through /admin/set_worker_role: in flight like the planner's own, with the same cooldowns
        (reversal, worker) from its start and end; the planner's target, set before it, is dropped. It shows among
        the status's decisions as kind "hand" and counts in `tidal_router:hand_moves_total` once it ends."""
        self.state.started(self.clock(), url, src, dst)
        self.state.committed = None
        how = "moved by hand (POST /admin/set_worker_role" + (', "force": true)' if forced else ")")
        self._hand[url] = self._hand_record(url, src, dst, how)
        logger.info("planner: a move by hand %s %s->%s%s; its cooldowns start now", url, src, dst,
                    " (forced)" if forced else "")

    def hand_move_finished(self, url: str, status: int, body: Any) -> None:
        ok = status == 200
        self.state.finished(self.clock(), url, ok, self.cfg)
        d = self._hand.pop(url, None)
        if d is not None:
            _settle(d, status, body if isinstance(body, dict) else {})
            self.st.metrics.hand_moves.labels(d.src, d.dst, "ok" if ok else "failed", "router").inc()
            (logger.info if ok else logger.warning)("planner: move by hand %s %s->%s %s%s", url, d.src, d.dst,
                                                    d.outcome, _took(d))

    def forget_worker(self, url: str) -> None:
        """A worker removed from the router: its cooldown and backoff go with it (one added again at that URL,
        a new server perhaps, starts afresh); a move of it still in flight ends as it would."""
        self.state.workers.pop(url, None)

    def switched_behind(self, url: str, src: str, dst: str) -> None:
        """A worker found in another mode than the router knew, switched on its own route: a move by hand,
        started and ended now, with its cooldowns, so that the next round does not undo it at once."""
        logger.warning("planner: worker %s switched %s->%s behind the router (on its own switch route, or restarted); "
                       "counted as a move by hand: its cooldowns start now", url, src, dst)
        self.state.started(self.clock(), url, src, dst)
        self.state.committed = None
        self.state.finished(self.clock(), url, True, self.cfg)
        d = self._hand_record(url, src, dst, "found in another mode by the health check: switched on the worker's "
                                             "own route, or restarted")
        d.outcome = "ok"
        self.st.metrics.hand_moves.labels(src, dst, "ok", "worker").inc()

    def _hand_record(self, url: str, src: str, dst: str, reason: str) -> Decision:
        d = Decision(at=self.clock(), kind="hand", reason=reason, url=url, src=src, dst=dst)
        self.decisions.append(d)
        return d

    def _keep(self, d: Decision, repeated: bool) -> None:
        """Into the status's history. A hold or advice that repeats the newest entry takes its place, counting the
        rounds (an idle router holds every interval, and 50 such holds would push every move out of the history)."""
        last = self.decisions[-1] if self.decisions else None
        if repeated and last is not None and (last.kind, last.why) == (d.kind, d.why):
            d.repeats = last.repeats + 1
            self.decisions[-1] = d
        else:
            self.decisions.append(d)

    def _record(self, d: Decision, traffic: Any) -> bool:
        """Metrics and the log line; True when the decision repeats the last one logged (a hold for the same cause,
        or the same advice, on the same pools)."""
        m = self.st.metrics
        m.planner_decisions.labels(d.kind).inc()
        _set_latency_gauges(m.planner_predicted_ttft, m.planner_predicted_tpot, d.current)
        _set_observed(m.planner_observed_ttft, m.planner_observed_tpot, traffic)
        pred = d.current
        pools = pool_counts(self.last_loads)
        # a hold for the same cause, or the same advice, on the same pools as the last one logged is a DEBUG line:
        # an idle router would repeat it every interval, an advising one every interval until someone moves
        same = ((d.kind, d.why, d.url, d.dst, tuple(sorted(pools.items())))
                if d.kind in ("hold", "advise") else None)
        repeated = same is not None and same == self._last_repeat
        self._last_repeat = same
        (logger.debug if repeated else logger.info)(
            "planner: %s (%s); pools %s; rate %.2f/s in %.0f out %.0f; predicted %s", d.kind, d.reason, pools,
            traffic.arrival_rate, traffic.mean_input_tokens, traffic.mean_output_tokens, _brief(pred))
        return repeated

    # ------------------------------------------------------------ status

    def status(self) -> dict:
        now = self.clock()
        d = self.last
        return {
            "mode": self.cfg.mode,
            # worker_cooldown_s as it applies (the flag's default is 3x the cooldown)
            "config": {**msgspec.to_builtins(self.cfg), "worker_cooldown_s": self.cfg.per_worker_cooldown_s},
            "cost_model": self.profile_path if self.cost is not None else None,
            "prediction": "cost model from --planner-profile" if self.cost is not None
            else "no --planner-profile: observed TTFT/TPOT scaled by the per-worker load ratio",
            "pools": {m: [w.url for w in self.st.registry.pool(m)] for m in MODES},
            "moving": [w.url for w in self.st.registry.all() if w.switching],
            "loads": msgspec.to_builtins(self.last_loads),
            "traffic": msgspec.to_builtins(self.window.traffic(now)),
            "current": msgspec.to_builtins(d.current) if d is not None else None,
            "candidates": msgspec.to_builtins(d.candidates) if d is not None else [],
            "decisions": [_summary(x, time.time() - now) for x in reversed(self.decisions)],  # newest first
            "cooldown": self.state.to_dict(now, self.cfg),
        }


def _settle(d: Decision, status: int, body: dict) -> None:
    """A move's outcome from the mover's answer: "ok" with the worker's timings and message, or why it failed."""
    if status != 200:
        d.outcome = f"failed: {(body.get('error') or {}).get('message', status)}"
        return
    d.outcome = "ok"
    timings = body.get("timings_ms")
    d.timings_ms = {k: v for k, v in (timings if isinstance(timings, dict) else {}).items()
                    if isinstance(v, (int, float))}
    d.worker_message = str(body.get("message") or "")


def _took(d: Decision) -> str:
    took = "".join(f", {k} {v:.0f} ms" for k, v in d.timings_ms.items())
    return took + (f" ({d.worker_message})" if d.worker_message else "")


def _brief(pred: Optional[Prediction]) -> str:
    if pred is None:
        return "-"
    if not pred.paths:  # no usable path: no worker, or a pool without its partner
        return "nothing (no usable path)"
    paths = ", ".join(f"{k}: TTFT {v.ttft_s * 1000:.0f} ms TPOT {v.tpot_s * 1000:.1f} ms"
                      for k, v in pred.paths.items())
    return f"score {pred.score:.3f} ({paths})"


def _set_latency_gauges(ttft: Any, tpot: Any, pred: Optional[Prediction]) -> None:
    ttft.clear()
    tpot.clear()
    if pred is None:
        return
    for path, p in pred.paths.items():
        ttft.labels("prefill" if path == PD_PATH else "null").set(p.ttft_s)
        tpot.labels("decode" if path == PD_PATH else "null").set(p.tpot_s)


def _set_observed(ttft: Any, tpot: Any, traffic: Any) -> None:
    ttft.clear()
    tpot.clear()
    for path, pool in ((PD_PATH, "prefill"), (NULL_PATH, "null")):
        if path in traffic.ttft_s:
            ttft.labels(pool).set(traffic.ttft_s[path])
    for path, pool in ((PD_PATH, "decode"), (NULL_PATH, "null")):
        if path in traffic.tpot_s:
            tpot.labels(pool).set(traffic.tpot_s[path])
