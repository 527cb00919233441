"""Real tidal processes for end-to-end tests: started as a user would, stopped by PID."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import httpx

def free_port() -> int:
    """A free port below the ephemeral range (see free_port_block)."""
    return free_port_block(1)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


_HANDED_OUT: set[int] = set()


def free_port_block(n: int) -> int:
    """The first of n consecutive free ports (for `tidal cluster --base-port`, which takes
    base, base+1, ...). Taken below the ephemeral range: an ephemeral port next to a free one
    may be any client connection's source port by the time a server binds it."""
    lo, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(lo - n, 10001))
        if not _HANDED_OUT.isdisjoint(range(base, base + n)):
            continue  # handed out before, maybe not bound yet
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        _HANDED_OUT.update(range(base, base + n))
        return base
    raise RuntimeError(f"no {n} consecutive free ports below {lo}")


class Server:
    def __init__(self, *extra: str, cmd: Optional[list[str]] = None, env: Optional[dict] = None,
                 port: Optional[int] = None, host: str = "127.0.0.1", prefix: Optional[list[str]] = None,
                 wait: bool = True):
        """`host`: the address it listens on; `prefix`: a command it runs under (`ip netns exec NS`, which
        execs it, so the PID stays the server's); `wait=False`: return at once, call wait_ready() later
        (servers started together load their models in parallel: see all_ready)."""
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        if cmd is None:
            cmd = [sys.executable, "-m", "tidal.launch_server", "--host", host, "--port", str(self.port),
                   "--max-total-tokens", "8192", "--dtype", "float32", *extra]
        cmd = [*(prefix or []), *cmd]
        self.log = open(f"/tmp/tidal-test-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(self.log.name).read()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("server did not become ready")

    def stop(self) -> int:
        self.log.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def all_ready(*servers: Server) -> list[Server]:
    """Servers made with wait=False (so they load their models in parallel), once all are ready; all
    stopped if one fails."""
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return list(servers)


def assert_idle_and_intact(url: str, timeout: float = 60) -> None:
    """The server holds no request and no KV (the prefix cache aside) and is healthy: with
    --enable-integrity-check, which crashes a scheduler on a leak, that proves its pools intact."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        load = httpx.get(url + "/get_load", timeout=10).json()[0]
        if load["num_reqs"] == 0 and load["num_tokens"] == 0:
            break
        time.sleep(0.5)
    assert load["num_reqs"] == 0 and load["num_tokens"] == 0, load
    assert httpx.get(url + "/health", timeout=10).status_code == 200


class Traffic:
    """Client threads sending greedy /generate requests (prompts in turn) until stopped;
    counts successes, failures and outputs that differ from `reference[prompt]`."""

    def __init__(self, url: str, reference: dict[str, list[int]], max_new_tokens: int, threads: int = 3,
                 sampling: Optional[dict] = None):
        self.url, self.reference, self.max_new_tokens = url, reference, max_new_tokens
        self.sampling = {"ignore_eos": True, **(sampling or {})}  # extra sampling params for every request
        self.prompts = list(reference)
        self.ok, self.failures, self.mismatches = 0, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, k: int) -> None:
        while not self._stop.is_set():
            prompt = self.prompts[k % len(self.prompts)]
            k += 1
            body = {"text": prompt, "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0.0,
                                                        **self.sampling}}
            try:
                r = httpx.post(self.url + "/generate", json=body, timeout=300)
            except httpx.HTTPError as e:
                self.failures.append(repr(e))
                continue
            if r.status_code != 200:
                self.failures.append(f"{r.status_code}: {r.text[:300]}")
            elif r.json()["output_ids"] != self.reference[prompt]:
                self.mismatches.append(prompt)
            else:
                self.ok += 1

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


def greedy_concurrently(url: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy /generate output_ids of every prompt (token ids), all sent at once so the server batches them."""
    import concurrent.futures as cf

    def one(ids: list[int]) -> list[int]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                      "ignore_eos": True}}
        r = httpx.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))
