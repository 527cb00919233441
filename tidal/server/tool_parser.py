"""Tool-call parsers: model output text -> (content, tool calls), whole or streamed.

A parser describes one model family's format (where a call starts, how it closes); one
analysis (`ToolCallParser.analyze`) serves both modes:

- non-streaming (`parse`): strict. A call counts only when it is complete and well formed
  (its arguments parse as a JSON object); anything else stays content, verbatim.
- streaming (`ToolCallStream`): the same analysis on the text so far, told which part may
  still grow. Text that could be the start of a call marker, and whitespace that might sit
  right before a call, are held back until decided. A call is announced once its name is
  complete; its arguments are then streamed as the model writes them. For every output
  whose calls are well formed the joined deltas equal the non-streaming result, however the
  text is split. A call that turns out malformed after its name was sent cannot be taken
  back: it ends where the JSON broke and the rest streams as content.

Content is the text outside calls; whitespace that touches a call belongs to the call.
Arguments are passed on exactly as the model wrote them (re-serialized only for a call whose
`name` does not come first, which is announced once complete).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Optional, Union

import regex

NAME_ARGS = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'


@dataclass
class Content:
    text: str


@dataclass
class Call:
    name: str
    arguments: str  # raw JSON text; complete unless the call is still growing or was cut
    complete: bool = True


Segment = Union[Content, Call]


@dataclass
class Settled:
    """How far a growing text is decided for good: the segments before `pos` (streaming)."""

    pos: int = 0
    after_call: bool = False
    segs: list = field(default_factory=list)


@dataclass
class _Scan:
    status: str  # "ok" | "partial" | "bad"
    name: Optional[str] = None  # set once the name is known (the call may be announced)
    arguments: str = ""
    end: int = 0  # ok: where the call ends; bad with a name: where the JSON broke


def _json_object_end(text: str, i: int, memo: Optional[dict] = None) -> Optional[int]:
    """The index just past the JSON object starting at text[i] == '{', or None if the text
    ends first (strings and escapes respected; the content is checked later by json.loads).
    `memo` (streaming, where the text only grows) keeps each scan's progress by its start."""
    k, depth, in_str, esc, end = memo.get(i, (i, 0, False, False, None)) if memo is not None else (i, 0, False, False, None)
    while end is None and k < len(text):
        ch = text[k]
        k += 1
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                end = k
    if memo is not None:
        memo[i] = (k, depth, in_str, esc, end)
    return end


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _loads_object(raw: str) -> Optional[dict]:
    try:
        v = json.loads(raw)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


