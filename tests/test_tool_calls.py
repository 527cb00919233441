"""Tool calling's request side (tidal.server.tool_calls): checks, the JSON schema that
required / named tool_choice decode under, the chat template's `tools`, and the output
turned into `tool_calls`."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tidal.config import default_model_path
from tidal.model.tokenizer import load_tokenizer
from tidal.server.openai_api import chat_prompt
from tidal.server.protocol import ApiError, ChatCompletionRequest, parse_body
from tidal.server.tool_calls import ToolOutput, plan_tools, tool_sampling
from tidal.server.tool_parser import get_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def request(**kw) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({"messages": MESSAGES, **kw}).encode())


def test_default_choice_is_auto_with_tools_and_none_without():
    assert plan_tools(request(tools=[WEATHER])).choice == "auto"
    assert plan_tools(request()).choice == "none"
    assert plan_tools(request(tools=[WEATHER], tool_choice="none")).json_schema() is None
    assert plan_tools(request(tools=[WEATHER])).json_schema() is None


@pytest.mark.parametrize("kw,message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "needs a non-empty `tools`"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "needs a non-empty `tools`"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "named tool_choice must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "parameters must be"),
    ({"tools": [WEATHER, WEATHER]}, "given twice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"}, "cannot be combined"),
    ({"functions": [WEATHER["function"]]}, "legacy"),
])
def test_malformed_tool_requests_are_refused(kw, message):
    with pytest.raises(ApiError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        plan_tools(request(**kw))
    assert e.value.status_code == 400


def _calls_from_required_output(plan, text):
    return ToolOutput(plan, None).message(text)


def test_named_schema_is_the_functions_parameters_and_the_output_is_its_arguments():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert plan.json_schema() == TIME["function"]["parameters"]
    msg = ToolOutput(plan, None).message('{"tz": "UTC"}')
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}


def test_required_schema_accepts_calls_of_the_tools_only():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"))
    schema = plan.json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "UTC"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"tz": "UTC"}}], [{"name": "other", "parameters": {}}],
                [{"name": "get_time", "parameters": {"tz": "UTC"}, "x": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)).json_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    jsonschema.validate(good[:1], single)


def test_required_output_becomes_tool_calls_whole_and_streamed():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"))
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "UTC"}}]'
    msg = ToolOutput(plan, None).message(text)
    assert msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    out = ToolOutput(plan, None)
    deltas = [d for i in range(1, len(text) + 1) for d in out.deltas(text[:i], final=i == len(text))]
    assert all(set(d) == {"tool_calls"} for d in deltas)
    args = {}
    for d in deltas:
        tc = d["tool_calls"][0]
        args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert [args[0], args[1]] == [c["function"]["arguments"] for c in msg["tool_calls"]]
    assert out.called


def test_auto_uses_the_servers_parser_and_none_does_not():
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    auto = ToolOutput(plan_tools(request(tools=[WEATHER])), get_parser("hermes")).message(text)
    assert auto["content"] == "Sure." and auto["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    none = ToolOutput(plan_tools(request(tools=[WEATHER], tool_choice="none")), get_parser("hermes")).message(text)
    assert none == {"role": "assistant", "content": text}
    no_parser = ToolOutput(plan_tools(request(tools=[WEATHER])), None).message(text)
    assert no_parser == {"role": "assistant", "content": text}


# A tool-aware chat template (the shape of Hermes/Qwen-style templates).
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "({{ c.function.arguments.city }})</tool_call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_gets_tools_tool_calls_and_tool_results():
    tok = load_tokenizer(default_model_path(), None)
    tok.chat_template = TOOLS_TEMPLATE
    body = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}])
    prompt = chat_prompt(tok, body.messages, plan_tools(body).tools)
    assert prompt.startswith('<tools>get_weather:{"properties":') or prompt.startswith('<tools>get_weather:{"type"')
    assert "<tool_call>get_weather(Paris)</tool_call>" in prompt  # arguments given to the template as an object
    assert "<|im_start|>tool\n18C[for call_1]<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_auto_without_parallel_tool_calls_answers_the_first_call_only():
    one = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    text = one % "Paris" + "\n" + one % "Rome"
    plan = plan_tools(request(tools=[WEATHER], parallel_tool_calls=False))
    msg = ToolOutput(plan, get_parser("hermes")).message(text)
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"city": "Paris"}']
    out = ToolOutput(plan, get_parser("hermes"))
    deltas = [d for i in range(1, len(text) + 1) for d in out.deltas(text[:i], final=i == len(text))]
    assert {d["tool_calls"][0]["index"] for d in deltas} == {0}
    both = ToolOutput(plan_tools(request(tools=[WEATHER])), get_parser("hermes")).message(text)
    assert len(both["tool_calls"]) == 2


def test_sampling_gets_the_schema_or_keeps_special_tokens_for_a_special_marker():
    named = plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(tool_sampling(named, get_parser("hermes"), None)["json_schema"]) == WEATHER["function"]["parameters"]
    auto = plan_tools(request(tools=[WEATHER]))
    assert tool_sampling(auto, get_parser("llama3"), None) == {"skip_special_tokens": False}  # <|python_tag|>
    assert tool_sampling(auto, get_parser("llama3"), True) == {}  # the client's choice stands
    assert tool_sampling(auto, get_parser("hermes"), None) == {}  # <tool_call> is ordinary text
    assert tool_sampling(auto, None, None) == {}
    assert tool_sampling(plan_tools(request(tools=[WEATHER], tool_choice="none")), get_parser("llama3"), None) == {}
