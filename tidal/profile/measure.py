"""The measurement of one live tidal server over HTTP (`tidal profile`).

- prefill: one request of N random token ids (unique per request, so the prefix cache
  cannot serve any of it) with max_new_tokens=1; its time is the server's own
  `meta_info.e2e_latency` (arrival in the API process to the first token), else the
  client's wall time. One warm-up per size, then the median of the repeats. Repeats run in
  rounds over the whole grid (here and for decode), so a slow spell on a shared host touches
  every point alike.
- prefill_batch: K prompts of N tokens in one batch /generate (the scheduler takes them in one
  step), for every K of --prefill-batches and N of --prefill-tokens with K x N within one
  prefill step (the chunked-prefill size and --max-prefill-tokens); its time is the slowest
  prompt's `e2e_latency`. Rounds and medians as for prefill.
- decode: B concurrent streamed requests of L-token prompts with ignore_eos. The server
  exposes no per-step timing (scheduler/step_timing.py logs only at DEBUG, /metrics has a
  bucketed inter-token histogram), so the step time is the median client-side inter-token
  interval in the steady state: after every request got its first token and before the first
  one finished. context_tokens is B times the mean KV length over those intervals.
- kv_transfer (opt-in, with a decode peer and --measure-switch): the server in prefill mode
  serves one cached prompt per length in turn with a real hand-off to the decode peer (both
  get the request with the same bootstrap room, as the router sends it) and with a fake one
  (bootstrap host 2.2.2.2: nothing moves). The prompt being cached, both prefill about one
  token, and every page is sent either way; the hand-off time is the difference of the
  medians of the server's `e2e_latency` (its reply leaves once the transfer succeeded), the
  bytes the growth of the server's `transfer_bytes` counter.
- switch (opt-in, it changes the server's mode): every direction between null, prefill and
  decode once, timed by the server's reply (`timings_ms.switch`); the idle drain cost is the
  client round trip of those drained switch requests minus the switch itself. The original
  mode is restored at the end, whatever happened.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import random
import statistics
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import httpx

from tidal.config import bearer_headers, prefill_step_tokens
from tidal.cpus import cpu_flags
from tidal.profile.schema import (
    VERSION,
    DecodePoint,
    Drain,
    KVTransferPoint,
    PrefillBatchPoint,
    PrefillPoint,
    Profile,
    ServerInfo,
    SwitchPoint,
)

SWITCH_WALK = ("prefill", "decode", "null", "decode", "prefill", "null")  # every direction once, from null
LOWEST_PROMPT_ID = 1000  # random prompts stay clear of special and byte tokens
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # tidal.transfer's fake hand-off: the prefill role's path, nothing moves


class ProfileError(Exception):
    """A measurement that cannot go on; the message says why, for the command line."""


@dataclass
class Options:
    url: str
    prefill_tokens: list[int]
    decode_batches: list[int]  # [] = default_decode_batches(the server's facts)
    decode_contexts: list[int]
    prefill_batches: list[int] = field(default_factory=lambda: [2, 4, 8])
    decode_tokens: int = 32
    repeats: int = 3
    timeout_s: float = 120.0
    measure_switch: bool = False
    decode_url: Optional[str] = None
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    log: Callable[[str], None] = print
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ HTTP


def _server_message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("message"):
            return str(body["message"])
    return r.text[:300]


class Http:
    """One server's HTTP API; every failure becomes a ProfileError naming the call."""

    def __init__(self, url: str, timeout_s: float, api_key: Optional[str], admin_api_key: Optional[str]):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.headers = bearer_headers(api_key)
        self.admin_headers = bearer_headers(admin_api_key or api_key)
        self.client = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self.client.close()

    def call(self, method: str, path: str, body: Any = None, admin: bool = False) -> Any:
        headers = self.admin_headers if admin else self.headers
        try:
            r = self.client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as e:
            raise ProfileError(self.explain(method, path, e)) from None
        if r.status_code != 200:
            raise ProfileError(f"{method} {self.url}{path}: HTTP {r.status_code}: {_server_message(r)}")
        try:
            return r.json()
        except ValueError:
            raise ProfileError(f"{method} {self.url}{path}: the answer is not JSON: {r.text[:200]!r}") from None

    def explain(self, method: str, path: str, e: Exception) -> str:
        if isinstance(e, httpx.TimeoutException):
            return f"{method} {self.url}{path}: no answer within {self.timeout_s:g}s (--timeout-s)"
        if isinstance(e, httpx.ConnectError):
            return f"cannot connect to {self.url}: {e}; is the server running?"
        return f"{method} {self.url}{path} failed: {type(e).__name__}: {e}"


