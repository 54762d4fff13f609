"""The hybridrt CLI: chat driven through stdin, batch generate, bench, one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_char_tokenizer, write_random_checkpoint
from hybridrt.cli import bench as cli_bench
from hybridrt.cli import chat as cli_chat
from hybridrt.cli import cuda_driver as cli_cuda_driver
from hybridrt.cli.chat import Conversation, Renderer
from hybridrt.cli.main import app

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hybridrt" / "demo_model"
MODEL_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--cache-memory", "64MiB"]
GREEDY = ["--temperature", "0", "--max-tokens", "6"]
Q1, Q2 = "hello there", "how are you"

# Qwen3's chat template in miniature: past answers lose their think block, and the generation
# prompt of non-thinking mode carries an empty one; so the next prompt is not the last prompt
# plus the answer.
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n')"
    " + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if not enable_thinking is defined or not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("cli"), tiny_text_config(), seed=5)
    write_char_tokenizer(d)
    return str(d)


@pytest.fixture(scope="module")
def ref(tiny):
    return LLM(tiny, dtype="float32", max_model_len=512, cache_memory="64MiB")


def invoke(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def encode(llm, messages):
    text = llm.apply_chat_template(messages)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def greedy(llm, ids, n=6):
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return out[0].outputs[0].text, out[0].outputs[0].token_ids


def shown(text):
    """An answer as the chat prints it: then a newline unless it ends with one."""
    return text + ("\n" if text and not text.endswith("\n") else "") + "[prompt"


def in_order(out: str, pieces: list[str]) -> None:
    at = 0
    for p in pieces:
        i = out.find(p, at)
        assert i >= 0, f"{p!r} not found after position {at} in:\n{out}"
        at = i + len(p)


def stats(out: str, name: str) -> list[int]:
    return [int(v) for v in re.findall(rf"{name}\s+(\d+)", out)]


def one_error_line(res_stderr: str) -> str:
    lines = [ln for ln in res_stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res_stderr
    assert "Traceback" not in res_stderr
    return lines[0]


# chat ----------------------------------------------------------------------------------------
def test_chat_turns_reuse_the_cache_regen_clear_set_and_exit(tiny, ref):
    ids1 = encode(ref, [{"role": "user", "content": Q1}])
    t1, a1 = greedy(ref, ids1)
    a1_content = ref.tokenizer.decode(a1[:-1] if a1[-1] == 1 else a1, skip_special_tokens=False)
    conv = [{"role": "user", "content": Q1}, {"role": "assistant", "content": a1_content},
            {"role": "user", "content": Q2}]
    ids2 = encode(ref, conv)  # a fresh run of the whole conversation
    t2, _ = greedy(ref, ids2)
    script = (f"{Q1}\n{Q2}\n/stats\n/regen\n/stats\n/set temperature -1\n/set temperature 0\n"
              f"/clear\n{Q1}\n/stats\n/exit\nnever read\n")
    res = invoke("chat", tiny, *MODEL_FLAGS, *GREEDY, input=script)
    assert res.exit_code == 0, res.output
    out = res.stdout
    in_order(out, [shown(t1), shown(t2), "prompt built", shown(t2), "prompt built",
                   "temperature=0.0", "(conversation cleared)", shown(t1)])
    assert out.count("[prompt") == 4  # nothing after /exit
    cached = len(ids1) + len(a1) - 1  # the last answer token was sampled, never fed
    assert stats(out, "prompt tokens") == [len(ids2), len(ids2), len(ids1)]
    # after /clear the same first question resumes from the prefix cache like any prompt
    assert stats(out, "reused tokens") == [cached, len(ids2) - 1, len(ids1) - 1]
    assert stats(out, "prefilled tokens") == [len(ids2) - cached, 1, 1]
    assert "incremental" in out
    err = one_error_line(res.stderr)
    assert "temperature" in err and ">= 0" in err


def test_chat_drops_the_oldest_turns_when_the_context_is_full(tiny):
    """No turn fails for length: the oldest turns go (the system prompt stays), a message
    longer than the context keeps its end, and one dim line says so each time."""
    turns = [f"{c * 20}" for c in "abcdef"] + ["z" * 300, "short"]
    script = "\n".join([*turns, "/stats"]) + "\n"
    res = invoke("chat", tiny, "--dtype", "float32", "--cache-memory", "64MiB",
                 "--max-model-len", "96", "--system", "be brief", *GREEDY, input=script)
    assert res.exit_code == 0, res.output
    assert not res.stderr  # no turn failed
    out = res.stdout
    assert out.count("[prompt") == len(turns)  # every turn answered
    notes = re.findall(r"\(context limit 96 tokens: ([^)]*)\)", out)
    assert notes and all("oldest turn" in n or "kept the last" in n for n in notes)
    assert any("kept the last" in n and "of the message's 300 tokens" in n for n in notes)
    (prompt,) = stats(out, "prompt tokens")
    assert prompt <= 96 - 6  # room for --max-tokens 6


def test_conversation_drops_turns_but_keeps_the_system_prompt(ref):
    conv = Conversation(ref.tokenizer, [1], {}, system="sys")
    for q, a in (("q1", "a1"), ("q2", "a2")):
        ids, _ = conv.prompt_for(q)
        conv.messages.append({"role": "user", "content": q})
        conv.commit(ids, ref.tokenizer.encode(a, add_special_tokens=False) + [1])
    assert conv.drop_oldest_turn()
    assert [m["content"] for m in conv.messages] == ["sys", "q2", "a2"]
    assert conv.prompt_ids is None  # the next prompt is templated afresh
    assert conv.drop_oldest_turn() and not conv.drop_oldest_turn()
    assert conv.messages == [{"role": "system", "content": "sys"}]


def test_chat_speculative_stats_and_speculative_tokens_setting(tiny, ref):
    ids1 = encode(ref, [{"role": "user", "content": Q1}])
    t1, _ = greedy(ref, ids1)
    script = f"{Q1}\n/stats\n/set speculative_tokens 3\n/set speculative_tokens 0\n/regen\n"
    res = invoke("chat", tiny, *MODEL_FLAGS, *GREEDY, "--speculative-tokens", "2", input=script)
    assert res.exit_code == 0, res.output
    out = res.stdout
    first, second = out.split("speculative_tokens=0")
    assert re.search(r"\| acceptance \d\.\d\d\]", first)
    assert re.search(r"acceptance length\s+\d\.\d\d", first)
    assert "acceptance" not in second  # k=0 for the regenerated answer
    in_order(out, [shown(t1), shown(t1)])  # greedy speculation is lossless
    assert "speculative_tokens must be in [0, 2]" in res.stderr


def test_chat_set_and_help_list_every_setting_and_chat_has_generates_flags(tiny):
    script = "/set\n/help\n/set stop x y\n/set frequency_penalty 0.5\n/set stop none\n/set\n"
    res = invoke("chat", tiny, *MODEL_FLAGS, "--repetition-penalty", "1.1", input=script)
    assert res.exit_code == 0 and not res.stderr, res.output
    listing, rest = res.stdout.split("commands:")
    help_text, _ = rest.split("stop=['x y']")
    for name in cli_chat.SETTABLE:
        assert re.search(rf"^  {name} +\S", listing, re.M), name  # /set: name and value
        assert name in help_text, name
    assert re.search(r"repetition_penalty +1.1", listing)
    assert "frequency_penalty=0.5" in res.stdout and "stop=None" in res.stdout
    import typer.main

    group = typer.main.get_command(app)
    opts = {name: {o for p in group.commands[name].params if p.param_type_name == "option"
                   for o in p.opts} for name in ("chat", "generate")}
    io_only = {"--prompt", "-p", "--input", "-i", "--output", "-o", "--progress", "--chat"}
    assert opts["generate"] - io_only <= opts["chat"]


def test_ctrl_c_stops_the_answer_and_keeps_it_in_the_session(tiny, ref, monkeypatch):
    fired = []
    write = Renderer.write

    def write_then_ctrl_c(self, pieces):
        write(self, pieces)
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Renderer, "write", write_then_ctrl_c)
    ids1 = encode(ref, [{"role": "user", "content": Q1}])
    res = invoke("chat", tiny, *MODEL_FLAGS, *GREEDY, input=f"{Q1}\n{Q2}\n/stats\n")
    assert res.exit_code == 0, res.output
    assert res.stdout.count("(interrupted)") == 1 and res.stdout.count("[prompt") == 2
    (reused,) = stats(res.stdout, "reused tokens")
    (prompt,) = stats(res.stdout, "prompt tokens")
    (prefilled,) = stats(res.stdout, "prefilled tokens")
    assert len(ids1) <= reused < len(ids1) + 6  # the prompt and the partial answer
    assert prefilled == prompt - reused


def _loop(llm, text=""):
    import io

    return cli_chat.ChatLoop(llm, {"temperature": 0}, 0, None, None, False,
                             stdin=io.StringIO(text), stdout=io.StringIO())


def test_chat_reads_multi_line_messages(ref, monkeypatch):
    loop = _loop(ref, 'one line\ntwo \\\nlines\n"""\nthree\n\nlines\n"""\n"""inline"""\n'
                      '"""never closed\n')
    try:
        msgs = [loop.read() for _ in range(5)]
        assert msgs == ["one line", "two \nlines", "\nthree\n\nlines\n", "inline",
                        "never closed"]
        assert loop.read() is None
        # in a terminal, lines already waiting after the one read are the rest of a paste
        loop.interactive = True
        typed = ["pasted 1", "pasted 2", "pasted 3", "typed later"]
        prompts = []

        def fake_input(prompt):
            prompts.append(prompt)
            return typed.pop(0)

        monkeypatch.setattr("builtins.input", fake_input)
        monkeypatch.setattr(loop, "_more_pending", lambda: len(typed) > 1)
        assert loop.read() == "pasted 1\npasted 2\npasted 3"
        assert loop.read() == "typed later" and prompts == [">>> ", "", "", ">>> "]
    finally:
        ref.close_session(loop.session)


