"""The API process side of the scheduler link: tokenize, validate, send, route outputs.

A request is one or more `ReqState`s (a batch, or n > 1) sharing one asyncio.Event;
the receive task applies each `ReqOutput` to its state (ids, incremental text,
logprobs), bumps the state's version and sets the event. Consumers iterate
`TokenizerManager.updates(states)`, which yields cumulative snapshots.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

import zmq

from tidal.config import ServerArgs
from tidal.constrained.grammar import GrammarError, JsonStyle, check_grammar
from tidal.messages import (
    AbortReq,
    BatchOut,
    CancelMigrationReq,
    FinishReason,
    FlushCacheReq,
    FlushCacheResp,
    LoadLoRAReq,
    LoRAResp,
    GenerateReq,
    LoadSnapshot,
    ModeStatusReq,
    ModeStatusResp,
    PrepareModeReq,
    ReqOutput,
    SchedulerError,
    SchedulerReady,
    UnloadLoRAReq,
    StatsReq,
    StatsResp,
    SwitchModeReq,
    SwitchModeResp,
    decode_to_api,
    encode,
)
from tidal.sampling_params import SamplingParams
from tidal.server.detokenizer import IncrementalDetokenizer, decode_tokens
from tidal.server.limits import check_stop, check_top_logprobs, max_chars_per_token
from tidal.server.migration import MigrationRelay
from tidal.server.protocol import ApiError

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0
# Texts up to this many characters (in all, per request) are tokenized on the event loop
# (about a millisecond); longer ones in a worker thread, so other clients are not stalled.
INLINE_TOKENIZE_CHARS = 32 * 1024


def load_server_tokenizer(args: ServerArgs) -> Any:
    try:
        from tidal.model.tokenizer import load_tokenizer
    except ModuleNotFoundError as e:
        if e.name not in ("tidal.model.tokenizer", "tidal.model"):
            raise
        load_tokenizer = _fallback_load_tokenizer
    return load_tokenizer(args.model_path, args.tokenizer_path)


def _fallback_load_tokenizer(model_path: str, tokenizer_path: Optional[str] = None) -> Any:
    from transformers import AutoTokenizer

    if tokenizer_path:
        return AutoTokenizer.from_pretrained(tokenizer_path)
    if model_path.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(model_path))
        return AutoTokenizer.from_pretrained(d, gguf_file=f)
    return AutoTokenizer.from_pretrained(model_path)


@dataclass(eq=False)
class ReqState:
    req: GenerateReq
    group: str  # the client's rid for the whole request (batch / n > 1)
    event: asyncio.Event
    detok: IncrementalDetokenizer
    text_in_logprobs: bool = False
    internal: bool = False  # health checks: not counted in metrics
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_token_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    embedding: Optional[list[float]] = None  # an embedding request's result
    error: Optional[ApiError] = None
    version: int = 0

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def text(self) -> str:
        return self.detok.text

    def apply(self, out: ReqOutput, tokenizer: Any) -> None:
        self.output_ids.extend(out.new_token_ids)
        self.detok.feed(out.new_token_ids, out.finish_reason)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.input_logprobs:
            self.input_token_logprobs.extend(self._triples(out.input_logprobs, tokenizer))
        if out.input_top_logprobs:
            self.input_top_logprobs.extend(
                None if row is None else self._triples(row, tokenizer) for row in out.input_top_logprobs)
        if out.output_logprobs:
            self.output_token_logprobs.extend(self._triples(out.output_logprobs, tokenizer))
        if out.output_top_logprobs:
            self.output_top_logprobs.extend(self._triples(row, tokenizer) for row in out.output_top_logprobs)
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.finish_reason is not None:
            self.finish(out.finish_reason)
        self.version += 1

    def _triples(self, pairs: Sequence[tuple[Optional[float], int]], tokenizer: Any) -> list[list]:
        texts = decode_tokens(tokenizer, [t for _, t in pairs]) if self.text_in_logprobs else None
        return [[lp, tid, texts[i] if texts else None] for i, (lp, tid) in enumerate(pairs)]

    def finish(self, reason: FinishReason, error: Optional[ApiError] = None) -> None:
        if self.finished:
            return
        if not self.detok.finished:
            self.detok.feed([], reason)
        self.finish_reason = reason
        self.finished_at = time.monotonic()
        if error is None and reason.type == "abort" and reason.status_code:
            error = ApiError(reason.message or "request aborted", reason.status_code)
        self.error = error
        self.version += 1
        self.event.set()

    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens or len(self.req.input_ids)

    def num_completion_tokens(self) -> int:
        return self.completion_tokens or len(self.output_ids)

    def latencies(self) -> tuple[Optional[float], float, int]:
        """(arrival to the first output token, None before it; arrival to the end, or to now; completion
        tokens): the TTFT and TPOT a non-streamed reply hides, by this server's clock."""
        end = self.finished_at or time.monotonic()
        first = None if self.first_token_at is None else self.first_token_at - self.created
        return first, end - self.created, self.num_completion_tokens()

    def meta_info(self) -> dict:
        first, e2e, completion = self.latencies()
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_json() if self.finish_reason else None,
            "prompt_tokens": self.num_prompt_tokens(),
            "completion_tokens": completion,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(e2e, 6),
        }
        if first is not None:
            meta["first_token_latency"] = round(first, 6)
        if self.req.return_logprob:
            meta["input_token_logprobs"] = self.input_token_logprobs
            meta["output_token_logprobs"] = self.output_token_logprobs
            if self.req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self.input_top_logprobs
                meta["output_top_logprobs"] = self.output_top_logprobs
        return meta


