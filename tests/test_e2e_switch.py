"""Runtime role switching on real servers: the admin API's status codes, and a 3-server
cluster moved through every direction by the router under continuous client traffic."""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx
import pytest

from servers import Server, Traffic, all_ready, free_port

pytestmark = pytest.mark.timeout(900)

KEY = "sekrit"
PROMPTS = ["The capital of France is", "def add(a, b):", "Three primary colors are", "Water boils at"]


def dynamic_flags(*extra: str) -> tuple[str, ...]:
    return ("--enable-dynamic-disaggregation", "--disaggregation-transfer-backend", "tcp",
            "--disaggregation-bootstrap-port", str(free_port()), "--torch-threads", "1",
            "--chunked-prefill-size", "32", *extra)


def dynamic_server(*extra: str) -> Server:
    return Server(*dynamic_flags(*extra))


def switch(url: str, mode: str, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/admin/switch_disaggregation_mode", json={"mode": mode, **kw}, headers=headers,
                      timeout=120)


def gen(url: str, text: str, n: int = 16) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=120)


def stream_into(url: str, body: dict, got: list, first_token: threading.Event) -> None:
    """POST a streamed /generate; `got` holds the output ids so far, `first_token` is set with the first."""
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got[:] = json.loads(line[6:])["output_ids"]
                first_token.set()


def test_admin_api_status_codes():
    s = dynamic_server("--admin-api-key", KEY)
    try:
        assert switch(s.url, "prefill", key=None).status_code == 401
        assert switch(s.url, "sideways").status_code == 400
        st = httpx.get(s.url + "/admin/disaggregation_status", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert st["current_mode"] == "null" and st["transition_state"] == "IDLE" and st["epoch"] == 0

        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}}
        with httpx.Client(timeout=120) as c:
            t = threading.Thread(target=lambda: c.post(s.url + "/generate", json=body))
            t.start()
            time.sleep(1.0)
            busy = switch(s.url, "prefill")  # queues not empty, no drain
            assert busy.status_code == 503 and busy.headers.get("retry-after")
            slow = switch(s.url, "decode", drain=True, timeout_s=0.5)  # the request outlives the drain
            assert slow.status_code == 504 and slow.json()["current_mode"] == "null"
            t.join()

        r = switch(s.url, "prefill")
        assert r.status_code == 200 and r.json()["epoch"] == 1 and "switch" in r.json()["timings_ms"]
        info = httpx.get(s.url + "/server_info").json()
        assert info["disaggregation_mode"] == "prefill" and info["epoch"] == 1
        r = httpx.post(s.url + "/pd_role_switch", json={"new_role": "null"}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["current_mode"] == "null"
        assert gen(s.url, PROMPTS[1], 4).status_code == 200
        wrong = httpx.post(s.url + "/generate", json={"text": "hi"}, headers={"X-Tidal-Expected-Mode": "decode"})
        assert wrong.status_code == 409 and wrong.json()["error"]["type"] == "ConflictError", wrong.text
    finally:
        s.stop()


def test_disabled_switching_is_400():
    s = Server("--torch-threads", "1")
    try:
        r = switch(s.url, "prefill", key=None)
        assert r.status_code == 400 and "--enable-dynamic-disaggregation" in r.json()["message"]
    finally:
        s.stop()


def test_router_moves_workers_through_every_direction_under_traffic():
    servers = all_ready(*(Server(*dynamic_flags(), wait=False) for _ in range(3)))
    a, b, c = (s.url for s in servers)
    reference = {p: gen(a, p).json()["output_ids"] for p in PROMPTS}
    rport = free_port()
    cmd = [sys.executable, "-m", "tidal.router", "--port", str(rport), "--worker", a, b, c,
           "--policy", "round_robin", "--health-check-interval-secs", "1", "--max-retries", "5"]
    router = Server(cmd=cmd, port=rport)
    moves = [(a, "prefill"), (b, "decode"), (a, "decode"), (c, "prefill"), (b, "prefill"), (c, "null"),
             (a, "null"), (b, "null")]
    try:
        with Traffic(router.url, reference, 16) as traffic:
            time.sleep(2)
            for url, mode in moves:
                r = httpx.post(router.url + "/admin/set_worker_role", json={"url": url, "mode": mode}, timeout=180)
                assert r.status_code == 200, r.text
                assert r.json()["mode"] == mode
                time.sleep(1.5)
        workers = {w["url"]: w for w in httpx.get(router.url + "/workers").json()["workers"]}
        assert all(w["mode"] == "null" for w in workers.values())
        assert workers[a]["epoch"] == 3 and workers[b]["epoch"] == 3 and workers[c]["epoch"] == 2
        assert traffic.failures == [] and traffic.mismatches == []
        assert traffic.ok > 20
    finally:
        router.stop()
        for s in servers:
            s.stop()


def streaming(url: str, text: str, n: int) -> tuple[threading.Thread, list]:
    """A streamed temperature-0 answer of n tokens from `url`, started and past its first token: the thread
    streaming it, and its output ids so far."""
    got, first_token = [], threading.Event()
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "stream": True}
    t = threading.Thread(target=stream_into, args=(url, body, got, first_token))
    t.start()
    assert first_token.wait(120)
    return t, got


