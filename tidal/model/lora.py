"""Multi-LoRA serving: PEFT adapters applied per request inside one shared forward pass.

Every targeted projection becomes a LoRALinear: the base layer (dense, int4 or int8, whatever
the model holds) runs once over the whole batch, then each token gets its own adapter's
`scale * (x @ A^T) @ B^T` added. Nothing is merged into the base weights, and rows of requests
without an adapter get exactly nothing added.

Our model fuses q/k/v into qkv_proj and gate/up into gate_up_proj, so an adapter's parts of
one fused layer are stacked: A = [A_q; A_k; A_v] ([r_q + r_k + r_v, in]) and B is block
diagonal ([out, r_q + r_k + r_v]; each part's rows of the output see only its own rank columns),
with the part's scale folded into its B block. A part the adapter does not target is absent
from A and zero in B.

A pass with several adapters stacks them once more: A_all = [A_1; A_2; ...], B_all = [B_1 B_2 ...]
(cached per set of adapters), and a [T, R_tot] 0/1 mask keeps for each token only its adapter's
rank columns: delta = ((x @ A_all^T) * mask) @ B_all^T. That is three ops per layer however many
adapters share the batch (a loop of per-adapter gathers, matmuls and index_add_ cost about twice
as much at decode, docs/benchmarks.md section 14),
at the price of computing every token against every adapter's A (R_tot is small next to the
base layer's width).

All loaded adapters stay resident (they are small next to the model); --max-loras-per-batch
limits how many distinct adapters one batch may hold (the scheduler enforces it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from tidal.config import LORA_TARGET_MODULES
from tidal.model.lora_config import target_modules

logger = logging.getLogger(__name__)

STACK_CACHE_SIZE = 8  # sets of adapters whose stacked weights are kept (a running batch's set rarely changes)

# our (fused) module -> the PEFT module names it holds, in row order
FUSED_PARTS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
_PEFT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be loaded here (a client error: HTTP 400)."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    targets: tuple[str, ...]  # PEFT module names present in the weights
    # (layer, our module) -> (A [R, in], B [out, R] with the scale folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    widths: dict[str, int] = field(default_factory=dict)  # our module -> R (the same in every layer)


def read_adapter_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"{path!r} is not a PEFT adapter directory (no adapter_config.json)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = [("use_dora", cfg.get("use_dora")), ("rank_pattern", cfg.get("rank_pattern")),
                   ("alpha_pattern", cfg.get("alpha_pattern")), ("modules_to_save", cfg.get("modules_to_save")),
                   ("bias", cfg.get("bias", "none") != "none")]
    bad = [k for k, v in unsupported if v]
    if bad:
        raise LoRAError(f"{path}: adapter options not supported: {bad}")
    return cfg


def adapter_scale(cfg: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise LoRAError(f"{path}: no adapter_model.safetensors")
    return load_file(file)


def _group_by_module(tensors: dict[str, torch.Tensor], path: str) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, PEFT module): {"A": ..., "B": ...}}; anything else in the file is refused."""
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PEFT_KEY.search(key)
        if m is None or m.group(3) not in LORA_TARGET_MODULES:
            raise LoRAError(f"{path}: tensor {key!r} is not a LoRA weight of {', '.join(LORA_TARGET_MODULES)}")
        parts.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
    return parts


class ModuleShapes:
    """Input/output sizes of each PEFT module in this model (per layer they are all the same)."""

    def __init__(self, model: nn.Module):
        cfg = model.config
        q, kv, inter = model._local_sizes()
        h = cfg.hidden_size
        self.num_layers = cfg.num_layers
        self.out = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": inter, "up_proj": inter,
                    "down_proj": h}
        self.inp = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q, "gate_proj": h, "up_proj": h,
                    "down_proj": inter}


