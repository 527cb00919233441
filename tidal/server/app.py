"""The FastAPI app: SGLang native routes, OpenAI routes, admin routes, errors, auth (server/auth.py).

TCP_NODELAY: not set here because asyncio already sets it on every accepted TCP
socket: asyncio/selector_events.py, `_SelectorSocketTransport.__init__` calls
`base_events._set_nodelay(sock)` for AF_INET/AF_INET6 stream sockets with proto
IPPROTO_TCP (uvloop's TCPTransport does the same). Checked with uvicorn 0.54 + h11 on
Python 3.11: inside a request the accepted socket had proto=6 and TCP_NODELAY=1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import tidal
from tidal.config import ServerArgs, hide_model_paths
from tidal.sampling_params import seed_for_copy
from tidal.server import openai_api
from tidal.server.admin import add_admin_api
from tidal.server.embeddings import add_embedding_routes, refuse_generation
from tidal.server.auth import AuthMiddleware, Guard, is_authenticated
from tidal.server.lora_api import adapter_cards, add_lora_routes, lora_for_model
from tidal.server.limits import BodySizeLimitMiddleware, check_n, check_prompt_count
from tidal.server.metrics import CONTENT_TYPE, Metrics
from tidal.server.protocol import (
    internal_error_message,
    SSE_DONE,
    AbortRequest,
    ApiError,
    DetokenizeRequest,
    GenerateRequest,
    JSONResp,
    apply_expected_mode,
    error_body,
    error_response,
    event_stream,
    parse_body,
    run_until_done,
    sampling_from_dict,
    sse,
    TokenizeRequest,
)
from tidal.server.tokenizer_manager import ReqState, TokenizerManager

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
STATS_TIMEOUT_S = 2.0


@dataclasses.dataclass
class ServerContext:
    args: ServerArgs
    tm: TokenizerManager
    metrics: Metrics
    started_at: float = dataclasses.field(default_factory=time.time)
    # this process's own: a router that sees it change knows the server restarted, its epochs counting from 0 again
    boot_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> Response:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> Response:
        return error_response(ApiError(f"invalid request: {e.errors()}"))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_req: Request, e: json.JSONDecodeError) -> Response:
        return error_response(ApiError(f"malformed JSON: {e}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, e: StarletteHTTPException) -> Response:
        return JSONResp(error_body(str(e.detail), e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_req: Request, e: Exception) -> Response:
        return JSONResp(error_body(internal_error_message(e), 500), status_code=500)


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="tidal", version=tidal.__version__)
    app.state.ctx = ctx
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=ctx.args.max_request_body_bytes)
    # added last, so it runs first: an unauthenticated body is never read
    app.add_middleware(AuthMiddleware, guard=Guard.for_server(ctx.args.api_key, ctx.args.admin_api_key))
    _add_native_routes(app)
    add_embedding_routes(app)
    _add_info_routes(app)
    _add_admin_routes(app)
    add_lora_routes(app)
    add_admin_api(app)
    return app


# ---------------------------------------------------------------- /generate


def _pick(value: Any, i: int, name: str, count: int) -> Any:
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise ApiError(f"{name} has {len(value)} entries for {count} prompts")
    return value[i]


async def _generate_prompts(tm: TokenizerManager, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise ApiError("Either text or input_ids should be provided (exactly one of them).")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        check_prompt_count(len(texts), tm.args.max_batch_size_per_request)
        ids, batched = await tm.tokenize_all(texts), isinstance(body.text, list)
    else:
        batched = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        ids = [list(x) for x in body.input_ids] if batched else [list(body.input_ids)]
        check_prompt_count(len(ids), tm.args.max_batch_size_per_request)
    if not ids:
        raise ApiError("The batch is empty.")
    return ids, batched


async def _generate_reqs(tm: TokenizerManager, body: GenerateRequest) -> tuple[list, bool, Optional[str]]:
    prompts, batched = await _generate_prompts(tm, body)
    count = len(prompts)
    group = body.rid if isinstance(body.rid, str) else None
    reqs = []
    for i, ids in enumerate(prompts):
        sp = _pick(body.sampling_params, i, "sampling_params", count)
        if sp is not None and not isinstance(sp, dict):
            raise ApiError("sampling_params must be an object")
        params, max_set, n = sampling_from_dict(sp)
        check_n(n, tm.args.max_n)
        batched = batched or n > 1
        if isinstance(body.rid, list):
            rid = _pick(body.rid, i, "rid", count)
        else:
            rid = f"{group}-{i}" if group and count > 1 else group
        rid = rid or uuid.uuid4().hex
        for j in range(n):
            p = msgspec.structs.replace(params, seed=seed_for_copy(params.seed, j))
            reqs.append(tm.make_req(
                ids, p, max_set=max_set, rid=rid if n == 1 else f"{rid}-{j}", stream=body.stream,
                return_logprob=bool(_pick(body.return_logprob, i, "return_logprob", count)),
                logprob_start_len=_pick(body.logprob_start_len, i, "logprob_start_len", count),
                top_logprobs_num=_pick(body.top_logprobs_num, i, "top_logprobs_num", count),
                bootstrap=(_pick(body.bootstrap_host, i, "bootstrap_host", count),
                           _pick(body.bootstrap_port, i, "bootstrap_port", count),
                           _pick(body.bootstrap_room, i, "bootstrap_room", count)),
                priority=_pick(body.priority, i, "priority", count),
                lora_name=_pick(body.lora_path, i, "lora_path", count)))
    return reqs, batched, group


def generate_output(s: ReqState) -> dict:
    return {"text": s.text, "output_ids": list(s.output_ids), "meta_info": s.meta_info()}


async def _stream_generate(tm: TokenizerManager, states: list[ReqState], batched: bool) -> AsyncIterator[bytes]:
    try:
        async for changed in tm.updates(states):
            for s in changed:
                out = generate_output(s)
                if batched:
                    out["index"] = states.index(s)
                yield sse(out)
        yield SSE_DONE
    except ApiError as e:
        yield sse(e.body())
        yield SSE_DONE
    finally:
        tm.abort_states(states)


def _add_native_routes(app: FastAPI) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        tm = _ctx(request).tm
        refuse_generation(tm.args)
        body = parse_body(GenerateRequest, await request.body())
        reqs, batched, group = await _generate_reqs(tm, body)
        apply_expected_mode(request, reqs)
        states = tm.submit(reqs, group=group, text_in_logprobs=body.return_text_in_logprobs)
        if body.stream:
            return event_stream(_stream_generate(tm, states, batched))
        if not await run_until_done(request, tm, states):
            return Response(status_code=499)
        outs = [generate_output(s) for s in states]
        return JSONResp(outs if batched else outs[0])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        ctx = _ctx(request)
        refuse_generation(ctx.args)
        return await openai_api.create_completion(request, ctx.tm, ctx.args.model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        ctx = _ctx(request)
        refuse_generation(ctx.args)
        return await openai_api.create_chat_completion(request, ctx.tm, ctx.args.model_name)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        ctx = _ctx(request)
        base = _model_card(ctx)
        return JSONResp(_reveal({"object": "list", "data": [base, *adapter_cards(ctx.tm, base)]}, request))

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        ctx = _ctx(request)
        base = _model_card(ctx)
        if model_id != ctx.args.model_name:
            lora_for_model(ctx.tm, model_id, ctx.args.model_name)  # 404 unless an adapter
            return JSONResp(_reveal(next(c for c in adapter_cards(ctx.tm, base) if c["id"] == model_id), request))
        return JSONResp(_reveal(base, request))

    for path in ("/tokenize", "/v1/tokenize"):
        app.add_api_route(path, tokenize, methods=["POST"])
    for path in ("/detokenize", "/v1/detokenize"):
        app.add_api_route(path, detokenize, methods=["POST"])


def _model_card(ctx: ServerContext) -> dict:
    ready = ctx.tm.ready
    return {"id": ctx.args.model_name, "object": "model", "created": int(ctx.started_at), "owned_by": "tidal",
            "root": ctx.args.model_path, "max_model_len": ready.context_length if ready else None}


async def tokenize(request: Request) -> Response:
    ctx = _ctx(request)
    body = parse_body(TokenizeRequest, await request.body())
    lora_for_model(ctx.tm, body.model, ctx.args.model_name)
    texts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    check_prompt_count(len(texts), ctx.args.max_batch_size_per_request)
    ids = await ctx.tm.tokenize_all(texts, add_special_tokens=body.add_special_tokens)
    batched = isinstance(body.prompt, list)
    return JSONResp({"tokens": ids if batched else ids[0], "count": [len(x) for x in ids] if batched else len(ids[0]),
                     "max_model_len": ctx.tm.ready.context_length})


async def detokenize(request: Request) -> Response:
    ctx = _ctx(request)
    body = parse_body(DetokenizeRequest, await request.body())
    lora_for_model(ctx.tm, body.model, ctx.args.model_name)
    batched = bool(body.tokens) and isinstance(body.tokens[0], list)
    seqs = body.tokens if batched else [body.tokens]
    check_prompt_count(len(seqs), ctx.args.max_batch_size_per_request)
    if ctx.tm.ready is None:
        raise ApiError("The server is starting up.", 503)
    for seq in seqs:
        ctx.tm.check_token_ids(seq, "tokens")
    texts = [ctx.tm.tokenizer.decode(seq, skip_special_tokens=body.skip_special_tokens) for seq in seqs]
    return JSONResp({"text": texts if batched else texts[0]})


# ---------------------------------------------------------------- info


async def _try_stats(tm: TokenizerManager) -> Optional[Any]:
    try:
        return await tm.get_stats(timeout=STATS_TIMEOUT_S)
    except ApiError:
        return None


def _struct_dict(obj: Any) -> Optional[dict]:
    if obj is None:
        return None
    d = msgspec.to_builtins(obj)
    d.pop("type", None)
    return d


def _reveal(body: dict, request: Request) -> dict:
    """Filesystem paths only for callers that presented a configured key; others see the model name."""
    return body if is_authenticated(request) else hide_model_paths(body, _ctx(request).args.model_name)


def _add_info_routes(app: FastAPI) -> None:
    async def server_info(request: Request) -> Response:
        ctx = _ctx(request)
        info = ctx.args.masked_dict()
        stats = await _try_stats(ctx.tm) if ctx.tm.alive else None
        info.update({
            "version": tidal.__version__,
            "disaggregation_mode": stats.disaggregation_mode if stats else ctx.args.disaggregation_mode,
            "epoch": stats.epoch if stats else 0,
            "boot_id": ctx.boot_id,
            "served_model_name": ctx.args.model_name, "scheduler_info": _struct_dict(ctx.tm.ready),
            "torch_threads": ctx.tm.ready.torch_threads if ctx.tm.ready else None,
            "cpu_affinity": ctx.tm.ready.cpu_affinity if ctx.tm.ready else None,
            "kv_events": ctx.tm.ready.kv_events if ctx.tm.ready else {},
            "internal_states": [_struct_dict(stats)] if stats is not None else [],
        })
        return JSONResp(_reveal(info, request))

    async def model_info(request: Request) -> Response:
        args = _ctx(request).args
        info = {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
                "is_generation": not args.is_embedding, "served_model_name": args.model_name}
        ready = _ctx(request).tm.ready
        if args.is_embedding and ready is not None:
            info.update({"pooling": ready.pooling, "embedding_dimensions": ready.hidden_size})
        return JSONResp(_reveal(info, request))

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/version")
    async def version() -> Response:
        return JSONResp({"version": tidal.__version__})

    @app.get("/health")
    async def health(request: Request) -> Response:
        tm = _ctx(request).tm
        if tm.alive:
            return Response(status_code=200)
        return JSONResp(error_body(f"scheduler unavailable: {tm.dead_reason or 'starting'}", 503), status_code=503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        tm = _ctx(request).tm
        if tm.alive and await tm.health_generate(HEALTH_GENERATE_TIMEOUT_S):
            return Response(status_code=200)
        return JSONResp(error_body("health generation failed", 503), status_code=503)


# ---------------------------------------------------------------- admin


def _add_admin_routes(app: FastAPI) -> None:
    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        tm = _ctx(request).tm
        st, age = await tm.latest_stats()  # not an RPC: it must answer under load
        return JSONResp([{"dp_rank": 0, "num_reqs": st.num_running_reqs + st.num_waiting_reqs,
                          "num_waiting_reqs": st.num_waiting_reqs, "num_tokens": st.num_used_tokens,
                          "num_queued_prefill_tokens": st.queued_prefill_tokens,
                          "num_decoding_reqs": st.num_decoding_reqs,
                          "num_waiting_prompt_tokens": st.waiting_prompt_tokens,
                          "prompts_received_total": tm.prompts_received,
                          "prompt_tokens_received_total": tm.prompt_tokens_received,
                          "max_total_tokens": st.max_total_tokens,
                          "handing_over_from": st.handing_over_from,
                          "age_s": round(age, 3)}])

    async def flush_cache(request: Request) -> Response:
        resp = await _ctx(request).tm.flush_cache()
        return JSONResp({"success": resp.success, "message": resp.message or ("Cache flushed." if resp.success else "")},
                        status_code=200 if resp.success else 400)

    for method in ("GET", "POST"):  # one route per method: distinct OpenAPI operation ids
        app.add_api_route("/flush_cache", flush_cache, methods=[method], name=f"flush_cache_{method.lower()}")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = parse_body(AbortRequest, await request.body())
        if not body.rid and not body.abort_all:
            raise ApiError("rid or abort_all is required")
        n = _ctx(request).tm.abort_request(body.rid, body.abort_all)
        return JSONResp({"success": True, "num_aborted": n})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx = _ctx(request)
        if ctx.tm.alive:
            with contextlib.suppress(ApiError):
                ctx.metrics.set_stats(*await ctx.tm.latest_stats(timeout=STATS_TIMEOUT_S))
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
