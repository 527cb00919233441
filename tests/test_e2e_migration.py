"""Drain by migration on the real model: a switch that cannot drain in time moves its running requests,
KV and all, to a decode server, where they go on with the tokens an unmigrated run gives (streamed and
not, with logprobs); a target that cannot take them leaves them here, finished as before, the switch
rolled back; bad bodies are 400s; pools intact on both servers."""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import threading
import time

import httpx
import pytest

from servers import Server, all_ready, assert_idle_and_intact, free_port

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["The capital of France is", "Write a short story about a robot who learns to paint."]
N = 72


@pytest.fixture(scope="module")
def servers():
    """A switchable null server (the one that migrates) and a decode server (where requests go)."""
    common = ("--torch-threads", "1", "--enable-dynamic-disaggregation", "--disaggregation-transfer-backend", "tcp",
              "--enable-integrity-check")
    source, target = all_ready(Server(*common, "--disaggregation-bootstrap-port", str(free_port()), wait=False),
                               Server(*common, "--disaggregation-mode", "decode", wait=False))
    yield source, target
    for s in (target, source):
        s.stop()


def body(text: str, n: int = N, **fields) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}, **fields}


@pytest.fixture(scope="module")
def reference(servers):
    source, _ = servers
    out = {}
    for p in PROMPTS:
        r = httpx.post(source.url + "/generate", json=body(p, return_logprob=True), timeout=300)
        assert r.status_code == 200, r.text
        out[p] = r.json()
    return out


