"""Tool calls in Qwen3.5's XML format (hybridrt/tool_calls.py), LLM.chat(tools=...) and
n > 1 (hybridrt/parallel_sampling.py) on the demo model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrt.llm import LLM
from hybridrt.reasoning import split_reasoning
from hybridrt.sampling_params import SamplingParams
from hybridrt.tool_calls import ToolCallParser, parse_tool_calls, typed_value

pytestmark = pytest.mark.usefixtures("one_thread_module")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["c", "f"]}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "compute", "parameters": {"type": "object", "properties": {
            "x": {"type": "number"}, "flags": {"type": "array", "items": {"type": "boolean"}},
            "opts": {"type": "object"}, "note": {"type": ["string", "null"], "maxLength": 12},
            "exact": {"type": "boolean"}}}}},
]
ANSWER = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n"
          "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
          "<tool_call>\n<function=compute>\n<parameter=x>\n-2.5e3\n</parameter>\n"
          "<parameter=flags>\n[true, false]\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n"
          "</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n"
          "<parameter=exact>\nTrue\n</parameter>\n</function>\n</tool_call>")
EXPECTED = [("get_weather", {"city": "San Jose", "days": 3}),
            ("compute", {"x": -2500.0, "flags": [True, False], "opts": {"a": [1, 2]},
                         "note": "line one\nline two", "exact": True})]


def test_parse_typed_arguments_and_content():
    content, calls = parse_tool_calls(ANSWER, TOOLS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert [c.arguments for c in calls] == [json.dumps(a) for _, a in EXPECTED]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_deltas_reassemble_to_the_parse(step):
    """Fed in pieces of ``step`` characters: each call's name comes first (with its id), then
    argument fragments that join to the non-streaming arguments, one per parameter."""
    p, names, args, text = ToolCallParser(TOOLS), {}, {}, ""
    for i in range(0, len(ANSWER), step):
        t, deltas = p.feed(ANSWER[i:i + step])
        text += t
        for d in deltas:
            if d.name is not None:
                assert d.index not in names and d.arguments == ""
                names[d.index] = d.name
            else:
                assert d.index in names  # the name came first
                args[d.index] = args.get(d.index, "") + d.arguments
    t, deltas = p.flush()
    assert not deltas
    assert text + t == "Let me look.\n\n"
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == EXPECTED


def test_unfinished_call_stays_incomplete_and_text_without_calls_passes():
    content, calls = parse_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                                      "Par", TOOLS)
    assert content is None and [(c.arguments, c.complete) for c in calls] == [
        ('{"city": "Par', False)]
    assert parse_tool_calls("no calls here, <tool_ not one", TOOLS) == (
        "no calls here, <tool_ not one", [])


@pytest.mark.parametrize("text, schema, value", [
    ("12", {"type": "integer"}, 12), ("1.50", {"type": "number"}, 1.5),
    ("7", {"type": "number"}, 7), ("x7", {"type": "integer"}, "x7"),
    ("false", {"type": "boolean"}, False), ("null", {"type": ["string", "null"]}, None),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("0012", {"type": "string"}, "0012"),
    ('{"a": 1}', None, {"a": 1}), ("plain", None, "plain"), ('"c"', {"enum": ["c"]}, "c"),
])
def test_typed_value(text, schema, value):
    assert typed_value(text, schema) == value


def test_tool_call_inside_the_think_block_ends_it():
    """vLLM #39056: a call begun before </think> is a call, not reasoning."""
    text = "I need the weather.\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    reasoning, answer = split_reasoning(text, True, tool_calls=True)
    assert reasoning == "I need the weather."
    assert [c.name for c in parse_tool_calls(answer, TOOLS)[1]] == ["get_weather"]
    assert split_reasoning(text, True) == (text, "")  # without tools: all reasoning


# LLM.chat(tools=...) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    return LLM(dtype="float32", max_model_len=1024, max_num_seqs=16, cache_memory=64 << 20)


MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(params=["llguidance", "xgrammar"])
def engine(request, monkeypatch):
    """Each grammar engine in turn (HYBRIDRT_GRAMMAR_ENGINE set for the test)."""
    pytest.importorskip(request.param)
    monkeypatch.setenv("HYBRIDRT_GRAMMAR_ENGINE", request.param)
    return request.param


