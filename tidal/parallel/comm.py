"""Tensor-parallel communicators: one process per TP rank, all on this host.

`ShmComm` exchanges data through one POSIX shared-memory segment. Every collective is
one round of "write my slot, publish my sequence number, wait until every rank
published it, read every slot". Measured on this 2-core host ([4, 576] float32
all-reduce): gloo 2.0-2.8 ms, this ~20 us (2 ranks) to ~100 us (3 ranks); the model does
two all-reduces per layer, so gloo would cost more than the forward pass itself.

Reductions add the ranks' slots in rank order on every rank, so every rank gets the
same bits: ranks that sample, schedule and poll from the same numbers stay in step.

Segment layout: a header page ([0] abort flag, [8 + 8r] rank r's published sequence)
then two buffers (alternating by sequence parity) of `size` slots each. A rank reuses
a buffer two collectives later, and it can only get there after every rank has
published the collective in between, i.e. finished reading this one.
"""

from __future__ import annotations

import os
import struct
import time
from multiprocessing import shared_memory
from typing import Optional, Sequence

import numpy as np
import torch

HEADER_BYTES = 4096
DEFAULT_SLOT_BYTES = 8 << 20
# A wait spins (yielding the core) for SPIN_S, since collectives inside a forward pass meet
# within microseconds; then it sleeps with a doubling interval up to MAX_SLEEP_S, so ranks
# waiting for an idle rank 0 cost little CPU (and the first request after idle at most that).
SPIN_S = 0.0005
MAX_SLEEP_S = 0.004


class TPCommError(RuntimeError):
    """A peer rank is gone, aborted, or did not arrive in time."""


class PeerAborted(TPCommError):
    """Another rank called abort(): it failed and reports why itself."""


