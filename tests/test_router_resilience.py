"""The router's resilience (issue 66, part 4): retry delays with jitter and Retry-After, a circuit breaker per
worker, the admission gate's bounded queue, GET /workers, and membership changes under traffic. Units on a fake
clock, then a real router against mock workers (tests/mock_worker.py)."""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from typing import Any

import httpx
import pytest

from mock_worker import MockWorker
from router_server import RouterServer, wait_for
from tidal.router.cli import add_router_args, router_config_from_namespace
from tidal.router.legs import BREAKER_FAILURE_STATUS
from tidal.router.resilience import (
    CLOSED, FAILURE, HALF_OPEN, NEUTRAL, OPEN, SUCCESS,
    AdmissionGate, AdmissionRefused, BreakerConfig, CircuitBreaker, CircuitBreakers, RetryPolicy, parse_retry_after,
)

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- retries


def test_retry_delays_grow_to_the_cap_spread_by_the_jitter_and_honour_retry_after():
    policy = RetryPolicy(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter=0.2)
    rng = random.Random(0)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        delays = [policy.delay_s(attempt, rng) for _ in range(200)]
        assert all(base * 0.8 - 1e-9 <= d <= base * 1.2 + 1e-9 for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > base * 0.2  # spread, not one value
    assert RetryPolicy(0.1, 1.0, 2.0, 0.0).delay_s(2, rng) == pytest.approx(0.2)
    assert policy.delay_s(1, rng, retry_after_s=0.5) >= 0.5  # the worker's word is kept
    assert policy.delay_s(1, rng, retry_after_s=120) <= 1.0  # up to the cap
    assert parse_retry_after("2") == 2.0 and parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None and parse_retry_after("-1") is None
    assert parse_retry_after(None) is None and parse_retry_after("nan") is None


# ---------------------------------------------------------------- circuit breaker


def test_a_breaker_opens_after_k_consecutive_failures_and_refusals_do_not_count():
    clock = Clock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, success_threshold=2, timeout_s=10, window_s=60))
    for verdict in (FAILURE, FAILURE, SUCCESS, FAILURE, NEUTRAL, FAILURE):  # a success breaks the streak
        b.record(verdict, clock())
        assert b.state == CLOSED
    assert b.record(FAILURE, clock()) == OPEN
    assert not b.allows(clock()) and b.times_opened == 1
    assert BREAKER_FAILURE_STATUS >= {500, 502, 504, 408} and not BREAKER_FAILURE_STATUS & {503, 409, 429, 400}


def test_a_failure_streak_older_than_the_window_starts_over():
    clock = Clock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, window_s=5))
    b.record(FAILURE, clock())
    b.record(FAILURE, clock())
    clock.t += 6
    b.record(FAILURE, clock())  # the first of a new streak
    b.record(FAILURE, clock())
    assert b.state == CLOSED
    assert b.record(FAILURE, clock()) == OPEN


def test_half_open_lets_one_probe_at_a_time_closes_after_j_successes_and_reopens_on_a_failure():
    clock = Clock()
    board = CircuitBreakers(BreakerConfig(failure_threshold=1, success_threshold=2, timeout_s=10), clock=clock)
    assert not board.claim("w")
    board.record("w", FAILURE)
    assert board.state("w")["state"] == OPEN and not board.allows("w")
    assert board.state("w")["reopens_in_s"] == 10
    clock.t += 10
    assert board.allows("w")
    assert board.claim("w") is True  # the probe
    assert board.state("w")["state"] == HALF_OPEN and not board.allows("w")  # one at a time
    board.record("w", NEUTRAL, probe=True)  # a refusal proves nothing: another probe may go
    assert board.allows("w")
    board.claim("w")
    board.record("w", SUCCESS, probe=True)
    assert board.state("w")["state"] == HALF_OPEN
    board.claim("w")
    board.record("w", SUCCESS, probe=True)
    assert board.state("w")["state"] == CLOSED
    board.record("w", FAILURE)
    clock.t += 10
    board.claim("w")
    board.record("w", SUCCESS, probe=False)  # sent before the circuit opened: the probe decides
    assert board.state("w")["state"] == HALF_OPEN and not board.allows("w")
    board.record("w", FAILURE, probe=True)
    assert board.state("w") == {"state": OPEN, "consecutive": 0, "times_opened": 3, "reopens_in_s": 10}


