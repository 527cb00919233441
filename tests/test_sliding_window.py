"""Sliding-window attention vs transformers on tiny random models: Mistral (every layer windowed), Qwen2,
Qwen3 and Gemma 3 with local and global layers (`max_window_layers`, `layer_types`), on both attention backends, over
prompts several windows long: whole and chunked prefill, prefill on a cached prefix, batched decode of
requests shorter and longer than the window, and short extends (speculative verification's shape)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import one_thread  # noqa: F401  (autouse fixture)
from test_model_parity import PagedKV, make_batch
from tiny_models import tiny_hf

from tidal.model.config import config_from_hf
from tidal.model.forward_batch import ForwardMode
from tidal.model.loader import load_model

ATOL = 1e-4  # float32, tiny models: measured diffs ~1e-6; a wrong window shows up as > 0.1
VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=6), [6, 6, 6]),
    "qwen2-max-window-layers": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
                                [None, 5, 5]),
    "qwen3-layer-types": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=7, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"]), [7, None, 7]),
    # sandwich norms, GELU, its own attention scale, a local RoPE (and linear scaling on the global layer)
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=6, head_dim=16, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e6}}), [6, 6, None]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    cls, kw, _ = FAMILIES[request.param]
    hf = tiny_hf(cls, **{**TINY, **kw})
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, hf, str(path)


@pytest.fixture(scope="module", params=["torch", "flex"])
def model(family, request):
    from tidal.model.attn_backend import create_attention_backend

    backend = create_attention_backend(request.param, torch.device("cpu"), compile_flex=False)
    m, cfg = load_model(family[2], torch.float32, "cpu", attn_backend=backend)
    return m, cfg


def _seqs(n: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def _run(m, fb) -> torch.Tensor:
    with torch.inference_mode():
        return m.compute_logits(m(fb))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_layer_windows_follow_transformers(family):
    name, hf, _ = family
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.layer_windows == FAMILIES[name][2]
    types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * cfg.num_layers
    assert [w is not None for w in cfg.layer_windows] == [t == "sliding_attention" for t in types]
    assert cfg.context_length == TINY["max_position_embeddings"]  # no longer capped at the window


@pytest.mark.parametrize("chunk", [40, 7, 3])
def test_prefill_in_chunks_then_decode(family, model, chunk):
    """A 40-token prompt (several windows) prefilled whole or in chunks crossing the window's edge, then decoded."""
    hf, (m, cfg) = family[1], model
    ids = _seqs(1, [44])[0]
    want = _hf_logits(hf, ids)
    kv = PagedKV(cfg, page_size=4, seed=chunk)
    got = []
    for s in range(0, 40, chunk):
        new = ids[s:min(s + chunk, 40)]
        got.append(_run(m, make_batch(kv, ForwardMode.EXTEND, [(0, new, s)])))
    for s in range(40, 44):
        got.append(_run(m, make_batch(kv, ForwardMode.DECODE, [(0, [ids[s]], s)])))
    assert _diff(torch.cat(got), want) < ATOL


def test_ragged_batches_across_the_window(family, model):
    """Requests shorter and longer than the window in one mixed extend, short extends, then batched decode."""
    hf, (m, cfg) = family[1], model
    seqs = _seqs(2, [5, 30, 12, 40])
    want = [_hf_logits(hf, s) for s in seqs]
    kv = PagedKV(cfg, page_size=4, seed=5)
    # requests 1 and 3 have a cached prefix (11 and 20 tokens); 0 and 2 are fresh (2 shorter, 12 longer than W)
    _run(m, make_batch(kv, ForwardMode.EXTEND, [(1, seqs[1][:11], 0), (3, seqs[3][:20], 0)]))
    cuts = [(0, 0, 2), (1, 11, 22), (2, 0, 9), (3, 20, 31)]
    got = _run(m, make_batch(kv, ForwardMode.EXTEND, [(r, seqs[r][a:b], a) for r, a, b in cuts]))
    assert _diff(got, torch.cat([want[r][a:b] for r, a, b in cuts])) < ATOL
    # short extends on cached prefixes (the batched short path): 1, 3 and 2 tokens
    short = [(0, 2, 3), (1, 22, 25), (2, 9, 11), (3, 31, 34)]
    got = _run(m, make_batch(kv, ForwardMode.EXTEND, [(r, seqs[r][a:b], a) for r, a, b in short]))
    assert _diff(got, torch.cat([want[r][a:b] for r, a, b in short])) < ATOL
    # batched decode: request 0 stays inside the window, the others are past it
    pos = {0: 3, 1: 25, 2: 11, 3: 34}
    for _ in range(4):
        live = [r for r in pos if pos[r] < len(seqs[r])]
        got = _run(m, make_batch(kv, ForwardMode.DECODE, [(r, [seqs[r][pos[r]]], pos[r]) for r in live]))
        assert _diff(got, torch.stack([want[r][pos[r]] for r in live])) < ATOL
        for r in live:
            pos[r] += 1


