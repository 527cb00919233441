"""Decode tokens/s at concurrency C with 0 vs N LoRA adapters active, on one running server.

Rounds alternate "base" (every request on the base model) and "lora" (requests spread over the
given adapters): C concurrent /generate requests of a short prompt and OUT output tokens each;
tokens/s = all output tokens / wall time of the round (prefill is a few percent of it).
Usage: python3 scripts/lora_bench.py URL ADAPTER [ADAPTER ...] [--c 8] [--out 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import time

import httpx

PROMPT = "Write a long story about a lighthouse keeper and the ships that pass by at night."


def one_round(url: str, loras: list, out: int) -> float:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": out, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(loras)) as pool:
        outs = list(pool.map(lambda lp: httpx.post(url + "/generate", json={**body, "lora_path": lp},
                                                    timeout=600).json(), loras))
    wall = time.perf_counter() - start
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("adapters", nargs="+")
    p.add_argument("--c", type=int, default=8)
    p.add_argument("--out", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    sides = {"base": [None] * a.c, "lora": [a.adapters[i % len(a.adapters)] for i in range(a.c)]}
    one_round(a.url, sides["lora"], 8)  # warm-up
    results: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(a.rounds):
        for name, loras in sides.items():
            results[name].append(one_round(a.url, loras, a.out))
    for name, vals in results.items():
        print(f"{name}: median {statistics.median(vals):.1f} tok/s  rounds {[round(v, 1) for v in vals]}")
    print(f"lora/base: {statistics.median(results['lora']) / statistics.median(results['base']):.3f}")


if __name__ == "__main__":
    main()
