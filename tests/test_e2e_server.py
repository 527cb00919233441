"""End-to-end: the real server on the default model, called over HTTP as a user would."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import time

import httpx
import pytest

from servers import Server

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
]


@pytest.fixture(scope="module")
def server():
    s = Server("--chunked-prefill-size", "64", "--enable-integrity-check")
    yield s
    s.stop()


def generate(server, text, n=16, **kw):
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, **kw.pop("sp", {})}, **kw}
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_greedy_is_deterministic_and_has_meta(server):
    a = generate(server, PROMPTS[0])
    b = generate(server, PROMPTS[0])
    assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
    meta = a["meta_info"]
    assert meta["completion_tokens"] == len(a["output_ids"]) <= 16
    assert meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert b["meta_info"]["cached_tokens"] > 0  # the same prompt again hits the radix cache


def test_concurrent_requests_batch_and_match_sequential(server):
    sequential = [generate(server, p, 24, sp={"ignore_eos": True})["output_ids"] for p in PROMPTS]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(generate, server, p, 24, sp={"ignore_eos": True}) for p in PROMPTS]
        concurrent = [f.result()["output_ids"] for f in futs]
    assert concurrent == sequential
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("tidal:max_decode_batch_size"))
    assert float(line.split()[-1]) > 1


def prefill_batches(server) -> int:
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    return info["internal_states"][0]["num_prefill_batches"]


def test_a_batch_requests_prompts_are_prefilled_in_one_step(server):
    """They reach the scheduler as one message; sent one by one, 8 came in 2 prefill steps."""
    prompts = [[1000 + 97 * i + j for j in range(8)] for i in range(8)]  # 64 tokens: one chunk
    before = prefill_batches(server)
    r = httpx.post(server.url + "/generate", json={"input_ids": prompts, "sampling_params": {"max_new_tokens": 1}},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["completion_tokens"] for o in r.json()] == [1] * len(prompts)
    assert prefill_batches(server) - before == 1


def test_stream_generate_concatenates_to_final(server):
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 20, "temperature": 0.0}, "stream": True}
    texts = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["text"])
    final = generate(server, PROMPTS[2], 20)["text"]
    assert len(texts) > 1 and texts[-1] == final


def test_openai_client_chat_streaming(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    full = client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="default", messages=msgs, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    comp = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert comp.choices[0].text == generate(server, PROMPTS[0], 8)["text"]


def test_abort_running_request(server):
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}, "rid": "to-abort",
            "stream": True}
    got = 0
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    httpx.post(server.url + "/abort_request", json={"rid": "to-abort"}, timeout=10)
                last = json.loads(line[6:])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 2000


@pytest.mark.parametrize(
    "body",
    [
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        {"text": "hi", "sampling_params": {"top_p": 1.5}},
        {"text": "hi", "sampling_params": {"temperature": "hot"}},
        {"text": "x " * 9000},
        {"input_ids": []},
        {"text": "hi", "priority": 1},  # without --enable-priority-scheduling
    ],
)
def test_bad_input_gets_400_json(server, body):
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_malformed_json_gets_400(server):
    r = httpx.post(server.url + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert generate(server, "Still alive?", 2)["meta_info"]["completion_tokens"] >= 1


def test_info_routes(server):
    for route in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load", "/v1/models"):
        assert httpx.get(server.url + route, timeout=10).status_code == 200, route
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200


def test_sigterm_leaves_no_orphans():
    s = Server("--max-running-requests", "4")
    children = subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True, text=True).stdout.split()
    assert children
    s.stop()
    time.sleep(1)
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


@pytest.mark.parametrize("backend", ["tidal", "openai-chat"])
def test_bench_against_real_server(server, backend, tmp_path):
    import argparse

    from tidal.bench import add_bench_args, run_bench

    out = tmp_path / "r.json"
    ns = add_bench_args(argparse.ArgumentParser()).parse_args([
        "--url", server.url, "--backend", backend, "--num-prompts", "4", "--random-input-len", "16",
        "--random-output-len", "8", "--random-range-ratio", "1", "--max-concurrency", "4", "--disable-tqdm",
        "--output-file", str(out),
    ])
    res = run_bench(ns)
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["total_output_tokens"] == 32
    assert res["ttft_ms"]["p50"] > 0 and out.exists()


def test_disable_overlap_schedule_gives_the_same_outputs(server):
    """The module's server overlaps decode passes (the default); one started with
    --disable-overlap-schedule answers every request token for token the same."""
    serial = Server("--chunked-prefill-size", "64", "--enable-integrity-check", "--disable-overlap-schedule")
    try:
        bodies = [
            {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}},
            {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 24, "temperature": 0.8, "seed": 11}},
            {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "stop": [" the"]}},
            {"text": PROMPTS[3], "sampling_params": {"max_new_tokens": 48, "temperature": 0.0}},
        ]
        for body in bodies:
            got = [httpx.post(s.url + "/generate", json=body, timeout=120).json() for s in (server, serial)]
            assert got[0]["output_ids"] == got[1]["output_ids"], body
            assert got[0]["meta_info"]["finish_reason"] == got[1]["meta_info"]["finish_reason"], body
        info = [httpx.get(s.url + "/server_info", timeout=10).json() for s in (server, serial)]
        assert [i["disable_overlap_schedule"] for i in info] == [False, True]
        overlapped = [i["internal_states"][0]["num_overlapped_batches"] for i in info]
        assert overlapped[0] > 0 and overlapped[1] == 0
    finally:
        serial.stop()
