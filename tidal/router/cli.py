"""`tidal router` flags (SGLang router shapes) and the entry point."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

import msgspec

from tidal.config import keys_from_env
from tidal.http_timeout import DEFAULT_READ_TIMEOUT_S, h11_with_read_timeout
from tidal.planner.flags import add_planner_args, planner_config_from_namespace
from tidal.profile.schema import profile_error
from tidal.router.config import RouterConfig
from tidal.router.policies import POLICIES
from tidal.router.workers import (
    DEFAULT_BOOTSTRAP_PORT,
    normalize_url,
    parse_bootstrap_port,
)

logger = logging.getLogger(__name__)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    w = parser.add_argument_group("workers")
    w.add_argument("--prefill", action="append", nargs="+", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help=f"a prefill worker, optionally followed by its bootstrap port or 'none' "
                        f"(default {DEFAULT_BOOTSTRAP_PORT}); repeat for more")
    w.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL",
                   help="a decode worker; repeat for more")
    w.add_argument("--worker", "--worker-urls", dest="worker", action="extend", nargs="+", default=[],
                   metavar="URL", help="a null-role worker that takes whole requests; repeat for more")
    w.add_argument("--pd-disaggregation", action="store_true", help="accepted for SGLang compatibility and ignored: PD routing is always on when prefill and "
                        "decode workers are given (default: off)")
    w.add_argument("--enforce-disaggregation", action="store_true",
                   help="never send whole requests to a single worker: 503 when no prefill/decode pair is healthy")
    p = parser.add_argument_group("policies")
    p.add_argument("--policy", choices=POLICIES, default=d.policy, help="how a worker is picked for a request")
    p.add_argument("--prefill-policy", choices=POLICIES, default=None, help="default: --policy")
    p.add_argument("--decode-policy", choices=POLICIES, default=None, help="default: --policy")
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: minimum matched prefix fraction for affinity")
    p.add_argument("--balance-abs-threshold", type=float, default=d.balance_abs_threshold,
                   help="cache_aware: load difference above which the least-loaded worker wins")
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="cache_aware: load ratio above which the least-loaded worker wins")
    p.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                   help="cache_aware: prefix entries kept per pool (LRU)")
    p.add_argument("--kv-load-weight", type=float, default=d.kv_load_weight,
                   help="kv_aware: each open request on a worker costs this many mean prompts of prefill "
                        f"(default {d.kv_load_weight:g}; 0: cache hits only)")
    p.add_argument("--model-path", default=None,
                   help="kv_aware: the model whose tokenizer the router tokenizes prompts with (default: the "
                        "model_path a worker's /server_info reports)")
    p.add_argument("--tokenizer-path", default=None, help="kv_aware: a tokenizer to use instead of --model-path's")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default=d.host, help="address to listen on; 127.0.0.1 keeps the server local")
    s.add_argument("--port", type=int, default=d.port, help="HTTP port")
    s.add_argument("--health-check-interval-secs", type=float, default=d.health_check_interval_s, help="seconds between worker health checks")
    s.add_argument("--health-check-timeout-secs", type=float, default=d.health_check_timeout_s, help="timeout of one health check")
    s.add_argument("--health-failure-threshold", type=int, default=d.health_failure_threshold,
                   help="consecutive failed checks or connection errors that make a worker unhealthy")
    s.add_argument("--request-timeout-secs", type=float, default=d.request_timeout_s, help="upstream read timeout per request")
    add_resilience_args(parser, d)
    s.add_argument("--api-key", default=None,
                   help="Bearer key clients must send on every route but /health, /health_generate, /metrics "
                        "and the admin ones; also sent to the workers (default: none; then the client's "
                        "Authorization header is passed through; $TIDAL_API_KEY sets it too)")
    s.add_argument("--admin-api-key", default=None,
                   help="the router's own Bearer key for /add_worker, /remove_worker, /flush_cache, /admin/* "
                        "(default: $TIDAL_ADMIN_API_KEY, else none; then those routes are open only when no key "
                        "at all is configured)")
    s.add_argument("--worker-admin-api-key", default=None,
                   help="sent to the workers' admin routes for role moves and /flush_cache "
                        "(default: $TIDAL_WORKER_ADMIN_API_KEY, else --api-key)")
    s.add_argument("--switch-timeout-secs", type=float, default=60.0, help="drain + switch budget per role move")
    s.add_argument("--http-read-timeout-secs", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="close a connection whose whole request has not arrived this many seconds after it "
                        f"opened or after its previous response (slowloris) (default: {DEFAULT_READ_TIMEOUT_S:g})")
    s.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error", "critical"), help="logging level")
    add_planner_args(parser)


def add_resilience_args(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Retries, circuit breakers and admission, with sgl-model-gateway's flag names."""
    r = parser.add_argument_group("retries")
    r.add_argument("--max-retries", "--retry-max-retries", dest="max_retries", type=int, default=d.max_retries,
                   help="retries on another worker (and a new room for PD) after a 408, 429, 5xx or connection error")
    r.add_argument("--disable-retries", action="store_true", help="no retries (--max-retries 0)")
    r.add_argument("--retry-initial-backoff-ms", type=float, default=d.retry_initial_backoff_s * 1000,
                   help="first retry delay")
    r.add_argument("--retry-max-backoff-ms", type=float, default=d.retry_max_backoff_s * 1000,
                   help="cap of the retry delay (and of a worker's Retry-After the router honours)")
    r.add_argument("--retry-backoff-multiplier", type=float, default=d.retry_backoff_multiplier,
                   help="each retry's delay is the previous one's times this")
    r.add_argument("--retry-jitter-factor", type=float, default=d.retry_jitter_factor,
                   help="each delay is spread at random by +- this fraction of itself")
    c = parser.add_argument_group("circuit breaker (per worker)")
    c.add_argument("--disable-circuit-breaker", action="store_true", help="never stop routing to a failing worker")
    c.add_argument("--cb-failure-threshold", type=int, default=d.cb_failure_threshold,
                   help="consecutive failed requests (connection errors, timeouts, 5xx but 503) that open the circuit")
    c.add_argument("--cb-success-threshold", type=int, default=d.cb_success_threshold,
                   help="consecutive successful probes that close it again")
    c.add_argument("--cb-timeout-duration-secs", type=float, default=d.cb_timeout_s,
                   help="how long an open circuit takes no request before one probe goes (half-open)")
    c.add_argument("--cb-window-duration-secs", type=float, default=d.cb_window_s,
                   help="a failure streak older than this starts over")
    a = parser.add_argument_group("admission")
    a.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="requests the router serves at once (a stream counts until it ends); more wait in a "
                        "queue (default: -1, no limit)")
    a.add_argument("--queue-size", type=int, default=d.queue_size,
                   help="requests that may wait for a slot; one more is a 429 with Retry-After")
    a.add_argument("--queue-timeout-secs", type=float, default=d.queue_timeout_s,
                   help="how long a request waits for a slot before a 408 with Retry-After")


