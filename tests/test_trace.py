"""``hybridrt.trace``: the recorder's five variables, the invariants read from a trace (each one
broken on purpose in a test double of the engine and in a doctored trace), and tracing off
costing nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
from hybridrt.trace import INVARIANTS, TraceRecorder, check_trace

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BUDGET = 16  # tokens a step: the long prompt is prefilled in chunks beside the others' decodes


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    pass


def make_llm(**kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", BUDGET)
    kw.setdefault("cache_memory", 64 << 20)
    kw.setdefault("trace", True)
    llm = LLM(**kw)  # traced: llm.trace is the engine's observer (llm.engine.observer.steps)
    assert llm.trace is llm.engine.observer if kw["trace"] else llm.trace is None
    return llm


@pytest.fixture(scope="module")
def prompts():
    """The demo tokenizer's ids of a short prompt, another one and a long one (> BUDGET)."""
    llm = make_llm(trace=False)
    tok = llm.tokenizer
    return [tok.encode(t, add_special_tokens=False) for t in (
        "What does json.dumps do?", "What does os.path.join do?",
        "Return a new deque object initialized left-to-right with data from iterable. "
        "If iterable is not specified, the new deque is empty.")]


def drive(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    """The scenario of docs/five-variables.md: the first prompt alone (a prefill, then decode
    steps), the long one added two steps later (its chunks beside the first one's decodes),
    the second one after that, then the first prompt again (a prefix-cache hit) -> the
    requests' output tokens, in that order."""
    eng = llm.engine
    rids = [eng.add_request(prompts[0], params)]
    for n in range(200):
        if n == 2:
            rids.append(eng.add_request(prompts[2], params))
        if n == 3:
            rids.append(eng.add_request(prompts[1], params))
        if not eng.has_unfinished_requests():
            break
        eng.step()
    rids.append(eng.add_request(prompts[0], params))
    while eng.has_unfinished_requests():
        eng.step()
    return [eng.pop_request(r).output_token_ids for r in rids]


@pytest.fixture(scope="module")
def spec_trace(prompts):
    """The scenario with 2 MTP drafts a step: (outputs, steps, llm)."""
    llm = make_llm(speculative_tokens=2)
    outs = drive(llm, prompts)
    return outs, llm.engine.observer.steps, llm


def _seqs(steps, rid=None):
    return [(r, s) for r in steps for s in r["seqs"] if rid is None or s["request"] == rid]


# The recorder ---------------------------------------------------------------------------------
def test_tracing_leaves_the_tokens_as_they_are(prompts, spec_trace):
    outs, steps, _ = spec_trace
    assert outs == drive(make_llm(speculative_tokens=2, trace=False), prompts)
    assert outs[0] == outs[3]  # the prefix-cache hit continues as the cold run did


def test_the_five_variables_of_a_prefill_a_decode_and_a_mixed_step(prompts, spec_trace):
    _, steps, llm = spec_trace
    first = steps[0]
    (seq,) = first["seqs"]
    n = len(prompts[0])
    hidden = llm.config.hidden_size
    # 1. hidden states: the prompt's ids enter, one row each, packed
    assert seq["hidden"]["token_ids"] == prompts[0] == first["input_ids"]
    assert seq["hidden"]["shape"] == [n, hidden] and seq["hidden"]["source"] == ["prompt"] * n
    # 2. positions 0..n-1
    assert seq["positions"]["positions"] == list(range(n)) and seq["positions"]["start"] == 0
    # 3. attention: its rows of the packed batch, queries 0..n-1 over keys 0..n-1 in its blocks
    att = seq["attention"]
    assert att["rows"] == [0, n] and att["queries"] == [0, n - 1] and att["keys"] == [0, n - 1]
    assert len(att["block_table"]) == 1 and att["context_len"] == n
    # 4. caches: it writes its KV block, starts from a zero GDN state, writes its first slot
    cache = seq["cache"]
    assert cache["kv_written"] == cache["kv_read"] == att["block_table"]
    assert cache["gdn"]["read"] is None and cache["gdn"]["written"] == cache["gdn"]["own_slots"][:1]
    assert cache["admitted"] and cache["prefix"]["cached_tokens"] == 0
    # 5. decoding: the last row's logits, greedy, the argmax chosen, drafts for the next step
    dec = seq["decoding"]
    assert dec["logits_rows"] == [n - 1] and dec["params"]["temperature"] == 0.0
    assert dec["emitted"] == [dec["top"][0][0][0]] and len(dec["drafts_next"]) == 2
    # a verify step of the same request: last token + 2 drafts at positions n, n+1, n+2
    _, ver = next((r, s) for r, s in _seqs(steps[1:], "0"))
    assert ver["positions"]["positions"] == [n, n + 1, n + 2]
    assert ver["hidden"]["source"] == ["output", "draft", "draft"]
    assert ver["decoding"]["drafts_verified"] == dec["drafts_next"]
    assert len(ver["cache"]["gdn"]["written"]) == 3  # one state slot per verified position
    # a step mixing a prompt chunk with another request's decode (verify) rows
    mixed = [r for r in steps if {s["hidden"]["source"][0] for s in r["seqs"]} >= {
        "prompt", "output"}]
    assert mixed and all(r["kind"] == "prefill" for r in mixed)
    chunks = [s for _, s in _seqs(steps, "1") if s["hidden"]["source"][0] == "prompt"]
    assert len(chunks) > 1  # the long prompt took several steps
    # the header: which layers are attention, which GDN
    head = llm.engine.observer.header()
    assert [i for i, t in enumerate(head["layers"]) if t == "attention"] == (
        llm.config.full_attention_layers)


def test_a_prefix_hit_names_the_checkpoint_it_resumed_from(prompts, spec_trace):
    _, steps, _ = spec_trace
    _, seq = _seqs(steps, "3")[0]
    prefix = seq["cache"]["prefix"]
    ck = prefix["checkpoint"]
    assert prefix["cached_tokens"] == ck["num_tokens"] == len(prompts[0]) - 1
    assert seq["positions"]["positions"] == [len(prompts[0]) - 1]  # one token computed
    assert seq["cache"]["gdn"]["read"] == seq["cache"]["gdn"]["own_slots"][0]
    # the first run saved that checkpoint: its slot is the one the hit copied from
    _, cold = _seqs(steps, "0")[0]
    assert [ck["num_tokens"], ck["slot"]] in cold["cache"]["gdn"]["checkpoints"]


def test_a_finished_requests_state_is_kept_as_a_checkpoint_once(spec_trace):
    """The first run of a prompt keeps its final state from one of its own slots; the same
    prompt again ends at the same tokens: the cache has that checkpoint already."""
    _, steps, _ = spec_trace
    last = {s["request"]: s for _, s in _seqs(steps) if s["decoding"]["finish_reason"]}
    first, again = last["0"]["cache"]["kept_checkpoint"], last["3"]["cache"]["kept_checkpoint"]
    assert first["own"] and first["slot"] in last["0"]["cache"]["gdn"]["own_slots"]
    assert not again["own"] and again["slot"] == first["slot"]


def test_a_partly_accepted_draft_restores_the_accepted_slot(spec_trace):
    _, steps, _ = spec_trace
    partly = [(r, s) for r, s in _seqs(steps) if s["decoding"].get("accepted") == 1
              and s["cache"]["gdn"]["restored"] is not None]
    assert partly, "the scenario has no verification with exactly one of two drafts accepted"
    for rec, seq in partly:
        gdn = seq["cache"]["gdn"]
        assert gdn["restored"] == gdn["written"][1] == gdn["own_slots"][1]
        after = next(s for r, s in _seqs(steps, seq["request"]) if r["step"] > rec["step"])
        assert after["cache"]["gdn"]["read"] == gdn["restored"]


def test_a_clean_run_keeps_every_invariant(spec_trace, prompts):
    _, steps, _ = spec_trace
    assert check_trace(steps) == []
    llm = make_llm()  # no speculation: decode steps instead of verifications
    drive(llm, prompts)
    assert check_trace(llm.engine.observer.steps) == []


# Each invariant broken on purpose: a doctored trace ---------------------------------------------
def _doctor(steps: list[dict], invariant: str) -> list[dict]:
    steps = copy.deepcopy(steps)
    pairs = _seqs(steps)
    if invariant == "positions":
        _, seq = next((r, s) for r, s in pairs if s["positions"]["start"] > 0)
        seq["positions"]["positions"][0] += 1
    elif invariant == "isolation":
        _, a = pairs[0]
        _, b = next((r, s) for r, s in pairs if s["request"] != a["request"])
        b["cache"]["kv_read"].append(a["cache"]["kv_written"][0])
    elif invariant == "prefix_hit":
        _, seq = next((r, s) for r, s in pairs if (s["cache"]["prefix"] or {}).get("checkpoint"))
        seq["cache"]["prefix"]["checkpoint"]["num_tokens"] -= 1
    else:
        _, seq = next((r, s) for r, s in pairs if s["decoding"].get("accepted")
                      and s["cache"]["gdn"]["restored"] is not None)
        seq["cache"]["gdn"]["restored"] = seq["cache"]["gdn"]["written"][0]
    return steps


@pytest.mark.parametrize("invariant", INVARIANTS)
def test_a_doctored_trace_breaks_the_invariant_it_changes(spec_trace, invariant):
    _, steps, _ = spec_trace
    found = check_trace(_doctor(steps, invariant))
    assert found and {v.invariant for v in found} == {invariant}, found


# Each invariant broken on purpose: a test double of the engine ---------------------------------
def test_positions_shifted_by_the_runner_are_reported(prompts, monkeypatch):
    import hybridrt.runner as runner

    real = runner.build_batch

    def shifted(*args, **kw):
        batch = real(*args, **kw)
        if batch.num_tokens > 1:
            batch.positions[-1] += 1  # the step's last token one position too far
        return batch

    monkeypatch.setattr(runner, "build_batch", shifted)
    llm = make_llm()
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    found = check_trace(llm.engine.observer.steps)
    assert found and {v.invariant for v in found} == {"positions"}
    assert "row 0 has positions" in str(found[0])


def test_a_request_given_another_ones_blocks_is_reported(prompts):
    llm = make_llm()
    cache = llm.engine.cache
    real = cache.block_table
    cache.block_table = lambda owner: (owner == "1" and real("0")) or real(owner)
    llm.generate([prompts[0], prompts[1]], GREEDY, use_tqdm=False)
    found = check_trace(llm.engine.observer.steps)
    assert "isolation" in {v.invariant for v in found}
    assert any("that request 0 writes in the same step" in str(v) for v in found)


def test_a_hit_computed_from_position_0_is_reported(prompts, monkeypatch):
    from hybridrt.scheduler import Scheduler

    real = Scheduler._admit

    def from_zero(self, req, budget):  # the state restored, the positions not
        n = real(self, req, budget)
        if n is not None and req.num_computed_tokens:
            n, req.num_computed_tokens = min(len(req.token_ids), budget), 0
        return n

    monkeypatch.setattr(Scheduler, "_admit", from_zero)
    llm = make_llm()
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert check_trace(llm.engine.observer.steps) == []
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    found = check_trace(llm.engine.observer.steps)
    assert found and found[0].invariant == "prefix_hit"
    assert "first computed position 0 != num_cached_tokens" in found[0].message


def test_a_rollback_to_the_wrong_slot_is_reported(prompts, monkeypatch):
    from hybridrt.specdec.verify import Settled

    monkeypatch.setattr(Settled, "slot_cursor", property(lambda self: 0))
    llm = make_llm(speculative_tokens=2)
    drive(llm, prompts)
    assert any(s["decoding"].get("accepted") for _, s in _seqs(llm.engine.observer.steps))
    found = check_trace(llm.engine.observer.steps)
    assert found and {v.invariant for v in found} == {"draft_rollback"}


# Tracing off ----------------------------------------------------------------------------------
def test_tracing_off_calls_no_recorder(prompts, monkeypatch):
    """Off (the default), the engine has no observer: the runner and the engine check one
    attribute and call nothing (a recorder would fail here)."""
    def boom(*a, **kw):
        raise AssertionError("a recorder was called with tracing off")

    for name in ("executed", "applied", "phase", "__init__"):
        monkeypatch.setattr(TraceRecorder, name, boom)
    llm = make_llm(trace=False)
    assert llm.engine.observer is None
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)