# ------------------------------------------------------------------ the server


@dataclass
class ServerFacts:
    info: ServerInfo
    mode: str
    switchable: bool
    vocab_size: int
    context_length: int
    max_input_tokens: int
    max_running_requests: int
    bootstrap_port: Optional[int] = None


def read_server(http: Http) -> ServerFacts:
    info = http.call("GET", "/server_info")
    sched = info.get("scheduler_info") if isinstance(info, dict) else None
    if not sched:
        raise ProfileError(f"{http.url}/server_info has no scheduler_info: not a tidal server, or not ready yet")
    try:
        return _server_facts(http, info, sched)
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{http.url}/server_info lacks what a tidal server reports ({type(e).__name__}: {e})") \
            from None


def _server_facts(http: Http, info: dict, sched: dict) -> ServerFacts:
    model = info.get("served_model_name") or http.call("GET", "/get_model_info").get("served_model_name", "")
    server = ServerInfo(
        url=http.url, model=str(model), quantization=str(sched.get("quantization", "none")),
        dtype=str(sched["dtype"]), torch_threads=int(sched.get("torch_threads") or 0), cpu_flags=cpu_flags(),
        page_size=int(sched["page_size"]), max_total_tokens=int(sched["max_total_tokens"]),
        max_running_requests=int(sched["max_running_requests"]), prefill_step_tokens=_prefill_step_tokens(info),
        transfer_backend=str(info.get("disaggregation_transfer_backend", "")))
    return ServerFacts(server, str(info.get("disaggregation_mode", "null")),
                       bool(info.get("enable_dynamic_disaggregation")), int(sched["vocab_size"]),
                       int(sched["context_length"]), int(sched["max_req_input_len"]),
                       int(sched["max_running_requests"]), info.get("disaggregation_bootstrap_port"))


def _prefill_step_tokens(info: dict) -> int:
    return prefill_step_tokens(int(info.get("chunked_prefill_size") or -1), int(info.get("max_prefill_tokens") or 0))


