"""Embeddings end to end on the default model: an `--is-embedding` server (null mode, then
switched through prefill and decode with requests in flight) and a 1P1D `tidal cluster` whose
router answers /v1/embeddings like the null server.

Reference: transformers' last_hidden_state of the same GGUF (float32), last-token pooled and
L2-normalized; tolerance max abs diff < 1e-4 and cosine > 0.9999 (measured ~2e-6). Between tidal
servers (other batch compositions, same float32 kernels) max abs diff < 1e-5.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from servers import Server, free_port, free_port_block

pytestmark = pytest.mark.timeout(900)

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog",
         "A prompt longer than the sixteen-token chunked prefill size, so that the server computes its "
         "embedding over several prefill passes and must still match the reference."]
EMB_ARGS = ("--is-embedding", "--chunked-prefill-size", "16", "--torch-threads", "1")


def embed(url: str, inp, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json={"input": inp, **extra}, timeout=300)


def vectors(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data])


@pytest.fixture(scope="module")
def emb():
    s = Server(*EMB_ARGS, "--enable-dynamic-disaggregation", "--disaggregation-transfer-backend", "tcp",
               "--disaggregation-bootstrap-port", str(free_port()), "--enable-integrity-check")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def token_ids(emb) -> list[list[int]]:
    r = httpx.post(emb.url + "/tokenize", json={"prompt": TEXTS}, timeout=30)
    ids = r.json()["tokens"]
    assert len(ids[2]) > 16
    return ids


@pytest.fixture(scope="module")
def reference(token_ids) -> np.ndarray:
    from tidal.bench.hf_baseline import load_model

    torch.set_num_threads(1)
    hf = load_model(None, "float32", "cpu")
    with torch.inference_mode():
        rows = [F.normalize(hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float(), dim=0)
                for ids in token_ids]
    return torch.stack(rows).numpy()


def assert_matches(got: np.ndarray, ref: np.ndarray, max_abs: float = 1e-4) -> None:
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < max_abs
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.9999


def test_batched_embeddings_equal_hf(emb, token_ids, reference):
    r = embed(emb.url, TEXTS)
    assert_matches(vectors(r), reference)
    body = r.json()
    assert body["object"] == "list" and body["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert body["usage"]["prompt_tokens"] == sum(len(x) for x in token_ids)
    assert_matches(vectors(embed(emb.url, token_ids)), reference)  # list of token-id lists
    assert_matches(vectors(embed(emb.url, token_ids[2])), reference[2:])  # one token-id list
    assert_matches(vectors(embed(emb.url, TEXTS[1], model="default")), reference[1:2])
    load = httpx.get(emb.url + "/get_load", timeout=10).json()[0]
    assert load["num_tokens"] == 0  # every embedding request freed its KV


def test_openai_client_and_encode(emb, reference):
    import openai

    client = openai.OpenAI(base_url=emb.url + "/v1", api_key="none")
    res = client.embeddings.create(model="default", input=TEXTS)  # the client asks for base64
    assert_matches(np.array([d.embedding for d in res.data]), reference)
    assert res.usage.prompt_tokens > 0
    floats = client.embeddings.create(model="default", input=TEXTS[0], encoding_format="float")
    assert_matches(np.array([floats.data[0].embedding]), reference[:1])

    one = httpx.post(emb.url + "/encode", json={"text": TEXTS[2]}, timeout=60).json()
    assert_matches(np.array([one["embedding"]]), reference[2:])
    assert one["meta_info"]["prompt_tokens"] > 16
    many = httpx.post(emb.url + "/encode", json={"text": TEXTS}, timeout=60).json()
    assert_matches(np.array([m["embedding"] for m in many]), reference)
    info = httpx.get(emb.url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is False and info["pooling"].startswith("last + L2")


def test_bad_requests_are_400(emb):
    for path, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(emb.url + path, json=body, timeout=30)
        assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], (path, r.text)
    r = embed(emb.url, "hi", dimensions=64)
    assert r.status_code == 400 and "dimensions" in r.json()["error"]["message"]
    assert embed(emb.url, "hi", encoding_format="int8").status_code == 400
    assert embed(emb.url, []).status_code == 400
    assert embed(emb.url, "").status_code == 400
    assert embed(emb.url, "hi", model="gpt-4").status_code == 404
    too_long = embed(emb.url, [1] * 9000)  # the context is 8192 tokens
    assert too_long.status_code == 400 and "longer than" in too_long.json()["error"]["message"]
    assert httpx.post(emb.url + "/encode", json={}, timeout=30).status_code == 400
    assert embed(emb.url, TEXTS[:1]).status_code == 200  # the server is fine afterwards


def _switch(url: str, mode: str) -> httpx.Response:
    return httpx.post(url + "/admin/switch_disaggregation_mode",
                      json={"mode": mode, "drain": True, "timeout_s": 120}, timeout=300)


def test_role_switch_with_embeddings_in_flight(emb, reference):
    """Requests in flight when a drained switch starts all complete with the reference results;
    every role then answers embeddings locally."""
    batch = TEXTS * 3
    expected = np.concatenate([reference] * 3)
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(embed, emb.url, batch) for _ in range(4)]
        while httpx.get(emb.url + "/get_load", timeout=10).json()[0]["num_reqs"] == 0:
            time.sleep(0.01)  # until the scheduler holds some of them
        switched = _switch(emb.url, "prefill")
        results = [f.result() for f in futures]
    assert switched.status_code == 200, switched.text
    assert switched.json()["timings_ms"]["drain"] > 0  # there was something to drain
    for r in results:
        assert_matches(vectors(r), expected)
    assert_matches(vectors(embed(emb.url, TEXTS)), reference)  # prefill role
    assert _switch(emb.url, "decode").status_code == 200
    assert_matches(vectors(embed(emb.url, TEXTS)), reference)  # decode role
    assert _switch(emb.url, "null").status_code == 200
    assert httpx.get(emb.url + "/get_load", timeout=10).json()[0]["num_tokens"] == 0


def test_pd_cluster_router_equals_null_server(emb, token_ids):
    """prefill + decode + router, each server started with --is-embedding: the router sends
    embeddings to the prefill worker, which computes them without any KV transfer."""
    null_vectors = vectors(embed(emb.url, TEXTS))
    port, base = free_port(), free_port_block(4)
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", "tcp", "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(free_port()), "--torch-threads", "1",
           "--server-args", "--max-total-tokens 8192 --dtype float32 " + " ".join(EMB_ARGS)]
    router = Server(cmd=cmd, port=port)
    try:
        assert_matches(vectors(embed(router.url, TEXTS)), null_vectors, max_abs=1e-5)
        enc = httpx.post(router.url + "/encode", json={"input_ids": token_ids}, timeout=120).json()
        assert_matches(np.array([e["embedding"] for e in enc]), null_vectors, max_abs=1e-5)
        prefill_url, decode_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
        prompts = {url: httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["total_prompt_tokens"]
                   for url in (prefill_url, decode_url)}
        assert prompts[prefill_url] >= 2 * sum(len(x) for x in token_ids) and prompts[decode_url] == 0
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 400
    finally:
        router.stop()
