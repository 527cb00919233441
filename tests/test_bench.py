"""tidal bench: the client against a mock SSE server, datasets, metrics math, plots."""


import argparse
import asyncio
import json
import os
import socket
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from tidal.bench import add_bench_args, run_bench
from tidal.bench import datasets as ds
from tidal.bench.metrics import (RequestRecord, compute_metrics, format_table, meets_slos,
                                 parse_goodput, summarize)
from tidal.bench.serving import StreamState, apply_chunk, arrival_offsets

TOKEN_DELAY = 0.002


class WordTokenizer:
    """A tiny exact-round-trip tokenizer: id i <-> word 'w{i}' (ids 0..2 are special)."""

    vocab_size = 500
    all_special_ids = [0, 1, 2]

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else 3 + len(w) % 400
                for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


# --------------------------------------------------------------------------- mock server

def _make_app(state: dict[str, Any]) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": "mock-model", "object": "model"}]}

    @app.post("/generate")
    async def generate(req: Request) -> Any:
        body = await req.json()
        state["bodies"].append(body)
        state.setdefault("auth", []).append(req.headers.get("authorization"))
        if state.get("fail"):
            return JSONResponse({"error": "boom"}, status_code=500)
        n = body["sampling_params"]["max_new_tokens"]
        n_in = len(body["input_ids"]) if "input_ids" in body else len(body["text"].split())

        async def gen() -> Any:
            text = ""
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY)
                text += f" t{i}"
                meta = {"prompt_tokens": n_in, "completion_tokens": i + 1,
                        "finish_reason": {"type": "length"} if i == n - 1 else None}
                yield sse({"text": text, "meta_info": meta})
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def openai_stream(body: dict[str, Any], chat: bool) -> Any:
        n = body["max_tokens"]
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY)
            piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield sse({"choices": [{"index": 0, "finish_reason": None, **piece}]})
        if state.get("usage", True) and body.get("stream_options", {}).get("include_usage"):
            yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(req: Request) -> Any:
        body = await req.json()
        state["bodies"].append(body)
        return StreamingResponse(openai_stream(body, False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> Any:
        body = await req.json()
        state["bodies"].append(body)
        return StreamingResponse(openai_stream(body, True), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def mock_server() -> Iterator[tuple[str, dict[str, Any]]]:
    import uvicorn

    state: dict[str, Any] = {"bodies": []}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_make_app(state), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    th.join(timeout=5)
    sock.close()


def _ns(url: str, tmp_path: Any, **kw: Any) -> argparse.Namespace:
    p = add_bench_args(argparse.ArgumentParser())
    ns = p.parse_args(["--url", url, "--num-prompts", "6", "--random-input-len", "20",
                       "--random-output-len", "5", "--random-range-ratio", "1.0",
                       "--disable-tqdm", "--output-file", str(tmp_path / "r.json")])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


# --------------------------------------------------------------------------- client runs

@pytest.mark.parametrize("backend", ["tidal", "sglang", "openai", "openai-chat"])
def test_run_bench_backends(mock_server: Any, tmp_path: Any, backend: str) -> None:
    url, state = mock_server
    state["bodies"].clear()
    ns = _ns(url, tmp_path, backend=backend, max_concurrency=3,
             goodput=["ttft:5000", "tpot:1000"])
    res = run_bench(ns, tokenizer=WordTokenizer())
    assert res["completed"] == 6 and res["failed"] == 0
    assert len(state["bodies"]) == 7  # 1 warmup + 6
    assert res["total_output_tokens"] == 30
    for r in res["requests"]:
        assert r["success"] and r["ttft"] > 0 and r["e2e"] >= r["ttft"]
        assert len(r["itl"]) == 4 and r["output_tokens"] == 5
    assert res["ttft_ms"]["mean"] > 0 and res["tpot_ms"]["p50"] > 0
    assert res["itl_ms"]["p99"] >= res["itl_ms"]["p50"] > 0
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    assert res["goodput"]["fraction"] == 1.0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 6 and saved["config"]["backend"] == backend
    body = state["bodies"][-1]
    if backend in ("tidal", "sglang"):
        assert len(body["input_ids"]) == 20 and body["stream"] is True
        assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0,
                                           "ignore_eos": True}
    else:
        assert body["stream_options"] == {"include_usage": True}
        assert saved["config"]["model"] == "mock-model" and body["model"] == "mock-model"
    if backend == "openai-chat":
        nonce_text = WordTokenizer().decode(saved["config"]["nonce"])
        assert body["messages"][0]["content"].startswith(nonce_text)


def test_run_bench_sends_the_api_key_and_never_saves_it(mock_server: Any, tmp_path: Any) -> None:
    url, state = mock_server
    state["auth"] = []
    res = run_bench(_ns(url, tmp_path, api_key="sk-bench-7"), tokenizer=WordTokenizer())
    assert res["completed"] == 6 and state["auth"] == ["Bearer sk-bench-7"] * 7
    saved = (tmp_path / "r.json").read_text()
    assert "sk-bench-7" not in saved and json.loads(saved)["config"]["api_key"] == "<set>"


def test_run_bench_text_usage_fallback_and_plot(mock_server: Any, tmp_path: Any) -> None:
    url, state = mock_server
    state["usage"] = False
    try:
        ns = _ns(url, tmp_path, backend="openai", plot=str(tmp_path / "p.png"),
                 request_rate=200.0, warmup_requests=0)
        res = run_bench(ns, tokenizer=WordTokenizer())
    finally:
        state["usage"] = True
    assert res["completed"] == 6
    assert all(r["output_tokens"] == 5 for r in res["requests"])  # tokenized text
    assert all(r["prompt_tokens"] == 20 for r in res["requests"])
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_run_bench_text_prompts_and_failures(mock_server: Any, tmp_path: Any) -> None:
    url, state = mock_server
    state["bodies"].clear()
    ns = _ns(url, tmp_path, backend="sglang", send_input_ids=False, warmup_requests=0,
             num_prompts=3, goodput=["e2e:100000"])
    state["fail"] = True
    try:
        res = run_bench(ns, tokenizer=WordTokenizer())
    finally:
        state["fail"] = False
    assert res["completed"] == 0 and res["failed"] == 3
    assert "HTTP 500" in res["requests"][0]["error"]
    assert res["goodput"]["fraction"] == 0.0
    assert "text" in state["bodies"][0] and "input_ids" not in state["bodies"][0]
    ns.warmup_requests = 1
    with pytest.raises(SystemExit):
        state["fail"] = True
        try:
            run_bench(ns, tokenizer=WordTokenizer())
        finally:
            state["fail"] = False


def test_run_bench_azure_trace_replay(mock_server: Any, tmp_path: Any) -> None:
    url, _ = mock_server
    csv = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.0000000,30,4\n"
                   "2023-11-16 18:15:46.5000000,500,300\n"
                   "2023-11-16 18:15:47.0000000,12,2\n")
    ns = _ns(url, tmp_path, dataset="azure-conv", dataset_path=str(tmp_path),
             num_prompts=3, warmup_requests=0, trace_speedup=10.0, max_input_len=40,
             max_output_len=6)
    t0 = time.perf_counter()
    res = run_bench(ns, tokenizer=WordTokenizer())
    assert time.perf_counter() - t0 >= 0.1  # last arrival at 1.0 s / 10
    assert res["completed"] == 3
    assert [r["output_tokens"] for r in res["requests"]] == [4, 6, 2]
    assert [r["prompt_tokens"] for r in res["requests"]] == [30, 40, 12]
    starts = [r["start"] for r in res["requests"]]
    assert starts[1] >= 0.045 and starts[2] >= 0.095


# --------------------------------------------------------------------------- datasets

def test_random_dataset_lengths_and_nonce() -> None:
    tok = WordTokenizer()
    a = ds.sample_random_requests(tok, 50, 40, 8, range_ratio=0.5, seed=3, as_ids=True)
    b = ds.sample_random_requests(tok, 50, 40, 8, range_ratio=0.5, seed=3, as_ids=True)
    assert all(20 <= r.prompt_len <= 40 and len(r.prompt_ids) == r.prompt_len for r in a)
    assert all(4 <= r.output_len <= 8 for r in a)
    assert [r.output_len for r in a] == [r.output_len for r in b]  # seeded lengths
    nonce_a, nonce_b = a[0].prompt_ids[:4], b[0].prompt_ids[:4]
    assert nonce_a != nonce_b  # per-run nonce differs even with the same seed
    assert all(r.prompt_ids[:4] == nonce_a for r in a)
    assert a[0].prompt_ids[4:] == b[0].prompt_ids[4:]  # the body is seeded
    text = ds.sample_random_requests(tok, 3, 12, 2, range_ratio=1.0, seed=3)
    assert all(r.prompt_len == 12 and tok.encode(r.prompt) == r.prompt_ids for r in text)
    assert not any(set(r.prompt_ids) & {0, 1, 2} for r in a)  # no special tokens
    fixed = ds.sample_random_requests(tok, 5, 16, 3, range_ratio=1.0, seed=0)
    assert {r.prompt_len for r in fixed} == {16} and {r.output_len for r in fixed} == {3}


def test_azure_trace_parsing_and_scaling(tmp_path: Any) -> None:
    assert ds.parse_timestamp("2023-11-16 18:17:04.0319600") - \
        ds.parse_timestamp("2023-11-16 18:17:03.9799600") == pytest.approx(0.052)
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:00:{i:02d}.5000000,{100 + i},{10 + i}\n" for i in range(10)))
    rows = ds.load_azure_trace(str(csv), num_prompts=3, offset=4, speedup=2.0)
    assert rows == [(0.0, 104, 14), (0.5, 105, 15), (1.0, 106, 16)]
    reqs = ds.sample_azure_requests(WordTokenizer(), rows, max_input_len=50,
                                    max_output_len=15, as_ids=True)
    assert [(r.arrival_time, r.prompt_len, r.output_len) for r in reqs] == \
        [(0.0, 50, 14), (0.5, 50, 15), (1.0, 50, 15)]
    assert arrival_offsets(reqs, float("inf"), 0) == [0.0, 0.5, 1.0]
    assert ds.resolve_trace_file("azure-code", str(csv)) == str(csv)


def test_shipped_azure_trace() -> None:
    """The trace ships inside the package (no ../shared at run or test time), with its licence."""
    assert os.path.isfile(os.path.join(ds.default_azure_dir(), "LICENSE"))
    for name, count in (("azure-code", 8819), ("azure-conv", 19366)):
        assert len(ds.load_azure_trace(ds.resolve_trace_file(name, None), 10**6)) == count
    rows = ds.load_azure_trace(ds.resolve_trace_file("azure-code", None), 5)
    assert len(rows) == 5 and rows[0][0] == 0.0
    assert all(b >= a for (a, _, _), (b, _, _) in zip(rows, rows[1:]))


def test_poisson_arrivals() -> None:
    reqs = [ds.BenchRequest("p", [5], 1, 1) for _ in range(2000)]
    off = arrival_offsets(reqs, 100.0, seed=0)
    assert off[0] == 0.0 and all(b >= a for a, b in zip(off, off[1:]))
    assert np.mean(np.diff(off)) == pytest.approx(0.01, rel=0.1)
    assert arrival_offsets(reqs[:3], float("inf"), 0) == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- metrics

def _rec(ttft: float, e2e: float, out: int, ok: bool = True, prompt: int = 10) -> RequestRecord:
    itl = [(e2e - ttft) / (out - 1)] * (out - 1) if ok and out > 1 else []
    return RequestRecord(success=ok, error="" if ok else "x", ttft=ttft, e2e=e2e, itl=itl,
                         prompt_tokens=prompt, output_tokens=out if ok else 0)


def test_metrics_math() -> None:
    recs = [_rec(0.1, 1.1, 11), _rec(0.2, 2.2, 11), _rec(0.3, 0.3, 1), _rec(0, 0, 0, ok=False)]
    assert recs[0].tpot == pytest.approx(0.1) and recs[2].tpot is None
    m = compute_metrics(recs, duration_s=2.0, slos={"ttft": 150, "tpot": 150})
    assert (m["completed"], m["failed"], m["num_requests"]) == (3, 1, 4)
    assert m["total_output_tokens"] == 23 and m["total_input_tokens"] == 30
    assert m["output_throughput"] == pytest.approx(11.5)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert m["itl_ms"]["p50"] == pytest.approx(150.0)
    assert m["e2e_ms"]["max"] == pytest.approx(2200.0)
    # only recs[0] meets ttft<=150 & tpot<=150
    assert m["goodput"]["good_requests"] == 1
    assert m["goodput"]["fraction"] == pytest.approx(0.25)
    assert m["goodput"]["request_rate"] == pytest.approx(0.5)
    assert "Successful requests:" in format_table(m) and "Goodput" in format_table(m)


def test_goodput_parsing_and_edge_cases() -> None:
    assert parse_goodput(["ttft:200", "TPOT:50", "e2e:1e4"]) == \
        {"ttft": 200.0, "tpot": 50.0, "e2e": 10000.0}
    assert parse_goodput(None) == {}
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])
    assert meets_slos(_rec(0.1, 1.0, 5), {"e2e": 1000})
    assert not meets_slos(_rec(0.1, 1.0, 5), {"e2e": 999})
    assert summarize([])["p99"] == 0.0
    m = compute_metrics([], 0.0)
    assert m["completed"] == 0 and "goodput" not in m


