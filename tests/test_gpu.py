"""The same engine on CUDA (issue 9, lever 7): opt-in, `pytest -m gpu` on a machine with a GPU.

A tidal server on `--device cuda` answers greedy requests with Hugging Face transformers'
tokens on the same GGUF and device (float32, the exact path), and the compiled decode step
(`--enable-torch-compile`) with the eager server's. Skipped where torch sees no GPU.
`bash scripts/gpu_check.sh` runs these, then `tidal bench` and transformers `generate` on the GPU.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tidal.config import default_model_path

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three reasons to learn Rust:"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    from tidal.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids) -> list[list[int]]:
    import os

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).to("cuda").eval()
    model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens, like ignore_eos
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            t = torch.tensor([ids], device="cuda")
            gen = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def _serve(prompt_ids, *extra: str) -> tuple[dict, list[list[int]]]:
    from tests.servers import Server, greedy_concurrently

    srv = Server("--device", "cuda", *extra)
    try:
        info = httpx.get(srv.url + "/server_info", timeout=30).json()
        return info, greedy_concurrently(srv.url, prompt_ids, NEW_TOKENS)
    finally:
        assert srv.stop() == 0


def test_cuda_server_matches_transformers(prompt_ids, hf_greedy):
    info, out = _serve(prompt_ids)
    assert info["scheduler_info"]["device"].startswith("cuda")
    assert out == hf_greedy


def test_cuda_compiled_decode_matches_eager(prompt_ids, hf_greedy):
    _, out = _serve(prompt_ids, "--enable-torch-compile", "--torch-compile-max-bs", "4")
    assert out == hf_greedy