def pd_request(prefill_url: str, decode_url: str, text: str, room: int) -> httpx.Response:
    """One 8-token PD request, as the router sends it: both legs at once; the decode leg's answer."""
    bport = httpx.get(prefill_url + "/server_info").json()["disaggregation_bootstrap_port"]
    body = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    with httpx.Client(timeout=120) as c:
        leg = threading.Thread(target=lambda: c.post(prefill_url + "/generate", json=body))
        leg.start()
        answer = c.post(decode_url + "/generate", json=body)
        leg.join()
    return answer


@pytest.fixture(scope="module")
def pair():
    """Two dynamic servers shared by the handover tests (server starts were most of their time): each test
    gets them null and idle, their epochs as earlier tests left them."""
    a, b = all_ready(Server(*dynamic_flags(), wait=False), Server(*dynamic_flags(), wait=False))
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


_COLOCATED: dict[tuple[str, int], list[int]] = {}


def colocated(url: str, text: str, n: int) -> list[int]:
    """The greedy answer of a null server (every server here runs the same model and flags), asked once."""
    if (text, n) not in _COLOCATED:
        _COLOCATED[text, n] = gen(url, text, n).json()["output_ids"]
    return _COLOCATED[text, n]


def null_and_idle(*servers: Server) -> None:
    for s in servers:
        st = {}
        for _ in range(300):
            st = httpx.get(s.url + "/admin/disaggregation_status").json()
            if st["transition_state"] == "IDLE":
                break
            time.sleep(0.1)
        if st["current_mode"] != "null":
            assert switch(s.url, "null", drain=True, timeout_s=60).status_code == 200


def test_a_decode_server_switches_to_prefill_at_once_while_its_answer_goes_on(pair):
    """Real servers: B decodes a long answer for A; B switches to prefill with handover while it streams.
    The switch does not wait for the answer (no drain), B prefills for A (now decode) at once, the answer
    streams on to the end equal to the colocated one, and the decode role goes once it is done."""
    a, b = pair
    null_and_idle(a, b)
    n = 320
    want = gen(a.url, PROMPTS[1], n).json()["output_ids"]
    assert switch(a.url, "prefill").status_code == 200 and switch(b.url, "decode").status_code == 200
    bport = httpx.get(a.url + "/server_info").json()["disaggregation_bootstrap_port"]
    room = 12345
    sampling = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    body = {"text": PROMPTS[1], "sampling_params": sampling, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bport, "bootstrap_room": room}
    got, first_token = [], threading.Event()

    t = threading.Thread(target=stream_into, args=(b.url, {**body, "stream": True}, got, first_token))
    t.start()
    assert httpx.post(a.url + "/generate", json=body, timeout=300).status_code == 200  # A's prefill leg
    assert first_token.wait(120)
    r = switch(b.url, "prefill", handover=True, drain=False)
    assert r.status_code == 200, r.text
    assert r.json()["current_mode"] == "prefill" and r.json()["timings_ms"]["drain"] == 0.0
    assert "handover" in r.json()["message"]
    assert switch(a.url, "decode", drain=True, timeout_s=60).status_code == 200
    t_switch = time.time()
    # B prefills for A at once, while its own answer goes on
    bport_b = httpx.get(b.url + "/server_info").json()["disaggregation_bootstrap_port"]
    body2 = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
             "bootstrap_host": "127.0.0.1", "bootstrap_port": bport_b, "bootstrap_room": 777}
    with httpx.Client(timeout=120) as c:
        legs = [threading.Thread(target=lambda: c.post(b.url + "/generate", json=body2))]
        legs[0].start()
        second = c.post(a.url + "/generate", json=body2)
        legs[0].join()
    assert second.status_code == 200, second.text
    assert t.is_alive(), "the handed-over answer should still be streaming"
    t.join(300)
    assert got == want and len(got) == n
    st = httpx.get(b.url + "/admin/disaggregation_status").json()
    for _ in range(50):
        if st["transition_state"] == "IDLE":
            break
        time.sleep(0.1)
        st = httpx.get(b.url + "/admin/disaggregation_status").json()
    assert st["transition_state"] == "IDLE" and st["current_mode"] == "prefill"
    assert st["last_switch_timings_ms"]["handover"] > 0 and time.time() - t_switch < 300


