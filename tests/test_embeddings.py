"""Embeddings (`--is-embedding`): pooling config detection, and the scheduler on the real model
against transformers' hidden states pooled the same way.

Reference: transformers' `model.model(ids).last_hidden_state` (the final norm's output) of the
same GGUF in float32, pooled (last / mean / cls) and L2-normalized. Tolerance on the float32 path:
cosine > 0.9999 and max abs diff < 1e-4 per embedding (measured: ~2e-6).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_fixtures import one_thread  # noqa: F401  (autouse fixture)

from tidal.config import ServerArgs, default_model_path, server_args_from_namespace
from tidal.messages import GenerateReq
from tidal.model.pooling import DEFAULT_POOLING, PoolState, pooling_from_model, resolve_pooling
from tidal.sampling_params import SamplingParams

MAX_ABS = 1e-4
MIN_COSINE = 0.9999
CHUNK = 8  # the long prompt below spans several chunked-prefill passes


def _st_dir(tmp_path, pooling: dict, normalize: bool) -> str:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    cfg = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
           "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, **pooling}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_sentence_transformers_pooling_is_read(tmp_path):
    d = _st_dir(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True)
    cfg = pooling_from_model(d)
    assert (cfg.method, cfg.normalize) == ("mean", True)


def test_sentence_transformers_cls_without_normalize_and_unsupported_max(tmp_path):
    cls_dir = tmp_path / "cls"
    cls_dir.mkdir()
    cfg = pooling_from_model(_st_dir(cls_dir, {"pooling_mode_cls_token": True}, normalize=False))
    assert (cfg.method, cfg.normalize) == ("cls", False)
    max_dir = tmp_path / "max"
    max_dir.mkdir()
    with pytest.raises(ValueError, match="not supported"):
        pooling_from_model(_st_dir(max_dir, {"pooling_mode_max_tokens": True}, normalize=False))


def test_gguf_pooling_type_is_read(tmp_path):
    import gguf

    path = str(tmp_path / "emb.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.pooling_type", 1)  # llama.cpp: mean
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = pooling_from_model(path)
    assert (cfg.method, cfg.normalize, cfg.source) == ("mean", True, "GGUF pooling_type")


def test_causal_lm_defaults_to_last_token_normalized_and_flags_override():
    path = default_model_path()
    assert pooling_from_model(path) == DEFAULT_POOLING
    args = ServerArgs(model_path=path, is_embedding=True, pooling_method="mean", embedding_normalize=False)
    cfg = resolve_pooling(args)
    assert (cfg.method, cfg.normalize, cfg.source) == ("mean", False, "command line")


def test_flags_parse_and_imply_no_radix_cache():
    import argparse

    from tidal.config import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    args = server_args_from_namespace(p.parse_args(["--is-embedding", "--pooling-method", "cls",
                                                    "--no-embedding-normalize"]))
    assert args.is_embedding and args.pooling_method == "cls" and args.embedding_normalize is False
    assert args.disable_radix_cache
    with pytest.raises(ValueError, match="need --is-embedding"):
        server_args_from_namespace(p.parse_args(["--pooling-method", "mean"]))


def test_mean_pool_state_equals_one_pass_over_chunks():
    rows = torch.randn(10, 4)
    whole, chunked = PoolState("mean"), PoolState("mean")
    whole.add(rows, 0)
    for start in range(0, 10, 3):
        chunked.add(rows[start:start + 3], start)
    assert np.allclose(whole.result(True), chunked.result(True), atol=1e-6)
    assert np.allclose(whole.result(False), rows.mean(0).tolist(), atol=1e-6)


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def runner():
    from tidal.model.runner import ModelRunner

    args = ServerArgs(model_path=default_model_path(), dtype="float32", device="cpu", max_total_tokens=4096,
                      torch_threads=1)
    return ModelRunner(args)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tidal.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    texts = ["Hello", "The quick brown fox jumps over the lazy dog",
             "Paging through memory, the engine reads each token's keys and values from scattered slots, and "
             "the embedding must not change when the prompt is split into chunks."]
    ids = [tok(t)["input_ids"] for t in texts]
    assert len(ids[2]) > 2 * CHUNK
    return ids


@pytest.fixture(scope="module")
def hf_hidden(prompts) -> list[torch.Tensor]:
    """transformers' last_hidden_state [len, hidden] per prompt (float32, same GGUF)."""
    from tidal.bench.hf_baseline import load_model

    hf = load_model(None, "float32", "cpu")
    with torch.inference_mode():
        return [hf.model(torch.tensor([p])).last_hidden_state[0].float() for p in prompts]


