"""OpenAI-compatible /v1/completions and /v1/chat/completions on top of the TokenizerManager."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence, Union

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tidal.sampling_params import seed_for_copy
from tidal.server.limits import check_n, check_prompt_count, check_top_logprobs
from tidal.server.lora_api import lora_for_model
from tidal.server.protocol import (
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JSONResp,
    apply_expected_mode,
    event_stream,
    openai_sampling_dict,
    parse_body,
    run_until_done,
    sampling_from_dict,
    sse,
)
from tidal.server.tokenizer_manager import ReqState, TokenizerManager
from tidal.server.tool_calls import (ToolOutput, ToolPlan, finish_reason, plan_tools, refuse_tools, template_message,
                                     template_tools, tool_sampling)
from tidal.server.tool_parser import get_parser
from tidal.server_timing import HEADER as SERVER_TIMING, format_server_timing, mean_latencies


@dataclass
class _Call:
    """One OpenAI call: its states (prompt-major, n per prompt) and what the reply needs."""

    kind: str  # "text_completion" | "chat.completion"
    id: str
    model: str
    n: int
    states: list[ReqState]
    created: int = field(default_factory=lambda: int(time.time()))
    echo: list[str] = field(default_factory=list)  # completions echo=True: prompt text per prompt
    logprobs: bool = False
    include_usage: bool = False
    tools: Optional[ToolPlan] = None  # chat: the request's tool plan
    tool_call_parser: Optional[str] = None  # the server's --tool-call-parser

    def tool_output(self) -> ToolOutput:
        return ToolOutput(self.tools, get_parser(self.tool_call_parser))

    def index(self, s: ReqState) -> int:
        return self.states.index(s)

    def usage(self) -> dict:
        prompt = sum(s.num_prompt_tokens() for s in self.states[:: self.n])
        completion = sum(s.num_completion_tokens() for s in self.states)
        cached = sum(s.cached_tokens for s in self.states[:: self.n])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def chunk(self, choices: list[dict], usage: Optional[dict] = None) -> dict:
        obj = {"id": self.id, "object": f"{self.kind}.chunk" if self.kind == "chat.completion" else self.kind,
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return obj


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def check_model(requested: Optional[str], served: str) -> None:
    """404 for a `model` this server does not serve; no model and "default" mean the served one."""
    if requested is not None and requested not in (served, "default"):
        raise ApiError(f"The model `{requested}` does not exist; this server serves `{served}`.", 404)


def _check_max_tokens(max_tokens: Optional[int], name: str) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"{name} must be at least 1, got {max_tokens}")


def _check_fits_context(tm: TokenizerManager, prompts: Sequence[list[int]], max_tokens: Optional[int]) -> None:
    """400 when a prompt plus the requested completion does not fit the context (vLLM's rule)."""
    if max_tokens is None:
        return
    context = tm.ready.context_length
    for ids in prompts:
        tm.check_input_len(len(ids))  # a prompt too long by itself gets that error
        if len(ids) + max_tokens > context:
            raise ApiError(f"The context length is {context} tokens, but this request needs "
                           f"{len(ids) + max_tokens}: {len(ids)} prompt tokens plus max_tokens={max_tokens}. "
                           "Shorten the prompt or lower max_tokens.")


def _finish(s: ReqState) -> tuple[Optional[str], Union[int, str, None]]:
    fr = s.finish_reason
    if fr is None:
        return None, None
    return (fr.type if fr.type in ("stop", "length") else "abort"), fr.matched


def _build_reqs(tm: TokenizerManager, prompts: Sequence[list[int]], body: Any, max_tokens: Optional[int],
                logprobs: bool, top_logprobs: int, prompt_logprobs: bool,
                extra_sampling: Optional[dict] = None, lora: Optional[str] = None) -> list:
    if body.n < 1:
        raise ApiError(f"n must be >= 1, got {body.n}")
    check_n(body.n, tm.args.max_n)
    check_top_logprobs(top_logprobs, tm.args.max_logprobs)
    if body.bootstrap_room is not None and len(prompts) * body.n > 1:
        raise ApiError("A request with bootstrap_room (prefill/decode pairing) takes one prompt and n=1.")
    params, max_set, _ = sampling_from_dict({**openai_sampling_dict(body, max_tokens), **(extra_sampling or {})})
    base = body.rid or uuid.uuid4().hex
    reqs = []
    for i, ids in enumerate(prompts):
        for j in range(body.n):
            p = msgspec.structs.replace(params, seed=seed_for_copy(params.seed, j))
            rid = base if len(prompts) * body.n == 1 else f"{base}-{i * body.n + j}"
            reqs.append(tm.make_req(ids, p, max_set=max_set, rid=rid, stream=body.stream, return_logprob=logprobs,
                                    logprob_start_len=0 if prompt_logprobs else -1, top_logprobs_num=top_logprobs,
                                    bootstrap=(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room),
                                    priority=body.priority, lora_name=lora))
    return reqs


async def _respond(request: Request, tm: TokenizerManager, call: _Call, body: Any,
                   make_choice: Any, stream_gen: Any) -> Response:
    if body.stream:
        return event_stream(stream_gen(tm, call))
    if not await run_until_done(request, tm, call.states):
        return Response(status_code=499)
    choices = [make_choice(call, s) for s in call.states]
    timing = format_server_timing(*mean_latencies(s.latencies() for s in call.states))
    return JSONResp({"id": call.id, "object": call.kind, "created": call.created, "model": call.model,
                     "choices": choices, "usage": call.usage()},
                    headers={SERVER_TIMING: timing} if timing else None)


# ---------------------------------------------------------------- /v1/completions


async def _completion_prompts(tm: TokenizerManager, prompt: Any) -> tuple[list[list[int]], list]:
    """(token ids, the prompts as a list) for a str / list[str] / list[int] / list[list[int]] prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError("prompt must not be empty")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    check_prompt_count(len(prompt), tm.args.max_batch_size_per_request)
    tokenized = iter(await tm.tokenize_all([p for p in prompt if isinstance(p, str)]))
    ids = [next(tokenized) if isinstance(p, str) else list(p) for p in prompt]
    return ids, prompt


def _echo_texts(tm: TokenizerManager, prompts: list, n: int) -> list[str]:
    """Per state, the prompt text to echo (token prompts decoded once they are validated)."""
    texts = [p if isinstance(p, str) else tm.tokenizer.decode(p) for p in prompts]
    return [t for t in texts for _ in range(n)]


async def create_completion(request: Request, tm: TokenizerManager, model_name: str) -> Response:
    body = parse_body(CompletionRequest, await request.body())
    lora = lora_for_model(tm, body.model, model_name)
    refuse_tools(body)
    _check_max_tokens(body.max_tokens, "max_tokens")
    ids, prompts = await _completion_prompts(tm, body.prompt)
    _check_fits_context(tm, ids, body.max_tokens)
    want_lp = body.logprobs is not None
    reqs = _build_reqs(tm, ids, body, body.max_tokens, want_lp, body.logprobs or 0, want_lp and body.echo, lora=lora)
    call = _Call("text_completion", f"cmpl-{uuid.uuid4().hex}", lora or model_name, body.n, [],
                 echo=_echo_texts(tm, prompts, body.n) if body.echo else [], logprobs=want_lp,
                 include_usage=bool(body.stream_options and body.stream_options.include_usage))
    apply_expected_mode(request, reqs)
    call.states = tm.submit(reqs, group=body.rid, text_in_logprobs=True)
    return await _respond(request, tm, call, body, _completion_choice, _stream_completion)


def _completion_logprobs(entries: list, tops: list, offset: int) -> dict:
    tokens, lps, top, offsets = [], [], [], []
    for k, (lp, _tid, text) in enumerate(entries):
        text = text or ""
        tokens.append(text)
        lps.append(lp)
        row = tops[k] if k < len(tops) else None
        top.append(None if row is None else {t or "": v for v, _i, t in row})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def _completion_choice(call: _Call, s: ReqState) -> dict:
    k = call.index(s)
    prefix = call.echo[k] if call.echo else ""
    lp = None
    if call.logprobs:
        entries, tops = list(s.output_token_logprobs), list(s.output_top_logprobs)
        if call.echo:
            entries = s.input_token_logprobs + entries
            tops = (s.input_top_logprobs or [None] * len(s.input_token_logprobs)) + tops
        lp = _completion_logprobs(entries, tops, 0)
    reason, matched = _finish(s)
    return {"index": k, "text": prefix + s.text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}


async def _streamed(tm: TokenizerManager, call: _Call, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The SSE envelope both OpenAI streams share: usage chunk, [DONE], errors, abort on exit."""
    try:
        async for chunk in chunks:
            yield chunk
        if call.include_usage:
            yield sse(call.chunk([], call.usage()))
        yield SSE_DONE
    except ApiError as e:
        yield sse(e.body())
        yield SSE_DONE
    finally:
        await chunks.aclose()
        tm.abort_states(call.states)


def _stream_completion(tm: TokenizerManager, call: _Call) -> AsyncIterator[bytes]:
    return _streamed(tm, call, _completion_chunks(tm, call))


async def _completion_chunks(tm: TokenizerManager, call: _Call) -> AsyncIterator[bytes]:
    sent_text = [0] * len(call.states)
    sent_lp = [0] * len(call.states)
    echoed = [not call.echo] * len(call.states)
    async for changed in tm.updates(call.states):
        for s in changed:
            k = call.index(s)
            delta = s.text[sent_text[k]:]
            lp = None
            if call.logprobs:
                new = s.output_token_logprobs[sent_lp[k]:]
                lp = _completion_logprobs(new, s.output_top_logprobs[sent_lp[k]:], sent_text[k])
                sent_lp[k] += len(new)
            sent_text[k] = len(s.text)
            if not echoed[k]:
                echoed[k] = True
                delta = call.echo[k] + delta
            reason, matched = _finish(s)
            if delta or reason or (lp and lp["tokens"]):
                yield sse(call.chunk([{"index": k, "text": delta, "logprobs": lp, "finish_reason": reason,
                                       "matched_stop": matched}]))


# ---------------------------------------------------------------- /v1/chat/completions


def _message_dict(m: ChatMessage) -> dict:
    if m.role not in CHAT_ROLES:
        raise ApiError(f"Invalid chat message role {m.role!r}; the roles are {', '.join(CHAT_ROLES)}.")
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        parts = []
        for part in m.content:
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise ApiError("only text content parts are supported")
            parts.append(part["text"])
        d["content"] = "".join(parts)
    d.setdefault("content", "")
    return template_message(d)


def chat_prompt(tok: Any, messages: Sequence[ChatMessage], tools: Optional[list[dict]] = None) -> str:
    """The chat template applied to `messages` (and `tools`, for templates that show them)."""
    if not getattr(tok, "chat_template", None):
        raise ApiError("This model has no chat template; use /v1/completions")
    msgs = [_message_dict(m) for m in messages]
    try:
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja raises on template rule violations (role order, ...)
        raise ApiError(f"cannot apply the chat template: {e}") from None


async def chat_prompt_ids(tm: TokenizerManager, messages: Sequence[ChatMessage],
                          tools: Optional[list[dict]] = None) -> list[int]:
    prompt = chat_prompt(tm.tokenizer, messages, tools)
    return (await tm.tokenize_all([prompt], add_special_tokens=False))[0]


async def create_chat_completion(request: Request, tm: TokenizerManager, model_name: str) -> Response:
    body = parse_body(ChatCompletionRequest, await request.body())
    lora = lora_for_model(tm, body.model, model_name)
    _check_max_tokens(body.max_tokens, "max_tokens")
    _check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs requires logprobs to be true")
    plan = plan_tools(body)
    ids = await chat_prompt_ids(tm, body.messages, template_tools(plan))
    _check_fits_context(tm, [ids], max_tokens)
    extra = tool_sampling(plan, get_parser(tm.args.tool_call_parser), body.skip_special_tokens)
    try:
        reqs = _build_reqs(tm, [ids], body, max_tokens, body.logprobs, body.top_logprobs or 0, False,
                           extra_sampling=extra, lora=lora)
    except ApiError as e:
        if "json_schema" not in extra or e.status_code != 400 or "json_schema" not in e.message:
            raise
        raise ApiError(f"tool_choice {plan.choice!r} decodes under the tools' parameters schemas, which the "
                       f"grammar engine refuses: {e.message}") from None
    call = _Call("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", lora or model_name, body.n, [],
                 logprobs=body.logprobs, include_usage=bool(body.stream_options and body.stream_options.include_usage),
                 tools=plan, tool_call_parser=tm.args.tool_call_parser)
    apply_expected_mode(request, reqs)
    call.states = tm.submit(reqs, group=body.rid, text_in_logprobs=True)
    return await _respond(request, tm, call, body, _chat_choice, _stream_chat)


def _chat_logprobs(entries: list, tops: list) -> dict:
    content = []
    for k, (lp, _tid, text) in enumerate(entries):
        text = text or ""
        row = tops[k] if k < len(tops) else []
        content.append({
            "token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": t or "", "logprob": v, "bytes": list((t or "").encode("utf-8"))}
                             for v, _i, t in row or []],
        })
    return {"content": content}


