"""OpenAI's Responses API (``/v1/responses``) on the real server (demo model), spoken to by the
official ``openai`` SDK, the OpenAI Agents SDK and LangChain: text with instructions, the stream
events from ``response.created`` to ``response.completed``, forced function calls with valid
arguments and json_schema output (temperature 1, several seeds), reasoning mapped to the
thinking switch, ``status: "incomplete"``, a function_call_output round trip, an Agents SDK run
whose function tool is called, and OpenAI-shaped 400s. The answers are those of the same
request through chat completions: one engine path."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

from test_serve import MODEL, Running, make_llm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

ADD = {"type": "function", "name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}, "strict": True}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"type": "string", "enum": ["admin", "user"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
ASK = "What is the weather in Paris?"
SEEDS = range(5)


@pytest.fixture(scope="module")
def srv():
    s = Running(make_llm(max_model_len=1024))
    yield s
    s.stop()


def test_text_with_instructions_equals_chat_completions(srv):
    r = srv.client.responses.create(model=MODEL, instructions="Answer about Python.",
                                    input="What does json.dumps do?", max_output_tokens=16,
                                    temperature=0)
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                              messages=[{"role": "system",
                                                         "content": "Answer about Python."},
                                                        {"role": "user",
                                                         "content": "What does json.dumps do?"}])
    assert r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content.strip()
    assert [o.type for o in r.output] == ["message"]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else
                        "completed")


def test_stream_events_from_created_to_completed(srv):
    kw = dict(model=MODEL, input="Which module provides deque?", max_output_tokens=200,
              temperature=0)
    whole = srv.client.responses.create(**kw)
    events = list(srv.client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" == f"response.{whole.status}"
    for k in ("response.output_item.added", "response.content_part.added",
              "response.output_text.delta", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert k in kinds, k
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == whole.output_text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_forced_function_call_arguments_validate(srv, choice):
    for seed in SEEDS:
        kw = dict(model=MODEL, input=ASK, tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=False, max_output_tokens=200, temperature=1.0,
                  extra_body={"seed": seed})
        r = srv.client.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1, r
        c = calls[0]
        assert c.status == "completed" and c.call_id
        assert choice == "required" or c.name == "add"
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        events = list(srv.client.responses.create(stream=True, **kw))
        args = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
        assert args == c.arguments
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done[0].arguments == c.arguments


def test_json_schema_output_validates(srv):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                      "strict": True}}
    for seed in SEEDS:
        r = srv.client.responses.create(model=MODEL, input="A person, as JSON", text=fmt,
                                        max_output_tokens=200, temperature=1.0,
                                        extra_body={"seed": seed})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), PERSON)
    r = srv.client.responses.create(model=MODEL, input="Any JSON object",
                                    text={"format": {"type": "json_object"}},
                                    max_output_tokens=300, temperature=1.0,
                                    extra_body={"seed": 1})
    assert isinstance(json.loads(r.output_text), dict)


def test_reasoning_effort_is_the_thinking_switch(srv):
    kw = dict(model=MODEL, input="What does json.dumps do?", max_output_tokens=60,
              temperature=0)
    on = srv.client.responses.create(reasoning={"effort": "medium"}, **kw)
    off = srv.client.responses.create(reasoning={"effort": "none"}, **kw)
    assert on.output[0].type == "reasoning" and on.output[1].type == "message"
    assert all(o.type != "reasoning" for o in off.output)
    chat = srv.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What does json.dumps do?"}],
        max_tokens=60, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on.output_text == chat.choices[0].message.content.strip()
    kinds = [e.type for e in srv.client.responses.create(stream=True,
                                                         reasoning={"effort": "high"}, **kw)]
    added = kinds.index("response.output_item.added")
    assert "response.output_text.delta" in kinds[added:]


def test_cut_by_max_output_tokens_is_incomplete(srv):
    r = srv.client.responses.create(model=MODEL, input="Tell me about deque.",
                                    max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = list(srv.client.responses.create(model=MODEL, input="Tell me about deque.",
                                              max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_function_call_output_round_trip(srv):
    r = srv.client.responses.create(model=MODEL, input=ASK, tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=200, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    items = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True)
                                                 for o in r.output],
             {"type": "function_call_output", "call_id": call.call_id,
              "output": "sunny, 21 C"}]
    r2 = srv.client.responses.create(model=MODEL, input=items, tools=TOOLS,
                                     max_output_tokens=30, temperature=0)
    assert r2.output and r2.usage.input_tokens > r.usage.input_tokens
    assert r2.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                     "parameters")}}
               for t in TOOLS])
    assert r2.usage.input_tokens == chat.usage.prompt_tokens


def test_openai_agents_runner_calls_the_function_tool(srv):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> str:
        """Add two integers."""
        calls.append((a, b))
        return f"the sum is {a + b}"

    client = openai.AsyncOpenAI(base_url=f"{srv.base}/v1", api_key="unused")
    agent = agents.Agent(
        name="adder", instructions="Use the tool.", tools=[add],
        model=agents.OpenAIResponsesModel(MODEL, client),
        model_settings=agents.ModelSettings(tool_choice="add", temperature=0, max_tokens=200),
        tool_use_behavior="stop_on_first_tool")
    agents.set_tracing_disabled(True)
    result = asyncio.run(agents.Runner.run(agent, "What is 2 + 3?", max_turns=2))
    assert len(calls) == 1 and all(isinstance(x, int) for x in calls[0])
    assert result.final_output == f"the sum is {sum(calls[0])}"


def test_langchain_over_the_responses_api(srv):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    chat = ChatOpenAI(model=MODEL, base_url=f"{srv.base}/v1", api_key="unused",
                      temperature=0, max_tokens=100, use_responses_api=True)
    messages = [HumanMessage("What is 2 + 3?")]
    ai = chat.bind_tools([add], tool_choice="add").invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "add"
    args = ai.tool_calls[0]["args"]
    assert isinstance(args["a"], int) and isinstance(args["b"], int)
    messages += [ai, ToolMessage(str(add.invoke(args)), tool_call_id=ai.tool_calls[0]["id"])]
    final = chat.bind_tools([add]).invoke(messages)
    assert final.content


@pytest.mark.parametrize("body, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "stateless"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "http://x"}]}]},
     "this server fetches no image URLs"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "files are not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]},
     "unknown call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": []}, "input must be"),
    ({"input": "hi", "max_output_tokens": 0}, "max_tokens"),
])
def test_bad_requests_get_openai_shaped_400s(srv, body, words):
    with pytest.raises(openai.BadRequestError, match=words) as e:
        srv.client.responses.create(model=MODEL, **body)
    assert e.value.body["type"] == "invalid_request_error"
