"""Priority scheduling on real servers (default model): a high-priority request overtakes queued
and running low-priority ones, the queue limit's 503s, a 1P1D cluster behind the router, and a
role switch with priority requests queued."""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest

from servers import Server, free_port, free_port_block

pytestmark = pytest.mark.timeout(900)

FLAGS = ("--enable-priority-scheduling", "--torch-threads", "1", "--chunked-prefill-size", "32")
BLOCKER = "Write a long story about a dragon who"
LONG = 64  # tokens of the request that holds the only running slot


@pytest.fixture(scope="module")
def server():
    s = Server(*FLAGS, "--max-running-requests", "1", "--max-queued-requests", "3", "--enable-integrity-check",
               "--enable-dynamic-disaggregation", "--disaggregation-transfer-backend", "tcp",
               "--disaggregation-bootstrap-port", str(free_port()))
    yield s
    s.stop()


def body(text: str, n: int, priority=None) -> dict:
    b = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    if priority is not None:
        b["priority"] = priority
    return b


class Clients:
    """Requests sent from threads; records each response and the order they finished in."""

    def __init__(self, url: str):
        self.url, self.results, self.order = url, {}, []
        self.lock, self.threads = threading.Lock(), []

    def send(self, name: str, text: str, n: int, priority=None, path: str = "/generate") -> None:
        def run():
            r = httpx.post(self.url + path, json=body(text, n, priority), timeout=300)
            with self.lock:
                self.results[name] = r
                self.order.append(name)

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(300)


def load(url: str) -> dict:
    return httpx.get(url + "/get_load", timeout=10).json()[0]


def wait_load(url: str, key: str, value: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if load(url)[key] == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{key} never reached {value}: {load(url)}")


def retracted(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["num_retracted_total"]


def output_alone(url: str, text: str, n: int) -> list[int]:
    r = httpx.post(url + "/generate", json=body(text, n), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_high_priority_overtakes_queued_and_running_requests(server):
    url = server.url
    ref_blocker = output_alone(url, BLOCKER, LONG)
    ref_high = output_alone(url, "The capital of France is", 4)
    before = retracted(url)
    c = Clients(url)
    c.send("blocker", BLOCKER, LONG, priority=0)
    wait_load(url, "num_decoding_reqs", 1)
    for name in ("low1", "low2"):
        c.send(name, f"Count to three, {name}:", 4, priority=0)
    wait_load(url, "num_waiting_reqs", 2)
    c.send("high", "The capital of France is", 4, priority=10)
    c.join()
    assert {k: r.status_code for k, r in c.results.items()} == dict.fromkeys(["blocker", "low1", "low2", "high"], 200)
    assert c.order[0] == "high", c.order  # ahead of the queued ones and of the running one it preempted
    assert retracted(url) > before
    # the preempted request resumed where it stopped: the same greedy tokens as alone
    assert c.results["blocker"].json()["output_ids"] == ref_blocker
    assert c.results["high"].json()["output_ids"] == ref_high


def test_full_queue_is_503_and_a_higher_priority_request_displaces_the_lowest(server):
    url = server.url
    c = Clients(url)
    c.send("blocker", BLOCKER, LONG, priority=100)  # outranks everything: never preempted
    wait_load(url, "num_decoding_reqs", 1)
    for i in range(3):
        c.send(f"q{i}", f"Name a fruit number {i}:", 2, priority=0)
        wait_load(url, "num_waiting_reqs", i + 1)
    full = httpx.post(url + "/generate", json=body("one more", 2, priority=0), timeout=60)
    assert full.status_code == 503, full.text
    assert "queue is full" in full.json()["error"]["message"]
    assert full.headers.get("retry-after")
    c.send("vip", "Name a vegetable:", 2, priority=5)
    c.join()
    codes = {k: r.status_code for k, r in c.results.items()}
    assert codes == {"blocker": 200, "q0": 200, "q1": 200, "q2": 503, "vip": 200}, codes
    assert "higher priority" in c.results["q2"].json()["error"]["message"]
    assert c.order.index("vip") < c.order.index("q0")
    wait_load(url, "num_reqs", 0)


def test_role_switch_drains_queued_priority_requests_in_order(server):
    url = server.url
    texts = {p: f"Say the number {p}:" for p in (0, 1, 2)}
    refs = {p: output_alone(url, t, 3) for p, t in texts.items()}
    c = Clients(url)
    c.send("blocker", BLOCKER, LONG // 2, priority=100)
    wait_load(url, "num_decoding_reqs", 1)
    for p in (0, 1, 2):
        c.send(f"p{p}", texts[p], 3, priority=p)
        wait_load(url, "num_waiting_reqs", p + 1)
    r = httpx.post(url + "/admin/switch_disaggregation_mode", json={"mode": "prefill", "drain": True, "timeout_s": 120},
                   timeout=180)
    c.join()
    assert r.status_code == 200 and r.json()["current_mode"] == "prefill", r.text
    assert all(res.status_code == 200 for res in c.results.values()), {k: v.text for k, v in c.results.items()}
    assert c.order == ["blocker", "p2", "p1", "p0"]  # none lost, served by priority before the switch
    for p in (0, 1, 2):
        assert c.results[f"p{p}"].json()["output_ids"] == refs[p]
    back = httpx.post(url + "/admin/switch_disaggregation_mode", json={"mode": "null"}, timeout=180)
    assert back.status_code == 200, back.text
    again = httpx.post(url + "/generate", json=body(texts[2], 3, priority=7), timeout=60)
    assert again.status_code == 200 and again.json()["output_ids"] == refs[2]


def test_batch_generate_takes_a_priority_per_prompt(server):
    b = {"text": ["Hello", "The sky is"], "priority": [1, 2],
         "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(server.url + "/generate", json=b, timeout=60)
    assert r.status_code == 200 and [len(o["output_ids"]) for o in r.json()] == [2, 2], r.text
    r = httpx.post(server.url + "/generate", json={**b, "priority": [1]}, timeout=60)
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


# ---------------------------------------------------------------- 1P1D behind the router


@pytest.fixture(scope="module")
def cluster():
    port, base, bport = free_port(), free_port_block(4), free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", "tcp", "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(bport), "--policy", "round_robin", "--torch-threads", "1",
           "--server-args", "--max-total-tokens 8192 --dtype float32 " + " ".join(FLAGS)]
    router = Server(cmd=cmd, port=port)
    yield router
    router.stop()


def test_priority_through_the_router_to_a_1p1d_cluster(cluster, server):
    prompts = ["The capital of France is", "def add(a, b):", "List three colors:"]
    refs = [output_alone(server.url, p, 6) for p in prompts]
    c = Clients(cluster.url)
    for i, p in enumerate(prompts):
        c.send(str(i), p, 6, priority=i * 3 - 2)
    c.join()
    assert [c.results[str(i)].json()["output_ids"] for i in range(len(prompts))] == refs
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "priority": 4}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    comp = {"model": "default", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "priority": -1}
    assert httpx.post(cluster.url + "/v1/completions", json=comp, timeout=120).status_code == 200
    # the workers see the field the router forwards: one they refuse comes back as their 400
    bad = httpx.post(cluster.url + "/generate", json=body("hi", 2, priority=2**63), timeout=60)
    assert bad.status_code == 400 and "64-bit" in bad.text, bad.text
