"""Agents over HTTP: the real server on a loopback port, spoken to by clients nobody here wrote
(the official ``openai`` client and ``langchain-openai``): tool calls with tool_choice auto /
required / named, streamed tool-call deltas reassembled, response_format json_schema strict,
vLLM's structured_outputs, n = 3. On the demo model, sampled at temperature 1, every
constrained output parses and validates against its schema."""

from __future__ import annotations

import json
from typing import Literal

import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_serve import Running, make_llm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"type": "string", "enum": ["admin", "user"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
SAMPLES = 8  # requests per case, sampled at temperature 1


@pytest.fixture(scope="module")
def srv():
    s = Running(make_llm(max_model_len=1024))
    yield s
    s.stop()


def check_calls(calls, names=None) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}])
def test_required_and_named_calls_always_valid(srv, choice):
    for seed in range(SAMPLES):
        r = srv.client.chat.completions.create(
            model="hybridrt-demo", messages=ASK, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200)
        msg, fin = r.choices[0].message, r.choices[0].finish_reason
        assert fin == "tool_calls", (fin, msg)
        check_calls(msg.tool_calls, None if choice == "required" else {"add"})


def test_auto_answers_text_or_valid_calls_and_none_never_parses(srv):
    r = srv.client.chat.completions.create(model="hybridrt-demo", messages=ASK, tools=TOOLS,
                                           tool_choice="auto", temperature=0, max_tokens=40)
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    if msg.tool_calls:
        check_calls(msg.tool_calls)
    calls_text = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                  "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                  "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                  "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    r = srv.client.chat.completions.create(  # forced through structured_outputs
        model="hybridrt-demo", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=400,
        temperature=0, extra_body={"structured_outputs": {"choice": [calls_text]}})
    assert r.choices[0].message.content == calls_text and not r.choices[0].message.tool_calls
    r = srv.client.chat.completions.create(
        model="hybridrt-demo", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=400,
        temperature=0, extra_body={"structured_outputs": {"choice": [calls_text]}})
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in r.choices[0].message.tool_calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_streamed_tool_call_deltas_reassemble(srv):
    """Streaming: each call's name arrives first, then argument fragments; joined they equal
    the non-streaming answer to the same seeded request."""
    for seed in range(4):
        kw = dict(model="hybridrt-demo", messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200)
        whole = srv.client.chat.completions.create(**kw).choices[0].message.tool_calls
        calls, finish = {}, None
        for chunk in srv.client.chat.completions.create(stream=True, **kw):
            ch = chunk.choices[0]
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.function.name and d.id  # the name comes first
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
            [(c.function.name, c.function.arguments) for c in whole]
        for c in calls.values():
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_two_step_tool_loop_renders_the_result(srv):
    r = srv.client.chat.completions.create(model="hybridrt-demo", messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function",
                                                        "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = srv.client.chat.completions.create(model="hybridrt-demo", messages=messages,
                                            tools=TOOLS, temperature=0, max_tokens=30)
    assert r2.choices[0].message.content
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_response_format_json_schema_strict_always_valid(srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    for seed in range(SAMPLES):
        r = srv.client.chat.completions.create(
            model="hybridrt-demo", messages=[{"role": "user", "content": "A person, as JSON"}],
            response_format=fmt, temperature=1.0, seed=seed, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = srv.client.chat.completions.create(
        model="hybridrt-demo", messages=[{"role": "user", "content": "Any JSON object"}],
        response_format={"type": "json_object"}, temperature=1.0, seed=1, max_tokens=300)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_extra_field_on_both_endpoints(srv):
    r = srv.client.completions.create(model="hybridrt-demo", prompt="Colour:", max_tokens=20,
                                      temperature=1.0, seed=3, extra_body={
                                          "structured_outputs": {"regex": "(red|blue) [0-9]{2}"}})
    assert __import__("re").fullmatch("(red|blue) [0-9]{2}", r.choices[0].text)
    r = srv.client.chat.completions.create(
        model="hybridrt-demo", messages=ASK, max_tokens=20, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "foo"}}}},
     "the constraint cannot be compiled"),
    ({"response_format": {"type": "xml"}}, "response_format must be"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"jsn": {}}}, "unknown fields"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot go with response_format"),
])
def test_bad_constraints_get_400(srv, body, words):
    with pytest.raises(openai.BadRequestError, match=words):
        srv.client.chat.completions.create(model="hybridrt-demo", messages=ASK, max_tokens=8,
                                           **{k: v for k, v in body.items()
                                              if k in ("tools", "tool_choice",
                                                       "response_format")},
                                           extra_body={k: v for k, v in body.items()
                                                       if k == "structured_outputs"})
    r = srv.client.chat.completions.create(model="hybridrt-demo", messages=ASK, max_tokens=4)
    assert r.choices[0].message.content is not None  # the server goes on


def test_n3_choices_streamed_and_not(srv):
    kw = dict(model="hybridrt-demo", messages=[{"role": "user", "content": "A person"}],
              n=3, temperature=1.0, seed=11, max_tokens=200, response_format={
                  "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    r = srv.client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)
    assert len(set(texts)) > 1
    streamed = {0: "", 1: "", 2: ""}
    for chunk in srv.client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts  # each choice its own seed: seed + i
    assert r.usage.completion_tokens > 0


# langchain-openai ---------------------------------------------------------------------------
def test_langchain_structured_output_and_tool_loop(srv):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=130)
        role: str = Field(json_schema_extra={"enum": ["admin", "user"]})

    chat = ChatOpenAI(model="hybridrt-demo", base_url=f"{srv.base}/v1", api_key="unused",
                      temperature=1.0, max_tokens=200)
    structured = chat.with_structured_output(Person)
    for seed in range(SAMPLES):
        p = structured.invoke("Describe a person.", config={"configurable": {}},
                              **({"seed": seed}))
        assert isinstance(p, Person) and p.role in ("admin", "user")

    class WeatherArgs(BaseModel):
        city: str = Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city; unit is celsius or fahrenheit."""
        return f"sunny, 21 degrees {unit} in {city}"

    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    args = ai.tool_calls[0]["args"]
    assert set(args) == {"city", "unit"}
    messages += [ai, ToolMessage(get_weather.invoke(args), tool_call_id=ai.tool_calls[0]["id"])]
    final = chat.bind_tools([get_weather]).invoke(messages)
    assert isinstance(final.content, str) and final.content
