"""Native int4 serving of a GGUF's Q4_0/Q4_1 weights (tidal/model/quant.py) against the exact float32 path.

The quantized model has the same int4 weights as the float32 one (the file's); what differs is
the precision of activations at the int4 matmuls (bfloat16), of the group scales (bfloat16) and
of the LM head's weights (Q8_0 in the file, per-row int8 here). Bounds below are measured values with headroom; a wrong code
layout, scale or zero shows up as garbage (top-1 agreement near 0, perplexity in the thousands).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_fixtures import one_thread  # noqa: F401  (autouse fixture)

from tidal.config import ServerArgs, default_model_path
from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.model.forward_batch import ForwardBatch, ForwardMode
from tidal.model.quant import Int4Linear, Int4Weight, Int8Linear, int4_from_gguf, resolve_quantization

gguf_quants = pytest.importorskip("gguf.quants")

# teacher-forced next-token agreement with the float32 model over ~300 tokens of English/code text
MIN_TOP1_AGREEMENT = 0.95  # measured 0.98 (171 tokens)
MAX_PPL_RATIO = 1.02  # measured 1.002; perplexity of the quantized path / float32 path on the same text
# w8a16 requantizes the file's 4-bit groups to one int8 scale per row: rows whose groups have
# very different scales lose bits (measured: agreement 0.93, perplexity ratio 1.009)
W8A16_MIN_TOP1_AGREEMENT = 0.90
W8A16_MAX_PPL_RATIO = 1.03
TEXT = ("The scheduler keeps a queue of waiting requests and a batch of running ones. Each step it "
        "admits what fits in the KV cache, runs one forward pass over the batch, samples a token for "
        "every request and streams it back. Prefix caching lets requests that share a system prompt "
        "skip recomputing it: the radix tree maps token prefixes to the KV slots that hold them. "
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
        "When memory runs short, the scheduler retracts the request with the least progress and puts "
        "it back in the queue; its cached prefix may survive in the tree. Chunked prefill splits a long "
        "prompt into pieces so that decoding requests keep getting tokens while it is processed.")



@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_from_gguf_is_exact(qtype):
    rows, cols = 8, 128
    w = np.random.default_rng(0).normal(size=(rows, cols)).astype(np.float32)
    qt = getattr(gguf_quants, qtype)
    raw = gguf_quants.quantize(w, qt.qtype)
    ref = gguf_quants.dequantize(raw, qt.qtype).reshape(rows, cols)
    mine = int4_from_gguf(raw, qtype, (rows, cols))
    assert mine.codes.dtype == torch.uint8 and int(mine.codes.max()) <= 15
    torch.testing.assert_close(mine.dequantize(), torch.from_numpy(ref), rtol=1e-6, atol=1e-6)


def test_int4_linear_matches_dequantized_matmul():
    g = torch.Generator().manual_seed(0)
    rows, cols = 96, 256
    w = Int4Weight(torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g),
                   torch.rand(rows, cols // 32, generator=g) * 0.05, torch.randn(rows, cols // 32, generator=g) * 0.1)
    dense = w.dequantize()
    bias = torch.randn(rows, generator=g)
    lin = Int4Linear(w, bias, dense.clone(), max_quant_tokens=4)
    x = torch.randn(3, cols, generator=g)
    ref = x @ dense.t() + bias
    y = lin(x)
    # bf16 activations, scales and output: relative error ~2^-8 of the output scale
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()
    assert not torch.equal(y, ref)  # the int4 kernel ran, not the dense copy
    big = torch.randn(5, cols, generator=g)  # over max_quant_tokens: the dense copy, exactly
    torch.testing.assert_close(lin(big), torch.nn.functional.linear(big, dense, bias), rtol=0, atol=0)


def test_int4_linear_without_dense_copy_runs_int4_for_every_size():
    w = Int4Weight(torch.randint(0, 16, (64, 64), dtype=torch.uint8), torch.full((64, 2), 0.01), torch.zeros(64, 2))
    lin = Int4Linear(w, None, None, max_quant_tokens=0)
    assert lin.dense is None
    x = torch.randn(40, 64)
    ref = x @ w.dequantize().t()
    assert (lin(x) - ref).abs().max() < 0.02 * ref.abs().max()


def test_resolve_quantization():
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", "gguf", "auto", cpu, 1) == "gguf"
    assert resolve_quantization("auto", "gguf", "bfloat16", cpu, 1) == "gguf"
    assert resolve_quantization("auto", "gguf", "float32", cpu, 1) == "none"  # the exact path
    assert resolve_quantization("auto", "hf", "auto", cpu, 1) == "none"
    assert resolve_quantization("auto", "gguf", "auto", cpu, 2) == "none"
    assert resolve_quantization("gguf", "gguf", "float32", cpu, 1) == "gguf"
    assert resolve_quantization("none", "gguf", "auto", cpu, 1) == "none"
    assert resolve_quantization("w8a16", "hf", "auto", cpu, 1) == "w8a16"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("w8a16", "hf", "auto", torch.device("cuda"), 1)
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_quantization("gguf", "hf", "auto", cpu, 1)
    with pytest.raises(ValueError, match="--tp"):
        resolve_quantization("gguf", "gguf", "auto", cpu, 2)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_quantization("int3", "gguf", "auto", cpu, 1)
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(model_path="x", quantization="int3").validate()


def _logits_over(model, cfg, ids: list[int], chunk: int) -> torch.Tensor:
    """Teacher-forced logits [len(ids), V], feeding `chunk` tokens per forward pass (1 = decode steps)."""
    n = len(ids)
    pool = MHATokenToKVPool(n + 16, 16, torch.float32, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    req_to_token = torch.zeros(1, n, dtype=torch.int64)
    req_to_token[0] = torch.arange(16, 16 + n)
    out = []
    with torch.inference_mode():
        for s in range(0, n, chunk):
            e = min(n, s + chunk)

            def t(x):
                return torch.tensor(x, dtype=torch.int64)

            mode = ForwardMode.DECODE if e - s == 1 and s > 0 else ForwardMode.EXTEND
            fb = ForwardBatch(mode, t(ids[s:e]), torch.arange(s, e), req_to_token[0, s:e].clone(), t([0]), t([e]),
                              t([s]), t([e - s]), req_to_token, pool, [e], [s], [e - s])
            out.append(model.compute_logits(model(fb)))
    return torch.cat(out)


@pytest.fixture(scope="module")
def models():
    from tidal.model.loader import load_model
    from tidal.model.tokenizer import load_tokenizer

    path = default_model_path()
    exact, cfg = load_model(path, torch.float32, "cpu", quantization="none")
    quant, _ = load_model(path, torch.float32, "cpu", quantization="gguf", max_quant_tokens=16)
    ids = load_tokenizer(path)(TEXT, add_special_tokens=False)["input_ids"]
    return exact, quant, cfg, ids


@pytest.fixture(scope="module")
def w8a16_model():
    from tidal.model.loader import load_model

    model, _ = load_model(default_model_path(), torch.float32, "cpu", quantization="w8a16", max_quant_tokens=16)
    return model


def _ppl(logits: torch.Tensor, ids: list[int]) -> float:
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def test_quantized_model_converted_every_gguf_int4_layer(models):
    _, quant, cfg, _ = models
    int4 = [m for m in quant.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 4 * cfg.num_layers  # qkv, o, gate_up, down of every layer
    assert isinstance(quant.lm_head, Int8Linear)  # Q8_0 in the file: per-row int8


def test_quantized_decode_agrees_with_float32(models):
    exact, quant, cfg, ids = models
    ref = _logits_over(exact, cfg, ids, chunk=64)
    q = _logits_over(quant, cfg, ids, chunk=1)  # decode steps: the int4 kernels
    agreement = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ppl_ref, ppl_q = _ppl(ref, ids), _ppl(q, ids)
    print(f"tokens {len(ids)}: top-1 agreement {agreement:.4f}, ppl float32 {ppl_ref:.3f} int4 {ppl_q:.3f}")
    assert agreement >= MIN_TOP1_AGREEMENT
    assert ppl_q / ppl_ref <= MAX_PPL_RATIO


def test_w8a16_decode_agrees_with_float32(models, w8a16_model):
    exact, _, cfg, ids = models
    assert sum(isinstance(m, Int8Linear) for m in w8a16_model.modules()) == 4 * cfg.num_layers + 1  # + LM head
    ref = _logits_over(exact, cfg, ids, chunk=64)
    q = _logits_over(w8a16_model, cfg, ids, chunk=1)
    agreement = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ppl_ref, ppl_q = _ppl(ref, ids), _ppl(q, ids)
    print(f"w8a16: top-1 agreement {agreement:.4f}, ppl float32 {ppl_ref:.3f} int8 {ppl_q:.3f}")
    assert agreement >= W8A16_MIN_TOP1_AGREEMENT
    assert ppl_q / ppl_ref <= W8A16_MAX_PPL_RATIO


def test_quantized_prefill_over_threshold_is_the_exact_path(models):
    exact, quant, cfg, ids = models
    ref = _logits_over(exact, cfg, ids[:100], chunk=50)
    torch.testing.assert_close(_logits_over(quant, cfg, ids[:100], chunk=50), ref, rtol=0, atol=0)


def _greedy(model, cfg, prompt: list[int], n: int) -> list[int]:
    """Single-request greedy decoding the way a server runs it: the prompt in one pass, then one token per pass."""
    ids, out = list(prompt), []
    logits = _logits_over(model, cfg, ids, chunk=len(ids))[-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        ids.append(out[-1])
        logits = _logits_over_last(model, cfg, ids)
    return out


def _logits_over_last(model, cfg, ids: list[int]) -> torch.Tensor:
    # recomputes the prefix in one pass (over the dense threshold: the exact path), then the last token alone
    n = len(ids)
    pool = MHATokenToKVPool(n + 16, 16, torch.float32, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    req_to_token = torch.arange(16, 16 + n, dtype=torch.int64)[None]

    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    with torch.inference_mode():
        for s, e, mode in ((0, n - 1, ForwardMode.EXTEND), (n - 1, n, ForwardMode.DECODE)):
            fb = ForwardBatch(mode, t(ids[s:e]), torch.arange(s, e), req_to_token[0, s:e].clone(), t([0]), t([e]),
                              t([s]), t([e - s]), req_to_token, pool, [e], [s], [e - s])
            logits = model.compute_logits(model(fb)[-1:])
    return logits[0]


def test_server_serves_the_gguf_quantized_by_default(models):
    """`tidal serve` at its defaults runs the int4 path, and its greedy tokens are the in-process quantized model's."""
    import httpx

    from tests.servers import Server

    _, quant, cfg, ids = models
    prompt = ids[:40]  # > --quantized-max-tokens: prefilled on the dense copy, decoded in int4
    ref = _greedy(quant, cfg, prompt, 12)
    srv = Server("--dtype", "auto", "--quantized-max-tokens", "16", "--torch-threads", "1")
    try:
        info = httpx.get(srv.url + "/server_info", timeout=30).json()
        assert info["scheduler_info"]["quantization"] == "gguf"
        assert info["quantization"] == "auto"
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
        r = httpx.post(srv.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == ref
    finally:
        assert srv.stop() == 0
