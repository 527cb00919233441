"""The worker registry and its health checker.

A worker's pool is derived from its own state (`mode`, `healthy`), never kept in
separate per-role lists, so that a worker can move between pools by changing one field:
`set_mode` is the hook through which the router will learn each worker's live
`disaggregation_mode` and `epoch` from `/server_info` (runtime role switching).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import aiohttp

logger = logging.getLogger(__name__)

PREFILL, DECODE, NULL = "prefill", "decode", "null"
MODES = (PREFILL, DECODE, NULL)
DEFAULT_BOOTSTRAP_PORT = 8998
LOAD_KEYS = ("num_reqs", "num_waiting_reqs", "num_tokens", "num_queued_prefill_tokens", "max_total_tokens",
             "num_decoding_reqs", "num_waiting_prompt_tokens", "prompts_received_total", "prompt_tokens_received_total")
# reported by tidal servers, not by every server the router may drive: absent, the planner falls back
OPTIONAL_LOAD_KEYS = LOAD_KEYS[5:]
# a tidal server's during a handover: the role whose requests it still finishes (a string, not summed)
HANDOVER_KEY = "handing_over_from"


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"invalid worker URL {url!r}: expected http://host:port")
    return url


def parse_bootstrap_port(value: str) -> Optional[int]:
    """A bootstrap port argument: a port number, or `none`."""
    if value.strip().lower() == "none":
        return None
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"invalid bootstrap port {value!r}: expected a port number or 'none'") from None
    if not 0 < port < 65536:
        raise ValueError(f"invalid bootstrap port {port}")
    return port


def sum_load(entries: Any) -> Optional[dict]:
    """Sum a worker's `/get_load` answer (one entry per DP rank) into one dict: every LOAD_KEYS key, 0 where no
    rank reports it, except the planner's optional ones (OPTIONAL_LOAD_KEYS), which stay absent then."""
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list):
        return None
    total = {k: 0 for k in LOAD_KEYS if k not in OPTIONAL_LOAD_KEYS}
    for e in entries:
        if isinstance(e, dict):
            if isinstance(e.get(HANDOVER_KEY), str) and e[HANDOVER_KEY]:
                total[HANDOVER_KEY] = e[HANDOVER_KEY]
            for k in LOAD_KEYS:
                v = e.get(k)
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + int(v)
    return total


@dataclasses.dataclass
class Worker:
    url: str
    mode: str  # live role: which pool the worker is in
    bootstrap_port: Optional[int] = DEFAULT_BOOTSTRAP_PORT  # used while in prefill mode
    configured_role: str = ""
    healthy: bool = False
    epoch: Optional[int] = None
    failures: int = 0  # consecutive failed health checks / connection errors
    in_flight: int = 0  # requests this router has open on the worker
    load: Optional[dict] = None  # cached /get_load, summed over DP ranks
    last_check: float = 0.0
    last_error: Optional[str] = None
    switching: bool = False  # being moved to another role: in no pool meanwhile
    reports_epoch: bool = False  # a tidal worker: requests carry X-Tidal-Expected-Mode
    boot_id: Optional[str] = None  # a tidal worker's /server_info `boot_id`: a new one is a restart
    tp_size: Optional[int] = None  # from /server_info; None: unknown (pairs with anything)

    def __post_init__(self) -> None:
        self.configured_role = self.configured_role or self.mode

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    def load_score(self) -> float:
        """Cached server load plus what this router has in flight there."""
        cached = self.load.get("num_reqs", 0) if self.load else 0
        return float(cached + self.in_flight)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["role"] = self.mode
        d["load_score"] = self.load_score()
        return d


