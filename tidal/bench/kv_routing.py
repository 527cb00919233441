"""How much of each prompt the workers find cached under each router policy: the same shared-prefix workload
(groups of requests that share a long system prompt, shuffled, a few at a time) through `tidal router` with
each policy in turn, against the same tidal servers (their caches flushed between policies). The servers
publish KV events (kv_aware follows them); a small KV pool per server makes prefixes compete for room.

    python -m tidal.bench.kv_routing --servers 3 --groups 9 --per-group 6

Prints one JSON line per policy: the cached share of prompt tokens, the latency's p50 and p90, the wall time,
and kv_aware's own count of the hits it expected.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import random
import socket
import statistics
import sys
import time

import httpx

from tidal.bench.procs import serving

KV_EVENTS = '{"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
TOPICS = ["Roman history", "Python code review", "French cooking", "orbital mechanics", "tax law", "jazz theory",
          "gardening", "chess openings", "medieval poetry", "network security", "marine biology", "typography"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(groups: int, per_group: int, prefix_repeats: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        system = (f"You are an expert on {TOPICS[g % len(TOPICS)]} (desk {g}). Answer carefully, cite what you "
                  f"know, and keep to the subject. ") * prefix_repeats
        prompts += [f"{system}Question {i}: what is the most important idea here?" for i in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def _process(cmd: list[str], port: int, log: str):
    return serving(cmd, f"http://127.0.0.1:{port}", log)


def run_policy(policy: str, workers: list[str], prompts: list[str], concurrency: int, max_new_tokens: int,
               model_path: str, kv_load_weight: float = 1.0) -> dict:
    for w in workers:
        httpx.post(w + "/flush_cache", timeout=30)
    port = _free_port()
    cmd = [sys.executable, "-m", "tidal.router", "--port", str(port), "--policy", policy,
           "--health-check-interval-secs", "1", "--log-level", "warning", "--model-path", model_path,
           "--kv-load-weight", str(kv_load_weight)]
    for w in workers:
        cmd += ["--worker", w]
    with _process(cmd, port, f"/tmp/tidal-bench-router-{policy}.log") as url:
        if policy == "kv_aware":  # every view in sync before the first request
            deadline = time.time() + 60
            while time.time() < deadline and not all(
                    (w.get("kv_events") or {}).get("synced") for w in httpx.get(url + "/workers").json()["workers"]):
                time.sleep(0.2)

        def one(text: str) -> tuple[float, int, int]:
            t0 = time.perf_counter()
            r = httpx.post(url + "/generate", json={"text": text, "sampling_params": {
                "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}, timeout=300)
            r.raise_for_status()
            meta = r.json()["meta_info"]
            return time.perf_counter() - t0, meta["cached_tokens"], meta["prompt_tokens"]

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        stats = httpx.get(url + "/workers").json().get("policies", {}).get("null")
    lat = sorted(r[0] for r in results)
    cached, total = sum(r[1] for r in results), sum(r[2] for r in results)
    out = {"policy": policy, "requests": len(results), "cached_share": round(cached / total, 4),
           "cached_tokens": cached, "prompt_tokens": total, "latency_p50_s": round(statistics.median(lat), 4),
           "latency_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 4), "wall_s": round(wall, 2)}
    if stats:
        out["kv_aware_expected_cached"] = stats["expected_cached_tokens"]
        out["kv_aware_fallbacks"] = stats["fallbacks"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.kv_routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--groups", type=int, default=9, help="distinct shared prefixes")
    p.add_argument("--per-group", type=int, default=6, help="requests per prefix")
    p.add_argument("--prefix-repeats", type=int, default=6, help="sentences per system prompt (~24 tokens each)")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=1536, help="KV pool of each server, in tokens")
    p.add_argument("--policies", default="round_robin,cache_aware,kv_aware")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default=None, help="default: the default model")
    p.add_argument("--kv-load-weight", type=float, default=0.25, help="the router's, for kv_aware")
    ns = p.parse_args(argv)
    from tidal.config import default_model_path

    model = ns.model_path or default_model_path()
    prompts = workload(ns.groups, ns.per_group, ns.prefix_repeats, ns.seed)
    with contextlib.ExitStack() as stack:
        workers = []
        for i in range(ns.servers):
            port = _free_port()
            cmd = [sys.executable, "-m", "tidal.launch_server", "--port", str(port), "--torch-threads", "1",
                   "--model-path", model, "--page-size", "16", "--max-total-tokens", str(ns.max_total_tokens),
                   "--kv-events-config", KV_EVENTS, "--disable-cpu-pinning"]
            workers.append(stack.enter_context(_process(cmd, port, f"/tmp/tidal-bench-worker-{i}.log")))
        for policy in ns.policies.split(","):
            print(json.dumps(run_policy(policy, workers, prompts, ns.concurrency, ns.max_new_tokens, model, ns.kv_load_weight)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
