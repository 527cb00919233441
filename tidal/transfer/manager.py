"""KVManager (one per server rank) and the per-request KVSender / KVReceiver.

A manager composes a transport (the backend: how pages move), the ZMQ control plane,
and the prefill or decode side (rooms, handshakes, timeouts). Prefill managers
register their rank with the bootstrap server; decode managers find prefill ranks
through it and send it heartbeats.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Optional

import numpy as np

from tidal.transfer.base import (
    FAKE_BOOTSTRAP_HOST,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    TransferConfig,
    TransferStats,
    Transport,
)
from tidal.config import bearer_headers
from tidal.transfer.common import ControlPlane, advertised_host, http_json
from tidal.transfer.decode import DecodeReceiver, DecodeSide
from tidal.transfer.fake import FakeReceiver, FakeSender
from tidal.transfer.poll import KVPoll
from tidal.transfer.prefill import PrefillSender, PrefillSide

logger = logging.getLogger(__name__)

TransportFactory = Callable[..., Transport]  # (args, mode, sink) -> Transport


def is_fake_addr(bootstrap_addr: str) -> bool:
    return bootstrap_addr.rpartition(":")[0].strip("[]") == FAKE_BOOTSTRAP_HOST


class KVManager(BaseKVManager):
    REGISTER_TIMEOUT = 5.0

    def __init__(self, backend: str, transport_factory: TransportFactory, args: KVArgs, mode: str,
                 bootstrap_port: Optional[int] = None, config: Optional[TransferConfig] = None):
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        if args.page_size != args.kv_pool.page_size:
            raise ValueError(f"KVArgs.page_size {args.page_size} != kv_pool.page_size {args.kv_pool.page_size}")
        self.backend = backend
        self.args = args
        self.mode = mode
        self.config = config or TransferConfig.from_env()
        self.id = f"{mode}-{uuid.uuid4().hex[:12]}"
        self._stats = TransferStats()
        self._host = advertised_host(args.host)
        self._bootstrap: Optional[tuple[str, int]] = None
        self._transport: Optional[Transport] = None
        self._control: Optional[ControlPlane] = None
        self._prefill: Optional[PrefillSide] = None
        self._decode: Optional[DecodeSide] = None
        self._closed = False
        try:
            if mode == "prefill":
                self._start_prefill(transport_factory, bootstrap_port)
            else:
                self._start_decode(transport_factory)
        except BaseException:
            self.shutdown()
            raise

    def _start_prefill(self, factory: TransportFactory, bootstrap_port: Optional[int]) -> None:
        self._transport = factory(self.args, "prefill", None)
        side = self._prefill = PrefillSide(self.args, self.config, self._transport, self._stats, self.id)
        self._control = ControlPlane(self.args.host or "0.0.0.0", self.id, side.on_message, side.on_tick,
                                     advertise=self._host)
        side.attach(self._control, self._control.endpoint)
        if bootstrap_port is not None:
            self.register(bootstrap_port)

    def _start_decode(self, factory: TransportFactory) -> None:
        side = self._decode = DecodeSide(self.args, self.config, self._stats, self.id)
        self._control = ControlPlane(self.args.host or "0.0.0.0", self.id, side.on_message, side.on_tick,
                                     advertise=self._host)
        self._transport = factory(self.args, "decode", side)
        side.attach(self._transport, self._control)

    # ---- bootstrap registration

    def _registration(self) -> dict:
        a = self.args
        return {
            "role": "Prefill", "rank_ip": self._host, "rank_port": self._control.port,
            "engine_rank": a.engine_rank, "tp_size": a.tp_size, "dp_size": a.dp_size, "pp_size": a.pp_size,
            "page_size": a.page_size, "kv_dtype": a.kv_dtype, "prefill_id": self.id,
            "num_kv_heads": a.head_layout().total_heads,
        }

    def register(self, bootstrap_port: int) -> None:
        """PUT /route on host:bootstrap_port, retried for up to REGISTER_TIMEOUT s while the
        server comes up; RuntimeError if it rejects the registration or never answers."""
        if self._prefill is None:
            return
        addr = f"{self._host}:{bootstrap_port}"
        deadline = time.monotonic() + self.REGISTER_TIMEOUT
        delay = 0.02
        while True:
            try:
                status, body = http_json("PUT", addr, "/route", self._registration(),
                                         headers=bearer_headers(self.args.bootstrap_key))
                if status == 200:
                    self._bootstrap = (self._host, bootstrap_port)
                    return
                if status in (400, 401):
                    raise RuntimeError(f"bootstrap server {addr} rejected the registration: {body}")
                why = f"HTTP {status}: {body}"
            except OSError as e:
                why = str(e)
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot register with the bootstrap server at {addr}: {why}")
            time.sleep(delay)
            delay = min(0.2, delay * 2)

    _register = register  # the name the first role integration used

    def forget_registration(self) -> None:
        """The bootstrap server went away with our registration in it: nothing to deregister."""
        self._bootstrap = None

    def _deregister(self) -> None:
        host, port = self._bootstrap
        query = f"/route?engine_rank={self.args.engine_rank}&target_dp_group=0&target_pp_rank=0&prefill_id={self.id}"
        try:
            http_json("DELETE", f"{host}:{port}", query, timeout=0.5, headers=bearer_headers(self.args.bootstrap_key))
        except OSError:
            pass  # the bootstrap server is already gone

    # ---- per-request objects

    def make_sender(self, bootstrap_addr: str, bootstrap_room: int) -> BaseKVSender:
        if is_fake_addr(bootstrap_addr):
            return FakeSender(self._stats, bootstrap_room)
        if self._prefill is None:
            raise ValueError(f"a {self.mode} manager cannot make KV senders")
        return PrefillSender(self._prefill, bootstrap_room)

    def make_receiver(self, bootstrap_addr: str, bootstrap_room: int) -> BaseKVReceiver:
        if is_fake_addr(bootstrap_addr):
            return FakeReceiver(self.args, self._stats, bootstrap_room)
        if self._decode is None:
            raise ValueError(f"a {self.mode} manager cannot make KV receivers")
        return DecodeReceiver(self._decode, bootstrap_addr, bootstrap_room)

    # ---- observability and lifecycle

    @property
    def endpoint(self) -> str:
        return self._control.endpoint if self._control else ""

    def stats(self) -> dict:
        return {"backend": self.backend, "mode": self.mode, "id": self.id, **self._stats.snapshot()}

    def shutdown(self) -> None:
        """Fails live rooms (partners are told), stops every thread, closes every socket and mapping."""
        if self._closed:
            return
        self._closed = True
        if self._bootstrap is not None:
            self._deregister()
        for step in (self._prefill and self._prefill.close, self._decode and self._decode.close,
                     self._control and self._control.close, self._transport and self._transport.close):
            if step:
                try:
                    step()
                except Exception:
                    logger.exception("transfer manager shutdown step failed")


class KVSender(BaseKVSender):
    """One per request on prefill: `KVSender(manager, "host:port", room)`."""

    def __init__(self, manager: BaseKVManager, bootstrap_addr: str, bootstrap_room: int):
        self._impl: BaseKVSender = manager.make_sender(bootstrap_addr, bootstrap_room)

    def poll(self) -> KVPoll:
        return self._impl.poll()

    def init(self, num_kv_pages: int, metadata_index: int) -> None:
        self._impl.init(num_kv_pages, metadata_index)

    def send(self, kv_page_indices: np.ndarray, is_last: bool) -> None:
        self._impl.send(kv_page_indices, is_last)

    def failure_exception(self) -> Optional[Exception]:
        return self._impl.failure_exception()

    def abort(self) -> None:
        self._impl.abort()


class KVReceiver(BaseKVReceiver):
    """One per request on decode: `KVReceiver(manager, "host:port", room)`."""

    def __init__(self, manager: BaseKVManager, bootstrap_addr: str, bootstrap_room: int):
        self._impl: BaseKVReceiver = manager.make_receiver(bootstrap_addr, bootstrap_room)

    def poll(self) -> KVPoll:
        return self._impl.poll()

    def init(self, kv_page_indices: np.ndarray, metadata_index: int) -> None:
        self._impl.init(kv_page_indices, metadata_index)

    def failure_exception(self) -> Optional[Exception]:
        return self._impl.failure_exception()

    def abort(self) -> None:
        self._impl.abort()
