"""The bootstrap server that decode servers ask for the prefill ranks (SGLang's routes),
and the decode side's client of it: lookups and heartbeats in one background thread.

Routes (PUT and DELETE /route need `Authorization: Bearer KEY` when the server has a key,
401 otherwise: only the ranks of the server that owns it can (re)point its rooms):
  PUT /route      a prefill rank registers {role, rank_ip, rank_port, engine_rank,
                  tp_size, dp_size, pp_size, page_size, kv_dtype, [dp_group, pp_rank, prefill_id,
                  num_kv_heads (the model's)]}
  DELETE /route   ?engine_rank&target_dp_group&target_pp_rank[&prefill_id]: deregister
  GET /route      engine_rank=-1&target_dp_group=-1&target_pp_rank=-1: the topology
                  {prefill_attn_tp_size, prefill_dp_size, prefill_pp_size, prefill_page_size,
                  prefill_kv_dtype[, prefill_num_kv_heads]}; otherwise one rank's
                  {rank_ip, rank_port, prefill_id}.
                  400 bad query, 404 unknown rank, 503 nothing registered yet.
  GET /health
  POST /heartbeat {decode_id, [endpoint]} -> {status, prefill_ids}; open, so the peers it
                  remembers expire after PEER_TTL_S and are capped at MAX_DECODE_PEERS.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web

from tidal.transfer.common import http_json
from tidal.transfer.heads import HeadLayout, HeadSlice, sources, split_problem

logger = logging.getLogger(__name__)

_REQUIRED = {"rank_ip": str, "rank_port": int, "engine_rank": int}
_OPTIONAL_INT = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 1, "dp_group": 0, "pp_rank": 0,
                 "num_kv_heads": 0}


def _parse_registration(body: Any) -> dict:
    """The validated registration, or ValueError saying what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    role = body.get("role", "Prefill")
    if not isinstance(role, str) or role.lower() != "prefill":
        raise ValueError(f"role must be 'Prefill', got {role!r}")
    out: dict[str, Any] = {}
    for key, typ in _REQUIRED.items():
        value = body.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ValueError(f"{key} is required ({typ.__name__})")
        out[key] = value
    for key, default in _OPTIONAL_INT.items():
        value = body.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key} must be a non-negative int")
        out[key] = value
    if out["engine_rank"] >= out["tp_size"] or out["page_size"] < 1 or not 0 < out["rank_port"] < 65536:
        raise ValueError("engine_rank must be < tp_size, page_size >= 1, rank_port in 1..65535")
    out["kv_dtype"] = str(body.get("kv_dtype", ""))
    out["prefill_id"] = str(body.get("prefill_id", f"{out['rank_ip']}:{out['rank_port']}"))
    return out


def _query_ints(request: web.Request, names: tuple[str, ...]) -> tuple[int, ...]:
    try:
        return tuple(int(request.query[n]) for n in names)
    except (KeyError, ValueError) as e:
        raise web.HTTPBadRequest(text=f"query needs integer {', '.join(names)}: {e}") from e


_ROUTE_KEYS = ("engine_rank", "target_dp_group", "target_pp_rank")
PEER_TTL_S = 30.0  # a few heartbeat intervals (TIDAL's default interval is 5 s)
MAX_DECODE_PEERS = 1024


