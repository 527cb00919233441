"""Decode-step time at batch C with 0 vs 2 LoRA adapters active, in-process (no server), interleaved.

Builds a ModelRunner with the server's defaults (int4 GGUF path on a CPU) and --enable-lora with the
given adapters, prefills C requests of PROMPT_LEN tokens, then times decode steps alternating
"base" (no request with an adapter) and "lora" (requests spread over the adapters), REPS each.
min of each side is the least disturbed by other load on the machine; tokens/s = C / step time.
Usage: python3 scripts/lora_step_bench.py NAME=PATH [NAME=PATH ...] [--c 8] [--reps 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tidal.config import ServerArgs, default_model_path
from tidal.model.forward_batch import ForwardBatch, ForwardMode
from tidal.model.runner import ModelRunner

PROMPT_LEN = 64


def batch(runner, mode, c: int, pos: int, n: int, names) -> ForwardBatch:
    """c requests, request i in row i of req_to_token (slots i * 1024 + position), n new tokens at pos."""
    t = torch.tensor
    ids = torch.randint(100, 1000, (c * n,))
    positions = torch.arange(pos, pos + n).repeat(c)
    loc = torch.cat([torch.arange(pos, pos + n) + i * 1024 for i in range(c)]) + 1
    seq = [pos + n] * c
    fb = ForwardBatch(mode, ids, positions, loc, torch.arange(c), t(seq), t([pos] * c), t([n] * c),
                      runner.req_to_token, runner.kv_pool, seq, [pos] * c, [n] * c)
    fb.lora_names = names
    return fb


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("adapters", nargs="+")
    p.add_argument("--c", type=int, default=8)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    args = ServerArgs(model_path=default_model_path(), max_total_tokens=16384, torch_threads=a.threads,
                      enable_lora=True, lora_paths=tuple(a.adapters))
    runner = ModelRunner(args)
    c = a.c
    runner.req_to_token = torch.arange(c * 1024).view(c, 1024) + 1
    names = list(args.lora_adapters)
    sides = {"base": None, "lora": [names[i % len(names)] for i in range(c)]}
    rows = torch.arange(c)
    runner.forward(batch(runner, ForwardMode.EXTEND, c, 0, PROMPT_LEN, sides["lora"]),
                   torch.arange(c) * PROMPT_LEN + PROMPT_LEN - 1)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(a.reps + 3):
        for name, lora in sides.items():
            fb = batch(runner, ForwardMode.DECODE, c, PROMPT_LEN, 1, lora)
            t0 = time.perf_counter()
            runner.forward(fb, rows)
            if rep >= 3:
                times[name].append(time.perf_counter() - t0)
    print(f"quantization {runner.quantization}, dtype {runner.dtype}, threads {a.threads}, batch {c}")
    for name, ts in times.items():
        print(f"{name}: min {min(ts) * 1e3:.2f} ms ({c / min(ts):.1f} tok/s), median {statistics.median(ts) * 1e3:.2f} ms")
    print(f"lora/base decode tok/s (min): {min(times['base']) / min(times['lora']):.3f}, "
          f"(median): {statistics.median(times['base']) / statistics.median(times['lora']):.3f}")


if __name__ == "__main__":
    main()