class SingleRank:
    """TP size 1: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast_bytes(self, data: Optional[bytes]) -> bytes:
        return data or b""

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def all_gather_ints(self, values: Sequence[int]) -> np.ndarray:
        return np.asarray([list(values)], dtype=np.int64).reshape(1, len(values))

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def segment_bytes(size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    return HEADER_BYTES + 2 * size * slot_bytes


def create_segment(size: int, slot_bytes: int = DEFAULT_SLOT_BYTES, name: Optional[str] = None) -> str:
    """Creates (zeroed) the segment for `size` ranks; the creator owns it (its name says so, see
    tidal.leftovers) and unlinks it with `unlink_segment`. Pages are backed only as collectives
    touch them."""
    from tidal.leftovers import owned_segment_name

    name = name or owned_segment_name("tp")
    shm = shared_memory.SharedMemory(name=name, create=True, size=segment_bytes(size, slot_bytes))
    shm.buf[:HEADER_BYTES] = bytes(HEADER_BYTES)
    created = shm.name
    shm.close()
    return created


def unlink_segment(name: str) -> None:
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()


class ShmComm:
    def __init__(self, name: str, rank: int, size: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 timeout_s: float = 300.0):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} out of range for TP size {size}")
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self._shm = shared_memory.SharedMemory(name=name)
        _untrack(self._shm)  # the launcher owns the segment; a rank must not unlink it at exit
        if self._shm.size < segment_bytes(size, slot_bytes):
            raise ValueError(f"shared segment {name} is too small for {size} ranks")
        buf = self._shm.buf
        self._abort = np.ndarray((1,), dtype=np.int64, buffer=buf, offset=0)
        self._seqs = np.ndarray((size,), dtype=np.int64, buffer=buf, offset=8)
        self._data = np.ndarray((2, size, slot_bytes), dtype=np.uint8, buffer=buf, offset=HEADER_BYTES)
        self._seq = 0

    # ---- the one primitive

    def _publish(self, payload: np.ndarray) -> np.ndarray:
        """Write this rank's payload (uint8, <= slot_bytes), publish it, wait for every rank;
        the [size, slot_bytes] buffer of this collective, valid until this rank's
        next-but-one collective."""
        self._seq += 1
        buf = self._data[self._seq & 1]
        buf[self.rank, : payload.nbytes] = payload.reshape(-1).view(np.uint8)
        self._seqs[self.rank] = self._seq  # x86 keeps stores in order: the data is visible first
        self._wait(self._seq)
        return buf

    def _exchange(self, payload: np.ndarray) -> np.ndarray:
        """Every rank's payload (the same length on all ranks) as a [size, n] view."""
        return self._publish(payload)[:, : payload.nbytes]

    def _wait(self, seq: int) -> None:
        seqs = self._seqs
        if min(seqs) >= seq:
            return
        start = time.monotonic()
        spin_until, deadline, sleep = start + SPIN_S, start + self.timeout_s, 0.00005
        while min(seqs) < seq:
            if self._abort[0]:
                raise PeerAborted("a peer TP rank aborted")
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if now > deadline:
                behind = [r for r in range(self.size) if self._seqs[r] < seq]
                raise TPCommError(f"TP ranks {behind} did not reach collective {seq} in {self.timeout_s}s")
            time.sleep(sleep)
            sleep = min(MAX_SLEEP_S, sleep * 2)

    def _exchange_tensor(self, x: torch.Tensor) -> np.ndarray:
        """[size, *x.shape] array (a copy) of every rank's x; x has the same shape on every rank."""
        src = x.detach().contiguous().cpu().numpy()
        flat = src.reshape(-1).view(np.uint8)
        out = np.empty((self.size, flat.nbytes), dtype=np.uint8)
        for start in range(0, max(flat.nbytes, 1), self.slot_bytes):
            piece = flat[start:start + self.slot_bytes]
            out[:, start:start + piece.nbytes] = self._exchange(piece)
        return out.view(src.dtype).reshape(self.size, *src.shape)

    # ---- collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, added in rank order (the same bits everywhere)."""
        parts = self._exchange_tensor(x)
        acc = parts[0].copy()
        for r in range(1, self.size):
            acc += parts[r]
        return torch.from_numpy(acc).to(x.device)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = torch.from_numpy(self._exchange_tensor(x)).to(x.device)
        return torch.cat(list(parts.unbind(0)), dim=dim)

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x (same shape and dtype on every rank)."""
        return torch.from_numpy(self._exchange_tensor(x)[0].copy()).to(x.device)

    def all_gather_ints(self, values: Sequence[int]) -> np.ndarray:
        """[size, len(values)] int64; every rank passes the same number of values."""
        return self._exchange_tensor(torch.tensor(list(values), dtype=torch.int64)).reshape(self.size, len(values))

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes (any lengths), in rank order."""
        room = self.slot_bytes - 8
        parts: list[bytearray] = [bytearray() for _ in range(self.size)]
        lengths: Optional[list[int]] = None
        offset = 0
        while lengths is None or any(offset < n for n in lengths):
            piece = data[offset:offset + room]
            header = struct.pack("<q", len(data))
            got = self._publish(np.frombuffer(header + piece, dtype=np.uint8))  # lengths differ: read whole slots
            if lengths is None:
                lengths = [struct.unpack("<q", bytes(g[:8]))[0] for g in got]
            for r, g in enumerate(got):
                take = max(0, min(room, lengths[r] - offset))
                parts[r] += bytes(g[8:8 + take])
            offset += room
        return [bytes(p) for p in parts]

    def _exchange_var(self, payload: bytes) -> list[np.ndarray]:
        """Payloads of different lengths: each rank's slot is read up to the longest one."""
        n = len(payload)
        self._seq += 1
        buf = self._data[self._seq & 1]
        buf[self.rank, :n] = np.frombuffer(payload, dtype=np.uint8)
        self._seqs[self.rank] = self._seq
        self._wait(self._seq)
        return [buf[r, : self.slot_bytes] for r in range(self.size)]

    def broadcast_bytes(self, data: Optional[bytes]) -> bytes:
        """Rank 0's bytes on every rank (other ranks pass None)."""
        return self.all_gather_bytes(data if self.rank == 0 else b"")[0]

    # ---- lifecycle

    def abort(self) -> None:
        """Make every rank's current and next collective fail (a rank is going down)."""
        try:
            self._abort[0] = 1
        except (TypeError, ValueError):
            pass

    def close(self) -> None:
        self._abort = self._seqs = self._data = None  # drop the views before unmapping
        try:
            self._shm.close()
        except BufferError:
            pass


def _untrack(shm: shared_memory.SharedMemory) -> None:
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass
