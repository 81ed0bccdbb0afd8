"""Structured outputs through the official `openai` client against a real `loraplex serve` on the
quick start (SmolLM2-135M-Instruct and its three trained adapters): `chat.completions.parse`
with a Pydantic model gives a parsed object 20 of 20 times on each model, `json_object` answers
parse 20 of 20, vLLM's fields constrain completions, a constraint that cannot compile is a 400
naming its field; tool calls with `tool_choice="required"` carry arguments valid against their
schema 20 of 20, streamed (as deltas) and not, a named function is called, tool results go back
in `tool` messages. The parses on the four models are asked for together, one batch for the
engine (`parsed`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.quickstart.conftest import copy_quickstart
from tests.server.test_serve_cli import loraplex_serve

MODELS = ["SmolLM2-135M-Instruct", "extract", "pirate", "sentiment"]
SENTENCE = "Extract JSON (name, age, city): Sofia is 41 years old and lives in Madrid."
NUM_TRIES = 20


Words = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z ]{0,23}$")]


class Person(BaseModel):
    """Its strings are bounded: the sentiment adapter, trained to answer one word, never ends an
    open string of its own will (it writes `positivenegativenegative...` to the token limit)."""

    name: Words
    age: int
    city: Words


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    data_dir = copy_quickstart(tmp_path_factory.mktemp("structured") / "data")
    with loraplex_serve(data_dir, "--max-num-seqs", str(len(MODELS) * NUM_TRIES)) as served:
        key = (Path(data_dir) / "demo-api-key").read_text().strip()
        yield openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=300)


def in_parallel(count: int, ask) -> list:
    """`ask(i)` for i < count, sent together (the engine batches them)."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(ask, range(count)))


@pytest.fixture(scope="module")
def parsed(client: openai.OpenAI) -> dict[str, list[tuple[str, str | None, Person | None]]]:
    """Model -> NUM_TRIES (finish reason, text, parsed Person) of parses with the Pydantic model,
    those of all the models sent together: one batch for the engine, where a batch a model took
    270 s against 196 s on a loaded 2-core machine. On a client of their own, whose connections
    close after: the other tests' clients reuse none left idle here (a reused connection that the
    server closes as idle in the meantime is a connection error)."""

    def ask(i: int) -> tuple[str, str | None, Person | None]:
        completion = batch_client.chat.completions.parse(
            model=MODELS[i // NUM_TRIES], messages=[{"role": "user", "content": SENTENCE}],
            response_format=Person, max_tokens=120, temperature=0.7, seed=i % NUM_TRIES)
        choice = completion.choices[0]
        return choice.finish_reason, choice.message.content, choice.message.parsed

    with openai.OpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0,
                       timeout=client.timeout) as batch_client:
        answers = in_parallel(len(MODELS) * NUM_TRIES, ask)
    return {model: answers[k * NUM_TRIES:(k + 1) * NUM_TRIES] for k, model in enumerate(MODELS)}


@pytest.mark.parametrize("model", MODELS)
def test_parse_with_a_pydantic_model_gives_an_object_every_time(parsed: dict[str, list], model: str) -> None:
    for finish_reason, text, _ in parsed[model]:
        assert finish_reason == "stop", text
    people = [person for _, _, person in parsed[model]]
    assert all(isinstance(person, Person) for person in people), people
    if model == "extract":  # the adapter trained on this task gets it right
        assert sum(p == Person(name="Sofia", age=41, city="Madrid") for p in people) >= NUM_TRIES // 2


def test_json_object_answers_parse_every_time(client: openai.OpenAI) -> None:
    """On the base model. Free JSON need not end: the adapters, each trained to one kind of
    answer, do not (sentiment never closes a string, extract nests objects to the token limit);
    a schema is what bounds them (the parse test above)."""

    def ask(i: int) -> str:
        completion = client.chat.completions.create(
            model=MODELS[0], response_format={"type": "json_object"},
            messages=[{"role": "user", "content": 'A cat\'s name and colour, as a JSON object with keys '
                       '"name" and "colour".'}], max_tokens=200, temperature=0.7, seed=i)
        return completion.choices[0].message.content

    answers = in_parallel(NUM_TRIES, ask)
    assert all(isinstance(json.loads(answer), dict) for answer in answers), answers


