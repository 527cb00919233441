"""Typed messages between the API process and the scheduler (msgspec over ZMQ).

Every message is a tagged msgspec.Struct; a socket carries the Union of the
messages its receiver accepts, so decoding yields the concrete type.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from tidal.sampling_params import SamplingParams


class _Msg(msgspec.Struct, tag=True, kw_only=True):
    pass


# ---------------------------------------------------------------- API -> scheduler


class GenerateReq(_Msg):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs; k: prompt logprobs from position k
    top_logprobs_num: int = 0
    arrival_time: float = 0.0
    priority: Optional[int] = None  # --enable-priority-scheduling; None counts as 0
    # prefill/decode pairing, injected by the router (SGLang's field names)
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    # set by tidal's router (X-Tidal-Expected-Mode): refuse with 409 if this server is elsewhere
    expected_mode: Optional[str] = None
    expected_epoch: Optional[int] = None
    # --is-embedding servers: prefill only, the pooled hidden state comes back in ReqOutput.embedding
    embedding: bool = False
    # the LoRA adapter to run this request with (SGLang's lora_path: a loaded adapter's name); None: the base model
    lora_name: Optional[str] = None


class AbortReq(_Msg):
    rid: str = ""
    abort_all: bool = False


class CancelMigrationReq(_Msg):
    """The API process could not hand a migrating request to its new server: it goes on decoding here."""

    rid: str
    reason: str = ""


class FlushCacheReq(_Msg):
    call_id: int


class StatsReq(_Msg):
    call_id: int


class SwitchModeReq(_Msg):
    call_id: int
    mode: str
    drain: bool = False
    timeout_s: float = 30.0
    flush_cache: bool = True
    handover: bool = False  # decode -> prefill / null, null -> prefill: serve the new role at once, finish the old's
    # drain_policy migrate: past timeout_s, running requests move to another decode server (tidal/roles/migration.py);
    # what is still here migrate_timeout_s later fails the switch
    migrate: bool = False
    migrate_timeout_s: float = 30.0


class PrepareModeReq(_Msg):
    call_id: int
    mode: str


class ModeStatusReq(_Msg):
    call_id: int


class LoadLoRAReq(_Msg):
    call_id: int
    lora_name: str
    lora_path: str


class UnloadLoRAReq(_Msg):
    call_id: int
    lora_name: str


ToScheduler = Union[GenerateReq, AbortReq, CancelMigrationReq, FlushCacheReq, StatsReq, SwitchModeReq, PrepareModeReq, ModeStatusReq,
                    LoadLoRAReq, UnloadLoRAReq]


# ---------------------------------------------------------------- scheduler -> API


class FinishReason(msgspec.Struct, omit_defaults=True):
    """SGLang's finish_reason object: type stop | length | abort."""

    type: str
    matched: Union[int, str, None] = None
    length: Optional[int] = None
    message: Optional[str] = None
    status_code: Optional[int] = None

    def to_json(self) -> dict:
        return msgspec.to_builtins(self)


class MigrationTicket(msgspec.Struct, omit_defaults=True):
    """A request moving to another decode server with its KV (tidal/roles/migration.py).

    `offer`: its KV (`kv_tokens`: the prompt and every output token but the last) waits for that server
    behind the bootstrap server at host:port, room `bootstrap_room`; the API process sends the request
    there and relays its output. `done`: the KV arrived, the request is gone from here, what the relay
    received is the request's output. `failed`: the request goes on here; the relay's output is dropped.
    """

    state: str  # offer | done | failed
    cause: str = "switch"  # switch (drain_policy migrate) | retract (--retraction-migrate-to)
    bootstrap_host: str = ""
    bootstrap_port: int = 0
    bootstrap_room: int = 0
    kv_tokens: int = 0
    message: str = ""


class ReqOutput(msgspec.Struct, kw_only=True, array_like=True):
    """Incremental output of one request since the previous ReqOutput for it."""

    rid: str
    new_token_ids: list[int]
    finish_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # logprobs, only when requested: (logprob, token_id) and top-k lists of the same
    output_logprobs: Optional[list[tuple[float, int]]] = None
    output_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    input_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    embedding: Optional[list[float]] = None  # an embedding request's pooled vector (final output only)
    migration: Optional[MigrationTicket] = None  # the request is moving to another server (after these tokens)


class BatchOut(_Msg):
    outputs: list[ReqOutput]