def test_chat_banner_names_the_model_and_how_it_runs(ref):
    import torch

    from hybridrt.llm import default_model

    text = cli_chat.banner(ref)
    for part in (str(ref.model_path), "float32", f"cpu, {torch.get_num_threads()} threads",
                 "context 512 tokens"):
        assert part in text, part
    assert "demo" not in text
    demo = cli_chat.banner(LLM(default_model(), max_model_len=256, cache_memory=4 << 20))
    assert "bfloat16" in demo and "context 256 tokens" in demo
    assert "demo model" in demo and "not an\n  assistant" in demo
    from hybridrt.model_path import DEMO_MODEL_DIR

    png = DEMO_MODEL_DIR / "demo.png"
    assert f"/image {png}" in demo and png.is_file()  # the picture it names ships
    # what the cache may take, as sized (4 MiB asked: at most that)
    mib = LLM(default_model(), max_model_len=256, cache_memory=4 << 20).cache_sizing.total_bytes
    assert f"cache: up to {mib / 2**20:.0f} MiB" in demo and mib <= 4 << 20


def test_incremental_prompt_is_the_template_for_chatml(ref):
    conv = Conversation(ref.tokenizer, [1], {}, system="be brief")
    ids, _ = conv.prompt_for(Q1)
    conv.messages.append({"role": "user", "content": Q1})
    answer = ref.tokenizer.encode("fine!", add_special_tokens=False) + [1]
    conv.commit(ids, answer)
    ids2, text2 = conv.prompt_for(Q2)
    assert conv.last_build == "incremental"
    assert ids2[:len(ids) + len(answer)] == ids + answer
    assert text2 == ref.apply_chat_template(conv.messages + [{"role": "user", "content": Q2}])
    assert ids2 == ref.tokenizer.encode(text2, add_special_tokens=False)


def test_qwen3_style_template_falls_back_to_retemplating(ref):
    tok = ref.tokenizer
    saved, tok.chat_template = tok.chat_template, QWEN3_STYLE_TEMPLATE
    try:
        conv = Conversation(tok, [1], {})
        ids, _ = conv.prompt_for(Q1)
        assert tok.decode(ids).endswith("assistant\n<think>\n\n</think>\n\n")
        conv.messages.append({"role": "user", "content": Q1})
        conv.commit(ids, tok.encode("fine!", add_special_tokens=False) + [1])
        ids2, text2 = conv.prompt_for(Q2)
        assert conv.last_build == "re-templated"
        assert "<|im_start|>assistant\nfine!<|im_end|>" in text2
        assert ids2 == tok.encode(text2, add_special_tokens=False)
    finally:
        tok.chat_template = saved


def test_qwen3_style_template_reuses_up_to_the_generation_prompt(ref):
    """Re-templating rewrites the last answer, but the GDN snapshot taken where the generation
    prompt started lets the next turn reuse everything before it."""
    tok = ref.tokenizer
    saved, tok.chat_template = tok.chat_template, QWEN3_STYLE_TEMPLATE
    sp = SamplingParams(temperature=0, max_tokens=6)
    s = ref.open_session()
    try:
        conv = Conversation(tok, [1], {})
        ids, _ = conv.prompt_for(Q1)
        gen1 = conv.gen_start
        assert gen1 is not None and gen1 < len(ids)
        conv.messages.append({"role": "user", "content": Q1})
        conv.commit(ids, list(ref.stream_tokens(ids, sp, session=s, snapshot_at=gen1)))
        ids2, _ = conv.prompt_for(Q2)
        assert conv.last_build == "re-templated"
        assert ref.engine.cached_tokens(ids2) >= gen1  # at least the snapshot (earlier tests
        out = list(ref.stream_tokens(ids2, sp, session=s, snapshot_at=conv.gen_start))
        assert s.last_reused_tokens >= gen1  # on the same engine may have cached more of it)
        m = ref.last_stream_output.metrics
        assert m["num_prefilled_tokens"] == len(ids2) - s.last_reused_tokens
        assert out == greedy(ref, ids2)[1]
    finally:
        tok.chat_template = saved
        ref.close_session(s)


def test_renderer_dims_hides_or_tags_the_think_block():
    pieces = [(True, "hmm"), (True, "m"), (False, "Answer <b>")]

    class Out:
        text = ""

        def write(self, t):
            self.text += t

        def flush(self):
            pass

    outs = {}
    for name, color, hide in (("hidden", True, True), ("dimmed", True, False),
                              ("piped", False, False)):
        outs[name] = Out()
        r = Renderer(outs[name], color=color, hide_thinking=hide)
        r.write(pieces)
        r.end()
    assert outs["hidden"].text == "Answer <b>"
    assert outs["dimmed"].text == "\x1b[2mhmm\x1b[22m\x1b[2mm\x1b[22m\n\nAnswer <b>"
    assert outs["piped"].text == "<think>\nhmmm\n</think>\n\nAnswer <b>"
    cut = Out()
    r = Renderer(cut, color=False, hide_thinking=False)
    r.write([(True, "cut short")])
    r.end()
    assert cut.text == "<think>\ncut short\n</think>"


