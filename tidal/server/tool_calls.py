"""Tool calling for /v1/chat/completions: the request's `tools` / `tool_choice` checked and
turned into a plan (what the chat template gets, which JSON schema constrains the output),
and the output turned back into OpenAI `tool_calls`, whole or as stream deltas.

- `none`: tools reach the template; the output is plain content.
- `auto` (the default when tools are given): the server's `--tool-call-parser` (if any)
  finds calls in the text; without one the text stays content.
- `required` / named function: the output is constrained to a JSON schema built from the
  tools (works for any model), so every finished answer is a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import regex

from tidal.server.protocol import ApiError
from tidal.server.tool_parser import Call, ToolCallParser, ToolCallStream

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    tools: list[dict]  # validated OpenAI tool objects
    choice: str  # "none" | "auto" | "required" | "named"
    function: Optional[str] = None  # the named function
    parallel: bool = True
    parameters: dict[str, dict] = field(default_factory=dict)  # function name -> parameters schema

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def json_schema(self) -> Optional[dict]:
        """The schema the output must follow (required / named), else None."""
        if self.choice == "named":
            return self.parameters[self.function]
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in self.parameters.items()]
        array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return array


def _check_tool(t: Any, k: int) -> tuple[str, dict]:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise ApiError(f'tools[{k}] must be {{"type": "function", "function": {{"name": ..., ...}}}}')
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise ApiError(f"tools[{k}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ApiError(f"tools[{k}].function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = _EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise ApiError(f"tools[{k}].function.parameters must be a JSON Schema object")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ApiError(f"tools[{k}].function.strict must be a boolean")
    return name, params


def _choice(tool_choice: Any, has_tools: bool) -> tuple[str, Optional[str]]:
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ApiError(f'tool_choice must be "none", "auto", "required" or '
                           f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}')
        return tool_choice, None
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError('a named tool_choice must be {"type": "function", "function": {"name": ...}}')
    return "named", fn["name"]


def plan_tools(body: Any) -> ToolPlan:
    """The checked tool plan of a chat request; ApiError (400) on anything malformed."""
    if body.functions or body.function_call not in (None, "none", "auto"):
        raise ApiError("the legacy `functions` / `function_call` fields are not supported; use `tools` and `tool_choice`")
    tools = body.tools or []
    params: dict[str, dict] = {}
    for k, t in enumerate(tools):
        name, schema = _check_tool(t, k)
        if name in params:
            raise ApiError(f"tools: the function name {name!r} is given twice")
        params[name] = schema
    choice, function = _choice(body.tool_choice, bool(tools))
    if choice in ("required", "named") and not tools:
        raise ApiError(f"tool_choice {body.tool_choice!r} needs a non-empty `tools` list")
    if choice == "named" and function not in params:
        raise ApiError(f"tool_choice names the function {function!r}, which is not in tools "
                       f"({', '.join(params) or 'none'})")
    if choice in ("required", "named"):
        for key in ("response_format", "json_schema", "regex", "ebnf", "structural_tag"):
            value = getattr(body, key, None)
            if value is not None and not (key == "response_format" and value.get("type", "text") == "text"):
                raise ApiError(f"tool_choice {choice!r} constrains the output itself; it cannot be combined with {key}")
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolPlan(list(tools), choice, function, parallel, params)


def tool_sampling(plan: ToolPlan, parser: Optional[ToolCallParser], skip_special_tokens: Optional[bool]) -> dict:
    """Sampling fields the plan adds: the JSON schema of required / named, and for `auto` with a
    parser whose call marker is a special token (Llama 3's <|python_tag|>) special tokens kept
    in the text unless the request says otherwise."""
    schema = plan.json_schema()
    if schema is not None:
        return {"json_schema": json.dumps(schema)}
    if plan.choice == "auto" and plan.tools and parser is not None and parser.marker_is_special_token \
            and skip_special_tokens is None:
        return {"skip_special_tokens": False}
    return {}


def refuse_tools(body: Any) -> None:
    """400 for tool fields on /v1/completions (tools are a chat feature)."""
    if body.tools or body.functions or body.tool_choice not in (None, "none") \
            or body.function_call not in (None, "none"):
        raise ApiError("tools are only supported on /v1/chat/completions")


def template_tools(plan: ToolPlan) -> Optional[list[dict]]:
    """What the chat template's `tools` variable gets (None when the request has none)."""
    return plan.tools or None


def template_message(d: dict) -> dict:
    """A message for the chat template: an assistant's tool call arguments given as JSON text
    (OpenAI's wire form) become objects, the form chat templates iterate over."""
    calls = d.get("tool_calls")
    if d.get("role") != "assistant" or not isinstance(calls, list):
        return d
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        out.append(c)
    return {**d, "tool_calls": out}


# ---------------------------------------------------------------- the output


class _RequiredArrayParser(ToolCallParser):
    """The `required` output: `[{"name": ..., "parameters": {...}}, ...]` (schema-constrained)."""

    name = "required"
    _open, _next = regex.compile(r"\s*\["), regex.compile(r"\s*,")

    def call_start(self, text: str, pos: int, first: bool, after_call: bool) -> Optional[tuple[int, int]]:
        m = (self._open if first else self._next if after_call else None)
        hit = m.match(text, pos) if m is not None else None
        return (pos, hit.end()) if hit else None

    def held_from(self, text: str, pos: int, first: bool, after_call: bool) -> int:
        return pos  # nothing but calls is expected; the array's punctuation is never content

    def _step_past_empty_marker(self, text: str, pos: int, segs: list) -> int:
        return len(text)


def _call_dict(call: Call) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_calls" if called and reason == "stop" else reason


class ToolOutput:
    """Turns one choice's output text into the assistant message / stream deltas."""

    def __init__(self, plan: ToolPlan, parser: Optional[ToolCallParser]) -> None:
        self.plan = plan
        if plan.choice == "named":
            self.parser = None
        elif plan.choice == "required":
            self.parser = _RequiredArrayParser()
        else:
            self.parser = parser if plan.choice == "auto" and plan.tools else None
        self.stream: Optional[ToolCallStream] = None
        self.named_sent = -1  # named: argument chars sent; -1 before the call's first delta

    @property
    def active(self) -> bool:
        return self.plan.choice == "named" or self.parser is not None

    def message(self, text: str) -> dict:
        """The non-streaming assistant message (tool_calls only when there are calls)."""
        if self.plan.choice == "named":
            calls = [Call(self.plan.function, text.lstrip())]
            content = None
        elif self.parser is None:
            return {"role": "assistant", "content": text}
        else:
            content, calls = self.parser.parse(text)
            if self.plan.choice == "required":
                content = None if calls else text
            calls = calls if self.plan.parallel else calls[:1]
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [_call_dict(c) for c in calls]
        return msg

    def deltas(self, text: str, final: bool) -> list[dict]:
        """Stream deltas for the output so far (`text` is the whole text, not a delta)."""
        if self.plan.choice == "named":
            return self._named_deltas(text)
        if self.stream is None:
            self.stream = ToolCallStream(self.parser, new_call_id)
        out = self.stream.feed(text[len(self.stream.text):], final=final)
        if self.plan.choice == "required":
            out = [d for d in out if "tool_calls" in d]
        if not self.plan.parallel:  # parallel_tool_calls false: the first call only
            out = [d for d in out if d.get("tool_calls", [{"index": 0}])[0]["index"] == 0]
        return out

    def _named_deltas(self, text: str) -> list[dict]:
        args = text.lstrip()
        out = []
        if self.named_sent < 0 and args:
            self.named_sent = 0
            out.append({"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function",
                                        "function": {"name": self.plan.function, "arguments": ""}}]})
        if self.named_sent >= 0 and len(args) > self.named_sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": args[self.named_sent:]}}]})
            self.named_sent = len(args)
        return out

    @property
    def called(self) -> bool:
        if self.plan.choice == "named":
            return self.named_sent >= 0
        return self.stream is not None and self.stream.called

