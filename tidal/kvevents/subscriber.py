"""The router side of KV events: an exact index of the blocks each worker's prefix cache holds, fed by one
subscription per worker that notices gaps in the sequence numbers and fills them from the worker's replay
socket (or, when the buffer no longer has them, from a snapshot).

A worker's view is `synced` only while every batch since its last snapshot (or its first batch, 0) was applied
in order; a router policy falls back to its approximate tree for a worker that is not.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Optional, Sequence

import zmq

from tidal.kvevents.events import BATCH_DECODER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tidal.kvevents.publisher import END_SEQ, ERROR_SEQ, pack_seq, unpack_seq

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0


class KVBlockIndex:
    """worker -> the block hashes its cache holds; thread-safe (subscriptions write, the router reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, set[int]] = {}
        self._synced: dict[str, bool] = {}

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        with self._lock:
            blocks = self._blocks.setdefault(worker, set())
            for e in batch.events:
                if isinstance(e, BlockStored):
                    blocks.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    blocks.difference_update(e.block_hashes)
                elif isinstance(e, AllBlocksCleared):
                    blocks.clear()

    def set_synced(self, worker: str, synced: bool) -> None:
        with self._lock:
            self._synced[worker] = synced

    def synced(self, worker: str) -> bool:
        with self._lock:
            return self._synced.get(worker, False)

    def matched_blocks(self, worker: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chained hashes) the worker holds."""
        with self._lock:
            blocks = self._blocks.get(worker, ())
            n = 0
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
            return n

    def size(self, worker: str) -> int:
        with self._lock:
            return len(self._blocks.get(worker, ()))

    def blocks(self, worker: str) -> set[int]:
        with self._lock:
            return set(self._blocks.get(worker, ()))

    def forget(self, worker: str) -> None:
        with self._lock:
            self._blocks.pop(worker, None)
            self._synced.pop(worker, None)


class WorkerSubscription:
    """Follows one worker's events into the index on a thread of its own. `drop`: a test hook that loses the
    live messages it returns True for (as a full socket or a flaky link would)."""

    def __init__(self, worker: str, endpoint: str, replay_endpoint: Optional[str], index: KVBlockIndex,
                 topic: str = "", drop: Optional[Callable[[int], bool]] = None) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.topic = topic
        self.drop = drop
        self.expected: Optional[int] = None  # the next sequence number to apply
        self.replays = self.snapshots = self.errors = 0
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sub {worker}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            self._join()
            while not self._stop.is_set():
                if sub.poll(50):
                    _, seq_frame, payload = sub.recv_multipart()
                    seq = unpack_seq(seq_frame)
                    if self.drop is not None and self.drop(seq):
                        continue
                    self._on_live(seq, payload)
        except Exception:  # noqa: BLE001 - the index falls back; the router keeps routing
            logger.exception("kv events of %s: subscription stopped", self.worker)
            self.index.set_synced(self.worker, False)
        finally:
            sub.close(0)

    def _on_live(self, seq: int, payload: bytes) -> None:
        if self.expected is not None and seq < self.expected:
            return  # replayed already
        if (self.expected is None and seq != 0) or (self.expected is not None and seq > self.expected):
            self.index.set_synced(self.worker, False)
            self._recover(0 if self.expected is None else self.expected)
            if self.expected is None or seq < self.expected:
                return
            if seq > self.expected:  # still a hole (the replay failed): wait for the next message to retry
                return
        self.index.apply(self.worker, BATCH_DECODER.decode(payload))
        self.expected = seq + 1
        self.index.set_synced(self.worker, True)

    # ---- replay

    def _join(self) -> None:
        """Start from a snapshot, so that a worker that publishes nothing for a while (an idle one) is in sync
        from the start; without a replay socket the view syncs at the publisher's batch 0 or never."""
        if self.replay_endpoint is not None and self._resync_from_snapshot():
            self.index.set_synced(self.worker, True)

    def _resync_from_snapshot(self) -> bool:
        snapshot = self._ask(json.dumps({"snapshot": True}).encode())
        if not snapshot or snapshot[0][0] == ERROR_SEQ:
            return False
        self.snapshots += 1
        covers_until, payload = snapshot[0]
        self.index.apply(self.worker, BATCH_DECODER.decode(payload))
        self.expected = covers_until
        return True

    def _recover(self, start: int) -> None:
        """Fill the hole from `start`: the buffered batches, else a snapshot. Leaves the view unsynced when the
        replay socket does not answer (the next live message tries again)."""
        if self.replay_endpoint is None:
            return
        replies = self._ask(pack_seq(start))
        if replies is None:
            return
        if replies and replies[0][0] == ERROR_SEQ:
            self.errors += 1
            if not self._resync_from_snapshot():
                return
        else:
            self.replays += 1
            for seq, payload in replies:
                if self.expected is None or seq >= self.expected:
                    self.index.apply(self.worker, BATCH_DECODER.decode(payload))
                    self.expected = seq + 1
            if self.expected is None:
                self.expected = start
        self.index.set_synced(self.worker, True)

    def _ask(self, request: bytes) -> Optional[list[tuple[int, bytes]]]:
        """The replay socket's answer (batches, or one error), without its end marker; None on a timeout."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send(request)
            out: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while time.monotonic() < deadline:
                if not sock.poll(50):
                    continue
                seq_frame, payload = sock.recv_multipart()
                seq = unpack_seq(seq_frame)
                if seq == END_SEQ:
                    return out
                out.append((seq, payload))
                if seq == ERROR_SEQ:
                    return out
            logger.warning("kv events of %s: no replay answer from %s in %ss", self.worker,
                           self.replay_endpoint, REPLAY_TIMEOUT_S)
            return None
        finally:
            sock.close(0)
