"""Tool calling on a real server with the default model (SmolLM2-135M, which does not call
tools by itself), through the `openai` client, streaming and not: named and required
tool_choice (constrained to the tools' schemas), auto with the hermes parser (the call forced
by a regex), none, and the 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from servers import Server

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Use a tool."}]
FORCED = '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>'


@pytest.fixture(scope="module")
def server():
    s = Server("--tool-call-parser", "hermes", "--torch-threads", "1", "--chunked-prefill-size", "64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def create(client, stream: bool, **kw):
    """A chat completion as (message dict, finish_reason), streamed or not; a stream is joined
    the way a client joins OpenAI's deltas and checked to have OpenAI's shape."""
    args = {"model": "default", "messages": MESSAGES, "max_tokens": 64, "temperature": 0, **kw}
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in m.tool_calls or []]
        return {"content": m.content, "tool_calls": calls}, r.choices[0].finish_reason
    content, calls, reason = None, [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        if ch.delta.content:
            content = (content or "") + ch.delta.content
        for tc in ch.delta.tool_calls or []:
            if tc.id is not None:  # a call's first delta: index, id, type, name, empty arguments
                assert tc.index == len(calls) and tc.type == "function" and tc.function.arguments == ""
                calls.append({"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": ""}})
            else:  # then argument fragments only
                assert tc.function.name is None and tc.type is None
                calls[tc.index]["function"]["arguments"] += tc.function.arguments
        reason = ch.finish_reason or reason
    return {"content": content, "tool_calls": calls}, reason


def check_calls(calls: list[dict]) -> list[tuple[str, dict]]:
    """Every call well formed and its arguments valid against its function's schema."""
    out = []
    for c in calls:
        assert c["id"].startswith("call_") and len(c["id"]) > 8 and c["type"] == "function"
        args = json.loads(c["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[c["function"]["name"]])
        out.append((c["function"]["name"], args))
    assert len({c["id"] for c in calls}) == len(calls)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_choice_none_answers_plain_content(client, stream):
    msg, reason = create(client, stream, tools=TOOLS, tool_choice="none", max_tokens=12)
    plain, plain_reason = create(client, stream, max_tokens=12)
    assert msg == plain and msg["tool_calls"] == [] and msg["content"]  # the template ignores tools
    assert reason == plain_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_without_a_call_keeps_the_text_as_content(client, stream):
    msg, reason = create(client, stream, tools=TOOLS, max_tokens=12)
    plain, _ = create(client, stream, max_tokens=12)
    assert msg == plain and reason == "length"


def test_a_conversation_with_tool_calls_and_results_is_accepted(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees, sunny"}]
    msg, _ = create(client, False, messages=messages, tools=TOOLS, max_tokens=8)
    assert msg["content"]


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "needs a non-empty `tools`"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "needs a non-empty `tools`"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0] must be"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice must be"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, "the tools' parameters schemas"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
]


@pytest.mark.parametrize("extra,message", BAD)
def test_malformed_tools_are_400(server, extra, message):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "BadRequestError" and err["code"] == 400


def test_openai_client_gets_bad_request_and_completions_refuse_tools(client, server):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "other"}})
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and "only supported on /v1/chat/completions" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------- constrained: named / required


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_answers_a_valid_call_streamed_or_not(client, name):
    named = {"type": "function", "function": {"name": name}}
    whole, reason = create(client, False, tools=TOOLS, tool_choice=named)
    assert reason == "tool_calls" and whole["content"] is None
    assert [n for n, _ in check_calls(whole["tool_calls"])] == [name]
    streamed, reason = create(client, True, tools=TOOLS, tool_choice=named)
    assert reason == "tool_calls" and streamed["content"] is None
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_tool_choice_answers_valid_calls(client, stream):
    msg, reason = create(client, stream, tools=TOOLS, tool_choice="required", max_tokens=160)
    assert reason == "tool_calls" and msg["content"] is None
    assert len(check_calls(msg["tool_calls"])) >= 1
    one, reason = create(client, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls" and len(check_calls(one["tool_calls"])) == 1


def test_required_with_sampling_stays_valid(client):
    for seed in range(2):
        msg, reason = create(client, False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                             temperature=1.0, seed=seed)
        assert reason == "tool_calls" and len(check_calls(msg["tool_calls"])) == 1


def test_each_of_n_choices_gets_its_own_calls(client, server):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "n": 2,
            "max_tokens": 64, "temperature": 1.0, "seed": 7}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        assert c["finish_reason"] == "tool_calls" and len(check_calls(c["message"]["tool_calls"])) == 1
    calls: dict[int, list] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    for tc in ch["delta"].get("tool_calls", []):
                        if "id" in tc:
                            calls.setdefault(ch["index"], []).append(dict(tc, function=dict(tc["function"])))
                        else:
                            calls[ch["index"]][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == [0, 1] and all(len(check_calls(v)) == 1 for v in calls.values())


# ---------------------------------------------------------------- auto with the hermes parser


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_parses_a_hermes_call(client, stream):
    msg, reason = create(client, stream, tools=TOOLS, extra_body={"regex": FORCED})
    assert reason == "tool_calls" and msg["content"] is None
    assert check_calls(msg["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_keeps_text_before_calls_as_content(client, stream):
    regex = "Checking\\. " + FORCED + "\\n" + FORCED.replace("Paris", "Rome")
    msg, reason = create(client, stream, tools=TOOLS, extra_body={"regex": regex})
    assert reason == "tool_calls" and msg["content"] == "Checking."
    assert check_calls(msg["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_none_with_the_forced_call_text_leaves_it_as_content(client):
    msg, reason = create(client, False, tools=TOOLS, tool_choice="none", extra_body={"regex": FORCED})
    assert msg["tool_calls"] == [] and reason == "stop"
    assert msg["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
