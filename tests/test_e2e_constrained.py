"""Constrained decoding end to end on the default model: outputs parse and validate against
their schema (greedy and sampled, batched with unconstrained requests), the openai client's
response_format, 400s for bad grammars, a 1P1D cluster equal to null mode token for token
(the prefill side draws the first token under the grammar, the decode side resumes from it),
and constrained traffic across runtime role switches."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import sys
import time

import httpx
import jsonschema
import openai
import pytest

from servers import Server, Traffic, all_ready, free_port, free_port_block

pytestmark = pytest.mark.timeout(900)

SERVER_ARGS = ["--max-total-tokens", "8192", "--dtype", "float32", "--chunked-prefill-size", "16"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]},
                                      "population_millions": {"type": "number"},
                                      "capital": {"type": "boolean"}},
     "required": ["city", "capital"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "maxItems": 3},
                                      "meta": {"type": "object", "properties": {"pages": {"type": "integer"}},
                                               "required": ["pages"], "additionalProperties": False}},
     "required": ["title", "tags", "meta"], "additionalProperties": False},
]
PROMPTS = ["Describe a person as JSON:", "A city as JSON:", "Some fruit names as a JSON list:",
           "A book record in JSON:"]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
EBNF = 'root ::= answer "." \nanswer ::= "yes" | "no" | "maybe"'
CONSTRAINED = [  # (prompt, sampling params) whose outputs are checked, and compared across modes
    *[(p, {"json_schema": json.dumps(s)}) for p, s in zip(PROMPTS, SCHEMAS)],
    ("Call me at", {"regex": PHONE}),
    ("Is the sky blue? Answer:", {"ebnf": EBNF}),
]


def generate(url: str, text, sampling: dict, n: int = 96) -> dict | list:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, **sampling}}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def check(text: str, sampling: dict) -> None:
    if "json_schema" in sampling:
        jsonschema.validate(json.loads(text), json.loads(sampling["json_schema"]))
    elif "regex" in sampling:
        assert re.fullmatch(sampling["regex"], text), text
    else:
        assert text in ("yes.", "no.", "maybe."), text


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_ARGS, "--torch-threads", "1")
    yield s
    s.stop()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_validate_greedy_and_sampled_batched(server, temperature):
    # one /generate batch: every constrained kind, run side by side
    texts = [p for p, _ in CONSTRAINED]
    body = {"text": texts, "sampling_params": [{"max_new_tokens": 96, "temperature": temperature, "seed": i, **sp}
                                               for i, (_, sp) in enumerate(CONSTRAINED)]}
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    for out, (_, sp) in zip(r.json(), CONSTRAINED):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        check(out["text"], sp)


def test_unconstrained_neighbours_are_unchanged(server):
    plain = ["The capital of France is", "def add(a, b):"]
    alone = [generate(server.url, p, {"ignore_eos": True}, 24)["output_ids"] for p in plain]
    jobs = [(p, {"ignore_eos": True}, 24) for p in plain] + [(p, sp, 96) for p, sp in CONSTRAINED]
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        outs = list(ex.map(lambda j: generate(server.url, *j), jobs))
    assert [o["output_ids"] for o in outs[:2]] == alone
    for out, (_, sp) in zip(outs[2:], CONSTRAINED):
        check(out["text"], sp)


def test_openai_response_format(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    schema = SCHEMAS[0]
    messages = [{"role": "user", "content": "Give me a person named Ada, aged 36, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=64, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = client.chat.completions.create(model="default", messages=messages, max_tokens=64, temperature=0,
                                            response_format=fmt, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content
    obj = client.chat.completions.create(model="default", messages=messages, max_tokens=64, temperature=0.7,
                                         seed=3, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    done = client.completions.create(model="default", prompt="Call me at", max_tokens=32, temperature=0,
                                     extra_body={"regex": PHONE})
    assert re.fullmatch(PHONE, done.choices[0].text)


@pytest.mark.parametrize("extra,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "objekt"),
    ({"extra_body": {"regex": "a(b"}}, "unclosed group"),
    ({"extra_body": {"ebnf": "root ::= nowhere"}}, "nowhere"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}}, "cannot be combined"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
])
def test_bad_grammars_are_400(server, extra, needle):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match=re.escape(needle)):
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       **extra)
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {"regex": "[", "max_new_tokens": 4}})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}})
    assert r.status_code == 400 and "only one of" in r.json()["error"]["message"]


def test_pd_cluster_equals_null_mode_token_for_token(server):
    port, base, bport = free_port(), free_port_block(4), free_port()
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "1", "--decode", "1",
           "--disaggregation-transfer-backend", "tcp", "--port", str(port), "--base-port", str(base),
           "--bootstrap-base-port", str(bport), "--torch-threads", "1",
           "--server-args", " ".join(SERVER_ARGS)]
    router = Server(cmd=cmd, port=port)
    try:
        for prompt, sp in CONSTRAINED:
            want = generate(server.url, prompt, sp)
            got = generate(router.url, prompt, sp)
            assert got["output_ids"] == want["output_ids"], (prompt, got["text"], want["text"])
            check(got["text"], sp)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=64,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[0])
    finally:
        router.stop()


@pytest.mark.slow  # a soak; test_e2e_switch.py switches under traffic, test_pd_cluster_... is PD (suite time)
def test_constrained_traffic_survives_role_switches():
    def dynamic() -> Server:
        return Server(*SERVER_ARGS, "--enable-dynamic-disaggregation", "--disaggregation-transfer-backend", "tcp",
                      "--disaggregation-bootstrap-port", str(free_port()), "--torch-threads", "1", wait=False)

    servers = all_ready(*(dynamic() for _ in range(3)))  # one keeps a usable path while the others move
    a, b, c = (s.url for s in servers)
    sampling = {"json_schema": json.dumps(SCHEMAS[0]), "ignore_eos": False}
    prompts = ["Describe a person as JSON:", "Another person, as JSON:"]
    reference = {p: generate(a, p, sampling, 48)["output_ids"] for p in prompts}
    rport = free_port()
    router = Server(cmd=[sys.executable, "-m", "tidal.router", "--port", str(rport), "--worker", a, b, c,
                         "--policy", "round_robin", "--health-check-interval-secs", "1", "--max-retries", "5"],
                    port=rport)
    try:
        with Traffic(router.url, reference, 48, threads=2, sampling=sampling) as traffic:
            time.sleep(2)
            for url, mode in [(a, "prefill"), (b, "decode"), (c, "prefill"), (a, "null"), (c, "null"), (b, "null")]:
                r = httpx.post(router.url + "/admin/set_worker_role", json={"url": url, "mode": mode}, timeout=180)
                assert r.status_code == 200, r.text
                time.sleep(2)
        assert traffic.failures == [] and traffic.mismatches == []
        assert traffic.ok >= 6
        # the API surface a client expects answers through the router after the switches
        model = httpx.get(router.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        assert httpx.get(f"{router.url}/v1/models/{model}", timeout=30).status_code == 200
        ids = httpx.post(router.url + "/tokenize", json={"prompt": "Hello"}, timeout=30).json()["tokens"]
        assert httpx.post(router.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["text"] == "Hello"
    finally:
        router.stop()
        for s in servers:
            s.stop()
