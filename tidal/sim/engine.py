"""The simulated cluster, in virtual time: a heap of events (arrivals, step ends, KV
transfers, health refreshes, planner ticks, move phases).

What is the live code, called as is:
- routing: `tidal.router.policies.plan_route` over a real `WorkerRegistry` of `Worker`
  records (their `load` refreshed every health-check interval, `in_flight` kept by
  `begin`/`end` as the dispatcher does), with the router's pool policies;
- the planner: `tidal.planner.decide.decide` with a `PlannerState`, fed `pool_loads`
  of the registry (the loop's own function) and a `TrafficWindow`, on the virtual clock;
- admission: `PrefillAdder` + `admit_waiting` inside each instance (instance.py).

Host sharing (`host_cores`): instances that share one host with fewer cores than their
threads compute more slowly together. Each step is work measured alone (the profile's
seconds); while n instances compute at once, each runs at min(1, cores / (n x threads))
of that speed (processor sharing), so a step stretches while others are busy. Off (None):
every instance has its own cores, as in a cluster of many hosts.

A move follows the live drain-switch path: the worker leaves every pool, finishes what it
holds (drain), then switches (switch_seconds) and joins its new pool; a drain longer than
the router's switch timeout fails the move and the worker returns to its pool. A decode
worker moving to prefill or null, and a null worker moving to prefill, hand over what they hold
as the live router asks them to (unless `decode_move` is "drain", or "migrate", which the sim
runs as a drain: it moves no KV): they switch at once and finish
it in the new role; a move of a worker still doing so waits for it as a drain (the live worker
holds a drained switch until its handover ends), except a move back to the role it handed over from,
which waits only for what the new role took on itself (a prefill server's PD prompts).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from typing import Any, Callable, Optional

from tidal.config import HANDOVER_SWITCHES
from tidal.planner.decide import PlannerState, decide, drain_work, has_path, heading_for, pool_counts
from tidal.planner.loop import pool_loads
from tidal.planner.schema import NULL_PATH, PD_PATH, PlannerConfig
from tidal.planner.window import Observation, TrafficWindow
from tidal.router.config import RouterConfig
from tidal.router.policies import CacheAwarePolicy, Policy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy, plan_route
from tidal.router.workers import WorkerRegistry
from tidal.sim.instance import DECODE, NULL, PREFILL, Limits, SimInstance, SimReq, Step
from tidal.sim.lookahead import choose_split
from tidal.sim.workload import TraceRequest

MODES = (NULL, PREFILL, DECODE)


@dataclasses.dataclass
class SimConfig:
    null: int = 0
    prefill: int = 1
    decode: int = 1
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    policy: str = "cache_aware"
    health_check_interval_s: float = 5.0
    switch_timeout_s: float = 60.0
    seed: int = 0
    # stop once this fraction of requests has missed an SLO (the goodput search needs no more)
    stop_after_miss_fraction: Optional[float] = None
    drain_limit_s: float = 600.0  # after the last arrival, requests still open then end "unfinished"
    # instead of the planner: head for these layouts ({mode: workers}) in turn, one per phase_period_s
    phase_layouts: tuple[dict, ...] = ()
    phase_period_s: float = 0.0
    # instead of the planner: these moves, (seconds, from mode, to mode[, live worker URL]), as a live run made them
    replayed_moves: tuple[tuple, ...] = ()
    # instead of the planner: every lookahead_interval_s, head for the split (prefill workers) of these whose copy of
    # the cluster has missed the fewest requests lookahead_horizon_s later (copies tried lookahead_jobs at once)
    lookahead_splits: tuple[int, ...] = ()
    lookahead_interval_s: float = 10.0
    lookahead_horizon_s: float = 30.0
    lookahead_jobs: int = 1
    # the arrivals a copy runs on: "trace" (the future itself) or "recent" (the last horizon's arrivals again, shifted
    # a horizon on: what a planner that simulates its candidates on the traffic it has seen could know)
    lookahead_forecast: str = "trace"
    host_cores: Optional[float] = None  # all instances on one host with this many cores (None: own cores each)
    instance_threads: int = 1  # compute threads of one instance (the profile's torch threads)


def make_policies(name: str, seed: int) -> dict[str, Policy]:
    """The router's per-pool policies, seeded so that a run is reproducible."""
    rc = RouterConfig()

    def one(i: int) -> Policy:
        if name == "random":
            return RandomPolicy(seed * 3 + i)
        if name == "power_of_two":
            return PowerOfTwoPolicy(seed * 3 + i)
        if name == "round_robin":
            return RoundRobinPolicy()
        if name == "cache_aware":
            return CacheAwarePolicy(rc.cache_threshold, rc.balance_abs_threshold, rc.balance_rel_threshold,
                                    rc.max_tree_size)
        raise ValueError(f"unknown policy {name!r}")

    return {mode: one(i) for i, mode in enumerate(MODES)}


