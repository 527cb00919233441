"""Speculative decoding's speedup: a server without it and one with `--speculative-algorithm
NGRAM` (or STANDALONE, its draft the default model's first `--draft-layers` layers, written by
tidal.spec.truncated_draft), both up at once on the default model, sent the same greedy requests
in alternating rounds (one server busy at a time), at each concurrency, on two workloads:

- copy: prompts whose continuation repeats text they contain (a passage asked for again,
  a function written out again with one name changed): what prompt lookup is for;
- open: open-ended prompts, where guesses seldom hold.

    python -m tidal.bench.spec [--concurrency 1,8] [--rounds 3] [--max-new-tokens 96]
    python -m tidal.bench.spec --algorithm STANDALONE --draft-layers 8

Prints one JSON line per (workload, concurrency): output tok/s medians of each server, the
speedup, and the accept length (tokens per request and verification pass) of the rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import time

import httpx

from tidal.bench.procs import serving

PASSAGE = ("The harbour wakes before the town does. Fishing boats slip their moorings in the grey light, "
           "gulls circle the cannery roof, and the baker on Quay Street pulls the first loaves from his oven "
           "while the church clock still reads a quarter to five.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n")
WORKLOADS = {
    "copy": [
        f"Text: {PASSAGE}\n\nThe same text, copied exactly:\n",
        f"{CODE}\n# The same function again, renamed to average:\n",
        "Numbers: 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79.\nThe numbers again: 3, 14,",
        f"Quote: \"{PASSAGE[:120]}\"\nRepeat the quote: \"",
    ],
    "open": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a refrigerator keeps food cold, for a ten-year-old.",
        "List some ideas for a rainy weekend at home, with a sentence on each.",
        "Describe the city of Lisbon to someone who has never been there.",
    ],
}


def _generate(url: str, text: str, n: int) -> int:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["meta_info"]["completion_tokens"]


def _round(url: str, prompts: list[str], concurrency: int, n: int) -> float:
    """Output tokens per second of `concurrency` requests sent at once (the prompts cycled)."""
    texts = [prompts[i % len(prompts)] for i in range(concurrency)]
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda s: _generate(url, s, n), texts))
    return tokens / (time.perf_counter() - t)


def _spec_counters(url: str) -> tuple[int, int]:
    st = httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]
    steps, length = st["spec_verify_steps"], st["spec_accept_length"]
    return steps, round(steps * length)


def _server(port: int, extra: list[str], threads: int) -> list[str]:
    return [sys.executable, "-m", "tidal.launch_server", "--port", str(port), "--torch-threads", str(threads),
            "--max-total-tokens", "16384", *extra]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--port", type=int, default=31870)
    p.add_argument("--algorithm", default="NGRAM", choices=["NGRAM", "STANDALONE"])
    p.add_argument("--draft-layers", type=int, default=8, help="STANDALONE: the draft's layers (the target's first)")
    a = p.parse_args()
    spec = ["--speculative-algorithm", a.algorithm, "--speculative-num-draft-tokens", str(a.num_draft_tokens)]
    if a.algorithm == "STANDALONE":
        from tidal.config import default_model_path
        from tidal.spec.truncated_draft import truncate_gguf

        draft = truncate_gguf(default_model_path(), f"/tmp/tidal-bench-draft-{a.draft_layers}.gguf", a.draft_layers)
        spec += ["--speculative-draft-model-path", draft]
    plain_url, spec_url = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{a.port + 1}"
    with serving(_server(a.port, [], a.torch_threads), plain_url, "/tmp/tidal-bench-spec-plain.log"), \
            serving(_server(a.port + 1, spec, a.torch_threads), spec_url, f"/tmp/tidal-bench-spec-{a.algorithm.lower()}.log"):
        for url in (plain_url, spec_url):  # warm-up
            _round(url, WORKLOADS["open"], 2, 8)
        for workload, prompts in WORKLOADS.items():
            for c in (int(x) for x in a.concurrency.split(",")):
                plain, fast = [], []
                steps0, gained0 = _spec_counters(spec_url)
                for _ in range(a.rounds):
                    plain.append(_round(plain_url, prompts, c, a.max_new_tokens))
                    fast.append(_round(spec_url, prompts, c, a.max_new_tokens))
                steps1, gained1 = _spec_counters(spec_url)
                base, sped = statistics.median(plain), statistics.median(fast)
                print(json.dumps({
                    "workload": workload, "concurrency": c, "plain_tok_s": round(base, 1),
                    "algorithm": a.algorithm, "spec_tok_s": round(sped, 1), "speedup": round(sped / base, 2),
                    "accept_length": round((gained1 - gained0) / max(steps1 - steps0, 1), 2),
                }), flush=True)


if __name__ == "__main__":
    main()
