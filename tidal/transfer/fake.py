"""The `fake` backend: moves nothing and succeeds at once, with no network at all.

Used for warm-up and health checks, and for any request whose bootstrap host is
2.2.2.2 whatever the manager's backend. A fake receiver writes a metadata record
holding only the room (output token 0), so decode's room check passes.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from tidal.transfer.base import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVTransferError,
    TransferStats,
)
from tidal.transfer.metadata import MetadataRecord
from tidal.transfer.poll import KVPoll


class FakeSender(BaseKVSender):
    def __init__(self, stats: TransferStats, room: int):
        self._stats = stats
        self._status = KVPoll.WaitingForInput
        self._init_at = time.monotonic()

    def poll(self) -> KVPoll:
        return self._status

    def init(self, num_kv_pages: int, metadata_index: int) -> None:
        self._init_at = time.monotonic()

    def send(self, kv_page_indices: np.ndarray, is_last: bool) -> None:
        if is_last and self._status == KVPoll.WaitingForInput:
            self._status = KVPoll.Success
            self._stats.add_success(time.monotonic() - self._init_at)

    def failure_exception(self) -> Optional[Exception]:
        return KVTransferError("aborted") if self._status == KVPoll.Failed else None

    def abort(self) -> None:
        if self._status != KVPoll.Success:
            self._status = KVPoll.Failed


class FakeReceiver(BaseKVReceiver):
    def __init__(self, args: KVArgs, stats: TransferStats, room: int):
        self._args = args
        self._stats = stats
        self._room = room
        self._status = KVPoll.WaitingForInput

    def poll(self) -> KVPoll:
        return self._status

    def init(self, kv_page_indices: np.ndarray, metadata_index: int) -> None:
        if self._status != KVPoll.WaitingForInput:
            return
        if 0 <= metadata_index < self._args.metadata.size:
            self._args.metadata.set(metadata_index, MetadataRecord(output_id=0, bootstrap_room=self._room))
        self._status = KVPoll.Success
        self._stats.add_success(0.0)

    def failure_exception(self) -> Optional[Exception]:
        return KVTransferError("aborted") if self._status == KVPoll.Failed else None

    def abort(self) -> None:
        if self._status != KVPoll.Success:
            self._status = KVPoll.Failed


class FakeKVManager(BaseKVManager):
    backend = "fake"

    def __init__(self, args: KVArgs, mode: str):
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        self.args = args
        self.mode = mode
        self._stats = TransferStats()

    def make_sender(self, bootstrap_addr: str, bootstrap_room: int) -> BaseKVSender:
        return FakeSender(self._stats, bootstrap_room)

    def make_receiver(self, bootstrap_addr: str, bootstrap_room: int) -> BaseKVReceiver:
        return FakeReceiver(self.args, self._stats, bootstrap_room)

    def stats(self) -> dict:
        return {"backend": "fake", "mode": self.mode, **self._stats.snapshot()}

    def shutdown(self) -> None:
        pass