# generate ------------------------------------------------------------------------------------
def test_generate_jsonl_mixed_settings_in_order_with_error_lines(tiny, ref, tmp_path):
    hello_text, _ = greedy(ref, ref.tokenizer.encode("hello"), 8)
    stop = hello_text[2]
    seeded = {"temperature": 0.9, "top_k": 20, "seed": 7, "max_tokens": 6, "logprobs": 1}
    msgs = [{"role": "user", "content": "hi"}]
    lines = [
        json.dumps({"id": "greedy", "prompt": "hello", "temperature": 0, "max_tokens": 5}),
        "plain text prompt",
        json.dumps({"id": "chat", "messages": msgs, "max_tokens": 3}),
        '{"id": "bad-json", "prompt": ',
        json.dumps({"id": "seeded", "prompt": "abc", **seeded}),
        "",
        json.dumps({"id": "bad-value", "prompt": "x", "top_p": 0}),
        json.dumps({"id": "unknown", "prompt": "x", "colour": "red"}),
        json.dumps({"id": "stop", "prompt": "hello", "max_tokens": 8, "stop": [stop]}),
        '"a JSON string"',
        "[1, 2]",
        '"Hi," she said.',
        json.dumps({"id": "think", "messages": msgs, "max_tokens": 3,
                    "chat_template_kwargs": {"enable_thinking": False}}),
        json.dumps({"id": "kwargs-no-messages", "prompt": "x",
                    "chat_template_kwargs": {"enable_thinking": True}}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    res = invoke("generate", tiny, *MODEL_FLAGS, "--temperature", "0", "--max-tokens", "4",
                 "--input", src, "--output", dst)
    assert res.exit_code == 1, res.output  # some prompts failed
    recs = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["greedy", 1, "chat", 3, "seeded", "bad-value", "unknown",
                                      "stop", 8, 9, 10, "think", "kwargs-no-messages"]
    by_id = {r["id"]: r for r in recs}
    for bad, why in [(3, "line 4: invalid JSON"), ("bad-value", "line 7: top_p"),
                     ("unknown", "line 8: unknown field(s) 'colour'"),
                     (8, "line 10: a JSON string is not a request"),
                     (9, "line 11: a JSON list is not a request"),
                     ("kwargs-no-messages", "line 14: chat_template_kwargs applies to messages")]:
        assert set(by_id[bad]) == {"id", "error"} and by_id[bad]["error"].startswith(why), bad
    assert by_id[10]["prompt"] == '"Hi," she said.'
    assert by_id["think"]["prompt"] == ref.apply_chat_template(msgs, {"enable_thinking": False})
    assert by_id["think"]["prompt"] != by_id["chat"]["prompt"]

    def same(rec, prompt, params):
        out = ref.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (rec["text"], rec["token_ids"]) == (out.text, out.token_ids)
        assert rec["finish_reason"] == out.finish_reason
        assert rec["metrics"]["num_generated_tokens"] == len(out.token_ids)

    same(by_id["greedy"], "hello", SamplingParams(temperature=0, max_tokens=5))
    same(by_id[1], "plain text prompt", SamplingParams(temperature=0, max_tokens=4))
    assert by_id["chat"]["prompt"] == ref.apply_chat_template(msgs)
    same(by_id["chat"], by_id["chat"]["prompt"], SamplingParams(temperature=0, max_tokens=3))
    same(by_id["seeded"], "abc", SamplingParams(**seeded))
    assert len(by_id["seeded"]["logprobs"]) == len(by_id["seeded"]["token_ids"])
    assert by_id["stop"]["text"] == hello_text[:hello_text.index(stop)]
    assert by_id["stop"]["finish_reason"] == "stop"
    assert "6 of 13 prompts failed" in res.stderr


def test_generate_reads_prompt_flags_then_stdin_lines(tiny):
    res = invoke("generate", tiny, *MODEL_FLAGS, "--temperature", "0", "--max-tokens", "2",
                 "--no-progress", "--prompt", "first", "--input", "-", input="second\n\nthird\n")
    assert res.exit_code == 0, res.output
    recs = [json.loads(ln) for ln in res.stdout.splitlines()]
    assert [(r["id"], r["prompt"]) for r in recs] == [(0, "first"), (1, "second"), (2, "third")]
    assert all(len(r["token_ids"]) <= 2 and r["finish_reason"] for r in recs)
    assert not res.stderr  # exit 0: every prompt succeeded


def test_generate_chat_templates_plain_prompts(tiny, ref):
    res = invoke("generate", tiny, *MODEL_FLAGS, *GREEDY, "--no-progress", "--chat", "--no-think",
                 "-p", "hi", "--input", "-",
                 input="what now\n" + json.dumps({"prompt": "raw"}) + "\n")
    assert res.exit_code == 0, res.output
    recs = [json.loads(ln) for ln in res.stdout.splitlines()]
    off = {"enable_thinking": False}
    assert [r["prompt"] for r in recs] == [
        ref.apply_chat_template([{"role": "user", "content": "hi"}], off),
        ref.apply_chat_template([{"role": "user", "content": "what now"}], off), "raw"]


def test_generate_exit_status_is_documented_in_help():
    res = invoke("generate", "--help")
    assert "Exit status: 0" in " ".join(res.stdout.split())


def test_generate_writes_each_line_when_done_and_keeps_them_when_interrupted(tiny, tmp_path,
                                                                             monkeypatch):
    """Lines go out in input order as soon as they and the ones before are done (flushed), so
    Ctrl-C in the middle of a run keeps every finished line."""
    from hybridrt.engine import LLMEngine

    lines = [json.dumps({"prompt": "a", "max_tokens": 1}),
             json.dumps({"prompt": "b", "max_tokens": 40, "ignore_eos": True}),
             json.dumps({"prompt": "c", "max_tokens": 2})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    step, calls = LLMEngine.step, []

    def step_then_ctrl_c(self):
        calls.append(1)
        if len(calls) == 6:
            assert [json.loads(ln)["id"] for ln in dst.read_text().splitlines()] == [0]
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", step_then_ctrl_c)
    res = invoke("generate", tiny, *MODEL_FLAGS, "--temperature", "0", "--no-progress",
                 "--input", src, "--output", dst)
    assert res.exit_code == 130, res.output  # as its help says
    assert res.stderr.strip() == "interrupted: wrote 1 line"
    recs = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [(r["id"], len(r["token_ids"])) for r in recs] == [(0, 1)]  # "c" waits for "b"


# errors --------------------------------------------------------------------------------------
def test_unknown_model_path_is_one_error_line(tmp_path):
    res = invoke("chat", tmp_path / "no-such-model", input="hi\n")
    assert res.exit_code != 0
    assert "no-such-model" in one_error_line(res.stderr)


@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "warm"], "--temperature"),
    (["--dtype", "float8"], "dtype"),
    (["--cache-memory", "lots"], "cache_memory"),
    (["--max-model-len", "1"], "max-model-len"),
    (["--no-such-flag"], "no-such-flag"),
], ids=["negative-temperature", "not-a-number", "dtype", "cache-memory", "max-model-len",
        "unknown-flag"])
def test_bad_flag_values_are_one_error_line_exit_2(tiny, flags, needle):
    res = invoke("chat", tiny, *flags, input="hi\n")
    assert res.exit_code == 2, res.output
    assert needle in one_error_line(res.stderr)


