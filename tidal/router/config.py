"""The router's settings (filled from `tidal router` flags by tidal/router/cli.py)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from tidal.config import masked_repr
from tidal.planner.schema import PlannerConfig
from tidal.router.resilience import BreakerConfig, RetryPolicy


@dataclasses.dataclass
class RouterConfig:
    prefill: list[tuple[str, Optional[int]]] = dataclasses.field(default_factory=list)  # (url, bootstrap port)
    decode: list[str] = dataclasses.field(default_factory=list)
    workers: list[str] = dataclasses.field(default_factory=list)  # null role: whole requests
    policy: str = "cache_aware"
    prefill_policy: Optional[str] = None
    decode_policy: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 5.0
    health_failure_threshold: int = 2
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_retries: int = 3
    retry_initial_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0
    retry_backoff_multiplier: float = 2.0
    retry_jitter_factor: float = 0.2  # each delay spread by +-20% of itself
    # circuit breaker per worker (sgl-model-gateway's --cb-* flags and defaults)
    disable_circuit_breaker: bool = False
    cb_failure_threshold: int = 5
    cb_success_threshold: int = 2
    cb_timeout_s: float = 30.0
    cb_window_s: float = 60.0
    # admission: at most this many requests inside the router (<= 0: no limit), a queue of queue_size more
    max_concurrent_requests: int = -1
    queue_size: int = 100
    queue_timeout_s: float = 60.0
    enforce_disaggregation: bool = False
    cache_threshold: float = 0.5
    balance_abs_threshold: float = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 17
    kv_load_weight: float = 0.25  # kv_aware: the weight of a worker's queue against the tokens it would prefill
    tokenizer_path: Optional[str] = None  # kv_aware: the tokenizer (a directory or GGUF); default: model_path
    model_path: Optional[str] = None  # kv_aware: the model whose tokenizer it is; default: the workers' own
    prefill_wait_s: float = 30.0  # how long a finished decode waits for prefill's answer
    api_key: Optional[str] = None  # required from clients on API routes; sent to workers as a Bearer token
    admin_api_key: Optional[str] = None  # the router's own: required on its state-changing routes
    worker_admin_api_key: Optional[str] = None  # sent to workers' admin routes (role moves, flush_cache)
    switch_timeout_s: float = 60.0  # drain + switch budget for one role move
    log_level: str = "info"
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    planner_profile: Optional[str] = None  # a `tidal profile` JSON for the planner's cost model

    def __repr__(self) -> str:  # never shows a key
        return masked_repr(self)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("--max-retries must be >= 0")
        if self.health_check_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("intervals and timeouts must be positive")
        if self.retry_backoff_multiplier < 1 or not 0 <= self.retry_jitter_factor <= 1:
            raise ValueError("--retry-backoff-multiplier must be >= 1 and --retry-jitter-factor in [0, 1]")
        if self.retry_initial_backoff_s < 0 or self.retry_max_backoff_s < 0:
            raise ValueError("retry backoffs must be >= 0")
        if self.queue_size < 0 or self.queue_timeout_s <= 0:
            raise ValueError("--queue-size must be >= 0 and --queue-timeout-secs > 0")
        self.breaker_config()  # raises on a bad --cb-* value
        if self.kv_load_weight < 0:
            raise ValueError("--kv-load-weight must be >= 0")

    def uses_kv_events(self) -> bool:
        return "kv_aware" in (self.policy, self.prefill_policy, self.decode_policy)

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.retry_initial_backoff_s, self.retry_max_backoff_s, self.retry_backoff_multiplier,
                           self.retry_jitter_factor)

    def breaker_config(self) -> BreakerConfig:
        return BreakerConfig(not self.disable_circuit_breaker, self.cb_failure_threshold, self.cb_success_threshold,
                             self.cb_timeout_s, self.cb_window_s)
