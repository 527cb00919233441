"""The router's FastAPI app: generation routes, pass-through info routes, admin routes.

Authentication (tidal/server/auth.py's middleware, `Authorization: Bearer KEY`):
- /health, /health_generate, /metrics: open.
- Admin routes (/add_worker, /remove_worker, /flush_cache, /admin/*, /pd_role_switch):
  with `--admin-api-key`, that key and only that key. Without it they are open only
  when the router has no key at all; if `--api-key` or `--worker-admin-api-key` is set
  they answer 401 (set --admin-api-key to use them), so that nobody can act with the
  workers' keys on the router's behalf.
- Every other route (generation, info, /workers, /get_load): with `--api-key`, that key
  (the admin key works too); without it, open, and a generation request's own
  Authorization header goes to the workers.
Worker info passed through (/server_info, /v1/models, /model_info) has its secrets
masked and, for callers that presented no configured key, model paths replaced by the
model's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Optional

import aiohttp
import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

import tidal
from tidal.config import bearer_headers, hide_model_paths, mask_secrets
from tidal.planner.loop import PlannerLoop, load_cost_model
from tidal.router.config import RouterConfig
from tidal.router.dispatch import Dispatcher
from tidal.router.kv_aware import KVEventsFollower, RouterTokenizer
from tidal.router.legs import RelayResponse, json_error
from tidal.router.metrics import CONTENT_TYPE, RouterMetrics
from tidal.router.policies import Policy, make_policy
from tidal.router.orchestrate import RoleMover, add_orchestration_routes
from tidal.router.resilience import AdmissionGate, AdmissionRefused
from tidal.server.auth import AuthMiddleware, Guard, is_authenticated
from tidal.server.protocol import internal_error_message
from tidal.router.workers import (
    DECODE,
    DEFAULT_BOOTSTRAP_PORT,
    MODES,
    NULL,
    PREFILL,
    LOAD_KEYS,
    HealthChecker,
    Worker,
    WorkerRegistry,
    parse_bootstrap_port,
)

logger = logging.getLogger(__name__)

GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
TOKENIZER_ROUTES = ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize")
EMBEDDING_ROUTES = ("/v1/embeddings", "/encode")
ADMIN_PATHS = frozenset({"/add_worker", "/remove_worker", "/flush_cache", "/pd_role_switch",
                         "/load_lora_adapter", "/unload_lora_adapter"})
TOKENIZER_LOAD_TIMEOUT_S = 120.0  # kv_aware: how long the router's start waits for its tokenizer
HEALTH_GENERATE_TIMEOUT_S = 30.0  # a worker's own /health_generate waits up to 20 s


def _json(obj: Any, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status_code, media_type="application/json")


@dataclasses.dataclass
class RouterState:
    cfg: RouterConfig
    registry: WorkerRegistry
    policies: dict[str, Policy]
    metrics: RouterMetrics
    session: Optional[aiohttp.ClientSession] = None
    checker: Optional[HealthChecker] = None
    dispatcher: Optional[Dispatcher] = None
    mover: Optional[RoleMover] = None
    planner: Optional[PlannerLoop] = None
    gate: Optional[AdmissionGate] = None
    kv: Optional[KVEventsFollower] = None  # kv_aware: the workers' KV events
    tokenizer: Optional[RouterTokenizer] = None  # kv_aware: prompts to token ids
    started_at: float = dataclasses.field(default_factory=time.time)

    def worker_headers(self) -> dict:
        """For workers' API routes (info, load, health)."""
        return bearer_headers(self.cfg.api_key)

    def worker_admin_headers(self) -> dict:
        """For workers' admin routes: the worker admin key, else the API key (a worker's admin
        routes take its API key when it has no admin key)."""
        return bearer_headers(self.cfg.worker_admin_api_key or self.cfg.api_key)


def router_guard(cfg: RouterConfig) -> Guard:
    """The rule of the module docstring."""
    refusal = None
    if not cfg.admin_api_key and (cfg.api_key or cfg.worker_admin_api_key):
        refusal = ("this route changes the router's state and needs the router's own admin key: "
                   "start the router with --admin-api-key")
    return Guard(api_keys=tuple(k for k in (cfg.api_key, cfg.admin_api_key) if k) if cfg.api_key else (),
                 admin_keys=(cfg.admin_api_key,) if cfg.admin_api_key else (),
                 admin_paths=ADMIN_PATHS, admin_refusal=refusal)