class ToolCallParser:
    """One format. Subclasses set `markers` (strings that open a call anywhere in the text)
    and `close` (a regex matched after a call's JSON object, e.g. the closing tag)."""

    name = ""
    markers: tuple[str, ...] = ()
    marker_is_special_token = False  # then the text must keep special tokens for calls to be found
    close = regex.compile(r"")
    header = regex.compile(NAME_ARGS)

    def __init__(self) -> None:
        self._close_after_args = regex.compile(r"\s*\}" + self.close.pattern)  # the call object's own `}`
        self.scan_memo: Optional[dict] = None  # set by ToolCallStream: the text only grows

    # ---------------------------------------------------------------- format hooks

    def call_start(self, text: str, pos: int, first: bool, after_call: bool) -> Optional[tuple[int, int]]:
        """(start, body) of the next call opening at or after pos: its marker spans [start, body)."""
        hits = [(text.find(m, pos), m) for m in self.markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if not hits:
            return None
        i, m = min(hits)
        return i, i + len(m)

    def held_from(self, text: str, pos: int, first: bool, after_call: bool) -> int:
        """Where text that might still become a call (a marker's beginning) starts."""
        cut = len(text)
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text) - pos), 0, -1):
                if m.startswith(text[len(text) - k:]):
                    cut = min(cut, len(text) - k)
                    break
        return cut

    # ---------------------------------------------------------------- one call

    def scan_call(self, text: str, body: int) -> _Scan:
        m = self.header.match(text, body, partial=True)
        if m is None:
            return self._scan_whole_object(text, body)
        if m.partial:
            return _Scan("partial")
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return _Scan("bad")
        start = m.end() - 1  # the arguments object's `{`
        end = _json_object_end(text, start, self.scan_memo)
        if end is None:
            return _Scan("partial", name, text[start:])
        args = text[start:end]
        if _loads_object(args) is None:
            return _Scan("bad", name, args, end)
        c = self._close_after_args.match(text, end, partial=True)
        if c is None:
            return _Scan("bad", name, args, end)
        return _Scan("partial" if c.partial else "ok", name, args, c.end())

    def _scan_whole_object(self, text: str, body: int) -> _Scan:
        """A call whose keys come in another order: decided only once its object is complete."""
        start = _skip_ws(text, body)
        if start == len(text):
            return _Scan("partial")
        if text[start] != "{":
            return _Scan("bad")
        end = _json_object_end(text, start, self.scan_memo)
        if end is None:
            return _Scan("partial")
        obj = _loads_object(text[start:end])
        args = obj.get("arguments", obj.get("parameters", {})) if obj else None
        if not obj or not isinstance(obj.get("name"), str) or not isinstance(args, dict) or len(obj) > 2:
            return _Scan("bad")
        c = self.close.match(text, end, partial=True)
        if c is None:
            return _Scan("bad")
        if c.partial:
            return _Scan("partial")
        return _Scan("ok", obj["name"], json.dumps(args, ensure_ascii=False), c.end())

    # ---------------------------------------------------------------- the whole text

    def analyze(self, text: str, final: bool, strict: bool, settled: Optional[Settled] = None) -> list[Segment]:
        """Segments of `text`. final=False: the text may still grow, so only what is decided
        is returned (held text left out). strict=False: a call is kept from the moment its
        name is known (streaming). `settled` (a growing text's) resumes after the calls already
        closed, and is moved past each call closed now."""
        settled = settled or Settled()
        segs: list[Segment] = list(settled.segs)
        pos, after_call = settled.pos, settled.after_call
        while True:
            first = not segs and pos == 0
            hit = self.call_start(text, pos, first, after_call)
            if hit is None:
                tail_end = len(text) if final else self._held(text, pos, first, after_call)
                self._add_content(segs, text[pos:tail_end], after_call, before_call=False)
                return segs
            start, body = hit
            scan = self.scan_call(text, body)
            if scan.status == "partial" and not final:
                self._add_content(segs, text[pos:start], after_call, before_call=True)
                if scan.name is not None and not strict:
                    segs.append(Call(scan.name, scan.arguments, complete=False))
                return segs
            if scan.status == "ok":
                self._add_content(segs, text[pos:start], after_call, before_call=True)
                segs.append(Call(scan.name, scan.arguments))
                pos, after_call = scan.end, True
                settled.pos, settled.after_call, settled.segs = pos, True, list(segs)
                continue
            if scan.name is not None and not strict:  # announced already: cut the call here
                self._add_content(segs, text[pos:start], after_call, before_call=True)
                segs.append(Call(scan.name, scan.arguments, complete=False))
                if scan.status == "partial":  # final: the output ended inside the call
                    return segs
                pos, after_call = scan.end, True
                settled.pos, settled.after_call, settled.segs = pos, True, list(segs)
                continue
            # not a call: its marker is content, and the search goes on after it
            self._add_content(segs, text[pos:body], after_call, before_call=False)
            pos, after_call = body, False
            if body == start:
                pos = self._step_past_empty_marker(text, pos, segs)

    def _step_past_empty_marker(self, text: str, pos: int, segs: list[Segment]) -> int:
        raise AssertionError(f"{self.name}: a call opening with no marker must override this")

    def _held(self, text: str, pos: int, first: bool, after_call: bool) -> int:
        cut = self.held_from(text, pos, first, after_call)
        while cut > pos and text[cut - 1].isspace():  # whitespace right before a call is the call's
            cut -= 1
        return max(cut, pos)

    @staticmethod
    def _add_content(segs: list[Segment], text: str, after_call: bool, before_call: bool) -> None:
        if after_call:
            text = text.lstrip()
        if before_call:
            text = text.rstrip()
        if text:
            if segs and isinstance(segs[-1], Content):
                segs[-1] = Content(segs[-1].text + text)
            else:
                segs.append(Content(text))

    # ---------------------------------------------------------------- results

    def parse(self, text: str) -> tuple[Optional[str], list[Call]]:
        """Non-streaming: (content or None when there is none, the well-formed calls)."""
        segs = self.analyze(text, final=True, strict=True)
        content = "".join(s.text for s in segs if isinstance(s, Content))
        return (content or None), [s for s in segs if isinstance(s, Call)]


