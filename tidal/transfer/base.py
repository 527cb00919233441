"""The transfer interfaces: KVArgs, the manager/sender/receiver contracts, the page-mover
contract that backends implement, configuration from the environment, and statistics."""

from __future__ import annotations

import os
import threading
import warnings
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np
import torch

from tidal.kvcache.kv_pool import MHATokenToKVPool
from tidal.transfer.heads import HeadLayout, HeadSlice
from tidal.transfer.metadata import MetadataBuffers
from tidal.transfer.poll import KVPoll

FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class KVTransferError(Exception):
    """Why a transfer failed; `failure_exception()` returns one."""


@dataclass
class KVArgs:
    engine_rank: int
    kv_pool: MHATokenToKVPool
    metadata: MetadataBuffers
    page_size: int
    kv_dtype: str
    host: str = "127.0.0.1"
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    bootstrap_key: Optional[str] = None  # sent with PUT/DELETE /route (the bootstrap server's key)
    total_kv_heads: int = 0  # the model's KV heads; 0: this pool's heads times tp_size (none replicated)

    def head_layout(self) -> HeadLayout:
        return HeadLayout(self.total_kv_heads or self.kv_pool.num_kv_heads * self.tp_size, self.tp_size)


def _env_float(names: tuple[str, ...], default: float) -> float:
    for name in names:
        raw = os.environ.get(name)
        if raw not in (None, ""):
            return float(raw)
    return default


@dataclass(frozen=True)
class TransferConfig:
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 300.0  # as SGLang: counted from init, the prompt's time queued for prefill included
    failure_prob: float = 0.0
    heartbeat_interval: float = 5.0
    heartbeat_misses: int = 2
    abort_grace: float = 2.0  # how long a failed decode room waits for prefill to stop writing
    transfer_threads: int = 2

    @staticmethod
    def from_env() -> "TransferConfig":
        return TransferConfig(
            bootstrap_timeout=_env_float(("TIDAL_DISAGG_BOOTSTRAP_TIMEOUT",), 30.0),
            waiting_timeout=_env_float(("TIDAL_DISAGG_WAITING_TIMEOUT",), 300.0),
            failure_prob=_env_float(("TIDAL_DISAGG_TEST_FAILURE_PROB", "DISAGGREGATION_TEST_FAILURE_PROB"), 0.0),
            heartbeat_interval=_env_float(("TIDAL_DISAGG_HEARTBEAT_INTERVAL",), 5.0),
            abort_grace=_env_float(("TIDAL_DISAGG_ABORT_GRACE",), 2.0),
            transfer_threads=max(1, int(_env_float(("TIDAL_DISAGG_TRANSFER_THREADS",), 2))),
        )


# ---------------------------------------------------------------- public contracts


class BaseKVManager(ABC):
    mode: str
    args: KVArgs

    @abstractmethod
    def make_sender(self, bootstrap_addr: str, bootstrap_room: int) -> "BaseKVSender": ...

    @abstractmethod
    def make_receiver(self, bootstrap_addr: str, bootstrap_room: int) -> "BaseKVReceiver": ...

    def register(self, bootstrap_port: int) -> None:
        """Prefill: (re-)register this rank with the bootstrap server on bootstrap_port.
        No-op where there is nothing to register (fake backend, decode)."""
        return None

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class BaseKVSender(ABC):
    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def init(self, num_kv_pages: int, metadata_index: int) -> None: ...

    @abstractmethod
    def send(self, kv_page_indices: np.ndarray, is_last: bool) -> None: ...

    @abstractmethod
    def failure_exception(self) -> Optional[Exception]: ...

    @abstractmethod
    def abort(self) -> None: ...


class BaseKVReceiver(ABC):
    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def init(self, kv_page_indices: np.ndarray, metadata_index: int) -> None: ...

    @abstractmethod
    def failure_exception(self) -> Optional[Exception]: ...

    @abstractmethod
    def abort(self) -> None: ...


# ---------------------------------------------------------------- backend contract


@dataclass(frozen=True)
class Peer:
    """A decode server as the prefill side sees it, from its hello."""

    decode_id: str
    endpoint: str  # its control inbox
    info: dict  # what its transport's local_info() returned
    heads: HeadSlice  # which of this rank's KV heads go where in that decode rank's pool
    rank: int = 0  # its TP rank
    readers: int = 1  # how many ranks of its server this prefill rank sends each request to


class DecodeSink(Protocol):
    """What a decode-side transport that writes pages itself (tcp) calls back."""

    def begin_write(self, room: int, prefill_id: str, pages: np.ndarray) -> Optional[object]:
        """A token when the room accepts these destination pages now (pass it to
        end_write after writing); None: drop them (failed room, not its partner,
        pages outside the room's destination)."""

    def end_write(self, token: object) -> None: ...

    def on_inband(self, data: bytes) -> None:
        """A control message that travelled behind the pages (the completion)."""