def test_an_observer_without_the_hooks_is_not_called_for_them(prompts):
    """A phase timer (``hybridrt.bench.cuda``) has ``phase`` only: the hooks are skipped."""
    import contextlib

    class Phases:
        names: list = []

        def phase(self, name):
            self.names.append(name)
            return contextlib.nullcontext()

    llm = make_llm(trace=False)
    llm.engine.observer = obs = Phases()
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert obs.names[:6] == ["schedule", "prepare", "forward", "logits", "sample", "update"]


def test_one_observer_at_a_time_and_a_detached_recorder_records_no_more(prompts):
    llm = make_llm()
    rec = llm.engine.observer
    with pytest.raises(ValueError, match="already has an observer"):
        TraceRecorder.attach(llm.engine)
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    n = len(rec.steps)
    rec.detach()
    assert llm.engine.observer is None
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert len(rec.steps) == n
    assert TraceRecorder.attach(llm.engine) is llm.engine.observer


def test_the_recorder_reads_a_step_before_the_next_one_reuses_its_buffers(prompts):
    """The runner's index buffers are reused each step (kernels/meta.py): a record holds
    lists, not views of them."""
    llm = make_llm()
    llm.generate([prompts[0], prompts[1]], GREEDY, use_tqdm=False)
    for rec in llm.engine.observer.steps:
        assert isinstance(rec["input_ids"], list) and not any(
            isinstance(v, torch.Tensor) for v in rec.values())
        assert sum(len(s["hidden"]["token_ids"]) for s in rec["seqs"]) == rec["num_tokens"]