def default_decode_batches(facts: ServerFacts, longest: int) -> list[int]:
    """1, 4, 8, then doubling up to the server's max running requests (itself the last point), each batch's
    longest run fitting in the KV pool: the cost model should not have to extrapolate past the batches the
    server runs (from batch 16 an extrapolated step was 2-3.5x the measured one at 32 and 64)."""
    top = min(facts.max_running_requests, facts.info.max_total_tokens // max(1, longest))
    out, b = [], 1
    while b < top:
        out.append(b)
        b = 4 if b == 1 else 2 * b
    return out + [max(1, top)]


def check_grid(opts: Options, facts: ServerFacts) -> None:
    """Refuses, before measuring anything, a grid the server cannot hold."""
    too_long = [n for n in opts.prefill_tokens if n > facts.max_input_tokens]
    if too_long:
        raise ProfileError(f"--prefill-tokens {too_long} exceed the server's longest prompt "
                           f"({facts.max_input_tokens} tokens)")
    if facts.vocab_size <= 2 * LOWEST_PROMPT_ID:
        raise ProfileError(f"the vocabulary ({facts.vocab_size}) is too small for random prompts")
    longest = max(opts.decode_contexts) + opts.decode_tokens
    if longest > facts.context_length:
        raise ProfileError(f"--decode-contexts {max(opts.decode_contexts)} + --decode-tokens {opts.decode_tokens} "
                           f"exceed the context length {facts.context_length}")
    if max(opts.decode_batches) > facts.max_running_requests:
        raise ProfileError(f"--decode-batches {max(opts.decode_batches)} exceeds the server's max running "
                           f"requests ({facts.max_running_requests})")
    biggest = max(opts.decode_batches) * longest
    if biggest > facts.info.max_total_tokens:
        raise ProfileError(f"the largest decode run needs {biggest} KV tokens; the server holds "
                           f"{facts.info.max_total_tokens} (lower --decode-batches or --decode-contexts)")


def warn_if_busy(http: Http, opts: Options) -> None:
    load = http.call("GET", "/get_load")
    busy = sum(int(x.get("num_reqs", 0)) for x in load) if isinstance(load, list) else 0
    if busy:
        opts.log(f"warning: the server has {busy} requests in flight; other traffic ends up in the numbers")


def current_mode(http: Http) -> str:
    return str(http.call("GET", "/server_info").get("disaggregation_mode", "null"))


# ------------------------------------------------------------------ prefill


def random_prompt(rng: random.Random, tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(LOWEST_PROMPT_ID, vocab_size) for _ in range(tokens)]


def prefill_once(http: Http, prompts: list[list[int]]) -> float:
    """Seconds to prefill these prompts sent as one request: the slowest one's `e2e_latency`
    (arrival in the API process to its first token), else the client's wall time."""
    ids: Any = prompts if len(prompts) > 1 else prompts[0]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    t0 = time.perf_counter()
    out = http.call("POST", "/generate", body)
    wall = time.perf_counter() - t0
    replies = out if isinstance(out, list) else [out]
    e2e = [r.get("meta_info", {}).get("e2e_latency") if isinstance(r, dict) else None for r in replies]
    if len(e2e) != len(prompts) or any(x is None for x in e2e):
        return wall
    return max(float(x) for x in e2e)


def _median_rounds(http: Http, opts: Options, cells: list[tuple[int, int]], vocab_size: int,
                   rng: random.Random) -> dict[tuple[int, int], float]:
    """(batch, tokens) -> median seconds: a warm-up per cell, then `repeats` rounds over every cell
    (so a slow spell on a shared host touches every cell alike)."""
    def once(batch: int, tokens: int) -> float:
        return prefill_once(http, [random_prompt(rng, tokens, vocab_size) for _ in range(batch)])

    for cell in cells:
        once(*cell)
    times: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for _ in range(opts.repeats):
        for cell in cells:
            times[cell].append(once(*cell))
    return {cell: statistics.median(t) for cell, t in times.items()}


def measure_prefill(http: Http, opts: Options, vocab_size: int, rng: random.Random) -> list[PrefillPoint]:
    medians = _median_rounds(http, opts, [(1, n) for n in sorted(set(opts.prefill_tokens))], vocab_size, rng)
    points = []
    for (_, n), seconds in medians.items():
        opts.log(f"prefill {n} tokens: {seconds * 1000:.1f} ms")
        points.append(PrefillPoint(tokens=n, seconds=round(seconds, 6)))
    return points


def prefill_batch_cells(opts: Options, facts: ServerFacts) -> list[tuple[int, int]]:
    """(batch, tokens) for every batch of --prefill-batches above 1 and every prefill length whose
    batch one prefill step takes whole and the server runs at once."""
    return [(k, n) for k in sorted(set(opts.prefill_batches)) if 1 < k <= facts.max_running_requests
            for n in sorted(set(opts.prefill_tokens)) if k * n <= facts.info.prefill_step_tokens]


def measure_prefill_batches(http: Http, opts: Options, facts: ServerFacts,
                            rng: random.Random) -> list[PrefillBatchPoint]:
    cells = prefill_batch_cells(opts, facts)
    if not cells and all(k <= 1 for k in opts.prefill_batches):
        return []  # none asked for
    if not cells:
        opts.notes.append("prefill_batch not measured: no batch of --prefill-batches fits one prefill step "
                          f"({facts.info.prefill_step_tokens} tokens); a batch costs as one prompt of its total length")
        return []
    points = []
    for (k, n), seconds in _median_rounds(http, opts, cells, facts.vocab_size, rng).items():
        opts.log(f"prefill {k} x {n} tokens in one step: {seconds * 1000:.1f} ms")
        points.append(PrefillBatchPoint(batch=k, tokens=n, seconds=round(seconds, 6)))
    return points


# ------------------------------------------------------------------ decode

Stream = list[tuple[float, int]]  # (arrival time, output tokens so far) per SSE event


async def _stream_one(client: httpx.AsyncClient, http: Http, prompt: list[int], new_tokens: int) -> Stream:
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    events: Stream = []
    async with client.stream("POST", "/generate", json=body, headers=http.headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise ProfileError(f"POST {http.url}/generate (stream): HTTP {r.status_code}: {_server_message(r)}")
        async for line in r.aiter_lines():
            now = time.perf_counter()
            payload = line[5:].strip() if line.startswith("data:") else ""
            if not payload or payload == "[DONE]":
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise ProfileError(f"POST {http.url}/generate (stream): not a JSON event: {payload[:200]!r}") from None
            if "error" in chunk:
                raise ProfileError(f"POST {http.url}/generate (stream): {chunk['error']}")
            events.append((now, len(chunk.get("output_ids", []))))
    if not events or events[-1][1] != new_tokens:
        got = events[-1][1] if events else 0
        raise ProfileError(f"a decode request ended after {got} of {new_tokens} tokens")
    return events


async def _decode_run_async(http: Http, prompts: list[list[int]], new_tokens: int) -> list[Stream]:
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=http.url, timeout=http.timeout_s, limits=limits) as client:
        return list(await asyncio.gather(*(_stream_one(client, http, p, new_tokens) for p in prompts)))


def decode_run(http: Http, prompts: list[list[int]], new_tokens: int) -> list[Stream]:
    try:
        return asyncio.run(_decode_run_async(http, prompts, new_tokens))
    except httpx.HTTPError as e:
        raise ProfileError(http.explain("POST", "/generate (stream)", e)) from None


def steady_intervals(streams: list[Stream], prompt_tokens: int) -> tuple[list[float], list[int]]:
    """Per-token intervals while every request of the batch was decoding, and the KV length
    of the request at each (a token n, 1-based, comes from a step over prompt + n - 1 tokens).
    An event that carries k tokens counts as k intervals of 1/k of its gap."""
    all_running = max(s[0][0] for s in streams)
    first_done = min(s[-1][0] for s in streams)
    intervals: list[float] = []
    kv_lengths: list[int] = []
    for s in streams:
        for (t0, n0), (t1, n1) in zip(s, s[1:]):
            if t0 >= all_running and t1 <= first_done and n1 > n0:
                intervals += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
                kv_lengths += [prompt_tokens + n - 1 for n in range(n0 + 1, n1 + 1)]
    return intervals, kv_lengths


def decode_point(batch: int, context: int, intervals: list[float], kv_lengths: list[int],
                 opts: Options) -> DecodePoint:
    if not intervals:
        raise ProfileError(f"decode batch {batch} x {context} tokens: the requests never decoded together; "
                           f"raise --decode-tokens (now {opts.decode_tokens})")
    step = statistics.median(intervals)
    total_context = round(batch * statistics.fmean(kv_lengths))
    opts.log(f"decode batch {batch}, {context}-token prompts (context {total_context} tokens): "
             f"{step * 1000:.2f} ms/step over {len(intervals)} intervals")
    return DecodePoint(batch=batch, context_tokens=total_context, step_seconds=round(step, 6))


def measure_decode(http: Http, opts: Options, vocab_size: int, rng: random.Random) -> list[DecodePoint]:
    """A warm-up run, then `repeats` rounds over every (batch, prompt length) cell, each cell with
    its own prompts in every round (only decode steps are timed, so a prompt served from the
    prefix cache in later rounds changes nothing); per cell the median of all its intervals."""
    warm = [random_prompt(rng, min(opts.decode_contexts), vocab_size) for _ in range(max(opts.decode_batches))]
    decode_run(http, warm, opts.decode_tokens)
    cells = [(b, c) for b in sorted(set(opts.decode_batches)) for c in sorted(set(opts.decode_contexts))]
    prompts = {(b, c): [random_prompt(rng, c, vocab_size) for _ in range(b)] for b, c in cells}
    samples: dict[tuple[int, int], tuple[list[float], list[int]]] = {cell: ([], []) for cell in cells}
    for _ in range(opts.repeats):
        for b, c in cells:
            intervals, kv_lengths = steady_intervals(decode_run(http, prompts[(b, c)], opts.decode_tokens), c)
            samples[(b, c)][0].extend(intervals)
            samples[(b, c)][1].extend(kv_lengths)
    return [decode_point(b, c, *samples[(b, c)], opts) for b, c in cells]


# ------------------------------------------------------------------ KV transfer


def transfer_bytes(http: Http) -> int:
    states = http.call("GET", "/server_info").get("internal_states") or []
    if not states:
        raise ProfileError(f"{http.url}/server_info has no scheduler statistics (internal_states)")
    return int(states[0].get("transfer_bytes", 0))


def _handoff_body(prompt: list[int], host: str, port: Optional[int], rng: random.Random) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rng.randrange(2**62)}