def build_state(cfg: RouterConfig) -> RouterState:
    registry = WorkerRegistry(cfg.health_failure_threshold)
    for url, port in cfg.prefill:
        registry.add(url, PREFILL, port)
    for url in cfg.decode:
        registry.add(url, DECODE)
    for url in cfg.workers:
        registry.add(url, NULL)
    kv = KVEventsFollower() if cfg.uses_kv_events() else None
    knobs = dict(cache_threshold=cfg.cache_threshold, balance_abs_threshold=cfg.balance_abs_threshold,
                 balance_rel_threshold=cfg.balance_rel_threshold, max_tree_size=cfg.max_tree_size,
                 kv_follower=kv, kv_load_weight=cfg.kv_load_weight)
    policies = {PREFILL: make_policy(cfg.prefill_policy or cfg.policy, **knobs),
                DECODE: make_policy(cfg.decode_policy or cfg.policy, **knobs),
                NULL: make_policy(cfg.policy, **knobs)}
    registry.on_remove(lambda url: [p.forget(url) for p in policies.values()])
    st = RouterState(cfg, registry, policies, RouterMetrics(),
                     gate=AdmissionGate(cfg.max_concurrent_requests, cfg.queue_size, cfg.queue_timeout_s))
    if kv is not None:
        registry.on_remove(kv.forget)
        st.kv, st.tokenizer = kv, RouterTokenizer(cfg.tokenizer_path or cfg.model_path)
    st.mover = RoleMover(st)
    st.planner = PlannerLoop(cfg.planner, st, load_cost_model(cfg.planner_profile), cfg.planner_profile)
    return st


def _st(request: Request) -> RouterState:
    return request.app.state.router


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    st: RouterState = app.state.router
    cfg = st.cfg
    # keepalive below uvicorn's 5 s, so that the router never reuses a connection the worker is closing
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    st.session = aiohttp.ClientSession(
        connector=connector, trust_env=False, auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s))
    st.checker = HealthChecker(st.registry, st.session, cfg.health_check_interval_s, cfg.health_check_timeout_s,
                               st.worker_headers())
    st.dispatcher = Dispatcher(cfg, st.registry, st.policies, st.session, st.metrics, st.planner.window)
    if st.kv is not None:
        _follow_kv_events(st)
        await st.tokenizer.ready(TOKENIZER_LOAD_TIMEOUT_S)  # routes by tokens from the first request on
    await st.checker.check_all()
    st.checker.on_mode_change = st.planner.switched_behind  # from now on: the first check learned the modes
    st.registry.on_remove(st.planner.forget_worker)
    st.checker.start()
    st.planner.start()
    try:
        yield
    finally:
        await st.planner.stop()
        await st.checker.stop()
        await st.dispatcher.aclose()
        if st.kv is not None:
            await st.tokenizer.aclose()
            st.kv.close()
        await st.session.close()


def _follow_kv_events(st: RouterState) -> None:
    """kv_aware: subscribe to what each worker's /server_info says it publishes; tokenize prompts."""
    kv, tok = st.kv, st.tokenizer

    def on_info(w: Worker, info: dict) -> None:
        kv.learn(w, info)
        tok.offer(info.get("model_path"))

    st.checker.on_server_info = on_info
    st.dispatcher.tokenize = tok.tokens
    tok.start()


def create_router_app(cfg: RouterConfig, state: Optional[RouterState] = None) -> FastAPI:
    app = FastAPI(title="tidal router", version=tidal.__version__, lifespan=_lifespan)
    app.state.router = state or build_state(cfg)
    app.add_middleware(AuthMiddleware, guard=router_guard(app.state.router.cfg))
    add_orchestration_routes(app)

    @app.exception_handler(Exception)
    async def _internal(_req: Request, e: Exception) -> Response:
        return json_error(internal_error_message(e), 500)

    for route in GENERATE_ROUTES:
        app.add_api_route(route, _make_generate(route), methods=["POST"])
    _add_info_routes(app)
    _add_admin_routes(app)
    return app


