"""Hugging Face model directories: config.json (+ generation_config.json) and *.safetensors."""

from __future__ import annotations

import json
import os
from typing import Iterator, Optional

import torch

from tidal.model.config import ModelConfig, config_from_hf


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_hf_config(model_dir: str) -> ModelConfig:
    cfg = _read_json(os.path.join(model_dir, "config.json"))
    if cfg is None:
        raise FileNotFoundError(f"no config.json in {model_dir}")
    gen = _read_json(os.path.join(model_dir, "generation_config.json"))
    return config_from_hf(cfg, gen)


def safetensors_files(model_dir: str) -> list[str]:
    index = _read_json(os.path.join(model_dir, "model.safetensors.index.json"))
    if index is not None:
        names = sorted(set(index["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (pytorch .bin checkpoints are not supported)")
    return [os.path.join(model_dir, n) for n in names]


def _iter_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                yield name, f.get_tensor(name)


def load_hf_dir(model_dir: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Returns the config and a lazy iterator of (parameter name, tensor) from the checkpoint."""
    config = read_hf_config(model_dir)
    return config, _iter_weights(safetensors_files(model_dir))