class WorkerRegistry:
    """All workers known to the router; pools are views filtered by mode and health."""

    def __init__(self, failure_threshold: int = 2) -> None:
        self.failure_threshold = max(1, failure_threshold)
        self._workers: dict[str, Worker] = {}
        self._on_remove: list[Callable[[str], None]] = []

    # ------------------------------------------------------------ membership

    def add(self, url: str, mode: str, bootstrap_port: Optional[int] = DEFAULT_BOOTSTRAP_PORT,
            healthy: bool = False) -> Worker:
        if mode not in MODES:
            raise ValueError(f"invalid role {mode!r}: expected one of {', '.join(MODES)}")
        url = normalize_url(url)
        if url in self._workers:
            raise KeyError(f"worker {url} is already registered")
        w = Worker(url=url, mode=mode, bootstrap_port=bootstrap_port, healthy=healthy)
        self._workers[url] = w
        return w

    def remove(self, url: str) -> Optional[Worker]:
        w = self._workers.pop(url.strip().rstrip("/"), None)
        if w is not None:
            for cb in self._on_remove:
                cb(w.url)
        return w

    def on_remove(self, callback: Callable[[str], None]) -> None:
        self._on_remove.append(callback)

    def get(self, url: str) -> Optional[Worker]:
        return self._workers.get(url.strip().rstrip("/"))

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    # ------------------------------------------------------------ pools

    def pool(self, mode: str, healthy_only: bool = True) -> list[Worker]:
        return [w for w in self._workers.values()
                if w.mode == mode and not w.switching and (w.healthy or not healthy_only)]

    def has_pd_path(self) -> bool:
        return bool(self.pool(PREFILL)) and bool(self.pool(DECODE))

    def has_usable_path(self, enforce_disaggregation: bool = False) -> bool:
        """A healthy prefill+decode pair, or (unless enforced) a worker that takes whole requests."""
        if self.has_pd_path():
            return True
        if enforce_disaggregation:
            return False
        return bool(self.pool(NULL)) or bool(self.pool(DECODE))

    # ------------------------------------------------------------ state updates

    def set_mode(self, url: str, mode: str, epoch: Optional[int] = None,
                 bootstrap_port: Optional[int] = None) -> bool:
        """Move a worker to another pool; ignored (False) when `epoch` is older than the known one."""
        w = self.get(url)
        if w is None or mode not in MODES:
            return False
        if epoch is not None and w.epoch is not None and epoch < w.epoch:
            return False
        w.mode = mode
        if epoch is not None:
            w.epoch = epoch
        if bootstrap_port is not None:
            w.bootstrap_port = bootstrap_port
        return True

    def record_success(self, w: Worker) -> None:
        w.failures = 0
        if not w.healthy:
            logger.info("worker %s (%s) is healthy", w.url, w.mode)
        w.healthy = True
        w.last_error = None

    def record_request_ok(self, w: Worker) -> None:
        """A request succeeded: clears the failure streak, but only a health check revives a worker."""
        if w.healthy:
            w.failures = 0

    def record_failure(self, w: Worker, reason: str) -> bool:
        """Count a failure; True when it made the worker unhealthy."""
        w.failures += 1
        w.last_error = reason
        if w.healthy and w.failures >= self.failure_threshold:
            w.healthy = False
            logger.warning("worker %s (%s) marked unhealthy: %s", w.url, w.mode, reason)
            return True
        return False

    def begin(self, w: Worker) -> None:
        w.in_flight += 1

    def end(self, w: Worker) -> None:
        w.in_flight = max(0, w.in_flight - 1)


class HealthChecker:
    """Checks every worker's `GET /health` (and refreshes its `/get_load`) every interval."""

    def __init__(self, registry: WorkerRegistry, session: aiohttp.ClientSession, interval_s: float,
                 timeout_s: float, headers: Optional[dict] = None) -> None:
        self.registry = registry
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = headers or {}
        self._task: Optional[asyncio.Task] = None
        # called (url, old mode, new mode) when a check finds that a worker switched behind the router (on its own
        # switch route): the planner counts it as a move by hand
        self.on_mode_change: Optional[Callable[[str, str, str], None]] = None
        # called (worker, its /server_info) on every answer (kv_aware follows the worker's KV events from it)
        self.on_server_info: Optional[Callable[[Worker, dict], None]] = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:  # never let one bad round stop the checker
                logger.exception("health check round failed")

    async def check_all(self) -> None:
        workers = self.registry.all()
        await asyncio.gather(*(self.check(w) for w in workers))

    async def check(self, w: Worker) -> bool:
        try:
            async with self.session.get(w.url + "/health", timeout=self.timeout, headers=self.headers) as r:
                await r.read()
                ok, reason = r.status == 200, f"/health returned {r.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, reason = False, f"/health failed: {type(e).__name__}: {e}"
        w.last_check = time.time()
        if self.registry.get(w.url) is not w:  # removed meanwhile
            return ok
        if not ok:
            self.registry.record_failure(w, reason)
            return False
        self.registry.record_success(w)
        await self.refresh_load(w)
        if not w.switching:
            await self.refresh_mode(w)
        return True

    async def refresh_mode(self, w: Worker) -> None:
        """Learn the worker's live role and epoch (tidal workers can switch at runtime)."""
        try:
            async with self.session.get(w.url + "/server_info", timeout=self.timeout, headers=self.headers) as r:
                info = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        if not isinstance(info, dict):
            return
        if self.on_server_info is not None and self.registry.get(w.url) is w:
            self.on_server_info(w, info)
        if info.get("disaggregation_mode") not in MODES:
            return
        epoch = info.get("epoch") if isinstance(info.get("epoch"), int) else None
        if isinstance(info.get("tp_size"), int):
            w.tp_size = info["tp_size"]
        bport = info.get("disaggregation_bootstrap_port")
        old, known = w.mode, w.reports_epoch  # known: its mode was read from it before (not just declared)
        boot = info.get("boot_id") if isinstance(info.get("boot_id"), str) else None
        if boot is not None and w.boot_id is not None and boot != w.boot_id:
            # a restarted server counts its epochs from 0 again: its first older epoch is no stale answer
            logger.warning("worker %s restarted (a new boot id); it is in %s mode, epoch %s, as it says", w.url,
                           info["disaggregation_mode"], epoch)
            w.epoch = None
        w.boot_id = boot or w.boot_id
        if self.registry.set_mode(w.url, info["disaggregation_mode"], epoch,
                                  bport if isinstance(bport, int) else None):
            w.reports_epoch = known or epoch is not None
            if known and w.mode != old and self.on_mode_change is not None and not w.switching:
                self.on_mode_change(w.url, old, w.mode)

    async def refresh_load(self, w: Worker) -> None:
        try:
            async with self.session.get(w.url + "/get_load", timeout=self.timeout, headers=self.headers) as r:
                if r.status == 200:
                    w.load = sum_load(await r.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
