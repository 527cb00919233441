"""The `nixl` backend (optional: `pip install --no-deps nixl nixl-cu12`, UCX bundled).

Each manager runs a NIXL agent with UCX and registers its pool's K and V buffers
(DRAM; VRAM for a CUDA pool). Decode sends its agent metadata and buffer addresses in
its hello; prefill adds it as a remote agent and WRITEs runs of pages, waiting for each
transfer to finish; the common control plane carries the completion.

NIXL's own progress thread busy-polls a core, so it is off: prefill's worker drives
its transfers while waiting on them, and decode runs a light thread that progresses
its agent every TIDAL_NIXL_PROGRESS_INTERVAL seconds (default 0.002).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Optional

import numpy as np

from tidal.transfer.base import KVArgs, Peer, SlicedOverTcp, Transport, head_bytes, page_runs, sliced_nbytes

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as e:  # pragma: no cover - depends on the optional package
    raise ImportError("the nixl backend needs `pip install --no-deps nixl nixl-cu12`") from e


class NixlTransport(Transport):
    name = "nixl"
    XFER_TIMEOUT = 30.0

    def __init__(self, args: KVArgs, mode: str, sink=None):
        pool = args.kv_pool
        self.args = args
        self._head_bytes = head_bytes(pool)
        self._slices = SlicedOverTcp(args, mode, sink)
        self._mem = "VRAM" if pool.device.type == "cuda" else "DRAM"
        self._dev = (pool.device.index or 0) if pool.device.type == "cuda" else 0
        self._k = [b.data_ptr() for b in pool.k_buffer]
        self._v = [b.data_ptr() for b in pool.v_buffer]
        self._layer_page = pool.k_buffer[0][0].numel() * pool.k_buffer[0].element_size() * args.page_size
        self.agent_name = f"tidal-{mode}-{uuid.uuid4().hex[:12]}"
        self._agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        regs = [(b.data_ptr(), b.numel() * b.element_size(), self._dev, "") for b in pool.k_buffer + pool.v_buffer]
        self._reg = self._agent.register_memory(regs, self._mem)
        self._peers: dict[str, str] = {}  # decode_id -> remote agent name
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._progress: Optional[threading.Thread] = None
        if mode == "decode":
            self._progress = threading.Thread(target=self._progress_loop, name="tidal-kv-nixl-progress", daemon=True)
            self._progress.start()

    def _progress_loop(self) -> None:
        interval = float(os.environ.get("TIDAL_NIXL_PROGRESS_INTERVAL", "0.002"))
        while not self._stop.wait(interval):
            with self._lock:
                self._agent.get_new_notifs()  # drives UCX progress on this side

    def local_info(self) -> dict:
        with self._lock:
            meta = self._agent.get_agent_metadata()
        return {"agent_name": self.agent_name, "agent_meta": meta,
                "k_ptrs": self._k, "v_ptrs": self._v, "layer_page_bytes": self._layer_page,
                "head_bytes": self._head_bytes, "mem": self._mem, "dev": self._dev, **self._slices.tcp.local_info()}

    def inband_done_for(self, peer: Peer) -> bool:
        return self._slices.sliced(peer)

    def finish(self, peer: Peer, room: int, prefill_id: str, done: bytes) -> None:
        self._slices.tcp.finish(peer, room, prefill_id, done)

    def release_thread(self) -> None:
        self._slices.tcp.release_thread()

    def interrupt(self) -> None:
        self._slices.tcp.interrupt()

    def check_peer(self, info: dict) -> Optional[str]:
        if info.get("head_bytes", self._head_bytes) != self._head_bytes or len(info.get("k_ptrs", [])) != len(self._k):
            return "nixl: decode pool layout differs"
        return None

    def _remote(self, peer: Peer) -> str:
        with self._lock:
            name = self._peers.get(peer.decode_id)
            if name is None:
                name = self._agent.add_remote_agent(peer.info["agent_meta"])
                name = name.decode() if isinstance(name, bytes) else name
                self._peers[peer.decode_id] = name
            return name

    def write(self, peer: Peer, room: int, prefill_id: str, src: np.ndarray, dst: np.ndarray) -> int:
        if self._slices.sliced(peer):
            return self._slices.tcp.write(peer, room, prefill_id, src, dst)
        remote = self._remote(peer)
        local_descs, remote_descs = [], []
        runs = page_runs(src, dst)
        for mine, theirs in zip(self._k + self._v, peer.info["k_ptrs"] + peer.info["v_ptrs"], strict=True):
            for s, d, n in runs:
                local_descs.append((mine + s * self._layer_page, n * self._layer_page, self._dev))
                remote_descs.append((theirs + d * self._layer_page, n * self._layer_page, peer.info["dev"]))
        with self._lock:
            local = self._agent.get_xfer_descs(local_descs, self._mem)
            far = self._agent.get_xfer_descs(remote_descs, peer.info["mem"])
            handle = self._agent.initialize_xfer("WRITE", local, far, remote, b"")
        try:
            self._wait(handle)
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)
        return sliced_nbytes(len(src), self.args.kv_pool, self.args.page_size, peer.heads)

    def _wait(self, handle) -> None:
        with self._lock:
            state = self._agent.transfer(handle)
        deadline = time.monotonic() + self.XFER_TIMEOUT
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise RuntimeError("nixl transfer timed out")
            time.sleep(0.0002)
            with self._lock:
                state = self._agent.check_xfer_state(handle)
        if state == "ERR":
            raise RuntimeError("nixl transfer failed")

    def drop_peer(self, decode_id: str) -> None:
        self._slices.tcp.drop_peer(decode_id)
        with self._lock:
            name = self._peers.pop(decode_id, None)
            if name is not None:
                self._agent.remove_remote_agent(name)

    def close(self) -> None:
        if self._agent is None:
            return
        self._slices.close()
        self._stop.set()
        if self._progress is not None:
            self._progress.join()
        with self._lock:
            for name in self._peers.values():
                self._agent.remove_remote_agent(name)
            self._peers.clear()
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
                self._reg = None
            self._agent = None  # its UCX workers, sockets and threads go now, not at some later GC
