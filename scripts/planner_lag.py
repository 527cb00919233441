"""How long the planner's decision takes at N workers, and how long it stalls the router's event loop: the
decision taken inline (as the router did before 2026-11-29) against `PlannerLoop._decide` (a thread, on a copy
of the state). A coroutine that sleeps 1 ms in a loop stands for the router's streams; its lateness is the lag.

    PYTHONPATH=$PWD python3 scripts/planner_lag.py --workers 16 64 --profile tidal/profile/data/smollm2_cpu_2core_avx512.json

Each decision is one of a walk's: ROUNDS of them back to back, as a round that starts several moves takes them.
The load: half prefill workers with 2000 prompt tokens queued each, half decode workers with 20 answers each,
conversation-like traffic at 110 requests/s per 64 workers (prompts of 290 tokens, answers of 58).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from types import SimpleNamespace

from tidal.planner.decide import PlannerState, decide
from tidal.planner.loop import PlannerLoop
from tidal.planner.schema import PlannerConfig, Traffic, WorkerLoad
from tidal.profile.cost import CostModel

ROUNDS = 5
TICK_S = 0.001


def loads_of(n: int) -> list[WorkerLoad]:
    half = n // 2
    return [WorkerLoad(url=f"http://w{i}", mode="prefill" if i < half else "decode", kv_tokens_total=500000,
                       running_reqs=1 if i < half else 20, queued_prefill_tokens=2000 if i < half else 0)
            for i in range(n)]


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(TICK_S)
        lags.append(time.perf_counter() - t - TICK_S)


async def measure(n: int, cost: CostModel, inline: bool) -> tuple[float, float]:
    """(median seconds per decision, the loop's largest lag) over ROUNDS decisions back to back."""
    cfg = PlannerConfig(mode="sla", ttft_slo_s=8.0, tpot_slo_s=0.2, max_concurrent_moves=max(1, n // 4))
    traffic = Traffic(arrival_rate=110.0 * n / 64, mean_input_tokens=290, mean_output_tokens=58)
    loop = PlannerLoop(cfg, SimpleNamespace(), cost=cost, clock=lambda: 1000.0)
    loop.last_loads = loads_of(n)
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(lags, stop))
    await asyncio.sleep(0.05)
    took = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        if inline:
            decide(1000.0, cfg, PlannerState(), loop.last_loads, traffic, cost)
        else:
            loop.state = PlannerState()
            await loop._decide(1000.0, traffic)
        took.append(time.perf_counter() - t)
    stop.set()
    await tick
    return statistics.median(took), max(lags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--profile", default="tidal/profile/data/smollm2_cpu_2core_avx512.json")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case; medians reported")
    ns = ap.parse_args()
    cost = CostModel.from_file(ns.profile)
    print(f"| workers | decision | per decision (ms) | largest loop lag over {ROUNDS} decisions (ms) |")
    print("|---|---|---|---|")
    for n in ns.workers:
        for inline in (True, False):
            runs = [asyncio.run(measure(n, cost, inline)) for _ in range(ns.repeats)]
            took = statistics.median(r[0] for r in runs)
            lag = statistics.median(r[1] for r in runs)
            print(f"| {n} | {'inline' if inline else 'thread'} | {took * 1e3:.0f} | {lag * 1e3:.1f} |")


if __name__ == "__main__":
    main()