def _e2e(reply: Any) -> float:
    try:
        return float(reply["meta_info"]["e2e_latency"])
    except (KeyError, TypeError, ValueError):
        raise ProfileError(f"a /generate reply without meta_info.e2e_latency: {str(reply)[:200]}") from None


def fake_handoff(http: Http, prompt: list[int], port: Optional[int], rng: random.Random) -> float:
    return _e2e(http.call("POST", "/generate", _handoff_body(prompt, FAKE_BOOTSTRAP_HOST, port, rng)))


def real_handoff(http: Http, decode: Http, prompt: list[int], port: Optional[int],
                 rng: random.Random) -> tuple[float, int]:
    """(the prefill server's e2e seconds, bytes it sent) of one request handed to the decode peer."""
    body = _handoff_body(prompt, urllib.parse.urlsplit(http.url).hostname or "127.0.0.1", port, rng)
    before = transfer_bytes(http)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        to_decode = pool.submit(decode.call, "POST", "/generate", body)
        seconds = _e2e(http.call("POST", "/generate", body))
        to_decode.result()
    return seconds, transfer_bytes(http) - before


def check_decode_peer(decode: Http, facts: ServerFacts, opts: Options) -> None:
    peer = read_server(decode)
    if peer.mode != "decode":
        raise ProfileError(f"--decode-url {decode.url} is in {peer.mode} mode, not decode")
    if peer.info.transfer_backend != facts.info.transfer_backend:
        raise ProfileError(f"the decode peer uses the {peer.info.transfer_backend} transfer backend, the server "
                           f"{facts.info.transfer_backend}")
    if peer.info.page_size != facts.info.page_size:
        raise ProfileError(f"page sizes differ: server {facts.info.page_size}, decode peer {peer.info.page_size}")
    too_long = [n for n in opts.prefill_tokens if n > peer.max_input_tokens]
    if too_long:
        raise ProfileError(f"--prefill-tokens {too_long} exceed the decode peer's longest prompt "
                           f"({peer.max_input_tokens} tokens)")


