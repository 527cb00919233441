"""Tiny random transformers models (a few layers, hidden 64) for parity tests: no model hub is reachable."""

from __future__ import annotations

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_hf(config_class: str, seed: int = 0, **kw):
    """A transformers causal LM of `config_class` (e.g. "LlamaConfig") from TINY updated by kw, its weights
    random and every norm and bias perturbed (they start at 1 and 0), in eval mode."""
    import transformers

    cfg = getattr(transformers, config_class)(**{**TINY, **kw})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tiny_hf_dir(path, config_class: str = "LlamaConfig", **kw) -> str:
    """tiny_hf(...) saved as an HF directory (config.json + model.safetensors) at path."""
    tiny_hf(config_class, **kw).save_pretrained(path, safe_serialization=True)
    return str(path)
