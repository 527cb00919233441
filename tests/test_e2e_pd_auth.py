"""A real 1P1D pair (`tidal cluster`, default model, TCP transfer) with --api-key and
--admin-api-key: generation through the router needs the key, the prefill ranks register at
their bootstrap server with the server's own bootstrap key, strangers cannot re-point it, and
no key reaches a log line."""

from __future__ import annotations

import http.client
import json
import sys

import httpx
import psutil
import pytest

from servers import Server, free_port, free_port_block

pytestmark = pytest.mark.timeout(900)

API, ADMIN = "sk-pd-api-8d1e", "sk-pd-admin-0b7f"
SERVER_ARGS = "--max-total-tokens 8192 --dtype float32 --chunked-prefill-size 16 --page-size 16"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def put_route(port: int, headers: dict) -> int:
    body = {"role": "Prefill", "rank_ip": "10.6.6.6", "rank_port": 6666, "engine_rank": 0, "page_size": 16,
            "kv_dtype": "float32", "prefill_id": "evil"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("PUT", "/route", body=json.dumps(body), headers={"Content-Type": "application/json", **headers})
        return conn.getresponse().status
    finally:
        conn.close()


def test_pd_pair_with_keys():
    port, base, bport = free_port(), free_port_block(4), free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", "tcp", "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(bport), "--policy", "round_robin", "--torch-threads", "1",
           "--server-args", SERVER_ARGS, "--admin-api-key", ADMIN]
    # the API key from the environment, the admin key from a flag: both reach every member
    router = Server(cmd=cmd, port=port, env={"TIDAL_DISAGG_BOOTSTRAP_TIMEOUT": "8", "TIDAL_API_KEY": API})
    prefill = f"http://127.0.0.1:{base}"
    try:
        members = psutil.Process(router.proc.pid).children(recursive=True)
        assert len(members) >= 3  # two servers (and their schedulers) and the router
        for p in members:  # keys travel in the environment, not on world-readable command lines
            assert not {API, ADMIN} & set(p.cmdline()), p.cmdline()
        body = {"text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
        assert httpx.post(router.url + "/generate", json=body, timeout=60).status_code == 401
        first = httpx.post(router.url + "/generate", json=body, headers=bearer(API), timeout=300)
        assert first.status_code == 200, first.text
        assert len(first.json()["output_ids"]) == 8
        info = httpx.get(prefill + "/server_info", headers=bearer(API), timeout=10).json()
        assert info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_key"] == "<set>"
        for headers in ({}, bearer("wrong"), bearer(API), bearer(ADMIN)):  # only the server's own ranks
            assert put_route(bport, headers) == 401
        assert httpx.post(router.url + "/flush_cache", headers=bearer(API), timeout=30).status_code == 401
        r = httpx.post(router.url + "/flush_cache", headers=bearer(ADMIN), timeout=30)
        assert r.status_code == 200, r.text
        again = httpx.post(router.url + "/generate", json=body, headers=bearer(API), timeout=300)
        assert again.status_code == 200 and again.json()["output_ids"] == first.json()["output_ids"]
    finally:
        router.stop()
    log = open(router.log.name).read()
    assert "INFO" in log and "ready" in log
    assert API not in log and ADMIN not in log
