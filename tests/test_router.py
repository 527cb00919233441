"""The PD router against mock workers (tests/mock_worker.py), all real uvicorn servers on
127.0.0.1 in background threads; plus unit tests of the policies and the registry."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from mock_worker import MockWorker, free_port
from router_server import RouterServer, wait_for
from tidal.planner.schema import PlannerConfig
from tidal.router.config import RouterConfig
from tidal.router.dispatch import Dispatcher, merge_logprobs, request_text
from tidal.router.metrics import RouterMetrics
from tidal.router.policies import (
    CacheAwarePolicy, PowerOfTwoPolicy, PrefixIndex, RandomPolicy, RoundRobinPolicy, make_policy,
)
from tidal.router.workers import DECODE, NULL, PREFILL, Worker, WorkerRegistry

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@pytest.fixture(scope="module")
def mocks():
    ws = {"p1": MockWorker("prefill", "p1"), "p2": MockWorker("prefill", "p2"),
          "d1": MockWorker("decode", "d1"), "d2": MockWorker("decode", "d2"), "n1": MockWorker("null", "n1")}
    try:
        yield {name: w.start() for name, w in ws.items()}
    finally:
        for w in ws.values():
            w.stop()


@pytest.fixture
def m(mocks):
    for w in mocks.values():
        w.reset()
    return mocks


def pd(m: dict, prefill=("p1",), decode=("d1",), **kw: Any) -> RouterServer:
    return RouterServer(prefill=[(m[p].url, 8998) for p in prefill], decode=[m[d].url for d in decode], **kw)


# ---------------------------------------------------------------- PD dual dispatch


def test_dual_dispatch_injects_same_room(m):
    with pd(m, prefill_policy="random", decode_policy="random") as r:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "custom": 1}
        resp = r.post("/generate", body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["text"] == "d1 says hi"
        (pp, pb), = m["p1"].requests
        (dp, db), = m["d1"].requests
        assert pp == dp == "/generate" and pb == db
        assert pb["bootstrap_host"] == "127.0.0.1" and pb["bootstrap_port"] == 8998
        assert isinstance(pb["bootstrap_room"], int) and 0 <= pb["bootstrap_room"] <= 2**63 - 1
        assert {k: pb[k] for k in body} == body  # everything else untouched
        resp2 = r.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert resp2.status_code == 200
        assert m["p1"].requests[1][1]["bootstrap_room"] == m["d1"].requests[1][1]["bootstrap_room"]
        assert m["p1"].requests[1][1]["bootstrap_room"] != pb["bootstrap_room"]


def test_batch_gets_one_room_per_item(m):
    with pd(m) as r:
        for body in ({"text": ["a", "b", "c"]}, {"input_ids": [[1, 2], [3], [4, 5]]}):
            resp = r.post("/generate", body)
            assert resp.status_code == 200 and len(resp.json()) == 3
            pb, db = m["p1"].generate_requests()[-1], m["d1"].generate_requests()[-1]
            assert pb["bootstrap_room"] == db["bootstrap_room"]
            assert len(set(pb["bootstrap_room"])) == 3
            assert pb["bootstrap_host"] == ["127.0.0.1"] * 3 and pb["bootstrap_port"] == [8998] * 3
            assert [x["meta_info"]["room"] for x in resp.json()] == db["bootstrap_room"]


def test_streaming_is_relayed_byte_for_byte(m):
    m["d1"].chunk_delay_s = 0.01
    with pd(m) as r:
        for path, body in (("/generate", {"text": "hi", "stream": True}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})):
            with httpx.stream("POST", r.url + path, json=body, timeout=10) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                got = b"".join(resp.iter_raw())
            sent = m["d1"].requests[-1][1]
            assert got == b"".join(m["d1"].stream_bytes(path, sent))
            assert m["p1"].requests[-1][1]["bootstrap_room"] == sent["bootstrap_room"]


def test_logprobs_merged_from_prefill(m):
    with pd(m) as r:
        out = r.post("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 0}).json()
        meta = out["meta_info"]
        assert meta["input_token_logprobs"] == [[None, 11, None], [-0.5, 12, None], [-0.25, 13, None]]
        assert meta["input_top_logprobs"][1] == [[-0.5, 12, None]]
        assert meta["worker"] == "d1" and meta["output_token_logprobs"] == [[-0.1, 7, None]]
        outs = r.post("/generate", {"text": ["a", "b"], "return_logprob": [True, False]}).json()
        assert len(outs[0]["meta_info"]["input_token_logprobs"]) == 3
        assert "input_token_logprobs" not in outs[1]["meta_info"]
        plain = r.post("/generate", {"text": "hi"}).json()
        assert "input_token_logprobs" not in plain["meta_info"]
    d = {"meta_info": {"input_token_logprobs": [[-1.0, 5, None]]}}  # decode's own ones follow prefill's
    assert merge_logprobs(d, {"meta_info": {"input_token_logprobs": [[None, 4, None]]}})
    assert d["meta_info"]["input_token_logprobs"] == [[None, 4, None], [-1.0, 5, None]]


# ---------------------------------------------------------------- retries and errors


def test_retry_with_new_pair_after_503(m):
    m["p1"].fail_next = m["p2"].fail_next = 1
    with pd(m, prefill=("p1", "p2"), decode=("d1", "d2"), policy="random") as r:
        resp = r.post("/generate", {"text": "retry me"})
        assert resp.status_code == 200, resp.text
        prefill_reqs = m["p1"].requests + m["p2"].requests
        assert len(prefill_reqs) == 3  # both failed once (a new prefill was preferred), then success
        rooms = [b["bootstrap_room"] for _, b in prefill_reqs]
        assert m["p1"].requests and m["p2"].requests and len(set(rooms)) == 3
        assert resp.json()["meta_info"]["room"] in rooms
        metrics = httpx.get(r.url + "/metrics").text
        assert 'tidal_router:retries_total{role="prefill"' in metrics
    for w in m.values():
        w.reset()
    m["d1"].fail_next = 1
    with pd(m) as r:
        resp = r.post("/generate", {"text": "decode fails once"})
        assert resp.status_code == 200
        assert len(m["d1"].requests) == 2 and len(m["p1"].requests) == 2
        assert m["d1"].requests[0][1]["bootstrap_room"] != m["d1"].requests[1][1]["bootstrap_room"]


def test_a_stream_refused_in_its_first_event_is_retried(m):
    """A tidal server answers a stream 200 at once; a refusal its scheduler decides (the worker changed role since the
    router picked it: a decode worker that just handed over to prefill) is the stream's only event, a 409. Nothing
    was generated: the router retries on a new pair, as for a 409 status, and the client gets a whole stream (live
    run 41 lost a request this way). An error event with a status that is not retried is relayed as before."""
    from tidal.router.legs import stream_refusal

    m["d1"].stream_refusals = 1
    with pd(m) as r:
        with httpx.stream("POST", r.url + "/generate", json={"text": "x", "stream": True}, timeout=30) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events
        assert len(m["p1"].requests) == 2 and m["d1"].stream_refusals == 0
    ok = b'data: {"text": "hi"}\n\n'
    assert stream_refusal(ok) is None
    assert stream_refusal(b'data: {"error": {"message": "bad", "code": 400}}\n\n') is None
    assert stream_refusal(b'data: {"error": {"message": "draining", "code": 503}}\n\ndata: [DONE]\n\n') == \
        (503, b'{"error": {"message": "draining", "code": 503}}')


def test_retries_exhausted_passes_last_error(m):
    m["d1"].fail_next = 10
    with pd(m, max_retries=2) as r:
        resp = r.post("/generate", {"text": "x"})
        assert resp.status_code == 503
        assert "d1 overloaded" in resp.json()["error"]["message"]
        assert len(m["d1"].requests) == 3


def test_400_is_not_retried(m):
    m["d1"].reject = True
    with pd(m) as r:
        resp = r.post("/generate", {"text": "x"})
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == "bad request from mock"
        assert len(m["d1"].requests) == 1
    m["d1"].reject, m["p1"].reject = False, True
    with pd(m) as r:
        resp = r.post("/v1/completions", {"prompt": "x"})
        assert resp.status_code == 400
        assert [path for path, _ in m["p1"].requests].count("/v1/completions") == 1


def test_a_prefill_400_answered_after_the_decode_failed_is_not_retried(m):
    """The decode leg fails first (its own 503, or in a loaded host its KV wait ending before the prefill's
    400 reaches the router); the prefill's 400 answered 0.3 s later is the cause, and a bad request is not
    retried on a new pair."""
    m["p1"].hang_s, m["p1"].reject = 0.3, True
    m["d1"].fail_next = 1
    with pd(m) as r:
        resp = r.post("/v1/completions", {"prompt": "x"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"] == "bad request from mock"
        assert [path for path, _ in m["p1"].requests].count("/v1/completions") == 1
        assert len(m["d1"].requests) == 1


def test_timeout_gives_504(m):
    m["d1"].hang_s = 5
    with pd(m, request_timeout_s=0.5) as r:
        t0 = time.time()
        resp = r.post("/generate", {"text": "x"})
        assert resp.status_code == 504 and time.time() - t0 < 3
        assert len(m["d1"].requests) == 1  # timeouts are not retried


def test_client_disconnect_cancels_non_streaming(m):
    m["d1"].hang_s = 5
    with pd(m) as r:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/generate", json={"text": "x"}, timeout=0.3)
        d1 = r.worker(m["d1"].url)
        wait_for(lambda: d1.in_flight == 0, 2, "upstream calls cancelled")
        metrics = httpx.get(r.url + "/metrics").text
        assert 'tidal_router:requests_total{route="/generate",status="499"} 1.0' in metrics


def test_malformed_json_is_400(m):
    with pd(m) as r:
        for raw in (b"{not json", b"[1, 2]", b""):
            resp = httpx.post(r.url + "/generate", content=raw, timeout=5)
            assert resp.status_code == 400
            assert resp.json()["error"]["message"]
        assert not m["d1"].requests


def test_connection_errors_retry_and_mark_unhealthy(m):
    dead = MockWorker("decode", "dead").start()
    with RouterServer(prefill=[(m["p1"].url, 8998)], decode=[dead.url, m["d1"].url], decode_policy="round_robin",
                      health_failure_threshold=2) as r:
        dead.stop()  # healthy at the router's start, gone now
        assert r.worker(dead.url).healthy
        for _ in range(4):
            assert r.post("/generate", {"text": "x"}).status_code == 200
        w = r.worker(dead.url)
        assert not w.healthy and w.in_flight == 0
        workers = httpx.get(r.url + "/workers").json()["workers"]
        assert {x["url"]: x["healthy"] for x in workers}[dead.url] is False


def test_client_disconnect_cancels_upstream(m):
    m["d1"].num_chunks, m["d1"].chunk_delay_s = 200, 0.02
    with pd(m) as r:
        with httpx.stream("POST", r.url + "/generate", json={"text": "x", "stream": True}, timeout=10) as resp:
            next(resp.iter_raw())
        wait_for(lambda: m["d1"].cancelled >= 1, 5, "decode stream cancelled")
        wait_for(lambda: r.worker(m["d1"].url).in_flight == 0 and r.worker(m["p1"].url).in_flight == 0)


# ---------------------------------------------------------------- health, fallback, admin


def test_unhealthy_worker_skipped_then_recovers(m):
    with pd(m, decode=("d1", "d2"), policy="round_robin", health_check_interval_s=0.1,
            health_failure_threshold=1) as r:
        m["d2"].healthy = False
        wait_for(lambda: not r.worker(m["d2"].url).healthy, 5, "d2 unhealthy")
        for _ in range(4):
            assert r.post("/generate", {"text": "x"}).status_code == 200
        assert len(m["d1"].requests) == 4 and not m["d2"].requests
        m["d2"].healthy = True
        wait_for(lambda: r.worker(m["d2"].url).healthy, 5, "d2 healthy again")
        for _ in range(4):
            r.post("/generate", {"text": "x"})
        assert m["d2"].requests


def test_a_worker_restarted_at_its_url_is_learned_in_the_mode_it_says(m):
    """A tidal server counts its epochs from 0 at each start. An older epoch from the same process is a stale answer
    (ignored); from a new process (its /server_info's boot_id changed) it is the truth: a worker restarted in another
    mode joins that pool at the next health check instead of being held in its old one for good."""
    m["d1"].epoch, m["d1"].boot_id = 3, "first"
    try:
        with pd(m, decode=("d1", "d2"), health_check_interval_s=0.1) as r:
            d1 = m["d1"].url
            wait_for(lambda: r.worker(d1).epoch == 3 and r.worker(d1).boot_id == "first", 5, "d1's epoch learned")
            m["d1"].epoch = 2  # the same process: a stale answer
            time.sleep(0.4)
            assert (r.worker(d1).mode, r.worker(d1).epoch) == (DECODE, 3)
            m["d1"].role, m["d1"].epoch, m["d1"].boot_id = "null", 0, "second"  # restarted as a null server
            wait_for(lambda: r.worker(d1).mode == NULL, 5, "the restarted worker's mode learned")
            assert r.worker(d1).epoch == 0 and [w.url for w in r.state.registry.pool(NULL)] == [d1]
    finally:
        m["d1"].role, m["d1"].epoch, m["d1"].boot_id = "decode", 0, None


def test_fallback_to_whole_request_workers(m):
    m["p1"].healthy = False
    with RouterServer(prefill=[(m["p1"].url, 8998)], decode=[m["d1"].url], workers=[m["n1"].url]) as r:
        assert httpx.get(r.url + "/health").status_code == 200
        resp = r.post("/generate", {"text": "x"})
        assert resp.json()["text"] == "n1 says hi"
        assert not any(k in m["n1"].requests[0][1] for k in BOOT)
        assert not m["p1"].requests and not m["d1"].requests
    with pd(m) as r:  # no null worker: the decode worker prefills locally
        resp = r.post("/generate", {"text": "x"})
        assert resp.json()["text"] == "d1 says hi"
        assert not any(k in m["d1"].requests[0][1] for k in BOOT)
    with pd(m, enforce_disaggregation=True) as r:
        assert httpx.get(r.url + "/health").status_code == 503
        resp = r.post("/generate", {"text": "x"})
        assert resp.status_code == 503 and "enforced" in resp.json()["error"]["message"]


def test_null_workers_only_plain_proxy(m):
    with RouterServer(workers=[m["n1"].url]) as r:
        body = {"model": "mock", "prompt": "hi", "stream": True}
        with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=10) as resp:
            got = b"".join(resp.iter_raw())
        assert got == b"".join(m["n1"].stream_bytes("/v1/completions", body))
        assert m["n1"].requests[0][1] == body


def test_a_worker_refusing_a_move_is_a_502_with_its_message_and_stays(m):
    """A worker that refuses the router's admin key: the caller's own key was fine, so not a 401; the
    message is the worker's text, not a dict's repr."""
    m["d1"].switch_refusal = (401, {"error": {"message": "Invalid or missing admin key", "type": "AuthenticationError",
                                              "code": 401}})
    with pd(m, decode=("d1", "d2")) as r:
        resp = r.post("/admin/set_worker_role", {"url": m["d1"].url, "mode": "prefill"})
        assert [w.url for w in r.state.registry.pool(DECODE)] == [m["d1"].url, m["d2"].url]
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["message"] == f"worker {m['d1'].url} did not switch to prefill: " \
                                              "Invalid or missing admin key"


def test_a_switch_answered_with_a_body_that_is_no_object_fails_the_move_and_frees_the_planner(m):
    """A worker answering 200 with a JSON list: a 502 saying what it reported, the worker stays in its pool, and the
    move by hand is over for the planner (none left in flight to hold its own moves back)."""
    m["d1"].switch_refusal = (200, ["switched"])
    with pd(m, decode=("d1", "d2")) as r:
        resp = r.post("/admin/set_worker_role", {"url": m["d1"].url, "mode": "prefill"})
        assert [w.url for w in r.state.registry.pool(DECODE)] == [m["d1"].url, m["d2"].url]
        planner = r.state.planner
        assert planner.state.in_flight == {} and planner.state.workers[m["d1"].url].failures == 1
        assert planner.decisions[-1].outcome.startswith("failed: worker")
    assert resp.status_code == 502, resp.text
    assert "reported mode None epoch None; expected prefill" in resp.json()["error"]["message"]
    assert resp.json()["worker_response"] == ["switched"]


@pytest.fixture
def movable(m):
    """The mocks, their roles and epochs put back after a test that moves them."""
    yield m
    for w in m.values():
        w.role, w.epoch = {"p": "prefill", "d": "decode", "n": "null"}[w.name[0]], 0


def test_a_hand_move_that_leaves_nothing_to_route_to_is_refused_unless_forced(movable, caplog):
    """p1 prefill, d1 decode: d1 -> prefill would leave two prefill workers and nothing that decodes (409, the
    worker untouched, the refusal logged); forced, it moves, and the planner's record says it was forced. p1 ->
    decode leaves two decode workers, which prefill locally: allowed, unless disaggregation is enforced."""
    m = movable
    before = {name: w.switches for name, w in m.items()}
    caplog.set_level(logging.INFO, logger="tidal.router.orchestrate")
    with pd(m) as r:
        resp = r.post("/admin/set_worker_role", {"url": m["d1"].url, "mode": "prefill"})
        assert resp.status_code == 409, resp.text
        message = resp.json()["error"]["message"]
        assert "0 null, 2 prefill, 0 decode" in message and '"force": true' in message
        assert m["d1"].switches == before["d1"] and [w.url for w in r.state.registry.pool(DECODE)] == [m["d1"].url]
        assert f"a move by hand of {m['d1'].url} to prefill refused (409): moving" in caplog.text
        resp = r.post("/admin/set_worker_role", {"url": m["d1"].url, "mode": "prefill", "force": True})
        assert resp.status_code == 200, resp.text
        assert r.state.planner.decisions[-1].reason.endswith(', "force": true)')
        assert m["d1"].switch_body == {"mode": "prefill", "drain": True, "timeout_s": r.cfg.switch_timeout_s,
                                       "handover": True}
        assert m["d1"].switches == before["d1"] + 1 and r.state.registry.pool(DECODE) == []
    with pd(m, decode=("d2",)) as r:
        assert r.post("/admin/set_worker_role", {"url": m["p1"].url, "mode": "decode"}).status_code == 200
    m["p1"].role, m["p1"].epoch = "prefill", 0
    with pd(m, decode=("d2",), enforce_disaggregation=True) as r:
        resp = r.post("/admin/set_worker_role", {"url": m["p1"].url, "mode": "decode"})
        assert resp.status_code == 409 and "0 prefill, 2 decode" in resp.json()["error"]["message"]
        resp = r.post("/admin/set_worker_role", {"url": m["d2"].url, "mode": "null"})
        assert resp.status_code == 409 and "1 null, 1 prefill, 0 decode" in resp.json()["error"]["message"]
        assert r.post("/admin/set_worker_role", {"url": m["p1"].url, "mode": "null"}).status_code == 409
        assert m["p1"].switches == before["p1"] + 1 and m["d2"].switches == before["d2"]


def test_a_hand_move_to_a_third_role_during_a_handover_is_refused_unless_forced(movable):
    """d1 moved from decode to prefill finishes its decode requests (its /get_load says so): a move to null would
    wait for them with d1 out of every pool, so it is refused (409, d1 still serving prefill); the move back to
    decode goes, and a forced move to null too."""
    m = movable
    with pd(m, decode=("d1", "d2")) as r:
        d1 = m["d1"].url
        assert r.post("/admin/set_worker_role", {"url": d1, "mode": "prefill"}).status_code == 200
        m["d1"].load = {**m["d1"].load, "handing_over_from": "decode"}
        try:
            switches = m["d1"].switches
            resp = r.post("/admin/set_worker_role", {"url": d1, "mode": "null"})
            assert resp.status_code == 409, resp.text
            message = resp.json()["error"]["message"]
            assert "is handing over: it serves as prefill while it finishes its decode requests" in message
            assert "move back to decode at once" in message and '"force": true' in message
            assert m["d1"].switches == switches and d1 in [w.url for w in r.state.registry.pool(PREFILL)]
            assert r.post("/admin/set_worker_role", {"url": d1, "mode": "decode"}).status_code == 200
            m["d1"].load["handing_over_from"] = ""  # back in decode: no handover
            assert r.post("/admin/set_worker_role", {"url": d1, "mode": "prefill"}).status_code == 200
            m["d1"].load["handing_over_from"] = "decode"
            resp = r.post("/admin/set_worker_role", {"url": d1, "mode": "null", "force": True})
            assert resp.status_code == 200 and m["d1"].role == "null", resp.text
        finally:
            m["d1"].load.pop("handing_over_from")


def test_a_workers_load_sums_its_ranks_and_keeps_the_role_it_hands_over_from():
    from tidal.planner.loop import worker_load
    from tidal.router.workers import sum_load

    load = sum_load([{"dp_rank": 0, "num_reqs": 1, "handing_over_from": ""},
                     {"dp_rank": 1, "num_reqs": 2, "num_decoding_reqs": 1, "handing_over_from": "decode"}])
    assert load == {"num_reqs": 3, "num_waiting_reqs": 0, "num_tokens": 0, "num_queued_prefill_tokens": 0,
                    "max_total_tokens": 0, "num_decoding_reqs": 1, "handing_over_from": "decode"}
    w = Worker(url="http://w", mode=PREFILL)
    w.load = load
    assert worker_load(w).handing_over_from == "decode" and worker_load(w).running_reqs == 3
    assert "handing_over_from" not in sum_load([{"num_reqs": 1}])  # a server that does not say: none


def test_a_router_set_to_drain_decode_workers_asks_for_no_handover(movable):
    m = movable
    with pd(m, decode=("d1", "d2"), planner=PlannerConfig(decode_move="drain")) as r:
        resp = r.post("/admin/set_worker_role", {"url": m["d1"].url, "mode": "prefill"})
        assert resp.status_code == 200, resp.text
        assert m["d1"].switch_body == {"mode": "prefill", "drain": True, "timeout_s": r.cfg.switch_timeout_s,
                                       "handover": False}


def test_add_remove_workers_and_health(m):
    with RouterServer() as r:
        assert httpx.get(r.url + "/health").status_code == 503
        resp = r.post("/generate", {"text": "x"})
        assert resp.status_code == 503 and resp.json()["error"]["message"]
        add = lambda q: httpx.post(r.url + "/add_worker", params=q, timeout=5)  # noqa: E731
        assert add({"url": m["p1"].url, "role": "prefill", "bootstrap_port": "9100"}).status_code == 200
        assert httpx.get(r.url + "/health").status_code == 503  # a prefill alone is no path
        resp = r.post("/generate", {"text": "x"})
        assert resp.status_code == 503 and "no usable path among the healthy workers (1 prefill, 0 decode, 0 null)" \
            in resp.json()["error"]["message"], resp.text
        assert add({"url": m["d1"].url, "role": "decode"}).status_code == 200
        assert httpx.get(r.url + "/health").status_code == 200
        assert add({"url": m["d1"].url, "role": "decode"}).status_code == 409
        assert add({"url": m["d2"].url, "role": "bogus"}).status_code == 400
        assert add({"url": m["d2"].url, "role": "decode", "bootstrap_port": "x"}).status_code == 400
        assert r.post("/generate", {"text": "x"}).status_code == 200
        assert m["d1"].requests[0][1]["bootstrap_port"] == 9100
        roles = {w["url"]: (w["role"], w["healthy"]) for w in httpx.get(r.url + "/workers").json()["workers"]}
        assert roles == {m["p1"].url: ("prefill", True), m["d1"].url: ("decode", True)}
        assert httpx.post(r.url + "/remove_worker", params={"url": m["p1"].url}).status_code == 200
        assert httpx.post(r.url + "/remove_worker", params={"url": m["p1"].url}).status_code == 404
        assert r.post("/generate", {"text": "y"}).json()["text"] == "d1 says hi"  # decode alone: local prefill
        assert len(m["p1"].requests) == 1


def test_passthrough_routes(m):
    m["d1"].load = {"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 40, "num_decoding_reqs": 2,
                    "num_waiting_prompt_tokens": 30}
    m["p1"].load = {"num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 10}
    with pd(m) as r:
        assert httpx.get(r.url + "/v1/models").json()["data"][0]["id"] == "mock-model"
        info = httpx.get(r.url + "/get_server_info").json()
        assert info["role"] == "router"
        assert {w["server_info"]["name"] for w in info["workers"]} == {"p1", "d1"}
        load = httpx.get(r.url + "/get_load").json()
        assert load[0]["num_reqs"] == 5 and load[0]["num_tokens"] == 50 and len(load[0]["workers"]) == 2
        # what the planner reads of each worker: a field the worker does not report stays absent, not 0
        per_worker = {w["url"]: w["load"] for w in load[0]["workers"]}
        assert (per_worker[m["d1"].url]["num_decoding_reqs"], per_worker[m["d1"].url]["num_waiting_prompt_tokens"]) \
            == (2, 30)
        assert "num_decoding_reqs" not in per_worker[m["p1"].url] and per_worker[m["p1"].url]["num_waiting_reqs"] == 0
        flush = httpx.post(r.url + "/flush_cache").json()
        assert flush["success"] and m["p1"].flushes == 1 and m["d1"].flushes == 1
        assert httpx.get(r.url + "/health_generate").status_code == 200
        r.post("/generate", {"text": "x"})
        text = httpx.get(r.url + "/metrics").text
        assert f'tidal_router:worker_requests_total{{role="decode",worker="{m["d1"].url}"}} 1.0' in text
        assert 'tidal_router:requests_total{route="/generate",status="200"} 1.0' in text


def test_cli_subprocess(m):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "tidal.router", "--prefill", m["p1"].url, "none", "--decode", m["d1"].url,
           "--port", str(port), "--policy", "round_robin", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, "router subprocess")
        resp = httpx.post(url + "/generate", json={"text": "x"}, timeout=10)
        assert resp.status_code == 200
        assert m["d1"].requests[0][1]["bootstrap_port"] is None
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    bad = subprocess.run([sys.executable, "-m", "tidal.router", "--prefill", "http://x:1", "1", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--prefill" in bad.stderr


# ---------------------------------------------------------------- policies (unit)


def workers(*loads: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}:1", mode=DECODE, healthy=True, in_flight=n) for i, n in enumerate(loads)]


def test_random_and_round_robin():
    ws = workers(0, 0, 0)
    rnd = RandomPolicy(seed=1)
    assert {rnd.select(ws).url for _ in range(50)} == {w.url for w in ws}
    rr = RoundRobinPolicy()
    assert [rr.select(ws).url for _ in range(6)] == [w.url for w in ws] * 2


def test_power_of_two_prefers_lower_load():
    ws = workers(5, 1)
    p2 = PowerOfTwoPolicy(seed=0)
    assert all(p2.select(ws).url == ws[1].url for _ in range(20))
    ws[0].load = {"num_reqs": 0}
    ws[0].in_flight, ws[1].load = 0, {"num_reqs": 9}  # cached /get_load counts too
    assert p2.select(ws).url == ws[0].url
    many = workers(9, 9, 0, 9)
    picks = [p2.select(many).url for _ in range(200)]
    assert picks.count(many[2].url) > 70  # chosen whenever sampled (about half the time)


def test_cache_aware_affinity_and_balance():
    ca = CacheAwarePolicy(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5, block_chars=4)
    ws = workers(0, 0, 0)
    prompts = [f"system prompt {k} " * 4 for k in range(3)]
    first = [ca.select(ws, t).url for t in prompts]
    assert len(set(first)) == 3  # new prefixes spread over the pool
    for t, url in zip(prompts, first):
        assert ca.select(ws, t + " and a follow-up question").url == url  # shared prefix: same worker
    assert ca.select(ws, "completely different text here").url in {w.url for w in ws}
    target = next(w for w in ws if w.url == first[0])
    target.in_flight = 10  # imbalanced: max - min > 4 and max > 1.5 * min
    assert ca.select(ws, prompts[0] + "more").url != target.url
    target.in_flight = 0
    owner = next(w for w in ws if w.url == first[1])
    owner.in_flight = 3  # balanced enough: affinity wins even though it is the busiest
    assert ca.select(ws, prompts[1] + "more").url == owner.url


def test_cache_aware_threshold_and_forget():
    ca = CacheAwarePolicy(cache_threshold=0.9, block_chars=4)
    ws = workers(0, 0)
    url = ca.select(ws, "abcdefgh").url
    other = next(w.url for w in ws if w.url != url)
    assert ca.select(ws, "abcdefgh" + "x" * 40).url == other  # match 8/48 < 0.9: least cached wins
    ca.forget(url)
    assert url not in ca.index.sizes
    assert ca.index.match("abcdefgh", {url}) == (set(), 0)


def test_prefix_index_is_bounded():
    idx = PrefixIndex(block_chars=2, max_entries=10)
    for k in range(50):
        idx.insert(f"{k:04d}-text", "http://a:1")
    assert len(idx) == 10 and idx.sizes["http://a:1"] == 10
    owners, n = idx.match("0049-text", {"http://a:1"})
    assert owners == {"http://a:1"} and n == 9
    assert make_policy("power_of_two").name == "power_of_two"
    with pytest.raises(ValueError):
        make_policy("bucket")


# ---------------------------------------------------------------- registry and planning (unit)


def test_registry_pools_follow_worker_state():
    reg = WorkerRegistry(failure_threshold=2)
    p = reg.add("http://h1:1/", PREFILL, 9000, healthy=True)
    d = reg.add("http://h2:1", DECODE, healthy=True)
    assert p.url == "http://h1:1" and p.bootstrap_port == 9000 and p.host == "h1"
    assert reg.has_pd_path() and reg.pool(PREFILL) == [p]
    with pytest.raises(KeyError):
        reg.add("http://h1:1", DECODE)
    with pytest.raises(ValueError):
        reg.add("h3:1", DECODE)
    assert reg.set_mode(p.url, DECODE, epoch=3)
    assert reg.pool(PREFILL) == [] and reg.pool(DECODE) == [p, d]
    assert not reg.set_mode(p.url, PREFILL, epoch=2)  # stale epoch ignored
    assert reg.set_mode(p.url, PREFILL, epoch=4, bootstrap_port=9100) and p.bootstrap_port == 9100
    assert not reg.record_failure(d, "x") and d.healthy
    assert reg.record_failure(d, "y") and not d.healthy
    assert not reg.has_pd_path() and not reg.has_usable_path(True) and not reg.has_usable_path(False)
    reg.record_success(d)
    assert d.healthy and d.failures == 0
    seen = []
    reg.on_remove(seen.append)
    assert reg.remove(d.url) is d and seen == [d.url] and reg.remove(d.url) is None


def test_plan_chooses_between_pd_and_whole():
    cfg = RouterConfig()
    reg = WorkerRegistry()
    p = reg.add("http://p:1", PREFILL, healthy=True)
    d = reg.add("http://d:1", DECODE, healthy=True)
    n = reg.add("http://n:1", NULL, healthy=True)
    pol = {PREFILL: RoundRobinPolicy(), DECODE: RoundRobinPolicy(), NULL: RoundRobinPolicy()}
    disp = Dispatcher(cfg, reg, pol, None, RouterMetrics())
    assert disp.plan("", set()) == ("whole", n, None)  # tie: the whole path (no transfer)
    n.in_flight = 2
    assert disp.plan("", set()) == ("pd", p, d)
    cfg.enforce_disaggregation = True
    n.in_flight = 0
    assert disp.plan("", set()) == ("pd", p, d)
    d.healthy = False
    assert disp.plan("", set()) is None
    cfg.enforce_disaggregation = False
    assert disp.plan("", set()) == ("whole", n, None)
    n.healthy = False
    assert disp.plan("", set()) is None  # a prefill alone cannot serve


def test_pd_pairs_any_tp_sizes():
    """The transfer slices KV heads between TP sizes: a TP-1 prefill pairs with a TP-3 decode and back."""
    reg = WorkerRegistry()
    p1 = reg.add("http://p1:1", PREFILL, healthy=True)
    d3 = reg.add("http://d3:1", DECODE, healthy=True)
    p1.tp_size, d3.tp_size = 1, 3
    pol = {PREFILL: RoundRobinPolicy(), DECODE: RoundRobinPolicy(), NULL: RoundRobinPolicy()}
    disp = Dispatcher(RouterConfig(), reg, pol, None, RouterMetrics())
    assert reg.has_pd_path() and disp.plan("", set()) == ("pd", p1, d3)
    p3 = reg.add("http://p3:1", PREFILL, healthy=True)
    p3.tp_size = 3
    assert {disp.plan("", set())[1].url for _ in range(4)} == {p1.url, p3.url}


def test_request_text():
    assert request_text("/generate", {"text": ["a", "b"]}) == "a"
    assert request_text("/generate", {"input_ids": [1, 2, 3]}) == "1,2,3"
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert request_text("/v1/chat/completions", chat) == "user\nhi\n"
    assert request_text("/v1/completions", {"prompt": "p"}) == "p" and request_text("/v1/completions", {}) == ""