def load_adapter(name: str, path: str, shapes: ModuleShapes, dtype: torch.dtype, device: torch.device,
                 max_rank: Optional[int], allowed: tuple[str, ...]) -> LoRAAdapter:
    cfg = read_adapter_config(path)
    scale = adapter_scale(cfg)
    parts = _group_by_module(_read_tensors(path), path)
    if not parts:
        raise LoRAError(f"{path}: the adapter has no LoRA weights")
    rank = 0
    for (layer, mod), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{path}: layer {layer} {mod} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        if layer >= shapes.num_layers or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] \
                or tuple(a.shape[1:]) != (shapes.inp[mod],) or b.shape[0] != shapes.out[mod]:
            raise LoRAError(f"{path}: layer {layer} {mod}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not "
                            f"fit this model ({shapes.inp[mod]} -> {shapes.out[mod]}, {shapes.num_layers} layers)")
        rank = max(rank, a.shape[0])
    targets = tuple(m for m in LORA_TARGET_MODULES if any(m == mod for _, mod in parts))
    if max_rank is not None and rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    outside = [m for m in targets if m not in allowed]
    if outside:
        raise LoRAError(f"adapter {name!r} targets {outside}, outside --lora-target-modules {list(allowed)}")
    adapter = LoRAAdapter(name, path, rank, targets)
    for layer in range(shapes.num_layers):
        for ours, peft_names in FUSED_PARTS.items():
            fused = _fuse(layer, peft_names, parts, shapes, scale)
            if fused is not None:
                adapter.weights[(layer, ours)] = tuple(t.to(device=device, dtype=dtype).contiguous() for t in fused)
    _pad_widths(adapter)
    return adapter


def _pad_widths(adapter: LoRAAdapter) -> None:
    """One rank width per module across layers (zero-padded), so a pass's column layout fits every layer."""
    for (_, module), (a, _) in adapter.weights.items():
        adapter.widths[module] = max(adapter.widths.get(module, 0), a.shape[0])
    for key, (a, b) in adapter.weights.items():
        pad = adapter.widths[key[1]] - a.shape[0]
        if pad:
            adapter.weights[key] = (torch.cat([a, a.new_zeros(pad, a.shape[1])]),
                                    torch.cat([b, b.new_zeros(b.shape[0], pad)], dim=1))


