"""`hybridrt serve`: the real server on a loopback port, spoken to with the official openai
client and raw HTTP; outputs pinned to a cold ``LLM.generate`` of the same prompt ids (fp32,
greedy)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from hybridrt import LLM, SamplingParams  # noqa: E402
from hybridrt.server import Server  # noqa: E402

MODEL = "hybridrt-demo"
QUESTIONS = ["What does json.dumps do?", "Which module provides deque?",
             "What is the signature of os.path.join?", "What does re.sub return?"]


def make_llm(**kw) -> LLM:
    kw = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 32,
          "cache_memory": 64 << 20, **kw}
    return LLM(**kw)


class Running:
    """A Server under uvicorn in a thread, on a free loopback port."""

    def __init__(self, llm: LLM, **server_options):
        self.server = Server(llm, MODEL, **server_options)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1", port=port,
                                                log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.base}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self) -> dict[str, float]:
        deadline = time.time() + 30
        while True:
            m = self.metrics()
            if m["hybridrt_requests_running"] == 0 and m["hybridrt_requests_waiting"] == 0:
                return m
            assert time.time() < deadline, m
            time.sleep(0.05)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def ref():
    return make_llm()


@pytest.fixture(scope="module")
def srv():
    s = Running(make_llm())
    yield s
    s.stop()


def chat_ids(llm: LLM, messages: list[dict], **kwargs) -> list[int]:
    text = llm.apply_chat_template(messages, kwargs or None)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def cold(ref: LLM, ids: list[int], **params):
    params = {"temperature": 0.0, "max_tokens": 16, **params}
    (out,) = ref.generate([ids], SamplingParams(**params), use_tqdm=False)
    return out


def user(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


# Chat and completions, non-streaming and streaming -------------------------------------------
def test_chat_non_streaming_matches_llm(srv, ref):
    msgs = user(QUESTIONS[0])
    r = srv.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=16)
    want = cold(ref, chat_ids(ref, msgs))
    c = want.outputs[0]
    assert r.choices[0].message.content == c.text
    assert r.choices[0].finish_reason == c.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(c.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_non_streaming_with_usage(srv, ref):
    msgs = user(QUESTIONS[1])
    want = cold(ref, chat_ids(ref, msgs), max_tokens=20)
    chunks = list(srv.client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.outputs[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == want.outputs[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        want.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_completions_text_and_token_ids_streaming_and_not(srv, ref):
    prompt = "def read_config(path):\n    "
    ids = ref.tokenizer.encode(prompt, add_special_tokens=False)
    want = cold(ref, ids, max_tokens=12).outputs[0]
    r = srv.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    r2 = srv.client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12)
    assert r2.choices[0].text == want.text
    parts = [ch.choices[0].text for ch in srv.client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True) if ch.choices]
    assert "".join(parts) == want.text


def test_stop_strings_cut_the_text_streaming_and_not(srv, ref):
    msgs = user(QUESTIONS[2])
    out = cold(ref, chat_ids(ref, msgs), max_tokens=24).outputs[0]
    full = out.text
    # a stop string over a token boundary: the last character of one token and the first
    # two of the next, so a stream must hold text back to cut it
    pieces = [ref.tokenizer.decode(out.token_ids[:i]) for i in range(len(out.token_ids) + 1)]
    at = next(len(pieces[i]) - 1 for i in range(3, len(pieces) - 1)
              if len(pieces[i + 1]) - len(pieces[i]) >= 2 and full[:len(pieces[i])] ==
              pieces[i] and full[len(pieces[i]) - 1] != " ")
    stop = full[at:at + 3]
    assert full.index(stop) == at
    want = full[:at]
    r = srv.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=24, stop=[stop, "zzzzzz"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       srv.client.chat.completions.create(
                           model=MODEL, messages=msgs, temperature=0, max_tokens=24,
                           stop=[stop, "zzzzzz"], stream=True) if ch.choices)
    assert streamed == want


def test_logprobs_chat_and_completions(srv, ref):
    msgs = user(QUESTIONS[3])
    want = cold(ref, chat_ids(ref, msgs), max_tokens=8, logprobs=3).outputs[0]
    r = srv.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for entry, tok, lp in zip(content, want.token_ids, want.logprobs):
        assert entry.token == ref.tokenizer.decode([tok])
        assert entry.logprob == pytest.approx(lp[tok], abs=1e-5)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy: the top token
    streamed = [e for ch in srv.client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3,
        stream=True) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content]
    # the streamed request resumes from the first one's cached prefix: the same tokens, the
    # logprobs within bf16's rounding (the last prompt token is computed alone, not in a chunk)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    c = srv.client.completions.create(model=MODEL, prompt="import os\n", temperature=0,
                                      max_tokens=6, logprobs=2)
    lps = c.choices[0].logprobs
    assert "".join(lps.tokens) == c.choices[0].text
    assert len(lps.token_logprobs) == 6 and all(len(t) == 2 for t in lps.top_logprobs)
    assert lps.text_offset[0] == 0 and lps.text_offset[1] == len(lps.tokens[0])


def test_thinking_returns_reasoning_apart(srv, ref):
    msgs = user(QUESTIONS[0])
    want = ref.chat(msgs, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False,
                    chat_template_kwargs={"enable_thinking": True})[0].outputs[0]
    assert want.reasoning_text is not None  # the demo model thinks when asked to
    r = srv.client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=40,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    m = r.choices[0].message
    assert m.reasoning_content == want.reasoning_text and m.content == want.text
    chunks = [ch.choices[0].delta for ch in srv.client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=40, stream=True,
        extra_body={"enable_thinking": True}) if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == \
        want.reasoning_text
    assert "".join(d.content or "" for d in chunks) == want.text


def test_models_health_metrics(srv):
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{srv.base}/health").json() == {"status": "ok"}
    m = srv.metrics()
    for name in ("hybridrt_prompt_tokens_total", "hybridrt_prefix_reused_tokens_total",
                 "hybridrt_prefill_tokens_total", "hybridrt_cache_usage",
                 "hybridrt_spec_accepted_tokens_total", "hybridrt_requests_waiting",
                 "hybridrt_spec_ngram_draft_tokens_total",
                 "hybridrt_spec_mtp_accepted_tokens_total", "hybridrt_spec_k_chosen_total",
                 "hybridrt_spec_drafting_decisions_total"):
        assert name in m


# Bad requests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, words", [
    ({"messages": user("hi"), "temperature": -1}, 400, "temperature must be >= 0"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": user("hi"), "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ({"messages": user("hi"), "n": 0}, 400, "n must be an integer in [1, 128]"),
    ({"messages": user("hi"), "max_tokens": 0}, 400, "max_tokens must be an int >= 1"),
    ({"messages": user("hi"), "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ({"messages": user("x " * 600)}, 400, "max_model_len is 512"),
    ({"messages": user("hi"), "tools": [{"type": "function"}]}, 400, "tools[0]"),
])
def test_bad_chat_requests_get_openai_errors(srv, body, status, words):
    r = httpx.post(f"{srv.base}/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]


def test_bad_requests_raw_and_through_the_client(srv):
    r = httpx.post(f"{srv.base}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": ["a", "b"]})
    assert r.status_code == 400 and "one prompt per request" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": [10 ** 9]})
    assert r.status_code == 400 and "outside" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        srv.client.chat.completions.create(model=MODEL, messages=user("hi"), top_p=0)



def test_unknown_routes_and_methods_get_openai_json_errors(srv):
    r = httpx.get(f"{srv.base}/v1/embeddings")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["code"] == 404
    assert "/v1/embeddings" in err["message"]
    r = httpx.get(f"{srv.base}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"

def test_api_key(srv):
    srv.server.api_key = "sekrit"
    try:
        r = httpx.get(f"{srv.base}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(f"{srv.base}/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
        assert httpx.get(f"{srv.base}/health").status_code == 200
    finally:
        srv.server.api_key = None


def test_engine_error_is_a_500_and_the_server_goes_on(srv, ref):
    test_chat_non_streaming_matches_llm(srv, ref)
    assert srv.wait_idle()["hybridrt_prefix_cache_checkpoints"] >= 1
    engine = srv.server.loop.engine
    real = engine.step

    def broken():
        engine.step = real
        raise RuntimeError("injected failure")

    engine.step = broken
    r = httpx.post(f"{srv.base}/v1/chat/completions",
                   json={"messages": user("hi"), "max_tokens": 4})
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    m = srv.wait_idle()
    assert m["hybridrt_engine_errors_total"] >= 1
    assert m["hybridrt_cache_blocks_used"] == 0
    engine.cache.check()
    test_chat_non_streaming_matches_llm(srv, ref)


# Disconnects and concurrency -------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees(srv, ref):
    before = srv.metrics().get('hybridrt_requests_total{finish_reason="abort"}', 0)
    body = {"messages": user(QUESTIONS[1]), "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.base}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in got)
    m = srv.wait_idle()
    assert m['hybridrt_requests_total{finish_reason="abort"}'] == before + 1
    assert m["hybridrt_cache_blocks_used"] == 0
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{srv.base}/v1/chat/completions", json={**body, "stream": False},
                   timeout=0.5)
    m = srv.wait_idle()
    assert m['hybridrt_requests_total{finish_reason="abort"}'] == before + 2
    assert m["hybridrt_cache_blocks_used"] == 0
    test_chat_non_streaming_matches_llm(srv, ref)  # still serving, same answers


def test_bench_serve_runs_the_real_command_with_and_without_reuse(tmp_path):
    from hybridrt.bench import serve as servebench
    from hybridrt.llm import DEMO_MODEL_DIR

    # the model named, as a user would (it went before "serve" on the command line once)
    report = servebench.run(str(DEMO_MODEL_DIR), conversations=2, turns=2, max_tokens=4,
                            time_limit=60, threads=1, json_path=tmp_path / "serve.json")
    on, off = report["runs"]
    for r in (on, off):
        assert r["requests"] == 4 and r["skipped"] == 0 and r["errors"] == 0
        # inter-token gaps of a few microseconds print as 0.0 ms: the slowest are not
        assert r["ttft_ms_p50"] > 0 and r["itl_ms_p99"] > 0 and r["itl_ms_p50"] >= 0
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert off["reused_tokens"] == 0 and off["prefilled_tokens"] == off["prompt_tokens"]
    assert on["reused_tokens"] > 0
    assert on["prefilled_tokens"] == on["prompt_tokens"] - on["reused_tokens"]


def test_32_concurrent_streaming_clients_equal_llm_generate(srv, ref):
    questions = [f"{q} (case {i})" for i in range(8) for q in QUESTIONS]
    assert len(questions) == 32
    ids = [chat_ids(ref, user(q)) for q in questions]
    want = [o.outputs[0].text for o in ref.generate(
        ids, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]

    async def one(client, q):
        stream = await client.chat.completions.create(
            model=MODEL, messages=user(q), temperature=0, max_tokens=12, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream
                        if ch.choices])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{srv.base}/v1", api_key="x",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, q) for q in questions))

    assert asyncio.run(all_of_them()) == want
    m = srv.wait_idle()
    assert m["hybridrt_cache_blocks_used"] == 0


# Prefix reuse ----------------------------------------------------------------------------------
def converse(s: Running, ref: LLM, msgs: list[dict], turns: list[str], **kwargs):
    """Continue the conversation ``msgs`` (extended in place) by ``turns``; each answer must
    equal a cold run of the same prompt -> per turn (prompt tokens, cached tokens, tokens the
    server prefilled, prompt ids, answer ids)."""
    stats = []
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    for q in turns:
        msgs.append({"role": "user", "content": q})
        before = s.metrics()["hybridrt_prefill_tokens_total"]
        r = s.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                             max_tokens=16, logprobs=True, extra_body=extra)
        prefilled = s.metrics()["hybridrt_prefill_tokens_total"] - before
        ids = chat_ids(ref, msgs, **kwargs)
        want = cold(ref, ids, logprobs=0).outputs[0]
        assert r.choices[0].message.content == want.text
        # the same distributions, not only the same argmax: the reused state is exact
        got = [e.logprob for e in r.choices[0].logprobs.content]
        assert got == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)],
                                    abs=1e-4)
        assert r.choices[0].message.reasoning_content == want.reasoning_text
        u = r.usage
        stats.append((u.prompt_tokens, u.prompt_tokens_details.cached_tokens, prefilled, ids,
                      want.token_ids))
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    return stats


TURNS = ["What does json.dumps do?", "And json.loads?", "Which module provides deque?",
         "What is os.path.join for?"]


def test_multi_turn_prefills_only_the_new_tokens(srv, ref):
    stats = converse(srv, ref, [], TURNS)
    for n in range(len(stats)):
        prompt, cached, prefilled, ids, _ = stats[n]
        assert prefilled == prompt - cached
        if n == 0:
            continue  # an earlier test may have asked the same first question
        _, _, _, prev_ids, prev_answer = stats[n - 1]
        # the previous prompt and its answer up to the last token (its eos, never computed)
        assert ids[:len(prev_ids) + len(prev_answer) - 1] == (prev_ids + prev_answer)[:-1]
        assert cached == len(prev_ids) + len(prev_answer) - 1
        assert prefilled == prompt - cached


def test_multi_turn_with_a_history_rewriting_template(srv, ref):
    """A template that renders earlier answers without their think block (as Qwen3.5's
    does; the demo's keeps them): the next turn diverges where the previous answer began, and
    reuses everything before it through the GDN state saved there."""
    tokenizers = [srv.server.tokenizer, ref.tokenizer]
    demo = ref.tokenizer.chat_template
    keep = "'<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + " \
        "'\\n</think>\\n\\n' + content.lstrip('\\n')"
    assert keep in demo
    for t in tokenizers:
        t.chat_template = demo.replace(keep, "'<|im_start|>assistant\\n' + content")
    try:
        msgs = []  # questions no earlier test asked: nothing of them is cached yet
        stats = converse(srv, ref, msgs, [f"{q} Say it in a few words." for q in TURNS[:3]])
        for n in range(1, len(stats)):
            prompt, cached, prefilled, ids, _ = stats[n]
            prev_ids = stats[n - 1][3]
            assert ids[:len(prev_ids)] != prev_ids  # the generation prompt was re-rendered
            gen_start = len(ref.tokenizer.encode(ref.apply_chat_template(
                msgs[:2 * n - 1], add_generation_prompt=False), add_special_tokens=False))
            assert prev_ids[:gen_start] == ids[:gen_start]
            # resumed where the previous answer began (the checkpoint before the message that
            # starts there), or a token or two into its re-rendered generation prompt
            assert gen_start <= cached < len(prev_ids) and prefilled == prompt - cached
    finally:
        for t in tokenizers:
            t.chat_template = demo


def test_eviction_under_a_small_cache_keeps_outputs_exact(ref):
    """Three conversations on a cache that holds about two: the third evicts cached blocks of
    the least recently used one, whose next turn reuses less than all it had, and every answer
    equals a cold run's; the turn after reuses everything again."""
    s = Running(make_llm(max_model_len=128, max_num_seqs=1))
    try:
        blocks = s.metrics()["hybridrt_cache_blocks_total"]
        hist = [[] for _ in range(3)]
        ask = ("Please answer briefly, in plain words, name the module it comes from and say "
               "what it returns.")
        first = [converse(s, ref, hist[i], [f"{q} {ask}"])[0]
                 for i, q in enumerate(QUESTIONS[:3])]
        # their full blocks (what stays cached of each) cannot all stay
        assert sum((p + len(a) - 1) // 16 for p, _, _, _, a in first) > blocks
        m = s.metrics()
        assert m["hybridrt_prefix_cache_block_evictions_total"] >= 1
        assert m["hybridrt_preemptions_total"] == 0
        had = first[0][0] + len(first[0][4]) - 1  # conversation 0's computed tokens
        ((prompt, cached, prefilled, *_),) = converse(s, ref, hist[0], ["And then?"])
        assert cached < had and prefilled == prompt - cached  # partly evicted
        ((prompt, cached, prefilled, ids, answer),) = converse(s, ref, hist[0], ["Why?"])
        assert cached > 0 and prefilled == prompt - cached
    finally:
        s.stop()


def test_readme_server_examples_run(srv, capsys):
    """The README's Server examples, pointed at this test's port instead of 8000."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Server"):text.index("## Python API")]
    (python,) = re.findall(r"```python\n(.*?)```", section, re.S)
    exec(compile(python.replace("http://127.0.0.1:8000", srv.base), "README", "exec"), {})
    out = capsys.readouterr().out
    assert "cached prompt tokens:" in out and int(out.rsplit(":", 1)[1]) > 0
    curls = re.findall(r"```bash\n(.*?)```", section, re.S)[1]
    if shutil.which("curl"):
        res = subprocess.run(["bash", "-ec", curls.replace("http://127.0.0.1:8000", srv.base)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert '"object":"chat.completion"' in res.stdout and "data: [DONE]" in res.stdout
        assert "hybridrt_prefix_reused_tokens_total" in res.stdout


def test_serve_without_the_extra_and_with_bad_options(monkeypatch):
    import sys

    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    res = CliRunner().invoke(app, ["serve", "--max-model-len", "1"])
    assert res.exit_code == 2 and "--max-model-len must be an integer > 1" in res.output
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # not installed
    for args in (["serve"], ["bench", "serve"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and "pip install 'hybridrt[serve]'" in res.output
