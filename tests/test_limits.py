"""Bounded input (issue 8, items 3 and 5): body size, n, top logprobs, prompts per
request, stop strings, seeds, unsupported fields; and a huge prompt that must not stall
the event loop.

Most tests run against one server with the fake scheduler (tests/fake_scheduler.py) and
the default limits; the event-loop test and the tiny-temperature one use a real server.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from fake_scheduler import cached_tokenizer_dir
from servers import Server
from test_server_api import FakeServer

pytestmark = pytest.mark.timeout(300)

MiB = 1024 * 1024
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url():
    cached_tokenizer_dir()
    server = FakeServer().wait_ready()
    try:
        yield server.url
    finally:
        server.stop()


def post(url: str, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def assert_400(r: httpx.Response, *words: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    for w in words:
        assert w in err["message"], err["message"]
    return err["message"]


# ---------------------------------------------------------------- body size


def test_body_over_8_mib_is_413_before_parsing(url):
    huge = b'{"text": "' + b"a" * (16 * MiB) + b'"}'
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", content=huge, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == 413 and "--max-request-body-bytes" in err["message"]
    assert time.monotonic() - t0 < 20
    not_json = b"{" * (8 * MiB + 1)  # parsing it would be a 400; the size is checked first
    r = httpx.post(url + "/v1/completions", content=not_json, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:300]


def test_chunked_body_is_counted_and_cut_at_the_limit(url):
    sent = [0]

    def chunks(total: int):
        yield b'{"input_ids": [1], "pad": "'
        while sent[0] < total:
            sent[0] += 64 * 1024
            yield b"a" * (64 * 1024)
        yield b'", "sampling_params": {"max_new_tokens": 1}}'

    r = httpx.post(url + "/generate", content=chunks(12 * MiB), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == 413
    sent[0] = 0
    small = httpx.post(url + "/generate", content=chunks(64 * 1024), timeout=60)  # chunked, under the limit
    assert small.status_code == 200, small.text[:300]


def test_body_just_under_the_limit_is_parsed(url):
    body = b'{"input_ids": [1], "pad": "' + b"x" * (8 * MiB - 100) + b'", "sampling_params": {"max_new_tokens": 1}}'
    assert len(body) <= 8 * MiB
    r = httpx.post(url + "/generate", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:300]


# ---------------------------------------------------------------- counts


def test_n_is_bounded(url):
    assert_400(post(url, "/generate", {"text": "hi", "sampling_params": {"n": 65, "max_new_tokens": 1}}), "--max-n")
    assert_400(post(url, "/v1/completions", {"prompt": "hi", "n": 65, "max_tokens": 1}), "--max-n")
    assert_400(post(url, CHAT, {"messages": MSGS, "n": 65, "max_tokens": 1}), "--max-n")
    r = post(url, "/generate", {"text": "hi", "sampling_params": {"n": 64, "max_new_tokens": 1}})
    assert r.status_code == 200 and len(r.json()) == 64


def test_top_logprobs_are_bounded(url):
    native = {"text": "hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    assert_400(post(url, "/generate", {**native, "top_logprobs_num": 21}), "--max-logprobs")
    assert_400(post(url, "/generate", {**native, "top_logprobs_num": 10**30}), "--max-logprobs")
    assert post(url, "/generate", {**native, "top_logprobs_num": 20}).status_code == 200
    assert_400(post(url, "/v1/completions", {"prompt": "hi", "logprobs": 21, "max_tokens": 1}), "--max-logprobs")
    assert_400(post(url, CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21, "max_tokens": 1}),
               "--max-logprobs")


def test_prompts_per_request_are_bounded_before_tokenizing(url):
    many = ["a " * 2000] * 257
    t0 = time.monotonic()
    assert_400(post(url, "/generate", {"text": many}), "257 prompts", "--max-batch-size-per-request")
    assert time.monotonic() - t0 < 5
    assert_400(post(url, "/generate", {"input_ids": [[1]] * 257}), "--max-batch-size-per-request")
    assert_400(post(url, "/v1/completions", {"prompt": ["x"] * 257, "max_tokens": 1}), "--max-batch-size-per-request")
    assert_400(post(url, "/v1/completions", {"prompt": [[1]] * 257, "max_tokens": 1}), "--max-batch-size-per-request")
    r = post(url, "/generate", {"input_ids": [[1]] * 256, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and len(r.json()) == 256


def test_stop_strings_are_bounded(url):
    sp = {"max_new_tokens": 1}
    assert_400(post(url, "/generate", {"text": "hi", "sampling_params": {**sp, "stop": ["x"] * 33}}),
               "--max-stop-strings")
    assert_400(post(url, "/generate", {"text": "hi", "sampling_params": {**sp, "stop": "y" * 1025}}),
               "--max-stop-string-chars")
    assert_400(post(url, "/v1/completions", {"prompt": "hi", "stop": ["x"] * 33}), "--max-stop-strings")
    assert_400(post(url, CHAT, {"messages": MSGS, "stop": ["z" * 2000]}), "--max-stop-string-chars")
    assert post(url, "/generate", {"text": "hi", "sampling_params": {**sp, "stop": ["x"] * 32}}).status_code == 200


# ---------------------------------------------------------------- seeds and stuck rids


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
def test_seed_outside_64_bits_is_400_and_the_rid_stays_free(url, seed):
    rid = f"seed-rid-{seed}"
    body = {"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 1, "seed": seed, "temperature": 0.8}}
    assert_400(post(url, "/generate", body), "seed")
    assert_400(post(url, "/v1/completions", {"prompt": "hi", "seed": seed, "rid": rid + "-oai"}), "seed")
    ok = post(url, "/generate", {"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 1, "seed": 7}})
    assert ok.status_code == 200, ok.text
    assert ok.json()["meta_info"]["id"] == rid


def test_edge_seeds_with_n_do_not_overflow(url):
    for seed in (2**64 - 1, -(2**63)):
        body = {"text": "hi", "rid": f"edge-{seed}", "sampling_params": {"max_new_tokens": 1, "seed": seed, "n": 3}}
        r = post(url, "/generate", body)
        assert r.status_code == 200, r.text
        r = post(url, "/v1/completions", {"prompt": "hi", "seed": seed, "n": 3, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_no_int_field_can_leave_a_rid_stuck(url):
    rid = "huge-top-k"
    body = {"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 1, "top_k": 2**70}}
    for _ in range(2):  # the same rid twice: the first one must not stay registered
        r = post(url, "/generate", body)
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------- unsupported fields


@pytest.mark.parametrize("key,value,needle", [
    ("regex", "a(", "unclosed group"), ("json_schema", '{"type": "objekt"}', "objekt"),
    ("ebnf", "root ::= x", "x"), ("json_schema", {"type": "objekt"}, "objekt"), ("structural_tag", "{}", "structures"),
])
def test_invalid_grammars_are_400(url, key, value, needle):
    assert_400(post(url, "/generate", {"text": "hi", "sampling_params": {key: value}}), key, needle)
    assert_400(post(url, "/v1/completions", {"prompt": "hi", key: value}), key, needle)
    assert_400(post(url, CHAT, {"messages": MSGS, key: value}), key, needle)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "yaml"}},
    {"functions": [{"name": "f", "parameters": {}}]},
])
def test_unsupported_openai_output_fields_are_refused(url, extra):
    assert_400(post(url, CHAT, {"messages": MSGS, **extra}), "not supported")


def test_plain_text_format_and_no_tools_are_accepted(url):
    body = {"messages": MSGS, "max_tokens": 1, "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "none"}
    assert post(url, CHAT, body).status_code == 200
    assert post(url, CHAT, {**body, "tool_choice": "auto"}).status_code == 200
    ok = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "regex": None, "json_schema": None}}
    assert post(url, "/generate", ok).status_code == 200


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def real():
    server = Server("--max-request-body-bytes", str(64 * MiB), "--max-n", "2")
    try:
        yield server.url
    finally:
        server.stop()


def health_latencies_during(url: str, path: str, body: dict) -> tuple[httpx.Response, list[float]]:
    """Post `body` in a thread while polling /health every 100 ms; (its response, the polls' latencies)."""
    result: dict = {}
    sender = threading.Thread(target=lambda: result.update(r=httpx.post(url + path, json=body, timeout=120)))
    latencies = []
    with httpx.Client(timeout=10) as client:
        sender.start()
        while sender.is_alive():
            t0 = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.1)
    sender.join()
    return result["r"], latencies


