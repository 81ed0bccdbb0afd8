"""The pieces of tool calling that need no model: a constrained answer streamed as tool call
deltas piece by piece (whatever the pieces), calls parsed from an answer, and the messages a
template without tools gets."""

from __future__ import annotations

import json

import pytest

from loraplex.server.schemas.openai import ChatCompletionRequest
from loraplex.server.tools import (
    ToolCallStream,
    ToolMode,
    chat_messages,
    may_become_call,
    parse_tool_calls,
    tool_constraint,
    tool_mode,
)

NAMES = ("get_weather", "get_time")
ANSWER = ('[{"name":"get_weather","arguments":{"city":"Pa\\"ris}","unit":"celsius","days":[1,{"a":2}]}},'
          '{"name":"get_time","arguments":{}}]')


def request(**fields) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
             for name in NAMES]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools} | fields)


@pytest.mark.parametrize("piece", [1, 3, 7, len(ANSWER)])
def test_a_streamed_array_of_calls_becomes_deltas_whatever_the_pieces(piece: int) -> None:
    stream = ToolCallStream(ToolMode("required", names=NAMES))
    calls: dict[int, dict] = {}
    for start in range(0, len(ANSWER), piece):
        for delta in stream.push(ANSWER[start:start + piece]):
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.id is not None:
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
    expected = json.loads(ANSWER)
    assert [c["name"] for c in calls.values()] == [c["name"] for c in expected]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [c["arguments"] for c in expected]


def test_a_named_function_streams_its_arguments_as_they_come() -> None:
    stream = ToolCallStream(ToolMode("named", function="get_time", names=NAMES))
    first, second = stream.push('{"a"'), stream.push(":1}")
    assert first[0].id and first[0].function.name == "get_time" and first[1].function.arguments == '{"a"'
    assert [d.function.arguments for d in second] == [":1}"] and second[0].id is None


def test_calls_are_parsed_from_an_answer() -> None:
    required = ToolMode("required", names=NAMES)
    assert [c.function.name for c in parse_tool_calls(required, ANSWER)] == ["get_weather", "get_time"]
    auto = ToolMode("auto", names=NAMES)
    hermes = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
    assert [c.function.arguments for c in parse_tool_calls(auto, hermes)] == ["{}"]
    assert parse_tool_calls(auto, "It is sunny.") is None
    assert parse_tool_calls(auto, '[{"name": "unknown", "arguments": {}}]') is None
    assert parse_tool_calls(ToolMode("none", names=NAMES), ANSWER) is None
    assert may_become_call("  [") and may_become_call("<tool") and not may_become_call("Sure")


def test_required_and_named_constrain_the_output() -> None:
    body = request(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(tool_constraint(body, tool_mode(body)).json_schema)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    body = request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    spec = tool_constraint(body, tool_mode(body))
    assert json.loads(spec.json_schema) == {"type": "object"} and spec.param == "tools.1.function.parameters"
    assert tool_constraint(request(), tool_mode(request())) is None  # auto: free


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    body = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
    messages, tools = chat_messages(body, takes_tools=False)
    assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '[{"name":"get_time","arguments":{}}]'}
    assert messages[3] == {"role": "tool", "content": "12:00"}
    messages, tools = chat_messages(body, takes_tools=True)
    assert [t["function"]["name"] for t in tools] == list(NAMES) and messages[0]["role"] == "user"
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {}}
    assert messages[2]["tool_call_id"] == "c1"