def measure_kv_transfer(http: Http, decode: Http, opts: Options, facts: ServerFacts,
                        rng: random.Random) -> list[KVTransferPoint]:
    """Needs the server in prefill mode. One prompt per length, in the server's prefix cache after
    the warm-up, so both kinds of hand-off prefill about one token and differ by the transfer of
    the whole prompt's KV (every page is sent, cached or not). Real and fake hand-offs alternate."""
    port, points = facts.bootstrap_port, []
    for n in sorted(set(opts.prefill_tokens)):
        prompt = random_prompt(rng, n, facts.vocab_size)
        fake_handoff(http, prompt, port, rng)
        real_handoff(http, decode, prompt, port, rng)
        real, fake, sizes = [], [], []
        for _ in range(opts.repeats):
            seconds, size = real_handoff(http, decode, prompt, port, rng)
            real.append(seconds)
            sizes.append(size)
            fake.append(fake_handoff(http, prompt, port, rng))
        seconds = max(statistics.median(real) - statistics.median(fake), 0.0)
        size = int(statistics.median(sizes))
        opts.log(f"kv transfer {n} tokens: {seconds * 1000:.1f} ms, {size} bytes (cached prompt with the hand-off "
                 f"{statistics.median(real) * 1000:.1f} ms, with a fake one {statistics.median(fake) * 1000:.1f} ms)")
        points.append(KVTransferPoint(tokens=n, bytes=size, seconds=round(seconds, 6)))
    return points


# ------------------------------------------------------------------ switch and drain


def switch_to(http: Http, mode: str) -> tuple[float, float]:
    """(the server's switch seconds, the client's round trip seconds) of a drained switch."""
    t0 = time.perf_counter()
    reply = http.call("POST", "/admin/switch_disaggregation_mode",
                      {"mode": mode, "drain": True, "timeout_s": min(float(http.timeout_s), 3600.0)}, admin=True)
    wall = time.perf_counter() - t0
    server_ms = (reply.get("timings_ms") or {}).get("switch")
    return (server_ms / 1000 if server_ms is not None else wall), wall


def switch_walk(http: Http, opts: Options, start: str, timed: bool) -> tuple[list[SwitchPoint], list[float]]:
    """Every direction once (via null first unless the server is there); ends in null.
    The switch points, and what each drained request cost beyond its switch."""
    walk = ([] if start == "null" else ["null"]) + list(SWITCH_WALK)
    points, overheads, mode = [], [], start
    for dst in walk:
        seconds, wall = switch_to(http, dst)
        if timed:
            opts.log(f"switch {mode} -> {dst}: {seconds * 1000:.1f} ms (round trip {wall * 1000:.1f} ms)")
        points.append(SwitchPoint(src=mode, dst=dst, seconds=seconds))
        overheads.append(max(wall - seconds, 0.0))
        mode = dst
    return points, overheads


