"""The `tcp` backend: any two hosts. Prefill's transfer workers stream pages over ZMQ
to decode's receive thread, which checks each message's sizes and layout (and its CRC32
with TIDAL_DISAGG_TCP_CHECKSUM=1) and writes the pages into the decode pool. The
completion travels behind the pages on the same socket, so it is handled only after
every page of the room is written.

Message: [header, frame, ...]: the pages of layer 0's K, then layer 0's V, layer 1's K, ...,
each block in one or more frames of whole pages, pages in the order of the header's dst_pages.
With different TP sizes on the two sides a page carries only the heads the decode rank
reads from this prefill rank; the header says where they go (head_start, num_heads).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import zlib
from typing import Optional, Union

import msgspec
import numpy as np
import torch
import zmq

from tidal.transfer.base import (
    DecodeSink,
    KVArgs,
    PagePlan,
    Peer,
    Transport,
    as_bytes,
    as_bytes_shape,
    head_bytes,
    head_view,
    page_view,
    sliced_nbytes,
)
from tidal.transfer.common import advertised_host

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20
SEND_HWM = 16  # messages queued per peer before the worker waits (backpressure)
SEND_TIMEOUT = 30.0


class _Frame(msgspec.Struct, tag=True, kw_only=True):
    pass


class PagesFrame(_Frame):
    room: int
    prefill_id: str
    dst_pages: bytes
    nbytes: int
    crc: int  # zlib.crc32 of the payload; -1: not computed
    head_start: int = 0  # where the pages' heads go in the decode pool
    num_heads: int = -1  # -1: all of its heads


class DoneFrame(_Frame):
    data: bytes  # an encoded control message (RoomDone)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Union[PagesFrame, DoneFrame])


def _checksums() -> bool:
    return os.environ.get("TIDAL_DISAGG_TCP_CHECKSUM", "0") == "1"


class TcpTransport(Transport):
    name = "tcp"
    guarded = True
    inband_done = True

    def __init__(self, args: KVArgs, mode: str, sink: Optional[DecodeSink] = None):
        pool = args.kv_pool
        self.pool = pool
        self.page_size = args.page_size
        # [layer K, layer V, ...] page views, in message order
        self._views = [page_view(b, args.page_size) for pair in zip(pool.k_buffer, pool.v_buffer, strict=True)
                       for b in pair]
        self.head_page_nbytes = head_bytes(pool) * args.page_size  # one head of one page of one block
        self._checksum = _checksums()
        self._ctx = zmq.Context(io_threads=1)
        self._local = threading.local()
        self._interrupted = False
        self._receiver: Optional[_Receiver] = None
        if mode == "decode":
            self._receiver = _Receiver(self, sink, args.host or "0.0.0.0")

    # ---- decode side

    def local_info(self) -> dict:
        return {"data_endpoint": self._receiver.endpoint if self._receiver else ""}

    # ---- prefill side (transfer worker threads; one socket per peer per thread)

    def _socket(self, peer: Peer) -> zmq.Socket:
        socks = self._sockets()
        sock = socks.get(peer.decode_id)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.sndhwm = SEND_HWM
            sock.linger = 0
            sock.connect(peer.info["data_endpoint"])
            socks[peer.decode_id] = sock
        return sock

    def _sockets(self) -> dict[str, zmq.Socket]:
        if not hasattr(self._local, "socks"):
            self._local.socks = {}
        return self._local.socks

    def check_peer(self, info: dict) -> Optional[str]:
        return None if info.get("data_endpoint") else "decode has no tcp data endpoint"

    def write(self, peer: Peer, room: int, prefill_id: str, src: np.ndarray, dst: np.ndarray) -> int:
        sock = self._socket(peer)
        h = peer.heads
        views = [head_view(v, h.src_start, h.count) for v in self._views]
        per_msg = max(1, MAX_MESSAGE_BYTES // (self.head_page_nbytes * h.count * len(views)))
        for start in range(0, len(src), per_msg):
            groups = self._groups(views, src[start : start + per_msg])
            crc = -1
            if self._checksum:
                crc = 0
                for g in groups:
                    crc = zlib.crc32(g, crc)
            header = PagesFrame(room=room, prefill_id=prefill_id, dst_pages=dst[start : start + per_msg].tobytes(),
                                nbytes=sum(g.nbytes for g in groups), crc=crc, head_start=h.dst_start,
                                num_heads=-1 if h.whole else h.count)
            self._send(sock, [_encoder.encode(header), *groups])
        return sliced_nbytes(len(src), self.pool, self.page_size, h)

    @staticmethod
    def _groups(views: list[torch.Tensor], src: np.ndarray) -> list[np.ndarray]:
        """The pages as byte arrays, layer by layer, K then V, pages in order. Runs of a
        CPU pool's whole pages go as views (ZMQ sends from the pool itself); scattered pages
        and pages of some heads only are packed."""
        plan = PagePlan(src, np.arange(len(src)))
        out = []
        for view in views:
            if plan.sliced and view.device.type == "cpu" and view.is_contiguous():
                out.extend(as_bytes(view[s : s + n]).reshape(-1) for s, _, n in plan.runs)
            else:
                buf = torch.empty((len(src), *view.shape[1:]), dtype=view.dtype)
                plan.gather(view, buf)
                out.append(as_bytes(buf).reshape(-1))
        return out

    def _send(self, sock: zmq.Socket, parts: list) -> None:
        """Waits while decode drains (backpressure) but gives up on interrupt() or after SEND_TIMEOUT."""
        deadline = time.monotonic() + SEND_TIMEOUT
        while not sock.poll(100, zmq.POLLOUT):
            if self._interrupted or time.monotonic() > deadline:
                raise ConnectionError("tcp: decode is not draining its data socket")
        sock.send_multipart(parts, zmq.NOBLOCK, copy=False)

    def interrupt(self) -> None:
        self._interrupted = True

    def finish(self, peer: Peer, room: int, prefill_id: str, done: bytes) -> None:
        self._send(self._socket(peer), [_encoder.encode(DoneFrame(data=done))])

    def drop_peer(self, decode_id: str) -> None:
        sock = self._sockets().pop(decode_id, None)
        if sock is not None:
            sock.close(linger=0)

    def release_thread(self) -> None:
        for sock in self._sockets().values():
            sock.close(linger=0)
        self._sockets().clear()

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        self._ctx.term()

    # ---- decode side: apply one message (receive thread)

    def apply(self, sink: DecodeSink, header: PagesFrame, frames: list) -> None:
        """Checks one message (sizes, layout, optional CRC32) and writes its pages."""
        dst = np.frombuffer(header.dst_pages, dtype=np.int64)
        sizes = [len(f) for f in frames]
        heads = self.pool.num_kv_heads if header.num_heads == -1 else header.num_heads
        if not (0 < heads and 0 <= header.head_start and header.head_start + heads <= self.pool.num_kv_heads):
            logger.warning("tcp: room %s heads [%d, +%d) outside this pool; dropped", header.room,
                           header.head_start, heads)
            return
        block_page = self.head_page_nbytes * heads
        expected = len(dst) * block_page * len(self._views)
        if sum(sizes) != header.nbytes or header.nbytes != expected or not self._fits(len(dst), sizes, block_page):
            logger.warning("tcp: room %s message of %d bytes in %d frames does not match %d pages; dropped",
                           header.room, sum(sizes), len(sizes), len(dst))
            return
        if header.crc != -1:
            crc = 0
            for f in frames:
                crc = zlib.crc32(f, crc)
            if crc != header.crc:
                logger.warning("tcp: room %s checksum mismatch; dropped", header.room)
                return
        token = sink.begin_write(header.room, header.prefill_id, dst)
        if token is None:
            return  # the room failed or is not ours
        try:
            self._scatter(dst, frames, [head_view(v, header.head_start, heads) for v in self._views], block_page)
        finally:
            sink.end_write(token)

    def _fits(self, num_pages: int, sizes: list[int], block_page: int) -> bool:
        """Every frame holds whole pages of one layer's K or V, and they fill each exactly."""
        filled = blocks = 0
        for size in sizes:
            if size == 0 or size % block_page:
                return False
            filled += size // block_page
            if filled > num_pages:
                return False
            if filled == num_pages:
                blocks, filled = blocks + 1, 0
        return blocks == len(self._views) and filled == 0

    @staticmethod
    def _scatter(dst: np.ndarray, frames: list, views: list[torch.Tensor], block_page: int) -> None:
        block, offset = 0, 0
        plans: dict[tuple[int, int], PagePlan] = {}  # every block repeats the same split
        for f in frames:
            view = views[block]
            k = len(f) // block_page
            pages = np.frombuffer(f, dtype=np.uint8).reshape(k, *as_bytes_shape(view))
            plan = plans.get((offset, k))
            if plan is None:
                plan = plans[(offset, k)] = PagePlan(np.arange(k), dst[offset : offset + k])
            plan.copy(view, pages)
            offset += k
            if offset == len(dst):
                block, offset = block + 1, 0


class _Receiver:
    """Decode's receive thread: a bound PULL socket, stopped through a socketpair."""

    def __init__(self, transport: TcpTransport, sink: DecodeSink, host: str):
        self._transport = transport
        self._sink = sink
        self._sock = transport._ctx.socket(zmq.PULL)
        self._sock.linger = 0
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertised_host(host)}:{port}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tidal-kv-tcp-recv", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        try:
            while not self._stop:
                if self._sock in dict(poller.poll()):
                    self._drain()
        finally:
            self._sock.close(linger=0)

    def _drain(self) -> None:
        while not self._stop:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(parts)
            except Exception:
                logger.exception("tcp: bad message dropped")

    def _handle(self, parts: list) -> None:
        frame = _decoder.decode(parts[0].bytes)
        if isinstance(frame, DoneFrame):
            self._sink.on_inband(frame.data)
        elif len(parts) > 1:
            self._transport.apply(self._sink, frame, [p.buffer for p in parts[1:]])
