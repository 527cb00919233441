"""Embedding pooling: which hidden states make a prompt's embedding, and whether it is L2-normalized.

The hidden states are the model's final norm output (what the LM head would read). The method
comes from the model when it declares one (sentence-transformers' `modules.json` +
`1_Pooling/config.json` and a `Normalize` module in a Hugging Face directory; a GGUF's
`<arch>.pooling_type`, normalized as llama.cpp does by default), else last token + L2 norm, the
usual choice for a decoder-only model. `--pooling-method` / `--[no-]embedding-normalize` override.

Pooling is incremental so a prompt split into chunked-prefill passes pools exactly like one pass:
`PoolState.add(rows, first_pos)` takes each pass's rows of the request in position order.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tidal.config import POOLING_METHODS, ServerArgs

# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_ST_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    method: str  # one of POOLING_METHODS
    normalize: bool
    source: str  # where the choice came from, for logs and /get_model_info

    def describe(self) -> str:
        return f"{self.method}{' + L2 normalize' if self.normalize else ''} ({self.source})"


DEFAULT_POOLING = PoolingConfig("last", True, "default for a causal LM")


def resolve_pooling(args: ServerArgs) -> PoolingConfig:
    """The model's declared pooling with the command line's overrides applied."""
    base = pooling_from_model(args.model_path)
    method = args.pooling_method or base.method
    normalize = base.normalize if args.embedding_normalize is None else args.embedding_normalize
    overridden = (args.pooling_method is not None and args.pooling_method != base.method) or \
                 (args.embedding_normalize is not None and args.embedding_normalize != base.normalize)
    return PoolingConfig(method, normalize, "command line" if overridden else base.source)


def pooling_from_model(path: str) -> PoolingConfig:
    if os.path.isdir(path):
        return _from_sentence_transformers(path) or DEFAULT_POOLING
    if path.endswith(".gguf") and os.path.isfile(path):
        return _from_gguf(path) or DEFAULT_POOLING
    return DEFAULT_POOLING


def _read_json(path: str) -> Optional[object]:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _from_sentence_transformers(model_dir: str) -> Optional[PoolingConfig]:
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return None
    types = [str(m.get("type", "")) for m in modules]
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    cfg = _read_json(os.path.join(model_dir, pooling.get("path", "1_Pooling"), "config.json")) or {}
    chosen = [method for key, method in _ST_POOLING_KEYS.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_POOLING_KEYS]
    if len(chosen) != 1 or others:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {cfg} is not supported; "
                         f"tidal pools with exactly one of {POOLING_METHODS} (use --pooling-method)")
    normalize = any(t.endswith(".Normalize") for t in types)
    return PoolingConfig(chosen[0], normalize, "sentence-transformers modules.json")


def _from_gguf(path: str) -> Optional[PoolingConfig]:
    meta = read_gguf_scalars(path)
    value = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    if value is None:
        return None
    if int(value) not in _GGUF_POOLING:
        raise ValueError(f"{path}: GGUF pooling_type {value} is not supported (use --pooling-method)")
    return PoolingConfig(_GGUF_POOLING[int(value)], True, "GGUF pooling_type")


# GGUF value types: fixed-size scalars (struct format), 8 = string, 9 = array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_scalars(path: str) -> dict[str, object]:
    """A GGUF's scalar and string key/values (arrays skipped), reading only the header: a
    fraction of a second where gguf.GGUFReader takes seconds over a 49k-entry vocabulary."""
    with open(path, "rb") as f:
        def unpack(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string() -> str:
            return f.read(unpack("<Q")).decode("utf-8", "replace")

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(unpack("<Q"), 1)
            elif vtype == 9:
                etype, count = unpack("<I"), unpack("<Q")
                if etype in _GGUF_SCALARS:
                    f.seek(struct.calcsize(_GGUF_SCALARS[etype]) * count, 1)
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                f.seek(struct.calcsize(_GGUF_SCALARS[vtype]), 1)

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        unpack("<I")  # version
        unpack("<Q")  # tensor count
        meta: dict[str, object] = {}
        for _ in range(unpack("<Q")):
            key, vtype = string(), unpack("<I")
            if vtype in _GGUF_SCALARS:
                meta[key] = unpack(_GGUF_SCALARS[vtype])
            elif vtype == 8:
                meta[key] = string()
            else:
                skip(vtype)
        return meta


class PoolState:
    """One request's running pool over its prompt's hidden rows (float32)."""

    def __init__(self, method: str):
        self.method = method
        self.value: Optional[torch.Tensor] = None
        self.count = 0

    def add(self, rows: torch.Tensor, first_pos: int) -> None:
        """rows [n, hidden]: positions first_pos .. first_pos + n - 1, passes in position order."""
        rows = rows.float()
        if self.method == "last":
            self.value = rows[-1].clone()
        elif self.method == "cls":
            if first_pos == 0:
                self.value = rows[0].clone()
        else:
            total = rows.sum(dim=0)
            self.value = total if self.value is None else self.value + total
        self.count += rows.shape[0]

    def result(self, normalize: bool) -> list[float]:
        assert self.value is not None and self.count > 0, "no hidden rows were pooled"
        v = self.value / self.count if self.method == "mean" else self.value
        if normalize:
            v = F.normalize(v, p=2.0, dim=0)
        return v.tolist()
