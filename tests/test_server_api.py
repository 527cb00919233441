"""The HTTP API against the fake scheduler (tests/fake_scheduler.py), as real processes.

Four servers start concurrently (to share the import cost): the main one, one with
--api-key (ends with a SIGTERM test), one whose scheduler crashes, and one whose
scheduler fails to start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import httpx
import openai
import pytest

from fake_scheduler import cached_tokenizer_dir, default_gguf_path
from servers import free_port

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "tests", "fake_scheduler.py")
CONTEXT_LEN = 4096  # the fake scheduler's default
API_KEY = "sk-test-key"


def child_pids(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class FakeServer:
    def __init__(self, *extra: str, env: Optional[dict] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, FAKE, "--model-path", default_gguf_path(), "--tokenizer-path", cached_tokenizer_dir(),
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *extra]
        full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.children: list[int] = []

    def wait_ready(self, timeout: float = 120) -> "FakeServer":
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited: {self.proc.stdout.read()}"
            self.children = self.children or child_pids(self.proc.pid)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.children = child_pids(self.proc.pid)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in self.children:  # never leave a scheduler behind, even if a test failed
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers():
    cached_tokenizer_dir()
    s = {
        "main": FakeServer(env={"TIDAL_FAKE_STEP_S": "0.005"}),
        "auth": FakeServer("--api-key", API_KEY),
        "crash": FakeServer(),
        "bad_start": FakeServer(env={"TIDAL_FAKE_STARTUP_ERROR": "model file is corrupt"}),
    }
    try:
        for name in ("main", "auth", "crash"):
            s[name].wait_ready()
        yield s
    finally:
        for srv in s.values():
            srv.stop()


@pytest.fixture(scope="module")
def url(servers):
    return servers["main"].url


def gen(url: str, body: dict, status: int = 200):
    r = httpx.post(url + "/generate", json=body, timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def sse_events(resp: httpx.Response) -> list:
    """Parse an SSE body strictly: `data: ...` events separated by blank lines, ending with [DONE]."""
    raw = resp.text
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), raw[:300]
    return [json.loads(b[6:]) for b in blocks[:-1]]


# ---------------------------------------------------------------- info routes


def test_health_info_and_models(url):
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(url + path).json()
        assert info["disaggregation_mode"] == "null" and info["epoch"] == 0 and info["version"]
        assert info["scheduler_info"]["context_length"] == CONTEXT_LEN and info["api_key"] is None
        assert info["internal_states"][0]["gen_throughput"] == 123.0 and info["port"]
    for path in ("/model_info", "/get_model_info"):
        mi = httpx.get(url + path).json()
        assert mi["is_generation"] is True and mi["model_path"].endswith(".gguf") and mi["tokenizer_path"]
    models = openai.OpenAI(base_url=url + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    load = httpx.get(url + "/get_load").json()
    assert set(load[0]) >= {"num_reqs", "num_waiting_reqs", "num_tokens", "num_queued_prefill_tokens", "num_decoding_reqs",
                            "num_waiting_prompt_tokens", "max_total_tokens"}
    assert load[0]["max_total_tokens"] > 0 and load[0]["num_queued_prefill_tokens"] == 0
    assert load[0]["num_waiting_prompt_tokens"] == 0
    # the arrivals, counted by the front end as they come (the planner's): a request and its prompt's tokens
    ids = [1, 2, 3, 4, 5, 6, 7]
    gen(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    after = httpx.get(url + "/get_load").json()[0]
    assert after["prompts_received_total"] == load[0]["prompts_received_total"] + 1
    assert after["prompt_tokens_received_total"] == load[0]["prompt_tokens_received_total"] + len(ids)


def test_metrics(url):
    gen(url, {"text": "count me", "sampling_params": {"max_new_tokens": 3}})
    httpx.post(url + "/generate", json={"text": "count me", "stream": True, "sampling_params": {"max_new_tokens": 5}})
    text = httpx.get(url + "/metrics").text
    for name in ("tidal:num_requests_total", "tidal:prompt_tokens_total", "tidal:generation_tokens_total",
                 "tidal:time_to_first_token_seconds_bucket", "tidal:inter_token_latency_seconds_bucket",
                 "tidal:e2e_request_latency_seconds_bucket", "tidal:num_running_reqs", "tidal:num_queue_reqs",
                 "tidal:token_usage", "tidal:cache_hit_rate", "tidal:gen_throughput", "tidal:max_decode_batch_size"):
        assert name in text, name
    assert 'tidal:gen_throughput{model_name="SmolLM2-135M-Instruct.Q4_1.gguf"} 123.0' in text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    label = '{model_name="SmolLM2-135M-Instruct.Q4_1.gguf"}'
    assert float(samples[f"tidal:num_requests_total{label}"]) >= 2
    assert float(samples[f"tidal:inter_token_latency_seconds_count{label}"]) >= 1  # from the stream


# ---------------------------------------------------------------- /generate


def test_generate_single(url):
    out = gen(url, {"text": "Hello world", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert out["text"] == "Hello worldHello worldHello"  # the fake echoes the prompt tokens
    assert len(out["output_ids"]) == 5
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 2 and meta["completion_tokens"] == 5 and meta["e2e_latency"] > 0
    assert 0 < meta["first_token_latency"] <= meta["e2e_latency"]  # the TTFT a whole reply hides
    assert {"id", "cached_tokens"} <= set(meta)


def test_generate_input_ids_and_batches(url):
    ids = httpx.post(url + "/generate", json={"text": "Hello world", "sampling_params": {"max_new_tokens": 2}}
                     ).json()["output_ids"]
    one = gen(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    assert one["text"] == "Hello world"
    batch = gen(url, {"input_ids": [ids, ids[:1]], "sampling_params": {"max_new_tokens": 2}})
    assert [b["text"] for b in batch] == ["Hello world", "HelloHello"]
    texts = gen(url, {"text": ["a b", "c"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3}]})
    assert [t["meta_info"]["completion_tokens"] for t in texts] == [1, 3]
    n2 = gen(url, {"text": "x", "rid": "grp", "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert [o["meta_info"]["id"] for o in n2] == ["grp-0", "grp-1"]
    named = gen(url, {"text": ["x", "y"], "rid": "b", "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in named] == ["b-0", "b-1"]
    listed = gen(url, {"text": ["x", "y"], "rid": ["r1", "r2"], "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in listed] == ["r1", "r2"]


def test_generate_stream_sse(url):
    r = httpx.post(url + "/generate", json={"text": "Hello world", "stream": True,
                                            "sampling_params": {"max_new_tokens": 30}}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert len(events) >= 2
    for a, b in zip(events, events[1:]):  # cumulative text and ids
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert events[-1]["text"] == "Hello world" * 15
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_generate_batch_stream_has_index(url):
    r = httpx.post(url + "/generate", json={"text": ["a", "b"], "stream": True,
                                            "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    events = sse_events(r)
    assert {e["index"] for e in events} == {0, 1}


def test_generate_stops(url):
    out = gen(url, {"text": "Hello world. STOP here", "sampling_params": {"max_new_tokens": 20, "stop": "STOP"}})
    assert out["text"] == "Hello world. " and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "STOP"}
    kept = gen(url, {"text": "Hello world. STOP here",
                     "sampling_params": {"max_new_tokens": 20, "stop": ["STOP"], "no_stop_trim": True}})
    assert kept["text"] == "Hello world. STOP"
    dot = gen(url, {"text": "a.b", "sampling_params": {"max_new_tokens": 20, "stop_token_ids": [30]}})
    assert dot["text"] == "a" and dot["meta_info"]["finish_reason"]["matched"] == 30
    eos = gen(url, {"input_ids": [19556, 2], "sampling_params": {"max_new_tokens": 20}})
    assert eos["text"] == "Hello" and eos["output_ids"] == [19556, 2]
    ign = gen(url, {"input_ids": [19556, 2], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert ign["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_logprobs(url):
    out = gen(url, {"text": "Hello world", "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                    "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3}})
    meta = out["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["output_token_logprobs"][0][2] == "Hello" and isinstance(meta["output_token_logprobs"][0][0], float)
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == 2
    assert len(meta["output_top_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 2
    plain = gen(url, {"text": "Hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 1}})
    assert plain["meta_info"]["output_token_logprobs"][0][2] is None


def test_max_new_tokens_clipped_to_context(url):
    out = gen(url, {"input_ids": [19556] * (CONTEXT_LEN - 10), "sampling_params": {"max_new_tokens": 500}})
    assert out["meta_info"]["completion_tokens"] == 10
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_unknown_fields_ignored(url):
    out = gen(url, {"text": "hi", "whatever": 1, "sampling_params": {"max_new_tokens": 1, "json_schema": None}})
    assert out["meta_info"]["completion_tokens"] == 1


# ---------------------------------------------------------------- OpenAI


def test_completions(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    c = client.completions.create(model="default", prompt="Hello world", max_tokens=4, temperature=0)
    assert c.choices[0].text == "Hello worldHello world" and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 2 and c.usage.completion_tokens == 4 and c.usage.total_tokens == 6
    assert c.usage.prompt_tokens_details.cached_tokens >= 0
    multi = client.completions.create(model="default", prompt=["a", "b c"], max_tokens=1, n=2)
    assert [ch.index for ch in multi.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in multi.choices] == ["a", "a", "b", "b"]
    ids = client.completions.create(model="default", prompt=[19556, 905], max_tokens=2, echo=True, logprobs=1)
    assert ids.choices[0].text == "Hello worldHello world"
    assert ids.choices[0].logprobs.tokens == ["Hello", " world", "Hello", " world"]
    assert ids.choices[0].logprobs.token_logprobs[0] is None


def test_a_whole_openai_answer_says_its_ttft_and_tpot_in_server_timing(url):
    from tidal.server_timing import parse_server_timing

    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 4}, timeout=60)
    ttft, tpot = parse_server_timing(chat.headers.get("server-timing"))
    # the fake scheduler answers a whole request in one output (TTFT ~ e2e, TPOT ~ 0): this checks the header is
    # there and well formed; its units and the mean over choices are pinned in test_planner.py
    assert chat.status_code == 200 and ttft is not None and 0 < ttft and tpot is not None and tpot >= 0
    one = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
    assert parse_server_timing(one.headers.get("server-timing"))[1] is None  # one token: no TPOT
    streamed = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True},
                          timeout=60)
    assert "server-timing" not in streamed.headers  # a stream shows its own timing


def test_completions_stream(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    chunks = list(client.completions.create(model="default", prompt="Hello world", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == "Hello worldHello worldHello"
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_chat(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="default", messages=msgs, max_tokens=6)
    content = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and content.startswith("system\nYou")
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="default", messages=msgs, max_completion_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    lp = client.chat.completions.create(model="default", messages=msgs, max_tokens=2, logprobs=True, top_logprobs=2)
    assert len(lp.choices[0].logprobs.content) == 2 and len(lp.choices[0].logprobs.content[0].top_logprobs) == 2


def test_chat_stop_at_eos(url):
    # the fake echoes the chat prompt, whose first <|im_end|> (EOS) ends the answer
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 2
    assert choice["message"]["content"].endswith("Hugging Face")


# ---------------------------------------------------------------- errors


BAD = [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.1}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}}),
    ("/generate", {"text": 5}),
    ("/generate", {"text": ""}),
    ("/generate", {"input_ids": []}),
    ("/generate", {"input_ids": [99999999]}),
    ("/generate", {}),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": -5}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "top_p": 2}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "n": 0}),
    ("/v1/completions", {"model": "default", "prompt": ""}),
    ("/v1/completions", {"model": "default", "prompt": []}),
    ("/v1/completions", {"model": "default"}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": "ten"}),
    ("/v1/chat/completions", {"model": "default", "messages": []}),
    ("/v1/chat/completions", {"model": "default", "messages": "hi"}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}], "top_p": 1.01}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}], "n": 0}),
    ("/abort_request", {}),
]


@pytest.mark.parametrize("path,body", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_input_is_400(url, path, body):
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


PRIORITY_BODIES = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"model": "default", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


@pytest.mark.parametrize("path", list(PRIORITY_BODIES))
def test_priority_without_priority_scheduling_is_400(url, path):
    r = httpx.post(url + path, json={**PRIORITY_BODIES[path], "priority": 3}, timeout=30)
    assert r.status_code == 400, r.text
    assert "--enable-priority-scheduling" in r.json()["error"]["message"]
    assert httpx.post(url + path, json={**PRIORITY_BODIES[path], "priority": None}, timeout=30).status_code == 200


def test_priority_of_a_batch_without_priority_scheduling_is_400(url):
    body = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}, "priority": [1, 2]}
    r = httpx.post(url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and "--enable-priority-scheduling" in r.text


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(url, path):
    for raw in (b"{not json", b"", b"[1, 2]"):
        r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text


def test_prompt_too_long_names_both_numbers(url):
    n = CONTEXT_LEN + 5
    r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": [19556] * n})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and str(n) in msg and str(CONTEXT_LEN - 1) in msg


def test_openai_client_sees_400(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="hi", max_tokens=-1)


def test_unknown_route_404_json(url):
    r = httpx.get(url + "/no_such_route")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


# ---------------------------------------------------------------- abort, disconnect, cache


def _open_stream(client: httpx.Client, url: str, rid: str):
    body = {"text": "a long one", "rid": rid, "stream": True, "sampling_params": {"max_new_tokens": 3000}}
    cm = client.stream("POST", url + "/generate", json=body, timeout=30)
    resp = cm.__enter__()
    lines = resp.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    return cm, lines, json.loads(first[6:])


def _wait_idle(url: str, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while httpx.get(url + "/get_load").json()[0]["num_reqs"] != 0:
        assert time.time() < deadline, "the scheduler still runs requests"
        time.sleep(0.05)


def test_abort_request(url):
    with httpx.Client() as client:
        cm, lines, first = _open_stream(client, url, "abort-me")
        assert first["meta_info"]["finish_reason"] is None
        r = httpx.post(url + "/abort_request", json={"rid": "abort-me"})
        assert r.status_code == 200 and r.json()["num_aborted"] == 1
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        cm.__exit__(None, None, None)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle(url)


def test_abort_all_non_stream(url):
    import threading

    result = {}
    t = threading.Thread(target=lambda: result.update(gen(url, {"text": "x", "sampling_params": {
        "max_new_tokens": 3000}})))
    t.start()
    deadline = time.time() + 10
    while httpx.get(url + "/get_load").json()[0]["num_reqs"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    assert httpx.post(url + "/abort_request", json={"abort_all": True}).status_code == 200
    t.join(10)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"


def test_client_disconnect_aborts(url):
    with httpx.Client() as client:
        cm, _lines, _first = _open_stream(client, url, "gone-client")
        cm.__exit__(None, None, None)  # close the connection mid-stream
    _wait_idle(url)


def test_client_disconnect_aborts_non_stream(url):
    body = {"text": "slow", "sampling_params": {"max_new_tokens": 3000}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json=body, timeout=httpx.Timeout(5, read=0.3))
    _wait_idle(url)


def test_flush_cache_and_cached_tokens(url):
    body = {"text": "cache me please", "sampling_params": {"max_new_tokens": 1}}
    gen(url, body)
    assert gen(url, body)["meta_info"]["cached_tokens"] > 0
    assert httpx.post(url + "/flush_cache").status_code == 200
    assert httpx.get(url + "/flush_cache").json()["success"] is True
    assert gen(url, body)["meta_info"]["cached_tokens"] == 0


# ---------------------------------------------------------------- auth, crash, shutdown


def test_api_key(servers):
    url = servers["auth"].url
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/generate", json={"text": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    assert client.completions.create(model="default", prompt="hi", max_tokens=1).choices[0].text == "hi"
    assert httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()["api_key"] == "<set>"


def test_sigterm_leaves_no_orphans(servers):
    srv = servers["auth"]
    assert srv.children and all(pid_alive(p) for p in srv.children)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(20) == 0
    deadline = time.time() + 5
    while any(pid_alive(p) for p in srv.children) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in srv.children)


def test_scheduler_crash_gives_503_and_exit(servers):
    srv = servers["crash"]
    with httpx.Client() as client:
        cm, lines, _ = _open_stream(client, srv.url, "victim")
        r = httpx.post(srv.url + "/generate", json={"text": "FAKE_CRASH now", "sampling_params": {
            "max_new_tokens": 10}}, timeout=30)
        health = httpx.get(srv.url + "/health").status_code
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        cm.__exit__(None, None, None)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert health == 503
    assert events[-1]["error"]["code"] == 503
    assert srv.proc.wait(20) != 0


def test_scheduler_startup_error(servers):
    srv = servers["bad_start"]
    assert srv.proc.wait(60) != 0
    assert "model file is corrupt" in srv.proc.stdout.read()
