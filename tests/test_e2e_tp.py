"""Tensor-parallel servers (`--tp 3`: one scheduler process per rank) on the real model:
outputs equal a single-rank server's, two TP servers switch roles and pair rank to rank
with outputs equal to null mode (shm backend: every rank's pool in shared memory), a
switch failing on one rank rolls all ranks back, a TP-3 server pairs with a single-rank
one both ways (M:N, KV heads gathered or sliced) with outputs equal to null mode,
the router moves TP workers between pools under traffic with no failed request, and a
dead rank takes the server down cleanly."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import sys
import time

import httpx
import psutil
import pytest

from servers import Server, Traffic, free_port
from tidal.leftovers import segment_owner

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at"]
N = 10


def tp_server(*extra: str, env: dict | None = None, bport: int | None = None) -> Server:
    return Server("--tp", "3", "--torch-threads", "1", "--enable-dynamic-disaggregation",
                  "--disaggregation-transfer-backend", "shm", "--disaggregation-bootstrap-port",
                  str(bport or free_port()), "--chunked-prefill-size", "32", "--enable-integrity-check", *extra,
                  env=env)


def gen(url: str, text: str, n: int = N, **fields) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}, **fields}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def switch(url: str, mode: str) -> httpx.Response:
    return httpx.post(url + "/admin/switch_disaggregation_mode", json={"mode": mode}, timeout=120)



def pd_gen(prefill: Server, decode: Server, text: str) -> list[int]:
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bport, "bootstrap_room": random.randrange(2**63)}
    with cf.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(gen, prefill.url, text, N, **fields)
        fd = pool.submit(gen, decode.url, text, N, **fields)
        assert fp.result()["meta_info"]["completion_tokens"] == 1
        return fd.result()["output_ids"]


@pytest.fixture(scope="module")
def single_rank():
    s = Server("--torch-threads", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(single_rank):
    """Greedy tokens of a single-rank null server."""
    return {p: gen(single_rank.url, p)["output_ids"] for p in PROMPTS}


@pytest.fixture(scope="module")
def tp_pair():
    a_port, b_port = free_port(), free_port()
    a = tp_server(bport=a_port)
    b = tp_server(bport=b_port, env={"TIDAL_SWITCH_FAULT": "init@1>null"})  # b cannot return to null
    a.bport, b.bport = a_port, b_port
    yield a, b
    for s in (a, b):
        assert s.stop() == 0


def status(s: Server) -> dict:
    return httpx.get(s.url + "/admin/disaggregation_status", timeout=30).json()


def test_tp3_null_outputs_equal_single_rank(tp_pair, reference):
    a, _ = tp_pair
    for p in PROMPTS:
        assert gen(a.url, p)["output_ids"] == reference[p]
    body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "stream": True}
    with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=300) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= N
    info = httpx.get(a.url + "/server_info", timeout=30).json()
    assert info["tp_size"] == 3


def test_tp_servers_switch_pair_rank_to_rank_and_roll_back_on_one_rank(tp_pair, reference):
    a, b = tp_pair
    assert switch(a.url, "prefill").status_code == 200                   # null -> prefill
    assert switch(b.url, "decode").status_code == 200                    # null -> decode
    for p in PROMPTS:
        assert pd_gen(a, b, p) == reference[p]
    r = switch(b.url, "null")                                            # fails on TP rank 1 only
    assert r.status_code == 500 and "TP rank 1" in r.json()["message"] and "rolled back" in r.json()["message"]
    st = status(b)
    assert (st["current_mode"], st["epoch"], st["transition_state"]) == ("decode", 1, "IDLE")
    assert pd_gen(a, b, PROMPTS[1]) == reference[PROMPTS[1]]             # every rank still decodes
    assert switch(a.url, "decode").status_code == 200                    # prefill -> decode
    assert switch(b.url, "prefill").status_code == 200                   # decode -> prefill
    for p in PROMPTS:
        assert pd_gen(b, a, p) == reference[p]
    assert switch(a.url, "null").status_code == 200                      # decode -> null
    assert [gen(a.url, p)["output_ids"] for p in PROMPTS] == [reference[p] for p in PROMPTS]
    assert status(a)["epoch"] == 3 and status(b)["epoch"] == 2


def test_m_to_n_tp_pd_equals_null_both_ways(tp_pair, reference):
    """A TP-3 prefill with a single-rank decode (3 -> 1: the decode rank gathers a KV head from each
    prefill rank), then the roles swapped (1 -> 3: each decode rank reads its head of the single
    prefill rank's pages): tokens equal a null server's."""
    _, b = tp_pair
    if status(b)["current_mode"] != "prefill":  # it is when the test above ran
        assert switch(b.url, "prefill").status_code == 200
    single_port = free_port()
    single = Server("--torch-threads", "1", "--enable-dynamic-disaggregation", "--disaggregation-mode", "decode",
                    "--disaggregation-transfer-backend", "shm", "--disaggregation-bootstrap-port", str(single_port),
                    "--enable-integrity-check")
    single.bport = single_port
    try:
        for p in PROMPTS:
            assert pd_gen(b, single, p) == reference[p]                   # 3 -> 1
        assert switch(single.url, "prefill").status_code == 200
        assert switch(b.url, "decode").status_code == 200
        for p in PROMPTS:
            assert pd_gen(single, b, p) == reference[p]                   # 1 -> 3
        assert switch(b.url, "prefill").status_code == 200
    finally:
        single.stop()


def test_router_moves_tp_workers_under_traffic(tp_pair, single_rank, reference):
    """Two TP-3 workers and a single-rank null worker behind the router: TP workers are moved
    between pools under traffic (a move that fails on one rank leaves the worker where it
    was), and no client request fails or differs from the reference."""
    a, b = tp_pair
    if status(a)["current_mode"] != "null":
        assert switch(a.url, "null").status_code == 200
    if status(b)["current_mode"] != "prefill":
        assert switch(b.url, "prefill").status_code == 200
    rport = free_port()
    cmd = [sys.executable, "-m", "tidal.router", "--port", str(rport), "--worker", a.url, b.url, single_rank.url,
           "--policy", "round_robin", "--health-check-interval-secs", "1", "--max-retries", "5"]
    router = Server(cmd=cmd, port=rport)
    moves = [(a, "decode", 200), (b, "null", 500), (a, "prefill", 200), (b, "decode", 200), (a, "null", 200)]
    try:
        time.sleep(2)  # the router learns modes and TP sizes
        with Traffic(router.url, reference, N, threads=2) as traffic:
            time.sleep(2)
            for worker, mode, code in moves:
                r = httpx.post(router.url + "/admin/set_worker_role", json={"url": worker.url, "mode": mode},
                               timeout=300)
                assert r.status_code == code, r.text
                time.sleep(2)
        workers = {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=30).json()["workers"]}
        assert workers[b.url]["mode"] == "decode" and workers[a.url]["mode"] == "null"
        assert workers[a.url]["tp_size"] == 3 and workers[single_rank.url]["tp_size"] == 1
        assert traffic.failures == [] and traffic.mismatches == []
        assert traffic.ok >= 10
    finally:
        router.stop()


def rank_pools(ranks: list) -> list[str]:
    """The /dev/shm KV pools the ranks own (their names carry the owner, see tidal.leftovers)."""
    pids = {r.pid for r in ranks}
    return [n for n in os.listdir("/dev/shm") if n.startswith("tidal-kv-") and (segment_owner(n) or (0,))[0] in pids]


def test_a_dead_rank_stops_the_server_with_an_error():
    s = tp_server()
    try:
        ranks = [c for c in psutil.Process(s.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 3
        assert len(rank_pools(ranks)) == 3  # the shm backend: each rank's KV pool in shared memory
        os.kill(ranks[2].pid, signal.SIGKILL)
        deadline = time.time() + 60
        while s.proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert s.proc.returncode not in (None, 0)
        assert all(not r.is_running() or r.status() == psutil.STATUS_ZOMBIE for r in ranks)
        assert rank_pools(ranks) == []
    finally:
        s.stop()
