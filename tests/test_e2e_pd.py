"""End-to-end PD disaggregation on the default model: `tidal cluster` (1 prefill + 1 decode +
router) against a null server, over real KV transfer."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import sys

import httpx
import pytest

from servers import Server, free_port, free_port_block

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village far away from the sea and the mountains, there lived",
    "List three colors:",
]
SERVER_ARGS = "--max-total-tokens 8192 --dtype float32 --chunked-prefill-size 16"


def start_cluster(backend: str, page_size: int, env: dict | None = None) -> tuple[Server, int, int]:
    port, base, bport = free_port(), free_port_block(4), free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", backend, "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(bport), "--policy", "round_robin", "--torch-threads", "1",
           "--server-args", f"{SERVER_ARGS} --page-size {page_size}"]
    return Server(cmd=cmd, port=port, env=env), base, bport


@pytest.fixture(scope="module")
def null_server():
    s = Server("--chunked-prefill-size", "16", "--torch-threads", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module", params=[("tcp", 16), ("shm", 1)], ids=["tcp-ps16", "shm-ps1"])
def cluster(request):
    backend, page_size = request.param
    router, base, bport = start_cluster(backend, page_size, env={"TIDAL_DISAGG_BOOTSTRAP_TIMEOUT": "8"})
    yield router, f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}", bport
    router.stop()


def gen(url: str, text: str, n: int = 24, stream: bool = False, **extra) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()
    last = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
    return last


def test_router_outputs_equal_null_server(cluster, null_server):
    router, prefill_url, decode_url, _ = cluster
    ref = [gen(null_server.url, p)["output_ids"] for p in PROMPTS]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: gen(router.url, p)["output_ids"], PROMPTS))
    assert got == ref
    streamed = [gen(router.url, p, stream=True)["output_ids"] for p in PROMPTS[:2]]
    assert streamed == ref[:2]
    metrics = httpx.get(decode_url + "/metrics", timeout=10).text
    assert 'tidal:queue_size{model_name="SmolLM2-135M-Instruct.Q4_1.gguf",queue="transfer"}' in metrics
    info = httpx.get(prefill_url + "/server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "prefill"


def test_openai_chat_through_router_equals_null(cluster, null_server):
    router = cluster[0]
    body = {"model": "default", "messages": [{"role": "user", "content": "Name a fruit."}],
            "max_tokens": 16, "temperature": 0}
    a = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=300).json()
    b = httpx.post(null_server.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_prompt_only_and_openai_errors_through_router(cluster, null_server):
    """max_new_tokens 0 over PD: the decode side drops the prefill's first token (no output, same
    prompt logprobs as null); the OpenAI 400/404 answers pass through the router."""
    router, _, decode_url, _ = cluster
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}
    pd_out = httpx.post(router.url + "/generate", json=body, timeout=300).json()
    ref = httpx.post(null_server.url + "/generate", json=body, timeout=300).json()
    assert pd_out["output_ids"] == [] and pd_out["meta_info"]["finish_reason"]["length"] == 0
    assert len(pd_out["meta_info"]["input_token_logprobs"]) == len(ref["meta_info"]["input_token_logprobs"])
    assert httpx.get(decode_url + "/get_load", timeout=10).json()[0]["num_reqs"] == 0
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "model": "nope"}, timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert gen(router.url, PROMPTS[0], 4)["meta_info"]["completion_tokens"] == 4


def test_raw_bootstrap_requests_without_router(cluster, null_server):
    _, prefill_url, decode_url, bport = cluster
    room = random.randrange(2**63)
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    with cf.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(gen, prefill_url, PROMPTS[0], 12, **fields)
        fd = pool.submit(gen, decode_url, PROMPTS[0], 12, **fields)
        p, d = fp.result(), fd.result()
    assert p["meta_info"]["completion_tokens"] == 1
    assert d["output_ids"] == gen(null_server.url, PROMPTS[0], 12)["output_ids"]


def test_bad_bootstrap_input_gets_clear_errors(cluster):
    _, prefill_url, decode_url, bport = cluster
    r = httpx.post(prefill_url + "/generate", json={"text": "hi"}, timeout=60)
    assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]
    bad = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": 70000, "bootstrap_room": 1}
    r = httpx.post(decode_url + "/generate", json=bad, timeout=60)
    assert r.status_code == 400
    unreachable = {"text": "hi", "sampling_params": {"max_new_tokens": 2},
                   "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 5}
    r = httpx.post(decode_url + "/generate", json=unreachable, timeout=120)
    assert r.status_code >= 400 and r.json()["error"]["message"]
    assert gen(decode_url, "still serving?", 2)["meta_info"]["completion_tokens"] == 2  # local prefill
