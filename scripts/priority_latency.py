"""Latency of a short request sent behind a long running one and two queued ones, on one server
with --enable-priority-scheduling --max-running-requests 1: all at the default priority (FCFS)
vs the short one at priority 10 (it preempts the running request). Prints seconds to finish.

Run from the repository root: `PYTHONPATH=$PWD python3 scripts/priority_latency.py`."""
import sys, threading, time
sys.path.insert(0, "tests")
import httpx
from servers import Server

def body(t, n, p):
    b = {"text": t, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    if p is not None: b["priority"] = p
    return b

def scenario(url, prio):
    res = {}
    def send(name, t, n, p):
        t0 = time.time(); r = httpx.post(url + "/generate", json=body(t, n, p), timeout=300)
        res[name] = (time.time() - t0, r.status_code)
    ths = [threading.Thread(target=send, args=("blocker", "Write a long story about a dragon who", 64, 0 if prio else None))]
    ths[0].start(); time.sleep(1.0)
    for i in range(2):
        th = threading.Thread(target=send, args=(f"low{i}", f"Count to {i}:", 16, 0 if prio else None)); th.start(); ths.append(th); time.sleep(0.2)
    th = threading.Thread(target=send, args=("high", "The capital of France is", 4, 10 if prio else None)); th.start(); ths.append(th)
    for th in ths: th.join()
    return res

s = Server("--enable-priority-scheduling", "--max-running-requests", "1", "--torch-threads", "1")
try:
    for rep in range(2):
        for prio in (False, True):
            r = scenario(s.url, prio)
            print("priority" if prio else "fcfs    ", {k: round(v[0], 2) for k, v in r.items()}, flush=True)
finally:
    s.stop()