def hf_pool(hidden: torch.Tensor, method: str) -> torch.Tensor:
    v = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    return F.normalize(v, dim=0)


def assert_close(got: list[float], ref: torch.Tensor) -> None:
    g = torch.tensor(got)
    assert float((g - ref).abs().max()) < MAX_ABS
    assert float(F.cosine_similarity(g, ref, dim=0)) > MIN_COSINE


def run_to_idle(sched, max_steps: int = 200) -> dict:
    outs = {}
    for _ in range(max_steps):
        did = sched.step()
        sched.check_integrity()
        for o in sched.take_outbox():
            outs[o.rid] = o
        if not did and sched.is_idle():
            return outs
    raise AssertionError("scheduler did not go idle")


def embed_req(rid: str, ids: list[int]) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=0), embedding=True)


@pytest.mark.parametrize("method,mode", [("last", "null"), ("mean", "null"), ("cls", "null"), ("mean", "decode")])
def test_engine_embeddings_equal_hf_pooled(runner, prompts, hf_hidden, method, mode):
    """Several prompts in one batch, the longest split into chunked-prefill passes; KV and req
    slots are all free afterwards; the same in the decode role (computed locally, no transfer)."""
    from tidal.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=default_model_path(), is_embedding=True, pooling_method=method,
                      chunked_prefill_size=CHUNK, disaggregation_mode=mode)
    sched = Scheduler(args, runner)
    for i, p in enumerate(prompts):
        sched.handle(embed_req(str(i), p))
    outs = run_to_idle(sched)
    assert sched.stats.num_prefill_batches >= 3  # the long prompt took several chunks
    for i in range(len(prompts)):
        o = outs[str(i)]
        assert o.finish_reason.type == "length" and o.prompt_tokens == len(prompts[i])
        assert_close(o.embedding, hf_pool(hf_hidden[i], method))
    assert sched.mem.req_to_token_pool.available_size() == sched.mem.req_to_token_pool.size
    assert sched.mem.allocator.available_size() == sched.mem.max_total_tokens


def test_generation_scheduler_refuses_embedding_requests(runner, prompts):
    from tidal.scheduler.scheduler import Scheduler

    sched = Scheduler(ServerArgs(model_path=default_model_path()), runner)
    sched.handle(embed_req("e", prompts[0]))
    [out] = sched.take_outbox()
    assert out.finish_reason.status_code == 400 and "--is-embedding" in out.finish_reason.message
    assert out.embedding is None


def test_generation_server_refuses_embedding_routes():
    from fastapi.testclient import TestClient

    from tidal.server.app import ServerContext, create_app

    args = ServerArgs(model_path=default_model_path())
    client = TestClient(create_app(ServerContext(args=args, tm=None, metrics=None)))
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"})):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "this server is not an embedding model; start it with --is-embedding"


def test_aborted_chunked_embedding_frees_its_kv(runner, prompts):
    from tidal.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=default_model_path(), is_embedding=True, chunked_prefill_size=CHUNK)
    sched = Scheduler(args, runner)
    sched.handle(embed_req("long", prompts[2]))
    assert sched.step() and sched.planner.chunked_req is not None  # one chunk done, KV held
    sched.abort("long")
    outs = run_to_idle(sched)
    assert outs["long"].finish_reason.type == "abort" and outs["long"].embedding is None
    assert sched.mem.allocator.available_size() == sched.mem.max_total_tokens
    assert sched.mem.req_to_token_pool.available_size() == sched.mem.req_to_token_pool.size


def test_sentence_transformers_directory_end_to_end(tmp_path):
    """A Hugging Face directory declaring mean pooling + Normalize: the scheduler's embeddings
    equal the directory's transformers model, mean-pooled and normalized, without any flag."""
    import transformers

    from tidal.model.runner import ModelRunner
    from tidal.scheduler.scheduler import Scheduler

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _st_dir(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True)
    args = ServerArgs(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=512,
                      torch_threads=1, is_embedding=True, chunked_prefill_size=CHUNK)
    sched = Scheduler(args, ModelRunner(args))
    assert (sched.embedder.pooling.method, sched.embedder.pooling.normalize) == ("mean", True)
    prompts = [[5, 9, 13], list(range(1, 3 * CHUNK + 2))]
    for i, p in enumerate(prompts):
        sched.handle(embed_req(str(i), p))
    outs = run_to_idle(sched)
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            assert_close(outs[str(i)].embedding, hf_pool(hf.model(torch.tensor([p])).last_hidden_state[0], "mean"))