# Runs the CLI in a fresh interpreter -> "<exit code> <whether torch was imported>".
_NO_TORCH_PROBE = """
import sys
from hybridrt.cli.main import main
sys.argv = ["hybridrt", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    print(e.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize("args", [
    ["chat", "--temperature", "-1"],
    ["generate", "-p", "x", "--dtype", "float8"],
    ["generate", "-p", "x", "--cache-memory", "lots"],
    ["chat", "--max-model-len", "1"],
    ["chat", "--device", "tpu"],
    ["generate", "--no-such-flag"],
    ["generate", "-p", "x", "--top-p", "0"],
    ["bench", "spec", "--ks", "x"],
    ["bench", "throughput", "--dtype", "int4"],
    ["generate", "-p", "x", "--output", "/no-such-dir/out.jsonl"],
    ["serve", "--allowed-media-domains", "https://example.com"],
    ["chat", "--limit-mm-per-prompt", '{"images": 2}'],
], ids=lambda a: "-".join(a).replace("--", ""))
def test_usage_errors_print_before_torch_is_imported(args):
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE, *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          stdin=subprocess.DEVNULL)
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr)
    one_error_line(proc.stderr)


def _probe(*args, cwd=None, env=None) -> tuple[int, bool, str]:
    """The CLI in a fresh interpreter -> (exit code, whether torch was imported, stderr)."""
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE, *map(str, args)],
                          capture_output=True, text=True, timeout=120, check=False,
                          stdin=subprocess.DEVNULL, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})
    code, torch_loaded = proc.stdout.split()
    return int(code), torch_loaded == "True", proc.stderr


@pytest.mark.parametrize("command, model, needle", [
    (["generate", "MODEL", "-p", "x"], "no-such-model", "no-such-model"),
    (["chat", "MODEL"], "", "the model path is empty"),
    (["serve", "MODEL", "--port", "0"], "empty", "has no config.json"),
    (["quantize", "MODEL", "OUT"], "no-such-model", "no-such-model"),
    (["draft-vocab", "MODEL", "corpus.txt"], "empty", "has no config.json"),
], ids=["generate", "chat-empty", "serve-no-config", "quantize", "draft-vocab"])
def test_model_not_found_is_one_line_before_torch_is_imported(tmp_path, command, model, needle):
    """A MODEL that is neither a checkpoint directory nor a hub id, an empty one, a directory
    without config.json: exit 2 at once, torch never imported."""
    (tmp_path / "empty").mkdir()
    where = {"MODEL": str(tmp_path / model) if model else "", "OUT": str(tmp_path / "q")}
    code, torch_loaded, err = _probe(*[where.get(a, a) for a in command], cwd=tmp_path)
    assert (code, torch_loaded) == (2, False), err
    assert needle in one_error_line(err)


def test_offline_hub_id_is_one_line_naming_it(monkeypatch):
    """A hub id neither cached nor reachable: one line with the id and why, not the hub's
    exception chain; with HF_HUB_OFFLINE=1 before torch is imported."""
    code, torch_loaded, err = _probe("generate", "nobody-here/no-such-model", "-p", "x",
                                     env={"HF_HUB_OFFLINE": "1"})
    assert (code, torch_loaded) == (2, False), err
    line = one_error_line(err)
    assert "'nobody-here/no-such-model' is not a local directory nor in the Hugging Face " \
           "cache" in line and "HF_HUB_OFFLINE" in line
    import huggingface_hub
    from huggingface_hub import constants

    def unreachable(repo_id, local_files_only=False, **kw):
        try:
            raise OSError(-2, "Name or service not known")
        except OSError as e:
            raise RuntimeError("LocalEntryNotFoundError: a long hub story\nline two") from e

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    res = invoke("generate", "nobody-here/no-such-model", "-p", "x")
    assert res.exit_code == 2
    assert one_error_line(res.stderr) == (
        "error: model 'nobody-here/no-such-model' is not a local directory nor in the Hugging "
        "Face cache, and the Hugging Face Hub cannot be reached (Name or service not known)")


def test_empty_prompt_flag_is_a_usage_error_before_torch_is_imported():
    code, torch_loaded, err = _probe("generate", "-p", "hi", "-p", "")
    assert (code, torch_loaded) == (2, False), err
    assert one_error_line(err) == "error: --prompt 2 is empty"


def test_quantize_into_a_non_empty_directory_is_refused_before_torch_is_imported(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for out in (tmp_path / "out", tmp_path / "file"):
        code, torch_loaded, err = _probe("quantize", DEMO, out)
        assert (code, torch_loaded) == (2, False), err
        assert "exists and is not an empty directory" in one_error_line(err)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_serve_on_a_port_in_use_is_one_line_before_torch_is_imported():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, torch_loaded, err = _probe("serve", "--port", port)
    assert (code, torch_loaded) == (2, False), err
    assert one_error_line(err) == f"error: cannot listen on 127.0.0.1:{port}: already in use"
    code, torch_loaded, err = _probe("serve", "--host", "no-such-host.invalid")
    assert (code, torch_loaded) == (2, False), err
    assert "--host no-such-host.invalid" in one_error_line(err)


@pytest.mark.parametrize("args, needle", [
    (["--ray-address", "auto"], "--ray-address go(es) with --replicas N"),
    (["--router", "pow2"], "--router go(es) with --replicas N"),
    (["--replicas", "2", "--router", "random"], "--router must be prefix or pow2"),
    (["--replicas", "2", "--autoscaling", "{min"], "--autoscaling is not JSON"),
    (["--replicas", "2", "--autoscaling", "[1]"], "--autoscaling must be a JSON object"),
    (["--replicas", "2", "--autoscaling", '{"min_replicas": 3, "max_replicas": 1}'],
     "--autoscaling: Value error, max_replicas (1) must be greater than or equal to "
     "min_replicas (3)"),
    (["--replicas", "2", "--autoscaling", '{"min_replica": 1}'],
     "--autoscaling: min_replica: not a field"),
    (["--replicas", "2", "--port", "0"], "--port 0 does not go with --replicas"),
], ids=["address-alone", "router-alone", "router-name", "json", "object", "ray-rejects",
        "unknown-field", "port-0"])
def test_replica_options_mistakes_are_one_line_before_torch_is_imported(args, needle):
    if args[-1].startswith('{"'):  # Ray's own validation
        pytest.importorskip("ray")
    if "--port" not in args:
        args = ["--port", "1", *args]  # never bound: the mistake is found first
    code, torch_loaded, err = _probe("serve", *args)
    assert (code, torch_loaded) == (2, False), err
    assert needle in one_error_line(err)


def test_cuda_without_a_gpu_is_refused_before_the_model_loads(tiny, monkeypatch):
    import hybridrt.llm

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_cuda_driver, "missing_gpu_driver", lambda: None)  # torch's say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hybridrt.llm.LLM, "__init__", no_load)
    for args in (["generate", tiny, "-p", "x"], ["serve", tiny, "--port", "0"]):
        res = invoke(*args, "--device", "cuda")
        assert res.exit_code == 2, res.output
        assert "--device cuda: CUDA is not available" in one_error_line(res.stderr)


def test_a_hybridrt_folder_in_the_current_directory_is_named(tmp_path):
    """``python -m hybridrt`` in a directory with a ``hybridrt`` folder (no __init__.py) that
    Python takes for the package: one line naming the folder."""
    (tmp_path / "hybridrt").mkdir()
    proc = subprocess.run([sys.executable, "-m", "hybridrt", "--version"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode == 0:  # a regular (not editable) install: the package wins
        assert proc.stdout.startswith("hybridrt ")
        return
    assert proc.returncode == 1
    assert str(tmp_path / "hybridrt") in one_error_line(proc.stderr)


def test_exit_statuses_are_documented_in_the_help():
    text = " ".join(invoke("--help").stdout.split())
    for status in ("0 on success", "1 when something failed", "2 for a usage error",
                   "130 when interrupted"):
        assert status in text
    gen = " ".join(invoke("generate", "--help").stdout.split())
    assert "130 when interrupted (Ctrl-C)" in gen


def test_cuda_on_a_cpu_only_torch_is_one_error_line_exit_2(tiny, monkeypatch):
    import torch

    monkeypatch.setattr(cli_cuda_driver, "missing_gpu_driver", lambda: None)  # torch's say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    res = invoke("generate", tiny, "-p", "x", "--device", "cuda")
    assert res.exit_code == 2
    assert "CUDA is not available in this PyTorch build" in one_error_line(res.stderr)


def test_broken_checkpoint_is_one_error_line(tiny, tmp_path):
    (tmp_path / "config.json").write_text(Path(tiny, "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{trunc")
    res = invoke("generate", tmp_path, "--prompt", "hi")
    assert res.exit_code == 1
    one_error_line(res.stderr)


def test_python_m_chat_over_a_pipe(tiny, ref):
    t1, _ = greedy(ref, encode(ref, [{"role": "user", "content": Q1}]))
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrt.cli", "chat", tiny, *MODEL_FLAGS, *GREEDY,
         "--threads", "2"],
        input=f"{Q1}\n/exit\n", capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(shown(t1)), proc.stdout
    assert "Traceback" not in proc.stderr


# the command line itself -----------------------------------------------------------------------
def test_version_and_bare_hybridrt_prints_help_exit_0():
    from hybridrt import __version__

    res = invoke("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"hybridrt {__version__}"
    for args in ([], ["bench"]):
        res = invoke(*args)
        assert res.exit_code == 0, res.output
        assert res.stdout.startswith("Usage: hybridrt") and not res.stderr


def test_python_m_hybridrt_is_the_cli():
    proc = subprocess.run([sys.executable, "-m", "hybridrt", "--version"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("hybridrt "), proc.stderr


def _all_commands(group, path=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _all_commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_every_option_has_a_help_line_with_its_default():
    import typer.main

    for path, cmd in _all_commands(typer.main.get_command(app)):
        for p in cmd.params:
            if p.param_type_name != "option" or p.name == "help":
                continue
            where = f"{' '.join(path)} {p.opts[0]}"
            assert p.help, f"{where} has no help"
            shown = p.show_default and p.default is not None and not (
                p.is_flag and not p.secondary_opts and p.default is False)
            assert shown or "default" in p.help, f"{where}: the help does not give the default"
        res = invoke(*path, "--help")
        assert res.exit_code == 0 and "<bool>" not in res.stdout, res.stdout


# the model / engine option group (cli/options.py) --------------------------------------------
# The commands that build an LLM take the whole group (bench busy / serve / startup: in the
# processes they start). bench quality builds none (it loads the weights itself at each
# quantization it compares) and takes the group's --threads only.
LOADING_COMMANDS = (("chat",), ("generate",), ("serve",)) + tuple(("bench", c) for c in (
    "throughput", "spec", "prefix", "prefix-policy", "preemption", "busy", "startup", "serve",
    "steps", "structured"))
# Every default that differs from the group's, by command.
OWN_DEFAULTS = {
    ("chat",): {"max_num_seqs": 2},
    ("bench", "throughput"): {"dtype": "bfloat16"},
    ("bench", "spec"): {"dtype": "float32"},
    ("bench", "prefix"): {"cache_memory": "4GiB"},
    ("bench", "prefix-policy"): {"cache_memory": "6GiB", "max_model_len": 4096, "threads": 2},
    ("bench", "preemption"): {"dtype": "bfloat16", "cache_memory": "12MiB",
                              "max_model_len": 4096, "max_num_seqs": 8},
    ("bench", "steps"): {"dtype": "bfloat16", "cache_memory": "0.2", "max_model_len": 512,
                         "threads": 2},
    ("bench", "structured"): {"threads": 2},
}
# Options spelled as one of the group's flags but not the group's, and why.
NOT_THE_GROUPS = {
    ("bench", "gemm", "--threads"): "a kernel benchmark, no model: 2 threads by default",
    ("bench", "gemv", "--threads"): "a kernel benchmark, no model: 2 threads by default",
    ("quantize", "--quantization"): "which format to write: int8 by default",
    ("bench", "responsive", "--max-num-batched-tokens"): "the step budget measured: 2048 by "
    "default",
}


def _model_option_group():
    """The group's parameters as click builds them for a command that takes it."""
    import dataclasses

    import typer
    import typer.main

    from hybridrt.cli.options import ModelOptions, model_options

    probe = typer.Typer(add_completion=False)

    @probe.command()
    @model_options()
    def command(options: ModelOptions) -> None:
        """A command that takes the group."""

    fields = {f.name for f in dataclasses.fields(ModelOptions)}
    params = {p.name: p for p in typer.main.get_command(probe).params if p.name in fields}
    assert set(params) == fields
    return params


