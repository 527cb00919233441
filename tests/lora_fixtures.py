"""Random PEFT LoRA adapters on the default model (SmolLM2-135M GGUF loaded in transformers), saved once per session."""

from __future__ import annotations

import os

import pytest
import torch

from tidal.config import default_model_path

# name -> (rank, alpha, use_rslora, target modules): different ranks, scalings and targets
ADAPTERS = {
    "attn8": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp4": (4, 8, True, ["v_proj", "gate_proj", "up_proj", "down_proj"]),
    "all16": (16, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
# B is random (init_lora_weights=False) and scaled down so the adapters steer the model without drowning it
B_SCALE = 0.2


def load_hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    return hf.eval()


def make_adapters(out_dir: str) -> dict[str, str]:
    """Saves every adapter of ADAPTERS under out_dir/<name>; returns {name: path}."""
    import copy

    from peft import LoraConfig, get_peft_model

    base = load_hf_model()
    paths = {}
    for i, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        cfg = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                         init_lora_weights=False, lora_dropout=0.0)
        model = get_peft_model(copy.deepcopy(base), cfg)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(B_SCALE)
        paths[name] = os.path.join(out_dir, name)
        model.save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory) -> dict[str, str]:
    return make_adapters(str(tmp_path_factory.mktemp("lora")))


def lora_path_args(paths: dict[str, str]) -> list[str]:
    return [f"{name}={path}" for name, path in paths.items()]