class HermesParser(ToolCallParser):
    """Hermes / Qwen 2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number."""

    name = "hermes"
    markers = ("<tool_call>",)
    close = regex.compile(r"\s*</tool_call>")


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`. Without the tag a call must open the output
    (leading whitespace aside): a `{` inside prose is prose."""

    name = "llama3"
    markers = ("<|python_tag|>",)
    marker_is_special_token = True
    close = regex.compile(r"")
    _separator = regex.compile(r"\s*;")

    def call_start(self, text: str, pos: int, first: bool, after_call: bool) -> Optional[tuple[int, int]]:
        if after_call:
            m = self._separator.match(text, pos)
            if m:
                return pos, m.end()
        if first:
            i = _skip_ws(text, pos)
            if i < len(text) and text[i] == "{":
                return i, i
        return super().call_start(text, pos, first, after_call)

    def held_from(self, text: str, pos: int, first: bool, after_call: bool) -> int:
        if first and not text[pos:].strip():
            return pos  # nothing but whitespace yet: the output may still open with a call
        return super().held_from(text, pos, first, after_call)

    def _step_past_empty_marker(self, text: str, pos: int, segs: list[Segment]) -> int:
        # a leading `{` that is not a call: it and the text after it are content
        end = _skip_ws(text, pos) + 1
        ToolCallParser._add_content(segs, text[pos:end], False, False)
        return end


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen": HermesParser,
    "llama3": Llama3JsonParser,
    "llama3_json": Llama3JsonParser,
}


def get_parser(name: Optional[str]) -> Optional[ToolCallParser]:
    """The parser for `--tool-call-parser` (None: no parsing; calls stay in the content)."""
    if name is None or name == "none":
        return None
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


# ---------------------------------------------------------------- streaming


class ToolCallStream:
    """Incremental parser for one choice: feed the text deltas, get OpenAI delta dicts.

    Each call's first delta carries index, id, type and name with empty arguments; later
    ones carry argument fragments only. Call ids come from `new_id`.
    """

    def __init__(self, parser: ToolCallParser, new_id) -> None:
        self.parser = copy.copy(parser)  # its own scan memo; `parser` stays usable for whole texts
        self.parser.scan_memo = {}
        self.settled = Settled()
        self.new_id = new_id
        self.text = ""
        self.content_sent = 0
        self.args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.args_sent)

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        self.text += delta
        segs = self.parser.analyze(self.text, final=final, strict=False, settled=self.settled)
        out: list[dict] = []
        content_at, k = 0, 0
        for seg in segs:
            if isinstance(seg, Content):
                new = seg.text[max(0, self.content_sent - content_at):]
                content_at += len(seg.text)
                if new:
                    out.append({"content": new})
                    self.content_sent = content_at
                continue
            if k == len(self.args_sent):
                self.args_sent.append(0)
                out.append({"tool_calls": [{"index": k, "id": self.new_id(), "type": "function",
                                            "function": {"name": seg.name, "arguments": ""}}]})
            frag = seg.arguments[self.args_sent[k]:]
            if frag:
                self.args_sent[k] = len(seg.arguments)
                out.append({"tool_calls": [{"index": k, "function": {"arguments": frag}}]})
            k += 1
        return out
