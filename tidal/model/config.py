"""ModelConfig: the architecture facts tidal needs, normalised from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "linear"|"llama3"|"yarn", ...} or None
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    context_length: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    # llama.cpp's precomputed per-frequency divisors (GGUF `rope_freqs.weight`, Llama 3.1+)
    rope_freq_factors: Optional[list[float]] = None
    # per layer, its attention window (a query at position p sees keys in (p - W, p]) or None for full
    # attention; empty: every layer full (Mistral: every layer windowed; Qwen2/3 and Gemma: `layer_types`)
    layer_windows: list[Optional[int]] = field(default_factory=list)
    # the windowed layers' own RoPE (Gemma 3: a local base frequency), else they share the global one
    local_rope_theta: Optional[float] = None
    local_rope_scaling: Optional[dict] = None
    hidden_act: str = "silu"  # the MLP's gate activation
    # Gemma: embeddings scaled by sqrt(hidden); norms on the attention and MLP outputs too ("sandwich");
    # attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
    embed_scale: Optional[float] = None
    sandwich_norms: bool = False
    attn_scale: Optional[float] = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; tidal supports {ARCHS}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r} (supported: {ACTIVATIONS})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        self.local_rope_scaling = normalize_rope_scaling(self.local_rope_scaling)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"a sliding window must be >= 1 token, got {self.layer_windows}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> Optional[int]:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def windows(self) -> set[Optional[int]]:
        """The distinct attention windows of the layers (None: full attention)."""
        return set(self.layer_windows) if self.layer_windows else {None}

    @property
    def o_proj_bias(self) -> bool:
        # Qwen2 puts a bias on q/k/v only; Llama/Qwen3 attention_bias covers o_proj too
        return self.attention_bias and self.arch != "qwen2"


def normalize_rope_scaling(rs: Optional[dict]) -> Optional[dict]:
    """Returns None for plain RoPE, else a dict with a supported "rope_type"."""
    if not rs:
        return None
    rs = dict(rs)
    rope_type = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    rs.pop("type", None)
    rs.pop("rope_theta", None)
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}[rope_type]
    missing = [k for k in required if rs.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} is missing {missing}")
    rs["rope_type"] = rope_type
    return rs


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def config_from_hf(cfg: dict, gen_cfg: Optional[dict] = None) -> ModelConfig:
    """From a parsed config.json (and optional generation_config.json)."""
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None) or HF_MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch is None:
        raise ValueError(f"unsupported model: architectures={archs} model_type={cfg.get('model_type')!r}; tidal "
                         f"serves {sorted(HF_ARCHS)} (model_type {sorted(HF_MODEL_TYPES)})")
    n_heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = _hf_rope(cfg, "full_attention")
    local_theta, local_scaling = _hf_rope(cfg, "sliding_attention") if arch == "gemma3" else (None, None)
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{key}={cfg[key]} (Gemma-2-style logit soft-capping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an encoder) is not supported")
    gemma = arch == "gemma3"
    context = int(cfg.get("max_position_embeddings", 4096))
    eos = _as_id_list((gen_cfg or {}).get("eos_token_id")) or _as_id_list(cfg.get("eos_token_id"))
    return ModelConfig(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=arch in ("qwen3", "gemma3"),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        context_length=context,
        eos_token_ids=eos,
        bos_token_id=(gen_cfg or {}).get("bos_token_id", cfg.get("bos_token_id")),
        layer_windows=hf_layer_windows(cfg, arch),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
        sandwich_norms=gemma,
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma and cfg.get("query_pre_attn_scalar") else None,
    )


def _hf_rope(cfg: dict, layer_type: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) of a layer type. transformers >= 5 writes rope_parameters (rope_theta inside;
    per layer type for Gemma 3); older files use rope_theta + rope_scaling (Gemma 3: rope_local_base_freq)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        params = params.get(layer_type) or {}
    elif layer_type == "sliding_attention":  # an old Gemma 3 file: the local layers run plain RoPE
        return float(cfg.get("rope_local_base_freq", 10000.0)), None
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("llama3", "yarn"):
        scaling = dict(scaling)
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return float(theta), scaling


def hf_layer_windows(cfg: dict, arch: str) -> list[Optional[int]]:
    """Each layer's window, as transformers reads the config: `layer_types` where written; else Mistral
    windows every layer, Qwen2/3 the layers from `max_window_layers` on when `use_sliding_window`, Gemma 3
    all but every `sliding_window_pattern`-th."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if not window:
        return []
    types = cfg.get("layer_types")
    if types is None:
        if arch == "mistral":
            types = ["sliding_attention"] * n
        elif arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            first = cfg.get("max_window_layers", n)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        elif arch == "gemma3":  # older files: every `sliding_window_pattern`-th layer is global
            every = int(cfg.get("sliding_window_pattern", 6))
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        else:
            return []
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)} (supported: sliding_attention, full_attention)")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    windows = [int(window) if t == "sliding_attention" else None for t in types]
    return windows if any(w is not None for w in windows) else []


def _gguf_rope_scaling(meta: dict, a: str) -> Optional[dict]:
    rope_type = meta.get(f"{a}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    rs: dict[str, Any] = {"rope_type": rope_type, "factor": meta.get(f"{a}.rope.scaling.factor")}
    orig = meta.get(f"{a}.rope.scaling.original_context_length")
    if orig is not None:
        rs["original_max_position_embeddings"] = int(orig)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                      ("attn_factor", "attention_factor")):
        if f"{a}.rope.scaling.{key}" in meta:
            rs[name] = float(meta[f"{a}.rope.scaling.{key}"])
    return rs


def config_from_gguf(meta: dict, tensor_names: set[str]) -> ModelConfig:
    """From GGUF key/value metadata (plain Python values) and the set of tensor names."""
    a = meta["general.architecture"]
    if a not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture {a!r}")
    hidden = int(meta[f"{a}.embedding_length"])
    n_heads = int(meta[f"{a}.attention.head_count"])
    head_dim = meta.get(f"{a}.attention.key_length") or meta.get(f"{a}.rope.dimension_count") or hidden // n_heads
    vocab = meta.get(f"{a}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    eos = _as_id_list(meta.get("tokenizer.ggml.eos_token_id"))
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    return ModelConfig(
        arch=a,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{a}.feed_forward_length"]),
        num_layers=int(meta[f"{a}.block_count"]),
        num_heads=n_heads,
        num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv") or n_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta, a),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        context_length=int(meta.get(f"{a}.context_length", 4096)),
        eos_token_ids=eos,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
    )
