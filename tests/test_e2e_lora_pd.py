"""Multi-LoRA through prefill/decode disaggregation: a 1P1D `tidal cluster` (both servers load the same
adapters; the router forwards lora_path; the decode side decodes with the adapter), and servers whose
role is switched at runtime (adapters stay loaded, requests keep their adapter)."""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time

import httpx
import pytest

from servers import Server, all_ready, free_port, free_port_block

pytestmark = pytest.mark.timeout(900)

CASES = [("The quick brown fox", None), ("The quick brown fox", "attn8"), ("The quick brown fox", "mlp4"),
         ("Once upon a time, in a small village by the sea,", "attn8")]


def lora_flags(paths: dict[str, str]) -> list[str]:
    return ["--enable-lora", "--lora-paths", f"attn8={paths['attn8']}", f"mlp4={paths['mlp4']}"]


def gen(url: str, text: str, lora, n: int = 12) -> list[int]:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "lora_path": lora}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def all_cases(url: str) -> list[list[int]]:
    with cf.ThreadPoolExecutor(len(CASES)) as pool:  # concurrent: adapters share batches
        return list(pool.map(lambda c: gen(url, *c), CASES))


@pytest.fixture(scope="module")
def reference(lora_adapters) -> list[list[int]]:
    s = Server("--torch-threads", "1", "--chunked-prefill-size", "16", *lora_flags(lora_adapters))
    try:
        out = [gen(s.url, *c) for c in CASES]
    finally:
        s.stop()
    assert out[0] != out[1] and out[0] != out[2]  # the adapters matter for these prompts
    return out


def test_1p1d_cluster_serves_adapters_like_null(lora_adapters, reference):
    port, base, bport = free_port(), free_port_block(4), free_port()
    server_args = ("--max-total-tokens 8192 --dtype float32 --chunked-prefill-size 16 --page-size 16 "
                   + " ".join(lora_flags(lora_adapters)))
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", "tcp", "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(bport), "--policy", "round_robin", "--torch-threads", "1",
           "--server-args", server_args]
    router = Server(cmd=cmd, port=port)
    try:
        assert all_cases(router.url) == reference
        body = {"model": "attn8", "prompt": CASES[1][0], "max_tokens": 12, "temperature": 0}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["model"] == "attn8"
        unknown = httpx.post(router.url + "/generate", json={"text": "hi", "lora_path": "nope"}, timeout=60)
        assert unknown.status_code == 400
        decode_load = httpx.get(f"http://127.0.0.1:{base + 1}/get_load", timeout=10).json()[0]
        assert decode_load["num_reqs"] == 0
        # the router loads and unloads an adapter on every worker (prefill and decode alike)
        loaded = httpx.post(router.url + "/load_lora_adapter", timeout=120,
                            json={"lora_name": "mlp4-again", "lora_path": lora_adapters["mlp4"]})
        assert loaded.status_code == 200, loaded.text
        assert sorted(w["role"] for w in loaded.json()["workers"]) == ["decode", "prefill"]
        assert gen(router.url, CASES[2][0], "mlp4-again") == reference[2]  # the same adapter, loaded at runtime
        again = httpx.post(router.url + "/unload_lora_adapter", json={"lora_name": "mlp4-again"}, timeout=120)
        assert again.status_code == 200, again.text
        gone = httpx.post(router.url + "/generate", json={"text": "hi", "lora_path": "mlp4-again"}, timeout=60)
        assert gone.status_code == 400
        twice = httpx.post(router.url + "/unload_lora_adapter", json={"lora_name": "mlp4-again"}, timeout=120)
        assert twice.status_code == 400 and not twice.json()["success"]
    finally:
        router.stop()


def _switch(router_url: str, worker: str, mode: str) -> None:
    r = httpx.post(router_url + "/admin/set_worker_role", json={"url": worker, "mode": mode}, timeout=180)
    assert r.status_code == 200, r.text


def test_adapters_survive_role_switches(lora_adapters, reference):
    servers = all_ready(*(Server("--enable-dynamic-disaggregation", "--disaggregation-transfer-backend", "tcp",
                                 "--disaggregation-bootstrap-port", str(free_port()), "--torch-threads", "1",
                                 "--chunked-prefill-size", "16", *lora_flags(lora_adapters), wait=False)
                          for _ in range(2)))
    a, b = (s.url for s in servers)
    rport = free_port()
    router = Server(cmd=[sys.executable, "-m", "tidal.router", "--port", str(rport), "--worker", a, b,
                         "--policy", "round_robin", "--health-check-interval-secs", "1"], port=rport)
    try:
        assert all_cases(a) == reference  # null
        _switch(router.url, a, "prefill")
        _switch(router.url, b, "decode")
        time.sleep(1.5)
        assert all_cases(router.url) == reference  # a prefills, b decodes, each with the adapter
        _switch(router.url, a, "null")
        _switch(router.url, b, "null")
        assert all_cases(a) == reference and all_cases(b) == reference
        assert [m["id"] for m in httpx.get(b + "/v1/models").json()["data"][1:]] == ["attn8", "mlp4"]
    finally:
        router.stop()
        for s in servers:
            s.stop()
