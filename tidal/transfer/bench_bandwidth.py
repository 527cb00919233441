"""Raw KV transfer bandwidth per backend, next to a torch memcpy and a loopback TCP
socket moving the same bytes.

    python -m tidal.transfer.bench_bandwidth [--mb 256] [--page-size 16] [--shuffle] [--backends shm,tcp,...]
                                             [--tp 1:1,1:3,3:1]

Each backend moves one request's pages (init -> every side Success) between a prefill
and a decode server in this process, through a real bootstrap server: with `--tp M:N`
the prefill has M rank managers and the decode N (each with its share of the KV heads,
as TP servers hold them), and the bytes counted are the model's KV once. The default KV
shape is SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64, bfloat16).
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import threading
import time
import uuid
from typing import Callable

import numpy as np
import torch

from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.transfer.heads import HeadLayout
from tidal.transfer import (
    BootstrapServer,
    KVArgs,
    KVPoll,
    KVReceiver,
    KVSender,
    MetadataBuffers,
    MetadataRecord,
    TransferConfig,
    create_kv_manager,
)

OPTIONAL = {"mooncake": "mooncake", "nixl": "nixl"}


def best_of(runs: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(runs))


def bench_memcpy(nbytes: int, runs: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in

    def once() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    return best_of(runs, once)


def bench_socket(nbytes: int, runs: int) -> float:
    payload = memoryview(bytearray(np.random.randint(0, 255, nbytes, dtype=np.uint8).tobytes()))
    sink = bytearray(1 << 22)

    def once() -> float:
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]

        def drain() -> None:
            conn, _ = srv.accept()
            view, got = memoryview(sink), 0
            while got < nbytes:
                n = conn.recv_into(view)
                if not n:
                    break
                got += n
            conn.close()

        reader = threading.Thread(target=drain)
        reader.start()
        cli = socket.create_connection(("127.0.0.1", port))
        t = time.perf_counter()
        cli.sendall(payload)
        reader.join()
        dt = time.perf_counter() - t
        cli.close()
        srv.close()
        return dt

    return best_of(runs, once)


class BackendBench:
    def __init__(self, backend: str, a: argparse.Namespace, num_pages: int, m: int = 1, n: int = 1):
        self.backend, self.num_pages, self.ps = backend, num_pages, a.page_size
        self.shuffle = a.shuffle
        self.server = BootstrapServer("127.0.0.1", 0)
        self.server.start()
        self.addr = f"127.0.0.1:{self.server.port}"
        cfg = TransferConfig(transfer_threads=1)
        tokens = num_pages * a.page_size
        self.ppools, self.dpools, self.prefill, self.decode = [], [], [], []
        for side, size in (("prefill", m), ("decode", n)):
            layout = HeadLayout(a.kv_heads, size)
            for rank in range(size):
                heads = len(layout.heads_of(rank))
                shape = (tokens, a.page_size, torch.bfloat16, a.layers, heads, a.head_dim)
                shm = f"tidal_bench_{uuid.uuid4().hex[:8]}" if backend == "shm" and side == "decode" else None
                pool = MHATokenToKVPool(*shape, shm_name=shm)
                for buf in pool.k_buffer + pool.v_buffer:  # fault the pages in, as a running pool's are
                    buf.copy_(torch.randn(buf.shape, dtype=torch.bfloat16)) if side == "prefill" else buf.zero_()
                args = KVArgs(rank, pool, MetadataBuffers(4), a.page_size, "bfloat16", tp_size=size,
                              total_kv_heads=a.kv_heads)
                port = self.server.port if side == "prefill" else None
                (self.ppools if side == "prefill" else self.dpools).append(pool)
                (self.prefill if side == "prefill" else self.decode).append(create_kv_manager(backend, args, side,
                                                                                              port, cfg))
        self.room = 0

    def once(self) -> float:
        self.room += 1
        ss = [KVSender(m, self.addr, self.room) for m in self.prefill]
        rs = [KVReceiver(m, self.addr, self.room) for m in self.decode]
        _wait(lambda: all(r.poll() == KVPoll.WaitingForInput for r in rs), *rs)
        pages = np.arange(1, self.num_pages, dtype=np.int64)
        dst = np.random.permutation(pages) if self.shuffle else pages
        for r in rs:
            r.init(dst, 0)
        _wait(lambda: all(s.poll() == KVPoll.WaitingForInput for s in ss), *ss)
        for m in self.prefill:
            m.args.metadata.set(0, MetadataRecord(output_id=1, bootstrap_room=self.room))
        t = time.perf_counter()
        for s in ss:
            s.init(len(pages), 0)
            s.send(pages, is_last=True)
        _wait(lambda: all(x.poll() == KVPoll.Success for x in ss + rs), *ss, *rs)
        return time.perf_counter() - t

    def close(self) -> None:
        for m in self.decode + self.prefill:
            m.shutdown()
        for pool in self.dpools:
            pool.close()
        self.server.stop()


def _wait(pred: Callable[[], bool], *objs, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for o in objs:
            if o.poll() == KVPoll.Failed:
                raise RuntimeError(f"transfer failed: {o.failure_exception()}")
        if time.monotonic() > deadline:
            raise TimeoutError("transfer did not finish")
        time.sleep(0.0002)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=256.0, help="KV bytes per transfer, in MiB")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backends", default="shm,tcp,mooncake,nixl")
    p.add_argument("--shuffle", action="store_true", help="scatter the destination pages at random")
    p.add_argument("--tp", default="1:1", help="prefill:decode TP sizes, comma-separated (e.g. 1:1,1:3,3:1)")
    a = p.parse_args()
    sizes = [tuple(int(x) for x in pair.split(":")) for pair in a.tp.split(",") if pair]
    page_bytes = 2 * a.layers * a.kv_heads * a.head_dim * 2 * a.page_size
    num_pages = max(2, int(a.mb * (1 << 20) // page_bytes) + 1)  # +1: page 0 is the dummy page
    nbytes = (num_pages - 1) * page_bytes
    gbs = lambda dt: nbytes / dt / 1e9  # noqa: E731
    order = "shuffled" if a.shuffle else "contiguous"
    print(f"{nbytes / 2**20:.0f} MiB per transfer, {num_pages - 1} {order} pages of {a.page_size} tokens, "
          f"best of {a.runs}")
    print(f"{'torch memcpy':<28}{gbs(bench_memcpy(nbytes, a.runs)):8.2f} GB/s")
    print(f"{'loopback TCP socket':<28}{gbs(bench_socket(nbytes, a.runs)):8.2f} GB/s")
    for backend in [b for b in a.backends.split(",") if b]:
        if backend in OPTIONAL and importlib.util.find_spec(OPTIONAL[backend]) is None:
            print(f"{backend:<28}{'not installed':>13}")
            continue
        for m, n in sizes:
            bench = BackendBench(backend, a, num_pages, m, n)
            try:
                bench.once()  # warm-up: handshakes, mappings, connections
                label = f"{backend} backend" + (f" TP {m}->{n}" if (m, n) != (1, 1) or len(sizes) > 1 else "")
                print(f"{label:<28}{gbs(best_of(a.runs, bench.once)):8.2f} GB/s")
            finally:
                bench.close()


if __name__ == "__main__":
    main()
