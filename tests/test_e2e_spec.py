"""Speculative decoding (NGRAM) on the real model: greedy tokens identical to a server
without it, in null mode, as the decode server of a 1P1D pair with real KV transfer, and
after a runtime switch; guesses are made and kept; lengths, stops and logprobs exact; a
seeded sampled request repeats itself; pools intact."""

from __future__ import annotations

import concurrent.futures as cf
import random

import httpx
import pytest

from servers import Server, all_ready, assert_idle_and_intact, free_port

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
    ref, spec = all_ready(
        Server("--torch-threads", "1", "--enable-dynamic-disaggregation", "--disaggregation-transfer-backend",
               "tcp", "--disaggregation-bootstrap-port", str(bport), wait=False),
        Server("--torch-threads", "1", *SPEC, "--disaggregation-mode", "decode", "--enable-dynamic-disaggregation",
               "--disaggregation-transfer-backend", "tcp", "--enable-integrity-check", wait=False))
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
                                                        "--speculative-num-draft-tokens", "0"],
                ["--speculative-algorithm", "STANDALONE"]):
        r = subprocess.run([sys.executable, "-m", "tidal.launch_server", *bad], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and "speculative" in (r.stderr + r.stdout)


# ---------------------------------------------------------------- a draft model (STANDALONE)


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """Two servers speculating with a draft model, the default model's first 4 layers made here
    (tidal.spec.truncated_draft: no package ships a smaller model of its tokenizer): a switchable
    null server and a switchable decode server."""
    from tidal.config import default_model_path
    from tidal.spec.truncated_draft import truncate_gguf

    draft = truncate_gguf(default_model_path(), str(tmp_path_factory.mktemp("draft") / "draft4.gguf"), 4)
    flags = ("--torch-threads", "1", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
             draft, "--speculative-num-steps", "3", "--enable-dynamic-disaggregation",
             "--disaggregation-transfer-backend", "tcp", "--enable-integrity-check")
    bport = free_port()
    a, b = all_ready(Server(*flags, "--disaggregation-bootstrap-port", str(bport), wait=False),
                     Server(*flags, "--disaggregation-mode", "decode", wait=False))
    a.bport = bport
    yield a, b
    for s in (b, a):
        s.stop()


def test_a_draft_model_speculates_in_null_and_through_pd_and_equals_null(drafted, reference):
    a, b = drafted
    with cf.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: gen(a.url, p)["output_ids"], PROMPTS))
    assert outs == [reference[p] for p in PROMPTS]
    assert spec_stats(a.url)["spec_draft_tokens"] > 0
    switch(a.url, "prefill")  # switched: its draft's KV of each prompt goes to b with the target's
    try:
        for p in PROMPTS:
            assert pd_gen(a, b, p) == reference[p]
    finally:
        switch(a.url, "null")
    assert spec_stats(b.url)["spec_draft_tokens"] > 0
    for s in (a, b):
        assert_idle_and_intact(s.url)


def test_a_decode_server_with_a_draft_refuses_a_prefill_without_one(servers, drafted):
    ref, _, _ = servers
    _, b = drafted
    switch(ref.url, "prefill")
    try:
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": ref.bport, "bootstrap_room": random.randrange(2**63)}
        with cf.ThreadPoolExecutor(2) as pool:
            fp = pool.submit(httpx.post, ref.url + "/generate", json={"text": PROMPTS[2], "sampling_params": {
                "max_new_tokens": 4}, **fields}, timeout=120)
            fd = pool.submit(httpx.post, b.url + "/generate", json={"text": PROMPTS[2], "sampling_params": {
                "max_new_tokens": 4}, **fields}, timeout=120)
            rd = fd.result()
            fp.result()
        assert rd.status_code >= 400 and "draft_layers" in rd.text, rd.text
    finally:
        switch(ref.url, "null")
    assert_idle_and_intact(b.url)
