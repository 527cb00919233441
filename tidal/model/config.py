"""ModelConfig: the architecture facts tidal needs, normalised from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

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

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; tidal supports {ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(cfg.get("model_type", ""))
    if arch is None:
        raise ValueError(f"unsupported model: architectures={archs} model_type={cfg.get('model_type')!r}")
    n_heads = cfg["num_attention_heads"]
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older files use rope_theta + rope_scaling
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling") or rope_params or None
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("llama3", "yarn"):
        rope_scaling = dict(rope_scaling)
        rope_scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    context = int(cfg.get("max_position_embeddings", 4096))
    windowed = arch == "mistral" or (arch == "qwen2" and cfg.get("use_sliding_window"))
    if windowed and cfg.get("sliding_window"):
        # sliding-window attention is not implemented: stay inside the window, where it is exact
        context = min(context, int(cfg["sliding_window"]))
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
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        context_length=context,
        eos_token_ids=eos,
        bos_token_id=(gen_cfg or {}).get("bos_token_id", cfg.get("bos_token_id")),
    )


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
