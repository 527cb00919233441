"""Peer baseline: offline transformers `generate` throughput on the default GGUF model.

    python -m tidal.bench.hf_baseline --batch-sizes 1 8 32 --input-len 128 \
        --output-len 128 --dtype bfloat16

Greedy decoding with min_new_tokens = max_new_tokens (never stops early) over a
left-padded batch of random-token prompts; prints output tokens/s per batch size as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch

from tidal.bench.datasets import DEFAULT_GGUF, default_model_dir, random_lengths

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_path: Optional[str], dtype: str, device: str) -> Any:
    """transformers model from a .gguf file, an HF dir, or the default GGUF model."""
    from transformers import AutoModelForCausalLM

    if not model_path:
        src, kw = default_model_dir(), {"gguf_file": DEFAULT_GGUF}
    elif model_path.endswith(".gguf"):
        src = os.path.dirname(os.path.abspath(model_path))
        kw = {"gguf_file": os.path.basename(model_path)}
    else:
        src, kw = model_path, {}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[dtype], **kw)
    return model.to(device).eval()


def _special_ids(model: Any) -> tuple[int, list[int]]:
    """(pad id, ids never to sample) from the model's configs."""
    ids: list[int] = []
    for cfg in (model.config, getattr(model, "generation_config", None)):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(cfg, name, None) if cfg is not None else None
            ids.extend(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
    eos = getattr(model.config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    pad = getattr(model.config, "pad_token_id", None)
    pad = pad if pad is not None else (eos if eos is not None else 0)
    return int(pad), sorted(set(int(i) for i in ids))


def make_batch(batch_size: int, input_len: int, vocab_size: int, pad_id: int,
               exclude: Sequence[int], rng: np.random.Generator,
               range_ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts: (input_ids [B, L], attention_mask [B, L])."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(exclude, dtype=np.int64))
    lens = random_lengths(rng, batch_size, input_len, range_ratio)
    width = max(lens)
    ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch_size, width), dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, width - n:] = torch.from_numpy(rng.choice(allowed, size=n))
        mask[i, width - n:] = 1
    return ids, mask


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                   pad_id: int) -> tuple[float, int]:
    """Greedy generate exactly ``new_tokens`` per row; (seconds, output tokens)."""
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id if model.generation_config else None
    cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=pad_id,
                           eos_token_id=eos)
    device = str(ids.device)
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        _sync(device)
        dt = time.perf_counter() - t0
    return dt, int(out.shape[0] * (out.shape[1] - ids.shape[1]))


def run_baseline(model: Any, batch_sizes: Sequence[int], input_len: int, output_len: int,
                 seed: int = 0, num_iters: int = 1, range_ratio: float = 1.0,
                 warmup: bool = True) -> list[dict[str, Any]]:
    """Per batch size: output tokens/s of `generate`, and the prefill (1-token) time."""
    device = str(next(model.parameters()).device)
    pad_id, exclude = _special_ids(model)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(seed)
    if warmup:
        ids, mask = make_batch(1, min(input_len, 16), vocab, pad_id, exclude, rng)
        timed_generate(model, ids.to(device), mask.to(device), 4, pad_id)
    results = []
    for bs in batch_sizes:
        ids, mask = make_batch(bs, input_len, vocab, pad_id, exclude, rng, range_ratio)
        ids, mask = ids.to(device), mask.to(device)
        prefill_s, _ = timed_generate(model, ids, mask, 1, pad_id)
        runs = [timed_generate(model, ids, mask, output_len, pad_id) for _ in range(num_iters)]
        secs = float(np.mean([r[0] for r in runs]))
        tokens = runs[0][1]
        results.append({"batch_size": bs, "output_tokens": tokens, "seconds": secs,
                        "output_tokens_per_s": tokens / secs,
                        "prefill_s": prefill_s,
                        "input_tokens": int(mask.sum().item())})
    return results


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = p.add_argument
    a("--model-path", default=None, help=".gguf file or HF dir (default: SmolLM2 GGUF)")
    a("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    a("--input-len", type=int, default=128)
    a("--output-len", type=int, default=128)
    a("--range-ratio", type=float, default=1.0, help="prompt lens in [len*ratio, len]")
    a("--dtype", choices=sorted(DTYPES), default="float32")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--num-iters", type=int, default=1)
    a("--seed", type=int, default=0)
    a("--output-file", default=None)
    return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ns = add_args(argparse.ArgumentParser(description=__doc__)).parse_args(argv)
    model = load_model(ns.model_path, ns.dtype, ns.device)
    results = run_baseline(model, ns.batch_sizes, ns.input_len, ns.output_len, ns.seed,
                           ns.num_iters, ns.range_ratio)
    out = {"engine": "transformers.generate", "model": ns.model_path or DEFAULT_GGUF,
           "dtype": ns.dtype, "device": ns.device,
           "device_name": torch.cuda.get_device_name() if ns.device.startswith("cuda") else
           "cpu", "torch": torch.__version__, "input_len": ns.input_len,
           "output_len": ns.output_len, "results": results}
    print(json.dumps(out, indent=1))
    if ns.output_file:
        with open(ns.output_file, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
