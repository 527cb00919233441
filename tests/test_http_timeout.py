"""Slowloris: the server and the router close a connection whose request does not arrive
whole within --http-read-timeout-secs; normal and long streaming requests are untouched."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fake_scheduler import cached_tokenizer_dir, default_gguf_path
from servers import Server, free_port

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 2.0
HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\nAccept: */*\r\nX-Pad: " + b"a" * 64


@pytest.fixture(scope="module")
def server():
    port = free_port()
    cmd = [sys.executable, "tests/fake_scheduler.py", "--model-path", default_gguf_path(),
           "--tokenizer-path", cached_tokenizer_dir(), "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--http-read-timeout-secs", str(TIMEOUT_S)]
    s = Server(cmd=cmd, port=port, env={"TIDAL_FAKE_STEP_S": "0.05"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def router():
    port = free_port()
    cmd = [sys.executable, "-m", "tidal.router", "--host", "127.0.0.1", "--port", str(port),
           "--http-read-timeout-secs", str(TIMEOUT_S), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:  # no workers: /health answers 503, which is enough
            assert proc.poll() is None and time.time() < deadline, "the router did not start"
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def seconds_until_closed(port: int, dribble: bytes, every_s: float = 0.5, limit_s: float = 15.0) -> float:
    """Send `dribble` one byte every `every_s`; seconds until the server closes the socket."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(every_s)
        for i in range(int(limit_s / every_s)):
            try:
                if i < len(dribble):
                    sock.sendall(dribble[i:i + 1])
                if sock.recv(4096) == b"":
                    return time.monotonic() - t0
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
    return float("inf")


@pytest.mark.parametrize("dribble", [HEAD, b""], ids=["header-bytes-every-0.5s", "sends-nothing"])
def test_server_closes_slow_connections(server, dribble):
    took = seconds_until_closed(server.port, dribble)
    assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 3, took


def test_router_closes_slow_connections(router):
    took = seconds_until_closed(router, HEAD)
    assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 3, took


def test_normal_requests_and_long_streams_are_not_cut(server):
    with httpx.Client(timeout=30) as c:
        assert c.get(server.url + "/health").status_code == 200
        time.sleep(1)  # idle on the same keep-alive connection, then another request
        assert c.get(server.url + "/health").status_code == 200
        body = {"input_ids": [1, 2, 3], "stream": True,
                "sampling_params": {"max_new_tokens": 80, "temperature": 0.0, "ignore_eos": True}}
        t0, last = time.monotonic(), None
        with c.stream("POST", server.url + "/generate", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
        assert time.monotonic() - t0 > TIMEOUT_S  # the response outlived the read timeout
        assert last["meta_info"]["completion_tokens"] == 80
