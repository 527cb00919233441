"""Multi-LoRA on a real null-mode server: per-request adapters, the radix cache keyed by adapter,
/load_lora_adapter and /unload_lora_adapter, OpenAI `model` selection, and 400/404 answers.
(Parity with transformers + peft is in test_lora.py.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from servers import Server

pytestmark = pytest.mark.timeout(600)

PROMPT = "The quick brown fox"  # base, attn8 and mlp4 continue it differently within 10 tokens
LONG = ("Paging through memory, the engine reads each token's keys and values from scattered slots, "
        "and the answer must not change by a single bit of meaning.")


@pytest.fixture(scope="module")
def server(lora_adapters):
    s = Server("--torch-threads", "1", "--enable-integrity-check", "--max-lora-rank", "16",
               "--lora-paths", f"attn8={lora_adapters['attn8']}", f"mlp4={lora_adapters['mlp4']}")
    yield s
    s.stop()


def gen(url: str, text, lora=None, n: int = 10, stream: bool = False) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "lora_path": lora, "stream": stream}
    return httpx.post(url + "/generate", json=body, timeout=120)


def ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_adapters_batched_with_the_base_model_equal_single_requests(server):
    alone = {name: ids(gen(server.url, PROMPT, name)) for name in (None, "attn8", "mlp4")}
    assert len({tuple(v) for v in alone.values()}) == 3  # every adapter changes the continuation
    r = gen(server.url, [PROMPT] * 4, ["mlp4", None, "attn8", "mlp4"])
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [alone["mlp4"], alone[None], alone["attn8"], alone["mlp4"]]


def test_prefix_cache_is_keyed_by_adapter(server):
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    first = {}
    for name in ("attn8", "mlp4", None):  # the same prompt under each: no request reuses another's KV
        r = gen(server.url, LONG, name)
        assert r.json()["meta_info"]["cached_tokens"] == 0, name
        first[name] = r.json()["output_ids"]
    assert len({tuple(v) for v in first.values()}) == 3
    for name in ("attn8", "mlp4", None):  # now each hits its own prefix, with its own output
        r = gen(server.url, LONG, name)
        assert r.json()["meta_info"]["cached_tokens"] > 0, name
        assert r.json()["output_ids"] == first[name], name


def test_unknown_adapter_is_400(server):
    r = gen(server.url, PROMPT, "nope")
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
    r = gen(server.url, [PROMPT, PROMPT], ["attn8", "nope"])
    assert r.status_code == 400
    r = gen(server.url, [PROMPT, PROMPT], ["attn8"])
    assert r.status_code == 400  # one name for two prompts
    assert gen(server.url, PROMPT, "attn8").status_code == 200  # nothing was left behind


def test_openai_model_selects_the_adapter(server):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    base = models[0]["id"]
    assert {m["id"]: m.get("parent") for m in models[1:]} == {"attn8": base, "mlp4": base}
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    text = {name: httpx.post(server.url + "/v1/completions", json={**body, "model": name}).json()
            for name in (base, "attn8")}
    assert text["attn8"]["model"] == "attn8"
    for name, lora in ((base, None), ("attn8", "attn8")):
        assert text[name]["choices"][0]["text"] == gen(server.url, PROMPT, lora).json()["text"]
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "mlp4", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == "mlp4"
    assert httpx.post(server.url + "/v1/completions", json={**body, "model": "nope"}).status_code == 404
    assert httpx.get(server.url + "/v1/models/attn8").json()["parent"] == base
    assert httpx.get(server.url + "/v1/models/nope").status_code == 404


def test_load_use_and_unload(server, lora_adapters):
    url = server.url
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "all16", "lora_path": lora_adapters["all16"]})
    assert r.status_code == 200 and "all16" in r.json()["loaded_adapters"], r.text
    assert "all16" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    again = httpx.post(url + "/load_lora_adapter", json={"lora_name": "all16", "lora_path": lora_adapters["all16"]})
    assert again.status_code == 400  # the name is taken
    bad = httpx.post(url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    out = ids(gen(url, LONG, "all16"))
    assert out != ids(gen(url, LONG))

    # in use by a running request: refused, then accepted once it finished
    done = threading.Event()
    threading.Thread(target=lambda: (gen(url, LONG, "all16", n=300), done.set()), daemon=True).start()
    time.sleep(1.0)
    busy = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "all16"})
    assert busy.status_code == 400 and "in use" in busy.json()["error"]["message"]
    assert done.wait(120)
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "all16"})
    assert r.status_code == 200 and "all16" not in r.json()["loaded_adapters"]
    assert gen(url, LONG, "all16").status_code == 400
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "all16"}).status_code == 400
    # loaded again under the same name: the same tokens, computed afresh (its old prefixes were dropped)
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "all16", "lora_path": lora_adapters["all16"]})
    assert r.status_code == 200
    again = gen(url, LONG, "all16")
    assert again.json()["output_ids"] == out and again.json()["meta_info"]["cached_tokens"] == 0


def test_broken_adapter_files_are_400(server, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')  # no r
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    r = httpx.post(server.url + "/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "broken" in r.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    r = httpx.post(server.url + "/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(tmp_path)})
    assert r.status_code == 400
    assert "broken" not in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert gen(server.url, PROMPT, "attn8").status_code == 200  # the scheduler lives on


def test_lora_off_refuses_adapters():
    s = Server("--torch-threads", "1")
    try:
        r = gen(s.url, PROMPT, "attn8")
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    finally:
        s.stop()
