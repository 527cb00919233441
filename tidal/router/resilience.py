"""What keeps the router standing when workers fail or clients flood it: retry delays with jitter, a
circuit breaker per worker, and an admission gate with a bounded queue (sgl-model-gateway's shapes and flag
names: --retry-*, --cb-*, --max-concurrent-requests, --queue-size, --queue-timeout-secs).

All of it runs on the router's event loop: nothing here locks, and every method is synchronous except
`AdmissionGate.enter`, which is the one wait (bounded by the queue timeout).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import math
import random
import time
from typing import Callable, Optional

# ---------------------------------------------------------------- retries


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: attempt k (1-based) waits initial * multiplier^(k-1), capped, then spread by
    +-jitter of itself, so that clients failed by one worker do not come back in lockstep."""

    initial_s: float = 0.05
    max_s: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delay_s(self, attempt: int, rng: random.Random, retry_after_s: Optional[float] = None) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier ** max(0, attempt - 1))
        spread = base * self.jitter * (2 * rng.random() - 1)
        delay = max(0.0, base + spread)
        if retry_after_s is not None:  # the worker said when it can take more: never sooner, never past the cap
            delay = max(delay, min(retry_after_s, self.max_s))
        return delay


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """A Retry-After header's seconds (the delay form; an HTTP date is ignored)."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


# ---------------------------------------------------------------- circuit breaker

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
SUCCESS, FAILURE, NEUTRAL = "success", "failure", "neutral"


@dataclasses.dataclass(frozen=True)
class BreakerConfig:
    enabled: bool = True
    failure_threshold: int = 5  # consecutive failures that open the circuit
    success_threshold: int = 2  # consecutive successful probes that close it again
    timeout_s: float = 30.0  # open this long before a probe is let through (half-open)
    window_s: float = 60.0  # a failure streak older than this starts over

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("--cb-failure-threshold and --cb-success-threshold must be >= 1")
        if self.timeout_s < 0 or self.window_s <= 0:
            raise ValueError("--cb-timeout-duration-secs must be >= 0 and --cb-window-duration-secs > 0")


@dataclasses.dataclass
class CircuitBreaker:
    """One worker's. Closed: every request goes. Open: none goes until `timeout_s` passed; then half-open:
    one request at a time goes as a probe; `success_threshold` probes in a row close it, one failure opens
    it again. Only failures that say the worker is broken count (`verdict`); a refusal does not."""

    cfg: BreakerConfig
    state: str = CLOSED
    failures: int = 0  # the current streak of failures (closed) or of successful probes (half-open)
    streak_started: float = 0.0
    opened_at: float = 0.0
    probe_in_flight: bool = False
    times_opened: int = 0

    def allows(self, now: float) -> bool:
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return now - self.opened_at >= self.cfg.timeout_s
        return not self.probe_in_flight

    def claim(self, now: float) -> bool:
        """A request was routed here (after `allows`); True when it is a half-open breaker's probe."""
        if self.state == OPEN and now - self.opened_at >= self.cfg.timeout_s:
            self.state, self.failures = HALF_OPEN, 0
        if self.state == HALF_OPEN:
            self.probe_in_flight = True
            return True
        return False

    def record(self, verdict: str, now: float, probe: bool = False) -> Optional[str]:
        """The outcome of a claimed request (`probe`: what `claim` said); the new state when it changed."""
        was = self.state
        if probe:
            self.probe_in_flight = False
        if verdict == NEUTRAL:
            return None
        if self.state == HALF_OPEN:
            if not probe:
                return None  # sent before the circuit opened: the probe decides
            if verdict == FAILURE:
                self._open(now)
            else:
                self.failures += 1
                if self.failures >= self.cfg.success_threshold:
                    self.state, self.failures = CLOSED, 0
        elif self.state == CLOSED:
            if verdict == SUCCESS:
                self.failures = 0
            else:
                if not self.failures or now - self.streak_started > self.cfg.window_s:
                    self.failures, self.streak_started = 0, now
                self.failures += 1
                if self.failures >= self.cfg.failure_threshold:
                    self._open(now)
        return self.state if self.state != was else None

    def _open(self, now: float) -> None:
        self.state, self.failures, self.opened_at = OPEN, 0, now
        self.times_opened += 1

    def to_dict(self, now: float) -> dict:
        out = {"state": self.state, "consecutive": self.failures, "times_opened": self.times_opened}
        if self.state == OPEN:
            out["reopens_in_s"] = round(max(0.0, self.cfg.timeout_s - (now - self.opened_at)), 3)
        return out


