"""Per-request metadata slots: what prefill sends with the last chunk of KV.

Prefill writes the record of a finished prefill into its slot and the last
`send` carries it; decode's manager writes it into the slot the decode side gave
in `KVReceiver.init`. `bootstrap_room` lets decode check the record belongs to
the request.
"""

from __future__ import annotations

import threading
from typing import Optional

import msgspec
import numpy as np

DEFAULT_MAX_TOP_LOGPROBS = 20


class MetadataRecord(msgspec.Struct, kw_only=True):
    output_id: int
    cached_tokens: int = 0
    logprob: float = float("nan")  # logprob of output_id; NaN when not computed
    top_logprobs_val: list[float] = []
    top_logprobs_idx: list[int] = []
    bootstrap_room: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MetadataRecord)


def encode_record(rec: MetadataRecord) -> bytes:
    return _encoder.encode(rec)


def decode_record(data: bytes) -> MetadataRecord:
    return _decoder.decode(data)


class MetadataBuffers:
    """`size` fixed slots; alloc/free from the scheduler, set/get from any thread."""

    def __init__(self, size: int, max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS):
        if size < 1 or max_top_logprobs < 0:
            raise ValueError("size must be >= 1 and max_top_logprobs >= 0")
        self.size = size
        self.max_top_logprobs = max_top_logprobs
        self.output_id = np.zeros(size, dtype=np.int64)
        self.cached_tokens = np.zeros(size, dtype=np.int64)
        self.logprob = np.full(size, np.nan, dtype=np.float32)
        self.top_val = np.zeros((size, max_top_logprobs), dtype=np.float32)
        self.top_idx = np.zeros((size, max_top_logprobs), dtype=np.int64)
        self.top_num = np.zeros(size, dtype=np.int32)
        self.bootstrap_room = np.zeros(size, dtype=np.uint64)
        self._free = list(range(size - 1, -1, -1))
        self._used = np.zeros(size, dtype=bool)
        self._lock = threading.Lock()

    def alloc(self) -> Optional[int]:
        with self._lock:
            if not self._free:
                return None
            idx = self._free.pop()
            self._used[idx] = True
            return idx

    def free(self, idx: int) -> None:
        with self._lock:
            self._check(idx)
            if not self._used[idx]:
                raise ValueError(f"metadata slot {idx} freed twice")
            self._used[idx] = False
            self._free.append(idx)

    def available_size(self) -> int:
        return len(self._free)

    def set(self, idx: int, rec: MetadataRecord) -> None:
        self._check(idx)
        n = len(rec.top_logprobs_val)
        if n != len(rec.top_logprobs_idx) or n > self.max_top_logprobs:
            raise ValueError(
                f"top logprobs: {n} values, {len(rec.top_logprobs_idx)} ids, at most {self.max_top_logprobs}"
            )
        with self._lock:
            self.output_id[idx] = rec.output_id
            self.cached_tokens[idx] = rec.cached_tokens
            self.logprob[idx] = rec.logprob
            self.top_val[idx, :n] = rec.top_logprobs_val
            self.top_idx[idx, :n] = rec.top_logprobs_idx
            self.top_num[idx] = n
            self.bootstrap_room[idx] = np.uint64(rec.bootstrap_room)

    def get(self, idx: int) -> MetadataRecord:
        self._check(idx)
        with self._lock:
            n = int(self.top_num[idx])
            return MetadataRecord(
                output_id=int(self.output_id[idx]),
                cached_tokens=int(self.cached_tokens[idx]),
                logprob=float(self.logprob[idx]),
                top_logprobs_val=self.top_val[idx, :n].tolist(),
                top_logprobs_idx=self.top_idx[idx, :n].tolist(),
                bootstrap_room=int(self.bootstrap_room[idx]),
            )

    def _check(self, idx: int) -> None:
        if not 0 <= idx < self.size:
            raise IndexError(f"metadata slot {idx} out of range [0, {self.size})")
