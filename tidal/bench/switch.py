"""Role-switch benchmarks against a running tidal server started with
--enable-dynamic-disaggregation.

  python -m tidal.bench.switch latency --url URL --cycles 30
  python -m tidal.bench.switch drain   --url URL --concurrency 8
  python -m tidal.bench.switch soak    --url URL --cycles 1000
  python -m tidal.bench.switch relaunch [--model-path PATH]

`latency` walks null->prefill->decode->null->decode->prefill->null (all six directions)
and reports the server-side switch time and the client round trip per direction.
`soak` repeats null->prefill->decode->null and samples the scheduler process's threads,
open fds and RSS. `relaunch` times stopping a server and starting one in the other mode
until it answers its first request, the alternative to switching.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Optional

import httpx

from tidal.config import bearer_headers

CYCLE = ["prefill", "decode", "null", "decode", "prefill", "null"]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def switch(url: str, mode: str, key: Optional[str] = None, **kw) -> dict:
    headers = bearer_headers(key)
    t0 = time.perf_counter()
    r = httpx.post(url + "/admin/switch_disaggregation_mode", json={"mode": mode, **kw}, headers=headers, timeout=600)
    body = r.json()
    body["round_trip_ms"] = (time.perf_counter() - t0) * 1000
    if r.status_code != 200:
        raise RuntimeError(f"switch to {mode} failed: HTTP {r.status_code} {body}")
    return body


def current_mode(url: str) -> str:
    return httpx.get(url + "/server_info", timeout=30).json()["disaggregation_mode"]


def bench_latency(url: str, cycles: int, key: Optional[str]) -> dict:
    if current_mode(url) != "null":
        switch(url, "null", key)
    per_dir: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"switch_ms": [], "round_trip_ms": []})
    mode = "null"
    for _ in range(cycles):
        for target in CYCLE:
            body = switch(url, target, key)
            d = per_dir[f"{mode}->{target}"]
            d["switch_ms"].append(body["timings_ms"]["switch"])
            d["round_trip_ms"].append(body["round_trip_ms"])
            mode = target
    return {k: {m: {"p50": _pct(v, 50), "p99": _pct(v, 99), "n": len(v)} for m, v in d.items()}
            for k, d in per_dir.items()}


def _load(url: str, stop: threading.Event, n_tokens: int) -> None:
    body = {"text": "Tell me a long story about the sea.",
            "sampling_params": {"max_new_tokens": n_tokens, "ignore_eos": True, "temperature": 0}}
    with httpx.Client(timeout=600) as c:
        while not stop.is_set():
            c.post(url + "/generate", json=body)


def bench_drain(url: str, concurrency: int, n_tokens: int, key: Optional[str], repeats: int) -> dict:
    if current_mode(url) != "null":
        switch(url, "null", key)
    drains, switches = [], []
    for i in range(repeats):
        stop = threading.Event()
        threads = [threading.Thread(target=_load, args=(url, stop, n_tokens)) for _ in range(concurrency)]
        for t in threads:
            t.start()
        time.sleep(3.0)  # let the batch fill
        stop.set()  # the clients send nothing new; what is in flight must drain
        body = switch(url, "prefill" if i % 2 == 0 else "null", key, drain=True, timeout_s=600)
        drains.append(body["timings_ms"]["drain"])
        switches.append(body["timings_ms"]["switch"])
        for t in threads:
            t.join()
    if current_mode(url) != "null":
        switch(url, "null", key)
    return {"concurrency": concurrency, "max_new_tokens": n_tokens,
            "drain_ms": {"p50": _pct(drains, 50), "max": max(drains)},
            "switch_ms": {"p50": _pct(switches, 50), "max": max(switches)}}


def _scheduler_pids(server_pid: int) -> list[int]:
    """The server's scheduler processes, one per TP rank (not multiprocessing's resource tracker)."""
    children = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    ranks = []
    for c in children:
        with open(f"/proc/{c}/cmdline", "rb") as f:
            cmd = f.read()
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            ranks.append(int(c))
    return sorted(ranks) or [server_pid]


def _sample(pids: list[int]) -> dict:
    """Threads, fds and RSS summed over the scheduler ranks, and per rank."""
    per_rank = [_proc_sample(p) for p in pids]
    total = {k: sum(r[k] for r in per_rank) for k in ("threads", "fds", "rss_mb")}
    return {**total, "per_rank": per_rank} if len(pids) > 1 else total


def _proc_sample(pid: int) -> dict:
    status = open(f"/proc/{pid}/status").read()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"threads": int(fields["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_mb": int(fields["VmRSS"].split()[0]) / 1024}


def bench_soak(url: str, cycles: int, server_pid: int, key: Optional[str]) -> dict:
    pids = _scheduler_pids(server_pid)
    if current_mode(url) != "null":
        switch(url, "null", key)
    samples, t0 = [], time.time()
    for i in range(cycles):
        for mode in ("prefill", "decode", "null"):
            switch(url, mode, key)
        if i % max(cycles // 20, 1) == 0 or i == cycles - 1:
            samples.append({"cycle": i + 1, **_sample(pids)})
    warm = samples[1] if len(samples) > 1 else samples[0]
    return {"cycles": cycles, "seconds": time.time() - t0, "first": samples[0], "after_warmup": warm,
            "last": samples[-1], "samples": samples}


def _wait_first_request(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited while starting")
        try:
            r = httpx.post(url + "/generate", json=body, timeout=5)
            if r.status_code in (200, 400):  # 400: a prefill server answering without bootstrap fields
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError("server did not answer in time")


def bench_relaunch(model_path: Optional[str], repeats: int, port: int) -> dict:
    """Stop a null server, start a prefill server: seconds until it answers a first request."""
    url = f"http://127.0.0.1:{port}"
    base = [sys.executable, "-m", "tidal.launch_server", "--port", str(port), "--max-total-tokens", "8192"]
    if model_path:
        base += ["--model-path", model_path]
    times = []
    proc = subprocess.Popen(base, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_first_request(url, proc)
    for i in range(repeats):
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        mode = "prefill" if i % 2 == 0 else "null"
        proc = subprocess.Popen(base + ["--disaggregation-mode", mode], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        _wait_first_request(url, proc)
        times.append(time.perf_counter() - t0)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    return {"relaunch_s": {"p50": statistics.median(times), "max": max(times), "n": len(times)}}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.switch")
    p.add_argument("what", choices=["latency", "drain", "soak", "relaunch"])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--admin-api-key", default=None)
    p.add_argument("--cycles", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-pid", type=int, default=None, help="soak: the tidal serve process")
    p.add_argument("--model-path", default=None)
    p.add_argument("--port", type=int, default=30100, help="relaunch: port for the relaunched servers")
    p.add_argument("--output-file", default=None)
    ns = p.parse_args(argv)
    if ns.what == "latency":
        res = bench_latency(ns.url, ns.cycles, ns.admin_api_key)
    elif ns.what == "drain":
        res = bench_drain(ns.url, ns.concurrency, ns.max_new_tokens, ns.admin_api_key, ns.repeats)
    elif ns.what == "soak":
        if ns.server_pid is None:
            p.error("soak needs --server-pid")
        res = bench_soak(ns.url, ns.cycles, ns.server_pid, ns.admin_api_key)
    else:
        res = bench_relaunch(ns.model_path, ns.repeats, ns.port)
    text = json.dumps(res, indent=1)
    print(text)
    if ns.output_file:
        with open(ns.output_file, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
