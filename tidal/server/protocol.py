"""HTTP request bodies (SGLang /generate and the OpenAI endpoints) and the error shape.

Bodies are parsed with pydantic in strict mode: unknown fields are ignored, values of
the wrong type are a 400, never a silent coercion.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, AsyncIterator, Optional, Sequence, Union

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ERROR_TYPES = {  # the OpenAI client's exception names where it has one
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class ApiError(Exception):
    """An error answered as HTTP `status_code` with the OpenAI error body."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code

    def body(self) -> dict:
        return error_body(self.message, self.status_code)


def internal_error_message(e: BaseException) -> str:
    """Logs `e` with its traceback under a fresh id and returns a client message that names
    only the id and the exception type: its text may hold paths or other server internals."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=e)
    return f"internal error {error_id} ({type(e).__name__}); the server log has the details"


def error_body(message: str, status_code: int) -> dict:
    err_type = _ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")
    return {"error": {"message": message, "type": err_type, "code": status_code}}


def validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    if not body.strip():
        raise ApiError("request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ApiError(validation_message(e)) from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# ---------------------------------------------------------------- SGLang native


class GenerateRequest(_Body):
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    # prefill/decode pairing (router-injected); lists for batches
    bootstrap_host: Optional[Union[str, list[str]]] = None
    bootstrap_port: Optional[Union[int, list[int]]] = None
    bootstrap_room: Optional[Union[int, list[int]]] = None
    priority: Optional[Union[int, list[int]]] = None  # --enable-priority-scheduling
    # SGLang's per-request LoRA adapter: a loaded adapter's name (a list for batches; null: the base model)
    lora_path: Optional[Union[str, list[Optional[str]]]] = None


class LoadLoRARequest(_Body):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Body):
    lora_name: str


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class TokenizeRequest(_Body):
    """SGLang's /tokenize body (vLLM's has the same `prompt` and `add_special_tokens`)."""

    prompt: Union[str, list[str]]
    add_special_tokens: bool = True
    model: Optional[str] = None


class DetokenizeRequest(_Body):
    tokens: Union[list[int], list[list[int]]]
    skip_special_tokens: bool = True
    model: Optional[str] = None


# ---------------------------------------------------------------- OpenAI


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAIBase(_Body):
    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    # SGLang extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    skip_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    rid: Optional[str] = None
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    priority: Optional[int] = None  # --enable-priority-scheduling (SGLang and vLLM accept it here)
    # constrained decoding: SGLang's extra fields, or OpenAI's response_format (one of them)
    regex: Optional[str] = None
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None
    # tool calling: checked and planned in tidal.server.tool_calls (legacy functions are refused there)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None


class CompletionRequest(_OpenAIBase):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False


class ChatMessage(BaseModel):
    # messages keep their extra keys (tool_calls, name, ...) for the chat template
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    parallel_tool_calls: Optional[bool] = None


def response_format_grammar(fmt: Optional[dict[str, Any]]) -> dict[str, str]:
    """OpenAI's response_format as SGLang's constraint fields ({} for text or none)."""
    if fmt is None:
        return {}
    kind = fmt.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise ApiError("response_format json_schema needs a `json_schema` object with a `name` and a `schema`")
        return {"json_schema": _json_text(schema if schema is not None else {}, "response_format.json_schema.schema")}
    if kind == "structural_tag":
        return {"structural_tag": _json_text({k: v for k, v in fmt.items() if k != "type"}, "response_format")}
    raise ApiError(f"response_format type {kind!r} is not supported; use text, json_object, json_schema or structural_tag")


def _json_text(value: Any, name: str) -> str:
    """A JSON Schema given as an object or as a JSON string -> the JSON string."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ApiError(f"{name} must be a JSON object (or a JSON string), got {type(value).__name__}")
    return json.dumps(value)


