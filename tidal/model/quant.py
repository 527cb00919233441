"""Serving a GGUF's quantized tensors natively: weight-only int4 matmuls instead of dequantized floats.

A decode step of a small model on a CPU reads every weight once per token, so it is bound
by memory bandwidth: 4-bit weights are ~7x fewer bytes than float32. torch's CPU kernel
`_weight_int4pack_mm_for_cpu` computes x @ W^T with W stored as packed 4-bit codes and a
(scale, zero) pair per group of 32 input columns: w = (q - 8) * scale + zero. GGUF's
blocks are groups of 32 too, so they map onto it without requantizing:

    Q4_0: w = (q - 8) * d        -> scale d, zero 0
    Q4_1: w = q * d + m          -> scale d, zero m + 8 d

The kernel is vectorized for bfloat16 activations only (float32/float16 run a scalar loop
~15x slower, measured on AVX2), so activations are rounded to bfloat16 at the matmul and
its output comes back as bfloat16 (rounded); scales and zeros are bfloat16 too. That is the
whole numerical difference from the float32 path (llama.cpp itself rounds activations to
8-bit integers for these dot products). The quality bound is in tests/test_quantization.py.

The LM head (49152 x 576 in SmolLM2, the largest single matmul of a decode step; Q8_0 in
the file, with a scale per 32 columns that torch's int8 kernel cannot take) runs as int8
with one scale per row, requantized at load: `_weight_int8pack_mm` with bfloat16
activations read it 2.3x faster than float32 (bfloat16 dense: 1.5x). `w8a16` applies the
same per-row int8 form to every linear layer of any checkpoint.

Each quantized layer also keeps a dense copy of the same (dequantized) weights in the
model dtype, used for passes with more than `max_quant_tokens` tokens: the int4 kernel
does one pass over the weights per activation row, so prefill and large decode batches are
compute-bound and faster on a dense BLAS matmul. With max_quant_tokens = 0 no dense copy is
kept (less memory; every pass runs the int4 kernel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

from tidal.config import QUANTIZATIONS
GGUF_GROUP = 32
# GGUF tensor types served natively (others are dequantized to the model dtype)
NATIVE_GGUF_TYPES = ("Q4_0", "Q4_1")


@dataclass
class Int4Weight:
    """Group-wise 4-bit weight [rows, cols]: w = (codes - 8) * scale + zero per group of 32 columns."""

    codes: torch.Tensor  # uint8 [rows, cols], values 0..15
    scale: torch.Tensor  # float32 [rows, cols // 32]
    zero: torch.Tensor  # float32 [rows, cols // 32]

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        q = self.codes.view(rows, cols // GGUF_GROUP, GGUF_GROUP).float()
        w = (q - 8) * self.scale[..., None] + self.zero[..., None]
        return w.view(rows, cols)

    def rows(self, index) -> "Int4Weight":
        return Int4Weight(self.codes[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))


def int4_from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Weight:
    """GGUF Q4_0/Q4_1 block bytes [rows, blocks * block_bytes] -> Int4Weight [rows, cols] (exact)."""
    rows, cols = shape
    nb = cols // GGUF_GROUP
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_0":
        qs, zero = blocks[..., 2:18], np.zeros_like(d)
    elif type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs, zero = blocks[..., 4:20], m + 8 * d
    else:
        raise ValueError(f"GGUF type {type_name} has no native int4 kernel")
    # byte j of a block holds element j (low nibble) and element j + 16 (high nibble)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def int4_kernel_available() -> bool:
    return all(hasattr(torch.ops.aten, op) for op in ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"))


class Int4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W as packed int4 groups; a dense copy serves passes over max_quant_tokens."""

    def __init__(self, weight: Int4Weight, bias: Optional[torch.Tensor], dense: Optional[torch.Tensor],
                 max_quant_tokens: int):
        super().__init__()
        rows, cols = weight.codes.shape
        self.in_features, self.out_features = cols, rows
        self.max_quant_tokens = max_quant_tokens if dense is not None else None
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.codes.to(torch.int32).contiguous(), 1))
        # [cols / 32, rows, 2]: the kernel's layout of (scale, zero) per group and output row
        sz = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)
        self.register_buffer("scale_zero", sz.to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dense = None if dense is None else nn.Parameter(dense, requires_grad=False)
        self.register_buffer("dense_packed", None)  # pack_dense's

    def has_dense(self) -> bool:
        return self.dense is not None

    def pack_dense(self) -> None:
        """The dense copy reordered into oneDNN's layout (tidal/model/packed.py); the plain one is dropped."""
        from tidal.model.packed import pack_weight

        packed = pack_weight(self.dense.data)
        self.dense = None
        self.dense_packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_quant_tokens is not None and x.shape[0] > self.max_quant_tokens:
            return _dense(x, self.dense, self.dense_packed, self.out_features, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GGUF_GROUP, self.scale_zero).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dense above {self.max_quant_tokens} tokens"


class Int8Linear(nn.Module):
    """Weight-only int8 with one scale per output row (symmetric), bf16 activations at the kernel.

    Built from float weights: w ~ q * scale[row], q = round(w / scale), scale = max|w[row]| / 127.
    A dense copy (the float weights) serves passes over max_quant_tokens, as in Int4Linear.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], max_quant_tokens: int,
                 keep_dense: bool):
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.out_features, self.in_features = w.shape
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # a list: often the tied embedding, which must not be registered (and counted) twice
        self.dense = [weight] if keep_dense and max_quant_tokens else None
        self.max_quant_tokens = max_quant_tokens if self.dense is not None else None
        self.register_buffer("dense_packed", None)  # pack_dense's

    def has_dense(self) -> bool:
        return self.dense is not None

    def pack_dense(self) -> None:
        """The dense copy in oneDNN's layout: its own tensor (a tied embedding stays as it is)."""
        from tidal.model.packed import pack_weight

        packed = pack_weight(self.dense[0])
        self.dense = None
        self.dense_packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_quant_tokens is not None and x.shape[0] > self.max_quant_tokens:
            return _dense(x, None if self.dense is None else self.dense[0], self.dense_packed, self.out_features,
                          self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dense above {self.max_quant_tokens} tokens"


def _dense(x: torch.Tensor, plain: Optional[torch.Tensor], packed: Optional[torch.Tensor], out_features: int,
           bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A quantized layer's large passes: its dense copy, plain or prepacked."""
    if packed is not None:
        from tidal.model.packed import packed_linear

        return packed_linear(x, packed, out_features, bias)
    return F.linear(x, plain, bias)


def resolve_quantization(name: str, model_kind: str, dtype_arg: str, device: torch.device,
                         tp_size: int) -> str:
    """'gguf', 'w8a16' or 'none' (every weight dequantized to the model dtype).

    auto: gguf for a GGUF model on the CPU unless --dtype float32 was asked for (the exact path).
    """
    if name not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, got {name!r}")
    if name == "none":
        return "none"
    kernels = device.type == "cpu" and tp_size == 1 and int4_kernel_available()
    if name == "auto":
        return "gguf" if kernels and model_kind == "gguf" and dtype_arg != "float32" else "none"
    why = ("it runs on the CPU only" if device.type != "cpu" else
           "not with --tp > 1 yet" if tp_size != 1 else
           "this torch has no int4/int8 CPU kernels" if not kernels else
           "the model is not a GGUF file" if name == "gguf" and model_kind != "gguf" else None)
    if why:
        raise ValueError(f"--quantization {name}: {why}")
    return name


def quantize_model(model: nn.Module, int4: dict[str, Int4Weight], max_quant_tokens: int) -> dict[str, int]:
    """Swaps the model's linear layers whose checkpoint tensors were int4 for Int4Linear, the LM head for Int8Linear.

    int4: our parameter name (e.g. model.layers.0.self_attn.qkv_proj.weight) -> its fused Int4Weight.
    Returns counts of what was converted, for the start-up log.
    """
    counts = {"int4": 0, "int8": 0}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        key = f"{name}.weight"
        if key in int4:
            dense = module.weight.data if max_quant_tokens else None
            bias = None if module.bias is None else module.bias.data
            _replace(model, name, Int4Linear(int4[key], bias, dense, max_quant_tokens))
            counts["int4"] += 1
        elif name == "lm_head":
            _replace(model, name, Int8Linear(module.weight.data, None, max_quant_tokens, keep_dense=True))
            counts["int8"] += 1
    return counts


def quantize_model_w8a16(model: nn.Module, max_quant_tokens: int) -> dict[str, int]:
    """Every linear layer (LM head included) as per-row int8 weights made from the loaded float ones."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            bias = None if module.bias is None else module.bias.data
            _replace(model, name, Int8Linear(module.weight.data, bias, max_quant_tokens, keep_dense=True))
            count += 1
    return {"int8": count}


def _replace(model: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
