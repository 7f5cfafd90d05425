"""response_format and tools through the server, with the official openai client, on the demo
pair: JSON that parses and validates, tool_calls in OpenAI's shape (streaming included), the
same text as the library, and 400s naming what is wrong."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from verispec.server import ServerSettings, create_app

from live_server import ServerThread

pytestmark = pytest.mark.usefixtures("single_thread_torch")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
MESSAGES = [{"role": "user", "content": "Plan a trip as JSON."}]


@pytest.fixture(scope="module")
def decoder(demo_decoder):
    return demo_decoder


@pytest.fixture(scope="module")
def server(decoder):
    settings = ServerSettings(model_name="demo", max_tokens_limit=256)
    with ServerThread(create_app(decoder, settings)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_returns_json_that_validates(client, decoder, temperature):
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=96,
                                         temperature=temperature, seed=5,
                                         response_format=RESPONSE_FORMAT)
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    if temperature == 0.0:  # the library's constrained output, token for token
        prompt = "user: Plan a trip as JSON.\nassistant:"
        assert text == decoder.generate(prompt, max_new_tokens=96,
                                        response_format=RESPONSE_FORMAT).text


def test_json_object_and_completions_endpoint(client):
    out = client.completions.create(model="demo", prompt="config = ", max_tokens=64,
                                    temperature=0, extra_body={"response_format": {
                                        "type": "json_schema", "json_schema": {
                                            "name": "c", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    obj = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=128,
                                         temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of a JSON object
        assert obj.choices[0].message.content.startswith("{")


def test_streamed_json_schema_concatenates_to_json(client):
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=96,
                                                 temperature=0, stream=True,
                                                 response_format=RESPONSE_FORMAT))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_time"}}])
def test_tools_return_tool_calls(client, tool_choice):
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=96,
                                         temperature=0, tools=[WEATHER, TIME],
                                         tool_choice=tool_choice)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tools = {"get_weather": WEATHER, "get_time": TIME}
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments),
                        tools[call.function.name]["function"]["parameters"])


def test_streamed_tool_call_accumulates_to_one_call(client):
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=96,
                                                 temperature=0.7, seed=3, stream=True,
                                                 tools=[WEATHER], tool_choice="required"))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_each_of_n_streamed_choices_is_one_valid_call(client):
    # each choice is a row with its own grammar state: three sampled calls, one per index
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=96,
                                                 temperature=0.9, seed=1, n=3, stream=True,
                                                 tools=[WEATHER, TIME], tool_choice="required"))
    calls, finished = {}, {}
    for chunk in chunks:
        (choice,) = chunk.choices
        for call in choice.delta.tool_calls or []:
            assert choice.index not in calls  # one call a choice, sent whole
            calls[choice.index] = call
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert sorted(calls) == [0, 1, 2] and finished == {0: "tool_calls", 1: "tool_calls",
                                                       2: "tool_calls"}
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls.values():
        jsonschema.validate(json.loads(call.function.arguments),
                            tools[call.function.name]["function"]["parameters"])


def test_tool_choice_none_ignores_the_tools(client):
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8,
                                         temperature=0, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


BAD = {
    "invalid_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format", "Invalid type"),
    "unsupported_keyword": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}},
        "response_format", "Unimplemented keys"),
    "bad_regex": ({"response_format": {"type": "regex", "regex": "[0-9"}}, "response_format",
                  "regex"),
    "bad_grammar": ({"response_format": {"type": "grammar", "grammar": "start: undefined_rule"}},
                    "response_format", "does not compile"),
    "unsatisfiable": ({"response_format": {"type": "regex", "regex": "a{400}"},
                       "max_tokens": 20}, "max_tokens", "more than max_new_tokens=20"),
    "tool_choice_auto": ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice",
                         "not supported"),
    "tools_default_auto": ({"tools": [WEATHER]}, "tool_choice", "not supported"),
    "unknown_function": ({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    "tools_and_format": ({"tools": [WEATHER], "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "tools", "combined"),
    "legacy_functions": ({"functions": [WEATHER["function"]]}, "functions", "not supported"),
    "vllm_guided_json": ({"guided_json": SCHEMA}, "guided_json", "not supported"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_constraints_get_a_400_with_the_reason(server, client, name):
    fields, param, reason = BAD[name]
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 32, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert reason in error["message"] and error["param"] == param, error
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4)
    assert out.choices[0].message.content is not None  # still serving
