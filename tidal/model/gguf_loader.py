"""GGUF files: metadata -> ModelConfig, tensors -> float tensors under Hugging Face parameter names."""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator, Optional

import numpy as np
import torch

from tidal.model.config import ModelConfig, config_from_gguf
from tidal.model.quant import NATIVE_GGUF_TYPES, Int4Weight, int4_from_gguf

# large tokenizer arrays that the model does not need (slow to decode field by field)
_SKIP_FIELDS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                "tokenizer.ggml.token_type", "tokenizer.ggml.added_tokens"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# llama.cpp's converter permutes q/k rows of these archs into its interleaved RoPE layout
_PERMUTED_ARCHS = ("llama", "mistral")


# arrays of at least this many elements are left unread by open_gguf (the vocabulary, merges, scores)
BIG_ARRAY = 256


def open_gguf(path: str) -> Any:
    """A gguf.GGUFReader of `path` that leaves big metadata arrays unread (their contents() is []).

    gguf's reader parses every array element by element through numpy memmap views: the 49k-token
    vocabulary, merges and scores of a small model took 4.5 s of each server start on a 2-core AVX2
    machine, and the model needs none of them (the tokenizer is built by transformers and cached).
    A reader that cannot take the shortcut (another gguf version) is the plain one.
    """
    from gguf import GGUFReader

    try:
        return _metadata_reader_class()(path)
    except Exception:  # noqa: BLE001 - gguf's private layout changed: read it the slow way
        return GGUFReader(path)


@functools.cache
def _metadata_reader_class() -> type:
    from gguf import GGUFReader, GGUFValueType

    class MetadataReader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):  # gguf's own signature
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            n, itype = int(alen[0]), GGUFValueType(int(raw_itype[0]))
            if n < BIG_ARRAY or itype == GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs + 12
            if itype == GGUFValueType.STRING:
                raw = memoryview(np.asarray(self.data))
                order = "little" if self.byte_order == "I" else "big"
                for _ in range(n):  # uint64 length, then the bytes
                    offs += 8 + int.from_bytes(raw[offs:offs + 8], order)
            else:
                offs += n * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]

    return MetadataReader


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key/values as plain Python values (big tokenizer arrays are skipped)."""
    meta: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name in _SKIP_FIELDS or name.startswith("GGUF."):
            continue
        meta[name] = f.contents()
    return meta


def gguf_to_hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown tensors."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> HF half-rotation layout).

    The converter maps HF rows [head, half, pair_idx] to [head, pair_idx, half]; this is the inverse.
    Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    half_dim = rows // n_head // 2
    w = w.reshape(n_head, half_dim, 2, *w.shape[1:])  # [head, pair_idx, half, ...]
    return w.transpose(1, 2).reshape(rows, *w.shape[3:])  # [head*half*pair_idx, ...]


def _dequantize(t: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    # a plain ndarray view of the mmap: numpy memmap views cost ~15 us each in gguf's row loop
    arr = dequantize(np.asarray(t.data), t.tensor_type)
    if not arr.flags.writeable:  # F32 tensors come back as views of the read-only mmap
        arr = arr.copy()
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))


def _unpermute_for(hf: str, config: ModelConfig) -> Optional[int]:
    """The head count to undo llama.cpp's q/k row permutation with, or None if `hf` is not permuted."""
    if config.arch not in _PERMUTED_ARCHS:
        return None
    if ".q_proj." in hf:
        return config.num_heads
    if ".k_proj." in hf:
        return config.num_kv_heads
    return None


def _native_int4(t: Any, hf: str, n_head: Optional[int]) -> Optional[Int4Weight]:
    """The tensor's exact int4 form (rows in HF order) if it is a 2-D Q4_0/Q4_1 weight, else None."""
    if t.tensor_type.name not in NATIVE_GGUF_TYPES or not hf.endswith(".weight") or len(t.shape) != 2:
        return None
    shape = tuple(int(d) for d in reversed(t.shape))
    w = int4_from_gguf(np.asarray(t.data), t.tensor_type.name, shape)
    if n_head is None:
        return w
    return Int4Weight(*(unpermute_qk(x, n_head) for x in (w.codes, w.scale, w.zero)))


def _iter_weights(reader: Any, config: ModelConfig,
                  int4_out: Optional[dict[str, Int4Weight]]) -> Iterator[tuple[str, torch.Tensor]]:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into config.rope_freq_factors
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file")
        n_head = _unpermute_for(hf, config)
        if int4_out is not None:
            q = _native_int4(t, hf, n_head)
            if q is not None:
                int4_out[hf] = q
        w = _dequantize(t)
        yield hf, (w if n_head is None else unpermute_qk(w, n_head))


def load_gguf(path: str, int4_out: Optional[dict[str, Int4Weight]] = None
              ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Returns the config and a lazy iterator of (HF parameter name, float32 tensor).

    With `int4_out`, iterating also stores there, by HF name, the exact int4 form of every
    Q4_0/Q4_1 weight (see tidal/model/quant.py).
    """
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, set(tensors))
    emb = tensors.get("token_embd.weight")
    if emb is not None:
        config.vocab_size = int(emb.shape[1])  # GGUF shape [hidden, vocab]
    if "rope_freqs.weight" in tensors:
        config.rope_freq_factors = _dequantize(tensors["rope_freqs.weight"]).flatten().tolist()
    return config, _iter_weights(reader, config, int4_out)


def read_gguf_chat_template(path: str) -> str | None:
    f = open_gguf(path).fields.get("tokenizer.chat_template")
    return None if f is None else f.contents()
