"""Where the time of one forward pass goes: the model alone, no server, no scheduler.

    python -m tidal.bench.step --batch-sizes 1 8 32 --context 256 [--dtype auto] [--quantization auto]

For each batch size it fills a paged KV pool with `context` tokens per request (pages
shuffled, as in a long-running server), then times decode steps (ms/step, median of
--steps after --warmup) and, with --profile, groups torch's profiler events by kind:
matmul (linear layers and LM head), attention, K/V store and gather, norms/activations/RoPE
(elementwise) and everything else. `--prefill N` also times one N-token prefill in chunks of
--chunk tokens. `--decode-paths sdpa bag` times both decode attention paths in one run, their
steps alternating (an A/B); `--torch-compile` likewise times eager and compiled decode steps
(`tidal serve --enable-torch-compile`) alternating.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from typing import Optional

import torch

from tidal.cli_help import DefaultsHelpFormatter
from tidal.config import ServerArgs, default_model_path
from tidal.cpus import cpu_flags as host_cpu_flags
from tidal.cpus import simd_flags
from tidal.model.attention import DECODE_PATHS
from tidal.model.forward_batch import ForwardBatch, ForwardMode

# torch profiler op name -> bucket (first match wins; names are aten ops or our record_function labels)
_BUCKETS = [
    # the model's only bmm, softmax and embedding_bag are the "bag" decode attention path's
    ("attention", ("scaled_dot_product", "_flash_attention", "flex_attention", "tidal::attn", "aten::bmm",
                   "aten::_softmax", "embedding_bag")),
    ("matmul", ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul",
                "_weight_int4pack_mm", "_weight_int8pack_mm", "mkldnn")),
    ("kv store/gather", ("aten::index_select", "aten::index_put", "aten::index_copy", "aten::index",
                         "tidal::kv")),
    ("sampling/logits", ("aten::argmax", "aten::topk", "aten::sort", "aten::softmax", "tidal::sample")),
    ("elementwise (norm, rope, act, add)", ("aten::rms_norm", "aten::mul", "aten::add", "aten::silu",
                                            "aten::cat", "aten::sub", "aten::neg", "aten::copy_", "aten::to",
                                            "aten::_to_copy", "aten::embedding", "aten::where")),
]


class StepBench:
    """A model runner and a paged KV pool holding `batch` requests of `context` tokens each."""

    def __init__(self, args: ServerArgs, max_batch: int, context: int):
        from tidal.model.runner import ModelRunner

        self.runner = ModelRunner(args)
        self.page = args.page_size
        self.max_context = context + 64
        self.dev = self.runner.device
        self.req_to_token = torch.zeros(max_batch, self.max_context, dtype=torch.int64, device=self.dev)
        pages_needed = max_batch * (self.max_context // self.page + 1)
        pool_pages = self.runner.max_total_tokens // self.page
        if pages_needed > pool_pages:
            raise SystemExit(f"KV pool too small: need {pages_needed} pages, have {pool_pages}")
        free = list(range(1, pool_pages + 1))
        random.Random(0).shuffle(free)
        self.free = free
        self.pages: dict[int, list[int]] = defaultdict(list)

    def _slots(self, req: int, start: int, end: int) -> list[int]:
        pages = self.pages[req]
        while len(pages) * self.page < end:
            pages.append(self.free.pop())
        return [pages[p // self.page] * self.page + p % self.page for p in range(start, end)]

    def batch(self, mode: ForwardMode, reqs: list[tuple[int, int, int]]) -> ForwardBatch:
        """reqs: (req row, prefix length, new tokens) per request."""
        ids, pos, loc = [], [], []
        vocab = self.runner.model_config.vocab_size
        for r, pre, new in reqs:
            slots = self._slots(r, pre, pre + new)
            self.req_to_token[r, pre:pre + new] = torch.tensor(slots, device=self.dev)
            ids += [random.randrange(vocab // 20, vocab // 2) for _ in range(new)]
            pos += range(pre, pre + new)
            loc += slots
        pre = [p for _, p, _ in reqs]
        ext = [n for _, _, n in reqs]
        seq = [p + e for p, e in zip(pre, ext)]

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=self.dev)

        return ForwardBatch(mode, t(ids), t(pos), t(loc), t([r for r, _, _ in reqs]), t(seq), t(pre), t(ext),
                            self.req_to_token, self.runner.kv_pool, seq, pre, ext)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        ends = torch.cumsum(torch.tensor(fb.extend_seq_lens_cpu, device=self.dev), 0) - 1
        return self.runner.forward(fb, ends)

    def fill(self, batch: int, context: int, chunk: int) -> None:
        for r in range(batch):
            for s in range(0, context, chunk):
                self.run(self.batch(ForwardMode.EXTEND, [(r, s, min(chunk, context - s))]))

    def decode_step(self, batch: int, context: int) -> ForwardBatch:
        # every step writes the same position again: the context stays fixed while timing
        return self.batch(ForwardMode.DECODE, [(r, context, 1) for r in range(batch)])


def _bucket(name: str) -> str:
    for bucket, keys in _BUCKETS:
        if any(k in name for k in keys):
            return bucket
    return "other"


def profile_breakdown(fn, steps: int) -> dict[str, float]:
    """Self CPU time per bucket (ms per step) over `steps` calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        out[_bucket(ev.key)] += ev.self_cpu_time_total / 1000.0 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def time_steps(fn, warmup: int, steps: int) -> list[float]:
    """Milliseconds per call; on a GPU each call is waited for (kernels run asynchronously)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    return times


def bench_decode(sb: StepBench, batch: int, context: int, warmup: int, steps: int,
                 profile: bool, paths: tuple[str, ...] = ("auto",)) -> list[dict]:
    """One row per decode attention path (and, with a compiled runner, per eager/compiled);
    with several, their steps alternate so load changes hit all alike."""
    fb_once = sb.decode_step(batch, context)
    backend = sb.runner.attn_backend
    compiled = sb.runner.compiled
    variants = [(path, c) for path in paths for c in ((False, True) if compiled is not None else (False,))]

    def step_fn(path: str, use_compiled: bool):
        def step():
            backend.decode_path = path
            sb.runner.compiled = compiled if use_compiled else None
            fb_once.attn_metadata = None
            sb.run(fb_once)
        return step

    fns = {v: step_fn(*v) for v in variants}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
    for _ in range(steps):
        for v, fn in fns.items():
            times[v] += time_steps(fn, 0, 1)
    rows = []
    for v in variants:
        p50 = statistics.median(times[v])
        row = {"batch": batch, "context": context, "decode_path": v[0], "compiled": v[1], "ms_per_step_p50": p50,
               "ms_per_step_min": min(times[v]), "tok_per_s": batch * 1000.0 / p50}
        if profile:
            row["breakdown_ms"] = profile_breakdown(fns[v], max(3, steps // 2))
        rows.append(row)
    sb.runner.compiled = compiled
    return rows


def bench_prefill(sb: StepBench, tokens: int, chunk: int) -> dict:
    row = len(sb.pages)  # a fresh request row
    if row >= sb.req_to_token.shape[0] or tokens + 64 > sb.max_context:
        raise SystemExit("--prefill needs a free row and --context >= the prompt: raise --context")
    t0 = time.perf_counter()
    for s in range(0, tokens, chunk):
        sb.run(sb.batch(ForwardMode.EXTEND, [(row, s, min(chunk, tokens - s))]))
    return {"prefill_tokens": tokens, "chunk": chunk, "seconds": time.perf_counter() - t0}


def cpu_flags() -> str:
    return " ".join(simd_flags(host_cpu_flags())) or "unknown"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.step", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    a = p.add_argument
    a("--model-path", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2 GGUF)")
    a("--dtype", default="auto", help="as for tidal serve")
    a("--quantization", default=None, help="as for tidal serve (default: tidal serve's default)")
    a("--weight-prepack", default="auto", help="as for tidal serve")
    a("--quantized-max-tokens", type=int, default=8, help="as for tidal serve")
    a("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes to time")
    a("--context", type=int, default=256, help="KV tokens per request while timing decode")
    a("--page-size", type=int, default=16, help="KV page size")
    a("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    a("--one-thread-max-tokens", type=int, default=1,
      help="as for tidal serve: passes of at most this many tokens run on one thread (0: all on --threads)")
    a("--warmup", type=int, default=3, help="untimed steps first")
    a("--steps", type=int, default=10, help="timed steps (the median is reported)")
    a("--profile", action="store_true", help="also group profiler time by kind of op")
    a("--decode-paths", nargs="+", choices=DECODE_PATHS, default=["auto"],
      help="decode attention paths to time (tidal/model/attention.py); several alternate step by step "
           "in one run, for an A/B")
    a("--torch-compile", action="store_true",
      help="also time the decode step compiled as --enable-torch-compile does, alternating with eager steps")
    a("--prefill", type=int, default=0, help="also time prefilling one prompt of this many tokens")
    a("--chunk", type=int, default=512, help="prefill chunk size (for filling the pool and --prefill)")
    a("--output-file", default=None, help="write the results as JSON here")
    ns = p.parse_args(argv)
    max_batch = max(ns.batch_sizes) + (1 if ns.prefill else 0)
    context = max(ns.context, ns.prefill)
    kw = {} if ns.quantization is None else {"quantization": ns.quantization}
    kw["enable_torch_compile"] = ns.torch_compile  # eager unless asked (the server's default compiles)
    if ns.torch_compile:
        kw["torch_compile_max_bs"] = max(ns.batch_sizes)
    args = ServerArgs(model_path=ns.model_path or default_model_path(), dtype=ns.dtype, device="cpu",
                      page_size=ns.page_size, torch_threads=ns.threads, weight_prepack=ns.weight_prepack,
                      quantized_max_tokens=ns.quantized_max_tokens, one_thread_max_tokens=ns.one_thread_max_tokens,
                      max_total_tokens=(max_batch * (context // ns.page_size + 6)) * ns.page_size, **kw)
    sb = StepBench(args, max_batch, context)
    sb.fill(max(ns.batch_sizes), ns.context, ns.chunk)
    result = {"cpu_flags": cpu_flags(), "threads": sb.runner.torch_threads,
              "one_thread_max_tokens": ns.one_thread_max_tokens, "dtype": str(sb.runner.dtype),
              "weight_prepack": sb.runner.kernels.weight_prepack,
              "decode": []}
    for b in ns.batch_sizes:
        for row in bench_decode(sb, b, ns.context, ns.warmup, ns.steps, ns.profile, tuple(ns.decode_paths)):
            result["decode"].append(row)
            print(json.dumps(row))
    if ns.prefill:
        result["prefill"] = bench_prefill(sb, ns.prefill, ns.chunk)
        print(json.dumps(result["prefill"]))
    if ns.output_file:
        with open(ns.output_file, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
