"""KV cache event shapes (vLLM's and SGLang's names), the chained block hash, and `--kv-events-config`.

A block is one KV page (`--page-size` tokens). Its hash chains over the prefix: block i's hash is
blake2b-64(hash of block i-1, its token ids), the first block's chained from the namespace's seed (0 for the
base model, the adapter's id under LoRA). So a hash names a whole prefix, and a router that hashes a prompt the
same way finds how many of its leading blocks a worker holds by looking the hashes up in turn.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any, Optional, Sequence, Union

import msgspec
import numpy as np


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: Optional[int] = None


ENCODER = msgspec.msgpack.Encoder()
BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def namespace_id(namespace: Any) -> Optional[int]:
    """The lora_id of a prefix namespace (a LoRA adapter's name): a stable 63-bit number; None for the base."""
    if namespace is None:
        return None
    digest = hashlib.blake2b(str(namespace).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def block_hash(parent: Optional[int], tokens: Sequence[int], seed: int = 0) -> int:
    return _chain(parent, np.asarray(tokens, dtype=np.int64).tobytes(), seed)


def _chain(parent: Optional[int], token_bytes: bytes, seed: int) -> int:
    h = hashlib.blake2b(struct.pack("<q", seed if parent is None else parent), digest_size=8)
    h.update(token_bytes)
    return int.from_bytes(h.digest(), "little", signed=True)


def block_hashes(tokens: Sequence[int], block_size: int, parent: Optional[int] = None,
                 namespace: Any = None) -> list[int]:
    """The hashes of the whole blocks of `tokens`, chained from `parent` (None: the namespace's first block)."""
    seed = namespace_id(namespace) or 0
    raw = np.asarray(tokens, dtype=np.int64).tobytes()  # converted once: a router hashes every prompt
    step = 8 * block_size
    out = []
    for start in range(0, len(raw) - step + 1, step):
        parent = _chain(parent, raw[start:start + step], seed)
        out.append(parent)
    return out


# ---------------------------------------------------------------- --kv-events-config

_ENDPOINT = re.compile(r"^(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(\d{1,5}|\*)|ipc://.+)$")


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's `--kv-events-config` JSON (its field names and defaults). `*` as an endpoint's host means the
    server's own --host (tidal binds nothing wider than that); port 0 or `*` is a free port, which the server
    reports in /server_info `kv_events` (so one config serves many servers on a host)."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    enable_kv_cache_events: bool = True

    @property
    def enabled(self) -> bool:
        return self.publisher != "null" and self.enable_kv_cache_events

    def resolved(self, host: str) -> "KVEventsConfig":
        """Endpoints with `*` replaced by `host` (0.0.0.0 stays a wildcard bind)."""
        bind = "*" if host in ("", "0.0.0.0") else host
        sub = (lambda e: e.replace("tcp://*:", f"tcp://{bind}:", 1) if e else e)
        return msgspec.structs.replace(self, endpoint=sub(self.endpoint), replay_endpoint=sub(self.replay_endpoint))


def parse_kv_events_config(text: Optional[str]) -> Optional[KVEventsConfig]:
    """The config of a `--kv-events-config` value (JSON text, or a path to a JSON file); None when absent;
    ValueError with the reason when it is not a valid config."""
    if text is None or not text.strip():
        return None
    raw = text
    if not text.lstrip().startswith("{"):
        try:
            with open(text) as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"--kv-events-config: not JSON and not a readable file: {e}") from None
    try:
        json.loads(raw)
        cfg = msgspec.json.decode(raw, type=KVEventsConfig)
    except (ValueError, msgspec.ValidationError) as e:
        raise ValueError(f"--kv-events-config: {e}") from None
    if cfg.publisher not in ("null", "zmq"):
        raise ValueError(f"--kv-events-config: publisher {cfg.publisher!r} is not one of null, zmq")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(cfg, name)
        if value is not None and not _ENDPOINT.match(value):
            raise ValueError(f"--kv-events-config: {name} {value!r} is not tcp://HOST:PORT or ipc://PATH")
    if cfg.replay_endpoint is not None and cfg.replay_endpoint == cfg.endpoint and not _free_port(cfg.endpoint):
        raise ValueError("--kv-events-config: endpoint and replay_endpoint must differ")
    if cfg.buffer_steps < 1 or cfg.hwm < 0 or cfg.max_queue_size < 1:
        raise ValueError("--kv-events-config: buffer_steps and max_queue_size must be >= 1, hwm >= 0")
    return cfg


def _free_port(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and endpoint.endswith((":0", ":*"))


class KVEventSink:
    """What a prefix cache tells about its blocks, kept until the scheduler hands it to the publisher."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[KVEvent] = []

    def stored(self, hashes: list[int], parent: Optional[int], tokens: list[int], namespace: Any) -> None:
        if hashes:
            self.pending.append(BlockStored(hashes, parent, tokens, self.block_size, namespace_id(namespace)))

    def removed(self, hashes: list[int]) -> None:
        if hashes:
            self.pending.append(BlockRemoved(hashes))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        out, self.pending = self.pending, []
        return out
