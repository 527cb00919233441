"""Decode side of the common transfer layer: the room table, the prefill rank
connections, the control handlers, and the receiver the scheduler drives.

A room is Bootstrapping until the prefill ranks it reads from (its legs: one when both
sides run the same TP size, several when prefill has more ranks; tidal.transfer.heads)
are resolved (BootstrapClient) and have answered our Hello, then WaitingForInput; init()
sends TransferInfo (the destination pages) to every leg and makes it Transferring; a
RoomDone from every leg (each wrote its heads of every page; it carries the metadata
record) makes it Success, acknowledged to every leg with RoomAck.

A failed room whose legs may still write into its pages (one-sided backends) keeps
reporting Transferring until each such leg's RoomFailed fences it, or `abort_grace`
passes, so the scheduler never frees pages that are still being written.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Optional

import numpy as np

from tidal.transfer.base import (
    BaseKVReceiver,
    KVArgs,
    KVTransferError,
    TransferConfig,
    TransferStats,
    Transport,
    layout_of,
    page_bytes,
    pages_problem,
)
from tidal.transfer.bootstrap import BootstrapClient, Target
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
    decode_msg,
    split_addr,
)
from tidal.transfer.metadata import MetadataRecord, decode_record
from tidal.transfer.poll import TERMINAL_POLLS, KVPoll

logger = logging.getLogger(__name__)


def _valid_addr(addr: str) -> bool:
    try:
        split_addr(addr)
        return True
    except ValueError:
        return False


class RankConn:
    """Our link to one prefill rank's inbox: pending until its HelloAck."""

    def __init__(self, endpoint: str, prefill_id: str):
        self.endpoint = endpoint
        self.prefill_id = prefill_id
        self.state = "pending"
        self.error: Optional[str] = None


class ReceiverRoom:
    def __init__(self, room: int, addr: str, doomed: bool):
        self.room = room
        self.addr = addr
        self.status = KVPoll.Bootstrapping
        self.reason: Optional[str] = None
        self.created = time.monotonic()
        self.init_at: Optional[float] = None
        self.failed_at = 0.0
        self.target: Optional[Target] = None
        self.conns: list[RankConn] = []  # one per leg, once every leg is ready
        self.done: set[str] = set()  # prefill ids whose RoomDone arrived
        self.record: Optional[MetadataRecord] = None  # the first leg's
        self.dst: Optional[np.ndarray] = None
        self.metadata_index = -1
        self.info_sent = False
        self.unfenced: set[str] = set()  # after a failure: legs that may still write
        self.writing = 0
        self.doomed = doomed

    @property
    def fenced(self) -> bool:
        return not self.unfenced