def _chat_choice(call: _Call, s: ReqState) -> dict:
    reason, matched = _finish(s)
    lp = _chat_logprobs(s.output_token_logprobs, s.output_top_logprobs) if call.logprobs else None
    message = call.tool_output().message(s.text)
    return {"index": call.index(s), "message": message, "logprobs": lp,
            "finish_reason": finish_reason(reason, "tool_calls" in message), "matched_stop": matched}


def _stream_chat(tm: TokenizerManager, call: _Call) -> AsyncIterator[bytes]:
    return _streamed(tm, call, _chat_chunks(tm, call))


async def _chat_chunks(tm: TokenizerManager, call: _Call) -> AsyncIterator[bytes]:
    sent_text = [-1] * len(call.states)  # -1: the role chunk is not sent yet
    sent_lp = [0] * len(call.states)
    tools = [call.tool_output() for _ in call.states]
    async for changed in tm.updates(call.states):
        for s in changed:
            k = call.index(s)
            if sent_text[k] < 0:
                sent_text[k] = 0
                yield sse(call.chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
            reason, matched = _finish(s)
            lp = None
            if call.logprobs:
                lp = _chat_logprobs(s.output_token_logprobs[sent_lp[k]:], s.output_top_logprobs[sent_lp[k]:])
                sent_lp[k] = len(s.output_token_logprobs)
            if tools[k].active:
                deltas = tools[k].deltas(s.text, final=reason is not None)
            else:
                deltas = [{"content": s.text[sent_text[k]:]}] if len(s.text) > sent_text[k] else []
            sent_text[k] = len(s.text)
            if not deltas and lp and lp["content"]:
                deltas = [{"content": ""}]
            for j, delta in enumerate(deltas):
                yield sse(call.chunk([{"index": k, "delta": delta, "logprobs": lp if j == 0 else None,
                                       "finish_reason": None}]))
            if reason:
                yield sse(call.chunk([{"index": k, "delta": {}, "logprobs": None,
                                       "finish_reason": finish_reason(reason, tools[k].called),
                                       "matched_stop": matched}]))
