"""PD across two hosts for real (issue 66, part 5): the prefill and decode servers run in network namespaces of
their own, joined by veth links through a bridge (tests/netns.py), each listening on its host's address only;
the router runs here and reaches both over the bridge, and the KV goes host to host.

- tcp and mooncake (when installed) across the link: outputs equal the decode server's own local prefill token
  for token, clean and under packet loss (nftables) and delay (tc netem, where the kernel has it) or a bandwidth
  cap (tc tbf);
- the link between prefill and decode cut mid-transfer: both sides free everything within their timeouts, the
  router retries on another decode host, and every pool is intact afterwards.

Skipped, with the reason, where network namespaces cannot be made (not root, no `ip`)."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import time
from typing import Optional

import httpx
import pytest

import netns
from router_server import RouterServer
from servers import Server, assert_idle_and_intact, free_port

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

ARGS = ["--torch-threads", "1", "--chunked-prefill-size", "64", "--enable-integrity-check"]
# the waiting timeout counts from the decode's pre-allocation, the prompt's prefill included: longer than that
FAST_TIMEOUTS = {"TIDAL_DISAGG_BOOTSTRAP_TIMEOUT": "5", "TIDAL_DISAGG_WAITING_TIMEOUT": "10"}
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in float32: layers x (K, V) x KV heads x head dim x 4 B
PROMPTS = ["The capital of France is", "List three colours of the sea:", "def fibonacci(n):",
           "Once upon a time, in a quiet village by the river,"]
MAX_NEW = 12

BACKENDS = ["tcp", pytest.param("mooncake", marks=pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="mooncake not installed"))]


@pytest.fixture(scope="module")
def net():
    with netns.Network(3) as n:
        yield n


def serve(host: netns.Host, mode: str, backend: str, bport: Optional[int] = None, env: Optional[dict] = None,
          ) -> Server:
    extra = [*ARGS, "--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
    if bport is not None:
        extra += ["--disaggregation-bootstrap-port", str(bport)]
    return Server(*extra, host=host.addr, prefix=host.exec_prefix(), env=env)


def start_all(*makers):
    """Start servers at once (their model loads overlap); stop the started ones if any fails."""
    with cf.ThreadPoolExecutor(len(makers)) as pool:
        futures = [pool.submit(m) for m in makers]
        servers, error = [], None
        for f in futures:
            try:
                servers.append(f.result())
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others are stopped
                error = e
    if error is not None:
        for s in servers:
            s.stop()
        raise error
    return servers


def greedy(url: str, prompt: str, **fields) -> list[int]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
            **fields}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def kv_bytes(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tidal:kv_transfer_bytes"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_across_two_hosts_equals_the_local_prefill_clean_and_impaired(net, backend):
    hp, hd = net.hosts[0], net.hosts[1]
    bport = free_port()
    prefill, decode = start_all(lambda: serve(hp, "prefill", backend, bport), lambda: serve(hd, "decode", backend))
    try:
        reference = {p: greedy(decode.url, p) for p in PROMPTS}  # no bootstrap fields: decode prefills itself
        with RouterServer(prefill=[(prefill.url, bport)], decode=[decode.url]) as router:
            assert {w.host for w in router.state.registry.all()} == {hp.addr, hd.addr}
            for p in PROMPTS:
                assert greedy(router.url, p) == reference[p], p
            moved = kv_bytes(decode.url)
            assert moved > 0, "the KV crossed the link"
            if netns.has_nft():
                hp.loss(3)
                hd.loss(3)
            if netns.has_netem():
                hp.delay(20)
            else:
                hp.rate(200)  # no netem in this kernel: a bandwidth cap instead of a delay
            try:
                for p in PROMPTS:
                    assert greedy(router.url, p) == reference[p], f"{p} (impaired link)"
            finally:
                hp.heal()
                hd.heal()
            assert kv_bytes(decode.url) > moved
        for s in (prefill, decode):
            assert_idle_and_intact(s.url)
    finally:
        decode.stop()
        prefill.stop()


@pytest.mark.skipif(not netns.has_nft(), reason="the link cut needs nftables (nft)")
def test_a_link_cut_mid_transfer_frees_both_sides_and_the_router_retries_on_another_host(net):
    hp, hd, hd2 = net.hosts
    bport = free_port()
    prefill, cut_decode, other_decode = start_all(
        lambda: serve(hp, "prefill", "tcp", bport, env=FAST_TIMEOUTS),
        lambda: serve(hd, "decode", "tcp", env=FAST_TIMEOUTS),
        lambda: serve(hd2, "decode", "tcp", env=FAST_TIMEOUTS))
    try:
        prompt = "Tell me about the sea. " + " ".join(["waves"] * 500)  # ~8 chunks of 64, sent as each is done
        prompt_tokens = len(httpx.post(other_decode.url + "/tokenize", json={"prompt": prompt}).json()["tokens"])
        reference = greedy(other_decode.url, prompt)
        # round robin takes the URLs in order: the cut host (.2) first, the retry the other one (.3)
        with RouterServer(prefill=[(prefill.url, bport)], decode=[cut_decode.url, other_decode.url],
                          decode_policy="round_robin", prefill_policy="round_robin") as router:
            with cf.ThreadPoolExecutor(1) as pool:
                started = time.time()
                answer = pool.submit(greedy, router.url, prompt)
                deadline = time.time() + 30
                while kv_bytes(prefill.url) == 0 and time.time() < deadline:  # the first chunks have gone
                    time.sleep(0.05)
                sent_at_cut = kv_bytes(prefill.url)
                hp.cut_from(hd)
                assert 0 < sent_at_cut < prompt_tokens * KV_BYTES_PER_TOKEN, "cut mid-transfer"
                try:
                    out = answer.result(timeout=120)
                finally:
                    hp.heal()
            elapsed = time.time() - started
            assert out == reference
            failed = httpx.get(cut_decode.url + "/metrics", timeout=10).text
            assert any(line.startswith("tidal:kv_failed_transfers") and not line.endswith(" 0.0")
                       for line in failed.splitlines()), "the cut decode side failed its transfer"
            assert elapsed < 60, elapsed
            for s in (prefill, cut_decode, other_decode):
                assert_idle_and_intact(s.url, timeout=15)  # freed within the timeouts (and the abort grace)
            assert greedy(router.url, PROMPTS[0]) == greedy(other_decode.url, PROMPTS[0])  # healed: serves again
    finally:
        for s in (other_decode, cut_decode, prefill):
            s.stop()
