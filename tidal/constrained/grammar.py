"""Grammar requests: which constraint a request asks for, and its llguidance grammar.

Kinds follow SGLang's sampling parameters: `json_schema` (a JSON Schema as a JSON string),
`regex`, `ebnf` (GBNF, as llama.cpp and xgrammar write it; Lark is accepted too) and
`structural_tag` (SGLang's `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`:
free text in which every structure that starts with a trigger is constrained).

`to_llguidance` turns one into llguidance's grammar text; it is cheap (no tokenizer) and
raises `GrammarError` with a message a client can act on. The API process calls
`check_grammar` on every request, so an invalid schema, regex or grammar is a 400 before the
request reaches a scheduler.
"""

from __future__ import annotations

import json
from typing import Optional

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    pass


class JsonStyle:
    """How JSON is laid out where a schema leaves it free. Compact separators with one space
    (Python's json.dumps style) by default: free whitespace lets small models pad forever."""

    def __init__(self, whitespace_pattern: Optional[str] = None):
        self.whitespace_pattern = whitespace_pattern

    def options(self) -> dict:
        if self.whitespace_pattern is not None:
            return {"whitespace_pattern": self.whitespace_pattern, "whitespace_flexible": True}
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def to_llguidance(kind: str, text: str, style: Optional[JsonStyle] = None) -> str:
    """llguidance grammar text for one grammar request; GrammarError if it is not valid."""
    from llguidance import LLMatcher

    try:
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(_json_object(text, kind), defaults=(style or JsonStyle()).options())
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(text)
        elif kind == "ebnf":
            grammar = _ebnf(text)
        elif kind == "structural_tag":
            grammar = _structural_tag(text, style or JsonStyle())
        else:
            raise GrammarError(f"unknown grammar kind {kind!r} (expected one of {', '.join(GRAMMAR_KINDS)})")
    except GrammarError:
        raise
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise GrammarError(f"invalid {kind}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {kind}: {error.strip()}")
    return grammar


def check_grammar(kind: str, text: str, style: Optional[JsonStyle] = None) -> None:
    to_llguidance(kind, text, style)


def _json_object(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise GrammarError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _ebnf(text: str) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as e:  # the converter raises bare exceptions on syntax errors
        raise GrammarError(f"invalid ebnf: {e}") from None
    return LLMatcher.grammar_from_lark(lark)


def _structural_tag(text: str, style: JsonStyle) -> str:
    from llguidance import StructTag

    spec = _json_object(text, "structural_tag")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise GrammarError("structural_tag needs non-empty `structures` and `triggers` lists")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarError("each structural_tag structure needs string `begin` and `end` and a `schema`")
        trigger = next((t for t in triggers if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"structure begin {s['begin']!r} starts with none of the triggers {triggers}")
        schema = s.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("each structural_tag structure needs a JSON object `schema`")
        schema = {**schema, "x-guidance": style.options()}
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return StructTag.to_grammar(tags, assume_special=False)