class DecodeSide:
    def __init__(self, args: KVArgs, config: TransferConfig, stats: TransferStats, decode_id: str):
        self.args = args
        self.config = config
        self.stats = stats
        self.decode_id = decode_id
        self.transport: Optional[Transport] = None
        self.control: Optional[ControlPlane] = None
        self.client: Optional[BootstrapClient] = None
        self._lock = threading.RLock()
        self._rooms: dict[int, ReceiverRoom] = {}
        self._conns: dict[str, RankConn] = {}
        # rooms that failed while their prefill's endpoint was still being looked up: room -> (target, reason,
        # failed at); told once the target resolves (`_on_target_ready`), forgotten after the bootstrap timeout
        self._untold: dict[int, tuple[Target, str, float]] = {}
        self._closed = False

    def attach(self, transport: Transport, control: ControlPlane) -> None:
        self.transport = transport
        self.control = control
        self.client = BootstrapClient(self.decode_id, control.endpoint, self.args.page_size, self.args.kv_dtype,
                                      self.args.engine_rank, self.config, self._on_target_ready, self._on_target_lost,
                                      heads=self.args.head_layout())

    # ---- scheduler thread

    def open_room(self, addr: str, room: int) -> ReceiverRoom:
        st = ReceiverRoom(room, addr, doomed=random.random() < self.config.failure_prob)
        with self._lock:
            if self._closed:
                reason = "decode transfer manager is shut down"
            elif room in self._rooms:
                reason = f"duplicate bootstrap_room {room}: another request on this decode holds it"
            elif not _valid_addr(addr):
                reason = f"bad bootstrap address {addr!r}, expected host:port"
            else:
                self._rooms[room] = st
                st.target = self.client.target(addr)
                return st
        st.status, st.reason = KVPoll.Failed, reason
        self.stats.add_failure(during_bootstrap=True)
        return st

    def poll(self, st: ReceiverRoom) -> KVPoll:
        now = time.monotonic()
        self._advance(st, now)
        if st.doomed and st.status not in TERMINAL_POLLS and st.status != KVPoll.Bootstrapping:
            self.fail(st, "injected failure (TIDAL_DISAGG_TEST_FAILURE_PROB)")  # the partner is known: told
        if st.status == KVPoll.Failed and not st.fenced:
            return KVPoll.Transferring  # a prefill rank may still write into the pages
        return st.status

    def init(self, st: ReceiverRoom, pages: np.ndarray, metadata_index: int) -> None:
        pages = np.array(pages, dtype=np.int64).reshape(-1)
        problem = pages_problem(pages, self.args.kv_pool, self.args.page_size)
        if not 0 <= metadata_index < self.args.metadata.size:
            problem = f"metadata slot {metadata_index} out of range"
        with self._lock:
            if st.status in TERMINAL_POLLS or st.dst is not None:
                return
            if problem is None:
                st.dst, st.metadata_index, st.init_at = pages, int(metadata_index), time.monotonic()
        if problem is not None:
            return self.fail(st, f"init(): {problem}")
        self._advance(st, st.init_at)

    def fail(self, st: ReceiverRoom, reason: str, from_prefill: Optional[str] = None) -> None:
        """from_prefill: the prefill id of the leg that failed the room (it will not write again)."""
        with self._lock:
            if st.status == KVPoll.Failed and from_prefill is not None:
                st.unfenced.discard(from_prefill)
                if st.fenced:
                    self._drop(st)
                return
            if st.status in TERMINAL_POLLS:
                return
            during_bootstrap = st.status == KVPoll.Bootstrapping
            st.status, st.reason, st.failed_at = KVPoll.Failed, reason, time.monotonic()
            guarded = self.transport is not None and self.transport.guarded and st.writing == 0
            if st.info_sent and not guarded:
                st.unfenced = {c.prefill_id for c in st.conns} - st.done - {from_prefill}
            if st.fenced:
                self._drop(st)
            tell = self._partner_endpoints(st, reason, skip=from_prefill)
        self.stats.add_failure(during_bootstrap)
        logger.info("decode room %s failed: %s", st.room, reason)
        for endpoint in tell:
            self._tell_abort(endpoint, st.room, reason)

    def _partner_endpoints(self, st: ReceiverRoom, reason: str, skip: Optional[str] = None) -> list[str]:
        """Lock held. Where to tell the prefill ranks that `st` failed: its connections, else the legs of its
        resolved target (a room that fails while a Hello is still unanswered; each prefill rank fails the room,
        or tombstones it until the request reaches it). A target still being looked up is told once it resolves.
        Without this a request aborted on decode in its first milliseconds held its prefill server's room until
        the prefill's bootstrap timeout (30 s)."""
        if st.conns:
            return [c.endpoint for c in st.conns if c.state == "ready" and c.prefill_id != skip]
        t = st.target
        if t is None or t.state == "failed":
            return []
        if t.state == "ready":
            return [leg.endpoint for leg in t.legs if leg.prefill_id != skip]
        self._untold[st.room] = (t, reason, time.monotonic())
        return []

    def _tell_untold(self, t: Target) -> None:
        """Tells the prefill ranks behind `t`, now resolved, of the rooms that failed while it was looked up."""
        with self._lock:
            rooms = [(room, reason) for room, (target, reason, _) in self._untold.items() if target is t]
            for room, _ in rooms:
                del self._untold[room]
        for room, reason in rooms:
            for leg in t.legs:
                self._tell_abort(leg.endpoint, room, reason)

    def _tell_abort(self, endpoint: str, room: int, reason: str) -> None:
        self._send(endpoint, AbortRoom(room=room, decode_id=self.decode_id, endpoint=self.control.endpoint,
                                       reason=reason))

    def _fence(self, st: ReceiverRoom) -> None:
        st.unfenced.clear()
        self._drop(st)

    def _drop(self, st: ReceiverRoom) -> None:
        if self._rooms.get(st.room) is st:
            del self._rooms[st.room]

    def _advance(self, st: ReceiverRoom, now: float) -> None:
        """Moves a room along from what its target and connection say; applies timeouts."""
        if st.status == KVPoll.Failed:
            if not st.fenced and now - st.failed_at > self.config.abort_grace:
                logger.warning("room %s: no fence from prefill in %ss; releasing", st.room, self.config.abort_grace)
                with self._lock:
                    self._fence(st)
            return
        if st.status == KVPoll.Success:
            return
        if st.status == KVPoll.Bootstrapping:
            self._bootstrap_step(st, now)
        if st.status == KVPoll.WaitingForInput and st.dst is not None:
            self._send_info(st)
        elif st.status == KVPoll.WaitingForInput and now - st.created > self.config.bootstrap_timeout:
            # the decode server never found KV room for it (a full pool or running batch): its prefill gives up
            # on the destination at this same deadline, so the request must not wait on here alone
            self.fail(st, f"no KV room: room {st.room} was not pre-allocated on decode within "
                          f"{self.config.bootstrap_timeout:g}s (the KV pool or the running batch is full)")
        if st.init_at is not None and st.status not in TERMINAL_POLLS and now - st.init_at > self.config.waiting_timeout:
            self.fail(st, f"waiting timeout: room {st.room} not completed {self.config.waiting_timeout}s after init")

    def _bootstrap_step(self, st: ReceiverRoom, now: float) -> None:
        t = st.target
        error = None
        if t is not None and t.state == "failed":
            error = t.error
        elif t is not None and t.state == "ready":
            conns = [self._conns.get(leg.endpoint) for leg in t.legs]
            if all(c is not None and c.prefill_id == leg.prefill_id and c.state == "ready"
                   for c, leg in zip(conns, t.legs, strict=True)):
                with self._lock:
                    if st.status == KVPoll.Bootstrapping:
                        st.conns, st.status = conns, KVPoll.WaitingForInput
                return
            refused = next((c for c in conns if c is not None and c.state == "failed"), None)
            if refused is not None:
                error = f"prefill {t.addr} refused to pair: {refused.error}"
        if error is None and now - st.created > self.config.bootstrap_timeout:
            why = f" ({t.why})" if t is not None and t.why else ""
            error = f"bootstrap timeout: prefill at {st.addr} not reached after {self.config.bootstrap_timeout}s{why}"
        if error is not None:
            self.fail(st, error)

    def _send_info(self, st: ReceiverRoom) -> None:
        with self._lock:
            if st.status != KVPoll.WaitingForInput or st.info_sent:
                return
            st.info_sent = True
            st.status = KVPoll.Transferring
        msg = TransferInfo(room=st.room, decode_id=self.decode_id, endpoint=self.control.endpoint,
                           dst_pages=st.dst.tobytes(), metadata_index=st.metadata_index)
        for conn in st.conns:
            self._send(conn.endpoint, msg)

    def _send(self, endpoint: str, msg: WireMsg) -> None:
        if self.control is not None:
            self.control.send(endpoint, msg)

    # ---- bootstrap client thread

    def _on_target_ready(self, t: Target) -> None:
        self._tell_untold(t)
        hello = None
        for leg in t.legs:
            with self._lock:
                conn = self._conns.get(leg.endpoint)
                if conn is not None and conn.prefill_id == leg.prefill_id and conn.state != "failed":
                    continue
                self._conns[leg.endpoint] = RankConn(leg.endpoint, leg.prefill_id)
            hello = hello or Hello(decode_id=self.decode_id, endpoint=self.control.endpoint,
                                   layout=layout_of(self.args), info=self.transport.local_info())
            self._send(leg.endpoint, hello)

    def _on_target_lost(self, t: Target, reason: str, replaced: bool = False) -> None:
        """The prefill behind t left. Where another registered at its address, its rooms start
        over with that one (unless a write is in flight): a prefill drains before it leaves,
        so a room still waiting on it was routed to its successor and reached only the stale
        endpoint; after a crash the successor writes every page again."""
        with self._lock:
            live = [st for st in self._rooms.values() if st.target is t and st.status not in TERMINAL_POLLS]
            conns = [c for c in (self._conns.pop(leg.endpoint, None) for leg in t.legs) if c is not None]
            moved = [st for st in live if replaced and st.writing == 0 and not st.done and not self._closed]
            for st in moved:
                self._restart_bootstrap(st)
        for st in live:
            if st not in moved:
                self.fail(st, reason)
        if moved:
            logger.info("%s; %d waiting room(s) go to the prefill now registered there", reason, len(moved))
        for conn in conns:
            self.control.disconnect(conn.endpoint)

    def _restart_bootstrap(self, st: ReceiverRoom) -> None:
        """Lock held: the room looks its prefill up again; its pages and deadlines stay."""
        st.target = self.client.target(st.addr)
        st.status, st.conns, st.info_sent = KVPoll.Bootstrapping, [], False

    # ---- control thread (and the tcp receive thread for in-band completions)

    def on_message(self, msg: WireMsg) -> None:
        if isinstance(msg, RoomDone):
            self._on_done(msg)
        elif isinstance(msg, RoomFailed):
            self._on_failed(msg)
        elif isinstance(msg, HelloAck):
            self._on_hello_ack(msg)
        else:
            logger.debug("decode ignores %s", type(msg).__name__)

    def on_inband(self, data: bytes) -> None:
        self.on_message(decode_msg(data))

    def _partner(self, room: int, prefill_id: str) -> Optional[ReceiverRoom]:
        st = self._rooms.get(room)
        if st is None or all(c.prefill_id != prefill_id for c in st.conns):
            return None
        return st

    def _on_done(self, msg: RoomDone) -> None:
        problem, landed = None, False
        with self._lock:
            st = self._partner(msg.room, msg.prefill_id)
            if st is not None and st.status != KVPoll.Transferring:
                return  # failed meanwhile; our AbortRoom is on its way
            if st is None:
                conn = next((c for c in self._conns.values() if c.prefill_id == msg.prefill_id), None)
            else:
                problem = self._leg_done(st, msg)
                landed = problem is None and st.status == KVPoll.Success
        if st is None:
            if conn is not None:  # tell that prefill so its room fails now rather than at its timeout
                self._tell_abort(conn.endpoint, msg.room, "unknown room on decode")
        elif problem:
            self.fail(st, problem)
        elif landed:
            self.stats.add_bytes(len(st.dst) * page_bytes(self.args.kv_pool, self.args.page_size))
            self.stats.add_success(time.monotonic() - (st.init_at or st.created))
            for conn in st.conns:
                self._send(conn.endpoint, RoomAck(room=msg.room, decode_id=self.decode_id))

    def _leg_done(self, st: ReceiverRoom, msg: RoomDone) -> Optional[str]:
        """Lock held. One leg finished; once every leg has, writes the metadata record and
        the room succeeds. None unless something is wrong."""
        try:
            record = decode_record(msg.metadata)
        except Exception as e:
            return f"malformed metadata from prefill: {e}"
        if record.bootstrap_room != st.room:
            return f"metadata is for room {record.bootstrap_room}, not {st.room}"
        if msg.num_pages != len(st.dst):
            return f"prefill wrote {msg.num_pages} pages, decode expected {len(st.dst)}"
        if st.record is not None and record.output_id != st.record.output_id:
            return f"prefill ranks disagree on the first token ({st.record.output_id} vs {record.output_id})"
        st.done.add(msg.prefill_id)
        st.record = st.record or record
        if len(st.done) < len(st.conns):
            return None
        try:
            self.args.metadata.set(st.metadata_index, st.record)
        except (ValueError, IndexError) as e:
            return f"metadata record does not fit this decode's slots: {e}"
        st.status = KVPoll.Success
        self._drop(st)
        return None

    def _on_failed(self, msg: RoomFailed) -> None:
        with self._lock:
            st = self._partner(msg.room, msg.prefill_id)
        if st is not None:
            self.fail(st, f"prefill failed the transfer: {msg.reason}", from_prefill=msg.prefill_id)

    def _on_hello_ack(self, msg: HelloAck) -> None:
        with self._lock:
            conn = self._conns.get(msg.endpoint)
            if conn is None or conn.prefill_id != msg.prefill_id or conn.state != "pending":
                return
            conn.state, conn.error = ("failed", msg.error) if msg.error else ("ready", None)
            waiting = [st for st in self._rooms.values() if st.status == KVPoll.Bootstrapping]
        now = time.monotonic()
        for st in waiting:
            self._advance(st, now)

    def on_tick(self, now: float) -> None:
        with self._lock:
            rooms = list(self._rooms.values())
            for room in [r for r, (_, _, at) in self._untold.items() if now - at > self.config.bootstrap_timeout]:
                del self._untold[room]  # the prefill has timed the room out by now
        for st in rooms:
            self._advance(st, now)

    # ---- DecodeSink, for transports whose own thread writes the pages (tcp)

    def begin_write(self, room: int, prefill_id: str, pages: np.ndarray) -> Optional[ReceiverRoom]:
        with self._lock:
            st = self._partner(room, prefill_id)
            if st is None or st.status != KVPoll.Transferring or not np.isin(pages, st.dst).all():
                return None
            st.writing += 1
            return st

    def end_write(self, st: ReceiverRoom) -> None:
        with self._lock:
            st.writing -= 1
            if st.status == KVPoll.Failed and st.writing == 0 and not st.fenced:
                self._fence(st)

    # ---- lifecycle

    def close(self) -> None:
        """Fails every live room and says Bye to every prefill rank we paired with."""
        with self._lock:
            self._closed = True
            rooms = list(self._rooms.values())
            conns = [c for c in self._conns.values() if c.state == "ready"]
        for st in rooms:
            self.fail(st, "decode transfer manager shut down")
            with self._lock:
                self._fence(st)
        for conn in conns:
            self._send(conn.endpoint, Bye(decode_id=self.decode_id, endpoint=self.control.endpoint))
        if self.client is not None:
            self.client.close()


class DecodeReceiver(BaseKVReceiver):
    def __init__(self, side: DecodeSide, addr: str, room: int):
        self._side = side
        self._room = side.open_room(addr, room)

    def poll(self) -> KVPoll:
        return self._side.poll(self._room)

    def init(self, kv_page_indices: np.ndarray, metadata_index: int) -> None:
        self._side.init(self._room, kv_page_indices, metadata_index)

    def failure_exception(self) -> Optional[Exception]:
        reason = self._room.reason
        return KVTransferError(reason) if self._room.status == KVPoll.Failed and reason else None

    def abort(self) -> None:
        self._side.fail(self._room, "the request was aborted")