def measure_switches(http: Http, opts: Options, original: str) -> tuple[list[SwitchPoint], Drain]:
    """A warm-up walk, then `repeats` timed walks: per direction the median switch time;
    the idle drain cost is the median overhead. Leaves the server in null mode."""
    switch_walk(http, opts, original, timed=False)
    times: dict[tuple[str, str], list[float]] = {}
    overheads: list[float] = []
    for _ in range(opts.repeats):
        points, extra = switch_walk(http, opts, "null", timed=True)
        for p in points:
            times.setdefault((p.src, p.dst), []).append(p.seconds)
        overheads += extra
    points = [SwitchPoint(src=src, dst=dst, seconds=round(statistics.median(v), 6)) for (src, dst), v in times.items()]
    return points, Drain(seconds_idle=round(statistics.median(overheads), 6))


def restore_mode(http: Http, original: str, tries: int = 5) -> None:
    """Switch the server back to `original`. A run interrupted in the middle of a switch left that switch to
    finish on the server: a refusal while it does is retried."""
    for attempt in range(tries):
        try:
            if current_mode(http) != original:
                switch_to(http, original)
            break
        except ProfileError:
            if attempt == tries - 1:
                raise
            time.sleep(0.5)
    if current_mode(http) != original:
        raise ProfileError(f"the server did not return to {original} mode")


# ------------------------------------------------------------------ the whole run


def check_flags(opts: Options) -> None:
    """What is wrong with the flags alone, before any server is asked."""
    if opts.decode_url and not opts.measure_switch:
        raise ProfileError("--decode-url needs --measure-switch: the server is switched to prefill mode to hand "
                           "its KV to the decode peer")


def check_options(opts: Options, facts: ServerFacts) -> None:
    if not opts.decode_batches:
        opts.decode_batches = default_decode_batches(facts, max(opts.decode_contexts) + opts.decode_tokens)
    check_grid(opts, facts)
    if opts.measure_switch and not facts.switchable:
        raise ProfileError("--measure-switch needs a server started with --enable-dynamic-disaggregation")
    if not opts.measure_switch and facts.mode != "null":
        raise ProfileError(f"the server is in {facts.mode} mode; profile a null-mode server, or pass "
                           f"--measure-switch (it switches to null to measure and back at the end)")


def run_profile(opts: Options) -> Profile:
    check_flags(opts)
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(contextlib.closing(
            Http(opts.url, opts.timeout_s, opts.api_key, opts.admin_api_key)))
        facts = read_server(http)
        check_options(opts, facts)
        warn_if_busy(http, opts)
        decode = None
        if opts.decode_url:
            decode = stack.enter_context(contextlib.closing(
                Http(opts.decode_url, opts.timeout_s, opts.api_key, opts.admin_api_key)))
            check_decode_peer(decode, facts, opts)
        return _measure(http, decode, opts, facts)


def _measure(http: Http, decode: Optional[Http], opts: Options, facts: ServerFacts) -> Profile:
    rng = random.Random(time.time_ns())
    switches, drain, transfers = [], None, []
    try:
        if opts.measure_switch:
            switches, drain = measure_switches(http, opts, facts.mode)
        else:
            opts.notes.append("switch and drain not measured (pass --measure-switch)")
        prefill = measure_prefill(http, opts, facts.vocab_size, rng)
        prefill_batch = measure_prefill_batches(http, opts, facts, rng)
        steps = measure_decode(http, opts, facts.vocab_size, rng)
        if decode is not None:
            switch_to(http, "prefill")
            transfers = measure_kv_transfer(http, decode, opts, facts, rng)
    except BaseException:
        if opts.measure_switch:
            _restore_quietly(http, opts, facts.mode)
        raise
    if opts.measure_switch:
        restore_mode(http, facts.mode)
    if decode is None:
        opts.notes.append("kv_transfer not measured: [] (pass --decode-url with --measure-switch; the cost model "
                          "treats a hand-off as free)")
    return Profile(version=VERSION, measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   server=facts.info, prefill=prefill, prefill_batch=prefill_batch, decode=steps,
                   kv_transfer=transfers, switch=switches, drain=drain)


def _restore_quietly(http: Http, opts: Options, original: str) -> None:
    """After a failure: put the original mode back, or say that it could not be."""
    try:
        restore_mode(http, original)
    except ProfileError as e:
        opts.log(f"warning: could not restore the server's {original} mode: {e}")