def _fuse(layer: int, peft_names: tuple[str, ...], parts: dict, shapes: ModuleShapes,
          scale: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Stacked A and block-diagonal scaled B of one fused module, or None if the adapter skips it."""
    present = [(n, parts[(layer, n)]) for n in peft_names if (layer, n) in parts]
    if not present:
        return None
    a = torch.cat([ab["A"].float() for _, ab in present])
    out_rows = sum(shapes.out[n] for n in peft_names)
    b = torch.zeros(out_rows, a.shape[0])
    row = col = 0
    for n in peft_names:
        if (layer, n) in parts:
            part_b = parts[(layer, n)]["B"].float()
            b[row:row + part_b.shape[0], col:col + part_b.shape[1]] = part_b * scale
            col += part_b.shape[1]
        row += shapes.out[n]
    return a, b


@dataclass
class LoRAPass:
    """The adapters of one forward pass, stacked: per layer module, A_all [R_tot, in] and B_all [out, R_tot]
    (the adapters' blocks side by side, zeros where one skips the module), and per module name a
    [T, R_tot] 0/1 mask of the rank columns each token's adapter owns."""

    stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    masks: dict[str, torch.Tensor]


def stack_adapters(adapters: list[LoRAAdapter]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Per (layer, module) that any of them targets: the adapters' A and B blocks side by side, in order."""
    keys = {k for a in adapters for k in a.weights}
    stacks = {}
    for key in keys:
        some_a, some_b = next(a.weights[key] for a in adapters if key in a.weights)
        a_parts, b_parts = [], []
        for ad in adapters:
            width = ad.widths.get(key[1], 0)
            a, b = ad.weights.get(key, (some_a.new_zeros(width, some_a.shape[1]), some_b.new_zeros(some_b.shape[0], width)))
            a_parts.append(a)
            b_parts.append(b)
        stacks[key] = (torch.cat(a_parts).contiguous(), torch.cat(b_parts, dim=1).contiguous())
    return stacks


def column_masks(adapters: list[LoRAAdapter], rows: list[torch.Tensor], num_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Per module name, [T, R_tot]: 1 where token t belongs to the adapter owning rank column r."""
    masks = {}
    for module in FUSED_PARTS:
        widths = [ad.widths.get(module, 0) for ad in adapters]
        if not any(widths):
            continue
        mask = torch.zeros(num_tokens, sum(widths), dtype=dtype, device=device)
        col = 0
        for r, w in zip(rows, widths):
            mask[r, col:col + w] = 1
            col += w
        masks[module] = mask
    return masks


class LoRALinear(nn.Module):
    """base(x) plus, for each token, its adapter's delta: ((x @ A_all^T) * mask) @ B_all^T, three ops
    however many adapters the pass holds (the mask zeroes the other adapters' rank columns)."""

    def __init__(self, base: nn.Module, layer: int, module: str, state: "LoRAManager"):
        super().__init__()
        self.base = base
        self.key = (layer, module)
        self.state = [state]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        lora = self.state[0].current()
        if lora is None:
            return y
        w = lora.stacks.get(self.key)
        if w is None:
            return y
        a, b = w
        h = (x @ a.t()).mul_(lora.masks[self.key[1]])
        return torch.addmm(y, h, b.t())


class LoRAManager:
    """Loaded adapters by name, the wrapped layers, and the segments of the pass being run."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, max_rank: Optional[int],
                 targets: tuple[str, ...], max_loras_per_batch: int):
        self.dtype, self.device = dtype, device
        self.shapes = ModuleShapes(model)
        self.max_rank = max_rank
        self.targets = targets
        self.max_loras_per_batch = max_loras_per_batch
        self.adapters: dict[str, LoRAAdapter] = {}
        self._local = threading.local()  # the pass being run, for the thread running it
        self._stacks: dict[tuple[str, ...], dict] = {}  # stacked weights per set of adapters, recent ones
        self._wrap(model)

    @classmethod
    def from_args(cls, args, model: nn.Module, dtype: torch.dtype, device: torch.device) -> "LoRAManager":
        """Loads --lora-paths; the rank limit and targets default to what those adapters need."""
        initial = args.lora_adapters
        shapes = ModuleShapes(model)
        everything = LORA_TARGET_MODULES
        loaded = {n: load_adapter(n, p, shapes, dtype, device, args.max_lora_rank,
                                  target_modules(args.lora_target_modules) or everything)
                  for n, p in initial.items()}
        max_rank = args.max_lora_rank or (max(a.rank for a in loaded.values()) if loaded else None)
        if args.lora_target_modules:
            targets = target_modules(args.lora_target_modules)
        elif loaded:
            targets = tuple(m for m in everything if any(m in a.targets for a in loaded.values()))
        else:
            targets = everything
        mgr = cls(model, dtype, device, max_rank, targets, args.max_loras_per_batch)
        mgr.adapters.update(loaded)
        logger.info("LoRA: %d adapters loaded (%s), max rank %s, targets %s", len(loaded),
                    ", ".join(loaded) or "none", max_rank or "any", ",".join(targets))
        return mgr

    def _wrap(self, model: nn.Module) -> None:
        for layer_id, layer in enumerate(model.model.layers):
            for ours, peft_names in FUSED_PARTS.items():
                if not any(n in self.targets for n in peft_names):
                    continue
                parent_name, _, child = ours.rpartition(".")
                parent = layer.get_submodule(parent_name)
                setattr(parent, child, LoRALinear(getattr(parent, child), layer_id, ours, self))

    # ---------------------------------------------------------------- adapters

    def load(self, name: str, path: str) -> LoRAAdapter:
        if not name:
            raise LoRAError("lora_name must not be empty")
        if name in self.adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = load_adapter(name, path, self.shapes, self.dtype, self.device, self.max_rank, self.targets)
        self.adapters[name] = adapter
        self._stacks.clear()
        logger.info("LoRA: loaded %r from %s (rank %d, %s)", name, path, adapter.rank, ",".join(adapter.targets))
        return adapter

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        self._stacks.clear()
        logger.info("LoRA: unloaded %r", name)

    def paths(self) -> dict[str, str]:
        return {n: a.path for n, a in self.adapters.items()}

    # ---------------------------------------------------------------- passes

    def prepare(self, names: list[Optional[str]], tokens_per_req: list[int]) -> Optional[LoRAPass]:
        """The pass for a flat batch whose request i has tokens_per_req[i] rows and adapter names[i]."""
        rows: dict[str, list[int]] = {}
        start = 0
        for name, n in zip(names, tokens_per_req):
            if name is not None:
                rows.setdefault(name, []).extend(range(start, start + n))
            start += n
        if not rows:
            return None
        order = tuple(sorted(rows))
        adapters = [self.adapters[n] for n in order]
        stacks = self._stacks.get(order)
        if stacks is None:
            if len(self._stacks) >= STACK_CACHE_SIZE:
                self._stacks.pop(next(iter(self._stacks)))
            stacks = self._stacks[order] = stack_adapters(adapters)
        index = [torch.tensor(rows[n], dtype=torch.int64, device=self.device) for n in order]
        return LoRAPass(stacks, column_masks(adapters, index, start, self.dtype, self.device))

    def begin(self, lora: Optional[LoRAPass]) -> None:
        self._local.lora = lora

    def current(self) -> Optional[LoRAPass]:
        return getattr(self._local, "lora", None)