def _same_param(a, b, help_too: bool = True) -> bool:
    """The same flag (and, with help_too, the same help but for a default of its own)."""
    from hybridrt.cli.options import without_default_text

    def what(p):
        kind = getattr(getattr(p, "type", None), "name", None)
        text = without_default_text(p.help or "") if help_too else None
        return p.param_type_name, p.opts, p.secondary_opts, text, kind

    return what(a) == what(b)


def _refused(p) -> bool:
    return (p.help or "").startswith("Not taken by this command: ")


def _command(path):
    import typer.main

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def test_every_model_loading_command_takes_every_flag_of_the_model_option_group():
    group = _model_option_group()
    assert {"--quantization", "--dtype", "--max-num-seqs", "--max-num-batched-tokens",
            "--device", "--threads", "--draft-vocab", "--batch-invariant", "--block-size",
            "--backend", "--async-scheduling", "--checkpoint-interval", "--checkpoint-share",
            "--max-num-sessions", "--engine-seed"} <= {o for p in group.values() for o in p.opts}
    assert set(OWN_DEFAULTS) <= set(LOADING_COMMANDS)
    for path in LOADING_COMMANDS:
        where = f"hybridrt {' '.join(path)}"
        params = {p.name: p for p in _command(path).params}
        for field, ref in group.items():
            assert field in params, f"{where} lacks {ref.opts[0] if ref.opts else field}"
            p = params[field]
            refused = _refused(p)
            assert _same_param(p, ref, help_too=not refused and field != "model"), \
                f"{where} {field}"
            if refused:
                continue
            default = OWN_DEFAULTS.get(path, {}).get(field, ref.default)
            assert p.default == default, f"{where} {field}"
    assert "--quantization" in invoke("serve", "--help").stdout


def test_every_option_named_as_a_group_flag_is_the_groups():
    """No command declares its own --dtype, --threads, ... beside the group's (the drift the
    group ends), but for the listed ones, which mean something else there."""
    import typer.main

    group = _model_option_group()
    by_flag = {o: p for p in group.values() if p.param_type_name == "option" for o in p.opts}
    seen = set()
    for path, cmd in _all_commands(typer.main.get_command(app)):
        for p in cmd.params:
            flag = next((o for o in p.opts if o in by_flag), None)
            if p.param_type_name != "option" or flag is None:
                continue
            if (*path, flag) in NOT_THE_GROUPS:
                seen.add((*path, flag))
                assert not _same_param(p, by_flag[flag]), (*path, flag)
                continue
            assert _same_param(p, by_flag[flag], help_too=not _refused(p)), \
                f"hybridrt {' '.join(path)} {flag}"
    assert seen == set(NOT_THE_GROUPS)


# every flag of the group but MODEL, given, and the LLM keyword arguments they stand for
GROUP_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "3",
               "--max-num-batched-tokens", "64", "--cache-memory", "64MiB", "--threads", "1",
               "--device", "cpu", "--quantization", "int8", "-k", "2", "--draft-vocab", "8",
               "--no-prefix-caching", "--batch-invariant", "--block-size", "32",
               "--backend", "cpu", "--no-async-scheduling", "--checkpoint-interval", "256",
               "--checkpoint-share", "0.5", "--max-num-sessions", "4", "--engine-seed", "7",
               "--language-model-only",
               "--speculative-method", "mtp+ngram", "--speculative-adaptive",
               "--prompt-lookup-min", "1", "--prompt-lookup-max", "3",
               "--prefix-cache-dir", "/tmp/pc", "--prefix-cache-dir-size", "1GiB",
               "--hf-overrides", '{"max_position_embeddings": 1024}',
               "--kv-cache-dtype", "int8", "--vision-quantization", "int8",
               "--limit-mm-per-prompt", '{"image": 4}', "--video-fps", "1.5",
               "--video-max-frames", "8", "--encoder-cache-memory", "1MiB"]
GROUP_KWARGS = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 3,
                "max_num_batched_tokens": 64, "cache_memory": "64MiB", "device": "cpu",
                "threads": 1, "quantization": "int8", "speculative_tokens": 2,
                "draft_vocab_size": 8, "enable_prefix_caching": False, "batch_invariant": True,
                "block_size": 32, "backend": "cpu", "async_scheduling": False,
                "checkpoint_interval": 256, "checkpoint_share": 0.5, "max_num_sessions": 4,
                "seed": 7, "language_model_only": True, "speculative_method": "mtp+ngram",
                "speculative_adaptive": True,
                "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "prefix_cache_dir": "/tmp/pc", "prefix_cache_dir_size": "1GiB",
                "hf_overrides": '{"max_position_embeddings": 1024}',
                "kv_cache_dtype": "int8", "vision_quantization": "int8",
                "limit_mm_per_prompt": '{"image": 4}', "video_fps": 1.5, "video_max_frames": 8,
                "encoder_cache_memory": "1MiB",
                "mmproj": None}  # --mmproj takes a GGUF model: tests/test_gguf_mmproj.py


def _record_llm(monkeypatch):
    import hybridrt.llm

    seen = []

    def record(self, model=None, **kwargs):
        seen.append((model, kwargs))
        raise ValueError("recorded")

    monkeypatch.setattr(hybridrt.llm.LLM, "__init__", record)
    return seen


def test_every_model_option_reaches_llm(tiny, monkeypatch):
    """The group's flags -> LLM's keyword arguments, the same for chat, generate and serve
    (serve --quantization included): every keyword argument of LLM but the tokenizer and
    trace (the ``hybridrt trace`` command)."""
    import inspect

    import hybridrt.llm
    from hybridrt.cli.options import ModelOptions

    llm_kwargs = set(inspect.signature(hybridrt.llm.LLM).parameters) - {"self", "model"}
    assert set(GROUP_KWARGS) == llm_kwargs - {"tokenizer", "trace"}  # trace: hybridrt trace
    assert set(ModelOptions().llm_kwargs()) == set(GROUP_KWARGS)
    seen = _record_llm(monkeypatch)
    runs = {"chat": [], "generate": ["-p", "x"], "serve": ["--port", "0"]}
    for name, extra in runs.items():
        res = invoke(name, tiny, *GROUP_FLAGS, *extra, input="hi\n")
        assert res.exit_code == 1 and "recorded" in one_error_line(res.stderr), res.output
    assert len(seen) == 3 and all(Path(m).samefile(tiny) for m, _ in seen)
    assert [kw for _, kw in seen] == [GROUP_KWARGS] * 3


def _without(flags: list[str], *drop: str) -> list[str]:
    """GROUP_FLAGS less the flags ``drop`` (and their values)."""
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
            continue
        if f in drop:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("-")
            continue
        out.append(f)
    return out


# bench command -> (its own arguments, the group flags it refuses)
BENCH_RUNS = {
    "spec": (["--ks", "0,2"], ["-k", "--draft-vocab", "--no-prefix-caching", "--max-num-seqs",
                               "--max-model-len"]),
    "prefix": ([], ["--no-prefix-caching", "--max-model-len", "--max-num-seqs"]),
    "prefix-policy": ([], ["--max-num-seqs", "--no-prefix-caching", "--checkpoint-interval",
                           "--checkpoint-share"]),
    "preemption": (["--long", "100,10", "--short", "50,10"], ["--checkpoint-share"]),
    "steps": ([], ["--quantization", "--max-num-seqs"]),
    "throughput": (["--no-transformers"], [
        "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--cache-memory",
        "--block-size", "--max-num-sessions", "--device", "-k", "--draft-vocab"]),
}