class Transport:
    """Moves pages of one manager's pool; built as `Transport(args, mode, sink)` (sink:
    the DecodeSink on decode, None on prefill). Prefill side: `write` runs in transfer
    worker threads; decode side: `local_info` tells prefill how to reach this pool.

    guarded: decode's own threads write the pages (a failed room stops them at once);
    otherwise prefill writes one-sided and decode waits for its fence.
    inband_done: the completion must travel behind the pages (`finish`); per peer in
    `inband_done_for` (one-sided backends send head slices over tcp, see OneSidedWithSlices).
    """

    name = "base"
    guarded = False
    inband_done = False

    def local_info(self) -> dict:
        return {}

    def inband_done_for(self, peer: Peer) -> bool:
        return self.inband_done

    def check_peer(self, info: dict) -> Optional[str]:
        """Prefill side: why this decode cannot be served, or None."""
        return None

    def write(self, peer: Peer, room: int, prefill_id: str, src: np.ndarray, dst: np.ndarray) -> int:
        raise NotImplementedError

    def finish(self, peer: Peer, room: int, prefill_id: str, done: bytes) -> None:
        raise NotImplementedError

    def drop_peer(self, decode_id: str) -> None:
        """Called in every transfer worker thread when a decode server leaves."""

    def release_thread(self) -> None:
        """A transfer worker thread is exiting."""

    def interrupt(self) -> None:
        """The manager is shutting down: writes blocked on a peer should give up."""

    def close(self) -> None: ...


# ---------------------------------------------------------------- pages


def page_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """[slot, kv_head, head_dim] -> [page, page_size, kv_head, head_dim]."""
    n = buf.shape[0] // page_size
    return buf[: n * page_size].view(n, page_size, *buf.shape[1:])


def page_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page lists advance by one."""
    if len(src) == 0:
        return []
    step = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate(([0], np.flatnonzero(step) + 1))
    ends = np.concatenate((starts[1:], [len(src)]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A numpy uint8 view of a CPU tensor (last dim in bytes)."""
    return t.view(torch.uint8).numpy()


def as_bytes_shape(t: torch.Tensor) -> tuple[int, ...]:
    """Shape of one row (page) of as_bytes(t)."""
    return (*t.shape[1:-1], t.shape[-1] * t.element_size())


