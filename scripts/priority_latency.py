"""Latency of a short request sent behind a long running one and two queued ones, on one server
with --enable-priority-scheduling --max-running-requests 1: all at the default priority (FCFS)
vs the short one at priority 10 (it preempts the running request). Prints seconds to finish.

Run from the repository root: `PYTHONPATH=$PWD python3 scripts/priority_latency.py`.
"""

from __future__ import annotations

import sys
import threading
import time

import httpx

sys.path.insert(0, "tests")
from servers import Server  # noqa: E402


def body(text: str, n: int, priority) -> dict:
    b = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    if priority is not None:
        b["priority"] = priority
    return b


def scenario(url: str, use_priority: bool) -> dict:
    seconds: dict[str, float] = {}
    threads: list[threading.Thread] = []

    def send(name: str, text: str, n: int, priority) -> None:
        t0 = time.time()
        r = httpx.post(url + "/generate", json=body(text, n, priority if use_priority else None), timeout=300)
        r.raise_for_status()
        seconds[name] = round(time.time() - t0, 2)

    def start(*a, pause: float) -> None:
        threads.append(threading.Thread(target=send, args=a))
        threads[-1].start()
        time.sleep(pause)

    start("blocker", "Write a long story about a dragon who", 64, 0, pause=1.0)
    for i in range(2):
        start(f"low{i}", f"Count to {i}:", 16, 0, pause=0.2)
    start("high", "The capital of France is", 4, 10, pause=0.0)
    for t in threads:
        t.join()
    return seconds


def main() -> None:
    s = Server("--enable-priority-scheduling", "--max-running-requests", "1", "--torch-threads", "1")
    try:
        for _ in range(2):
            for use_priority in (False, True):
                print("priority" if use_priority else "fcfs    ", scenario(s.url, use_priority), flush=True)
    finally:
        s.stop()


if __name__ == "__main__":
    main()
