"""Which CPU kernels a server runs, chosen from the CPU it finds (never assumed), and why.

`detect_cpu()` reads what the CPU can do: torch's own dispatch level (the vector ISA its
kernels were built for and picked at start), AMX tiles and AVX512-BF16 as torch reports them,
and /proc/cpuinfo's SIMD flags for the log. From that, the device and the model dtype:

- `choose_kernels()`: weight prepacking (tidal/model/packed.py) is on where bfloat16 matmuls are
  native (AMX or AVX512-BF16) and the model runs in bfloat16: there oneDNN's prepacked matmuls
  beat F.linear (a 32-request decode step 118 -> 86 ms, docs/benchmarks.md section 28). Without
  native bfloat16 the model runs in float32 by default, where it is not measured: off. The
  int4/int8 kernels keep the passes of at most `--quantized-max-tokens` (8) rows: a decode step
  streams every weight from memory and 4-bit weights are a quarter of the bytes; in the whole
  model they win through 8 rows even beside prepacked bfloat16 (same section).
- `choose_compile()`: the compiled decode step (tidal/model/compiled.py) is on by default where it
  runs (a CPU, one rank, no LoRA, no speculative decoding, the torch attention backend, a C++
  compiler on the PATH). `TIDAL_TORCH_COMPILE_AUTO=off` makes the default off (the test suite's
  servers start in seconds that way; the compiled step has its own tests).

Each choice is logged at info with its reason; explicit flags always win, and an explicit
choice the machine cannot run is a clear error at start-up.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch

from tidal.config import WEIGHT_PREPACK
from tidal.cpus import cpu_flags, simd_flags

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class CpuKind:
    isa: str  # torch's kernel level: "AMX" (AVX512 + AMX tiles), "AVX512", "AVX2", "DEFAULT", ...
    native_bf16: bool  # AMX or AVX512-BF16: bfloat16 dot products in hardware
    flags: tuple[str, ...] = ()  # the SIMD flags of /proc/cpuinfo

    def describe(self) -> str:
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        return f"{self.isa}, {bf16} ({' '.join(self.flags) or 'flags unknown'})"


def detect_cpu() -> CpuKind:
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        isa = "unknown"
    amx = _torch_says("_is_amx_tile_supported")
    bf16 = amx or _torch_says("_is_avx512_bf16_supported")
    if amx and isa.startswith("AVX512"):
        isa = "AMX"
    return CpuKind(isa, bf16, tuple(simd_flags(cpu_flags())))


def _torch_says(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


@dataclass(frozen=True)
class KernelChoice:
    weight_prepack: bool
    reason: str

    def log(self, cpu: CpuKind) -> None:
        logger.info("CPU: %s", cpu.describe())
        logger.info("kernels: weight prepack %s: %s", "on" if self.weight_prepack else "off", self.reason)


def choose_kernels(prepack: str, device: torch.device, dtype: torch.dtype, cpu: CpuKind) -> KernelChoice:
    """What --weight-prepack means here; raises ValueError when an explicit `on` cannot run."""
    from tidal.model.packed import prepack_available

    if prepack not in WEIGHT_PREPACK:
        raise ValueError(f"--weight-prepack must be one of {WEIGHT_PREPACK}, not {prepack!r}")
    if prepack == "on":
        dtype_name = str(dtype).removeprefix("torch.")
        why_not = ("it packs CPU weights only" if device.type != "cpu" else
                   "this torch has no oneDNN linear ops" if not prepack_available() else
                   f"oneDNN cannot reorder {dtype_name} weights on this CPU ({cpu.describe()})"
                   if not prepack_available(dtype) else None)
        if why_not:
            raise ValueError(f"--weight-prepack on: {why_not}")
        packed, why = True, "asked for (--weight-prepack on)"
    elif prepack == "off":
        packed, why = False, "off (--weight-prepack off)"
    else:
        packed, why = _auto_prepack(device, dtype, cpu, prepack_available(dtype))
    return KernelChoice(packed, why)


def _auto_prepack(device: torch.device, dtype: torch.dtype, cpu: CpuKind, available: bool) -> tuple[bool, str]:
    if device.type != "cpu":
        return False, f"the model runs on {device.type}"
    if dtype != torch.bfloat16:
        return False, f"the model runs in {str(dtype).removeprefix('torch.')} (prepacking is measured to pay in bfloat16)"
    if not cpu.native_bf16:
        return False, "this CPU has no native bfloat16 (no AMX, no AVX512-BF16)"
    if not available:
        return False, "this torch or CPU cannot reorder bfloat16 weights for oneDNN"
    return True, f"{cpu.isa} with native bfloat16: oneDNN's prepacked bfloat16 matmuls"


COMPILE_AUTO_ENV = "TIDAL_TORCH_COMPILE_AUTO"
CXX_COMPILERS = ("g++", "c++", "clang++")


def choose_compile(requested: Optional[bool], device: torch.device, tp_size: int, lora: bool,
                   attention_backend: str, speculative: bool = False, environ=os.environ) -> tuple[bool, str]:
    """Whether the decode step is compiled, and why (requested: --enable/--disable-torch-compile, None = auto)."""
    if requested is not None:
        return requested, "asked for" if requested else "off (--disable-torch-compile)"
    if environ.get(COMPILE_AUTO_ENV, "").lower() in ("0", "off", "false", "no"):
        return False, f"off by default here ({COMPILE_AUTO_ENV}={environ[COMPILE_AUTO_ENV]})"
    why_not = (f"the model runs on {device.type} (measured to pay on CPUs)" if device.type != "cpu" else
               "--tp > 1" if tp_size > 1 else
               "LoRA is on" if lora else
               "speculative decoding verifies in extend passes, which run eager" if speculative else
               f"the {attention_backend} attention backend compiles its own kernels" if attention_backend != "torch"
               else None)
    if why_not is None and not (environ.get("CXX") or any(shutil.which(c) for c in CXX_COMPILERS)):
        why_not = "no C++ compiler on the PATH (inductor needs one)"
    if why_not:
        return False, f"off: {why_not}"
    return True, "on: a CPU with a C++ compiler, one rank, no LoRA"
