"""Benchmark workloads: random-token prompts and Azure LLM trace (2023) replay.

Every prompt of a run starts with the same per-run random nonce (a few token ids drawn
from an OS-seeded RNG, not from ``--seed``), so no server can serve a run from a
previous run's prefix cache; the rest of each prompt is seeded by ``--seed``.
"""

from __future__ import annotations

import csv
import os
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional, Sequence

import numpy as np

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
AZURE_FILES = {"azure-code": "AzureLLMInferenceTrace_code.csv",
               "azure-conv": "AzureLLMInferenceTrace_conv.csv"}
DATASETS = ("random", "azure-code", "azure-conv")


@dataclass
class BenchRequest:
    """One request to send: the prompt (text and token ids), lengths, arrival offset."""

    prompt: str
    prompt_ids: list[int]
    prompt_len: int
    output_len: int
    arrival_time: Optional[float] = None  # seconds after the start (trace replay)


# --------------------------------------------------------------------------- tokenizer

def default_model_dir() -> str:
    """Directory of the default GGUF model (see tidal.config.default_model_path)."""
    from tidal.config import default_model_path

    return os.path.dirname(default_model_path())


_TOKENIZERS: dict[str, Any] = {}


def get_tokenizer(path: Optional[str] = None) -> Any:
    """A transformers tokenizer: a HF dir/name, a .gguf file, or the default GGUF model's."""
    key = path or "<default>"
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    from transformers import AutoTokenizer

    if not path:
        tok = AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=DEFAULT_GGUF)
    elif path.endswith(".gguf"):
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
    else:
        tok = AutoTokenizer.from_pretrained(path)
    _TOKENIZERS[key] = tok
    return tok


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _allowed_ids(tokenizer: Any) -> np.ndarray:
    vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    return np.setdiff1d(np.arange(vocab), np.asarray(special, dtype=np.int64))


# --------------------------------------------------------------------------- prompts

NONCE_TOKENS = 4


def make_nonce(tokenizer: Any, n: int = NONCE_TOKENS) -> list[int]:
    """``n`` random vocab ids from an OS-seeded RNG: a fresh prefix each run, whatever
    ``--seed`` is (about 1e18 possibilities for a 49k vocabulary)."""
    rng = np.random.default_rng(secrets.randbits(64))
    return rng.choice(_allowed_ids(tokenizer), size=n).tolist()


class PromptMaker:
    """Builds prompts of a given token length: nonce ids followed by random vocab ids."""

    def __init__(self, tokenizer: Any, rng: np.random.Generator, nonce_ids: list[int],
                 as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.nonce_ids = list(nonce_ids)
        self.allowed = _allowed_ids(tokenizer)
        self.as_ids = as_ids

    def make(self, input_len: int, output_len: int,
             arrival_time: Optional[float] = None) -> BenchRequest:
        n = max(input_len, len(self.nonce_ids) + 1)
        body = self.rng.choice(self.allowed, size=n - len(self.nonce_ids)).tolist()
        ids = self.nonce_ids + body
        text = self.tokenizer.decode(ids)
        if not self.as_ids:  # the server re-tokenizes text: trim so it is ~n tokens
            ids = encode(self.tokenizer, text)[:n]
            text = self.tokenizer.decode(ids)
        return BenchRequest(prompt=text, prompt_ids=ids, prompt_len=len(ids),
                            output_len=max(1, output_len), arrival_time=arrival_time)


def random_lengths(rng: np.random.Generator, n: int, mean_len: int,
                   range_ratio: float) -> list[int]:
    """Uniform integers in [mean_len * range_ratio, mean_len], at least 1."""
    low = max(1, int(mean_len * range_ratio))
    high = max(low, mean_len)
    return rng.integers(low, high + 1, size=n).tolist()


def sample_random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 0,
                           nonce: Optional[list[int]] = None,
                           as_ids: bool = False) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lens = random_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = random_lengths(rng, num_prompts, output_len, range_ratio)
    maker = PromptMaker(tokenizer, rng, nonce or make_nonce(tokenizer), as_ids)
    return [maker.make(i, o) for i, o in zip(in_lens, out_lens)]


