"""The attention backend interface, and the choice of one (`--attention-backend`).

A backend is what every attention layer calls; the model knows nothing else of it:

- `init_forward_metadata(fb)`: once per pass, before the layers run, whatever every layer of
  the pass reuses (slot tables, masks, block masks), stored in `fb.attn_metadata`;
- `forward(q, k, v, layer_id, fb) -> [T, H * D]`: stores the pass's new K/V at
  `fb.out_cache_loc` in `fb.kv_pool`, then attends q [T, H, D] to each request's KV
  (its positions up to the query's, in `fb.req_to_token`).

Every pass is one `ForwardBatch` (tidal/model/forward_batch.py): decode, prefill on a cached
prefix, a chunk, a mixed batch and speculative verification differ only in their extend and
prefix lengths, so a backend serves them all from those (the flex backend with one mask). A
sliding window or an encoder's bidirectional span is a change of which keys a query sees: a
mask for flex, the mask the torch backend builds.

Backends: `torch` (tidal/model/attention.py, the exact reference: gather + SDPA) and `flex`
(tidal/model/flex_attention.py, PyTorch's FlexAttention over the page table, compiled). `auto`
is torch for now: flex has not been measured faster on a CPU here (issue 67 measures it per CPU).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from tidal.config import ATTENTION_BACKENDS
from tidal.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build what every layer of this pass reuses, in fb.attn_metadata."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """Store k/v at fb.out_cache_loc, then attend: q [T, H, D] -> [T, H * D]."""


def resolve_attention_backend(name: str, device: torch.device) -> tuple[str, str]:
    """(backend, why) for `--attention-backend name` on this device; ValueError for one that cannot run."""
    from tidal.model.flex_attention import flex_available

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "flex":
        missing = flex_available()
        if missing is not None:
            raise ValueError(f"--attention-backend flex: {missing}; use --attention-backend torch")
        return "flex", "asked for"
    if name == "torch":
        return "torch", "asked for"
    return "torch", f"auto on {device.type}: the torch backend (flex is not measured faster here yet)"


def create_attention_backend(name: str, device: torch.device, compile_flex: bool = True) -> AttentionBackend:
    chosen, why = resolve_attention_backend(name, device)
    logger.info("attention backend: %s (%s)", chosen, why)
    if chosen == "flex":
        from tidal.model.flex_attention import FlexAttnBackend

        return FlexAttnBackend(compile=compile_flex)
    from tidal.model.attention import TorchNativeAttnBackend

    return TorchNativeAttnBackend()