@dataclasses.dataclass
class Move:
    worker: str
    src: str
    dst: str
    started: float
    drained: Optional[float] = None
    ended: Optional[float] = None
    outcome: str = ""
    handover: bool = False  # switching without a drain (HANDOVER_SWITCHES), what it held finished in the new role
    handed_over: Optional[float] = None  # a handover: when the worker had finished the requests it held
    reversal: bool = False  # back to the role a handover in progress replaced: that handover ends here


class Cluster:
    def __init__(self, cfg: SimConfig, cost: Any, trace: list[TraceRequest], limits: Optional[Limits] = None,
                 planner_cost: Any = None) -> None:
        self.cfg, self.cost = cfg, cost
        self.planner_cost = planner_cost or cost  # what the planner predicts with (the sim's own by default)
        self.limits = limits or Limits()
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, Any]] = []
        self._seq = 0
        self.registry = WorkerRegistry()
        self.instances: dict[str, SimInstance] = {}
        layout = [NULL] * cfg.null + [PREFILL] * cfg.prefill + [DECODE] * cfg.decode
        for i, mode in enumerate(layout):
            url = f"http://sim-{i:03d}:30000"
            self.registry.add(url, mode, healthy=True)
            inst = SimInstance(url, mode, cost, self.limits)
            inst.on_first_token = self._first_token_on_decode
            self.instances[url] = inst
        self.policies = make_policies(cfg.policy, cfg.seed)
        self.window = TrafficWindow(cfg.planner.window_s, 0.0, cfg.planner.burst_window_s,
                                    cfg.planner.ttft_slo_s)
        self.state = PlannerState()
        self.requests = [SimReq(i, t.arrival, t.input_tokens, t.output_tokens) for i, t in enumerate(trace)]
        self.moves: list[Move] = []
        self._moving: dict[str, Move] = {}
        self.pools: list[dict] = []
        self.decisions: dict[str, int] = {}
        self.ended = 0
        self.missed = 0
        self.stopped_early = False
        self.rng = random.Random(cfg.seed)
        self._work_left: dict[str, float] = {}  # host sharing: step seconds still to compute, per instance
        self._step_token: dict[str, int] = {}  # host sharing: the step-end event that is current
        self._copying: dict[str, SimReq] = {}  # host sharing: KV copies computing (key "kv:<rid>"), one thread each
        self._share_rate, self._share_since = 1.0, 0.0
        self._plan_pending = False
        self._stands_for: dict[str, str] = {}  # replayed moves: live worker URL -> the simulated worker
        self._target = {NULL: cfg.null, PREFILL: cfg.prefill, DECODE: cfg.decode}  # lookahead: the split headed for
        self._next_look = 0.0
        self._forked = False  # a copy trying a split: it does not look ahead itself
        self.lookahead: list[dict] = []  # lookahead: per look, when, the split chosen, each split's known misses

    # ------------------------------------------------------------ events

    def at(self, t: float, fn: Callable, arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def replace_arrivals_after_now(self, arrivals: list[SimReq]) -> None:
        """The requests due after now become `arrivals` (in arrival order, ids unused so far): those of the trace
        never come (a lookahead copy's forecast)."""
        self._heap = [e for e in self._heap if not (e[2] == self._arrive and e[0] > self.now)]
        heapq.heapify(self._heap)
        self.requests = [r for r in self.requests if r.arrival <= self.now] + arrivals
        for r in arrivals:
            self.at(r.arrival, self._arrive, r)

    @property
    def largest_decode_batch(self) -> int:
        return max((i.largest_decode_batch for i in self.instances.values()), default=0)

    def run(self) -> "Cluster":
        self.start()
        last = self.requests[-1].arrival if self.requests else 0.0
        horizon = last + self.cfg.drain_limit_s
        limit = self.cfg.stop_after_miss_fraction
        total = len(self.requests)
        while self._heap and (self.ended < total or self._moving):
            t, _, fn, arg = heapq.heappop(self._heap)
            if t > horizon:
                break
            self.now = t
            fn(arg)
            if limit is not None and self.missed > limit * total:
                self.stopped_early = True
                break
        for r in self.requests:
            if not r.outcome:
                r.outcome = "unfinished"
        return self

    def start(self) -> None:
        """The events a run starts from: every arrival, the health checks, and the planner's or the schedule's
        first tick."""
        for r in self.requests:
            self.at(r.arrival, self._arrive, r)
        self._refresh_loads()
        self._record_pools()
        self.at(self.cfg.health_check_interval_s, self._health_tick)
        if self.cfg.phase_layouts:
            self.at(0.0, self._phase_tick)
        elif self.cfg.lookahead_splits:
            self.at(0.0, self._lookahead_tick)
        elif self.cfg.replayed_moves:
            for move in self.cfg.replayed_moves:
                self.at(move[0], self._replayed_move, move)
        elif self.cfg.planner.mode != "static":
            self.window.baseline(self.now, pool_loads(self.registry))  # as the live loop does when it starts
            self.at(self.cfg.planner.interval_s, self._planner_tick)

    def _health_tick(self, _: Any) -> None:
        self._refresh_loads()
        self.at(self.now + self.cfg.health_check_interval_s, self._health_tick)

    def _refresh_loads(self) -> None:
        for w in self.registry.all():
            w.load = self.instances[w.url].load()

    # ------------------------------------------------------------ requests

    def _arrive(self, r: SimReq) -> None:
        r.ticket = self.window.arrival(self.now)
        route = plan_route(self.registry, self.policies, "", set())
        # a server refuses (HTTP 400) an input longer than its KV pool less one token (Scheduler._validate)
        if route is None or r.input_len > self.cost.max_total_tokens - 1:
            self._end(r, "rejected")
            return
        kind, w, d = route
        self.registry.begin(w)
        inst = self.instances[w.url]
        inst.receive(r)
        inst.waiting.append(r)
        if kind == "pd":
            r.path, r.prefill_url, r.decode_url = PD_PATH, w.url, d.url
            self.registry.begin(d)
            self.instances[d.url].receive(r)
            self.instances[d.url].pd_decodes += 1
            self.instances[d.url].pd_awaiting_kv += 1
        else:
            r.path, r.decode_url = NULL_PATH, w.url
            inst.null_reqs += 1
        self._wake(inst)

    def _wake(self, inst: SimInstance) -> None:
        """New work: the server looks at it after every other event of this instant (the live scheduler
        receives all pending requests before it schedules)."""
        if inst.step is None and not inst.wake_pending:
            inst.wake_pending = True
            self.at(self.now, self._woken, inst)

    def _woken(self, inst: SimInstance) -> None:
        inst.wake_pending = False
        self._kick(inst)

    def _kick(self, inst: SimInstance) -> None:
        if inst.step is not None:
            return
        step = inst.next_step()
        if step is not None:
            inst.step = step
            if self.cfg.host_cores is None:
                self.at(self.now + step.seconds, self._step_done, inst)
            else:
                self._advance_shared()
                self._work_left[inst.url] = step.seconds
                self._reschedule_shared()
        self._note_handover_end(inst)
        self._check_drain(inst)

    # ------------------------------------------------------------ host sharing (processor sharing)

    def _advance_shared(self) -> None:
        """Every computing instance did (now - since) x rate of its step's work."""
        done = (self.now - self._share_since) * self._share_rate
        for url in self._work_left:
            self._work_left[url] = max(self._work_left[url] - done, 0.0)
        self._share_since = self.now

    def _reschedule_shared(self) -> None:
        copies = len(self._copying)
        threads = (len(self._work_left) - copies) * self.cfg.instance_threads + copies
        self._share_rate = min(1.0, self.cfg.host_cores / threads) if threads else 1.0
        for url, left in self._work_left.items():
            self._step_token[url] = self._step_token.get(url, 0) + 1
            self.at(self.now + left / self._share_rate, self._shared_step_done, (url, self._step_token[url]))

    def _shared_step_done(self, arg: tuple[str, int]) -> None:
        url, token = arg
        if token != self._step_token[url]:
            return  # superseded: the sharing changed after this end was scheduled
        self._advance_shared()
        del self._work_left[url]
        copied = self._copying.pop(url, None)
        if copied is not None:
            self._transferred(copied)
        else:
            self._step_done(self.instances[url])
        self._reschedule_shared()

    def _step_done(self, inst: SimInstance) -> None:
        step: Step = inst.step
        inst.step = None
        inst.busy_s += step.seconds
        if step.kind == "prefill":
            self._prefilled(inst, step)
        else:
            self._decoded(inst, step)
        self._kick(inst)

    def _prefilled(self, inst: SimInstance, step: Step) -> None:
        for r in step.reqs:
            r.computed = r.kv_len
            if r is step.chunked:
                continue
            if r.generated == 0:
                r.generated = 1  # the prefill samples the first token
            if inst.mode == PREFILL and r.decode_url != inst.url:  # else handed over, retracted: decoded here
                inst.sending += 1
                self._send_kv(r)
                continue
            self._first_token(r)
            if r.generated >= r.output_len:
                self._finish(inst, r)
            else:
                inst.running.append(r)

    def _send_kv(self, r: SimReq) -> None:
        """The prompt's KV goes to its decode server. On a shared host the copy is computed by a transfer
        thread of the prefill server (the shm backend's), so it takes a core's share like a step."""
        seconds = self.cost.kv_transfer_seconds(r.input_len)
        if self.cfg.host_cores is None:
            self.at(self.now + seconds, self._transferred, r)
            return
        self._advance_shared()
        key = f"kv:{r.rid}"
        self._copying[key] = r
        self._work_left[key] = seconds
        self._reschedule_shared()

    def _transferred(self, r: SimReq) -> None:
        src, dst = self.instances[r.prefill_url], self.instances[r.decode_url]
        src.free(r)
        src.sending -= 1
        src.assigned -= 1
        self.registry.end(self.registry.get(src.url))
        r.computed = 0
        dst.arrived.append(r)
        self._kick(src)
        self._wake(dst)

    def _first_token_on_decode(self, r: SimReq) -> None:
        """A transferred request joined its decode server's batch: its first token goes out."""
        self._first_token(r)
        if r.generated >= r.output_len:
            inst = self.instances[r.decode_url]
            inst.running.remove(r)
            self._finish(inst, r)

    def _first_token(self, r: SimReq) -> None:
        if r.first_token_at is None:
            r.first_token_at = self.now
            if r.ticket is not None:
                r.ticket.tokens = r.generated  # what the client has been sent

    def _decoded(self, inst: SimInstance, step: Step) -> None:
        done = []
        for r in step.reqs:
            r.generated += 1
            if r.ticket is not None:
                r.ticket.tokens = r.generated
            if r.generated >= r.output_len:
                done.append(r)
        if done:
            ids = {id(r) for r in done}
            inst.running = [r for r in inst.running if id(r) not in ids]
            for r in done:
                self._finish(inst, r)

    def _finish(self, inst: SimInstance, r: SimReq) -> None:
        inst.free(r)
        inst.assigned -= 1
        inst.pd_decodes -= r.path == PD_PATH
        inst.null_reqs -= r.path == NULL_PATH
        self._note_handover_end(inst)
        self.registry.end(self.registry.get(inst.url))
        ttft, tpot = self.ttft_tpot(r)
        self.window.completion(self.now, Observation(path=r.path, prompt_tokens=r.input_len,
                                                     completion_tokens=r.generated, arrived_at=r.arrival, ttft_s=ttft,
                                                     tpot_s=tpot if r.generated > 1 else None), r.ticket)
        self._end(r, "finished", self.meets_slo(r))

    def _note_handover_end(self, inst: SimInstance) -> None:
        """A handover ends when the worker holds nothing more of its old role (a request ended, or under null
        the last PD request's KV joined the batch)."""
        if inst.handover_move is not None and not inst.handing_over():
            inst.handover_move.handed_over = self.now
            inst.handover_move = None

    def _end(self, r: SimReq, outcome: str, met: bool = False) -> None:
        assert not r.outcome, f"request {r.rid} ended twice ({r.outcome}, {outcome})"
        self.window.forget(r.ticket)
        r.outcome = outcome
        r.finished_at = self.now
        self.ended += 1
        self.missed += not met

    def ttft_tpot(self, r: SimReq) -> tuple[float, float]:
        ttft = r.first_token_at - r.arrival
        tpot = (r.finished_at if r.finished_at is not None else self.now) - r.first_token_at
        return ttft, tpot / (r.generated - 1) if r.generated > 1 else 0.0

    def meets_slo(self, r: SimReq) -> bool:
        ttft, tpot = self.ttft_tpot(r)
        return ttft <= self.cfg.planner.ttft_slo_s and tpot <= self.cfg.planner.tpot_slo_s

    # ------------------------------------------------------------ the planner and moves

    def _planner_tick(self, _: Any) -> None:
        self._plan(None)
        self.at(self.now + self.cfg.planner.interval_s, self._planner_tick)

    def _plan(self, _: Any) -> None:
        self._plan_pending = False
        self._refresh_loads()  # the live loop refreshes every /get_load before deciding
        loads = pool_loads(self.registry)
        traffic = self.window.traffic(self.now, loads)
        while True:  # as the live loop: decide until it holds, on the loads of the interval's start
            d = decide(self.now, self.cfg.planner, self.state, loads, traffic, self.planner_cost)
            key = d.kind if d.kind in ("move", "advise") else f"hold: {d.why}"
            self.decisions[key] = self.decisions.get(key, 0) + 1
            if d.kind != "move":
                break
            self._start_move(d.url, d.dst, d.answers)

    def _phase_tick(self, _: Any) -> None:
        """Heads for the current phase's layout with every move it takes at once, the workers with the
        least to drain first: a planner that knows the phases (one layout each), paying drains and switches
        like any move."""
        k = int(self.now // self.cfg.phase_period_s) % len(self.cfg.phase_layouts)
        self._head_for(self.cfg.phase_layouts[k])
        self.at(self.now + self.cfg.planner.interval_s, self._phase_tick)

    def _lookahead_tick(self, _: Any) -> None:
        """Every lookahead interval: the split whose copy of the cluster has missed the fewest requests by the
        horizon becomes the target (a planner that sees the future, paying drains and switches like any move);
        every planner interval in between: heads for it. A copy heads for the split it tries, and looks no further."""
        if self.now >= self._next_look and not self._forked:
            self._refresh_loads()
            self._target = choose_split(self)
            self._next_look = self.now + self.cfg.lookahead_interval_s
        self._head_for(self._target)
        self.at(self.now + min(self.cfg.planner.interval_s, self.cfg.lookahead_interval_s), self._lookahead_tick)

    def _head_for(self, target: dict) -> None:
        """Starts every move that takes the pools toward `target` ({mode: workers}), the workers with the least to
        drain first, none that would leave no path while it drains."""
        self._refresh_loads()
        loads = pool_loads(self.registry)
        serving, heading = pool_counts(loads), heading_for(pool_counts(loads), self.state)
        for w in sorted(loads, key=lambda w: (drain_work(w), w.url)):
            short = sorted((m for m in MODES if heading[m] < target[m]), key=lambda m: heading[m])  # empty first
            if heading[w.mode] <= target[w.mode] or not short:
                continue
            serving[w.mode] -= 1
            if not has_path(serving):
                serving[w.mode] += 1  # it would leave no path while it drains: later
                continue
            heading[w.mode] -= 1
            heading[short[0]] += 1
            self._start_move(w.url, short[0])

    def run_until(self, t: float) -> None:
        """Every event up to virtual time t (a copy of the cluster trying a split)."""
        while self._heap and self._heap[0][0] <= t:
            now, _, fn, arg = heapq.heappop(self._heap)
            self.now = now
            fn(arg)

    def known_misses(self) -> int:
        """The requests arrived so far that have missed an SLO or will: ended without meeting both, waiting for their
        first token past the TTFT SLO, or decoding slower than the TPOT SLO so far."""
        ttft_slo, tpot_slo = self.cfg.planner.ttft_slo_s, self.cfg.planner.tpot_slo_s
        out = self.missed
        for r in self.requests:  # in arrival order
            if r.arrival > self.now:
                break
            if r.outcome:
                continue
            if r.first_token_at is None:
                out += self.now - r.arrival > ttft_slo
            elif r.first_token_at - r.arrival > ttft_slo:
                out += 1
            elif r.generated > 1:
                out += (self.now - r.first_token_at) / (r.generated - 1) > tpot_slo
        return out

    def _replayed_move(self, move: tuple) -> None:
        """A live run's move (seconds, from mode, to mode[, live worker URL]): the simulated worker that stands
        for that live worker (the first time, one of its pool that stands for no other), else the one of
        its pool with the least to drain; while none is in the pool (an earlier move of it has not landed
        here yet) it is waited for, 0.1 s at a time."""
        _, src, dst, *live = move
        self._refresh_loads()
        free = [w for w in pool_loads(self.registry) if w.mode == src]
        if live:
            mine = self._stands_for.get(live[0])
            taken = set(self._stands_for.values())
            free = [w for w in free if w.url == mine] if mine else [w for w in free if w.url not in taken]
        if not free:
            self.at(self.now + 0.1, self._replayed_move, move)
            return
        url = min(free, key=lambda w: (drain_work(w), w.url)).url
        if live:
            self._stands_for[live[0]] = url
        self._start_move(url, dst)

    def _start_move(self, url: str, dst: str, answers: Optional[float] = None) -> None:
        w = self.registry.get(url)
        w.switching = True
        self.state.started(self.now, url, w.mode, dst, answers)
        move = Move(worker=url, src=w.mode, dst=dst, started=self.now)
        self.moves.append(move)
        self._moving[url] = move
        self._record_pools()
        inst = self.instances[url]
        move.handover = (move.src, dst) in HANDOVER_SWITCHES and self.cfg.planner.decode_move == "handover"
        move.reversal = inst.handover_move is not None and inst.handover_move.src == dst
        if move.handover and not inst.handing_over():  # nothing to drain
            move.drained = self.now
            self.at(self.now + self.cost.switch_seconds(move.src, move.dst), self._switched, move)
            return
        self.at(self.now + self.cfg.switch_timeout_s, self._drain_timeout, move)
        self._check_drain(inst)

    def _check_drain(self, inst: SimInstance) -> None:
        """A drain ends when the worker holds nothing; a handover's wait, when the one before it has ended (the
        live worker queues a switch asked for during a handover until then); a move back, when the role it
        reverses holds nothing of its own."""
        move = self._moving.get(inst.url)
        if move is None or move.drained is not None:
            return
        if move.reversal:
            ready = inst.reversible()
        else:
            ready = (not inst.handing_over()) if move.handover else inst.idle()
        if ready:
            move.drained = self.now
            self.at(self.now + self.cost.switch_seconds(move.src, move.dst), self._switched, move)

    def _switched(self, move: Move) -> None:
        inst = self.instances[move.worker]
        inst.mode = move.dst
        self._note_handover_end(inst)  # a move back ends the handover it reverses
        if inst.handing_over():
            inst.handover_move = move
        elif move.handover:
            move.handed_over = self.now
        self.registry.set_mode(move.worker, move.dst)
        self._end_move(move, "ok")

    def _drain_timeout(self, move: Move) -> None:
        if move.drained is None:
            self._end_move(move, f"failed: drain took more than {self.cfg.switch_timeout_s:g} s")

    def _end_move(self, move: Move, outcome: str) -> None:
        move.ended, move.outcome = self.now, outcome
        self.registry.get(move.worker).switching = False
        del self._moving[move.worker]
        self.state.finished(self.now, move.worker, outcome == "ok", self.cfg.planner)
        self._record_pools()
        self._kick(self.instances[move.worker])
        if outcome == "ok" and self.state.committed is not None and not self._plan_pending:
            self._plan_pending = True  # as the live loop: a move that lands mid-walk starts the next round now
            self.at(self.now, self._plan)

    def _record_pools(self) -> None:
        counts = {m: len(self.registry.pool(m)) for m in MODES}
        counts["moving"] = len(self._moving)
        self.pools.append({"t": round(self.now, 6), **counts})