def test_stream_chunk_parsing() -> None:
    st = StreamState()
    assert apply_chunk("tidal", {"text": "a", "meta_info": {"completion_tokens": 1}}, st)
    assert apply_chunk("tidal", {"text": "ab", "meta_info": {"completion_tokens": 2}}, st)
    # a token that decodes to no new text still counts via completion_tokens
    assert apply_chunk("tidal", {"text": "ab", "meta_info": {"completion_tokens": 3}}, st)
    assert st.text == "ab" and st.completion_tokens == 3
    st2 = StreamState()
    assert not apply_chunk("openai-chat", {"choices": [{"delta": {"role": "assistant"}}]}, st2)
    assert apply_chunk("openai-chat", {"choices": [{"delta": {"content": "hi"}}]}, st2)
    assert not apply_chunk("openai", {"choices": [], "usage": {"completion_tokens": 4}}, st2)
    assert st2.completion_tokens == 4
    st3 = StreamState()
    apply_chunk("sglang", {"error": {"message": "bad"}}, st3)
    assert st3.error == "bad"


def test_hf_baseline_tiny_model() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidal.bench.hf_baseline import make_batch, run_baseline

    ids, mask = make_batch(3, 8, 50, 0, [0, 1, 2], np.random.default_rng(0), 0.5)
    assert ids.shape[0] == 3 and (mask.sum(1) >= 4).all()
    assert (mask[:, -1] == 1).all() and ((ids == 0) == (mask == 0)).all()  # left padded
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    res = run_baseline(model, [1, 2], input_len=6, output_len=4, warmup=False)
    assert [r["output_tokens"] for r in res] == [4, 8]
    assert all(r["output_tokens_per_s"] > 0 for r in res)
