"""Prefill side of the common transfer layer: the room table, the control handlers,
and the sender the scheduler drives.

A room is Bootstrapping until decode's TransferInfo (its destination pages) arrives
from every decode rank that reads from this rank (one when both sides run the same TP
size; see tidal.transfer.heads), then WaitingForInput; the last send makes it
Transferring; every destination's RoomAck (pages and metadata landed) makes it Success.
Any failure of a room that has destinations queues a fence behind the room's transfer
jobs: the fence tells each decode rank RoomFailed, so it knows nothing will be written
to its pages any more.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from tidal.transfer.base import (
    BaseKVSender,
    KVArgs,
    KVTransferError,
    Peer,
    TransferConfig,
    TransferStats,
    Transport,
    layout_of,
    layout_problem,
    pages_problem,
)
from tidal.transfer.heads import HeadLayout, readers, sources
from tidal.transfer.common import (
    AbortRoom,
    Bye,
    ControlPlane,
    Hello,
    HelloAck,
    RoomAck,
    RoomDone,
    RoomFailed,
    TransferInfo,
    WireMsg,
    encode_msg,
)
from tidal.transfer.metadata import encode_record
from tidal.transfer.poll import TERMINAL_POLLS, KVPoll
from tidal.transfer.workers import TransferWorkers

logger = logging.getLogger(__name__)


@dataclass
class Destination:
    decode_id: str
    endpoint: str
    pages: np.ndarray
    metadata_index: int
    arrived: float
    rank: int = 0  # the decode rank's TP rank
    expected: int = 1  # destinations the room has in all (decode ranks reading from this rank)


class SenderRoom:
    def __init__(self, room: int, doomed: bool):
        self.room = room
        self.status = KVPoll.Bootstrapping
        self.reason: Optional[str] = None
        self.created = time.monotonic()
        self.init_at: Optional[float] = None
        self.dsts: dict[int, Destination] = {}  # decode rank -> where its pages go
        self.expected: Optional[int] = None  # len(dsts) once every destination arrived
        self.acked: set[int] = set()
        self.num_kv_pages: Optional[int] = None
        self.metadata_index = -1
        self.sent = 0
        self.doomed = doomed


class PrefillSide:
    def __init__(self, args: KVArgs, config: TransferConfig, transport: Transport, stats: TransferStats,
                 prefill_id: str):
        self.args = args
        self.config = config
        self.transport = transport
        self.stats = stats
        self.prefill_id = prefill_id
        self.control: Optional[ControlPlane] = None
        self.endpoint = ""  # this rank's inbox as registered with the bootstrap server
        self._lock = threading.RLock()
        self._rooms: dict[int, SenderRoom] = {}
        self._pending: dict[int, dict[int, Destination]] = {}  # room -> destinations that came before its sender
        self._tombstones: dict[int, tuple[str, str, float]] = {}  # room -> (origin, reason, when)
        self._peers: dict[str, Peer] = {}
        self._layout = layout_of(args)
        self._workers = TransferWorkers(config.transfer_threads, f"r{args.engine_rank}", transport.release_thread)
        self._closed = False

    def attach(self, control: ControlPlane, endpoint: str) -> None:
        self.control = control
        self.endpoint = endpoint

    # ---- scheduler thread

    def open_room(self, room: int) -> SenderRoom:
        st = SenderRoom(room, doomed=random.random() < self.config.failure_prob)
        with self._lock:
            tomb = self._tombstones.get(room)
            if self._closed:
                reason = "prefill transfer manager is shut down"
            elif room in self._rooms:
                reason = f"duplicate bootstrap_room {room}: another request on this prefill holds it"
            elif tomb is not None and tomb[0] == "peer":
                reason = tomb[1]
            else:
                self._rooms[room] = st
                for dst in self._pending.pop(room, {}).values():
                    self._attach(st, dst)
                return st
        st.status, st.reason = KVPoll.Failed, reason
        self.stats.add_failure(during_bootstrap=True)
        return st

    def poll(self, st: SenderRoom) -> KVPoll:
        if st.status not in TERMINAL_POLLS:
            if st.doomed and st.status != KVPoll.Bootstrapping:  # the partner is known: told
                self.fail(st, "injected failure (TIDAL_DISAGG_TEST_FAILURE_PROB)")
            else:
                self._check_deadlines(st, time.monotonic())
        return st.status

    def init(self, st: SenderRoom, num_kv_pages: int, metadata_index: int) -> None:
        with self._lock:
            if st.status == KVPoll.Failed:
                return
            st.num_kv_pages = int(num_kv_pages)
            st.metadata_index = int(metadata_index)
            st.init_at = time.monotonic()
            problem = self._size_problem(st)
        if problem:
            self.fail(st, problem)

    def send(self, st: SenderRoom, pages: np.ndarray, is_last: bool) -> None:
        pages = np.ascontiguousarray(pages, dtype=np.int64).reshape(-1)
        with self._lock:
            if st.status == KVPoll.Failed:
                return
            problem = self._send_problem(st, pages, is_last)
            if problem is None:
                dsts = [(d, d.pages[st.sent : st.sent + len(pages)]) for d in st.dsts.values()]
                st.sent += len(pages)
                if is_last:
                    st.status = KVPoll.Transferring
        if problem:
            return self.fail(st, problem)
        done = None
        if is_last:
            record = encode_record(self.args.metadata.get(st.metadata_index))
            done = RoomDone(room=st.room, prefill_id=self.prefill_id, metadata=record, num_pages=st.sent)
        self._workers.submit(st.room, lambda: self._run_send(st, pages, dsts, done))

    def fail(self, st: SenderRoom, reason: str, gone: Optional[str] = None, also: Optional[str] = None) -> None:
        """Every destination but `gone` (a decode rank that left) is told; `also`: an
        endpoint to tell besides them (a decode rank whose destination never arrived)."""
        with self._lock:
            if st.status in TERMINAL_POLLS:
                return
            during_bootstrap = st.status == KVPoll.Bootstrapping
            st.status, st.reason = KVPoll.Failed, reason
            if self._rooms.get(st.room) is st:
                del self._rooms[st.room]
                self._tombstones[st.room] = ("local", reason, time.monotonic())
            tell = [d.endpoint for d in st.dsts.values() if d.decode_id != gone]
        if also is not None and also not in tell:
            tell.append(also)
        self.stats.add_failure(during_bootstrap)
        logger.info("prefill room %s failed: %s", st.room, reason)
        msg = RoomFailed(room=st.room, prefill_id=self.prefill_id, reason=reason)
        for endpoint in tell:
            self._workers.submit(st.room, lambda e=endpoint: self._send(e, msg))

    # ---- checks (lock held)

    def _size_problem(self, st: SenderRoom) -> Optional[str]:
        if st.num_kv_pages is None:
            return None
        for d in st.dsts.values():
            if len(d.pages) != st.num_kv_pages:
                return (f"page count mismatch: prefill will send {st.num_kv_pages} pages, decode rank {d.rank} "
                        f"gave {len(d.pages)}")
        return None

    def _send_problem(self, st: SenderRoom, pages: np.ndarray, is_last: bool) -> Optional[str]:
        n = len(pages)
        if st.expected is None:
            return "send() before the decode destinations arrived (poll() was not WaitingForInput)"
        if st.num_kv_pages is None:
            return "send() before init()"
        if st.status == KVPoll.Transferring:
            return "send() after the last chunk"
        if not 0 <= st.metadata_index < self.args.metadata.size:
            return f"metadata slot {st.metadata_index} out of range"
        if st.sent + n > st.num_kv_pages:
            return f"sending {st.sent + n} pages, more than the {st.num_kv_pages} announced in init()"
        if is_last and st.sent + n != st.num_kv_pages:
            return f"last send leaves {st.num_kv_pages - st.sent - n} of {st.num_kv_pages} pages unsent"
        return pages_problem(pages, self.args.kv_pool, self.args.page_size)

    def _check_deadlines(self, st: SenderRoom, now: float) -> None:
        if st.status == KVPoll.Bootstrapping and now - st.created > self.config.bootstrap_timeout:
            self.fail(st, f"bootstrap timeout: no destination from decode for room {st.room} "
                          f"after {self.config.bootstrap_timeout}s")
        elif st.init_at is not None and st.status not in TERMINAL_POLLS and now - st.init_at > self.config.waiting_timeout:
            self.fail(st, f"waiting timeout: room {st.room} not completed {self.config.waiting_timeout}s after init")

    def _attach(self, st: SenderRoom, dst: Destination) -> None:
        st.dsts[dst.rank] = dst
        if len(st.dsts) == dst.expected:
            st.expected = dst.expected
            if st.status == KVPoll.Bootstrapping:
                st.status = KVPoll.WaitingForInput

    # ---- transfer worker threads

    def _run_send(self, st: SenderRoom, src: np.ndarray, dsts: list[tuple[Destination, np.ndarray]],
                  done: Optional[RoomDone]) -> None:
        for dst, pages in dsts:
            if st.status == KVPoll.Failed:
                return
            peer = self._peers.get(dst.decode_id)
            try:
                if peer is None:
                    raise KVTransferError(f"decode peer {dst.decode_id} is gone")
                if len(src) and peer.heads.count:
                    self.stats.add_bytes(self.transport.write(peer, st.room, self.prefill_id, src, pages))
                if done is not None and st.status != KVPoll.Failed:
                    if self.transport.inband_done_for(peer):
                        self.transport.finish(peer, st.room, self.prefill_id, encode_msg(done))
                    else:
                        self._send(peer.endpoint, done)
            except Exception as e:
                logger.warning("transfer of room %s failed", st.room, exc_info=True)
                self.fail(st, f"transfer failed ({self.transport.name}): {e}")

    def _send(self, endpoint: str, msg: WireMsg) -> None:
        if self.control is not None:
            self.control.send(endpoint, msg)

    # ---- control thread

    def on_message(self, msg: WireMsg) -> None:
        if isinstance(msg, TransferInfo):
            self._on_transfer_info(msg)
        elif isinstance(msg, RoomAck):
            self._on_ack(msg)
        elif isinstance(msg, AbortRoom):
            self._on_abort(msg)
        elif isinstance(msg, Hello):
            self._on_hello(msg)
        elif isinstance(msg, Bye):
            self._on_bye(msg)
        else:
            logger.debug("prefill ignores %s", type(msg).__name__)

    def _on_hello(self, msg: Hello) -> None:
        peer, error = self._peer_of(msg)
        error = error or self.transport.check_peer(msg.info)
        if error is None:
            with self._lock:
                self._peers[msg.decode_id] = peer
        self._send(msg.endpoint, HelloAck(prefill_id=self.prefill_id, endpoint=self.endpoint, error=error))

    def _peer_of(self, msg: Hello) -> tuple[Optional[Peer], Optional[str]]:
        """The decode rank behind a hello, with the heads it reads from this rank; or why it cannot pair."""
        theirs = dict(msg.layout)
        problem = layout_problem(dict(self._layout), theirs)
        if problem:
            return None, problem
        mine, rank = self.args.head_layout(), self.args.engine_rank
        try:
            decode = HeadLayout(theirs["total_kv_heads"], theirs["tp_size"])
            heads = sources(mine, decode, theirs["tp_rank"]).get(rank)
        except ValueError as e:
            return None, f"cannot pair prefill TP {mine.tp_size} with decode TP {theirs['tp_size']}: {e}"
        if heads is None:
            return None, f"decode rank {theirs['tp_rank']} reads nothing from prefill rank {rank}"
        if heads.dst_heads != theirs.get("num_kv_heads", heads.dst_heads):
            return None, f"decode rank {theirs['tp_rank']} pool holds {theirs['num_kv_heads']} KV heads, " \
                         f"expected {heads.dst_heads}"
        return Peer(msg.decode_id, msg.endpoint, msg.info, heads, theirs["tp_rank"],
                    len(readers(mine, decode, rank))), None

    def _on_transfer_info(self, msg: TransferInfo) -> None:
        with self._lock:
            peer = self._peers.get(msg.decode_id)
            if peer is None:
                reject = "unknown decode peer (no hello)"
            else:
                dst = Destination(msg.decode_id, msg.endpoint, np.frombuffer(msg.dst_pages, dtype=np.int64).copy(),
                                  msg.metadata_index, time.monotonic(), peer.rank, peer.readers)
                reject = self._accept(msg.room, dst)
        if reject:
            self._send(msg.endpoint, RoomFailed(room=msg.room, prefill_id=self.prefill_id, reason=reject))

    def _accept(self, room: int, dst: Destination) -> Optional[str]:
        st = self._rooms.get(room)
        if st is not None:
            if dst.rank in st.dsts or st.expected is not None:
                return f"room {room} is already paired with another destination"
            if any(d.expected != dst.expected for d in st.dsts.values()):
                return f"room {room}: destinations from decode servers of different TP sizes"
            self._attach(st, dst)
            problem = self._size_problem(st)
            if problem:
                self.fail(st, problem)
            return None
        tomb = self._tombstones.get(room)
        if tomb is not None:
            return f"prefill request for room {room} already failed: {tomb[1]}"
        pending = self._pending.setdefault(room, {})
        if dst.rank in pending:
            return f"duplicate destination for room {room}"
        pending[dst.rank] = dst
        return None

    def _on_ack(self, msg: RoomAck) -> None:
        with self._lock:
            st = self._rooms.get(msg.room)
            if st is None or st.status != KVPoll.Transferring:
                return
            rank = next((r for r, d in st.dsts.items() if d.decode_id == msg.decode_id), None)
            if rank is None:
                return
            st.acked.add(rank)
            if len(st.acked) < len(st.dsts):
                return
            st.status = KVPoll.Success
            del self._rooms[msg.room]
        self.stats.add_success(time.monotonic() - (st.init_at or st.created))

    def _on_abort(self, msg: AbortRoom) -> None:
        reason = f"aborted by decode: {msg.reason}"
        with self._lock:
            st = self._rooms.get(msg.room)
            if st is not None and st.expected is not None and all(d.decode_id != msg.decode_id
                                                                   for d in st.dsts.values()):
                return  # not this room's partner
            pend: dict[int, Destination] = {}
            if st is None:
                pend = self._pending.pop(msg.room, {})
                self._tombstones[msg.room] = ("peer", reason, time.monotonic())
        if st is not None:
            return self.fail(st, reason, also=msg.endpoint)  # its fence answers decode
        msg_failed = RoomFailed(room=msg.room, prefill_id=self.prefill_id, reason=reason)
        for endpoint in {msg.endpoint, *(d.endpoint for d in pend.values())}:
            self._send(endpoint, msg_failed)

    def _on_bye(self, msg: Bye) -> None:
        with self._lock:
            self._peers.pop(msg.decode_id, None)
            gone = [st for st in self._rooms.values() if any(d.decode_id == msg.decode_id for d in st.dsts.values())]
            for room, dsts in list(self._pending.items()):
                for rank in [r for r, d in dsts.items() if d.decode_id == msg.decode_id]:
                    del dsts[rank]
                if not dsts:
                    del self._pending[room]
        for st in gone:
            self.fail(st, f"decode peer {msg.decode_id} left", gone=msg.decode_id)
        self._workers.broadcast(lambda: self.transport.drop_peer(msg.decode_id))
        self.control.disconnect(msg.endpoint)

    def on_tick(self, now: float) -> None:
        with self._lock:
            live = list(self._rooms.values())
            keep = self.config.bootstrap_timeout + self.config.waiting_timeout
            stale = [(r, d) for r, dsts in self._pending.items() for d in dsts.values() if now - d.arrived > keep]
            for room in {r for r, _ in stale}:
                del self._pending[room]
            for room in [r for r, t in self._tombstones.items() if now - t[2] > keep]:
                del self._tombstones[room]
        for st in live:
            self._check_deadlines(st, now)
        for room, d in stale:
            why = "no prefill request for this room"
            self._send(d.endpoint, RoomFailed(room=room, prefill_id=self.prefill_id, reason=why))

    # ---- lifecycle

    def close(self) -> None:
        """Fails every live room (decode is told), then drains and stops the workers."""
        with self._lock:
            self._closed = True
            live = list(self._rooms.values())
        for st in live:
            self.fail(st, "prefill transfer manager shut down")
        self.transport.interrupt()
        self._workers.close()


class PrefillSender(BaseKVSender):
    def __init__(self, side: PrefillSide, room: int):
        self._side = side
        self._room = side.open_room(room)

    def poll(self) -> KVPoll:
        return self._side.poll(self._room)

    def init(self, num_kv_pages: int, metadata_index: int) -> None:
        self._side.init(self._room, num_kv_pages, metadata_index)

    def send(self, kv_page_indices: np.ndarray, is_last: bool) -> None:
        self._side.send(self._room, kv_page_indices, is_last)

    def failure_exception(self) -> Optional[Exception]:
        reason = self._room.reason
        return KVTransferError(reason) if self._room.status == KVPoll.Failed and reason else None

    def abort(self) -> None:
        self._side.fail(self._room, "aborted by prefill")
