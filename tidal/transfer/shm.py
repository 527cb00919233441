"""The `shm` backend: prefill and decode on one host.

The decode KV pool lives in a POSIX shared-memory file (MHATokenToKVPool(...,
shm_name=...)); decode tells prefill its path and layout in its hello, prefill maps
it once per decode peer and its transfer workers copy pages straight into it.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import numpy as np
import torch

from tidal.transfer.base import KVArgs, PagePlan, Peer, Transport, head_view, page_view, sliced_nbytes


def boot_id() -> str:
    """Identifies this kernel, hence this /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


def _element_offset(t: torch.Tensor, base: torch.Tensor) -> int:
    return (t.data_ptr() - base.data_ptr()) // t.element_size()


class _Mapping:
    """Decode's pool as page views over prefill's own mapping of the file."""

    def __init__(self, info: dict, dtype: torch.dtype, page_size: int):
        fd = os.open(info["path"], os.O_RDWR)  # no O_CREAT: a vanished pool is an error, not a new file
        try:
            elem = dtype.itemsize
            numel = info["nbytes"] // elem
            if os.fstat(fd).st_size < info["nbytes"]:
                raise RuntimeError(f"{info['path']} is smaller than the decode pool")
            flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
        finally:
            os.close(fd)
        shape = (info["slots"], info["num_kv_heads"], info["head_dim"])
        n = shape[0] * shape[1] * shape[2]
        self.k = [page_view(flat[o : o + n].view(shape), page_size) for o in info["k_offsets"]]
        self.v = [page_view(flat[o : o + n].view(shape), page_size) for o in info["v_offsets"]]


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, args: KVArgs, mode: str, sink=None):
        self.args = args
        self.pool = args.kv_pool
        self.page_size = args.page_size
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()
        if mode == "decode" and self.pool.shm_path is None:
            raise ValueError("the shm backend needs the decode KV pool in shared memory: "
                             "MHATokenToKVPool(..., shm_name=...)")
        self._src_k = [page_view(b, self.page_size) for b in self.pool.k_buffer]
        self._src_v = [page_view(b, self.page_size) for b in self.pool.v_buffer]

    # ---- decode side

    def local_info(self) -> dict:
        pool = self.pool
        base = pool.k_buffer[0]
        elem = base.element_size()
        return {
            "path": pool.shm_path,
            "boot_id": boot_id(),
            "nbytes": 2 * pool.num_layers * base.numel() * elem,
            "slots": base.shape[0],
            "num_kv_heads": pool.num_kv_heads,
            "head_dim": pool.head_dim,
            "k_offsets": [_element_offset(b, base) for b in pool.k_buffer],
            "v_offsets": [_element_offset(b, base) for b in pool.v_buffer],
        }

    # ---- prefill side

    def check_peer(self, info: dict) -> Optional[str]:
        if info.get("boot_id") != boot_id():
            return "the shm backend needs prefill and decode on the same host"
        if not info.get("path") or not os.path.exists(info["path"]):
            return f"decode KV pool {info.get('path')!r} is not in shared memory here"
        return None

    def _mapping(self, peer: Peer) -> _Mapping:
        with self._lock:
            m = self._maps.get(peer.decode_id)
            if m is None:
                m = self._maps[peer.decode_id] = _Mapping(peer.info, self.pool.dtype, self.page_size)
            return m

    def write(self, peer: Peer, room: int, prefill_id: str, src: np.ndarray, dst: np.ndarray) -> int:
        m = self._mapping(peer)
        plan = PagePlan(src, dst)
        h = peer.heads
        for layer in range(self.pool.num_layers):
            for theirs, mine in ((m.k[layer], self._src_k[layer]), (m.v[layer], self._src_v[layer])):
                plan.copy(head_view(theirs, h.dst_start, h.count), head_view(mine, h.src_start, h.count))
        return sliced_nbytes(len(src), self.pool, self.page_size, h)

    def drop_peer(self, decode_id: str) -> None:
        with self._lock:
            self._maps.pop(decode_id, None)  # unmapped when the last view goes

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