def _bootstrap_fields(bootstrap: Optional[tuple]) -> dict:
    if bootstrap is None or bootstrap[2] is None:
        return {}
    host, port, room = bootstrap
    if not isinstance(room, int) or not 0 <= room < 2**63:
        raise ApiError(f"bootstrap_room must be an integer in [0, 2**63), got {room!r}")
    if port is not None and not 0 < port < 65536:
        raise ApiError(f"bootstrap_port must be a TCP port, got {port!r}")
    if not host:
        raise ApiError("bootstrap_host is required with bootstrap_room")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer: Any = None, metrics: Any = None) -> None:
        self.args = args
        self.tokenizer = tokenizer if tokenizer is not None else load_server_tokenizer(args)
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        self.metrics = metrics
        self._valid_grammars: set[tuple[str, str]] = set()
        self.ready: Optional[SchedulerReady] = None
        self.lora_adapters: dict[str, str] = {}  # loaded LoRA adapters (name -> path), as the scheduler last said
        self.mode, self.epoch = args.disaggregation_mode, 0  # last known; the scheduler is authoritative
        self.dead_reason: Optional[str] = None
        self.output_timeout = float(args.watchdog_timeout)
        self.last_output_at = 0.0
        self.load: Optional[StatsResp] = None  # the scheduler's latest LoadSnapshot
        self.load_at = 0.0
        self._states: dict[str, ReqState] = {}
        # since the start: the requests sent to the scheduler and their prompts' tokens, counted here as they arrive
        # (the planner's arrivals, /get_load): the scheduler takes new requests only between passes, and a
        # prefill server's batched long prompts held its count back ~10 s on a live turn to them
        self.prompts_received = 0
        self.prompt_tokens_received = 0
        self._rpcs: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._push: Optional[zmq.Socket] = None
        self._recv_task: Optional[asyncio.Task] = None
        self.migrations = MigrationRelay(self, getattr(args, "api_key", None),
                                         getattr(args, "retraction_migrate_to", ()))  # requests moving to other servers (drain_policy migrate)

    # ------------------------------------------------------------ lifecycle

    def start(self, push: zmq.Socket, pull: Any, ready: SchedulerReady) -> None:
        """`push` is a blocking zmq PUSH (sent with NOBLOCK), `pull` a zmq.asyncio PULL."""
        self._push, self.ready = push, ready
        self.lora_adapters = dict(ready.lora_adapters)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(pull))

    async def stop(self) -> None:
        await self.migrations.close()
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
            self._recv_task = None

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.ready is not None

    @property
    def num_pending(self) -> int:
        return len(self._states)

    def mark_dead(self, reason: str) -> None:
        """The scheduler is gone: fail every pending request and RPC with a 503."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("scheduler is gone: %s", reason)
        err = ApiError(f"The scheduler process is gone ({reason}); the server is shutting down.", 503)
        for state in list(self._states.values()):
            state.finish(FinishReason(type="abort", message=err.message, status_code=503), err)
            self.migrations.cancel(state.rid)
        self._states.clear()
        for fut in self._rpcs.values():
            if not fut.done():
                fut.set_exception(err)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ApiError(f"The scheduler process is gone ({self.dead_reason}).", 503)
        if self.ready is None:
            raise ApiError("The server is starting up.", 503)

    def _send(self, *msgs: Any) -> None:
        """Several messages go as one multipart message: ZMQ delivers its parts together, so the
        scheduler reads a batch's requests in the same iteration and can prefill them in one step."""
        self._check_alive()
        try:
            self._push.send_multipart([encode(m) for m in msgs], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.mark_dead(f"send failed: {e}")
            self._check_alive()

    # ------------------------------------------------------------ receiving

    async def _recv_loop(self, pull: Any) -> None:
        while True:
            data = await pull.recv()
            try:
                msg = decode_to_api(data)
            except Exception:  # a bad frame must not stop the loop
                logger.exception("undecodable message from the scheduler")
                continue
            try:
                self._dispatch(msg)
            except Exception:
                logger.exception("failed to handle %s", type(msg).__name__)
            # recv() of a queued message does not yield; let the HTTP tasks run between batches
            await asyncio.sleep(0)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchOut):
            now = time.monotonic()
            self.last_output_at = now
            for out in msg.outputs:
                self._on_output(out, now)
        elif isinstance(msg, (FlushCacheResp, StatsResp, SwitchModeResp, ModeStatusResp, LoRAResp)):
            fut = self._rpcs.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, LoadSnapshot):
            self.load, self.load_at = msg.stats, time.monotonic()
        elif isinstance(msg, SchedulerError):
            self.mark_dead(msg.message)
        elif isinstance(msg, SchedulerReady):
            self.ready = msg

    def _on_output(self, out: ReqOutput, now: float) -> None:
        state = self._states.get(out.rid)
        if state is None:  # aborted by the client, or unknown
            if out.migration is not None and out.migration.state == "offer":
                self.send_control(CancelMigrationReq(rid=out.rid, reason="the client is gone"))
            return
        n = len(out.new_token_ids)
        if n and self.metrics is not None and not state.internal:
            if state.first_token_at is None:  # tokens that come with the first one carry no ITL
                self.metrics.on_first_token(now - state.created)
            else:
                self.metrics.on_tokens(now - state.last_token_at, n)
        if n:
            state.first_token_at = state.first_token_at or now
            state.last_token_at = now
        state.apply(out, self.tokenizer)
        if out.migration is not None and not state.finished:
            self.migrations.on_ticket(state, out.migration)
        if state.finished:
            self._states.pop(out.rid, None)
            self.migrations.cancel(out.rid)
            self._on_finished(state)
        state.event.set()

    def apply_relayed(self, out: ReqOutput) -> None:
        """Output of a migrated request, relayed from the server it moved to."""
        self._on_output(out, time.monotonic())

    def send_control(self, msg: Any) -> None:
        """A message to the scheduler that no caller waits on (lost if the scheduler is gone)."""
        try:
            self._send(msg)
        except ApiError:
            pass

    def _on_finished(self, state: ReqState) -> None:
        if self.metrics is None or state.internal:
            return
        fr = state.finish_reason
        self.metrics.on_finish(
            state.num_prompt_tokens(), state.num_completion_tokens(), state.cached_tokens,
            state.finished_at - state.created, aborted=fr is not None and fr.type == "abort")

    # ------------------------------------------------------------ requests

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def tokenize_all(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Tokenize without blocking the event loop: a text that certainly has too many
        tokens is refused before tokenizing, long texts are encoded in a worker thread
        (Rust tokenizers release the GIL while they encode)."""
        for t in texts:
            self._refuse_certainly_too_long(t)
        if sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS:
            return self._tokenize_within_limit(texts, add_special_tokens)
        return await asyncio.to_thread(self._tokenize_within_limit, texts, add_special_tokens)

    def _tokenize_within_limit(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """Stops at the first text that is too long (a batch of them is refused for the price of one)."""
        out = []
        for t in texts:
            out.append(self.tokenize(t, add_special_tokens))
            self.check_input_len(len(out[-1]))
        return out

    def _refuse_certainly_too_long(self, text: str) -> None:
        self._check_alive()
        per_token = self.max_chars_per_token
        if per_token is not None and len(text) > self.ready.max_req_input_len * per_token:
            raise self._too_long(f"{len(text)} characters, so more than {len(text) // per_token} tokens")

    def check_token_ids(self, ids: Sequence[int], name: str) -> None:
        vocab = self.ready.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(f"{name} must be token ids in [0, {vocab})")

    def check_grammar(self, sampling: SamplingParams) -> None:
        """400 for a grammar the engine would refuse (bad JSON Schema, regex or EBNF), before
        the request reaches a scheduler. Valid grammars are remembered (a bounded set)."""
        key = sampling.grammar_key
        if key is None or key in self._valid_grammars:
            return
        if self.args.grammar_backend == "none":
            raise ApiError(f"{key[0]} needs constrained decoding, which this server has off (--grammar-backend none)")
        try:
            check_grammar(key[0], key[1], JsonStyle(self.args.constrained_json_whitespace_pattern))
        except GrammarError as e:
            raise ApiError(str(e)) from None
        if len(self._valid_grammars) >= 1024:
            self._valid_grammars.clear()
        self._valid_grammars.add(key)

    def check_input_len(self, n: int) -> None:
        if n > self.ready.max_req_input_len:
            raise self._too_long(f"{n} tokens")

    def _too_long(self, size: str) -> ApiError:
        ready = self.ready
        return ApiError(f"The input ({size}) is longer than the model's maximum input length "
                        f"({ready.max_req_input_len} tokens; context length {ready.context_length} tokens).")

    def make_req(
        self, input_ids: list[int], sampling: SamplingParams, *, max_set: bool = True,
        rid: Optional[str] = None, stream: bool = False, return_logprob: bool = False,
        logprob_start_len: int = -1, top_logprobs_num: int = 0,
        bootstrap: Optional[tuple[Optional[str], Optional[int], Optional[int]]] = None,
        priority: Optional[int] = None,
        lora_name: Optional[str] = None,
    ) -> GenerateReq:
        """Validate one prompt and its parameters against the model limits (ApiError 400)."""
        self._check_alive()
        ready, n = self.ready, len(input_ids)
        if n == 0:
            raise ApiError("The prompt is empty; it must contain at least one token.")
        self.check_input_len(n)
        self.check_token_ids(input_ids, "input_ids")
        remaining = max(ready.context_length - n, 0)
        if not max_set:
            sampling.max_new_tokens = remaining
        try:
            sampling.validate(ready.vocab_size)
        except ValueError as e:
            raise ApiError(str(e)) from None
        sampling.max_new_tokens = min(sampling.max_new_tokens, remaining)
        sampling.min_new_tokens = min(sampling.min_new_tokens, sampling.max_new_tokens)
        if sampling.top_k >= ready.vocab_size:
            sampling.top_k = -1  # the same distribution, and a value the wire format can carry
        check_top_logprobs(top_logprobs_num, self.args.max_logprobs)
        check_stop(sampling.stop, self.args.max_stop_strings, self.args.max_stop_string_chars)
        self.check_grammar(sampling)
        if not -1 <= logprob_start_len < n:
            raise ApiError(f"logprob_start_len must be in [-1, {n}), got {logprob_start_len}")
        self.check_priority(priority)
        self.check_lora(lora_name)
        return GenerateReq(
            rid=rid or uuid.uuid4().hex, input_ids=list(input_ids), sampling=sampling, stream=stream,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0, arrival_time=time.time(),
            priority=priority, lora_name=lora_name, **_bootstrap_fields(bootstrap))

    def check_priority(self, priority: Optional[int]) -> None:
        if priority is None:
            return
        if not self.args.enable_priority_scheduling:
            raise ApiError("priority is set but this server does not schedule by priority; start it with "
                           "--enable-priority-scheduling, or leave priority out")
        if not -2**63 <= priority < 2**63:
            raise ApiError(f"priority must be a 64-bit integer, got {priority}")

    def make_embed_req(self, input_ids: list[int], rid: Optional[str] = None) -> GenerateReq:
        """One prompt of an embedding request (a prefill only), validated like make_req's (ApiError 400)."""
        self._check_alive()
        if not input_ids:
            raise ApiError("The input is empty; it must contain at least one token.")
        self.check_input_len(len(input_ids))
        self.check_token_ids(input_ids, "input_ids")
        return GenerateReq(rid=rid or uuid.uuid4().hex, input_ids=list(input_ids),
                           sampling=SamplingParams(max_new_tokens=0), arrival_time=time.time(), embedding=True)

    def check_lora(self, name: Optional[str]) -> None:
        """400 for an adapter this server does not hold (the scheduler checks again: unloads race)."""
        if name is None:
            return
        if not isinstance(name, str):
            raise ApiError("lora_path must be a string: the name of a loaded LoRA adapter")
        if not self.ready.lora_enabled:
            raise ApiError("LoRA is not enabled on this server (start it with --enable-lora)")
        if name not in self.lora_adapters:
            raise ApiError(f"Unknown LoRA adapter {name!r}; loaded: {sorted(self.lora_adapters)}")

    def submit(
        self, reqs: Sequence[GenerateReq], group: Optional[str] = None, *,
        text_in_logprobs: bool = False, internal: bool = False,
    ) -> list[ReqState]:
        """Register and send the requests; all states share one event."""
        self._check_alive()
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids) or any(r in self._states for r in rids):
            raise ApiError("Duplicate request id (rid): a request with this rid is in flight.")
        event = asyncio.Event()
        states = [self._new_state(r, group or r.rid, event, text_in_logprobs, internal) for r in reqs]
        for state in states:
            self._states[state.rid] = state
        try:
            self._send(*(state.req for state in states))
        except BaseException:  # nothing may stay registered: the rids must be reusable
            self.abort_states(states)
            raise
        if not internal:
            self.prompts_received += len(reqs)
            self.prompt_tokens_received += sum(len(r.input_ids) for r in reqs)
        return states

    def _new_state(self, req: GenerateReq, group: str, event: asyncio.Event,
                   text_in_logprobs: bool, internal: bool) -> ReqState:
        s = req.sampling
        detok = IncrementalDetokenizer(self.tokenizer, req.input_ids, skip_special_tokens=s.skip_special_tokens,
                                       stop=s.stop, no_stop_trim=s.no_stop_trim)
        return ReqState(req=req, group=group, event=event, detok=detok,
                        text_in_logprobs=text_in_logprobs, internal=internal)

    async def updates(self, states: Sequence[ReqState]) -> AsyncIterator[list[ReqState]]:
        """Yield the states that changed since the previous yield, until all are finished.

        Raises the ApiError of a failed state, and a 504 (after aborting) when the
        scheduler sends nothing for `output_timeout` seconds.
        """
        seen = [-1] * len(states)
        event = states[0].event
        while True:
            if not event.is_set():
                try:
                    await asyncio.wait_for(event.wait(), self.output_timeout)
                except asyncio.TimeoutError:
                    self.abort_states(states)
                    raise ApiError(f"No output from the scheduler for {self.output_timeout:.0f}s", 504) from None
            event.clear()
            changed = []
            for i, s in enumerate(states):
                if s.version != seen[i]:
                    seen[i] = s.version
                    changed.append(s)
                if s.error is not None:
                    self.abort_states(states)
                    raise s.error
            if changed:
                yield changed
            if all(s.finished for s in states):
                return

    async def wait_all(self, states: Sequence[ReqState]) -> list[ReqState]:
        async for _ in self.updates(states):
            pass
        return list(states)

    def abort_states(self, states: Sequence[ReqState]) -> None:
        """The client is gone: forget the unfinished states and tell the scheduler."""
        for s in states:
            if not s.finished and self._states.pop(s.rid, None) is not None:
                self.migrations.cancel(s.rid)
                s.finish(FinishReason(type="abort", message="client disconnected"))
                self._on_finished(s)
                if self.dead_reason is None:
                    try:
                        self._send(AbortReq(rid=s.rid))
                    except ApiError:
                        pass

    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """/abort_request: finish matching requests as aborted; returns how many."""
        if abort_all:
            matched = list(self._states.values())
        else:
            matched = [s for s in self._states.values() if rid and (s.rid == rid or s.group == rid)]
        self._send(AbortReq(abort_all=True) if abort_all else AbortReq(rid=rid))
        for s in matched:
            if s.rid != rid and not abort_all:
                self._send(AbortReq(rid=s.rid))
            self._states.pop(s.rid, None)
            self.migrations.cancel(s.rid)
            s.finish(FinishReason(type="abort", message="Aborted by /abort_request"))
            self._on_finished(s)
        return len(matched)

    # ------------------------------------------------------------ RPCs

    async def _call(self, msg_type: type, timeout: float, **fields: Any) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._rpcs[call_id] = fut
        try:
            self._send(msg_type(call_id=call_id, **fields))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ApiError(f"The scheduler did not answer {msg_type.__name__} within {timeout:.0f}s", 504) from None
        finally:
            self._rpcs.pop(call_id, None)

    async def switch_mode(self, mode: str, drain: bool, timeout_s: float, flush_cache: bool,
                          handover: bool = False, migrate_to: Sequence[str] = (),
                          migrate_timeout_s: float = 30.0) -> SwitchModeResp:
        """`migrate_to` (decode servers' URLs): drain_policy migrate, running requests move there past timeout_s."""
        if migrate_to:
            self.migrations.set_targets(list(migrate_to))
        wait = timeout_s + (migrate_timeout_s if migrate_to else 0.0) + RPC_TIMEOUT_S
        resp = await self._call(SwitchModeReq, wait, mode=mode, drain=drain, timeout_s=timeout_s,
                                flush_cache=flush_cache, handover=handover, migrate=bool(migrate_to),
                                migrate_timeout_s=migrate_timeout_s)
        self.mode, self.epoch = resp.current_mode, resp.epoch
        return resp

    async def prepare_mode(self, mode: str) -> SwitchModeResp:
        return await self._call(PrepareModeReq, 120.0, mode=mode)

    async def mode_status(self) -> ModeStatusResp:
        return await self._call(ModeStatusReq, RPC_TIMEOUT_S)

    async def load_lora(self, name: str, path: str) -> LoRAResp:
        resp = await self._call(LoadLoRAReq, 120.0, lora_name=name, lora_path=path)
        self.lora_adapters = dict(resp.adapters)
        return resp

    async def unload_lora(self, name: str) -> LoRAResp:
        resp = await self._call(UnloadLoRAReq, RPC_TIMEOUT_S, lora_name=name)
        self.lora_adapters = dict(resp.adapters)
        return resp

    async def flush_cache(self, timeout: float = RPC_TIMEOUT_S) -> FlushCacheResp:
        return await self._call(FlushCacheReq, timeout)

    async def get_stats(self, timeout: float = RPC_TIMEOUT_S) -> StatsResp:
        """Exact: answered after the scheduler's current iteration (seconds under load)."""
        return await self._call(StatsReq, timeout)

    async def latest_stats(self, timeout: float = RPC_TIMEOUT_S) -> tuple[StatsResp, float]:
        """(stats, age in seconds): the latest LoadSnapshot at once, or a StatsReq before the first."""
        self._check_alive()
        if self.load is None:
            return await self.get_stats(timeout), 0.0
        return self.load, time.monotonic() - self.load_at

    async def health_generate(self, timeout: float) -> bool:
        """Run a 1-token greedy generation; True when it finishes within `timeout`."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        ids = [bos] if isinstance(bos, int) and 0 <= bos < self.ready.vocab_size else [0]
        req = GenerateReq(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=ids,
                          sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        states = self.submit([req], internal=True)
        try:
            await asyncio.wait_for(self.wait_all(states), timeout)
        except (asyncio.TimeoutError, ApiError):
            self.abort_states(states)
            return False
        return True