# hybridrt trace ----------------------------------------------------------------------------------
CLI_FLAGS = ("--cache-memory", "64MiB", "--max-model-len", "256", "--max-num-batched-tokens",
             str(BUDGET), "--temperature", "0", "--max-tokens", "3")
QUESTIONS = ("What does json.dumps do?", "Return a new deque object initialized left-to-right "
             "with data from iterable.")


def invoke(*args):
    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_jsonl_is_the_recorders_trace_and_keeps_the_invariants(tmp_path):
    import json

    res = invoke("trace", "-p", QUESTIONS[0], "-p", QUESTIONS[1], "--chat", *CLI_FLAGS,
                 "--jsonl", "-")
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    head, steps = lines[0], lines[1:]
    assert head["trace"] == "hybridrt" and head["layers"].count("attention") == 2
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert {s["request"] for r in steps for s in r["seqs"]} == {"0", "1"}
    assert any(s["decoding"]["emitted"] for r in steps for s in r["seqs"])
    assert check_trace(steps) == []
    assert "invariants: positions, isolation, prefix_hit, draft_rollback hold" in res.stderr


def test_cli_table_filters_steps_and_requests_and_writes_the_html(tmp_path):
    page = tmp_path / "trace.html"
    res = invoke("trace", "-p", QUESTIONS[0], "-p", QUESTIONS[1], *CLI_FLAGS,
                 "--steps", "1-2", "--request", "0", "--html", page)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "layers: attention 3,7" in out
    shown = [ln.split(" · ")[0] for ln in out.splitlines() if ln.startswith("step ")]
    assert shown == ["step 1", "step 2"]
    assert "request 0" in out and "request 1" not in out
    for var in ("1 hidden", "2 positions", "3 attention", "4 caches", "5 decoding"):
        assert var in out
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<script src" not in text
    assert "request 0</th>" in text and 'data-k="0/0"' in text and "4 caches" in text
    import json
    import re

    data = json.loads(re.search(r"id='data'>(.*?)</script>", text, re.S).group(1))
    cells = set(re.findall(r'data-k="([^"]+)"', text))
    assert cells == set(data) and all("5 decoding" in v for v in data.values())