@pytest.mark.parametrize("page_size,chunk", [(1, 16), (4, 12)])
def test_engine_greedy_matches_transformers(family, page_size, chunk):
    """The scheduler on a windowed model (radix cache, chunked prefill, batched decode): transformers' tokens,
    and the same tokens again when a prompt comes back and is served on its cached prefix."""
    from tidal.config import ServerArgs
    from tidal.messages import GenerateReq
    from tidal.model.runner import ModelRunner
    from tidal.sampling_params import SamplingParams
    from tidal.scheduler.scheduler import Scheduler

    _, hf, path = family
    prompts = _seqs(3, [40, 9, 26])
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
            want.append(out[0, len(p):].tolist())
    args = ServerArgs(model_path=path, dtype="float32", device="cpu", page_size=page_size, chunked_prefill_size=chunk,
                      max_total_tokens=1024, torch_threads=1)
    sched = Scheduler(args, ModelRunner(args), tokenizer=None)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

    def serve(rids: list[str], idx: list[int]) -> dict[str, list[int]]:
        for rid, i in zip(rids, idx):
            sched.handle(GenerateReq(rid=rid, input_ids=prompts[i], sampling=sp))
        out: dict[str, list[int]] = {}
        for _ in range(200):
            did = sched.step()
            sched.check_integrity()
            for o in sched.take_outbox():
                out.setdefault(o.rid, []).extend(o.new_token_ids)
            if not did and sched.is_idle():
                break
        return out

    first = serve(["a0", "a1", "a2"], [0, 1, 2])
    assert [first[f"a{i}"] for i in range(3)] == want
    cached = sched.stats.total_cached_tokens
    again = serve(["b0", "b2"], [0, 2])  # served on their cached prefixes
    assert sched.stats.total_cached_tokens > cached
    assert [again["b0"], again["b2"]] == [want[0], want[2]]


def test_compiled_decode_step_equals_eager(family):
    """The compiled decode step (dynamic shapes) over windowed layers, as requests cross their window."""
    if family[0] != "qwen2-max-window-layers":
        pytest.skip("one family: the compile takes most of a minute")
    from tidal.bench.step import StepBench
    from tidal.config import ServerArgs

    args = ServerArgs(model_path=family[2], dtype="float32", device="cpu", page_size=4, torch_threads=1,
                      max_total_tokens=512, enable_torch_compile=True, torch_compile_max_bs=2)
    sb = StepBench(args, max_batch=2, context=64)
    lens = [3, 9]
    for row, n in enumerate(lens):
        sb.run(sb.batch(ForwardMode.EXTEND, [(row, 0, n)]))
    compiled = sb.runner.compiled
    assert compiled is not None
    for _ in range(5):  # row 0 goes from inside its window (5) to past it
        for rows in ([0], [0, 1]):
            fb = sb.batch(ForwardMode.DECODE, [(r, lens[r], 1) for r in rows])
            sb.runner.compiled = None
            eager = sb.run(fb)
            sb.runner.compiled = compiled
            fb.attn_metadata = None
            got = sb.run(fb)
            assert compiled.takes(fb)
            torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        lens = [n + 1 for n in lens]


def test_old_gemma3_keys():
    """Files written before transformers 5: `sliding_window_pattern` and `rope_local_base_freq`."""
    cfg = config_from_hf(dict(TINY, architectures=["Gemma3ForCausalLM"], num_hidden_layers=6, sliding_window=8,
                              sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=5000.0,
                              rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=16,
                              head_dim=16, hidden_activation="gelu_pytorch_tanh"))
    assert cfg.layer_windows == [8, 8, None, 8, 8, None]
    assert (cfg.rope_theta, cfg.rope_scaling["factor"]) == (1e6, 8.0)
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (5000.0, None)
    assert cfg.attn_scale == 0.25 and cfg.sandwich_norms and cfg.embed_scale == 8.0


@pytest.mark.parametrize("extra,message", [
    (dict(architectures=["FalconForCausalLM"], model_type="falcon"), "tidal serves"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2"), "Gemma3ForCausalLM"),
    (dict(architectures=["Gemma3ForCausalLM"], final_logit_softcapping=30.0), "soft-capping"),
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=4, layer_types=["chunked_attention"] * 3),
     "unsupported layer_types"),
    (dict(architectures=["MistralForCausalLM"], hidden_act="relu"), "unsupported activation"),
])
def test_unsupported_configs_are_clear_errors(extra, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(dict(TINY, **extra))
