"""The OpenAI/SGLang surface a client expects (issue 11 item 6), on one real null server:
/v1/models/{id}, unknown model 404, /tokenize, /detokenize, /version, chat roles, max_tokens 0,
prompt + max_tokens over the context, and /generate with max_new_tokens 0 (prompt scoring)."""

from __future__ import annotations

import sys

import httpx
import openai
import pytest

import tidal
from servers import Server, free_port

pytestmark = pytest.mark.timeout(300)

MODEL = "smol-test"
CONTEXT = 2048


@pytest.fixture(scope="module")
def server():
    s = Server("--served-model-name", MODEL, "--context-length", str(CONTEXT), "--torch-threads", "1")
    yield s
    s.stop()


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    return err["message"]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_model_by_id(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"][0]
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL == listed["id"] and card["max_model_len"] == CONTEXT
    assert client(server).models.retrieve(MODEL).id == MODEL
    assert "nope" in error_of(httpx.get(server.url + "/v1/models/nope"), 404)


def test_unknown_model_is_404_and_default_or_missing_accepted(server):
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        assert "`other` does not exist" in error_of(post(server, path, {**body, "model": "other"}), 404)
        for model in (MODEL, "default", None):
            r = post(server, path, body if model is None else {**body, "model": model})
            assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="other", prompt="Hi", max_tokens=2)


def test_max_tokens_zero_is_400_on_openai_routes(server):
    assert "max_tokens" in error_of(post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 0}), 400)
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for name in ("max_tokens", "max_completion_tokens"):
        assert name in error_of(post(server, "/v1/chat/completions", {**chat, name: 0}), 400)
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=MODEL, messages=chat["messages"], max_tokens=0)


def test_prompt_plus_max_tokens_over_context_is_400_with_both_numbers(server):
    n = len(post(server, "/tokenize", {"prompt": "Hello world"}).json()["tokens"])
    ok = post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 1})
    assert ok.status_code == 200
    msg = error_of(post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": CONTEXT - n + 1}), 400)
    assert str(CONTEXT) in msg and f"{n} prompt tokens" in msg and f"max_tokens={CONTEXT - n + 1}" in msg
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": CONTEXT}
    assert str(CONTEXT) in error_of(post(server, "/v1/chat/completions", chat), 400)


def test_invalid_chat_role_is_400(server):
    body = {"messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 2}
    msg = error_of(post(server, "/v1/chat/completions", body), 400)
    assert "wizard" in msg and "user" in msg
    body["messages"] = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert post(server, "/v1/chat/completions", body).status_code == 200


def test_tokenize_and_detokenize(server):
    one = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert one["count"] == len(one["tokens"]) > 0 and one["max_model_len"] == CONTEXT
    many = post(server, "/tokenize", {"prompt": ["Hello world", "a"], "add_special_tokens": False}).json()
    assert many["tokens"][0] == one["tokens"] and many["count"] == [len(t) for t in many["tokens"]]
    assert post(server, "/detokenize", {"tokens": one["tokens"]}).json() == {"text": "Hello world"}
    assert post(server, "/v1/detokenize", {"tokens": many["tokens"]}).json() == {"text": ["Hello world", "a"]}
    error_of(post(server, "/detokenize", {"tokens": [10**9]}), 400)
    error_of(post(server, "/tokenize", {"text": "no prompt field"}), 400)
    error_of(post(server, "/tokenize", {"prompt": "x", "model": "other"}), 404)


def test_version_and_info_aliases(server):
    assert httpx.get(server.url + "/version").json() == {"version": tidal.__version__}
    for path in ("/get_model_info", "/model_info"):
        assert httpx.get(server.url + path).json()["served_model_name"] == MODEL
    infos = [httpx.get(server.url + path).json() for path in ("/get_server_info", "/server_info")]
    assert all(info["version"] == tidal.__version__ for info in infos)
    # one per process (a router tells a restart by it): the same on every answer, 32 hex digits
    assert infos[0]["boot_id"] == infos[1]["boot_id"] and int(infos[0]["boot_id"], 16) >= 0
    assert len(infos[0]["boot_id"]) == 32


def test_generate_max_new_tokens_zero_scores_the_prompt(server):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}
    out = post(server, "/generate", body).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 0}
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] > 1
    streamed = httpx.post(server.url + "/generate", json={**body, "stream": True}, timeout=120).text
    assert '"output_ids":[]' in streamed and streamed.rstrip().endswith("[DONE]")
    # the server still generates normally afterwards
    again = post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert len(again.json()["output_ids"]) == 3


def test_router_forwards_the_new_routes(server):
    port = free_port()
    router = Server(cmd=[sys.executable, "-m", "tidal.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                         "--worker-urls", server.url], port=port)
    try:
        assert httpx.get(router.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
        error_of(httpx.get(router.url + "/v1/models/nope"), 404)
        assert httpx.get(router.url + "/version").json() == {"version": tidal.__version__}
        toks = post(router, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
        assert post(router, "/detokenize", {"tokens": toks}).json() == {"text": "Hello world"}
        error_of(post(router, "/v1/completions", {"prompt": "Hi", "model": "other"}), 404)
        out = post(router, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 0}}).json()
        assert out["output_ids"] == []
    finally:
        router.stop()