@pytest.mark.parametrize("flag, message", [
    (("--request", "9"), "--request: no request 9 in the run (its requests: 0)"),
    (("--steps", "99-"), "--steps: the run had 3 steps (0-2), none of them in the range"),
])
def test_cli_filters_that_match_nothing_in_the_run_are_refused(flag, message):
    res = invoke("trace", "-p", QUESTIONS[0], *CLI_FLAGS, *flag)
    assert res.exit_code == 2 and message in res.stderr, res.output


@pytest.mark.parametrize("flag, message", [
    (("--steps", "3-1"), "--steps: '3-1' is not a range of steps"),
    (("--steps", "x"), "--steps: 'x' is not a step"),
    (("--jsonl", "/nonexistent/dir/t.jsonl"), "--jsonl /nonexistent/dir/t.jsonl"),
])
def test_cli_bad_options_are_one_error_line_before_the_model_loads(flag, message):
    res = invoke("trace", "-p", "hi", *flag)
    assert res.exit_code == 2 and message in res.stderr, res.output


def test_the_decode_ab_script_runs_tracing_off_and_on():
    """python -m hybridrt.bench.decode_ab (decode speed alternated between trees, tracing off
    and on) stays runnable: one short round here."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "hybridrt.bench.decode_ab", ".", "--trace-on",
                          "--rounds", "1", "--steps", "2", "--batch", "1"], cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and "x1.000" in lines[0] and "(trace on)" in lines[1]


def test_the_traces_in_docs_five_variables_are_what_their_commands_print():
    """docs/five-variables.md shows three traces of the demo model, each under the command
    that prints it: run again, each prints the same (the logits' values compared to their
    first decimal: a CPU with other kernel paths rounds bf16 products otherwise)."""
    import re
    import shlex
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "five-variables.md").read_text()
    blocks = re.findall(r"```text\n\$ hybridrt (trace .*?)\n(.*?)```", doc, re.S)
    assert len(blocks) == 3
    for command, shown in blocks:
        res = invoke(*shlex.split(command))
        assert res.exit_code == 0, res.output

        def coarse(text: str) -> str:
            return re.sub(r"\((-?\d+\.\d)\d\)", r"(\1)", text)

        assert coarse(res.stdout) == coarse(shown), (
            f"docs/five-variables.md is stale for: hybridrt {command}")


def test_chained_decode_steps_are_traced_in_order(prompts):
    """With async scheduling a decode step is launched before the previous one is applied:
    each record is still completed by its own step's update."""
    llm = make_llm(async_scheduling=True)
    outs = drive(llm, prompts)
    assert outs == drive(make_llm(async_scheduling=True, trace=False), prompts)
    steps = llm.engine.observer.steps
    assert any(r["chained"] for r in steps)
    assert [r["step"] for r in steps] == list(range(len(steps)))
    chained = next(s for r in steps if r["chained"] for s in r["seqs"])
    assert chained["hidden"]["source"] == ["chained"]
    assert check_trace(steps) == []


