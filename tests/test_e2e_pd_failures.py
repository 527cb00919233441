"""PD failure paths on real servers: injected transfer failures under load, a decode server
killed mid-request, a partner that never comes. Every request must end, no server may hang,
and the pools must be intact afterwards (the servers run with --enable-integrity-check, which
crashes a scheduler on a leak, so a healthy idle server with no used tokens is the check)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import sys
import time

import httpx
import pytest

from servers import Server, all_ready, assert_idle_and_intact, free_port, free_port_block

pytestmark = pytest.mark.timeout(900)

ARGS = ["--max-total-tokens", "8192", "--chunked-prefill-size", "64", "--torch-threads", "1",
        "--enable-integrity-check", "--disaggregation-transfer-backend", "tcp"]
FAST_TIMEOUTS = {"TIDAL_DISAGG_BOOTSTRAP_TIMEOUT": "5", "TIDAL_DISAGG_WAITING_TIMEOUT": "5"}


@pytest.mark.slow  # a soak; tests/test_transfer.py injects failures into single transfers (suite time)
def test_injected_failures_under_load_every_request_ends():
    port, base, bport = free_port(), free_port_block(4), free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1", "--port", str(port),
           "--base-port", str(base), "--bootstrap-base-port", str(bport), "--policy", "round_robin",
           "--disaggregation-transfer-backend", "tcp", "--torch-threads", "1",
           "--server-args", " ".join(a for a in ARGS if a not in ("--disaggregation-transfer-backend", "tcp"))]
    router = Server(cmd=cmd, port=port, env={"TIDAL_DISAGG_TEST_FAILURE_PROB": "0.05", **FAST_TIMEOUTS})
    try:
        rng = random.Random(0)

        def one(i: int) -> int:
            body = {"text": f"Request {i}: " + " ".join(rng.choice(["sea", "sky", "tree", "rock"]) for _ in range(8)),
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
            r = httpx.post(router.url + "/generate", json=body, timeout=120)
            if r.status_code != 200:
                assert r.json()["error"]["message"], r.text  # a clear error, never an empty one
            return r.status_code

        with cf.ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(one, range(240)))
        assert len(codes) == 240
        assert codes.count(200) >= 200  # the router retries failed pairs with a new room
        for url in (f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"):
            assert_idle_and_intact(url)
        failed = httpx.get(f"http://127.0.0.1:{base + 1}/metrics", timeout=10).text
        assert "tidal:kv_failed" in failed
    finally:
        router.stop()


def test_killed_decode_lets_prefill_free_the_request():
    bport = free_port()
    prefill, decode = all_ready(
        Server(*ARGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport),
               env=FAST_TIMEOUTS, wait=False),
        Server(*ARGS, "--disaggregation-mode", "decode", env=FAST_TIMEOUTS, wait=False))
    try:
        prompt = " ".join(["word"] * 1500)
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": 42,
                  "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}, "text": prompt}
        with cf.ThreadPoolExecutor(2) as pool:
            fp = pool.submit(httpx.post, prefill.url + "/generate", json=fields, timeout=120)
            pool.submit(httpx.post, decode.url + "/generate", json=fields, timeout=120)
            time.sleep(1.0)
            os.killpg(decode.proc.pid, signal.SIGKILL)
            t0 = time.time()
            r = fp.result()
        assert time.time() - t0 < 60
        assert r.status_code in (200, 500), r.text
        if r.status_code != 200:
            assert "transfer" in r.json()["error"]["message"].lower()
        assert_idle_and_intact(prefill.url)
    finally:
        decode.stop()
        prefill.stop()


def test_prefill_without_partner_times_out():
    bport = free_port()
    prefill = Server(*ARGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport),
                     env=FAST_TIMEOUTS)
    try:
        body = {"text": "nobody decodes this", "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
                "bootstrap_room": 99}
        r = httpx.post(prefill.url + "/generate", json=body, timeout=60)
        assert r.status_code == 500 and "bootstrap" in r.json()["error"]["message"].lower()
        assert_idle_and_intact(prefill.url)
    finally:
        prefill.stop()