def _has_key(request: web.Request, key: str) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def hold_port(host: str, port: int) -> Optional[socket.socket]:
    """A socket bound to host:port that never listens, for a server that may become prefill later.

    While it lives no other socket binds the port, an outgoing connection's ephemeral port
    included, except one that sets SO_REUSEADDR and listens: the bootstrap server, which binds
    beside it whenever the server turns prefill. None (a warning logged) if the port is taken
    now; the switch to prefill then fails with the port's error and rolls back.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        logger.warning("bootstrap port %s:%d is in use (%s): this server cannot become prefill until it is free",
                       host, port, e)
        return None
    return sock


class BootstrapServer:
    """HTTP server in its own thread and event loop. `start()` raises if the port is taken."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, key: Optional[str] = None):
        self.host = host
        self.port = port
        self.key = key  # None: registrations from anyone (tests and benchmarks building parts directly)
        self._lock = threading.Lock()
        self._ranks: dict[tuple[int, int, int], dict] = {}  # (dp_group, engine_rank, pp_rank)
        self._topology: Optional[dict] = None
        self._decode_peers: dict[str, dict] = {}
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    # ---- lifecycle

    def start(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            raise RuntimeError("bootstrap server already started")
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._serve, name=f"tidal-bootstrap-{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"bootstrap server on {self.host}:{self.port} did not start in {timeout}s")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            err = self._error
            if isinstance(err, OSError):
                msg = f"bootstrap port {self.host}:{self.port} is already in use or unavailable: {err}"
                raise RuntimeError(msg) from err
            raise RuntimeError(f"bootstrap server failed to start: {err}") from err

    @property
    def running(self) -> bool:
        return self._thread is not None

    def stop(self) -> None:
        """Stops serving and releases the port; idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = None
        self._loop = None

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
        try:
            loop.run_until_complete(self._listen(runner))
        except BaseException as e:  # surfaced by start()
            self._error = e
            loop.run_until_complete(runner.cleanup())
            loop.close()
            self._ready.set()
            return
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    async def _listen(self, runner: web.AppRunner) -> None:
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True, reuse_port=False)
        await site.start()
        if self.port == 0:
            self.port = runner.addresses[0][1]

    # ---- state, for the owner and tests

    def decode_peers(self) -> dict[str, dict]:
        with self._lock:
            return {k: dict(v) for k, v in self._decode_peers.items()}

    def prefill_ids(self) -> list[str]:
        with self._lock:
            return sorted({r["prefill_id"] for r in self._ranks.values()})

    # ---- routes

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_delete("/route", self._delete_route)
        app.router.add_get("/health", self._health)
        app.router.add_post("/heartbeat", self._heartbeat)
        return app

    def _refusal(self, request: web.Request) -> Optional[web.Response]:
        if self.key is None or _has_key(request, self.key):
            return None
        return web.json_response({"error": "registrations need Authorization: Bearer <bootstrap key>"}, status=401,
                                 headers={"WWW-Authenticate": "Bearer"})

    async def _put_route(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        try:
            reg = _parse_registration(await request.json())
        except ValueError as e:  # includes JSON decode errors
            return web.json_response({"error": str(e)}, status=400)
        key = (reg["dp_group"], reg["engine_rank"], reg["pp_rank"])
        with self._lock:
            self._ranks[key] = reg
            self._topology = {
                "prefill_attn_tp_size": reg["tp_size"],
                "prefill_dp_size": reg["dp_size"],
                "prefill_pp_size": reg["pp_size"],
                "prefill_page_size": reg["page_size"],
                "prefill_kv_dtype": reg["kv_dtype"],
            }
            if reg["num_kv_heads"]:
                self._topology["prefill_num_kv_heads"] = reg["num_kv_heads"]
        return web.json_response({"status": "ok"})

    async def _get_route(self, request: web.Request) -> web.Response:
        rank, dp, pp = _query_ints(request, _ROUTE_KEYS)
        with self._lock:
            if not self._ranks:
                return web.json_response({"error": "no prefill rank registered yet"}, status=503)
            if (rank, dp, pp) == (-1, -1, -1):
                return web.json_response(dict(self._topology or {}))
            reg = self._ranks.get((dp, rank, pp))
        if reg is None:
            return web.json_response({"error": f"unknown prefill rank {rank} (dp {dp}, pp {pp})"}, status=404)
        return web.json_response({k: reg[k] for k in ("rank_ip", "rank_port", "prefill_id")})

    async def _delete_route(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        rank, dp, pp = _query_ints(request, _ROUTE_KEYS)
        want = request.query.get("prefill_id")
        with self._lock:
            reg = self._ranks.get((dp, rank, pp))
            if reg is None or (want is not None and reg["prefill_id"] != want):
                return web.json_response({"error": "not registered"}, status=404)
            del self._ranks[(dp, rank, pp)]
            if not self._ranks:
                self._topology = None
        return web.json_response({"status": "ok"})

    async def _health(self, request: web.Request) -> web.Response:
        with self._lock:
            body = {"status": "ok", "prefill_ranks": len(self._ranks), "decode_peers": len(self._decode_peers)}
        return web.json_response(body)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        decode_id = body.get("decode_id") if isinstance(body, dict) else None
        if not isinstance(decode_id, str) or not decode_id:
            return web.json_response({"error": "decode_id (str) is required"}, status=400)
        now = time.time()
        with self._lock:
            self._expire_peers(now)
            if decode_id in self._decode_peers or len(self._decode_peers) < MAX_DECODE_PEERS:
                self._decode_peers[decode_id] = {"last_seen": now, "endpoint": str(body.get("endpoint", ""))[:256]}
            ids = sorted({r["prefill_id"] for r in self._ranks.values()})
        return web.json_response({"status": "ok", "prefill_ids": ids})


    def _expire_peers(self, now: float) -> None:
        stale = [k for k, v in self._decode_peers.items() if now - v["last_seen"] > PEER_TTL_S]
        for k in stale:
            del self._decode_peers[k]


# ---------------------------------------------------------------- decode-side client


@dataclass(frozen=True)
class Leg:
    """One prefill rank a decode rank reads from, and the heads it reads."""

    rank: int
    endpoint: str
    prefill_id: str
    heads: HeadSlice


class Target:
    """Where one prefill bootstrap address leads: the prefill ranks this decode rank
    reads from (one when both sides run the same TP size); resolved by BootstrapClient's
    thread.

    state: "pending" -> "ready" (legs set) | "failed" (error set).
    Readers in other threads only look at `state` and the fields it guards.
    """

    def __init__(self, addr: str, deadline: float):
        self.addr = addr
        self.state = "pending"
        self.error: Optional[str] = None
        self.legs: list[Leg] = []
        self.deadline = deadline
        self.next_try = 0.0
        self.backoff = 0.05
        self.why = ""  # why it is still pending
        self.misses = 0


class BootstrapClient:
    """Resolves prefill bootstrap addresses (cached per address) and sends heartbeats
    to every bootstrap server this decode manager is paired with."""

    HTTP_TIMEOUT = 1.0

    def __init__(self, decode_id: str, endpoint: str, page_size: int, kv_dtype: str, engine_rank: int,
                 config, on_ready, on_lost, heads: Optional[HeadLayout] = None):
        self.decode_id = decode_id
        self.endpoint = endpoint
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.engine_rank = engine_rank
        self.heads = heads  # this decode server's; None: one rank, whatever prefill has
        self.config = config
        self._on_ready = on_ready  # (Target) -> None
        self._on_lost = on_lost  # (Target, reason, replaced: another prefill registered at its address) -> None
        self._lock = threading.Lock()
        self._targets: dict[str, Target] = {}
        self._wake = threading.Event()
        self._stop = False
        self._next_heartbeat = time.monotonic() + config.heartbeat_interval
        self._thread = threading.Thread(target=self._run, name="tidal-kv-bootstrap-client", daemon=True)
        self._thread.start()

    def target(self, addr: str) -> Target:
        """The cached target of addr, or a new pending one resolved in the background."""
        with self._lock:
            t = self._targets.get(addr)
            if t is None:
                t = Target(addr, time.monotonic() + self.config.bootstrap_timeout)
                self._targets[addr] = t
                self._wake.set()
            return t

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop:
            now = time.monotonic()
            with self._lock:
                pending = [t for t in self._targets.values() if t.state == "pending" and t.next_try <= now]
            for t in pending:
                self._resolve(t)
            if now >= self._next_heartbeat:
                self._heartbeats()
                self._next_heartbeat = time.monotonic() + self.config.heartbeat_interval
            self._wake.wait(self._sleep_time())
            self._wake.clear()

    def _sleep_time(self) -> float:
        now = time.monotonic()
        with self._lock:
            tries = [t.next_try for t in self._targets.values() if t.state == "pending"]
        return max(0.0, min([self._next_heartbeat, *tries]) - now)

    def _resolve(self, t: Target) -> None:
        try:
            status, topo = http_json("GET", t.addr, "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1",
                                     timeout=self.HTTP_TIMEOUT)
            if status == 200:
                refusal = self._refusal(topo)
                if refusal:
                    return self._fail(t, refusal)
                status, legs = self._legs(t, topo)
            if status == 200:
                return self._ready(t, legs)
            if status not in (503, 404):
                return self._fail(t, f"bootstrap server {t.addr} answered HTTP {status}: {topo if status else ''}")
            why = f"no prefill rank registered at bootstrap server {t.addr}"
        except (OSError, ValueError) as e:
            why = f"bootstrap server {t.addr} unreachable: {e}"
        t.why = why
        if time.monotonic() >= t.deadline:
            return self._fail(t, f"bootstrap timeout after {self.config.bootstrap_timeout}s: {why}")
        t.next_try = time.monotonic() + t.backoff
        t.backoff = min(1.0, t.backoff * 2)

    def _refusal(self, topo: dict) -> Optional[str]:
        page_size = topo.get("prefill_page_size")
        if page_size != self.page_size:
            return f"refusing to pair: prefill page size {page_size} != decode page size {self.page_size}"
        kv_dtype = topo.get("prefill_kv_dtype")
        if kv_dtype != self.kv_dtype:
            return f"refusing to pair: prefill kv dtype {kv_dtype!r} != decode kv dtype {self.kv_dtype!r}"
        tp = topo.get("prefill_attn_tp_size", 1)
        total = self._total_heads(topo)
        theirs = topo.get("prefill_num_kv_heads")
        if theirs is not None and theirs != total:
            return f"refusing to pair: prefill serves a model with {theirs} KV heads, decode {total}"
        problem = split_problem(total, tp) if isinstance(tp, int) else f"bad TP size {tp!r}"
        if problem:  # no slicing of heads serves this pair
            return f"refusing to pair: prefill TP size {tp}: {problem}"
        return None

    def _total_heads(self, topo: dict) -> int:
        if self.heads is not None:
            return self.heads.total_heads
        return topo.get("prefill_num_kv_heads") or topo.get("prefill_attn_tp_size", 1)

    def _legs(self, t: Target, topo: dict) -> tuple[int, Any]:
        """(200, the legs) once every prefill rank this decode rank reads from is registered; else (status, why)."""
        prefill = HeadLayout(self._total_heads(topo), topo.get("prefill_attn_tp_size", 1))
        decode = self.heads or HeadLayout(prefill.total_heads, 1)
        legs = []
        for rank, heads in sources(prefill, decode, self.engine_rank).items():
            status, reg = http_json("GET", t.addr, f"/route?engine_rank={rank}&target_dp_group=0&target_pp_rank=0",
                                    timeout=self.HTTP_TIMEOUT)
            if status != 200:
                return status, reg
            endpoint = f"tcp://{reg['rank_ip']}:{reg['rank_port']}"
            legs.append(Leg(rank, endpoint, str(reg.get("prefill_id", endpoint)), heads))
        return 200, legs

    def _ready(self, t: Target, legs: list[Leg]) -> None:
        t.legs = legs
        t.state = "ready"
        self._on_ready(t)

    def _fail(self, t: Target, reason: str) -> None:
        t.error = reason
        t.state = "failed"
        with self._lock:
            if self._targets.get(t.addr) is t:
                del self._targets[t.addr]
        logger.warning("%s", reason)

    def _heartbeats(self) -> None:
        with self._lock:
            ready = [t for t in self._targets.values() if t.state == "ready"]
        body = {"decode_id": self.decode_id, "endpoint": self.endpoint}
        for t in ready:
            try:
                status, resp = http_json("POST", t.addr, "/heartbeat", body, timeout=self.HTTP_TIMEOUT)
            except OSError as e:
                status, resp = 0, {"error": str(e)}
            registered = resp.get("prefill_ids", []) if status == 200 else []
            gone = [leg.prefill_id for leg in t.legs if leg.prefill_id not in registered]
            if status == 200 and gone:
                # another prefill registered here (the server left prefill and came back): it
                # takes over the rooms the gone one never started
                self._lose(t, f"prefill {gone[0]} is no longer registered at {t.addr}", replaced=bool(registered))
            elif status == 200:
                t.misses = 0
            else:
                t.misses += 1
                if t.misses >= self.config.heartbeat_misses:
                    self._lose(t, f"bootstrap server {t.addr} missed {t.misses} heartbeats: {resp}")

    def _lose(self, t: Target, reason: str, replaced: bool = False) -> None:
        self._fail(t, reason)
        self._on_lost(t, reason, replaced)