def test_a_miss_says_how_many_leading_blocks_were_cached_without_a_checkpoint(prompts):
    """Why a prompt did not hit: its first two blocks are cached (another prompt computed
    them), but that prompt's GDN checkpoints lie past where the two diverge."""
    from hybridrt.trace.render_text import seq_lines

    llm = make_llm(max_num_batched_tokens=64)
    base = (prompts[2] * 2)[:40]
    llm.generate([base], GREEDY, use_tqdm=False)
    llm.generate([base[:35] + [7, 8, 9]], GREEDY, use_tqdm=False)
    rec = llm.engine.observer.steps[-GREEDY.max_tokens]
    (seq,) = rec["seqs"]
    assert seq["cache"]["prefix"]["cached_tokens"] == 0
    assert seq["cache"]["prefix"]["cached_blocks"] == 2
    assert ("prefix cache miss (2 leading block(s) cached, but no GDN checkpoint to resume "
            "from)") in seq_lines(seq, rec)[0]


def test_positions_are_checked_row_by_row_where_there_are_three(spec_trace):
    """M-RoPE's three rows (t, h, w): a record may carry a list of rows; each is checked."""
    _, steps, _ = spec_trace
    steps = copy.deepcopy(steps)
    for _, seq in _seqs(steps):
        p = seq["positions"]["positions"]
        seq["positions"]["positions"] = [list(p), list(p), list(p)]
    assert check_trace(steps) == []
    _, seq = _seqs(steps)[1]
    seq["positions"]["positions"][2][0] -= 1
    (v,) = check_trace(steps)
    assert v.invariant == "positions" and "row 2 has positions" in v.message