def openai_sampling_dict(req: _OpenAIBase, max_tokens: Optional[int]) -> dict[str, Any]:
    """The OpenAI fields of `req` under SGLang's sampling parameter names (unset ones left out)."""
    pairs = {
        "max_new_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "min_new_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "stop_token_ids": req.stop_token_ids,
        "stop": req.stop,
        "seed": req.seed,
        "regex": req.regex,
        "json_schema": req.json_schema,
        "ebnf": req.ebnf,
        "structural_tag": req.structural_tag,
    }
    from_format = response_format_grammar(req.response_format)
    if from_format:
        if any(pairs[k] is not None for k in ("regex", "json_schema", "ebnf", "structural_tag")):
            raise ApiError("response_format cannot be combined with regex, json_schema, ebnf or structural_tag")
        pairs.update(from_format)
    # max_new_tokens stays even when None: an explicit null means "up to the context length"
    return {k: v for k, v in pairs.items() if v is not None or k == "max_new_tokens"}


_SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)


def sampling_from_dict(d: Optional[dict[str, Any]]) -> tuple[SamplingParams, bool, int]:
    """SGLang `sampling_params` -> (SamplingParams, max_new_tokens_was_set, n).

    Unknown keys are ignored; `stop` may be a string; `json_schema` and `structural_tag` may be
    objects instead of JSON strings; `sampling_seed` is an alias of `seed`. Raises ApiError on a
    wrong type; values (and grammars) are checked later, by TokenizerManager.make_req, once the
    prompt length is known.
    """
    d = dict(d or {})
    for key in ("json_schema", "structural_tag"):
        if d.get(key) is not None:
            d[key] = _json_text(d[key], key)
    n = d.pop("n", None)
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ApiError(f"n must be an integer >= 1, got {n!r}")
    if d.get("seed") is None and d.get("sampling_seed") is not None:
        d["seed"] = d["sampling_seed"]
    if isinstance(d.get("stop"), str):
        d["stop"] = [d["stop"]]
    for key in ("stop", "stop_token_ids"):
        if d.get(key) is None:
            d.pop(key, None)
    max_set = not ("max_new_tokens" in d and d["max_new_tokens"] is None)  # omitted: the default 128
    clean = {k: v for k, v in d.items() if k in _SAMPLING_FIELDS and v is not None}
    try:
        params = msgspec.convert(clean, SamplingParams)
    except msgspec.ValidationError as e:
        raise ApiError(f"invalid sampling_params: {e}") from None
    return params, max_set, n


# ---------------------------------------------------------------- HTTP plumbing

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()  # non-finite floats (a -inf logprob) become null, valid JSON


def to_json(obj: Any) -> bytes:
    return _json.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class JSONResp(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def error_response(e: ApiError) -> JSONResp:
    # 503: this server cannot take the request now (draining, switching); routers retry elsewhere
    headers = {"Retry-After": "1"} if e.status_code == 503 else None
    return JSONResp(e.body(), status_code=e.status_code, headers=headers)


EXPECTED_MODE_HEADER = "x-tidal-expected-mode"


def apply_expected_mode(request: Request, reqs: Sequence[Any]) -> None:
    """`X-Tidal-Expected-Mode: decode` or `decode;epoch=3` (set by tidal's router)."""
    raw = request.headers.get(EXPECTED_MODE_HEADER)
    if not raw:
        return
    mode, _, rest = raw.partition(";")
    epoch = None
    if rest.strip().startswith("epoch="):
        try:
            epoch = int(rest.strip()[len("epoch="):])
        except ValueError:
            raise ApiError(f"bad {EXPECTED_MODE_HEADER} header: {raw!r}") from None
    for r in reqs:
        r.expected_mode = mode.strip() or None
        r.expected_epoch = epoch


def event_stream(gen: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_until_done(request: Request, tm: Any, states: Sequence[Any]) -> bool:
    """Wait until every state is finished; False (after aborting them) if the client left.

    Raises the ApiError of a failed state.
    """
    work = asyncio.ensure_future(tm.wait_all(states))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            tm.abort_states(states)
    if work in done:
        work.result()
        return True
    return False
