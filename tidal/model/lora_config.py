"""LoRA flags: parsing --lora-paths and the start-up checks (no torch: the API process imports it)."""

from __future__ import annotations

from typing import Any, Iterable

from tidal.config import LORA_TARGET_MODULES


def parse_lora_paths(entries: Iterable[str]) -> dict[str, str]:
    """["name=path", "path", ...] -> {name: path}; a plain path is its own name (as SGLang)."""
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = entry, entry
        if not name or not path:
            raise ValueError(f"--lora-paths entry {entry!r}: expected name=path or a path")
        if name in out:
            raise ValueError(f"--lora-paths: the name {name!r} is given twice")
        out[name] = path
    return out


def target_modules(names: Iterable[str]) -> tuple[str, ...]:
    """--lora-target-modules values, "all" expanded, in the canonical order."""
    chosen = set(names)
    if "all" in chosen:
        return LORA_TARGET_MODULES
    unknown = chosen - set(LORA_TARGET_MODULES)
    if unknown:
        raise ValueError(f"--lora-target-modules: {sorted(unknown)} not among {LORA_TARGET_MODULES}")
    return tuple(m for m in LORA_TARGET_MODULES if m in chosen)


def check_lora_args(args: Any) -> None:
    if args.lora_paths and not args.enable_lora:
        raise ValueError("--lora-paths needs --enable-lora")
    if args.max_loras_per_batch < 1:
        raise ValueError("--max-loras-per-batch must be >= 1")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise ValueError("--max-lora-rank must be >= 1")
    parse_lora_paths(args.lora_paths)
    target_modules(args.lora_target_modules)
    if not args.enable_lora:
        return
    if args.tp_size > 1:
        raise ValueError("--enable-lora is not supported with --tp > 1 yet (the adapters' matmuls are not sharded)")
    if args.enable_torch_compile:
        raise ValueError("--enable-lora is not supported with --enable-torch-compile yet "
                         "(the compiled decode step has no per-request adapter path)")
