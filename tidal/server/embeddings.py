"""Embedding routes: OpenAI's POST /v1/embeddings and SGLang's POST /encode (`--is-embedding`).

Every prompt of a request is one scheduler request (a prefill, pooled as tidal/model/pooling.py
says); a list is submitted at once, so its prompts are batched with each other and with whatever
else the scheduler runs. A generation server refuses these routes with 400, and an embedding
server refuses the generation routes (`refuse_generation`).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import Response

from tidal.config import ServerArgs
from tidal.scheduler.embedding import NOT_EMBEDDING_SERVER
from tidal.server.limits import check_prompt_count
from tidal.server.openai_api import check_model
from tidal.server.protocol import ApiError, JSONResp, _Body, parse_body, run_until_done
from tidal.server.tokenizer_manager import ReqState, TokenizerManager

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body (`user` and other extra keys are ignored)."""

    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: str = "float"
    dimensions: Optional[int] = None
    rid: Optional[str] = None


class EncodeRequest(_Body):
    """SGLang's /encode body."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    rid: Optional[str] = None


def refuse_generation(args: ServerArgs) -> None:
    if args.is_embedding:
        raise ApiError("this server serves an embedding model (--is-embedding): it does not generate; "
                       "use /v1/embeddings or /encode")


def _refuse_unless_embedding(args: ServerArgs) -> None:
    if not args.is_embedding:
        raise ApiError(NOT_EMBEDDING_SERVER)


async def _prompts(tm: TokenizerManager, value: Any, texts_given: bool) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether the input was a list of prompts)."""
    if texts_given:
        texts = value if isinstance(value, list) else [value]
        check_prompt_count(len(texts), tm.args.max_batch_size_per_request)
        if not texts:
            raise ApiError("The input is an empty list.")
        return await tm.tokenize_all(texts), isinstance(value, list)
    if not value:
        raise ApiError("The input is an empty list.")
    batched = isinstance(value[0], list)
    ids = [list(x) for x in value] if batched else [list(value)]
    check_prompt_count(len(ids), tm.args.max_batch_size_per_request)
    return ids, batched


async def _embed(request: Request, tm: TokenizerManager, prompts: list[list[int]],
                 rid: Optional[str]) -> Optional[list[ReqState]]:
    """Run the prompts as one batch of embedding requests; None when the client left."""
    base = rid or uuid.uuid4().hex
    reqs = [tm.make_embed_req(ids, rid=base if len(prompts) == 1 else f"{base}-{i}") for i, ids in enumerate(prompts)]
    states = tm.submit(reqs, group=base)
    if not await run_until_done(request, tm, states):
        return None
    return states


def _encode_vector(vec: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


def _is_text_input(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and (not value or isinstance(value[0], str)))


def add_embedding_routes(app: FastAPI) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        ctx = request.app.state.ctx
        body = parse_body(EmbeddingRequest, await request.body())
        _refuse_unless_embedding(ctx.args)
        check_model(body.model, ctx.args.model_name)
        if body.encoding_format not in ENCODING_FORMATS:
            raise ApiError(f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {body.encoding_format!r}")
        if body.dimensions is not None:
            raise ApiError(f"dimensions is not supported: this model returns {ctx.tm.ready.hidden_size}-dimensional "
                           "embeddings and does not support shortened ones; omit dimensions")
        prompts, _ = await _prompts(ctx.tm, body.input, _is_text_input(body.input))
        states = await _embed(request, ctx.tm, prompts, body.rid)
        if states is None:
            return Response(status_code=499)
        tokens = sum(s.num_prompt_tokens() for s in states)
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(s.embedding, body.encoding_format)}
                for i, s in enumerate(states)]
        return JSONResp({"object": "list", "data": data, "model": ctx.args.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        ctx = request.app.state.ctx
        body = parse_body(EncodeRequest, await request.body())
        _refuse_unless_embedding(ctx.args)
        if (body.text is None) == (body.input_ids is None):
            raise ApiError("Either text or input_ids should be provided (exactly one of them).")
        texts_given = body.text is not None
        prompts, batched = await _prompts(ctx.tm, body.text if texts_given else body.input_ids, texts_given)
        states = await _embed(request, ctx.tm, prompts, body.rid)
        if states is None:
            return Response(status_code=499)
        outs = [{"embedding": s.embedding, "meta_info": _meta_info(s)} for s in states]
        return JSONResp(outs if batched else outs[0])


def _meta_info(s: ReqState) -> dict:
    end = s.finished_at or time.monotonic()
    return {"id": s.rid, "finish_reason": s.finish_reason.to_json() if s.finish_reason else None,
            "prompt_tokens": s.num_prompt_tokens(), "e2e_latency": round(end - s.created, 6)}