def test_huge_prompt_does_not_stall_other_clients(real):
    huge = ("The quick brown fox jumps over the lazy dog. " * 400_000)[: 16 * MiB]
    t0 = time.monotonic()
    r, latencies = health_latencies_during(real, "/generate", {"text": huge})
    assert_400(r, "maximum input length")  # certainly too long: refused before tokenizing
    assert time.monotonic() - t0 < 10
    assert max(latencies, default=0) < 1.0, latencies
    print(f"16 MiB prompt refused in {time.monotonic() - t0:.2f}s; /health max {max(latencies, default=0):.3f}s")
    # under that bound the server tokenizes, in a worker thread, then refuses by the exact count
    medium = "Hello world, " * 40_000  # 520k characters, 120k tokens: about a second to tokenize
    for path, body in (("/generate", {"text": [medium] * 8}), ("/v1/completions", {"prompt": medium}),
                       (CHAT, {"messages": [{"role": "user", "content": medium}]})):
        r, latencies = health_latencies_during(real, path, body)
        assert_400(r, "tokens)")
        assert latencies and max(latencies) < 1.0, (path, latencies)
        print(f"{path}: {len(latencies)} /health polls, max {max(latencies):.3f}s")


def test_tiny_temperature_equals_greedy_through_the_engine(real):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    for p in prompts:
        sp = {"max_new_tokens": 12, "ignore_eos": True}
        greedy = post(real, "/generate", {"text": p, "sampling_params": {**sp, "temperature": 0.0}}).json()
        for t in (1e-300, 1e-7):
            tiny = post(real, "/generate", {"text": p, "sampling_params": {**sp, "temperature": t}}).json()
            assert tiny["output_ids"] == greedy["output_ids"], (p, t)


def test_limit_flags_change_the_limits(real):
    assert_400(post(real, "/generate", {"text": "hi", "sampling_params": {"n": 3, "max_new_tokens": 1}}), "limit is 2")
    assert post(real, "/generate", {"text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 1}}).status_code == 200


# ---------------------------------------------------------------- the text-length bound


def test_chars_per_token_bound_is_sound_for_the_default_tokenizer():
    from transformers import AutoTokenizer

    from tidal.server.limits import max_chars_per_token

    tok = AutoTokenizer.from_pretrained(cached_tokenizer_dir())
    bound = max_chars_per_token(tok)
    assert bound is not None and 1 < bound < 200
    assert max(len(tok.decode([i]).encode()) for i in range(len(tok))) <= bound
    texts = [" " * 5000, "\n" * 3000 + "x", "<|im_start|>" * 50, "é漢字🙂" * 300, "a" * 4000, "\t \n" * 900]
    for text in texts:
        assert len(text) <= bound * len(tok.encode(text)), text[:20]
    assert max_chars_per_token(object()) is None
