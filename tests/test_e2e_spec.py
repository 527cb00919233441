"""Speculative decoding (NGRAM) on the real model: greedy tokens identical to a server
without it, in null mode, as the decode server of a 1P1D pair with real KV transfer, and
after a runtime switch; guesses are made and kept; lengths, stops and logprobs exact; a
seeded sampled request repeats itself; pools intact."""

from __future__ import annotations

import concurrent.futures as cf
import random

import httpx
import pytest

from servers import Server, assert_idle_and_intact, free_port

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
]
N = 40
SPEC = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")


def gen(url: str, text: str, n: int = N, **fields) -> dict:
    sampling = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **fields.pop("sampling", {})}
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": sampling, **fields}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def servers():
    """A plain server (the null reference, and the prefill of the PD test) and a speculating
    decode server; both may switch. (ref, prefill, spec): ref and prefill are one server."""
    bport = free_port()
    ref = Server("--torch-threads", "1", "--enable-dynamic-disaggregation", "--disaggregation-transfer-backend",
                 "tcp", "--disaggregation-bootstrap-port", str(bport))
    spec = Server("--torch-threads", "1", *SPEC, "--disaggregation-mode", "decode", "--enable-dynamic-disaggregation",
                  "--disaggregation-transfer-backend", "tcp", "--enable-integrity-check")
    ref.bport = bport
    yield ref, ref, spec
    for s in (spec, ref):
        s.stop()


@pytest.fixture(scope="module")
def reference(servers):
    ref, _, _ = servers
    return {p: gen(ref.url, p)["output_ids"] for p in PROMPTS}


def pd_gen(prefill: Server, decode: Server, text: str) -> list[int]:
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bport, "bootstrap_room": random.randrange(2**63)}
    with cf.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(gen, prefill.url, text, N, **fields)
        fd = pool.submit(gen, decode.url, text, N, **fields)
        fp.result()
        return fd.result()["output_ids"]


def spec_stats(url: str) -> dict:
    info = httpx.get(url + "/server_info", timeout=30).json()
    return info["internal_states"][0]


def switch(url: str, mode: str) -> None:
    r = httpx.post(url + "/admin/switch_disaggregation_mode", json={"mode": mode}, timeout=120)
    assert r.status_code == 200, r.text


def test_pd_with_a_speculating_decode_equals_null(servers, reference):
    _, prefill, spec = servers
    switch(prefill.url, "prefill")
    try:
        for p in PROMPTS:
            assert pd_gen(prefill, spec, p) == reference[p]
    finally:
        switch(prefill.url, "null")  # the reference again
    st = spec_stats(spec.url)
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] > 0
    assert st["spec_accept_length"] > 1.2, st


def test_switched_to_null_it_still_speculates_and_equals_null(servers, reference):
    _, _, spec = servers
    switch(spec.url, "null")
    before = spec_stats(spec.url)["spec_accepted_tokens"]
    with cf.ThreadPoolExecutor(3) as pool:  # one batch: guesses of several requests verified together
        outs = list(pool.map(lambda p: gen(spec.url, p)["output_ids"], PROMPTS))
    assert outs == [reference[p] for p in PROMPTS]
    assert spec_stats(spec.url)["spec_accepted_tokens"] > before


def test_lengths_stops_and_logprobs_are_exact(servers, reference):
    ref, _, spec = servers
    if spec_stats(spec.url)["disaggregation_mode"] != "null":
        switch(spec.url, "null")
    p = PROMPTS[0]
    for n in (1, 2, 7):  # a guess never runs past max_new_tokens
        out = gen(spec.url, p, n)
        assert out["output_ids"] == reference[p][:n] and out["meta_info"]["completion_tokens"] == n
    stop = {"sampling": {"stop": ["cherry"], "ignore_eos": False}}
    a, b = gen(ref.url, p, **stop), gen(spec.url, p, **stop)
    assert a["text"] == b["text"] and a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
    a = gen(ref.url, p, 12, return_logprob=True)["meta_info"]["output_token_logprobs"]
    b = gen(spec.url, p, 12, return_logprob=True)["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in a] == [t[1] for t in b]
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-3  # the verification pass is an extend, not a decode


def test_a_seeded_sampled_request_repeats_itself(servers):
    _, _, spec = servers
    if spec_stats(spec.url)["disaggregation_mode"] != "null":
        switch(spec.url, "null")
    sampling = {"sampling": {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 7}}
    outs = [gen(spec.url, PROMPTS[1], 24, **sampling)["output_ids"] for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 24
    assert_idle_and_intact(spec.url)


def test_bad_speculative_flags_fail_at_start():
    import subprocess
    import sys

    for bad in (["--speculative-algorithm", "EAGLE9"], ["--speculative-algorithm", "NGRAM",
                                                        "--speculative-num-draft-tokens", "0"]):
        r = subprocess.run([sys.executable, "-m", "tidal.launch_server", *bad], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and "speculative" in (r.stderr + r.stdout)
