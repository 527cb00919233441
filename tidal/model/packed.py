"""Dense linear layers with their weights reordered once into oneDNN's blocked layout (`--weight-prepack`).

`F.linear` on a CPU hands oneDNN (or MKL) a plain row-major weight on every call, and for
bfloat16 oneDNN reorders it into its blocked layout each time: for a decode step's small
activations that reorder costs as much as the matmul. PyTorch's mkldnn ops take the weight
reordered once at load (`mkldnn._reorder_linear_weight`) and multiply with it directly
(`mkldnn._linear_pointwise`), the same oneDNN matmuls vLLM's CPU backend runs. Measured on a
2-core AMD EPYC with AVX512-BF16 (SmolLM2-135M shapes, 2 threads, docs/benchmarks.md section 28):
1.2-4x faster than `F.linear` in bfloat16 from 1 to 128 rows, and faster than torch's int4/int8
weight-only kernels from 2 rows up.

The packed tensor is an opaque MKLDNN tensor: it cannot be sliced, shared with another layer or
moved. Under torch.compile inductor needs it as a graph constant, which its freezing mode gives
(`tidal/model/compiled.py` turns freezing on). Only 2-D float weights on the CPU are packed.
"""

from __future__ import annotations

from typing import Optional

import functools

import torch
import torch.nn.functional as F
from torch import nn


def prepack_available(dtype: torch.dtype = torch.float32) -> bool:
    """This torch has oneDNN and the mkldnn linear ops, and this CPU can reorder `dtype` weights.

    oneDNN reorders bfloat16 weights only with AVX512BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU
    cannot); that is probed, once per dtype, not inferred from the CPU's name.
    """
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return _reorders(dtype)


@functools.cache
def _reorders(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] reordered into oneDNN's layout (an MKLDNN tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with W packed by pack_weight; x is cast to the weight's dtype and back."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != packed.dtype:
        x2 = x2.to(packed.dtype)
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")
    return y.view(*lead, out_features).to(x.dtype)


class PackedLinear(nn.Module):
    """nn.Linear's y = x @ W^T + b with W prepacked (the plain weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_weight(weight))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.out_features, self.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T without the bias (a row-parallel layer adds it after its all-reduce)."""
        return packed_linear(x, self.packed, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, oneDNN prepacked"


def linear_without_bias(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T of an nn.Linear or a PackedLinear."""
    if isinstance(layer, PackedLinear):
        return layer.matmul(x)
    return F.linear(x, layer.weight)


def prepack_model(model: nn.Module) -> int:
    """Swaps every float nn.Linear for a PackedLinear and packs the dense copies that quantized layers keep.

    Returns how many weights were packed. A tied LM head gets its own packed copy (the embedding
    table stays as it is).
    """
    from tidal.model.quant import Int4Linear, Int8Linear, _replace

    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module.weight.is_floating_point() and module.weight.device.type == "cpu":
            bias = None if module.bias is None else module.bias.data
            _replace(model, name, PackedLinear(module.weight.data, bias))
            count += 1
        elif isinstance(module, (Int4Linear, Int8Linear)) and module.has_dense():
            module.pack_dense()
            count += 1
    return count