class CircuitBreakers:
    """The router's breakers, one per worker URL, made on first use and forgotten with the worker.
    Disabled, every worker is always allowed and nothing is kept."""

    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic,
                 on_change: Optional[Callable[[str, str], None]] = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.on_change = on_change  # (url, new state)
        self._by_url: dict[str, CircuitBreaker] = {}

    def _get(self, url: str) -> CircuitBreaker:
        b = self._by_url.get(url)
        if b is None:
            b = self._by_url[url] = CircuitBreaker(self.cfg)
        return b

    def allows(self, url: str) -> bool:
        return not self.cfg.enabled or self._get(url).allows(self.clock())

    def claim(self, url: str) -> bool:
        """Take the worker for one request; True when that request is its breaker's half-open probe."""
        return self.cfg.enabled and self._get(url).claim(self.clock())

    def record(self, url: str, verdict: str, probe: bool = False) -> None:
        b = self._by_url.get(url) if self.cfg.enabled else None
        if b is None:
            return  # disabled, or the worker was removed while its request ran
        changed = b.record(verdict, self.clock(), probe)
        if changed is not None and self.on_change is not None:
            self.on_change(url, changed)

    def forget(self, url: str) -> None:
        self._by_url.pop(url, None)

    def state(self, url: str) -> dict:
        if not self.cfg.enabled:
            return {"state": "disabled"}
        return self._get(url).to_dict(self.clock())

    def open_count(self, urls: list[str]) -> int:
        return sum(1 for u in urls if not self.allows(u))


# ---------------------------------------------------------------- admission


class AdmissionRefused(Exception):
    """The gate refused a request: `status` 429 (the queue is full) or 408 (it waited its whole timeout)."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class AdmissionGate:
    """At most `max_concurrent` requests inside the router at once; up to `queue_size` more wait, first in
    first out, each at most `queue_timeout_s`. `max_concurrent` <= 0: no limit (the gate never waits).

    A slot is `enter`ed before a request is routed and `leave`s when its answer has been sent (a stream: when
    it ends). A waiter that gives up (timeout, or the client left) hands on a slot it was given meanwhile."""

    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_s: float) -> None:
        self.max_concurrent = max_concurrent
        self.queue_size = max(0, queue_size)
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._hold_s = 1.0  # a running mean of how long a request holds its slot, for Retry-After
        self._entered: dict[int, float] = {}  # ticket -> when it entered
        self._tickets = itertools.count(1)
        self.refused = {429: 0, 408: 0}

    @property
    def limited(self) -> bool:
        return self.max_concurrent > 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        """When a slot is likely free: the queue ahead, at the mean hold time per slot; at least 1 s."""
        if not self.limited:
            return 1
        ahead = len(self._waiters) + 1
        return max(1, math.ceil(self._hold_s * ahead / self.max_concurrent))

    async def enter(self) -> int:
        """A ticket to pass to `leave`; raises AdmissionRefused."""
        if not self.limited:
            return 0
        if self.active < self.max_concurrent and not self._waiters:
            return self._admit()
        if len(self._waiters) >= self.queue_size:
            self.refused[429] += 1
            raise AdmissionRefused(429, f"the router is at --max-concurrent-requests {self.max_concurrent} with "
                                        f"{len(self._waiters)} waiting (--queue-size {self.queue_size})",
                                   self.retry_after_s())
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:  # not wait_for: cancelled once its slot came, it would swallow the cancellation and keep the slot
            await asyncio.wait({fut}, timeout=self.queue_timeout_s)
        except BaseException:  # the client left while it waited
            self._give_up(fut)
            raise
        if not fut.done():
            self._give_up(fut)
            self.refused[408] += 1
            raise AdmissionRefused(408, f"waited --queue-timeout-secs {self.queue_timeout_s:g} for one of the "
                                        f"router's {self.max_concurrent} request slots", self.retry_after_s())
        return fut.result()

    def _admit(self) -> int:
        self.active += 1
        ticket = next(self._tickets)
        self._entered[ticket] = time.monotonic()
        return ticket

    def _give_up(self, fut: asyncio.Future) -> None:
        if fut.done():
            self.leave(fut.result())  # a slot came just as it gave up: the next waiter takes it
            return
        fut.cancel()
        if fut in self._waiters:
            self._waiters.remove(fut)

    def leave(self, ticket: int) -> None:
        if not self.limited:
            return
        started = self._entered.pop(ticket, None)
        if started is None:
            return  # left already
        self._hold_s = 0.9 * self._hold_s + 0.1 * (time.monotonic() - started)
        self.active -= 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._admit())
                return