class PagePlan:
    """How to copy pages src[i] -> dst[i] between page views (first dim = page):
    slice copies when the pairs come in long runs, one gather + scatter otherwise.
    Built once per chunk, applied to every layer's K and V.

    CPU copies go through numpy: single-threaded and GIL-free, where torch's copy would
    start its intra-op thread pool from a background thread and fight the scheduler
    (measured 0.4 GB/s vs 12 GB/s on 2 busy cores).
    """

    def __init__(self, src: np.ndarray, dst: np.ndarray):
        self.num_pages = len(src)
        self.runs = page_runs(src, dst)
        self.sliced = len(self.runs) <= max(4, self.num_pages // 8)
        self._src = np.array(src, dtype=np.int64)
        self._dst = np.array(dst, dtype=np.int64)

    def copy(self, dst: torch.Tensor, src: "torch.Tensor | np.ndarray") -> None:
        """src: a page view like dst, or its as_bytes() array."""
        if dst.device.type != "cpu" or (isinstance(src, torch.Tensor) and src.device.type != "cpu"):
            return self._copy_torch(dst, src)
        d = as_bytes(dst)
        s = src if isinstance(src, np.ndarray) else as_bytes(src)
        if self.sliced:
            for a, b, n in self.runs:
                np.copyto(d[b : b + n], s[a : a + n])
        else:
            d[self._dst] = np.take(s, self._src, axis=0)

    def gather(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = src[src_pages[i]]; out is a contiguous CPU tensor with num_pages rows."""
        if src.device.type != "cpu":
            return out.copy_(src.index_select(0, torch.from_numpy(self._src).to(src.device)))
        s, o = as_bytes(src), as_bytes(out)
        if not self.sliced:
            np.take(s, self._src, axis=0, out=o)
            return
        pos = 0
        for a, _, n in self.runs:
            np.copyto(o[pos : pos + n], s[a : a + n])
            pos += n

    def _copy_torch(self, dst: torch.Tensor, src: "torch.Tensor | np.ndarray") -> None:
        if isinstance(src, np.ndarray):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only network buffer; only read
                src = torch.from_numpy(src)
            dst = dst.view(torch.uint8)
        if self.sliced:
            for a, b, n in self.runs:
                dst[b : b + n].copy_(src[a : a + n])
            return
        picked = src.index_select(0, torch.from_numpy(self._src).to(src.device))
        dst.index_copy_(0, torch.from_numpy(self._dst).to(dst.device), picked.to(dst.device))


def pages_problem(pages: np.ndarray, pool: MHATokenToKVPool, page_size: int) -> Optional[str]:
    """Why these page ids cannot index the pool, or None."""
    n = pool.k_buffer[0].shape[0] // page_size
    if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= n):
        return f"page ids outside the pool's pages [0, {n})"
    if len(np.unique(pages)) != len(pages):
        return "duplicate page ids"
    return None


def layout_of(args: KVArgs) -> dict:
    pool = args.kv_pool
    return {
        "num_layers": pool.num_layers,
        "num_kv_heads": pool.num_kv_heads,
        "head_dim": pool.head_dim,
        "dtype": str(pool.dtype),
        "page_size": args.page_size,
        "total_kv_heads": args.head_layout().total_heads,
        "tp_size": args.tp_size,
        "tp_rank": args.engine_rank,
        "draft_layers": getattr(pool, "draft_layers", 0),  # a draft model's KV stacked under the target's
    }


_SAME_ACROSS_RANKS = ("num_layers", "head_dim", "dtype", "page_size", "total_kv_heads", "draft_layers")


def layout_problem(prefill: dict, decode: dict) -> Optional[str]:
    """Why pages of a prefill rank with this layout cannot land in a decode rank's, or None.
    The TP sizes may differ: heads are sliced or gathered (tidal.transfer.heads)."""
    for layout in (prefill, decode):
        layout.setdefault("tp_size", 1)
        layout.setdefault("tp_rank", 0)
        layout.setdefault("total_kv_heads", layout.get("num_kv_heads", 0) * layout["tp_size"])
        layout.setdefault("draft_layers", 0)
    differ = [k for k in _SAME_ACROSS_RANKS if prefill.get(k) != decode.get(k)]
    if not differ:
        return None
    why = "KV layout mismatch: " + ", ".join(f"{k} prefill {prefill.get(k)} decode {decode.get(k)}" for k in differ)
    if "draft_layers" in differ:
        why += (" (the KV of a speculative draft model travels with the target's: run prefill and decode with the "
                "same --speculative-algorithm STANDALONE --speculative-draft-model-path, or neither)")
    return why


def head_bytes(pool: MHATokenToKVPool) -> int:
    return pool.head_dim * pool.k_buffer[0].element_size()


def sliced_nbytes(num_pages: int, pool: MHATokenToKVPool, page_size: int, heads: HeadSlice) -> int:
    """Bytes of num_pages pages across every layer, K and V, for the slice's heads."""
    return num_pages * page_size * 2 * pool.num_layers * heads.count * head_bytes(pool)


def head_view(view: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """A page view [page, page_size, kv_head, head_dim] narrowed to heads [start, start + count)."""
    return view if start == 0 and count == view.shape[2] else view[:, :, start : start + count]


def page_bytes(pool: MHATokenToKVPool, page_size: int) -> int:
    """Bytes of one page across every layer, K and V."""
    return pool.bytes_per_token() * page_size


# ---------------------------------------------------------------- statistics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, float("inf"))


class TransferStats:
    def __init__(self, keep: int = 1000):
        self._lock = threading.Lock()
        self.bytes = 0
        self.succeeded = 0
        self.failed_bootstraps = 0
        self.failed_transfers = 0
        self.latencies: deque[float] = deque(maxlen=keep)
        self.buckets = [0] * len(_LATENCY_BUCKETS)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def add_success(self, latency: float) -> None:
        with self._lock:
            self.succeeded += 1
            self.latencies.append(latency)
            for i, bound in enumerate(_LATENCY_BUCKETS):
                if latency <= bound:
                    self.buckets[i] += 1
                    break

    def add_failure(self, during_bootstrap: bool) -> None:
        with self._lock:
            if during_bootstrap:
                self.failed_bootstraps += 1
            else:
                self.failed_transfers += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "transferred_bytes": self.bytes,
                "succeeded": self.succeeded,
                "failed_bootstraps": self.failed_bootstraps,
                "failed_transfers": self.failed_transfers,
                "latencies_s": list(self.latencies),
                "latency_histogram": {
                    ("+Inf" if b == float("inf") else str(b)): c
                    for b, c in zip(_LATENCY_BUCKETS, self.buckets, strict=True)
                },
            }


class SlicedOverTcp:
    """What a one-sided backend (mooncake, nixl) does with head slices (M:N TP): with the
    pool laid out [slot, head, dim], a slice is one small piece per token and layer, and
    one-sided writes of such pieces crawl (measured below 0.01 GB/s for Mooncake over TCP,
    0.05 for NIXL), so slices go over the tcp backend's stream, which packs them, with the
    completion behind them. Whole pages (equal TP sizes) stay one-sided."""

    def __init__(self, args: KVArgs, mode: str, sink):
        from tidal.transfer.tcp import TcpTransport

        self.tcp = TcpTransport(args, mode, sink)

    @staticmethod
    def sliced(peer: Peer) -> bool:
        return not peer.heads.whole

    def close(self) -> None:
        self.tcp.close()