@pytest.fixture(scope="module")
def demos():
    return {}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_required_and_named_calls_are_valid_on_the_demo_model(demos, engine, choice):
    import jsonschema

    if engine not in demos:
        demos[engine] = LLM(dtype="float32", max_model_len=1024, max_num_seqs=16,
                            cache_memory=64 << 20)
        demos[engine].engine.structured_outputs.engine_name = engine
    demo = demos[engine]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300) for s in range(10)]
    outs = demo.chat([MESSAGES] * 10, params, tools=TOOLS, tool_choice=choice,
                     parallel_tool_calls=False, use_tqdm=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and len(c.tool_calls) == 1, c
        call = c.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_tool_result_is_rendered_back_and_auto_answers(demo):
    first = demo.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=200), tools=TOOLS,
                      tool_choice="required", use_tqdm=False)[0].outputs[0]
    call = first.tool_calls[0]
    follow = MESSAGES + [{"role": "assistant", "content": None,
                          "tool_calls": [call.as_openai()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    prompt = demo.apply_chat_template(
        __import__("hybridrt.tool_calls", fromlist=["x"]).template_messages(follow),
        {"tools": TOOLS})
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert f"<function={call.name}>" in prompt
    out = demo.chat(follow, SamplingParams(temperature=0, max_tokens=30), tools=TOOLS,
                    use_tqdm=False)[0].outputs[0]
    assert out.tool_calls == [] and out.text


def _walk(so, text: str) -> bool:
    """Every token of ``text`` (then eos) allowed by llguidance under ``so``, and the end."""
    from hybridrt.grammar_engine import LLGuidance
    from hybridrt.tokenizer import Tokenizer

    tok = Tokenizer(Path(__file__).resolve().parent.parent / "hybridrt" / "demo_model")
    engine = LLGuidance(tok, 6208, [0, 2])
    m = engine.matcher(engine.compile(so), [0, 2])
    return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False) + [2]) \
        and m.is_terminated()


def test_the_lark_of_the_calls_is_the_templates_format():
    """llguidance's call grammar: the template's calls pass (after the think block when the
    prompt opens one, not without it); an integer without bounds stops at 19 digits, a number
is written without an exponent, a string
    at its maxLength, a named call is that call alone."""
    pytest.importorskip("llguidance")
    from hybridrt.tool_calls import tool_constraint

    calls = ANSWER.split("Let me look.\n")[1].replace("line one\nline two", "l 1\nl 2") \
        .replace("True", "true").replace("-2.5e3", "-2500.5")
    assert parse_tool_calls(calls, TOOLS)[1]
    required = tool_constraint(TOOLS, "required", thinking=False, engine="llguidance")
    assert _walk(required, calls)
    assert not _walk(required, calls.replace("-2500.5", "-2.5e3"))  # bounded: no exponent
    assert not _walk(required, calls.replace("San Jose", "San Jose, California"))
    first = calls.split("\n<tool_call>\n<function=compute>")[0]
    thinks = tool_constraint(TOOLS, "required", thinking=True, parallel=False,
                             engine="llguidance")
    assert _walk(thinks, "Paris, then.\n</think>\n\n" + first)
    assert not _walk(thinks, first) and not _walk(thinks, "Hm.\n</think>\n\n" + calls)
    named = tool_constraint(TOOLS, {"type": "function", "function": {"name": "compute"}},
                            thinking=False, engine="llguidance")
    assert not _walk(named, first)
    wide = [{"type": "function", "function": {"name": "n", "parameters": {
        "type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}}}]
    call = "<tool_call>\n<function=n>\n<parameter=k>\n%s\n</parameter>\n</function>\n</tool_call>"
    wide_so = tool_constraint(wide, "required", thinking=False, engine="llguidance")
    assert _walk(wide_so, call % ("-" + "9" * 18)) and not _walk(wide_so, call % ("9" * 20))


# n > 1 ---------------------------------------------------------------------------------------
def test_n_choices_are_child_requests_with_their_own_seed(demo):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=3, ignore_eos=True)
    (out,) = demo.generate(["def f(x):"], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    alone = [demo.generate(["def f(x):"], params.clone(n=1, seed=7 + i),
                           use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone
    assert len({tuple(t) for t in alone}) == 3
    assert demo.engine.cache.all_free() and not demo.engine.requests
    with pytest.raises(ValueError, match="n must be an int in"):
        SamplingParams(n=0)


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_output_pipeline_streams_what_it_finishes(step, parallel):
    """hybridrt.output_pipeline, as the server and LLM use it: a choice streamed in pieces
    (a stop string's hold-back, the think block apart, calls piece by piece; the first call
    only unless parallel) joins to what ``finish_message`` makes of the whole text, and a
    choice that called ends with finish_reason "tool_calls"."""
    from hybridrt.output_pipeline import ChoiceStream, Shape, finish_message, finish_reason

    text = "I should call.</think>\n\n" + ANSWER
    shape = Shape(thinks=True, tools=TOOLS, parallel=parallel)
    want = finish_message(text, shape)
    assert want.reasoning == "I should call." and want.content == "Let me look."
    assert [c.name for c in want.tool_calls] == ["get_weather", "compute"][:2 if parallel else 1]
    stream, deltas = ChoiceStream(shape, holdback=3), []
    for end in range(step, len(text) + step, step):
        done = end >= len(text)
        new = stream.feed(text[:end], done)
        assert stream.sent == (len(text) if done else max(0, end - 3))
        deltas.append(stream.delta(new, done))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want.reasoning
    # the stream keeps the whitespace around the calls that the parse strips
    assert "".join(d.get("content", "") for d in deltas).strip() == want.content
    calls = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            name = c["function"].get("name")
            calls.setdefault(c["index"], [name, ""])[1] += c["function"]["arguments"]
    assert [tuple(v) for _, v in sorted(calls.items())] == \
        [(c.name, c.arguments) for c in want.tool_calls]
    assert finish_reason("stop", stream.called) == "tool_calls"
    assert finish_reason("length", stream.called) == "length"


def test_the_output_pipeline_fans_in_choices_with_their_usage():
    """``FanIn``: choices' progress in any order -> each one's tokens, its finishing item and
    the request's usage (the prompt once, every choice's tokens, the most cached)."""
    from types import SimpleNamespace as Item

    from hybridrt.output_pipeline import FanIn

    def item(index, ids, finish=None, prompt=0, cached=0):
        return Item(index=index, new_token_ids=ids, new_logprobs=None, finish_reason=finish,
                    num_prompt_tokens=prompt, num_reused_tokens=cached)

    f = FanIn(2)
    for it in (item(1, [5, 6]), item(0, [1]), item(1, [7], "stop", 9, 4), item(0, [2, 3])):
        f.add(it)
        assert not f.done
    f.add(item(0, [], "length", 9, 3))
    assert f.done and f.token_ids == [[1, 2, 3], [5, 6, 7]]
    assert [f.final[i].finish_reason for i in (0, 1)] == ["length", "stop"]
    assert (f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.cached_tokens) == (9, 6, 4)