class SchedulerReady(_Msg):
    max_total_tokens: int
    max_running_requests: int
    max_req_input_len: int
    context_length: int
    vocab_size: int
    page_size: int
    device: str
    dtype: str
    quantization: str = "none"  # "gguf": the file's int4 weights run natively (tidal/model/quant.py)
    torch_threads: int = 0  # per rank
    cpu_affinity: list[str] = []  # each rank's CPUs, in rank order ("0-3")
    pooling: str = ""  # --is-embedding: how embeddings are pooled (tidal/model/pooling.py)
    hidden_size: int = 0
    lora_enabled: bool = False
    lora_adapters: dict[str, str] = {}  # loaded LoRA adapters at start: name -> path
    kv_events: dict[str, Any] = {}  # --kv-events-config: where to subscribe (tidal.kvevents.publisher.KVEvents.info)


class FlushCacheResp(_Msg):
    call_id: int
    success: bool
    message: str = ""


class StatsResp(_Msg):
    call_id: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_tokens: int
    token_usage: float
    cache_hit_rate: float
    gen_throughput: float
    num_retracted_total: int
    num_prefill_batches: int
    num_decode_batches: int
    max_decode_batch_size: int
    total_prompt_tokens: int
    total_cached_tokens: int
    disaggregation_mode: str = "null"
    epoch: int = 0
    handing_over_from: str = ""  # during a handover: the role whose requests it still finishes ("" otherwise)
    queue_sizes: dict[str, int] = {}
    num_overlapped_batches: int = 0  # decode passes launched while the previous one ran
    # speculative decoding (tidal/spec.speculator.Speculator.stats); zeros without it
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accept_length: float = 0.0  # tokens gained per request and verification pass (>= 1)
    spec_accept_rate: float = 0.0  # guesses kept / guesses made
    # KV transfer (prefill/decode roles): counters and a latency histogram {le: count}
    transfer_bytes: int = 0
    transfer_succeeded: int = 0
    failed_bootstraps: int = 0
    failed_transfers: int = 0
    transfer_latency_histogram: dict[str, int] = {}
    transfer_latency_sum: float = 0.0
    num_migrated_total: int = 0  # requests that moved to another server with their KV (tidal/roles/migration.py)
    queued_prefill_tokens: int = 0  # prompt tokens waiting for prefill (waiting queue, chunk left, role queues)
    # requests in the running batch: num_running_reqs also counts those that only hold KV (a decode
    # server's PD requests still waiting for their prefill's KV)
    num_decoding_reqs: int = 0
    # the prompt tokens of the num_waiting_reqs requests (whole prompts): with it, their mean prompt length
    waiting_prompt_tokens: int = 0


class LoadSnapshot(_Msg):
    """Unsolicited StatsResp (call_id 0) that rank 0 pushes between iterations, at most every
    LOAD_SNAPSHOT_INTERVAL_S: /get_load and /metrics answer from the latest one at once,
    even while one iteration runs for seconds (a StatsReq waits for the next iteration)."""

    stats: StatsResp


class SwitchModeResp(_Msg):
    call_id: int
    status_code: int
    status: str
    message: str
    current_mode: str
    epoch: int
    timings_ms: dict[str, float] = {}
    migrated: int = 0  # drain_policy migrate: requests offered to other servers during the drain


class ModeStatusResp(_Msg):
    call_id: int
    current_mode: str
    transition_state: str
    target_mode: Optional[str]
    epoch: int
    last_error: Optional[str]
    initialized_roles: list[str]
    queue_sizes: dict[str, int]
    last_switch_timings_ms: dict[str, float]
    enabled: bool


class LoRAResp(_Msg):
    """Answer to LoadLoRAReq / UnloadLoRAReq; `adapters` is every adapter loaded after it (name -> path)."""
    call_id: int
    success: bool
    status_code: int = 200
    message: str = ""
    adapters: dict[str, str] = {}


class SchedulerError(_Msg):
    message: str


ToApi = Union[BatchOut, SchedulerReady, FlushCacheResp, StatsResp, LoadSnapshot, SchedulerError, SwitchModeResp,
              ModeStatusResp, LoRAResp]

_encoder = msgspec.msgpack.Encoder()
_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_to_api = msgspec.msgpack.Decoder(ToApi)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _to_scheduler.decode(data)


def decode_to_api(data: bytes) -> ToApi:
    return _to_api.decode(data)