# ---------------------------------------------------------------- generation


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def parse_object(raw: bytes) -> dict:
    """The request body as a JSON object; ValueError with a client-facing message otherwise."""
    if not raw.strip():
        raise ValueError("request body is empty; expected a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


async def admitted(st: RouterState, route: str, work: Any) -> Response:
    """Run `work` (a coroutine giving the answer) inside an admission slot, held until the answer is sent (a
    relayed stream: until it ends); a refusal is the gate's 429 or 408 with Retry-After."""
    try:
        ticket = await st.gate.enter()
    except AdmissionRefused as e:
        work.close()
        st.metrics.admission_refused.labels(str(e.status)).inc()
        st.metrics.requests.labels(route, str(e.status)).inc()
        resp = json_error(str(e), e.status)
        resp.headers["Retry-After"] = str(e.retry_after_s)
        return resp
    except BaseException:
        work.close()
        raise
    try:
        resp = await work
    except BaseException:
        st.gate.leave(ticket)
        raise
    if isinstance(resp, RelayResponse):
        resp.finalizers.append(lambda: st.gate.leave(ticket))
    else:
        st.gate.leave(ticket)
    return resp


def _make_generate(route: str) -> Any:
    async def generate(request: Request) -> Response:
        st = _st(request)
        try:
            body = parse_object(await request.body())
        except ValueError as e:
            st.metrics.requests.labels(route, "400").inc()
            return json_error(str(e), 400)
        work = asyncio.ensure_future(admitted(st, route, st.dispatcher.dispatch(
            route, body, request.headers.get("authorization"))))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        done: set = set()
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, gone):
                if not t.done():
                    t.cancel()
            await asyncio.gather(gone, return_exceptions=True)
        if work not in done:  # the client left: cancelling `work` cancels the upstream calls
            await asyncio.gather(work, return_exceptions=True)
            if work.done() and not work.cancelled() and isinstance(work.result(), RelayResponse):
                work.result().discard()  # it answered as the client left: never sent, so released here
            st.metrics.requests.labels(route, "499").inc()
            return Response(status_code=499)
        return work.result()

    generate.__name__ = "route_" + route.strip("/").replace("/", "_")
    return generate


# ---------------------------------------------------------------- info


async def _get_json(st: RouterState, w: Worker, path: str,
                    timeout: Optional[aiohttp.ClientTimeout] = None) -> tuple[int, Any]:
    try:
        async with st.session.get(w.url + path, timeout=timeout or st.checker.timeout,
                                  headers=st.worker_headers()) as r:
            raw = await r.read()
            return r.status, (msgspec.json.decode(raw) if raw else None)
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as e:
        return 0, {"error": f"{type(e).__name__}: {e}"}


def _first_healthy(st: RouterState) -> Optional[Worker]:
    for mode in (DECODE, NULL, PREFILL):
        pool = st.registry.pool(mode)
        if pool:
            return pool[0]
    return None


def _reveal(body: Any, request: Request) -> Any:
    """A worker's answer for this caller: secrets masked; paths only for authenticated callers."""
    body = mask_secrets(body)
    return body if is_authenticated(request) else hide_model_paths(body)


async def _forward_get(st: RouterState, path: str, request: Request) -> Response:
    w = _first_healthy(st)
    if w is None:
        return json_error("no healthy worker available", 503)
    status, body = await _get_json(st, w, path)
    return _json(_reveal(body, request), status) if status else json_error(f"worker {w.url}: {body['error']}", 502)


def _router_info(st: RouterState) -> dict:
    cfg = st.cfg
    return {"version": tidal.__version__, "role": "router", "started_at": st.started_at,
            "policy": cfg.policy, "prefill_policy": cfg.prefill_policy or cfg.policy,
            "decode_policy": cfg.decode_policy or cfg.policy, "enforce_disaggregation": cfg.enforce_disaggregation,
            "max_retries": cfg.max_retries, "request_timeout_secs": cfg.request_timeout_s,
            "health_check_interval_secs": cfg.health_check_interval_s}


