"""The planner on real servers: 1 prefill + 2 decode tidal servers behind `tidal router
--planner sla`; long prompts under a profile where prefill is the bottleneck starve the
prefill pool, and the planner moves a decode server to a role that prefills while no request
fails. Prefill and null are both such roles: a null worker takes half the arrivals whole, which
loads each prefilling worker as a second prefill server would. Under this profile no layout meets
the SLOs (a prompt's prefill alone takes ~1 s), the planner ranks by how soon the backlog is worked
off, which puts the two close, and the snapshot of the moment picks one (a CI run saw null)."""

from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from servers import Server, Traffic, free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# prefill costs 10 ms per prompt token in this profile; decode is cheap: long prompts starve prefill
PROFILE = {
    "version": 1, "server": {"max_total_tokens": 8192},
    "prefill": [{"tokens": 1, "seconds": 0.01}, {"tokens": 1000, "seconds": 10.0}],
    "decode": [{"batch": b, "context_tokens": c, "step_seconds": 0.01 + 1e-4 * b} for b in (1, 64) for c in (0, 8192)],
    "kv_transfer": [], "switch": [],
}
PROMPTS = [f"Item {k}: " + "the quick brown fox jumps over the lazy dog. " * 8 for k in range(3)]


def server(mode: str) -> Server:
    return Server("--enable-dynamic-disaggregation", "--disaggregation-mode", mode,
                  "--disaggregation-transfer-backend", "tcp", "--disaggregation-bootstrap-port", str(free_port()),
                  "--torch-threads", "1")


def test_planner_moves_a_decode_server_to_the_starved_prefill_pool(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    servers = [server("prefill"), server("decode"), server("decode")]
    p, d1, d2 = servers
    router = None
    try:
        rport = free_port()
        prefill_port = httpx.get(p.url + "/server_info").json()["disaggregation_bootstrap_port"]
        cmd = [sys.executable, "-m", "tidal.router", "--port", str(rport), "--prefill", p.url, str(prefill_port),
               "--decode", d1.url, d2.url, "--health-check-interval-secs", "1", "--max-retries", "5",
               "--planner", "sla", "--ttft-slo-ms", "1000", "--tpot-slo-ms", "1000", "--planner-interval-s", "1",
               "--planner-cooldown-s", "2", "--planner-profile", str(profile)]
        router = Server(cmd=cmd, port=rport)
        body = {"sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
        reference = {t: httpx.post(router.url + "/generate", json={"text": t, **body}, timeout=120).json()["output_ids"]
                     for t in PROMPTS}
        moved = []
        with Traffic(router.url, reference, 4, threads=2) as traffic:
            deadline = time.time() + 40
            while time.time() < deadline and not moved:
                time.sleep(0.5)
                status = httpx.get(router.url + "/planner/status", timeout=10).json()
                moved = [x for x in status["decisions"] if x["kind"] == "move" and x["outcome"] == "ok"]
            time.sleep(2)  # traffic keeps flowing over the new layout
        assert moved, status["decisions"][:3]
        src, dst = moved[0]["src"], moved[0]["dst"]
        assert src == "decode" and dst in ("prefill", "null"), moved[0]["reason"]
        assert moved[0]["current"]["paths"]["pd"]["ttft_s"] > 1.0
        # the router's pools follow the moves that landed (the planner may walk on over the 2 s of traffic after
        # the first: a CI run moved the other prefill worker to null): each worker is where its newest move took it
        landed = [x for x in httpx.get(router.url + "/planner/status", timeout=10).json()["decisions"]
                  if x["kind"] == "move" and x["outcome"] == "ok"]  # newest first
        workers = {w["url"]: w["mode"] for w in httpx.get(router.url + "/workers").json()["workers"]}
        start = {p.url: "prefill", d1.url: "decode", d2.url: "decode"}
        for url, mode in workers.items():
            assert mode == next((x["dst"] for x in landed if x["url"] == url), start[url]), (workers, landed)
        assert traffic.failures == [] and traffic.mismatches == [] and traffic.ok > 5
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
