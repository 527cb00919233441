"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Gemma 3) over a flat ragged ForwardBatch.

Gemma 3 is this decoder with a few switches (ModelConfig): scaled embeddings, norm weights stored as
offsets from 1 (folded at load), norms on the attention and MLP outputs (GemmaDecoderLayer), a tanh
GELU, an attention scale of its own, and a local RoPE for its sliding-window layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.attention import TorchNativeAttnBackend
from tidal.model.config import ModelConfig
from tidal.model.forward_batch import ForwardBatch
from tidal.model.packed import linear_without_bias
from tidal.parallel.comm import SingleRank
from tidal.parallel.sharding import ModelShard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # like HF: normalise in float32, cast back, then scale
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] (float32) and the cos/sin scale, for the config's RoPE scaling."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors is not None:
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv, 1.0
    if rs["rope_type"] == "linear":
        return inv / rs["factor"], 1.0
    if rs["rope_type"] == "llama3":
        return _llama3_inv_freq(inv, rs), 1.0
    return _yarn_inv_freq(config, rs)


def _llama3_inv_freq(inv: torch.Tensor, rs: dict) -> torch.Tensor:
    factor, old_ctx = rs["factor"], rs["original_max_position_embeddings"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    # long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(in_band, blended, out)


def _yarn_inv_freq(config: ModelConfig, rs: dict) -> tuple[torch.Tensor, float]:
    dim, base, factor = config.head_dim, config.rope_theta, rs["factor"]
    old_ctx = rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            attn_factor = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)

    def correction_dim(n_rot: float) -> float:
        return dim * math.log(old_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """HF-style half rotation: x = [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin]."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config, self.max_positions = config, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build()

    def build(self, device: Optional[torch.device] = None) -> None:
        """(Re)computes the float32 cos/sin cache [P, D/2], e.g. after materialising from meta."""
        device = device if device is not None else self.cos.device
        inv_freq, scale = rope_inv_freq(self.config)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq).to(device)  # [P, D/2]
        self.cos = freqs.cos() * scale
        self.sin = freqs.sin() * scale

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] of the pass's positions, looked up once and shared by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def row_parallel(layer: nn.Linear, x: torch.Tensor, tp) -> torch.Tensor:
    """A linear layer whose input columns are split over ranks: partial products, all-reduced, then the bias."""
    if tp.size == 1:
        return layer(x)
    y = tp.all_reduce(linear_without_bias(layer, x))
    return y if layer.bias is None else y + layer.bias


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, 1, D/2] (HF half rotation), as a new contiguous tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: TorchNativeAttnBackend, shard: ModelShard, tp):
        super().__init__()
        self.layer_id = layer_id
        # the backends scale scores by head_dim ** -0.5: a model with its own scale pre-scales q
        self.q_scale = 1.0 if config.attn_scale is None else config.attn_scale * config.head_dim ** 0.5
        self.n_heads, self.n_kv, self.head_dim = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.tp = [tp]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = [backend]

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n_tok, n_qk = x.shape[0], self.n_heads + self.n_kv
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        v = qkv[:, self.q_size + self.kv_size:].view(n_tok, self.n_kv, self.head_dim)
        if self.q_norm is None:
            # q and k are adjacent columns: one rotation for both heads' groups [T, H + Hkv, D]
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(n_tok, n_qk, self.head_dim), *rope)
            q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(n_tok, self.n_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(n_tok, self.n_kv, self.head_dim))
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = self.backend[0].forward(q, k, v, self.layer_id, fb)  # [T, H*D]
        return row_parallel(self.o_proj, out, self.tp[0])


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: ModelShard, tp):
        super().__init__()
        self.inter = shard.intermediate_size
        self.tp = [tp]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)
        self.act = ACT_FNS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return row_parallel(self.down_proj, self.act(gate) * up, self.tp[0])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: TorchNativeAttnBackend, shard: ModelShard, tp):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, backend, shard, tp)
        self.mlp = LlamaMLP(config, shard, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(rope, self.input_layernorm(h), fb)
        return h + self.mlp(self.post_attention_layernorm(h))


class GemmaDecoderLayer(nn.Module):
    """Gemma's "sandwich": a norm before and after both attention and the MLP (HF's names: its
    post_attention_layernorm is on the attention's output, pre_feedforward_layernorm before the MLP)."""

    def __init__(self, config: ModelConfig, layer_id: int, backend: TorchNativeAttnBackend, shard: ModelShard, tp):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, backend, shard, tp)
        self.mlp = LlamaMLP(config, shard, tp)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(h), fb))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchNativeAttnBackend, max_positions: int,
                 shard: ModelShard, tp):
        super().__init__()
        self.shard, self.tp = shard, tp
        self.embed_tokens = nn.Embedding(shard.vocab_per_rank, config.hidden_size)
        # Gemma's sqrt(hidden), rounded to the activations' dtype first as transformers does; per dtype ahead
        # of time (a tensor -> float inside the compiled step would break its graph)
        self.embed_scales = None if config.embed_scale is None else {
            dt: float(torch.tensor(config.embed_scale, dtype=dt, device="cpu"))
            for dt in (torch.float32, torch.bfloat16, torch.float16)}
        self.rotary = RotaryEmbedding(config, max_positions)
        # Gemma 3's windowed layers rotate with their own base frequency
        self.local_rotary = None
        if config.local_rope_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.local_rope_theta,
                                        rope_scaling=config.local_rope_scaling)
            self.local_rotary = RotaryEmbedding(local, max_positions)
        self.local_layers = [self.local_rotary is not None and config.window(i) is not None
                             for i in range(config.num_layers)]
        layer_cls = GemmaDecoderLayer if config.sandwich_norms else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_cls(config, i, backend, shard, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(ids)
        local = ids - self.shard.vocab_start  # this rank holds rows [start, start + per_rank)
        mine = (local >= 0) & (local < self.shard.vocab_per_rank)
        h = self.embed_tokens(local.clamp(0, self.shard.vocab_per_rank - 1))
        return self.tp.all_reduce(h.masked_fill(~mine[:, None], 0.0))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed(fb.input_ids)
        if self.embed_scales is not None:
            h = h * self.embed_scales[h.dtype]
        rope = self.rotary.cos_sin(fb.positions, h.dtype)
        local = self.local_rotary.cos_sin(fb.positions, h.dtype) if self.local_rotary is not None else rope
        for layer, is_local in zip(self.layers, self.local_layers):
            h = layer(local if is_local else rope, h, fb)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """forward(fb) -> final-normed hidden [T, hidden]; compute_logits(hidden [N, hidden]) -> float32 [N, vocab]."""

    def __init__(self, config: ModelConfig, attn_backend: Optional[TorchNativeAttnBackend] = None,
                 max_positions: Optional[int] = None, tp=None):
        super().__init__()
        self.config = config
        self.tp = tp or SingleRank()
        self.shard = ModelShard.of(config, self.tp.rank, self.tp.size)
        self.attn_backend = attn_backend or TorchNativeAttnBackend()
        self.attn_backend.layer_windows = list(config.layer_windows)
        self.model = LlamaModel(config, self.attn_backend, max_positions or config.context_length, self.shard, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, self.shard.vocab_per_rank, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.attn_metadata is None:
            self.attn_backend.init_forward_metadata(fb)
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.config.vocab_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors, fusing q/k/v into qkv_proj and gate/up into gate_up_proj."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        norm_offset = 1.0 if self.config.sandwich_norms else 0.0  # Gemma stores its norm weights as w - 1
        for name, w in weights:
            if norm_offset and name.endswith("norm.weight"):
                w = w.float() + norm_offset
            w = self.shard.take(name, w, self.config.head_dim)
            target, offset = self._fused_target(name)
            if target not in params:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue  # some checkpoints store the tied copy too
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            p = params[target]
            dst = p.data if offset is None else p.data.narrow(0, offset, w.shape[0])
            if dst.shape != w.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != model shape {tuple(dst.shape)}")
            dst.copy_(w)
            loaded.add(f"{target}@{offset}")
        self._check_complete(loaded)

    def _fused_target(self, name: str) -> tuple[str, Optional[int]]:
        """Maps an HF parameter name to (our parameter name, row offset inside a fused one)."""
        q, kv, inter = self._local_sizes()
        for part, offset in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
            if f".self_attn.{part}." in name:
                return name.replace(part, "qkv_proj"), offset
        for part, offset in (("gate_proj", 0), ("up_proj", inter)):
            if f".mlp.{part}." in name:
                return name.replace(part, "gate_up_proj"), offset
        return name, None

    def fuse_int4(self, parts: dict) -> dict:
        """HF-named Int4Weights -> our fused parameter names; a fused layer needs all its parts in int4."""
        from tidal.model.quant import Int4Weight

        grouped: dict[str, list[tuple[int, Int4Weight]]] = {}
        for name, w in parts.items():
            target, offset = self._fused_target(name)
            grouped.setdefault(target, []).append((offset or 0, w))
        fused = {}
        params = dict(self.named_parameters())
        for target, items in grouped.items():
            rows = sum(w.codes.shape[0] for _, w in items)
            if target in params and rows == params[target].shape[0]:
                fused[target] = Int4Weight.cat([w for _, w in sorted(items, key=lambda i: i[0])])
        return fused

    def _local_sizes(self) -> tuple[int, int, int]:
        """This rank's q rows, k (= v) rows and intermediate size."""
        s, d = self.shard, self.config.head_dim
        return s.num_heads * d, s.num_kv_heads * d, s.intermediate_size

    def _check_complete(self, loaded: set[str]) -> None:
        expected: set[str] = set()
        q, kv, inter = self._local_sizes()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                expected |= {f"{name}@{o}" for o in (0, q, q + kv)}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}@{o}" for o in (0, inter)}
            else:
                expected.add(f"{name}@None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