def test_bench_commands_pass_every_group_flag_they_take_to_llm(tiny, monkeypatch):
    """A bench command builds its LLM from the group flags it takes (what it does not set
    itself, e.g. --engine-seed, --backend, --block-size reach LLM as given)."""
    seen = _record_llm(monkeypatch)
    for name, (extra, refused) in BENCH_RUNS.items():
        flags = _without(GROUP_FLAGS, *refused)
        seen.clear()
        res = invoke("bench", name, tiny, *flags, *extra)
        assert "recorded" in res.output + str(res.exception), (name, res.output)
        assert len(seen) == 1 and Path(seen[0][0]).samefile(tiny), name
        given = {f for f in flags if f.startswith("-")}
        for kwarg, value in GROUP_KWARGS.items():
            if _flag_names(kwarg) & given:
                assert seen[0][1].get(kwarg) == value, (name, kwarg, seen[0][1])


def _flag_names(kwarg: str) -> set[str]:
    group = _model_option_group()
    field = {"seed": "engine_seed"}.get(kwarg, kwarg)
    return set(group[field].opts) | set(group[field].secondary_opts)


def test_bench_subprocess_commands_pass_the_group_on(monkeypatch):
    """bench startup / busy / serve hand the group to the processes they start: startup as
    generate's flags and the probe's kwargs, busy as the probe's kwargs, serve as its flags."""
    import hybridrt.bench.busy
    import hybridrt.bench.serve
    import hybridrt.bench.startup

    calls = {}
    monkeypatch.setattr(hybridrt.bench.startup, "run_startup_bench",
                        lambda *a, **kw: calls.setdefault("startup", kw))
    monkeypatch.setattr(hybridrt.bench.busy, "run_busy_bench",
                        lambda *a, **kw: calls.setdefault("busy", kw))
    monkeypatch.setattr(hybridrt.bench.serve, "run", lambda **kw: calls.setdefault("serve", kw))
    flags = ["--engine-seed", "7", "--block-size", "32", "--no-async-scheduling"]
    for name in ("startup", "busy", "serve"):
        res = invoke("bench", name, *flags, "--threads", "1") if name != "busy" else \
            invoke("bench", name, *flags)
        assert res.exit_code == 0, res.output
    assert calls["startup"]["engine_flags"] == ["--block-size", "32", "--no-async-scheduling",
                                                "--engine-seed", "7"]
    assert calls["startup"]["threads"] == 1 and calls["serve"]["threads"] == 1
    for name in ("startup", "busy"):
        engine = calls[name]["engine"]
        assert (engine["seed"], engine["block_size"], engine["async_scheduling"]) == (
            7, 32, False), name
        assert "threads" not in engine
    assert calls["serve"]["engine_flags"] == calls["startup"]["engine_flags"]


@pytest.mark.parametrize("args", [
    ("spec", "--max-num-seqs", "4"), ("spec", "-k", "2"), ("throughput", "--device", "cuda"),
    ("busy", "--threads", "2"), ("serve", "--no-prefix-caching"),
    ("steps", "--quantization", "int8"), ("prefix", "--prefix-caching"),
    ("prefix-policy", "--checkpoint-interval", "0"), ("structured", "--max-model-len", "64"),
    ("preemption", "--checkpoint-share", "0.1"),
])
def test_a_bench_refuses_a_group_flag_it_sets_itself_in_one_line(args):
    res = invoke("bench", *args)
    assert res.exit_code == 2, res.output
    line = one_error_line(res.stderr)
    flag = {"-k": "--speculative-tokens"}.get(args[1], args[1]).replace("--no-", "--")
    assert f"is not taken by bench {args[0]}: " in line and flag in line, line


def test_every_bench_command_takes_json_and_the_charted_ones_plot():
    """What README.md and `hybridrt bench --help` say of --json and --plot is true."""
    import re

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    said = re.search(r"`hybridrt bench` also has (.*?); each prints a table, `--json FILE` "
                     r"writes the report\s+\(`throughput` and `spec`: `--plot PNG`", readme, re.S)
    assert said, "README's bench line changed: update this test"
    listed = set(re.findall(r"`([a-z-]+)`", said.group(1)))
    bench = _command(("bench",))
    benchmarks = {n: c for n, c in bench.commands.items()
                  if n not in ("llamacpp-build", "llamacpp-convert")}  # tools, not benchmarks
    assert listed | {"throughput", "steps", "spec", "startup"} == set(benchmarks)
    text = " ".join(invoke("bench", "--help").stdout.split())
    assert "Each prints a table; --json FILE writes its report, --plot PNG (throughput, spec) " \
           "a chart. llamacpp-build builds llama.cpp and llamacpp-convert a GGUF" in text
    for name, cmd in benchmarks.items():
        opts = {o for p in cmd.params for o in p.opts}
        assert "--json" in opts, f"bench {name} lacks --json"
        assert ("--plot" in opts) == (name in ("throughput", "spec")), f"bench {name} --plot"


# bench command -> (module, the function it runs, its own arguments)
BENCH_ENTRIES = {
    "throughput": ("throughput", "throughput", ["--no-transformers"]),
    "gemv": ("gemv", "run_gemv_bench", []),
    "spec": ("spec", "run_spec_bench", []),
    "quality": ("quality", "run_quality", []),
    "startup": ("startup", "run_startup_bench", []),
    "gguf-error": ("gguf_error", "run_gguf_error_bench", ["pyproject.toml"]),
    "busy": ("busy", "run_busy_bench", []),
    "serve": ("serve", "run", []),
    "prefix": ("prefix", "run", []),
    "preemption": ("preemption", "run_preemption_bench", []),
    "steps": ("steps", "run", []),
    "prefix-policy": ("prefix_policy", "run", []),
    "structured": ("structured", "run", []),
    "long": ("long", "run", []),
    "responsive": ("responsive", "run", []),
    "kv-quality": ("kv_quality", "run", []),
    "attention": ("prompt_attention", "run", []),
}


def test_each_bench_hands_its_json_and_plot_paths_to_what_writes_them(monkeypatch, tmp_path):
    """--json FILE reaches the function that writes the report (each one's writing is tested
    with the benchmark: test_bench_*.py, test_preemption.py, test_serve.py), gemm's report is
    written by the command, and --plot PNG is drawn from the report (throughput, spec)."""
    import importlib

    pytest.importorskip("matplotlib")
    benchmarks = set(_command(("bench",)).commands) - {"llamacpp-build", "llamacpp-convert"}
    assert set(BENCH_ENTRIES) | {"gemm"} == benchmarks
    reports = {"throughput": {"model": "m", "dtype": "bf16", "threads": 1,
                              "hybridrt": {"prefill_tok_s": 1.0, "decode_b1_tok_s": 2.0}},
               "spec": {"model": "m", "rows": [{"k": 0, "batch_size": 1, "tok_s": 1.0},
                                               {"k": 1, "batch_size": 1, "tok_s": 2.0,
                                                "mean_acceptance_length": 1.5}]}}
    for name, (module, func, extra) in BENCH_ENTRIES.items():
        seen = {}

        def record(*args, name=name, seen=seen, **kwargs):
            seen.update(kwargs)
            return reports.get(name, {})

        monkeypatch.setattr(importlib.import_module(f"hybridrt.bench.{module}"), func, record)
        if name == "serve":
            monkeypatch.setattr("hybridrt.cli.serve._check_deps", lambda what: None)
        if name == "structured":
            monkeypatch.setattr(importlib.util, "find_spec", lambda m: object())
        out, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
        plot = ["--plot", png] if name in reports else []
        res = invoke("bench", name, *extra, "--json", out, *plot)
        monkeypatch.undo()
        assert res.exit_code == 0, (name, res.output)
        assert str(seen.get("json_path")) == str(out), (name, seen)
        if plot:
            assert _is_png(png), name
    monkeypatch.setattr("hybridrt.bench.gemm.gemm", lambda *a, **k: [{"rows": 1}])
    res = invoke("bench", "gemm", "--rows", "1", "--json", tmp_path / "gemm.json")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "gemm.json").read_text())["rows"] == [{"rows": 1}]