def _add_info_routes(app: FastAPI) -> None:
    async def server_info(request: Request) -> Response:
        st = _st(request)
        workers = st.registry.all()
        infos = await asyncio.gather(*(_get_json(st, w, "/server_info") for w in workers))
        out = _router_info(st)
        out["workers"] = [{**w.to_dict(), "server_info": _reveal(body, request) if status == 200 else None}
                          for w, (status, body) in zip(workers, infos)]
        return _json(out)

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/v1/models", "/model_info", "/get_model_info"):
        app.add_api_route(path, _forwarder(path), methods=["GET"])

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await _forward_get(_st(request), request.url.path, request)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": tidal.__version__})

    for path in TOKENIZER_ROUTES:  # the tokenizer is the same on every worker: any healthy one answers
        app.add_api_route(path, _post_forwarder(path), methods=["POST"])
    for path in EMBEDDING_ROUTES:  # a whole request on one worker (embeddings need no KV transfer)
        app.add_api_route(path, _embedding_forwarder(path), methods=["POST"])

    @app.get("/health")
    async def health(request: Request) -> Response:
        st = _st(request)
        if st.registry.has_usable_path(st.cfg.enforce_disaggregation):
            return Response(status_code=200)
        return json_error("no usable prefill/decode pair or whole-request worker", 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        st = _st(request)
        healthy = [w for w in st.registry.all() if w.healthy]
        timeout = aiohttp.ClientTimeout(total=HEALTH_GENERATE_TIMEOUT_S)
        results = await asyncio.gather(*(_get_json(st, w, "/health_generate", timeout) for w in healthy))
        passed = {w.mode for w, (status, _) in zip(healthy, results) if status == 200}
        ok = {PREFILL, DECODE} <= passed or (not st.cfg.enforce_disaggregation and
                                            (NULL in passed or (DECODE in passed and not st.registry.pool(PREFILL))))
        return Response(status_code=200) if ok else json_error("no usable path passed /health_generate", 503)


def _forwarder(path: str) -> Any:
    async def forward(request: Request) -> Response:
        return await _forward_get(_st(request), path, request)

    forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
    return forward


def _embedding_worker(st: RouterState, skip: set) -> Optional[Worker]:
    """The least loaded healthy worker, prefill workers first (an embedding is a prefill's work)."""
    for mode in (PREFILL, NULL, DECODE):
        pool = [w for w in st.registry.pool(mode) if w.url not in skip]
        if pool:
            return min(pool, key=lambda w: w.load_score)
    return None


def _embedding_forwarder(path: str) -> Any:
    """Forward a whole embedding request; a worker that answers 503 (draining for a role switch,
    starting) is skipped and the next one tried, up to --max-retries more times."""
    async def forward(request: Request) -> Response:
        st = _st(request)
        return await admitted(st, path, embed(st, await request.body()))

    async def embed(st: RouterState, body: bytes) -> Response:
        tried: set = set()
        headers = {**st.worker_headers(), "Content-Type": "application/json"}
        status, payload, last_error = 503, None, ""
        for _ in range(1 + st.cfg.max_retries):
            w = _embedding_worker(st, tried)
            if w is None:
                break
            tried.add(w.url)
            st.registry.begin(w)
            try:
                async with st.session.post(w.url + path, data=body, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=st.cfg.request_timeout_s)) as r:
                    status, payload = r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                status, payload = 502, None
                last_error = f"worker {w.url}: {type(e).__name__}: {e}"
                continue
            finally:
                st.registry.end(w)
            if status != 503:
                break
        if payload is None:
            return json_error(last_error if status == 502 else "no healthy worker available", status)
        return Response(payload, status_code=status, media_type="application/json")

    forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
    return forward


