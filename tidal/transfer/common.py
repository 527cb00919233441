"""The control plane shared by every backend: typed messages between the prefill and
decode managers over ZMQ, one thread per manager owning every socket, and small
HTTP helpers for the bootstrap server.

Decode -> prefill: Hello (once per prefill rank), TransferInfo (a room's destination
pages and metadata slot), AbortRoom, RoomAck (the room's pages and metadata landed),
Bye (the decode manager is going away).
Prefill -> decode: HelloAck, RoomDone (every page written; carries the metadata
record), RoomFailed (the prefill will not write this room again).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Callable, Optional, Union

import msgspec
import zmq

logger = logging.getLogger(__name__)


class _Wire(msgspec.Struct, tag=True, kw_only=True):
    pass


class Hello(_Wire):
    decode_id: str
    endpoint: str
    layout: dict
    info: dict


class TransferInfo(_Wire):
    room: int
    decode_id: str
    endpoint: str
    dst_pages: bytes  # int64 page ids
    metadata_index: int


class AbortRoom(_Wire):
    room: int
    decode_id: str
    endpoint: str
    reason: str


class RoomAck(_Wire):
    room: int
    decode_id: str


class Bye(_Wire):
    decode_id: str
    endpoint: str


class HelloAck(_Wire):
    prefill_id: str
    endpoint: str  # the prefill rank's inbox, as registered
    error: Optional[str] = None


class RoomDone(_Wire):
    room: int
    prefill_id: str
    metadata: bytes
    num_pages: int


class RoomFailed(_Wire):
    room: int
    prefill_id: str
    reason: str


WireMsg = Union[Hello, TransferInfo, AbortRoom, RoomAck, Bye, HelloAck, RoomDone, RoomFailed]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WireMsg)


def encode_msg(msg: WireMsg) -> bytes:
    return _encoder.encode(msg)


def decode_msg(data: bytes) -> WireMsg:
    return _decoder.decode(data)


class ControlPlane:
    """A bound PULL inbox and PUSH sockets to peers, all owned by one thread.

    `send` may be called from any thread; `on_message` and `on_tick` run in the
    control thread and must not block.
    """

    PEER_LINGER_MS = 200

    def __init__(
        self,
        host: str,
        name: str,
        on_message: Callable[[WireMsg], None],
        on_tick: Callable[[float], None],
        tick_s: float = 0.05,
        advertise: Optional[str] = None,
    ):
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._ctx = zmq.Context(io_threads=1)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.linger = 0
        try:
            port = self._inbox.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._inbox.close()
            self._ctx.term()
            raise
        self.endpoint = f"tcp://{advertise or host}:{port}"
        self.port = port
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._out: deque[tuple[str, Optional[bytes]]] = deque()
        self._peers: dict[str, zmq.Socket] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"tidal-kv-ctrl-{name}", daemon=True)
        self._thread.start()

    def send(self, endpoint: str, msg: WireMsg) -> None:
        self._out.append((endpoint, encode_msg(msg)))
        self._wake()

    def disconnect(self, endpoint: str) -> None:
        self._out.append((endpoint, None))
        self._wake()

    def close(self) -> None:
        """Sends what is queued, stops the thread, closes every socket."""
        if self._stop:
            return
        self._stop = True
        self._wake()
        self._thread.join()
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # ---- control thread

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already woken, or closing

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        next_tick = time.monotonic() + self._tick_s
        try:
            while not self._stop:
                wait_ms = max(0.0, next_tick - time.monotonic()) * 1000
                events = dict(poller.poll(wait_ms))
                if self._wake_r.fileno() in events:
                    self._drain_wake()
                self._flush()
                if self._inbox in events:
                    self._drain_inbox()
                now = time.monotonic()
                if now >= next_tick:
                    self._call(self._on_tick, now)
                    next_tick = now + self._tick_s
            self._flush()
        finally:
            for sock in self._peers.values():
                sock.close(linger=self.PEER_LINGER_MS)
            self._peers.clear()
            self._inbox.close(linger=0)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _flush(self) -> None:
        while self._out:
            endpoint, data = self._out.popleft()
            if data is None:
                sock = self._peers.pop(endpoint, None)
                if sock is not None:
                    sock.close(linger=self.PEER_LINGER_MS)
                continue
            try:
                self._peer(endpoint).send(data, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("control message to %s dropped: %s", endpoint, e)

    def _peer(self, endpoint: str) -> zmq.Socket:
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.sndhwm = 100_000
            sock.connect(endpoint)
            self._peers[endpoint] = sock
        return sock

    def _drain_inbox(self) -> None:
        for _ in range(1000):
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_msg(data)
            except msgspec.DecodeError as e:
                logger.warning("malformed control message ignored: %s", e)
                continue
            self._call(self._on_message, msg)

    @staticmethod
    def _call(fn: Callable, arg) -> None:
        try:
            fn(arg)
        except Exception:  # a handler bug must not kill the control plane
            logger.exception("transfer control handler failed")


# ---------------------------------------------------------------- HTTP helpers


def advertised_host(host: str) -> str:
    """The address peers should use to reach a socket bound on host."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    return os.environ.get("TIDAL_DISAGG_ADVERTISE_HOST") or socket.gethostbyname(socket.gethostname())


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad bootstrap address {addr!r}, expected host:port")
    return host.strip("[]"), int(port)


def http_json(method: str, addr: str, path: str, body: Optional[dict] = None, timeout: float = 2.0,
              headers: Optional[dict] = None) -> tuple[int, dict]:
    """One HTTP request to host:port; (status, JSON body or {}). Raises OSError when unreachable."""
    host, port = split_addr(addr)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers={**sent, **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
    except http.client.HTTPException as e:
        raise OSError(f"HTTP error talking to {addr}: {e}") from e
    finally:
        conn.close()
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        data = {"text": raw.decode(errors="replace")}
    return resp.status, data if isinstance(data, dict) else {"value": data}
