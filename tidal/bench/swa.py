"""KV memory of a sliding-window model with and without the windowed layers' own pool (tidal/kvcache/swa.py).

    python -m tidal.bench.swa [--requests 16] [--prompt 1024] [--output 128] [--window 256] [--layers 6]

Builds a small Gemma 3 text model from a transformers config with random weights (every
`--global-every`-th layer full attention, the rest windowed: Gemma 3's 5:1), serves the same batch
of requests through the scheduler twice, with one pool (`--swa-full-tokens-ratio 1`) and with the
SWA pool, and reports the peak tokens each pool held, the KV bytes a pool of that peak needs, and
whether the outputs were the same. The speed of this model says nothing; its memory is the point
(bytes per token scale with the real model's heads and layers, the ratios do not).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch


def _model_dir(path: str, layers: int, window: int, global_every: int, context: int) -> None:
    import transformers

    types = ["full_attention" if (i + 1) % global_every == 0 else "sliding_attention" for i in range(layers)]
    cfg = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=window, layer_types=types, max_position_embeddings=context)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)


def _serve(path: str, ratio: float, prompts: list[list[int]], a) -> dict:
    from tidal.config import ServerArgs
    from tidal.messages import GenerateReq
    from tidal.model.runner import ModelRunner
    from tidal.sampling_params import SamplingParams
    from tidal.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=path, dtype="float32", device="cpu", page_size=a.page_size,
                      chunked_prefill_size=a.chunk, max_total_tokens=a.requests * (a.prompt + a.output) * 2,
                      swa_full_tokens_ratio=ratio, enable_torch_compile=False, max_running_requests=a.requests)
    runner = ModelRunner(args)
    sched = Scheduler(args, runner, tokenizer=None)
    mem = sched.mem
    sp = SamplingParams(max_new_tokens=a.output, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(rid=str(i), input_ids=p, sampling=sp))
    out: dict[str, list[int]] = {}
    peak_full = peak_swa = 0
    t0 = time.perf_counter()
    while True:
        did = sched.step()
        peak_full = max(peak_full, mem.allocator.size - mem.allocator.available_size())
        if mem.swa is not None:
            peak_swa = max(peak_swa, mem.swa.swa.size - mem.swa.swa_available_size())
        for o in sched.take_outbox():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        if not did and sched.is_idle():
            break
    sched.check_integrity()
    cfg = runner.model_config
    per_layer_token = 2 * runner.num_kv_heads * cfg.head_dim * runner.dtype.itemsize
    windowed = len([w for w in cfg.layer_windows if w is not None])
    full_layers = cfg.num_layers - windowed
    if mem.swa is None:  # one pool: every layer keeps every token
        needed = peak_full * cfg.num_layers * per_layer_token
    else:
        needed = (peak_full * full_layers + peak_swa * windowed) * per_layer_token
    return {"ratio": ratio, "peak_full_tokens": peak_full, "peak_swa_tokens": peak_swa if mem.swa else None,
            "kv_bytes_at_peak": needed, "pool_bytes": runner.kv_pool.nbytes(), "seconds": time.perf_counter() - t0,
            "outputs": [out[str(i)] for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--global-every", type=int, default=6, help="every Nth layer is full attention (Gemma 3: 6)")
    p.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--ratio", type=float, default=0.8, help="--swa-full-tokens-ratio of the SWA run")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(a.prompt)] for _ in range(a.requests)]
    with tempfile.TemporaryDirectory() as d:
        _model_dir(d, a.layers, a.window, a.global_every, a.prompt + a.output + 64)
        runs = [_serve(d, 1.0, prompts, a), _serve(d, a.ratio, prompts, a)]
    one, swa = runs
    same = one["outputs"] == swa["outputs"]
    print(f"{a.requests} requests x ({a.prompt} in + {a.output} out), window {a.window}, {a.layers} layers "
          f"(every {a.global_every}th full), chunk {a.chunk}, page {a.page_size}")
    print("| pool | peak tokens, full layers | peak tokens, windowed layers | KV bytes at the peak | pool bytes |")
    print("|---|---|---|---|---|")
    for r, name in ((one, "one pool"), (swa, f"SWA pool (ratio {a.ratio})")):
        win = r["peak_swa_tokens"] if r["peak_swa_tokens"] is not None else r["peak_full_tokens"]
        print(f"| {name} | {r['peak_full_tokens']} | {win} | {r['kv_bytes_at_peak']} | {r['pool_bytes']} |")
    saved = 1 - swa["kv_bytes_at_peak"] / one["kv_bytes_at_peak"]
    print(f"KV memory at the peak: {100 * saved:.1f}% less with the SWA pool; outputs identical: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
                       "saved": saved, "identical": same}, f, indent=1)
    if not same:
        raise SystemExit("the two pools gave different outputs")


if __name__ == "__main__":
    main()