def _post_forwarder(path: str) -> Any:
    async def forward(request: Request) -> Response:
        st = _st(request)
        w = _first_healthy(st)
        if w is None:
            return json_error("no healthy worker available", 503)
        headers = {**st.worker_headers(), "Content-Type": "application/json"}
        try:
            async with st.session.post(w.url + path, data=await request.body(), headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=st.cfg.request_timeout_s)) as r:
                return Response(await r.read(), status_code=r.status, media_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as e:
            return json_error(f"worker {w.url}: {type(e).__name__}: {e}", 502)

    forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
    return forward


# ---------------------------------------------------------------- admin


async def _post_all(st: RouterState, path: str, body: Optional[bytes] = None) -> list[dict]:
    """POST to every worker; per worker: status, success and (for an error) its message."""
    async def one(w: Worker) -> dict:
        headers = {**st.worker_admin_headers(), **({"Content-Type": "application/json"} if body else {})}
        try:
            async with st.session.post(w.url + path, data=body, timeout=st.checker.timeout, headers=headers) as r:
                raw = await r.read()
                out = {"url": w.url, "role": w.mode, "status": r.status, "success": r.status == 200}
                if r.status != 200:
                    out["error"] = raw.decode(errors="replace")[:500]
                return out
        except (aiohttp.ClientError, TimeoutError) as e:
            return {"url": w.url, "role": w.mode, "status": None, "success": False, "error": str(e)}

    return list(await asyncio.gather(*(one(w) for w in st.registry.all())))


def _add_admin_routes(app: FastAPI) -> None:
    @app.get("/workers")
    async def workers(request: Request) -> Response:
        """Every worker: health, role, load, in flight, and its circuit breaker's state; the admission gate."""
        st = _st(request)
        breakers = st.dispatcher.breakers
        gate = st.gate
        kv = st.kv
        return _json({"workers": [{**w.to_dict(), "circuit_breaker": breakers.state(w.url),
                                   **({"kv_events": kv.state(w.url)} if kv is not None else {})}
                                  for w in st.registry.all()],
                      "policies": {role: p.stats() for role, p in st.policies.items() if p.stats() is not None},
                      **({"tokenizer": {"path": st.tokenizer.path, "loaded": st.tokenizer.prompts is not None,
                                        "error": st.tokenizer.error}} if st.tokenizer is not None else {}),
                      "admission": {"max_concurrent_requests": gate.max_concurrent, "active": gate.active,
                                    "queued": gate.queued, "queue_size": gate.queue_size,
                                    "refused": {str(k): v for k, v in gate.refused.items()}}})

    @app.post("/add_worker")
    async def add_worker(request: Request, url: str = "", role: str = NULL,
                         bootstrap_port: str = "") -> Response:
        st = _st(request)
        if not url:
            return json_error("the url query parameter is required", 400)
        if role not in MODES:
            return json_error(f"invalid role {role!r}: expected one of {', '.join(MODES)}", 400)
        try:
            port = parse_bootstrap_port(bootstrap_port) if bootstrap_port else DEFAULT_BOOTSTRAP_PORT
            w = st.registry.add(url, role, port)
        except KeyError as e:
            return json_error(str(e.args[0]), 409)
        except ValueError as e:
            return json_error(str(e), 400)
        await st.checker.check(w)
        logger.info("added %s worker %s (healthy=%s)", role, w.url, w.healthy)
        return _json({"success": True, "worker": w.to_dict()})

    @app.post("/remove_worker")
    async def remove_worker(request: Request, url: str = "") -> Response:
        w = _st(request).registry.remove(url) if url else None
        if w is None:
            return json_error(f"no worker {url!r}", 404)
        logger.info("removed %s worker %s", w.mode, w.url)
        return _json({"success": True, "worker": w.to_dict()})

    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        st = _st(request)
        healthy = [w for w in st.registry.all() if w.healthy]
        await asyncio.gather(*(st.checker.refresh_load(w) for w in healthy))
        total = {"dp_rank": 0, **dict.fromkeys(LOAD_KEYS, 0)}
        for w in healthy:
            for k, v in (w.load or {}).items():
                total[k] += v
        total["workers"] = [{"url": w.url, "role": w.mode, "in_flight": w.in_flight, "load": w.load}
                            for w in healthy]
        return _json([total])

    async def flush_cache(request: Request) -> Response:
        results = await _post_all(_st(request), "/flush_cache")
        ok = all(r["success"] for r in results)
        return _json({"success": ok, "workers": results}, 200 if ok else 500)

    for method in ("GET", "POST"):  # one route per method: distinct OpenAPI operation ids
        app.add_api_route("/flush_cache", flush_cache, methods=[method], name=f"flush_cache_{method.lower()}")

    async def lora_on_every_worker(request: Request) -> Response:
        """SGLang's /load_lora_adapter and /unload_lora_adapter on every worker (prefill and decode
        servers must hold the same adapters): 200 when all succeeded, else the first failure's status."""
        results = await _post_all(_st(request), request.url.path, await request.body())
        failed = [r for r in results if not r["success"]]
        status = 200 if not failed else (failed[0]["status"] or 502)
        return _json({"success": not failed, "workers": results}, status)

    for path in ("/load_lora_adapter", "/unload_lora_adapter"):
        app.add_api_route(path, lora_on_every_worker, methods=["POST"], name=path.strip("/"))

    @app.get("/planner/status")
    async def planner_status(request: Request) -> Response:
        return _json(_st(request).planner.status())

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        st = _st(request)
        st.metrics.admission_active.set(st.gate.active)
        st.metrics.admission_queued.set(st.gate.queued)
        return Response(st.metrics.render(st.registry), media_type=CONTENT_TYPE)
