"""load_model(path, dtype, device): a GGUF file or a Hugging Face directory -> (model, ModelConfig)."""

from __future__ import annotations

import os
from typing import Iterator, Optional

import torch

from tidal.model.attention import TorchNativeAttnBackend
from tidal.model.config import ModelConfig
from tidal.model.llama import LlamaForCausalLM


def resolve_model_path(path: str) -> tuple[str, str]:
    """("gguf", file) or ("hf", directory). A directory holding no config.json but one .gguf counts as that file."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"{path}: expected a .gguf file or a model directory")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.exists(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    raise ValueError(f"{path}: no config.json, and {len(ggufs)} .gguf files (need exactly one)")


def read_model(path: str, int4_out: Optional[dict] = None) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Config and (HF name, float tensor) pairs; with int4_out, a GGUF's int4 weights are also stored there."""
    kind, resolved = resolve_model_path(path)
    if kind == "gguf":
        from tidal.model.gguf_loader import load_gguf

        return load_gguf(resolved, int4_out)
    from tidal.model.hf_loader import load_hf_dir

    return load_hf_dir(resolved)


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               attn_backend: Optional[TorchNativeAttnBackend] = None,
               context_length: Optional[int] = None, tp=None, quantization: str = "none",
               max_quant_tokens: int = 8, prepack: bool = False) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Builds the model without random init (on meta), then fills it from the checkpoint.

    context_length, if given, overrides the config's (it sizes the RoPE cache). With a TP
    communicator `tp`, the model holds this rank's shard of the weights. quantization "gguf"
    serves the file's Q4_0/Q4_1 weights as int4, "w8a16" every linear layer as int8
    (tidal/model/quant.py). prepack reorders the dense weights into oneDNN's layout
    (tidal/model/packed.py).
    """
    int4: Optional[dict] = {} if quantization == "gguf" else None
    config, weights = read_model(path, int4)
    if context_length:
        config.context_length = int(context_length)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend=attn_backend, tp=tp)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty may have untied them
    for rotary in (model.model.rotary, model.model.local_rotary):
        if rotary is not None:
            rotary.build(torch.device(device))  # float32 cache, recomputed for real
    model.load_weights(weights)
    if quantization == "gguf":
        from tidal.model.quant import quantize_model

        quantize_model(model, model.fuse_int4(int4), max_quant_tokens)
    elif quantization == "w8a16":
        from tidal.model.quant import quantize_model_w8a16

        quantize_model_w8a16(model, max_quant_tokens)
    if prepack:
        from tidal.model.packed import prepack_model

        prepack_model(model)
    return model.eval(), config