def test_quantize_help_gives_int4_head_bits_as_the_kernel_has_them():
    from hybridrt.kernels import int4

    assert int4.Int6Weight.bits == 6
    text = " ".join(invoke("quantize", "--help").stdout.split())
    assert "the embedding / LM head in 6 bits" in text


# bench ---------------------------------------------------------------------------------------
def test_bench_throughput_on_tiny_checkpoint_gives_both_engines_the_same_work(tiny, tmp_path):
    out = tmp_path / "tp.json"
    torch.set_num_threads(2)
    try:
        res = invoke("bench", "throughput", tiny, "--dtype", "float32", "--threads",
                     "1", "--prefill-len", "16", "--prompt-len", "4", "--decode-tokens", "3",
                     "--concurrency", "2,9", "--repeats", "1", "--full", "--json", out)
        assert torch.get_num_threads() == 2  # the benchmark puts the caller's count back
    finally:
        torch.set_num_threads(1)
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["workload"] == {"prefill_len": 16, "prompt_len": 4, "decode_tokens": 3,
                                  "concurrency": [2, 9], "repeats": 1}
    work = report["work"]["hybridrt"]
    assert work["prefill_tok_s"] == {"requests": 1, "prompt_len": 16, "new_tokens": 1}
    assert work["decode_b1_tok_s"] == {"requests": 1, "prompt_len": 4, "new_tokens": 3}
    for c in (2, 9):
        for row in (f"aggregate_b{c}_tok_s", f"decode_b{c}_tok_s"):
            assert work[row] == {"requests": c, "prompt_len": 4, "new_tokens": 3}
    assert report["work"]["transformers"] == work  # every row: same requests, same new tokens
    assert set(report["ratio_vs_transformers"]) == set(report["hybridrt"]) == set(work)
    for row, ratio in report["ratio_vs_transformers"].items():
        assert ratio == pytest.approx(report["hybridrt"][row] / report["transformers"][row])
    assert report["ratio_decode_b9_vs_b1"] == pytest.approx(
        report["hybridrt"]["decode_b9_tok_s"] / report["hybridrt"]["decode_b1_tok_s"])
    assert "interleaved_decode_b9_over_b1" in report and "output, 9 concurrent" in res.stdout
    assert report["peak_rss_gib"] > 0 and "peak RSS (GiB)" in res.stdout


def test_bench_startup_smoke(tmp_path):
    """Fresh interpreters: import torch, generate one token of the demo model, a usage
    error; the report says how much the load and first token add to importing torch."""
    out = tmp_path / "startup.json"
    res = invoke("bench", "startup", "--runs", "1", "--threads", "1", "--json", out)
    assert res.exit_code == 0, res.output
    assert "load + first token beyond import torch" in res.stdout
    r = json.loads(out.read_text())
    assert set(r["median_s"]) == {"import_torch", "generate", "usage_error"}
    assert r["median_s"]["usage_error"] < r["median_s"]["import_torch"]  # no torch import
    assert r["generate_minus_import_torch_s"] > 0 and r["dtype"] == "bfloat16"
    assert r["phases_median_s"]["load"] > 0 and r["threads"] == 1


def test_plot_without_matplotlib_is_one_error_line_exit_2(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(cli_bench, "has_matplotlib", lambda: False)
    for args in (["bench", "spec", tiny, "--quick"], ["bench", "throughput"]):
        res = invoke(*args, "--plot", tmp_path / "x.png")
        assert res.exit_code == 2
        assert "matplotlib" in one_error_line(res.stderr)


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plots_are_written_as_png(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    res = invoke("bench", "spec", tiny, "--quick", "--ks", "0,1", "--batch-sizes", "1,2",
                 "--max-tokens", "3", "--threads", "1", "--json", tmp_path / "s.json",
                 "--plot", tmp_path / "s.png")
    assert res.exit_code == 0, res.output
    assert _is_png(tmp_path / "s.png")
    ours = {"prefill_tok_s": 100.0, "decode_b1_tok_s": 10.0}
    cli_bench.plot_throughput({"model": "m", "dtype": "bf16", "threads": 2, "hybridrt": ours,
                               "transformers": ours}, tmp_path / "t.png")
    assert _is_png(tmp_path / "t.png")


def spec_acceptance(report: dict, k: int) -> float:
    """Draft acceptance rate at ``k`` (batch 1 where there are several batch sizes)."""
    rows = [r for r in report["rows"] if r["k"] == k]
    rows.sort(key=lambda r: r.get("batch_size", 0))
    return rows[0]["mean_acceptance_length"] - 1.0


def test_bench_spec_quick_smoke_on_tiny_checkpoint(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("bench", "spec", tiny, "--quick", "--ks", "0,1", "--batch-sizes", "1",
                 "--max-tokens", "2")
    assert res.exit_code == 0, res.output
    assert "per-position acceptance" in res.stdout and not list(tmp_path.iterdir())  # no --json
    out = tmp_path / "spec.json"
    res = invoke("bench", "spec", tiny, "--quick", "--ks", "0,2", "--batch-sizes", "2",
                 "--max-tokens", "4", "--threads", "1", "--json", out)
    assert res.exit_code == 0, res.output
    assert "per-position acceptance" in res.stdout  # the table
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["batch_size"], r["k"]) for r in rows] == [(2, 0), (2, 2)]
    assert rows[1]["identical_to_k0"] and 1.0 <= rows[1]["mean_acceptance_length"] <= 3.0
    # the verify step's cost by rows per sequence, beside the decode step's (1 row)
    (cost,) = report["verify_cost"]
    assert (cost["batch_size"], cost["k"], cost["rows_per_sequence"]) == (2, 2, 3)
    assert cost["verify_over_step"] == pytest.approx(rows[1]["verify_over_step"])
    assert cost["decode_ms"] == pytest.approx(rows[1]["decode_s"] * 1e3)
    assert "verify step, batch 2, by rows per sequence (decode step: 1 row" in res.stdout


# the demo checkpoint (needs its trained weights in hybridrt/demo_model) ----------------------
def test_bench_spec_quick_on_demo_checkpoint_accepts_half(tmp_path):
    assert (DEMO / "model.safetensors").is_file(), "demo weights missing"
    out = tmp_path / "spec.json"
    res = invoke("bench", "spec", "--quick", "--ks", "0,1", "--batch-sizes", "1", "--threads", "1",
                 "--json", out)
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert all(r["identical_to_k0"] for r in report["rows"] if r["k"])
    # 17 drafts: 9 accepted before the vision tower, 8 after (evaluate.py on 777 drafts: 0.722
    # before, 0.700 after); random drafts would take about 1 in 6000
    assert spec_acceptance(report, 1) >= 0.45


def test_demo_checkpoint_matches_transformers():
    assert (DEMO / "model.safetensors").is_file(), "demo weights missing"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrt import load_model
    from hybridrt.forward_batch import ForwardBatch
    from hybridrt.statecache import CacheTensors

    tok = AutoTokenizer.from_pretrained(str(DEMO))
    text = tok.apply_chat_template([{"role": "user", "content": "What does `json.dumps` do?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    ref = AutoModelForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()

    net, config, _ = load_model(DEMO, torch.float32, with_mtp=False)
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    cache = CacheTensors.allocate(config, num_blocks=blocks + 1, num_slots=2, block_size=bs,
                                  dtype=torch.float32)
    pos = torch.arange(n)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=pos, cu_seqlens=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]), slot_mapping=pos, block_tables=torch.arange(blocks)[None],
        state_slots=torch.tensor([1]), has_initial_state=torch.tensor([False]),
        logits_indices=pos,
    )
    with torch.no_grad():
        ours = net.compute_logits(net(batch, cache)[batch.logits_indices]).float()
    assert ours.shape == expected.shape
    err = ((ours - expected).abs().max() / expected.abs().max()).item()
    assert err <= 1e-4, f"max-abs error {err:.3g} x max|ref|"


def test_demo_template_keeps_chat_turns_incremental():
    """The shipped template renders each turn as a prefix of the next, so chat reuses the
    cached conversation on the default model (with and without thinking)."""
    from transformers import PreTrainedTokenizerFast

    from hybridrt.llm import default_model

    tok = PreTrainedTokenizerFast.from_pretrained(default_model())
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for kwargs in ({}, {"enable_thinking": True}):
        conv = Conversation(tok, [im_end], kwargs, system="be brief")
        ids, _ = conv.prompt_for("What does `json.dumps` do?")
        conv.messages.append({"role": "user", "content": "What does `json.dumps` do?"})
        body = "<think>\nshort\n</think>\n\nSerialize obj." if kwargs else "Serialize obj."
        answer = tok.encode(body, add_special_tokens=False) + [im_end]
        conv.commit(ids, answer)
        ids2, text2 = conv.prompt_for("And `json.loads`?")
        assert conv.last_build == "incremental", kwargs
        assert ids2[:len(ids) + len(answer)] == ids + answer
        assert text2 == tok.apply_chat_template(
            conv.messages + [{"role": "user", "content": "And `json.loads`?"}],
            tokenize=False, add_generation_prompt=True, **kwargs)


def test_bench_gemv_sizes_its_cache_weights_from_the_l2(tmp_path):
    """The kernels' time from cache is taken on a weight sized from one core's L2 as Linux
    reports it ("1024K", "2M"); where it does not, 512 KiB."""
    from hybridrt.bench.gemv import l2_bytes

    f = tmp_path / "size"
    for text, size in (("1024K\n", 1 << 20), ("2M", 2 << 20), ("48K", 48 << 10),
                       ("65536", 65536), ("", 512 << 10), ("big", 512 << 10)):
        f.write_text(text)
        assert l2_bytes(str(f)) == size, text
    assert l2_bytes(str(tmp_path / "missing")) == 512 << 10


def test_bench_gemv_reports_every_path_and_row_count(tmp_path):
    """``hybridrt bench gemv`` on a tiny shape: every path built here and row count, each against
    the read loop over the same bytes and the path's peak; bad --paths / --rows: one error line,
    exit 2."""
    from hybridrt.bench.fixtures import TINY_TEXT_CONFIG
    from hybridrt.bench.gemv import run_gemv_bench, step_products
    from hybridrt.kernels import int4, native, quant

    if native.load() is None:
        pytest.skip("compiled kernels unavailable")
    shapes = step_products(TINY_TEXT_CONFIG)
    assert len(shapes) == 4 * 4 + 1 and shapes[-1] == (97, 48) and shapes[12] == (4 * 12 * 2
                                                                                  + 2 * 2 * 12, 48)
    report = run_gemv_bench((1, 3), threads=1, repeats=1, verbose=False, config=TINY_TEXT_CONFIG,
                            json_path=tmp_path / "g.json")
    built = native.half_paths() + [f"int{b}-{i}" for b, m in ((8, quant), (4, int4))
                                   for i in m.available_isas() if i != "ref"]
    got = [(r["path"], r["rows"]) for r in report["results"]]
    assert got == [(p, m) for p in ("bf16dot", "fma", "int8-vnni", "int8-avx2", "int4-vnni",
                                    "int4-avxvnni", "int4-avx2") if p in built for m in (1, 3)]
    assert report["read_gb_s"].keys() == {"bf16", "int8", "int4"} & {
        p.split("-")[0] if p.startswith("int") else "bf16" for p in built}
    vector4 = [i for i in int4.available_isas() if i != "ref"]
    if vector4:  # one path alone: only its read loop
        one = f"int4-{vector4[-1]}"
        report = run_gemv_bench((1,), threads=1, repeats=1, verbose=False,
                                config=TINY_TEXT_CONFIG, paths=[one])
        assert [r["path"] for r in report["results"]] == [one]
        assert report["read_gb_s"].keys() == {"int4"}
    assert all(r["ms"] > 0 and r["share_of_read_bound"] > 0 and r["from_cache_ms"] > 0
               for r in report["results"])
    assert json.loads((tmp_path / "g.json").read_text())["rows"] == [1, 3]
    for args, msg in ((["--paths", "bf16,fma"], "unknown path(s) bf16"),
                      (["--rows", "1,9"], "at most 8 rows")):
        res = invoke("bench", "gemv", *args)
        assert res.exit_code == 2 and msg in res.output, res.output


# one exit status per kind of mistake ----------------------------------------------------------
def _hiding(tmp_path: Path, *modules: str) -> dict[str, str]:
    """Environment for a fresh interpreter in which ``modules`` are not installed (None in
    sys.modules: import fails, importlib.util.find_spec says None)."""
    shim = tmp_path / "hide"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim),
                                                        os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("args, hidden, fix", [
    (["serve", "--port", "0"], "starlette", "pip install 'hybridrt[serve]'"),
    (["serve", "--port", "0"], "uvicorn", "pip install 'hybridrt[serve]'"),
    (["bench", "serve"], "httpx", "pip install 'hybridrt[serve]'"),
    (["serve", "--replicas", "2", "--port", "1"], "ray", "pip install 'hybridrt[ray]'"),
    (["bench", "throughput", "--plot", "p.png"], "matplotlib", "pip install 'hybridrt[plot]'"),
    (["bench", "structured"], "xgrammar,llguidance", "pip install 'hybridrt[structured]'"),
], ids=["serve-starlette", "serve-uvicorn", "bench-serve-httpx", "replicas-ray", "plot",
        "structured"])