def test_a_busy_null_server_switches_to_prefill_at_once_while_its_answer_goes_on(pair):
    """Real servers: A (null) streams a long answer of its own when it switches to prefill with handover.
    The switch does not drain, A prefills for B (decode) at once, its own answer streams on to the end equal
    to the one before the switch, and the null role goes once it is done."""
    a, b = pair
    null_and_idle(a, b)
    n = 200
    want = colocated(a.url, PROMPTS[3], n)
    assert switch(b.url, "decode").status_code == 200
    t, got = streaming(a.url, PROMPTS[3], n)
    r = switch(a.url, "prefill", handover=True, drain=False)
    assert r.status_code == 200, r.text
    assert r.json()["timings_ms"]["drain"] == 0.0 and "null role held finish under prefill" in r.json()["message"]
    t_switch = time.time()
    assert handing_over_from(a.url) == "null"  # what the router reads as the switch answers (no stale snapshot)
    pd = pd_request(a.url, b.url, PROMPTS[0], room=4242)
    assert pd.status_code == 200, pd.text
    assert t.is_alive(), "the handed-over answer should still be streaming"
    t.join(300)
    assert got == want
    for _ in range(50):
        st = httpx.get(a.url + "/admin/disaggregation_status").json()
        if st["transition_state"] == "IDLE":
            break
        time.sleep(0.1)
    assert st["transition_state"] == "IDLE" and st["current_mode"] == "prefill"
    assert st["last_switch_timings_ms"]["handover"] > 0 and time.time() - t_switch < 300
    assert handing_over_from(a.url) == ""


def handing_over_from(url: str) -> str:
    """/get_load's `handing_over_from`: a load snapshot, sent anew whenever the role changes."""
    return httpx.get(url + "/get_load", timeout=10).json()[0]["handing_over_from"]


def test_a_server_switched_back_during_its_handover_is_null_again_while_its_answer_goes_on(pair):
    """Real servers: A (null) hands its streaming answer over to prefill, prefills one PD request for B, and is
    switched back to null while the answer still streams: the switch back goes at once (no drain: the PD
    prompt's KV was sent), the answer ends equal to the one before, and A serves colocated requests again."""
    a, b = pair
    null_and_idle(a, b)
    epoch = httpx.get(a.url + "/admin/disaggregation_status").json()["epoch"]
    n = 200
    want = colocated(a.url, PROMPTS[3], n)
    assert switch(b.url, "decode").status_code == 200
    t, got = streaming(a.url, PROMPTS[3], n)
    assert switch(a.url, "prefill", handover=True, drain=False).status_code == 200
    assert pd_request(a.url, b.url, PROMPTS[0], room=4343).status_code == 200
    r = switch(a.url, "null", drain=False)
    assert r.status_code == 200, r.text
    assert r.json()["current_mode"] == "null" and r.json()["epoch"] == epoch + 2 and "switched back" in r.json()["message"]
    assert t.is_alive(), "the handed-over answer should still be streaming"
    st = httpx.get(a.url + "/admin/disaggregation_status").json()
    assert st["transition_state"] == "IDLE" and st["current_mode"] == "null"
    assert gen(a.url, PROMPTS[2], 8).status_code == 200  # colocated again
    t.join(300)
    assert got == want