# --------------------------------------------------------------------------- Azure trace

def default_azure_dir() -> str:
    """The Azure LLM inference trace 2023 shipped inside this package (CC-BY 4.0, see its README)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "azure_llm_2023")


TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFormatError(ValueError):
    """A trace file whose rows are not the Azure LLM trace's."""


def parse_timestamp(ts: str) -> float:
    """'2023-11-16 18:17:03.9799600' -> POSIX seconds (any number of fraction digits)."""
    base, _, frac = ts.strip().partition(".")
    sec = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
    return sec + (float("0." + frac) if frac else 0.0)


def resolve_trace_file(dataset: str, dataset_path: Optional[str]) -> str:
    """A CSV path from --dataset-path (a file or the trace directory) or the default dir."""
    if dataset_path and os.path.isfile(dataset_path):
        return dataset_path
    if dataset_path and not os.path.isdir(dataset_path):
        raise SystemExit(f"Azure trace not found: {dataset_path} (give a trace CSV or the directory holding "
                         f"{AZURE_FILES[dataset]})")
    path = os.path.join(dataset_path or default_azure_dir(), AZURE_FILES[dataset])
    if not os.path.isfile(path):
        raise SystemExit(f"Azure trace not found: {path} (give a trace CSV or the directory holding it)")
    return path


def load_azure_trace(path: str, num_prompts: int, offset: int = 0,
                     speedup: float = 1.0) -> list[tuple[float, int, int]]:
    """Rows [offset, offset+num_prompts) as (arrival_s, context_tokens, generated_tokens);
    arrivals are relative to the first selected row and divided by ``speedup``."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not set(TRACE_COLUMNS) <= set(reader.fieldnames or ()):
            raise TraceFormatError(f"{path}: not an Azure LLM trace (its header needs {','.join(TRACE_COLUMNS)})")
        for i, row in enumerate(reader):
            if i < offset:
                continue
            if len(rows) >= num_prompts:
                break
            try:
                rows.append((parse_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])))
            except (KeyError, ValueError, TypeError, AttributeError) as e:
                raise TraceFormatError(f"{path} line {i + 2}: not an Azure LLM trace row ({','.join(TRACE_COLUMNS)}): "
                                       f"{type(e).__name__}: {e}") from None
    if not rows:
        return []
    t0 = rows[0][0]
    return [((t - t0) / speedup, c, g) for t, c, g in rows]


def sample_azure_requests(tokenizer: Any, rows: Sequence[tuple[float, int, int]],
                          max_input_len: Optional[int] = None,
                          max_output_len: Optional[int] = None, seed: int = 0,
                          nonce: Optional[list[int]] = None,
                          as_ids: bool = False) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng, nonce or make_nonce(tokenizer), as_ids)
    out = []
    for t, ctx, gen in rows:
        ctx = min(ctx, max_input_len) if max_input_len else ctx
        gen = min(gen, max_output_len) if max_output_len else gen
        out.append(maker.make(ctx, gen, arrival_time=t))
    return out


def build_requests(ns: Any, tokenizer: Any,
                   as_ids: bool) -> tuple[list[BenchRequest], list[int]]:
    """The run's requests for the parsed CLI namespace, and the nonce ids they start with."""
    nonce = make_nonce(tokenizer)
    n = ns.num_prompts + ns.warmup_requests
    if ns.dataset == "random":
        reqs = sample_random_requests(tokenizer, n, ns.random_input_len, ns.random_output_len,
                                      ns.random_range_ratio, ns.seed, nonce, as_ids)
        return reqs, nonce
    path = resolve_trace_file(ns.dataset, ns.dataset_path)
    try:
        warm = load_azure_trace(path, ns.warmup_requests, ns.trace_offset, ns.trace_speedup)
        rows = load_azure_trace(path, ns.num_prompts, ns.trace_offset, ns.trace_speedup)
    except TraceFormatError as e:
        raise SystemExit(f"tidal bench: error: {e}") from None
    reqs = sample_azure_requests(tokenizer, list(warm) + list(rows), ns.max_input_len,
                                 ns.max_output_len, ns.seed, nonce, as_ids)
    return reqs, nonce