def test_a_missing_extra_is_exit_2_with_the_pip_command(tmp_path, args, hidden, fix):
    code, torch_loaded, err = _probe(*args, cwd=tmp_path,
                                     env=_hiding(tmp_path, *hidden.split(",")))
    assert (code, torch_loaded) == (2, False), err
    assert fix in one_error_line(err)


def test_each_kind_of_mistake_has_its_exit_status(tiny, tmp_path):
    """2: a bad flag, a bad value, a MODEL not found (the CLI's own check and the loader's);
    1: a failure while running (a broken checkpoint)."""
    from hybridrt.cli.common import exit_status
    from hybridrt.model_path import ModelNotFoundError

    assert invoke("chat", "--no-such-flag").exit_code == 2
    assert invoke("generate", tiny, "-p", "x", "--top-p", "0").exit_code == 2
    assert invoke("chat", tmp_path / "no-such-model").exit_code == 2
    assert exit_status(ModelNotFoundError("x")) == 2
    assert exit_status(FileNotFoundError("x")) == exit_status(ValueError("x")) == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(Path(tiny, "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{trunc")
    assert invoke("generate", broken, "-p", "x").exit_code == 1


def test_cuda_on_a_machine_without_a_gpu_driver_is_refused_before_torch_is_imported():
    from hybridrt.cli.cuda_driver import missing_gpu_driver

    if missing_gpu_driver() is None:
        pytest.skip("this machine has a GPU driver")
    for args in (["chat", "--device", "cuda"], ["serve", "--port", "0", "--device", "cuda:1"]):
        code, torch_loaded, err = _probe(*args)
        assert (code, torch_loaded) == (2, False), err
        assert "CUDA is not available: no GPU driver on this machine" in one_error_line(err)


@pytest.mark.parametrize("sign", [None, "/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg",
                                  "/dev/kfd", "nvidia-smi", "LD_LIBRARY_PATH",
                                  "/usr/lib/wsl/lib", "win32"])
def test_only_a_sure_no_gpu_driver_refuses_cuda_early(monkeypatch, tmp_path, sign):
    """No sign of a driver on Linux: refused. Any sign (NVIDIA's module or device nodes, WSL's
    GPU bridge, ROCm's node, nvidia-smi, a libcuda.so), or a platform it does not know: the
    answer is left to torch."""
    import glob
    import shutil

    from hybridrt.cli import cuda_driver

    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "libcuda.so.1").write_text("")
    monkeypatch.setattr(cuda_driver.sys, "platform", "win32" if sign == "win32" else "linux")
    monkeypatch.setattr(cuda_driver.os.path, "exists", lambda p: p == sign)
    monkeypatch.setattr(shutil, "which", lambda n: "/usr/bin/nvidia-smi"
                        if sign == "nvidia-smi" and n == "nvidia-smi" else None)
    real_glob = glob.glob
    monkeypatch.setattr(glob, "glob", lambda p: real_glob(p) if str(libdir) in p else
                        ["libcuda.so.1"] if sign and p.startswith(sign) else [])
    if sign == "LD_LIBRARY_PATH":
        monkeypatch.setenv("LD_LIBRARY_PATH", f"/nowhere{os.pathsep}{libdir}")
    else:
        monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    why = cuda_driver.missing_gpu_driver()
    assert (why is not None) == (sign is None), why


def test_bye_quits_the_chat_and_help_lists_it(tiny):
    res = invoke("chat", tiny, *MODEL_FLAGS, *GREEDY, input="/help\n/bye\nnever read\n")
    assert res.exit_code == 0, res.output
    assert "/exit, /bye" in res.stdout
    assert "[prompt" not in res.stdout and "unknown command" not in res.stderr  # not answered