def test_a_preempted_request_is_readmitted_from_its_checkpoint_and_keeps_the_invariants():
    """A cache too small for four growing requests: one is preempted (its state kept as a
    checkpoint) and admitted again later from it; the positions go on from its hit."""
    llm = make_llm(cache_memory="3MiB", max_num_batched_tokens=64)
    tok = llm.tokenizer
    ps = [tok.encode(f"Return a new deque object number {i} initialized left-to-right with "
                     f"data from iterable.") for i in range(4)]
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
                 use_tqdm=False)
    steps = llm.engine.observer.steps
    assert llm.engine.stats["num_preemptions"] >= 1
    gone = next(r for r in steps if r["preempted"])["preempted"][0]
    again = [s for _, s in _seqs(steps, gone) if s["cache"]["admitted"]][1]
    assert again["positions"]["start"] == again["cache"]["prefix"]["cached_tokens"] > 0
    assert check_trace(steps) == []


def test_an_image_requests_trace_shows_its_m_rope_rows_and_image_tokens(tmp_path):
    """With an image (a tiny checkpoint with a vision tower): the sequence positions stay
    C..C+T-1; the M-RoPE rows of the image tokens are the image's grid (h and w rows differ),
    a text token's three rows are equal, and decode tokens sit at their index + rope delta;
    a doctored decode row (the delta dropped) is reported."""
    from vision_helpers import image, write_vision_checkpoint

    from hybridrt.trace.render_text import seq_lines

    path, _ = write_vision_checkpoint(tmp_path / "vision", seed=3)
    llm = LLM(str(path), dtype="float32", max_model_len=256, cache_memory="32MiB", trace=True)
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?"
            "<|im_end|>\n<|im_start|>assistant\n")
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": [image(40, 24, 1)]}}],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.error is None
    steps = llm.trace.steps
    assert check_trace(steps) == []
    prefill = steps[0]["seqs"][0]
    m = prefill["positions"]["mrope"]
    images = m["image_tokens"]
    assert images and prefill["hidden"]["source"].count("image") == len(images)
    t, h, w = m["rows"]
    assert [h[i] for i in images] != [w[i] for i in images]
    delta = prefill["positions"]["rope_delta"]
    assert delta < 0  # the image's tokens take fewer positions than tokens
    decode = steps[-1]["seqs"][0]
    c = decode["positions"]["start"]
    assert decode["positions"]["mrope"]["rows"] == [[c + delta]] * 3
    assert "M-RoPE t [" in "\n".join(seq_lines(prefill, steps[0]))
    doctored = copy.deepcopy(steps)
    doctored[-1]["seqs"][0]["positions"]["mrope"]["rows"] = [[c]] * 3
    (v,) = check_trace(doctored)
    assert v.invariant == "positions" and "rope delta" in v.message
