"""The server side of KV events: batches published over ZMQ PUB with a sequence number, a bounded buffer of the
last `buffer_steps` batches, and a replay socket that answers what a subscriber missed.

Wire (vLLM's and SGLang's ZMQ publisher): each batch is a PUB message of three frames, `topic`, the sequence
number (8 bytes, big-endian, signed; +1 per batch from 0) and the msgpack `KVEventBatch`. The replay socket is a
ROUTER; a request is one frame:
- 8 bytes, big-endian: a start sequence number. The answer is every buffered batch from it on, one message each
  (`seq`, `payload`), then the end marker (`-1`, empty). A start older than the buffer or past the next number
  gets one error message instead (`-2`, a JSON `{"error": ..., "oldest": N, "next": M}`).
- `{"snapshot": true}` (JSON): one batch that clears the subscriber's view and stores every block the server's
  cache holds now, numbered with the next batch's sequence number (it covers every batch before that one;
  the next live batch is the one to apply after it), then the end marker. A subscriber
  that cannot be replayed (it joined late, or fell behind the buffer) resyncs from it.
Malformed requests get the error message; the publisher goes on serving the others.

All sockets live on one thread of their own: the scheduler only appends to a bounded queue (`publish`), so a
slow or absent subscriber never delays a forward pass. The thread also keeps the live blocks (from the events
it sends), which is what a snapshot is made of.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import struct
import threading
import time
from typing import Optional

import msgspec
import zmq

from tidal.kvevents.events import (
    ENCODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventsConfig,
)

logger = logging.getLogger(__name__)

END_SEQ, ERROR_SEQ = -1, -2
_SEQ = struct.Struct(">q")


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    return _SEQ.unpack(frame)[0]


def _bindable(endpoint: str) -> str:
    """ZMQ's spelling of a free port is `*`; port 0 means the same here."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


class LiveBlocks:
    """The blocks a server holds, in the order they were stored (a parent before its children)."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[Optional[int], list[int], int, Optional[int]]] = {}

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            parent, size = event.parent_block_hash, event.block_size
            for i, h in enumerate(event.block_hashes):
                self._blocks[h] = (parent, event.token_ids[i * size:(i + 1) * size], size, event.lora_id)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._blocks.pop(h, None)
        else:
            self._blocks.clear()

    def snapshot(self) -> list[KVEvent]:
        out: list[KVEvent] = [AllBlocksCleared()]
        for h, (parent, tokens, size, lora) in self._blocks.items():
            out.append(BlockStored([h], parent, tokens, size, lora))
        return out

    def __len__(self) -> int:
        return len(self._blocks)


class KVEventPublisher:
    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: Optional[int] = None) -> None:
        self.cfg = cfg
        self.dp_rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Optional[zmq.Socket] = None
        try:
            self._pub.bind(_bindable(cfg.endpoint))
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(_bindable(cfg.replay_endpoint))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(f"--kv-events-config: cannot bind {e}") from None
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay else None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._live = LiveBlocks()
        self._next_seq = 0
        self.dropped = 0  # batches the scheduler could not queue (the queue was full)
        self._must_resync = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the scheduler thread

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1
            # the next batch's sequence number is not skipped: instead its first event clears the view, and
            # a subscriber that was fine resyncs from a snapshot (see `_send`)
            self._must_resync = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)

    # ---- the publisher thread

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            self._drain_queue()
            if self._replay is not None:
                for sock, _ in poller.poll(5):
                    self._serve_replay()
            else:
                time.sleep(0.005)
        self._drain_queue()

    def _drain_queue(self) -> None:
        while True:
            try:
                events = self._queue.get_nowait()
            except queue.Empty:
                return
            self._send(events)

    def _send(self, events: list[KVEvent]) -> None:
        if self._must_resync:
            # batches were lost before they had numbers: what the live view holds is unknown to subscribers
            # and to us; the safe statement is that everything is gone (the server's next stores rebuild it)
            self._must_resync = False
            events = [AllBlocksCleared(), *[e for e in events if not isinstance(e, AllBlocksCleared)]]
        for e in events:
            self._live.apply(e)
        seq = self._next_seq
        self._next_seq += 1
        payload = ENCODER.encode(KVEventBatch(time.time(), events, self.dp_rank))
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self.cfg.topic.encode(), pack_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a slow subscriber past the HWM misses it and replays it

    def _serve_replay(self) -> None:
        try:
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        ident, request = frames[0], frames[-1]
        try:
            for seq, payload in self._answer(request):
                self._replay.send_multipart((ident, pack_seq(seq), payload))
        except Exception as e:  # noqa: BLE001 - a bad request must never stop the publisher
            logger.warning("kv events: replay request failed: %s", e)

    def _answer(self, request: bytes) -> list[tuple[int, bytes]]:
        oldest = self._buffer[0][0] if self._buffer else self._next_seq
        if len(request) == 8:
            start = unpack_seq(request)
            if not oldest <= start <= self._next_seq:
                return [self._error(f"replay from {start}: the buffer holds {oldest}..{self._next_seq - 1}",
                                    oldest)]
            return [(s, p) for s, p in self._buffer if s >= start] + [(END_SEQ, b"")]
        try:
            body = json.loads(request)
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("snapshot") is True:
            batch = KVEventBatch(time.time(), self._live.snapshot(), self.dp_rank)
            return [(self._next_seq, ENCODER.encode(batch)), (END_SEQ, b"")]
        return [self._error("a replay request is an 8-byte big-endian start sequence number or "
                            '{"snapshot": true}', oldest)]

    def _error(self, message: str, oldest: int) -> tuple[int, bytes]:
        return ERROR_SEQ, msgspec.json.encode({"error": message, "oldest": oldest, "next": self._next_seq})

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def live_blocks(self) -> int:
        return len(self._live)


class KVEvents:
    """A server's KV events: the sink its radix caches report to and the publisher, on TP rank 0 (every rank
    holds the same tree)."""

    @classmethod
    def create(cls, args, tp_rank: int) -> Optional["KVEvents"]:
        from tidal.kvevents.events import parse_kv_events_config

        cfg = parse_kv_events_config(args.kv_events_config)
        if cfg is None or not cfg.enabled or tp_rank != 0:
            return None
        return cls(cfg.resolved(args.host), args.page_size)

    def __init__(self, cfg: KVEventsConfig, block_size: int) -> None:
        from tidal.kvevents.events import KVEventSink

        self.sink = KVEventSink(block_size)
        self.publisher = KVEventPublisher(cfg)
        self.topic = cfg.topic

    def publish(self) -> None:
        if self.sink.pending:
            self.publisher.publish(self.sink.take())

    def info(self) -> dict:
        """Where a subscriber connects (the bound endpoints: a port 0 is resolved)."""
        return {"endpoint": self.publisher.endpoint, "replay_endpoint": self.publisher.replay_endpoint,
                "topic": self.topic, "block_size": self.sink.block_size}

    def close(self) -> None:
        self.publisher.close()
