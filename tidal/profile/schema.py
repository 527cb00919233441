"""The profile JSON, version 1 (see docs/elasticity.md).

A minimal copy written to the contract the planner depends on; the profiler's branch
owns this format and its version replaces this one.
"""

from __future__ import annotations

from typing import Optional

import msgspec


class ServerInfo(msgspec.Struct, kw_only=True):
    url: str = ""
    model: str = ""
    quantization: str = ""
    dtype: str = ""
    torch_threads: int = 0
    cpu_flags: list[str] = []
    page_size: int = 1
    max_total_tokens: int = 0
    transfer_backend: str = ""


class PrefillPoint(msgspec.Struct):
    tokens: int
    seconds: float


class DecodePoint(msgspec.Struct):
    batch: int
    context_tokens: int
    step_seconds: float


class TransferPoint(msgspec.Struct):
    tokens: int
    bytes: int
    seconds: float


class SwitchPoint(msgspec.Struct):
    src: str
    dst: str
    seconds: float


class Drain(msgspec.Struct):
    seconds_idle: float


class Profile(msgspec.Struct, kw_only=True):
    version: int = 1
    measured_at: str = ""
    server: ServerInfo = msgspec.field(default_factory=ServerInfo)
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    kv_transfer: list[TransferPoint] = []
    switch: list[SwitchPoint] = []
    drain: Optional[Drain] = None


def load_profile(path: str) -> Profile:
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=Profile)
