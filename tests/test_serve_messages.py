"""Anthropic's Messages API (``/v1/messages``) on the real server (demo model), spoken to by the
official ``anthropic`` SDK: text with a system prompt, streaming, forced tool_use whose input
validates against its schema (temperature 1, several seeds), a tool_result round trip,
thinking on and off, stop_sequences, the prefix cache in ``usage``, count_tokens, the
x-api-key header, and Anthropic-shaped 400s. The answers are those of the same request through
chat completions: one engine path."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("llguidance")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

from test_serve import MODEL, Running, make_llm  # noqa: E402

from hybridrt.openai_protocol import Limits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

KEY = "sk-test-messages"
ADD = {"name": "add", "description": "Add two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string",
                                              "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments: sent as extra fields


@pytest.fixture(scope="module")
def srv():
    s = Running(make_llm(max_model_len=1024), api_key=KEY, metrics_public=True,
                limits=Limits(max_body_bytes=256 << 10))
    s.client = s.client.with_options(api_key=KEY)
    s.claude = anthropic.Anthropic(base_url=s.base, api_key=KEY, max_retries=0)
    yield s
    s.stop()


def test_text_with_system_equals_chat_completions(srv):
    system = "You answer questions about Python."
    msgs = [{"role": "user", "content": "What does json.dumps do?"}]
    r = srv.claude.messages.create(model=MODEL, system=system, messages=msgs, max_tokens=16,
                                   extra_body=GREEDY)
    chat = srv.client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system}, *msgs], max_tokens=16,
        temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == chat.choices[0].message.content.strip()
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    # system as blocks renders the same prompt
    blocks = srv.claude.messages.create(model=MODEL, messages=msgs, max_tokens=16,
                                        extra_body=GREEDY,
                                        system=[{"type": "text", "text": system}])
    assert blocks.content[0].text == r.content[0].text


def test_stream_events_join_to_the_message(srv):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Which module has deque?"}],
              max_tokens=20, extra_body=GREEDY)
    whole = srv.claude.messages.create(**kw)
    with srv.claude.messages.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds
    assert kinds[-2] == "message_delta" if kinds[-2] != "content_block_stop" else True
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = httpx.post(f"{srv.base}/v1/messages", json={**kw, **GREEDY,
                                                      "stream": True},
                     headers={"x-api-key": KEY}).text
    events = [line.split(": ", 1)[1] for line in raw.splitlines() if line.startswith("event:")]
    assert events[:2] == ["message_start", "ping"]
    assert events[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "add"}])
def test_forced_tool_use_input_validates(srv, choice):
    for seed in range(6):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,
                  extra_body={"temperature": 1.0, "seed": seed})
        r = srv.claude.messages.create(**kw)
        uses = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and uses, r
        for b in uses:
            assert choice["type"] == "any" or b.name == "add"
            jsonschema.validate(b.input, SCHEMAS[b.name])
        with srv.claude.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
            [(b.name, b.input) for b in uses]


def test_tool_result_round_trip(srv):
    r = srv.claude.messages.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body=GREEDY)
    (use,) = [b for b in r.content if b.type == "tool_use"]
    follow = ASK + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "sunny, 21 C"}]}]
    r2 = srv.claude.messages.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=30,
                                    extra_body=GREEDY)
    assert r2.content and r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens > \
        r.usage.input_tokens + r.usage.cache_read_input_tokens
    # the tool result is in the prompt: as chat completions renders it
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        ASK[0], {"role": "assistant", "content": "", "tool_calls": [{
            "id": use.id, "type": "function", "function": {
                "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {"name": t["name"],
                                                 "description": t["description"],
                                                 "parameters": t["input_schema"]}}
               for t in TOOLS])
    count = srv.claude.messages.count_tokens(model=MODEL, messages=follow, tools=TOOLS)
    assert count.input_tokens == chat.usage.prompt_tokens


def test_thinking_enabled_and_disabled(srv):
    msgs = [{"role": "user", "content": "What does json.dumps do?"}]
    on = srv.claude.messages.create(model=MODEL, messages=msgs, max_tokens=60, extra_body=GREEDY,
                                    thinking={"type": "enabled", "budget_tokens": 40})
    off = srv.claude.messages.create(model=MODEL, messages=msgs, max_tokens=60, extra_body=GREEDY,
                                     thinking={"type": "disabled"})
    assert on.content[0].type == "thinking"  # the demo model's think block is empty
    assert on.content[1].type == "text" and on.content[1].text
    assert all(b.type != "thinking" for b in off.content)
    with srv.claude.messages.stream(model=MODEL, messages=msgs, max_tokens=60, extra_body=GREEDY,
                                    thinking={"type": "enabled", "budget_tokens": 40}) as s:
        starts = [ev.content_block.type for ev in s if ev.type == "content_block_start"]
        final = s.get_final_message()
    assert starts[0] == "thinking"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in on.content]
    chat = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                              temperature=0, extra_body={
                                                  "chat_template_kwargs": {
                                                      "enable_thinking": True}})
    assert on.content[0].thinking == chat.choices[0].message.reasoning_content


def test_stop_sequences(srv):
    msgs = [{"role": "user", "content": "What is the signature of os.path.join?"}]
    full = srv.claude.messages.create(model=MODEL, messages=msgs, max_tokens=24,
                                      extra_body=GREEDY).content[0].text
    stop = full.split()[2]
    r = srv.claude.messages.create(model=MODEL, messages=msgs, max_tokens=24, extra_body=GREEDY,
                                   stop_sequences=["zzzz", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == full[:full.index(stop)].strip()
    with srv.claude.messages.stream(model=MODEL, messages=msgs, max_tokens=24, extra_body=GREEDY,
                                    stop_sequences=["zzzz", stop]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == r.content[0].text


def test_multi_turn_reads_the_prefix_cache_and_prefills_only_what_it_adds(srv):
    msgs = [{"role": "user", "content": "Tell me about the collections module, turn one."}]
    seen, last = [], 0
    for turn in range(3):
        before = srv.wait_idle()["hybridrt_prefill_tokens_total"]
        r = srv.claude.messages.create(model=MODEL, messages=msgs, max_tokens=8, extra_body=GREEDY)
        prefilled = srv.wait_idle()["hybridrt_prefill_tokens_total"] - before
        u = r.usage
        seen.append((u.input_tokens, u.cache_read_input_tokens))
        assert prefilled == u.input_tokens  # exactly the tokens not read from the cache
        assert u.cache_read_input_tokens >= (last if turn else 0)  # the last turn's prompt
        last = u.input_tokens + u.cache_read_input_tokens
        msgs = msgs + [{"role": "assistant", "content": r.content[0].text},
                       {"role": "user", "content": f"And turn {turn + 2}?"}]
    assert seen[1][1] > 0 and seen[2][1] > 0
    assert seen[1][0] < seen[0][0]  # a later turn prefills only what it adds


def test_cache_reuse_is_the_same_through_messages_and_chat_completions(srv):
    """llama.cpp #19494: the two APIs reuse the prefix cache alike. A conversation sent through
    chat completions, then again through chat completions and through /v1/messages: both
    repeats read the same number of tokens from the cache, and answer the same."""
    msgs = [{"role": "user", "content": "Which standard module parses command-line options?"}]
    first = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                               temperature=0)
    again = srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                               temperature=0)
    r = srv.claude.messages.create(model=MODEL, messages=msgs, max_tokens=6,
                                   extra_body=GREEDY)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and r.usage.cache_read_input_tokens == cached
    assert r.usage.input_tokens + cached == first.usage.prompt_tokens
    assert r.content[0].text == again.choices[0].message.content.strip()


def test_count_tokens_equals_the_chat_prompt(srv):
    msgs = [{"role": "user", "content": "Count me."}]
    n = srv.claude.messages.count_tokens(model=MODEL, messages=msgs, system="Be brief.")
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, *msgs])
    assert n.input_tokens == chat.usage.prompt_tokens


def test_api_key_header_and_anthropic_shaped_401(srv):
    wrong = anthropic.Anthropic(base_url=srv.base, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, messages=ASK, max_tokens=4)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{srv.base}/v1/messages", json={"model": MODEL, "messages": ASK,
                                                    "max_tokens": 2},
                   headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["type"] == "message"


@pytest.mark.parametrize("body, words", [
    ({"messages": ASK}, "max_tokens: field required"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "unsupported block type 'audio'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "cannot be decoded as an image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}, "source must be"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "document blocks are not supported"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "ok"},
                                    {"role": "user", "content": [
                                        {"type": "tool_result", "tool_use_id": "toolu_x",
                                         "content": "1"}]}]}, "unknown tool_use_id"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "Sure"}]},
     "prefill"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                   "name": "web_search"}]}, "server tools"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}},
     "not in tools"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"max_tokens": 4, "messages": ASK, "model": "claude-opus-4"}, "does not exist"),
])
def test_bad_requests_get_anthropic_shaped_errors(srv, body, words):
    r = httpx.post(f"{srv.base}/v1/messages", json={"model": MODEL, **body},
                   headers={"x-api-key": KEY})
    assert r.status_code in (400, 404), r.text
    err = r.json()
    assert err["type"] == "error" and words in err["error"]["message"], err
    assert err["error"]["type"] == ("not_found_error" if r.status_code == 404 else
                                    "invalid_request_error")


def test_oversize_body_gets_an_anthropic_shaped_413(srv):
    big = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "x" * (300 << 10)}]}
    r = httpx.post(f"{srv.base}/v1/messages", json=big, headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    time.sleep(0.05)
    ok = srv.claude.messages.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.type == "message"