def stream(url: str, payload: dict, started: threading.Event) -> dict:
    """The last event of a streamed /generate; `started` set at its first token."""
    last = None
    with httpx.stream("POST", url + "/generate", json={**payload, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            last = json.loads(line[5:])
            assert "error" not in last, last
            if last.get("output_ids"):
                started.set()
    return last


def switch(url: str, mode: str, **fields) -> httpx.Response:
    return httpx.post(url + "/admin/switch_disaggregation_mode", json={"mode": mode, **fields}, timeout=300)


def wait_started(events: list[threading.Event], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for e in events:
        assert e.wait(max(deadline - time.monotonic(), 0.1)), "a request produced no token"


def run_during_switch(source: Server, payloads: list[dict], **switch_fields) -> tuple[httpx.Response, list[dict]]:
    """Start the requests on `source`, switch it to prefill once each produced a token; (switch answer, outputs)."""
    started = [threading.Event() for _ in payloads]
    with cf.ThreadPoolExecutor(len(payloads)) as pool:
        futs = []
        for p, ev in zip(payloads, started):
            if p.get("stream"):
                futs.append(pool.submit(stream, source.url, p, ev))
            else:
                ev.set()
                futs.append(pool.submit(lambda p=p: httpx.post(source.url + "/generate", json=p, timeout=300)))
        wait_started(started)
        time.sleep(0.3)  # the non-streamed one is past its prefill too
        answer = switch(source.url, "prefill", **switch_fields)
        outs = []
        for f in futs:
            res = f.result()
            if isinstance(res, httpx.Response):
                assert res.status_code == 200, res.text
                res = res.json()
            outs.append(res)
    return answer, outs


def test_a_switch_migrates_its_running_requests_and_their_tokens_are_unchanged(servers, reference):
    source, target = servers
    payloads = [{**body(PROMPTS[0]), "stream": True}, body(PROMPTS[1], return_logprob=True)]
    answer, outs = run_during_switch(source, payloads, drain_policy="migrate", timeout_s=0.2,
                                     migrate_to=[target.url], migrate_timeout_s=60)
    try:
        assert answer.status_code == 200, answer.text
        said = answer.json()
        assert said["current_mode"] == "prefill" and said["migrated"] == 2, said
        assert "migrate" in said["timings_ms"], said
        for p, out in zip(PROMPTS, outs):
            ref = reference[p]
            assert out["output_ids"] == ref["output_ids"], p
            assert out["text"] == ref["text"]
            assert out["meta_info"]["completion_tokens"] == N
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        lp, ref_lp = outs[1]["meta_info"]["output_token_logprobs"], reference[PROMPTS[1]]["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lp] == [t for _, t, _ in ref_lp]
        assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(lp, ref_lp))
        stats = httpx.get(target.url + "/get_load", timeout=30).json()
        assert stats, stats
    finally:
        assert switch(source.url, "null").status_code == 200
    assert_idle_and_intact(source.url)
    assert_idle_and_intact(target.url)


def test_a_target_that_cannot_take_them_leaves_them_here_and_the_switch_rolls_back(servers, reference):
    source, _ = servers
    nowhere = f"http://127.0.0.1:{free_port()}"
    payloads = [{**body(PROMPTS[0]), "stream": True}, body(PROMPTS[1], return_logprob=True)]
    answer, outs = run_during_switch(source, payloads, drain_policy="migrate", timeout_s=0.2, migrate_to=[nowhere],
                                     migrate_timeout_s=0.5)
    assert answer.status_code == 504, answer.text  # they go on here for seconds: past the migration's time
    said = answer.json()
    assert said["current_mode"] == "null" and "rolled back" in said["message"], said
    assert "stayed" in said["message"], said
    assert said["migrated"] == 0, said
    for p, out in zip(PROMPTS, outs):
        assert out["output_ids"] == reference[p]["output_ids"], p
    assert_idle_and_intact(source.url)


def test_the_router_moves_a_worker_by_migrating_what_it_runs(servers, reference):
    """`--planner-decode-move migrate`: a hand move of the null worker to prefill drains it briefly, then its
    running requests continue on the decode worker; the router learns the new mode."""
    source, target = servers
    rport = free_port()
    router = Server(cmd=[sys.executable, "-m", "tidal.router", "--port", str(rport), "--worker", source.url,
                         target.url, "--planner-decode-move", "migrate", "--planner-migrate-after-s", "0.2",
                         "--health-check-interval-secs", "1"], port=rport)
    try:
        payloads = [{**body(p), "stream": True} for p in PROMPTS]
        started = [threading.Event() for _ in payloads]
        with cf.ThreadPoolExecutor(len(payloads)) as pool:
            futs = [pool.submit(stream, source.url, p, ev) for p, ev in zip(payloads, started)]
            wait_started(started)
            r = httpx.post(router.url + "/admin/set_worker_role", json={"url": source.url, "mode": "prefill"},
                           timeout=180)
            outs = [f.result() for f in futs]
        assert r.status_code == 200, r.text
        assert r.json()["mode"] == "prefill" and "2 requests migrated" in r.json()["message"], r.json()
        for p, out in zip(PROMPTS, outs):
            assert out["output_ids"] == reference[p]["output_ids"], p
        r = httpx.post(router.url + "/admin/set_worker_role", json={"url": source.url, "mode": "null"}, timeout=180)
        assert r.status_code == 200, r.text
    finally:
        router.stop()
    assert_idle_and_intact(source.url)
    assert_idle_and_intact(target.url)


@pytest.mark.slow  # tests/test_migration.py covers retraction by migration on the fake model (suite time)
def test_a_server_short_of_kv_moves_what_it_retracts(servers):
    """--retraction-migrate-to: a server whose KV runs out moves its retraction victims to the decode server;
    every answer equals the one a roomy server gives."""
    source, target = servers
    small = Server("--torch-threads", "1", "--max-total-tokens", "256", "--max-running-requests", "4", "--schedule-conservativeness", "0.05",
                   "--disaggregation-transfer-backend", "tcp", "--enable-integrity-check",
                   "--retraction-migrate-to", target.url)
    try:
        texts = [f"Count from {k} to {k + 40}:" for k in range(4)]

        def run(url: str) -> list[httpx.Response]:
            with cf.ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda t: httpx.post(url + "/generate", json=body(t, 90), timeout=300), texts))

        want = [r.json()["output_ids"] for r in run(source.url)]
        got = run(small.url)
        assert [g.status_code for g in got] == [200] * 4, [g.text for g in got]
        assert [g.json()["output_ids"] for g in got] == want
        state = httpx.get(small.url + "/server_info", timeout=30).json()["internal_states"][0]
        assert state["num_migrated_total"] > 0, {k: v for k, v in state.items() if "retract" in k or "migrat" in k}
        assert_idle_and_intact(small.url)
    finally:
        small.stop()
    assert_idle_and_intact(target.url)


@pytest.mark.parametrize("fields, why", [
    ({"drain_policy": "migrate"}, "needs migrate_to"),
    ({"drain_policy": "later"}, "invalid drain_policy"),
    ({"drain_policy": "wait", "migrate_to": ["http://127.0.0.1:1"]}, "applies to drain_policy migrate"),
    ({"migrate_to": ["http://127.0.0.1:1"]}, "needs \"drain_policy\""),
    ({"drain_policy": "migrate", "migrate_to": ["127.0.0.1:1"]}, "http(s) URLs"),
])
def test_bad_migration_fields_are_400s(servers, fields, why):
    source, _ = servers
    r = switch(source.url, "prefill", **fields)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert httpx.get(source.url + "/admin/disaggregation_status", timeout=30).json()["current_mode"] == "null"
