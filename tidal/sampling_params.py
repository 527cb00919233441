"""Sampling parameters: the wire struct and its validation (SGLang field names)."""

from __future__ import annotations

import math
from typing import Optional

import msgspec

# Below this temperature, logits / temperature overflow float32 for ordinary logit gaps;
# such a temperature means greedy (as in SGLang).
GREEDY_TEMPERATURE = 1e-5
# The seeds torch.Generator.manual_seed accepts (and msgspec can encode).
SEED_MIN, SEED_END = -(2**63), 2**64


def seed_for_copy(seed: Optional[int], j: int) -> Optional[int]:
    """The seed of copy j of an n > 1 request: seed + j, wrapped to stay a valid seed."""
    if seed is None:
        return None
    s = seed + j
    return s - 2**64 if seed < SEED_END <= s else s


class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: Optional[int] = None
    # constrained decoding (SGLang's names; at most one): a JSON Schema as a JSON string, a
    # regular expression, an EBNF (GBNF) grammar, or SGLang's structural tag as a JSON string
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None

    @property
    def grammar_key(self) -> Optional[tuple[str, str]]:
        """(kind, text) of the request's grammar, or None when it is unconstrained."""
        for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError with a message a client can act on."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must be <= max_new_tokens")
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_END:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed}")
        kinds = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"only one of json_schema, regex, ebnf and structural_tag may be set, got {', '.join(kinds)}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
