"""Tool-call parsers (tidal.server.tool_parser): whole-text parsing and streaming that does
not depend on where the text is split."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from tidal.server.tool_parser import Call, ToolCallStream, get_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "nested": {"a": [1, "}]\\""]}}}'

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", f"Let me check.\n\n<tool_call>{WEATHER}</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
     "Let me check.",
     [("get_weather", '{"city": "Paris", "unit": "c"}'),
      ("get_time", '{"tz": "Europe/Paris", "nested": {"a": [1, "}]\\""]}}')]),
    ("hermes", f"<tool_call>{WEATHER}</tool_call>\nDone.", "Done.", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', None, [("f", '{"x": 1}')]),
    ("hermes", "a < b and <tool_ca are not calls", "a < b and <tool_ca are not calls", []),
    # malformed: stays content, verbatim
    ("hermes", "<tool_call>{\"name\": get_weather}</tool_call>", "<tool_call>{\"name\": get_weather}</tool_call>", []),
    ("hermes", "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ("hermes", '<tool_call>{"name": "f"</tool_call>', '<tool_call>{"name": "f"</tool_call>', []),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v;w"}}', None,
     [("a", "{}"), ("b", '{"k": "v;w"}')]),
    ("llama3", ' \n{"name": "a", "parameters": {"q": 1}} ;{"name": "b", "arguments": {}}', None, [("a", '{"q": 1}'), ("b", "{}")]),
    ("llama3", 'Sure: <|python_tag|>{"name": "a", "parameters": {}}', "Sure:", [("a", "{}")]),
    ("llama3", 'The set {"name": x} is not a call', 'The set {"name": x} is not a call', []),
    ("llama3", '{not a call} at all', '{not a call} at all', []),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": [1]}', '<|python_tag|>{"name": "a", "parameters": [1]}', []),
]


def _joined(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    content, calls, heads = "", {}, []
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["type"] == "function" and tc["function"]["arguments"] == "" and tc["index"] == len(calls)
                heads.append(tc)
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content or None, [tuple(c) for c in calls.values()], heads


def _stream(parser_name: str, pieces: list[str]) -> list[dict]:
    ids = (f"call_{i}" for i in itertools.count())
    st = ToolCallStream(get_parser(parser_name), lambda: next(ids))
    out = []
    for p in pieces:
        out += st.feed(p)
    return out + st.feed("", final=True)


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_parse_whole_text(parser_name, text, content, calls):
    got_content, got_calls = get_parser(parser_name).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_stream_equals_whole_at_every_split(parser_name, text, content, calls):
    expected = (content, calls)
    assert _joined(_stream(parser_name, [text]))[:2] == expected
    assert _joined(_stream(parser_name, list(text)))[:2] == expected  # one char at a time
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            assert _joined(_stream(parser_name, [text[:i], text[i:j], text[j:]]))[:2] == expected, (i, j)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _joined(_stream(parser_name, pieces))[:2] == expected


def test_stream_sends_name_first_then_argument_fragments():
    text = f"Hi <tool_call>{WEATHER}</tool_call>"
    deltas = _stream("hermes", list(text))
    content, calls, heads = _joined(deltas)
    assert heads[0]["function"]["name"] == "get_weather" and heads[0]["id"] == "call_0"
    assert len([d for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]) > 5  # streamed
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("content" in d for d in deltas[:first_call])


def test_stream_holds_back_a_possible_marker_until_decided():
    st = ToolCallStream(get_parser("hermes"), lambda: "call_x")
    assert st.feed("Hello <tool") == [{"content": "Hello"}]
    assert st.feed("box>") == [{"content": " <toolbox>"}]
    assert st.feed(" <tool_call>{\"na") == []
    assert st.feed("me\": \"f\", \"arguments\": ") == []
    assert st.feed("{\"a") == [{"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                                 "function": {"name": "f", "arguments": ""}}]},
                               {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a"}}]}]


def test_stream_call_broken_after_its_name_ends_there():
    # not taken back: the name was sent; the arguments are what was written before the break
    text = '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'
    content, calls, _ = _joined(_stream("hermes", list(text)))
    assert calls == [("f", '{"a": }')]
    assert get_parser("hermes").parse(text) == (text, [])  # non-streaming: strict, all content


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("nope")
    assert get_parser(None) is None and get_parser("none") is None
    assert isinstance(get_parser("qwen25").parse("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>")[1][0], Call)


def test_streaming_work_does_not_grow_with_the_text_so_far(monkeypatch):
    """Each update resumes where the last stopped: a call's JSON scan from its memo, the search for calls
    after the last closed one. Counted, not timed: the characters the JSON scan reads and the calls
    scanned stay linear in the text, where re-scanning it at every update made them quadratic."""
    from tidal.server import tool_parser

    read, scans = [0], [0]
    json_end, scan_call = tool_parser._json_object_end, tool_parser.ToolCallParser.scan_call

    def counting_json_end(text, i, memo=None):
        before = memo.get(i, (i,))[0] if memo is not None else i
        end = json_end(text, i, memo)
        read[0] += (memo[i][0] if memo is not None else (end or len(text))) - before
        return end

    def counting_scan_call(self, text, body):
        scans[0] += 1
        return scan_call(self, text, body)

    monkeypatch.setattr(tool_parser, "_json_object_end", counting_json_end)
    monkeypatch.setattr(tool_parser.ToolCallParser, "scan_call", counting_scan_call)
    long_call = '<tool_call>{"name": "run", "arguments": %s}</tool_call>' % json.dumps({"code": "x = 1\n" * 1300})
    many = "\n".join('<tool_call>{"name": "f", "arguments": {"i": %d}}</tool_call>' % i for i in range(150))
    for text in (long_call, many):
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
        read[0] = scans[0] = 0
        deltas = _stream("hermes", pieces)
        assert read[0] <= len(text) and scans[0] <= len(pieces) + 2 * text.count("<tool_call>") + 1
        assert _joined(deltas)[:2] == (lambda c, calls: (c, [(x.name, x.arguments) for x in calls]))(
            *get_parser("hermes").parse(text))
