"""Tool calls, reasoning and constraints hardened on all three APIs (chat completions,
Anthropic Messages, OpenAI Responses), each edge case peers get wrong a named test:

- JSON integers and numbers bounded in every grammar (int64 range, 9 decimals), so a weak
  model cannot write digits until max_tokens;
- a constraint (json_schema, json_object, forced tools) starts after the think block the
  prompt leaves open, never inside it;
- a tool call begun inside the think block is still returned as a call;
- streamed tool calls never leak their XML into text;
- a call cut by max_tokens comes back incomplete (chat: finish_reason "length" with the raw
  arguments; Anthropic: stop_reason "max_tokens", no tool_use; Responses: status
  "incomplete"), never as a valid-looking call.

The grammar tests walk the demo tokenizer's tokens through the compiled constraint; the
server tests run the demo model behind a chat template that leaves ``<think>`` open (as
Qwen3.5's does with thinking on); the shaping tests feed fixed outputs through each API's
answer and stream."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
anthropic_sdk = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from test_serve import MODEL, Running, make_llm  # noqa: E402

from hybridrt.output_pipeline import ChoiceStream, FanIn, Shape, finish_message  # noqa: E402
from hybridrt.sampling_params import SamplingParams  # noqa: E402
from hybridrt.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from hybridrt.server import anthropic, responses  # noqa: E402
from hybridrt.server.engine_loop import Progress  # noqa: E402
from hybridrt.server.job import Job  # noqa: E402
from hybridrt.server.prepare import Frontend  # noqa: E402
from hybridrt.server.responses_request import translate as responses_translate  # noqa: E402
from hybridrt.structured_outputs import StructuredOutputs  # noqa: E402
from hybridrt.think_constraint import after_think  # noqa: E402
from hybridrt.tool_calls import tool_constraint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

NUM = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
       "required": ["n", "x"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "put", "parameters": NUM}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string",
                                              "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
SEEDS = range(3)


# JSON integers and numbers bounded, in every grammar -----------------------------------------
@pytest.fixture(scope="module")
def demo():
    return make_llm(max_model_len=1024)


@pytest.fixture(scope="module")
def grammars(demo):
    tok = demo.tokenizer
    so = StructuredOutputs(tok, demo.config.vocab_size, [tok.eos_token_id], engine="llguidance")
    yield so, tok
    so.close()


def walks(grammars, params: SO, text: str) -> bool:
    """Whether the constraint accepts ``text`` token by token (not necessarily ended)."""
    so, tok = grammars
    g = so.matcher(so.compile(params), [], params.kind)
    return all(g.accept(t) for t in tok.encode(text, add_special_tokens=False))


def _answer(kind: str, n: str, x: str) -> str:
    if kind == "tools":
        return (f"<tool_call>\n<function=put>\n<parameter=n>\n{n}\n</parameter>\n"
                f"<parameter=x>\n{x}\n</parameter>\n</function>\n</tool_call>")
    body = f'{{"n": {n}, "x": {x}}}'
    return "reasoning</think>\n\n" + body if kind == "after_think" else body


def _constraint(kind: str) -> SO:
    return {"json_schema": SO(json=NUM), "json_object": SO(json_object=True),
            "tools": tool_constraint([TOOL], "required", False, False, engine="llguidance"),
            "after_think": after_think(SO(json=NUM), engine="llguidance")}[kind]


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "tools", "after_think"])
def test_json_integers_and_numbers_are_bounded_in_every_grammar(grammars, kind):
    c = _constraint(kind)
    assert walks(grammars, c, _answer(kind, "-" + "9" * 18, "123456789012345678.123456789"))
    assert not walks(grammars, c, _answer(kind, "1" + "0" * 19, "1.5"))  # 20 digits
    assert not walks(grammars, c, _answer(kind, "9" * 19, "1.5"))  # over 10**18
    assert not walks(grammars, c, _answer(kind, "7", "1" + "0" * 19))  # a number's digits
    assert not walks(grammars, c, _answer(kind, "7", "0.1234567891"))  # 10 decimals
    assert not walks(grammars, c, _answer(kind, "7", "1e300"))  # no exponent to hide them in


# Servers: the demo model, and behind a template that leaves <think> open --------------------
class ThinkingFront(Frontend):
    """The demo's chat template with Qwen3.5's thinking-on generation prompt: ``<think>``
    left open for the model to continue."""

    def apply_chat_template(self, messages, kwargs, add_generation_prompt):
        text = super().apply_chat_template(messages, kwargs, add_generation_prompt)
        thinking = (kwargs or {}).get("enable_thinking")
        return text + "<think>\n" if add_generation_prompt and thinking else text


@pytest.fixture(scope="module")
def srv(demo):
    s = Running(demo, front=ThinkingFront.of(demo))
    s.claude = anthropic_sdk.Anthropic(base_url=s.base, api_key="unused", max_retries=0)
    yield s
    s.stop()


THINK = {"enable_thinking": True}


def _chat(srv, thinking: bool, seed: int, **kw):
    return srv.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A number, as JSON."}],
        temperature=1.0, seed=seed, max_tokens=120,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}}, **kw)


def _messages(srv, thinking: bool, seed: int, **kw):
    return srv.claude.messages.create(
        model=MODEL, messages=[{"role": "user", "content": "A number, as JSON."}],
        max_tokens=120, extra_body={"temperature": 1.0, "seed": seed},
        thinking={"type": "enabled", "budget_tokens": 60} if thinking else
        {"type": "disabled"}, **kw)


def _responses(srv, thinking: bool, seed: int, **kw):
    return srv.client.responses.create(
        model=MODEL, input="A number, as JSON.", max_output_tokens=120, temperature=1.0,
        extra_body={"seed": seed}, reasoning={"effort": "medium" if thinking else "none"}, **kw)


def _json_of(api: str, r) -> tuple[str, str | None, bool]:
    """-> (the answer's text, its reasoning or None, whether it ended on its own)."""
    if api == "chat":
        m = r.choices[0].message
        return m.content or "", m.reasoning_content, r.choices[0].finish_reason == "stop"
    if api == "messages":
        text = "".join(b.text for b in r.content if b.type == "text")
        thought = [b.thinking for b in r.content if b.type == "thinking"]
        return text, thought[0] if thought else None, r.stop_reason == "end_turn"
    thought = [o for o in r.output if o.type == "reasoning"]
    reasoning = thought[0].content[0].text if thought and thought[0].content else None
    return r.output_text, reasoning, r.status == "completed"


def _json_request(api: str, srv, thinking: bool, seed: int, schema: dict):
    if api == "chat":
        return _chat(srv, thinking, seed, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    if api == "messages":
        return _messages(srv, thinking, seed, output_config={
            "format": {"type": "json_schema", "schema": schema}})
    return _responses(srv, thinking, seed, text={"format": {
        "type": "json_schema", "name": "n", "schema": schema}})


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_constrained_integers_end_within_int64_on_the_demo_model(srv, api):
    """The measured failure: an unbounded integer ran digit after digit to max_tokens."""
    for seed in SEEDS:
        text, _, ended = _json_of(api, _json_request(api, srv, False, seed, NUM))
        value = json.loads(text)
        assert ended and abs(value["n"]) <= 10 ** 18 and abs(value["x"]) <= 10 ** 18


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_json_schema_starts_after_the_think_block(srv, api):
    """vLLM #44012 / #50948: with <think> left open the JSON comes after </think>, as the
    answer, and the reasoning holds none of it."""
    for seed in SEEDS:
        text, reasoning, ended = _json_of(api, _json_request(api, srv, True, seed, NUM))
        assert reasoning is not None and "{" not in reasoning, reasoning
        jsonschema.validate(json.loads(text), NUM)
        assert ended


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_forced_tool_call_starts_after_the_think_block(srv, api):
    for seed in SEEDS:
        if api == "chat":
            r = _chat(srv, True, seed, tools=[WEATHER], tool_choice="required",
                      parallel_tool_calls=False)
            calls = [(c.function.name, json.loads(c.function.arguments))
                     for c in r.choices[0].message.tool_calls]
            assert r.choices[0].message.reasoning_content is not None
        elif api == "messages":
            r = _messages(srv, True, seed, tools=[{
                "name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                tool_choice={"type": "any", "disable_parallel_tool_use": True})
            calls = [(b.name, b.input) for b in r.content if b.type == "tool_use"]
            assert r.content[0].type == "thinking"
        else:
            r = _responses(srv, True, seed, tools=[{
                "type": "function", "name": "get_weather",
                "parameters": WEATHER["function"]["parameters"]}], tool_choice="required",
                parallel_tool_calls=False)
            calls = [(o.name, json.loads(o.arguments)) for o in r.output
                     if o.type == "function_call"]
            assert r.output[0].type == "reasoning"
        assert [c[0] for c in calls] == ["get_weather"], r
        jsonschema.validate(calls[0][1], WEATHER["function"]["parameters"])


BODIES = {  # a json_schema request and a forced call, thinking on, in each API's words
    "chat": ("/v1/chat/completions", None, lambda extra: {
        "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": THINK,
        **extra}),
    "messages": ("/v1/messages", anthropic.translate, lambda extra: {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 50,
        "thinking": {"type": "enabled", "budget_tokens": 10}, **extra}),
    "responses": ("/v1/responses", responses.translate, lambda extra: {
        "input": "x", "reasoning": {"effort": "low"}, **extra}),
}
JSON_EXTRA = {"chat": {"response_format": {"type": "json_schema", "json_schema": {
    "name": "n", "schema": NUM}}},
    "messages": {"output_config": {"format": {"type": "json_schema", "schema": NUM}}},
    "responses": {"text": {"format": {"type": "json_schema", "name": "n", "schema": NUM}}}}
TOOL_EXTRA = {"chat": {"tools": [WEATHER], "tool_choice": "required"},
              "messages": {"tools": [{"name": "get_weather",
                                      "input_schema": WEATHER["function"]["parameters"]}],
                           "tool_choice": {"type": "any"}},
              "responses": {"tools": [{"type": "function", "name": "get_weather",
                                       "parameters": WEATHER["function"]["parameters"]}],
                            "tool_choice": "required"}}


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_each_apis_constraint_lets_the_think_block_close_first(srv, grammars, api):
    """The job each API makes of a constrained request with <think> left open: its grammar
    takes reasoning, then </think>, then the answer; the answer alone inside the think block
    cannot end it."""
    _, translate, body = BODIES[api]
    for extra, answer in ((JSON_EXTRA[api], '{"n": 1, "x": 2.5}'), (TOOL_EXTRA[api], CALL)):
        raw = json.dumps({"model": MODEL, **body(extra)}).encode()
        job = srv.server.preparer.parse(raw, True, translate)
        assert job.shape.thinks
        assert walks(grammars, job.params.structured_outputs,
                     "Let me think.</think>\n\n" + answer)


# Shaping: fixed outputs through each API's answer and stream ---------------------------------
def _job(thinks: bool, tools=(WEATHER,)) -> Job:
    echo = responses_translate({"input": "x"})[1]
    return Job([1, 2, 3], SamplingParams(max_tokens=64), None, None, "chatcmpl-test", 0,
               Shape(thinks, list(tools), True), api=echo)


def _items(text: str, finish: str, step: int = 1) -> list[Progress]:
    """Progress of an output growing ``step`` characters at a time."""
    ends = list(range(step, len(text), step)) + [len(text)]
    return [Progress([7], None, text[:e], finish if e == len(text) else None,
                     num_prompt_tokens=3) for e in ends]


def _fan_in(items) -> FanIn:
    f = FanIn(1)
    for it in items:
        f.add(it)
    return f


SERVER = SimpleNamespace(model_name=MODEL, tokenizer=None, abort=lambda handles: None)


def _stream(module, job: Job, items) -> list[tuple[str, dict]]:
    """The (event, data) pairs of ``module.events`` over ``items``."""
    async def run():
        q = asyncio.Queue()
        for it in items[1:]:
            q.put_nowait(it)
        return [e async for e in module.events(SERVER, [SimpleNamespace(queue=q)], items[0],
                                               job)]
    out = []
    for chunk in asyncio.run(run()):
        lines = dict(line.split(": ", 1) for line in chunk.strip().splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def _no_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in o.items() if k != "call_id"} for o in output]


def _chat_stream(job: Job, items) -> tuple[str, str, list]:
    """A chat stream's (reasoning, content, tool call deltas) joined."""
    s = ChoiceStream(job.shape)
    reasoning, content, calls = "", "", []
    for it in items:
        done = it.finish_reason is not None
        d = s.delta(s.feed(it.text, done), done)
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        calls += d.get("tool_calls", [])
    return reasoning, content, calls


INSIDE = "<think>\nI need the weather.\n" + CALL  # the call begun before </think>


def test_tool_call_inside_think_is_a_call_on_chat_completions():
    m = finish_message(INSIDE, Shape(False, [WEATHER]))
    assert m.reasoning == "I need the weather."
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    reasoning, content, calls = _chat_stream(_job(False), _items(INSIDE, "stop"))
    assert reasoning == "I need the weather." and not content
    assert calls[0]["function"]["name"] == "get_weather"


def test_tool_call_inside_think_is_a_call_on_messages():
    job = _job(False)
    r = anthropic.answer(SERVER, job, _fan_in(_items(INSIDE, "stop", len(INSIDE))))
    assert [b["type"] for b in r["content"]] == ["thinking", "tool_use"]
    assert r["content"][1]["input"] == {"city": "Paris", "unit": "celsius"}
    assert r["stop_reason"] == "tool_use"
    events = _stream(anthropic, job, _items(INSIDE, "stop"))
    starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert starts == ["thinking", "tool_use"]


def test_tool_call_inside_think_is_a_call_on_responses():
    job = _job(False)
    r = responses.answer(SERVER, job, _fan_in(_items(INSIDE, "stop", len(INSIDE))))
    assert [o["type"] for o in r["output"]] == ["reasoning", "function_call"]
    assert json.loads(r["output"][1]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    events = _stream(responses, job, _items(INSIDE, "stop"))
    assert _no_ids(events[-1][1]["response"]["output"]) == _no_ids(r["output"])


TEXT_THEN_CALL = "Let me look that up.\n" + CALL + "\n"


def test_streamed_tool_calls_never_leak_xml_on_chat_completions():
    _, content, calls = _chat_stream(_job(False), _items(TEXT_THEN_CALL, "stop"))
    assert content.strip() == "Let me look that up." and "<" not in content
    assert "".join(c["function"]["arguments"] for c in calls) == \
        '{"city": "Paris", "unit": "celsius"}'


def test_streamed_tool_calls_never_leak_xml_on_messages():
    events = _stream(anthropic, _job(False), _items(TEXT_THEN_CALL, "stop"))
    text = "".join(d["delta"]["text"] for e, d in events
                   if e == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == "Let me look that up."
    args = "".join(d["delta"]["partial_json"] for e, d in events
                   if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}


def test_streamed_tool_calls_never_leak_xml_on_responses():
    events = _stream(responses, _job(False), _items(TEXT_THEN_CALL, "stop"))
    text = "".join(d["delta"] for e, d in events if e == "response.output_text.delta")
    assert text == "Let me look that up."
    assert [o["type"] for o in events[-1][1]["response"]["output"]] == ["message",
                                                                        "function_call"]


# what a weak model wrote when max_tokens cut it: an integer running on, a tag half written
CUT = ("<tool_call>\n<function=get_weather>\n<parameter=unit>\ncelsius\n</parameter>\n"
       "<parameter=city>\n107455077542754938500925428  </param")


def test_call_cut_by_max_tokens_is_incomplete_on_chat_completions(srv):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
              tools=[WEATHER], tool_choice="auto", max_tokens=len(
                  srv.server.tokenizer.encode(CUT, add_special_tokens=False)),
              temperature=0, extra_body={"structured_outputs": {"choice": [CUT + "x" * 40]}})
    r = srv.client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length"
    assert call.function.arguments == '{"unit": "celsius", "city": "107455077542754938500925428'
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # never a valid-looking call
    streamed = "".join(d.function.arguments or "" for ch in srv.client.chat.completions.create(
        stream=True, **kw) for d in (ch.choices[0].delta.tool_calls or []))
    assert streamed == call.function.arguments


def test_call_cut_by_max_tokens_is_incomplete_on_messages():
    job = _job(False)
    r = anthropic.answer(SERVER, job, _fan_in(_items(CUT, "length", len(CUT))))
    assert r["stop_reason"] == "max_tokens"
    assert all(b["type"] != "tool_use" for b in r["content"])
    events = _stream(anthropic, job, _items(CUT, "length"))
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    args = "".join(d["delta"]["partial_json"] for e, d in events
                   if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert "1074" not in args and "</param" not in args  # nothing of the cut value


def test_call_cut_by_max_tokens_is_incomplete_on_responses():
    job = _job(False)
    r = responses.answer(SERVER, job, _fan_in(_items(CUT, "length", len(CUT))))
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    (call,) = r["output"]
    assert call["status"] == "incomplete"
    assert call["arguments"] == '{"unit": "celsius", "city": "107455077542754938500925428'
    events = _stream(responses, job, _items(CUT, "length"))
    assert events[-1][0] == "response.incomplete"
    assert _no_ids(events[-1][1]["response"]["output"]) == _no_ids(r["output"])