def test_a_disabled_or_forgotten_breaker_allows_everything():
    off = CircuitBreakers(BreakerConfig(enabled=False, failure_threshold=1))
    off.record("w", FAILURE)
    assert off.allows("w") and off.state("w") == {"state": "disabled"} and not off.claim("w")
    on = CircuitBreakers(BreakerConfig(failure_threshold=1))
    on.claim("w")
    on.record("w", FAILURE)
    assert not on.allows("w")
    on.forget("w")
    assert on.allows("w")
    on.record("gone", FAILURE)  # a removed worker's late answer changes nothing
    assert on.allows("gone")


# ---------------------------------------------------------------- admission gate


def test_the_gate_queues_first_in_first_out_refuses_a_full_queue_and_times_out():
    async def main() -> None:
        gate = AdmissionGate(max_concurrent=2, queue_size=2, queue_timeout_s=0.3)
        a, b = await gate.enter(), await gate.enter()
        order: list[str] = []

        async def wait(name: str) -> int:
            t = await gate.enter()
            order.append(name)
            return t

        c = asyncio.ensure_future(wait("c"))
        d = asyncio.ensure_future(wait("d"))
        await asyncio.sleep(0.01)
        assert gate.active == 2 and gate.queued == 2
        with pytest.raises(AdmissionRefused) as full:
            await gate.enter()
        assert full.value.status == 429 and full.value.retry_after_s >= 1
        gate.leave(a)
        gate.leave(a)  # twice: the second changes nothing
        tc = await c
        assert order == ["c"] and gate.active == 2 and gate.queued == 1
        with pytest.raises(AdmissionRefused) as late:
            await d  # nobody leaves: it waits its whole timeout
        assert late.value.status == 408 and gate.queued == 0 and gate.refused == {429: 1, 408: 1}
        gate.leave(b)
        gate.leave(tc)
        assert gate.active == 0

    asyncio.run(main())


def test_a_waiter_that_leaves_gives_up_its_place_or_the_slot_it_was_handed():
    async def main() -> None:
        gate = AdmissionGate(max_concurrent=1, queue_size=5, queue_timeout_s=5)
        a = await gate.enter()
        gone = asyncio.ensure_future(gate.enter())
        nxt = asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0.01)
        gone.cancel()  # the client left while queued
        await asyncio.gather(gone, return_exceptions=True)
        assert gate.queued == 1
        gate.leave(a)
        b = await nxt
        late = asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0.01)
        gate.leave(b)  # hands the slot to `late` ...
        late.cancel()  # ... which is cancelled before it ran: the slot must not leak
        await asyncio.gather(late, return_exceptions=True)
        assert gate.active == 0 and gate.queued == 0
        assert await gate.enter() and gate.active == 1

    asyncio.run(main())


def test_an_unlimited_gate_never_waits():
    async def main() -> None:
        gate = AdmissionGate(max_concurrent=-1, queue_size=0, queue_timeout_s=1)
        tickets = [await gate.enter() for _ in range(1000)]
        for t in tickets:
            gate.leave(t)
        assert gate.active == 0

    asyncio.run(main())


# ---------------------------------------------------------------- flags