def test_vllm_fields_constrain_completions_and_chat(client: openai.OpenAI) -> None:
    def complete(**extra) -> str:
        return client.completions.create(model="sentiment", prompt="Review: The kettle is awful. Sentiment:",
                                         max_tokens=20, temperature=1.0, extra_body=extra).choices[0].text

    assert complete(structured_outputs={"choice": ["positive", "negative"]}) in ("positive", "negative")
    assert complete(guided_choice=["good", "bad"]) in ("good", "bad")
    assert re.fullmatch(r"[0-9]{3}", complete(guided_regex="[0-9]{3}"))
    assert re.fullmatch(r"(yes|no)!", complete(structured_outputs={"grammar": 'root ::= ("yes" | "no") "!"'}))
    schema = {"type": "object", "properties": {"score": {"type": "integer"}}, "required": ["score"]}
    assert isinstance(json.loads(complete(guided_json=schema) or "null")["score"], int)
    chat = client.chat.completions.create(
        model="extract", messages=[{"role": "user", "content": SENTENCE}], max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": Person.model_json_schema()}})
    assert Person.model_validate_json(chat.choices[0].message.content).city == "Madrid"


def test_a_streamed_constrained_answer_parses(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="extract", messages=[{"role": "user", "content": SENTENCE}], max_tokens=80, stream=True,
        n=2, temperature=0.8, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "strict": True, "schema": Person.model_json_schema()}})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [Person.model_validate_json(text).name for text in texts]


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": '{"type": "object", '}, "guided_json"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(client: openai.OpenAI, extra: dict,
                                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="extract", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert param in error["message"] or "both constrain" in error["message"], error


# Tool calling ---------------------------------------------------------------------------------
class WeatherArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Words
    unit: Literal["celsius", "fahrenheit"]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WeatherArguments.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                      "parameters": {"type": "object", "properties": {}}}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def check_call(name: str, arguments: str) -> None:
    assert name in ("get_weather", "get_time"), name
    if name == "get_weather":
        WeatherArguments.model_validate_json(arguments)
    else:
        assert json.loads(arguments) == {}


def _ask_for_calls(client: openai.OpenAI, i: int) -> list:
    completion = client.chat.completions.create(
        model=MODELS[i % len(MODELS)], messages=QUESTION, tools=TOOLS, tool_choice="required",
        max_tokens=150, temperature=0.7, seed=i)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    return choice.message.tool_calls


def _stream_calls(client: openai.OpenAI, i: int) -> tuple[dict, int, str | None]:
    stream = client.chat.completions.create(
        model=MODELS[i % len(MODELS)], messages=QUESTION, tools=TOOLS, tool_choice="required",
        max_tokens=150, temperature=0.7, seed=100 + i, stream=True)
    calls: dict[int, dict] = {}
    num_chunks, finish_reason = 0, None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                num_chunks += 1
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id is not None:
                    assert call["id"] is None  # id and name come once, first
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return calls, num_chunks, finish_reason


@pytest.fixture(scope="module")
def required_calls(client: openai.OpenAI) -> tuple[list, list]:
    """NUM_TRIES answers with tool_choice="required" and NUM_TRIES streamed ones, all sent
    together (one batch for the engine)."""
    answers = in_parallel(2 * NUM_TRIES, lambda i: _ask_for_calls(client, i) if i < NUM_TRIES
                          else _stream_calls(client, i - NUM_TRIES))
    return answers[:NUM_TRIES], answers[NUM_TRIES:]


def test_required_tool_calls_carry_valid_arguments_every_time(required_calls: tuple[list, list]) -> None:
    for calls in required_calls[0]:
        assert calls and len({call.id for call in calls}) == len(calls)
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments)


def test_streamed_required_tool_calls_come_as_deltas_and_carry_valid_arguments(
        required_calls: tuple[list, list]) -> None:
    for calls, num_chunks, finish_reason in required_calls[1]:
        assert finish_reason == "tool_calls" and calls and sorted(calls) == list(range(len(calls)))
        for call in calls.values():
            check_call(call["name"], call["arguments"])
        assert num_chunks > len(calls)  # the arguments came in pieces, as they were generated


def test_a_named_function_and_one_call_at_most(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="extract", messages=QUESTION, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    WeatherArguments.model_validate_json(call.function.arguments)
    for i in range(4):
        completion = client.chat.completions.create(
            model=MODELS[0], messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=150,
            parallel_tool_calls=False, temperature=1.0, seed=i)
        assert len(completion.choices[0].message.tool_calls) == 1


def test_tool_results_go_back_in_tool_messages(client: openai.OpenAI) -> None:
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    for tool_choice in ("none", "auto"):
        completion = client.chat.completions.create(model=MODELS[0], messages=messages, tools=TOOLS,
                                                    tool_choice=tool_choice, max_tokens=30, temperature=0)
        message = completion.choices[0].message
        if tool_choice == "none":
            assert message.content and not message.tool_calls
        for call in message.tool_calls or []:  # auto: calls, if any, are well-formed
            check_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(client: openai.OpenAI, extra: dict, param: str) -> None:
    body = {"tools": TOOLS} | extra
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="extract", messages=QUESTION, max_tokens=5, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
