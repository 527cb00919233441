"""`tidal bench`: an online serving benchmark against SGLang/OpenAI-compatible servers.

Sends streaming requests (random prompts or an Azure trace replay) under a Poisson
arrival rate and/or a concurrency cap, records TTFT / inter-token gaps / e2e latency per
request, and reports throughput, latency percentiles and SLO goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from tidal.cli_help import DefaultsHelpFormatter
from tidal.config import bearer_headers, keys_from_env, mask_secrets
from tidal.sampling_params import SamplingParams
from tidal.sse import iter_sse
from tidal.bench.datasets import (
    DATASETS,
    BenchRequest,
    build_requests,
    encode,
    get_tokenizer,
)
from tidal.bench.metrics import (
    RequestRecord,
    compute_metrics,
    format_table,
    parse_goodput,
)

BACKENDS = ("tidal", "sglang", "openai", "openai-chat")
GENERATE_BACKENDS = ("tidal", "sglang")
SAMPLING_KEYS = frozenset(SamplingParams.__struct_fields__)


@dataclass
class Target:
    """Where and how to send requests."""

    backend: str
    base_url: str
    model: str = "default"
    send_ids: bool = False
    temperature: float = 0.0
    ignore_eos: bool = True
    # merged into every request body; for /generate, sampling parameter keys go to sampling_params
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamState:
    """What the stream has delivered so far for one request."""

    text: str = ""
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    error: str = ""
    finished: bool = False


# --------------------------------------------------------------------------- protocol

def build_payload(t: Target, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streaming request for the target's backend."""
    if t.backend in GENERATE_BACKENDS:
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": req.output_len,
                                "temperature": t.temperature, "ignore_eos": t.ignore_eos},
            "stream": True,
        }
        if t.send_ids:
            body["input_ids"] = req.prompt_ids
        else:
            body["text"] = req.prompt
        for key, value in t.extra_body.items():
            (body["sampling_params"] if key in SAMPLING_KEYS else body)[key] = value
        return "/generate", body
    body = {"model": t.model, "max_tokens": req.output_len, "temperature": t.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if t.ignore_eos:
        body["ignore_eos"] = True
    body.update(t.extra_body)
    if t.backend == "openai":
        body["prompt"] = req.prompt_ids if t.send_ids else req.prompt
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": req.prompt}]
    return "/v1/chat/completions", body


def _apply_generate(data: dict[str, Any], st: StreamState) -> bool:
    text = data.get("text") or ""
    meta = data.get("meta_info") or {}
    before_len, before_ct = len(st.text), st.completion_tokens or 0
    if text.startswith(st.text):  # cumulative text (SGLang's default)
        st.text = text
    else:  # incremental streaming
        st.text += text
    if meta.get("completion_tokens") is not None:
        st.completion_tokens = int(meta["completion_tokens"])
    if meta.get("prompt_tokens") is not None:
        st.prompt_tokens = int(meta["prompt_tokens"])
    if meta.get("finish_reason") is not None:
        st.finished = True
    return len(st.text) > before_len or (st.completion_tokens or 0) > before_ct


def _apply_openai(data: dict[str, Any], st: StreamState) -> bool:
    usage = data.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        st.completion_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        st.prompt_tokens = int(usage["prompt_tokens"])
    choices = data.get("choices") or []
    if not choices:
        return False
    ch = choices[0]
    delta = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    st.text += delta
    if ch.get("finish_reason") is not None:
        st.finished = True
    return bool(delta)


def apply_chunk(backend: str, data: dict[str, Any], st: StreamState) -> bool:
    """Fold one SSE object into ``st``; True when it carried new output tokens."""
    if "error" in data and not data.get("choices") and "text" not in data:
        err = data["error"]
        st.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return False
    if backend in GENERATE_BACKENDS:
        return _apply_generate(data, st)
    return _apply_openai(data, st)


async def send_request(session: aiohttp.ClientSession, t: Target, req: BenchRequest,
                       run_start: float) -> RequestRecord:
    """Send one streaming request and time it (TTFT, gaps between token chunks, e2e)."""
    rec = RequestRecord(prompt_tokens=req.prompt_len, requested_output_tokens=req.output_len)
    path, body = build_payload(t, req)
    st = StreamState()
    t0 = last = time.perf_counter()
    rec.start = t0 - run_start
    got_first = False
    try:
        async with session.post(t.base_url + path, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for data in iter_sse(resp):
                now = time.perf_counter()
                if data is None:
                    break
                if apply_chunk(t.backend, data, st):
                    if got_first:
                        rec.itl.append(now - last)
                    else:
                        rec.ttft, got_first = now - t0, True
                    last = now
        rec.e2e = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  (every failure is a failed request)
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    return _finish_record(rec, st, got_first)


def _finish_record(rec: RequestRecord, st: StreamState, got_first: bool) -> RequestRecord:
    rec.generated_text = st.text
    rec.output_tokens = st.completion_tokens or 0
    if st.prompt_tokens:
        rec.prompt_tokens = st.prompt_tokens
    if st.error:
        rec.error = st.error
    elif not got_first:
        rec.error = "no output tokens"
    rec.success = not rec.error
    return rec


def count_missing_tokens(records: Sequence[RequestRecord], tokenizer: Any) -> None:
    """Output tokens by tokenizing the text, for servers that reported no usage."""
    for r in records:
        if r.success and r.output_tokens == 0:
            r.output_tokens = max(1, len(encode(tokenizer, r.generated_text)))


# --------------------------------------------------------------------------- load

def arrival_offsets(reqs: Sequence[BenchRequest], rate: float, seed: int) -> list[float]:
    """Send times (s after start): the trace's, all zero for rate=inf, else Poisson."""
    if reqs and all(r.arrival_time is not None for r in reqs):
        return [float(r.arrival_time) for r in reqs]  # type: ignore[arg-type]
    if math.isinf(rate) or rate <= 0:
        return [0.0] * len(reqs)
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=len(reqs))
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()[: len(reqs)]


async def _fetch_model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get(base_url + "/v1/models") as resp:
            data = await resp.json()
        return str(data["data"][0]["id"])
    except Exception:  # noqa: BLE001
        return "default"


async def _warmup(session: aiohttp.ClientSession, t: Target,
                  reqs: Sequence[BenchRequest]) -> None:
    if not reqs:
        return
    recs = [await send_request(session, t, r, time.perf_counter()) for r in reqs]
    if not any(r.success for r in recs):
        raise SystemExit(f"warmup failed against {t.base_url}: {recs[0].error}")


async def run_load(session: aiohttp.ClientSession, t: Target, reqs: Sequence[BenchRequest],
                   offsets: Sequence[float], max_concurrency: Optional[int],
                   disable_tqdm: bool = False) -> tuple[list[RequestRecord], float]:
    """Send ``reqs`` at ``offsets``, at most ``max_concurrency`` in flight; (records, s)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(reqs), disable=disable_tqdm, desc="bench", unit="req")
    start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestRecord:
        if sem is None:
            rec = await send_request(session, t, req, start)
        else:
            async with sem:
                rec = await send_request(session, t, req, start)
        bar.update(1)
        return rec

    tasks = []
    for req, off in zip(reqs, offsets):
        delay = start + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return records, duration


async def bench_async(ns: argparse.Namespace, t: Target, warm: Sequence[BenchRequest],
                      reqs: Sequence[BenchRequest]) -> tuple[list[RequestRecord], float]:
    timeout = aiohttp.ClientTimeout(total=ns.timeout)
    conn = aiohttp.TCPConnector(limit=0)
    headers = bearer_headers(ns.api_key)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn, headers=headers,
                                     trust_env=False) as session:
        if t.backend not in GENERATE_BACKENDS and not ns.model:
            t.model = await _fetch_model_name(session, t.base_url)
        await _warmup(session, t, warm)
        offsets = arrival_offsets(reqs, ns.request_rate, ns.seed)
        return await run_load(session, t, reqs, offsets, ns.max_concurrency, ns.disable_tqdm)


# --------------------------------------------------------------------------- CLI

def add_bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `tidal bench` flags."""
    a = p.add_argument
    a("--backend", choices=BACKENDS, default="tidal",
      help="request format: tidal/sglang use /generate, openai /v1/completions, openai-chat /v1/chat/completions")
    a("--url", default="http://127.0.0.1:30000", help="server base URL")
    a("--api-key", default=None, help="Bearer key sent with every request (default: $TIDAL_API_KEY, else none)")
    a("--model", default=None, help="model name for openai backends (default: /v1/models)")
    a("--dataset", choices=DATASETS, default="random",
      help="random prompts of fixed lengths, or a replay of the shipped Azure LLM trace 2023")
    a("--dataset-path", default=None,
      help="Azure trace CSV or directory (default: the trace shipped in tidal/bench/data)")
    a("--num-prompts", type=int, default=200, help="measured requests (after the warm-up ones)")
    a("--random-input-len", type=int, default=512, help="random dataset: prompt tokens")
    a("--random-output-len", type=int, default=128, help="random dataset: output tokens")
    a("--random-range-ratio", type=float, default=0.0,
      help="lengths are uniform in [len*ratio, len]")
    a("--trace-speedup", type=float, default=1.0, help="divide trace inter-arrivals by this")
    a("--trace-offset", type=int, default=0, help="skip this many trace rows")
    a("--max-input-len", type=int, default=None, help="cap trace prompt lengths (default: no cap)")
    a("--max-output-len", type=int, default=None, help="cap trace output lengths (default: no cap)")
    a("--request-rate", type=float, default=float("inf"),
      help="Poisson req/s (inf: all at once); trace datasets use the trace arrivals")
    a("--max-concurrency", type=int, default=None,
      help="requests in flight at most (default: no limit)")
    a("--warmup-requests", type=int, default=1, help="requests sent and discarded before measuring")
    a("--seed", type=int, default=1, help="seed for prompts and Poisson arrivals")
    a("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
      help="ask the server to generate exactly the requested output length")
    a("--temperature", type=float, default=0.0, help="sampling temperature sent with each request")
    a("--extra-request-body", default=None, metavar="JSON",
      help="JSON object merged into every request, e.g. '{\"regex\": \"[a-z ]+\"}' or "
           "'{\"response_format\": {\"type\": \"json_object\"}}'; for tidal/sglang, sampling parameter "
           "keys go into sampling_params (default: none)")
    a("--tokenizer", default=None, help="HF dir/name or .gguf (default: the default model)")
    a("--send-input-ids", action=argparse.BooleanOptionalAction, default=None,
      help="send token ids instead of text (default: on for tidal/sglang)")
    a("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS",
      help="SLOs, e.g. ttft:500 tpot:50 e2e:5000 (default: none, no goodput reported)")
    a("--output-file", default=None, help="write results JSON here (default: print only)")
    a("--plot", default=None, help="write a latency plot (PNG) here (default: no plot)")
    a("--save-text", action="store_true", help="keep generated text in the JSON")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def _make_target(ns: argparse.Namespace) -> Target:
    send_ids = ns.send_input_ids
    if send_ids is None:
        send_ids = ns.backend in GENERATE_BACKENDS
    return Target(backend=ns.backend, base_url=ns.url.rstrip("/"), model=ns.model or "default",
                  send_ids=bool(send_ids), temperature=ns.temperature,
                  ignore_eos=bool(ns.ignore_eos), extra_body=_extra_body(ns.extra_request_body))


def _extra_body(text: Optional[str]) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--extra-request-body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit("--extra-request-body must be a JSON object")
    return value


def _config(ns: argparse.Namespace, t: Target, nonce: list[int]) -> dict[str, Any]:
    cfg = mask_secrets({k: v for k, v in vars(ns).items() if not callable(v) and not k.startswith("_")})
    if math.isinf(cfg.get("request_rate", 0.0)):
        cfg["request_rate"] = "inf"
    cfg.update(model=t.model, send_input_ids=t.send_ids, nonce=nonce)
    return cfg


def run_bench(ns: argparse.Namespace, tokenizer: Any = None) -> dict[str, Any]:
    """Run the benchmark described by ``ns`` (from ``add_bench_args``); the results dict."""
    keys_from_env(ns)
    slos = parse_goodput(ns.goodput)
    tok = tokenizer if tokenizer is not None else get_tokenizer(ns.tokenizer)
    t = _make_target(ns)
    all_reqs, nonce = build_requests(ns, tok, t.send_ids)
    warm, reqs = all_reqs[: ns.warmup_requests], all_reqs[ns.warmup_requests:]
    records, duration = asyncio.run(bench_async(ns, t, warm, reqs))
    count_missing_tokens(records, tok)
    metrics = compute_metrics(records, duration, slos)
    result = {"config": _config(ns, t, nonce), **metrics,
              "requests": [r.to_json(ns.save_text) for r in records]}
    print(format_table(metrics))
    errors = sorted({r.error for r in records if r.error})
    if errors:
        print(f"errors ({len(errors)} kinds), e.g.: {errors[0]}", file=sys.stderr)
    _write_outputs(ns, result, records)
    return result


def _write_outputs(ns: argparse.Namespace, result: dict[str, Any],
                   records: Sequence[RequestRecord]) -> None:
    if ns.output_file:
        with open(ns.output_file, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if ns.plot:
        from tidal.bench.plot import plot_results

        plot_results(records, ns.plot, title=f"{ns.backend} {ns.dataset} {ns.url}")


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="tidal bench", description=__doc__, formatter_class=DefaultsHelpFormatter)
    add_bench_args(p)
    return run_bench(p.parse_args(argv))
