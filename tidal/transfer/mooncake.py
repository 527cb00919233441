"""The `mooncake` backend (optional: `pip install mooncake-transfer-engine-non-cuda`,
plus Debian's libibverbs1 on CPU hosts).

Each manager runs a Mooncake TransferEngine (P2P handshake; protocol from
TIDAL_MOONCAKE_PROTOCOL, "tcp" by default, "rdma" on InfiniBand/RoCE with
TIDAL_MOONCAKE_DEVICE) and registers its pool's K and V buffers. Decode tells prefill
its session and buffer addresses; prefill writes runs of pages one-sided with
batch_transfer_sync_write, and the common control plane carries the completion.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from tidal.transfer.base import KVArgs, Peer, SlicedOverTcp, Transport, head_bytes, page_runs, sliced_nbytes
from tidal.transfer.common import advertised_host

try:
    from mooncake.engine import TransferEngine
except ImportError as e:  # pragma: no cover - depends on the optional package
    raise ImportError("the mooncake backend needs `pip install mooncake-transfer-engine-non-cuda` "
                      "(and `apt-get install libibverbs1`)") from e


MAX_BATCH = int(os.environ.get("TIDAL_MOONCAKE_MAX_BATCH", "512"))


def _buffers(args: KVArgs) -> tuple[list[int], list[int], int]:
    """(K pointers, V pointers, bytes per page of one layer's K or V)."""
    pool = args.kv_pool
    k = [b.data_ptr() for b in pool.k_buffer]
    v = [b.data_ptr() for b in pool.v_buffer]
    per_page = pool.k_buffer[0][0].numel() * pool.k_buffer[0].element_size() * args.page_size
    return k, v, per_page


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, args: KVArgs, mode: str, sink=None):
        self.args = args
        self._head_bytes = head_bytes(args.kv_pool)
        self._slices = SlicedOverTcp(args, mode, sink)
        self._k, self._v, self._layer_page = _buffers(args)
        host = advertised_host(args.host)
        self._engine = TransferEngine()
        protocol = os.environ.get("TIDAL_MOONCAKE_PROTOCOL", "tcp")
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, os.environ.get("TIDAL_MOONCAKE_DEVICE", ""))
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({rc})")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._nbytes = [b.numel() * b.element_size() for b in args.kv_pool.k_buffer + args.kv_pool.v_buffer]
        self._registered: list[int] = []
        for ptr, n in zip(self._k + self._v, self._nbytes, strict=True):
            if self._engine.register_memory(ptr, n) != 0:
                self.close()
                raise RuntimeError("Mooncake register_memory failed for the KV pool")
            self._registered.append(ptr)

    def local_info(self) -> dict:
        return {"session": self.session, "k_ptrs": self._k, "v_ptrs": self._v, "layer_page_bytes": self._layer_page,
                "head_bytes": self._head_bytes, **self._slices.tcp.local_info()}

    def inband_done_for(self, peer: Peer) -> bool:
        return self._slices.sliced(peer)

    def finish(self, peer: Peer, room: int, prefill_id: str, done: bytes) -> None:
        self._slices.tcp.finish(peer, room, prefill_id, done)

    def drop_peer(self, decode_id: str) -> None:
        self._slices.tcp.drop_peer(decode_id)

    def release_thread(self) -> None:
        self._slices.tcp.release_thread()

    def interrupt(self) -> None:
        self._slices.tcp.interrupt()

    def check_peer(self, info: dict) -> Optional[str]:
        if info.get("head_bytes", self._head_bytes) != self._head_bytes or len(info.get("k_ptrs", [])) != len(self._k):
            return "mooncake: decode pool layout differs"
        return None

    def write(self, peer: Peer, room: int, prefill_id: str, src: np.ndarray, dst: np.ndarray) -> int:
        if self._slices.sliced(peer):
            return self._slices.tcp.write(peer, room, prefill_id, src, dst)
        srcs, dsts, lens = [], [], []
        runs = page_runs(src, dst)
        for mine, theirs in zip(self._k + self._v, peer.info["k_ptrs"] + peer.info["v_ptrs"], strict=True):
            for s, d, n in runs:
                srcs.append(mine + s * self._layer_page)
                dsts.append(theirs + d * self._layer_page)
                lens.append(n * self._layer_page)
        for i in range(0, len(srcs), MAX_BATCH):  # the engine rejects (-1) batches of a few thousand
            end = i + MAX_BATCH
            rc = self._engine.batch_transfer_sync_write(peer.info["session"], srcs[i:end], dsts[i:end], lens[i:end])
            if rc != 0:
                raise RuntimeError(f"Mooncake batch_transfer_sync_write to {peer.info['session']} failed ({rc})")
        return sliced_nbytes(len(src), self.args.kv_pool, self.args.page_size, peer.heads)

    def close(self) -> None:
        if self._engine is None:
            return
        self._slices.close()
        for ptr in self._registered:
            self._engine.unregister_memory(ptr)
        self._registered.clear()
        # TransferEngine's destructor takes about a second, holding the GIL: a background
        # thread would stall the scheduler just the same, so it happens here.
        self._engine = None
