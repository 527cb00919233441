"""The bootstrap server: routes, status codes, port handling, start/stop cycles."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading

import pytest

from tidal.transfer.bootstrap import BootstrapServer

pytestmark = pytest.mark.timeout(60)

REG = {
    "role": "Prefill", "rank_ip": "127.0.0.1", "rank_port": 40000, "engine_rank": 0,
    "tp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16, "kv_dtype": "bfloat16", "prefill_id": "p-1",
}


def call(port: int, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, {"text": text.decode()}


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", 0)
    s.start()
    yield s
    s.stop()


TOPO = "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"
RANK0 = "/route?engine_rank=0&target_dp_group=0&target_pp_rank=0"


def test_register_then_lookup(server):
    assert call(server.port, "PUT", "/route", REG) == (200, {"status": "ok"})
    status, topo = call(server.port, "GET", TOPO)
    assert status == 200
    assert topo == {"prefill_attn_tp_size": 1, "prefill_dp_size": 1, "prefill_pp_size": 1,
                    "prefill_page_size": 16, "prefill_kv_dtype": "bfloat16"}
    status, rank = call(server.port, "GET", RANK0)
    assert status == 200 and rank["rank_ip"] == "127.0.0.1" and rank["rank_port"] == 40000
    assert rank["prefill_id"] == "p-1"
    assert server.prefill_ids() == ["p-1"]


def test_unregistered_is_503_and_unknown_rank_404(server):
    assert call(server.port, "GET", TOPO)[0] == 503
    assert call(server.port, "GET", RANK0)[0] == 503
    call(server.port, "PUT", "/route", REG)
    assert call(server.port, "GET", "/route?engine_rank=3&target_dp_group=0&target_pp_rank=0")[0] == 404


@pytest.mark.parametrize("body", [
    {k: v for k, v in REG.items() if k != "rank_port"},
    {**REG, "rank_port": "40000"},
    {**REG, "role": "Decode"},
    {**REG, "engine_rank": 2, "tp_size": 2},
    {**REG, "page_size": 0},
    {**REG, "tp_size": True},
    [1, 2, 3],
])
def test_malformed_registration_is_400(server, body):
    status, resp = call(server.port, "PUT", "/route", body)
    assert status == 400 and resp["error"]


def test_non_json_registration_is_400(server):
    assert call(server.port, "PUT", "/route", raw=b"{not json")[0] == 400
    assert call(server.port, "PUT", "/route", raw=b"")[0] == 400


@pytest.mark.parametrize("query", ["/route", "/route?engine_rank=x&target_dp_group=0&target_pp_rank=0",
                                   "/route?engine_rank=0&target_dp_group=0"])
def test_bad_query_is_400(server, query):
    call(server.port, "PUT", "/route", REG)
    assert call(server.port, "GET", query)[0] == 400


def test_deregister(server):
    call(server.port, "PUT", "/route", REG)
    assert call(server.port, "DELETE", RANK0 + "&prefill_id=other")[0] == 404
    assert call(server.port, "DELETE", RANK0 + "&prefill_id=p-1")[0] == 200
    assert call(server.port, "GET", TOPO)[0] == 503


def test_health_and_heartbeat(server):
    status, health = call(server.port, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["prefill_ranks"] == 0
    call(server.port, "PUT", "/route", REG)
    status, resp = call(server.port, "POST", "/heartbeat", {"decode_id": "d-1", "endpoint": "tcp://x:1"})
    assert status == 200 and resp["prefill_ids"] == ["p-1"]
    peers = server.decode_peers()
    assert set(peers) == {"d-1"} and peers["d-1"]["endpoint"] == "tcp://x:1" and peers["d-1"]["last_seen"] > 0
    assert call(server.port, "POST", "/heartbeat", {"endpoint": "x"})[0] == 400
    assert call(server.port, "POST", "/heartbeat", raw=b"nope")[0] == 400
    assert call(server.port, "GET", "/health")[1]["decode_peers"] == 1


def test_port_in_use_is_a_clear_error(server):
    other = BootstrapServer("127.0.0.1", server.port)
    with pytest.raises(RuntimeError, match="already in use"):
        other.start()
    other.stop()  # harmless after a failed start
    assert call(server.port, "GET", "/health")[0] == 200


def test_port_held_by_plain_socket():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        with pytest.raises(RuntimeError, match="in use"):
            BootstrapServer("127.0.0.1", sock.getsockname()[1]).start()
    finally:
        sock.close()


def _counts() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def test_start_stop_cycles_release_the_port():
    first = BootstrapServer("127.0.0.1", 0)
    first.start()
    port = first.port
    first.stop()
    before = _counts()
    for i in range(50):
        s = BootstrapServer("127.0.0.1", port)
        s.start()
        if i % 10 == 0:
            assert call(port, "GET", "/health")[0] == 200
        s.stop()
        s.stop()  # idempotent
    assert _counts() == before
    probe = socket.socket()  # really released: a plain listener can take it
    probe.bind(("127.0.0.1", port))
    probe.listen()
    probe.close()