def _prefill_entries(values: list[list[str]]) -> list[tuple[str, Optional[int]]]:
    out = []
    for v in values:
        if len(v) > 2:
            raise ValueError(f"--prefill takes a URL and an optional bootstrap port, got {' '.join(v)}")
        port = parse_bootstrap_port(v[1]) if len(v) == 2 else DEFAULT_BOOTSTRAP_PORT
        out.append((normalize_url(v[0]), port))
    return out


def router_config_from_namespace(ns: argparse.Namespace) -> RouterConfig:
    keys_from_env(ns)
    return RouterConfig(
        prefill=_prefill_entries(ns.prefill), decode=[normalize_url(u) for u in ns.decode],
        workers=[normalize_url(u) for u in ns.worker], policy=ns.policy, prefill_policy=ns.prefill_policy,
        decode_policy=ns.decode_policy, host=ns.host, port=ns.port,
        health_check_interval_s=ns.health_check_interval_secs, health_check_timeout_s=ns.health_check_timeout_secs,
        health_failure_threshold=ns.health_failure_threshold, request_timeout_s=ns.request_timeout_secs,
        max_retries=0 if ns.disable_retries else ns.max_retries,
        retry_initial_backoff_s=ns.retry_initial_backoff_ms / 1000, retry_max_backoff_s=ns.retry_max_backoff_ms / 1000,
        retry_backoff_multiplier=ns.retry_backoff_multiplier, retry_jitter_factor=ns.retry_jitter_factor,
        disable_circuit_breaker=ns.disable_circuit_breaker, cb_failure_threshold=ns.cb_failure_threshold,
        cb_success_threshold=ns.cb_success_threshold, cb_timeout_s=ns.cb_timeout_duration_secs,
        cb_window_s=ns.cb_window_duration_secs, max_concurrent_requests=ns.max_concurrent_requests,
        queue_size=ns.queue_size, queue_timeout_s=ns.queue_timeout_secs,
        enforce_disaggregation=ns.enforce_disaggregation,
        cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
        balance_rel_threshold=ns.balance_rel_threshold, max_tree_size=ns.max_tree_size,
        kv_load_weight=ns.kv_load_weight, model_path=ns.model_path, tokenizer_path=ns.tokenizer_path,
        api_key=ns.api_key,
        admin_api_key=ns.admin_api_key,
        worker_admin_api_key=ns.worker_admin_api_key, switch_timeout_s=ns.switch_timeout_secs,
        log_level=ns.log_level, planner=planner_config_from_namespace(ns), planner_profile=ns.planner_profile)


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    from tidal.router.app import create_router_app

    try:
        cfg = router_config_from_namespace(ns)
    except ValueError as e:
        print(f"tidal router: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (cfg.prefill or cfg.decode or cfg.workers):
        logger.warning("no workers given: add them with POST /add_worker")
    try:
        app = create_router_app(cfg)
    except (OSError, ValueError, msgspec.MsgspecError) as e:  # the planner's profile
        print(f"tidal router: error: {profile_error('--planner-profile', cfg.planner_profile, e)}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=5,
                http=h11_with_read_timeout(ns.http_read_timeout_secs))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal router", description="PD-aware router for tidal/SGLang workers")
    add_router_args(parser)
    return run_router(parser.parse_args(argv))
