"""Tool calling through the router on a 1P1D cluster (the router posts the body to both
servers; the decode server's API process makes the tool_calls) and after a runtime role
switch of both servers back to null."""

from __future__ import annotations

import concurrent.futures as cf
import sys

import httpx
import openai
import pytest

from servers import Server, free_port
from test_e2e_tools import FORCED, TOOLS, check_calls, create

pytestmark = pytest.mark.timeout(900)


def dynamic_server() -> Server:
    return Server("--enable-dynamic-disaggregation", "--disaggregation-transfer-backend", "tcp",
                  "--disaggregation-bootstrap-port", str(free_port()), "--torch-threads", "1",
                  "--chunked-prefill-size", "32", "--tool-call-parser", "hermes")


def set_role(router: Server, url: str, mode: str) -> None:
    r = httpx.post(router.url + "/admin/set_worker_role", json={"url": url, "mode": mode}, timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["mode"] == mode


def modes(router: Server) -> dict[str, str]:
    return {w["url"]: w["mode"] for w in httpx.get(router.url + "/workers", timeout=10).json()["workers"]}


@pytest.fixture(scope="module")
def cluster():
    with cf.ThreadPoolExecutor(2) as pool:  # started side by side: each takes a while to load
        futures = [pool.submit(dynamic_server) for _ in range(2)]
    servers = [f.result() for f in futures if f.exception() is None]
    if len(servers) < 2:
        for s in servers:
            s.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    rport = free_port()
    cmd = [sys.executable, "-m", "tidal.router", "--port", str(rport), "--worker", *(s.url for s in servers),
           "--policy", "round_robin", "--health-check-interval-secs", "1", "--max-retries", "3"]
    router = Server(cmd=cmd, port=rport)
    try:
        yield router, servers
    finally:
        router.stop()
        for s in servers:
            s.stop()


def tool_answers(client) -> list:
    """Named (whole), required (streamed) and auto with a call forced by a regex (both ways)."""
    named = {"type": "function", "function": {"name": "get_time"}}
    out = [create(client, False, tools=TOOLS, tool_choice=named),
           create(client, True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
           create(client, False, tools=TOOLS, extra_body={"regex": FORCED}),
           create(client, True, tools=TOOLS, extra_body={"regex": FORCED})]
    for msg, reason in out:
        assert reason == "tool_calls" and msg["content"] is None
        check_calls(msg["tool_calls"])
    assert [c["function"]["name"] for c in out[0][0]["tool_calls"]] == ["get_time"]
    assert len(out[1][0]["tool_calls"]) == 1
    for msg, _ in out[2:]:
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
            ("get_weather", '{"city": "Paris"}')]
    return [[(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] for m, _ in out]


def test_tool_calls_through_1p1d_and_across_a_role_switch(cluster):
    router, (a, b) = cluster
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    set_role(router, a.url, "prefill")
    set_role(router, b.url, "decode")
    assert modes(router) == {a.url: "prefill", b.url: "decode"}
    pd_answers = tool_answers(client)
    set_role(router, a.url, "null")  # the switch: both back to null, then through the router again
    set_role(router, b.url, "null")
    assert modes(router) == {a.url: "null", b.url: "null"}
    assert tool_answers(client) == pd_answers  # greedy: the same calls in PD as on null servers
    plain, reason = create(client, False, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert plain["tool_calls"] == [] and plain["content"] and reason == "length"
