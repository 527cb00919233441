"""A planner that sees the future, for the simulator only: every lookahead interval it copies the cluster once per
candidate split (a fork of this process: the copy costs nothing until it diverges), lets each copy head for its
split and run on to the horizon, and heads for the split whose copy has missed the fewest requests by then.

No live planner can know the arrivals ahead; this one measures what knowing them is worth, paying the same drains and
switches as any move, so that a planner's gain and a goal set for it can be judged against what moving workers gains
at all on a workload. It is not a bound: it looks one horizon ahead and picks greedily."""

from __future__ import annotations

import os
from typing import Any

from tidal.sim.instance import DECODE, NULL, PREFILL, SimReq


def split_layout(instances: int, prefill: int) -> dict:
    return {NULL: 0, PREFILL: prefill, DECODE: instances - prefill}


def misses_if_headed_for(cluster: Any, prefill: int, until: float) -> int:
    """In a copy of the cluster: head for the split from now on, run to `until`, and count the misses known then."""
    cluster._forked = True
    cluster._target = split_layout(len(cluster.instances), prefill)
    if cluster.cfg.lookahead_forecast == "recent":
        forecast_recent(cluster, until)
    cluster._lookahead_tick(None)  # heads for it now, and again every planner interval
    cluster.run_until(until)
    return cluster.known_misses()


def forecast_recent(cluster: Any, until: float) -> None:
    """In a copy: the arrivals after now replaced with those of the last (until - now) seconds (all of them, when
    fewer seconds have passed), repeated after now at the period of the past they cover, up to `until`."""
    now = cluster.now
    period = min(until - now, now)
    recent = [r for r in cluster.requests if now - period <= r.arrival <= now] if period > 0 else []
    times = sorted((t, k) for k, r in enumerate(recent)
                   for t in _repeats(r.arrival, period, now, until))
    first_id = len(cluster.requests)
    cluster.replace_arrivals_after_now([SimReq(first_id + i, t, recent[k].input_len, recent[k].output_len)
                                        for i, (t, k) in enumerate(times)])


def _repeats(arrival: float, period: float, now: float, until: float) -> list[float]:
    """arrival + period, + 2 period, ... up to `until`, those after now."""
    out, t = [], arrival + period
    while t <= until:
        if t > now:
            out.append(t)
        t += period
    return out


def tried_misses(cluster: Any, splits: tuple[int, ...], until: float, jobs: int) -> dict[int, int]:
    """Each split's known misses at `until`, `jobs` forked copies at a time."""
    out: dict[int, int] = {}
    pending = list(splits)
    running: dict[int, tuple[int, int]] = {}  # pid -> (split, read end of its pipe)
    while pending or running:
        while pending and len(running) < jobs:
            p = pending.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the copy: never returns
                code = 1
                try:
                    os.close(r)
                    os.write(w, str(misses_if_headed_for(cluster, p, until)).encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(w)
            running[pid] = (p, r)
        pid = next(iter(running))
        p, r = running.pop(pid)
        chunks = []
        while chunk := os.read(r, 64):
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if status != 0 or not chunks:
            raise RuntimeError(f"lookahead: the copy trying split {p} at t = {cluster.now:.1f} s failed "
                               f"(wait status {status})")
        out[p] = int(b"".join(chunks))
    return out


def choose_split(cluster: Any) -> dict:
    """The split to head for: the fewest known misses at the horizon; on a tie the split headed for now, then the
    nearest to it (the fewest moves). Records the look in `cluster.lookahead`."""
    cfg, n = cluster.cfg, len(cluster.instances)
    now_p = cluster._target[PREFILL]
    misses = tried_misses(cluster, cfg.lookahead_splits, cluster.now + cfg.lookahead_horizon_s, cfg.lookahead_jobs)
    best = min(misses, key=lambda p: (misses[p], p != now_p, abs(p - now_p), p))
    cluster.lookahead.append({"t": round(cluster.now, 3), "split": f"{best}:{n - best}",
                              "misses": {f"{p}:{n - p}": m for p, m in sorted(misses.items())}})
    return split_layout(n, best)