def _cfg(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return router_config_from_namespace(parser.parse_args(argv))


def test_resilience_flags_keep_sgl_model_gateway_names_and_bad_values_are_refused():
    cfg = _cfg(["--retry-max-retries", "7", "--retry-backoff-multiplier", "1.5", "--retry-jitter-factor", "0.1",
                "--cb-failure-threshold", "4", "--cb-success-threshold", "3", "--cb-timeout-duration-secs", "12",
                "--cb-window-duration-secs", "30", "--max-concurrent-requests", "64", "--queue-size", "8",
                "--queue-timeout-secs", "5"])
    assert (cfg.max_retries, cfg.retry_backoff_multiplier, cfg.retry_jitter_factor) == (7, 1.5, 0.1)
    assert cfg.breaker_config() == BreakerConfig(True, 4, 3, 12.0, 30.0)
    assert (cfg.max_concurrent_requests, cfg.queue_size, cfg.queue_timeout_s) == (64, 8, 5.0)
    off = _cfg(["--disable-retries", "--disable-circuit-breaker"])
    assert off.max_retries == 0 and not off.breaker_config().enabled
    for bad in (["--cb-failure-threshold", "0"], ["--retry-jitter-factor", "2"], ["--queue-size", "-1"],
                ["--retry-backoff-multiplier", "0.5"], ["--queue-timeout-secs", "0"]):
        with pytest.raises(ValueError):
            _cfg(bad)


# ---------------------------------------------------------------- a real router against mock workers


@pytest.fixture(scope="module")
def mocks():
    ws = {n: MockWorker(role, n) for n, role in
          (("n1", "null"), ("n2", "null"), ("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))}
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


def gen(r: RouterServer, text: str = "x", **kw: Any) -> httpx.Response:
    return httpx.post(r.url + "/generate", json={"text": text, **kw}, timeout=30)


def workers_by_url(r: RouterServer) -> dict:
    body = httpx.get(r.url + "/workers", timeout=5).json()
    return {w["url"]: w for w in body["workers"]}


def test_a_failing_worker_is_cut_off_probed_after_the_cool_off_and_taken_back(m):
    bad, good = m["n1"], m["n2"]
    with RouterServer(workers=[bad.url, good.url], policy="round_robin", cb_failure_threshold=2,
                      cb_success_threshold=1, cb_timeout_s=0.5, max_retries=1) as r:
        bad.fail_next, bad.fail_status = 100, 500
        for _ in range(6):
            assert gen(r).status_code == 200  # retried on the good one
        assert len(bad.requests) == 2, "the breaker opens after 2 failures: no more requests go there"
        info = workers_by_url(r)[bad.url]["circuit_breaker"]
        assert info["state"] == "open" and info["times_opened"] == 1
        assert workers_by_url(r)[good.url]["circuit_breaker"]["state"] == "closed"
        assert 'state="open"' in httpx.get(r.url + "/metrics").text
        bad.fail_next = 0
        time.sleep(0.6)
        for _ in range(4):
            assert gen(r).status_code == 200
        assert len(bad.requests) >= 3  # the probe went, succeeded, and closed the circuit
        assert workers_by_url(r)[bad.url]["circuit_breaker"]["state"] == "closed"


def test_every_worker_open_is_a_503_that_says_so_and_refusals_never_open_a_breaker(m):
    with RouterServer(workers=[m["n1"].url], cb_failure_threshold=2, cb_timeout_s=30, max_retries=0) as r:
        m["n1"].fail_next = 5  # 503: a draining or full worker refuses; it is not broken
        assert [gen(r).status_code for _ in range(5)] == [503] * 5
        assert workers_by_url(r)[m["n1"].url]["circuit_breaker"]["state"] == "closed"
        m["n1"].fail_next, m["n1"].fail_status = 2, 502
        assert [gen(r).status_code for _ in range(2)] == [502, 502]
        resp = gen(r)
        assert resp.status_code == 503 and "open circuit breaker" in resp.json()["error"]["message"]
        assert len(m["n1"].requests) == 7


def test_a_failing_prefill_does_not_open_its_decode_partners_breaker(m):
    with RouterServer(prefill=[(m["p1"].url, 8998)], decode=[m["d1"].url], cb_failure_threshold=2,
                      max_retries=0) as r:
        m["p1"].fail_next, m["p1"].fail_status = 2, 500
        for _ in range(2):
            assert gen(r).status_code == 500
        state = {url: w["circuit_breaker"]["state"] for url, w in workers_by_url(r).items()}
        assert state == {m["p1"].url: "open", m["d1"].url: "closed"}
        resp = gen(r)  # the prefill is cut off: the decode worker prefills the whole request itself
        assert resp.status_code == 200 and "bootstrap_room" not in m["d1"].requests[-1][1]


def test_a_decode_failure_that_ends_before_its_failing_prefill_is_still_the_prefills(m):
    with RouterServer(prefill=[(m["p1"].url, 8998)], decode=[m["d1"].url], cb_failure_threshold=2,
                      max_retries=0) as r:
        m["p1"].fail_next, m["p1"].fail_status, m["p1"].hang_s = 2, 500, 0.3
        m["d1"].fail_next, m["d1"].fail_status = 2, 500  # decode answers first: its call ends with an error
        for _ in range(2):
            assert gen(r).status_code == 500
        state = {url: w["circuit_breaker"]["state"] for url, w in workers_by_url(r).items()}
        assert state == {m["p1"].url: "open", m["d1"].url: "closed"}


def test_a_retry_waits_at_least_the_workers_retry_after(m):
    with RouterServer(workers=[m["n1"].url], max_retries=1, retry_max_backoff_s=2.0) as r:
        m["n1"].fail_next, m["n1"].fail_status, m["n1"].fail_headers = 1, 429, {"Retry-After": "0.4"}
        t0 = time.monotonic()
        assert gen(r).status_code == 200
        assert time.monotonic() - t0 >= 0.4 and len(m["n1"].requests) == 2


def test_admission_queues_past_the_limit_refuses_a_full_queue_with_retry_after_and_times_out(m):
    m["n1"].hang_s = 1.0
    with RouterServer(workers=[m["n1"].url], max_concurrent_requests=1, queue_size=1, queue_timeout_s=5) as r:
        results: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            results[i] = gen(r, f"req {i}")

        first = threading.Thread(target=send, args=(0,))
        first.start()
        wait_for(lambda: len(m["n1"].requests) == 1, 5, "the first request at the worker")
        second = threading.Thread(target=send, args=(1,))
        second.start()
        wait_for(lambda: r.state.gate.queued == 1, 5, "the second request queued")
        full = gen(r, "req 2")
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
        assert "--max-concurrent-requests 1" in full.json()["error"]["message"]
        first.join()
        second.join()
        assert results[0].status_code == results[1].status_code == 200
        gate = httpx.get(r.url + "/workers").json()["admission"]
        assert gate == {"max_concurrent_requests": 1, "active": 0, "queued": 0, "queue_size": 1,
                        "refused": {"429": 1, "408": 0}}
        assert 'tidal_router:admission_refused_total{status="429"} 1.0' in httpx.get(r.url + "/metrics").text
    m["n1"].requests.clear()
    with RouterServer(workers=[m["n1"].url], max_concurrent_requests=1, queue_size=4, queue_timeout_s=0.2) as r:
        first = threading.Thread(target=gen, args=(r,))
        first.start()
        wait_for(lambda: len(m["n1"].requests) == 1, 5, "the first request at the worker")
        late = gen(r)
        assert late.status_code == 408 and "--queue-timeout-secs 0.2" in late.json()["error"]["message"]
        assert "retry-after" in late.headers
        first.join()
        assert len(m["n1"].requests) == 1 and r.state.gate.active == 0


def test_a_stream_holds_its_slot_until_it_ends_and_a_client_leaving_the_queue_frees_its_place(m):
    m["n1"].chunk_delay_s, m["n1"].num_chunks = 0.2, 4
    with RouterServer(workers=[m["n1"].url], max_concurrent_requests=1, queue_size=2, queue_timeout_s=10) as r:
        with httpx.stream("POST", r.url + "/generate", json={"text": "s", "stream": True}, timeout=30) as resp:
            lines = resp.iter_lines()  # one iterator: a dropped one closes the stream
            first = next(lines)
            assert first.startswith("data: ") and r.state.gate.active == 1
            with pytest.raises(httpx.ReadTimeout):  # queued behind the stream; the client gives up
                httpx.post(r.url + "/generate", json={"text": "t"}, timeout=0.3)
            wait_for(lambda: r.state.gate.queued == 0, 5, "the departed client leaving the queue")
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        wait_for(lambda: r.state.gate.active == 0, 5, "the stream's slot back")
        assert gen(r).status_code == 200 and len(m["n1"].requests) == 2  # the departed client's never went


def test_workers_removed_and_added_under_traffic_lose_no_request(m):
    """A worker removed while it serves a stream and a whole request finishes both; new requests avoid it; a
    worker added at runtime takes requests at once; /workers shows health, role, load and breaker state."""
    old, new = m["n1"], m["n2"]
    old.chunk_delay_s, old.num_chunks = 0.15, 5
    with RouterServer(workers=[old.url]) as r:
        expected = b"".join(old.stream_bytes("/generate", {"text": "long"}))
        got: list[bytes] = []

        def stream() -> None:
            with httpx.stream("POST", r.url + "/generate", json={"text": "long", "stream": True},
                              timeout=30) as resp:
                got.append(b"".join(resp.iter_bytes()))

        t = threading.Thread(target=stream)
        t.start()
        wait_for(lambda: old.requests, 5, "the stream at the old worker")
        added = httpx.post(r.url + "/add_worker", params={"url": new.url, "role": "null"}, timeout=5)
        assert added.status_code == 200 and added.json()["worker"]["healthy"]
        removed = httpx.post(r.url + "/remove_worker", params={"url": old.url}, timeout=5)
        assert removed.status_code == 200
        listed = workers_by_url(r)
        assert list(listed) == [new.url]
        assert {"healthy", "role", "load", "in_flight", "circuit_breaker"} <= set(listed[new.url])
        for _ in range(3):
            assert gen(r).status_code == 200
        t.join()
        assert got == [expected], "the removed worker's stream reached its client whole"
        assert len(old.requests) == 1 and len(new.requests) == 3
        assert old.cancelled == 0
