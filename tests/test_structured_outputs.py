"""Structured outputs in the engine (hybridrt/structured_outputs.py): every constrained output
valid (greedy and sampled), the mask on the right row of a mixed batch, a bad constraint
failing its own request only, preemption, abort and speculation with a constraint (greedy
token-equal to k=0; sampled: the exact distribution of k=0 with the same constraint), the
grammar cache, and the mask op against xgrammar's own kernel. The core cases run under both
grammar engines (``engine``), the rest under the default one (llguidance)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from helpers import chi2_pvalue

jsonschema = pytest.importorskip("jsonschema")

from hybridrt.bench.fixtures import (  # noqa: E402
    tiny_text_config,
    write_char_tokenizer,
    write_random_checkpoint,
)
from hybridrt.llm import LLM  # noqa: E402
from hybridrt.sampler import Sampler, SamplingRow, apply_token_bitmask  # noqa: E402
from hybridrt.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from hybridrt.statecache import CacheTensors  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "active"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)"
CHOICES = ["red", "green", "blue", "dark blue"]
GRAMMAR = 'root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= [0-9] [0-9]?'
GRAMMAR_RE = r"\[[0-9]{1,2}(,[0-9]{1,2}){0,2}\]"
MAX_TOKENS = 256


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(GRAMMAR_RE, text) is not None


CONSTRAINTS = {"json": so(json=PERSON), "regex": so(regex=REGEX), "choice": so(choice=CHOICES),
               "grammar": so(grammar=GRAMMAR)}


@pytest.fixture(scope="module")
def demo():
    # the embedded demo model (a real tokenizer, MTP weights), fp32 so that batches and
    # speculation give the same greedy tokens as runs alone
    return LLM(dtype="float32", max_model_len=512, max_num_seqs=16, speculative_tokens=2,
               cache_memory=64 << 20)


ENGINES = ["llguidance", "xgrammar"]


@pytest.fixture(scope="module")
def demos():
    return {}


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """Each grammar engine in turn (HYBRIDRT_GRAMMAR_ENGINE set for the test)."""
    pytest.importorskip(request.param)
    monkeypatch.setenv("HYBRIDRT_GRAMMAR_ENGINE", request.param)
    return request.param


@pytest.fixture
def demo_on(engine, demos):
    """The demo model (as ``demo``) whose constraints compile with ``engine``."""
    if engine not in demos:
        llm = LLM(dtype="float32", max_model_len=512, max_num_seqs=16, speculative_tokens=2,
                  cache_memory=64 << 20)
        llm.engine.structured_outputs.engine_name = engine
        demos[engine] = llm
    return demos[engine]


@pytest.fixture(scope="module")
def prompt(demo):
    return demo.apply_chat_template([{"role": "user", "content": "Describe one user."}])


def run(llm, prompts, params, k=0):
    return llm.generate(prompts, params, use_tqdm=False, speculative_tokens=k)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_outputs_always_valid_greedy_and_sampled(demo_on, prompt, kind):
    demo = demo_on
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                             structured_outputs=CONSTRAINTS[kind])]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS,
                              structured_outputs=CONSTRAINTS[kind]) for s in range(12)]
    outs = run(demo, [prompt] * len(params), params)
    for o in outs:
        c = o.outputs[0]
        assert o.error is None and c.finish_reason == "stop", (c.finish_reason, c.text)
        assert valid(kind, c.text), c.text
    assert len({o.outputs[0].text for o in outs}) > 1  # sampled: not one answer
    assert demo.engine.cache.all_free()


def test_mask_lands_on_its_own_row_in_a_mixed_batch(demo, prompt):
    """Four constraints and two free requests in one batch: each output equals the
    request run alone (greedy), so no row got another's mask."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=c)
              for c in CONSTRAINTS.values()]
    params = [free, *params, free]
    prompts = [prompt, prompt, "def f(x):", prompt, "The answer is", "import os"]
    together = [o.outputs[0].text for o in run(demo, prompts, params)]
    alone = [run(demo, [p], [sp])[0].outputs[0].text for p, sp in zip(prompts, params)]
    assert together == alone
    for kind, text in zip(CONSTRAINTS, together[1:5]):
        assert valid(kind, text), (kind, text)


@pytest.mark.parametrize("bad, words", [
    (so(json={"type": "foo"}), "structured_outputs.json: the constraint cannot be compiled"),
    (so(json='{"type": "object", "properties": '), "cannot be compiled"),
    (so(regex="(?<=a)b"), "structured_outputs.regex: the constraint cannot be compiled"),
    (so(grammar='root ::= "a" | b'), "structured_outputs.grammar: the constraint"),
    (so(json={"properties": {"a": {"$ref": "#/nope"}}}), "cannot be compiled"),
])
def test_bad_constraint_fails_its_request_only(demo_on, prompt, bad, words):
    demo = demo_on
    good = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                          structured_outputs=CONSTRAINTS["json"])
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [run(demo, [prompt], [good])[0], run(demo, ["def f(x):"], [free])[0]]
    outs = run(demo, [prompt, prompt, "def f(x):"],
               [good, SamplingParams(temperature=0, structured_outputs=bad), free])
    assert outs[1].outputs[0].finish_reason == "error" and words in str(outs[1].error)
    assert isinstance(outs[1].error, ValueError)
    assert [outs[0].outputs[0].text, outs[2].outputs[0].text] == \
        [a.outputs[0].text for a in alone]
    assert demo.engine.cache.all_free() and not demo.engine.has_unfinished_requests()


def test_params_are_checked_at_construction():
    with pytest.raises(ValueError, match="exactly one of"):
        so(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        so()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        so(choice=[])
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"


def test_compile_time_is_bounded(demo, prompt, monkeypatch):
    """A constraint that compiles for longer than the limit fails its request; the engine
    goes on (the compile finishes in its worker thread). The engine's compile is slowed
    down: llguidance compiles even a large enum in milliseconds."""
    slow = so(json={"enum": [f"value number {i}" for i in range(6000)]})
    so_ = demo.engine.structured_outputs
    grammar_engine = so_._get_engine()
    compile_ = grammar_engine.compile
    monkeypatch.setattr(grammar_engine, "compile", lambda p: time.sleep(0.3) or compile_(p))
    before = so_.compile_timeout
    so_.compile_timeout = 0.05
    try:
        outs = run(demo, [prompt, "def f(x):"],
                   [SamplingParams(temperature=0, structured_outputs=slow),
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    finally:
        so_.compile_timeout = before
    assert outs[0].outputs[0].finish_reason == "error"
    assert "did not compile within 0.05 s" in str(outs[0].error)
    assert len(outs[1].outputs[0].token_ids) == 8


def test_compiled_grammars_are_cached(demo, prompt):
    stats = demo.engine.structured_outputs.stats
    schema = {"type": "object", "properties": {"k": {"enum": ["cache", "me"]}}, "required": ["k"]}
    p = SamplingParams(temperature=0, max_tokens=64, structured_outputs=so(json=schema))
    run(demo, [prompt], [p])
    demo.engine.structured_outputs._pool.submit(lambda: None).result()  # earlier tests' done
    compiled, hits = stats["compiled"], stats["cache_hits"]
    outs = run(demo, [prompt] * 3, [p] * 3)
    assert stats["compiled"] == compiled and stats["cache_hits"] == hits + 3
    assert all(json.loads(o.outputs[0].text)["k"] in ("cache", "me") for o in outs)


def test_abort_while_compiling_and_while_running(demo, prompt):
    eng = demo.engine
    rid = eng.add_request(demo.tokenizer.encode(prompt), SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=so(json={"type": "array"})))
    eng.abort_request(rid)
    assert eng.get_request(rid).finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    eng.pop_request(rid)
    rid = eng.add_request(demo.tokenizer.encode(prompt), SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["json"]))
    while not eng.get_request(rid).output_token_ids:
        eng.step()
    eng.abort_request(rid)
    assert eng.pop_request(rid).finish_reason == "abort"
    assert eng.cache.all_free() and not eng.has_unfinished_requests()


def _budget(llm, num_blocks, num_slots):
    cfg, dtype = llm.config, llm.dtype
    extra = llm.model.num_attention_caches - len(cfg.full_attention_layers)
    return (num_blocks * CacheTensors.bytes_per_block(cfg, 16, dtype, extra)
            + num_slots * CacheTensors.bytes_per_slot(cfg, dtype))


def test_preemption_mid_constraint_resumes_the_matcher(prompt):
    """Seeded sampled JSON requests preempted while generating are recomputed and go on from
    where their matcher stood: outputs equal those of a cache that holds them all, valid."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS,
                             structured_outputs=CONSTRAINTS["json"]) for s in range(4)]
    roomy = LLM(dtype="float32", max_model_len=512, max_num_seqs=4, cache_memory=64 << 20)
    done = run(roomy, [prompt] * 4, params)
    ref = [o.outputs[0].text for o in done]
    lens = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in done]
    blocks = -(-max(lens) // 16) + 1  # the longest fits alone, the four together do not
    llm = LLM(dtype="float32", max_model_len=blocks * 16, max_num_seqs=4,
              max_num_batched_tokens=32, cache_memory=_budget(roomy, blocks, 6))
    assert llm.cache_sizing.num_blocks == blocks
    llm.engine.scheduler.admission_control = False  # admission control would avoid them all
    outs = run(llm, [prompt] * 4, params)
    assert llm.engine.stats["num_preemptions"] > 0
    assert [o.outputs[0].text for o in outs] == ref
    assert all(valid("json", t) for t in ref)
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize("kind", ["json", "grammar"])
def test_speculation_with_a_constraint_is_greedy_lossless(demo_on, prompt, kind):
    demo = demo_on
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                             structured_outputs=CONSTRAINTS[kind])]
    k0 = run(demo, [prompt], params, k=0)[0].outputs[0]
    k2 = run(demo, [prompt], params, k=2)[0]
    assert k2.outputs[0].token_ids == k0.token_ids and valid(kind, k0.text)
    assert k2.metrics["spec"]["num_draft_tokens"] > 0


# Speculation, sampled: the exact distribution --------------------------------------------------
SMALL_VOCAB = 16  # 3 specials, then "\n", " ", "!", '"', "#", "$", "%", "&", "'", "(", ")", ...
ODD, EVEN = "!#%", "()*+"  # the constraint alternates between these two sets
ALTERNATING = so(regex=f"([{ODD}][{EVEN}]){{2,}}")  # at least 4 tokens: no stop before 5
PROMPT = [3, 7, 12, 5, 9, 4]


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tiny_v16_so"),
                                tiny_text_config(vocab_size=SMALL_VOCAB), seed=11)
    write_char_tokenizer(d, SMALL_VOCAB)
    return d


def _small_llm(ckpt, k):
    return LLM(ckpt, dtype="float32", speculative_tokens=k, max_model_len=16,
               max_num_seqs=256, max_num_batched_tokens=2048, cache_memory=16 << 20, seed=1234)


def _allowed(llm, chars: str) -> torch.Tensor:
    ids = [llm.tokenizer.convert_tokens_to_ids(c) for c in chars]
    mask = torch.zeros(SMALL_VOCAB, dtype=torch.bool)
    mask[ids] = True
    return mask


def _exact_constrained(ckpt, params) -> list[torch.Tensor]:
    """Exact distributions of tokens 1, 2, 3 under ``params`` and the alternating
    constraint, without speculation: every context scored once, the logits outside the
    allowed set of its position set to -inf, then the sampler's own processing."""
    llm = _small_llm(ckpt, 0)
    V = SMALL_VOCAB
    ctx = [PROMPT] + [PROMPT + [a] for a in range(V)] + [PROMPT + [a, b] for a in range(V)
                                                         for b in range(V)]
    score = SamplingParams(temperature=0, max_tokens=1, logprobs=V, ignore_eos=True)
    outs = llm.generate(ctx, score, use_tqdm=False)
    logits = torch.tensor([[o.outputs[0].logprobs[0][t] for t in range(V)] for o in outs])
    odd, even = _allowed(llm, ODD), _allowed(llm, EVEN)
    logits[0, ~odd] = float("-inf")
    logits[1:1 + V, :][:, ~even] = float("-inf")
    logits[1 + V:, :][:, ~odd] = float("-inf")
    sampler, rows = Sampler(), [SamplingRow(params) for _ in ctx]
    probs = torch.nan_to_num(sampler.probs(sampler.processed_logits(logits, rows), rows))
    p1, p2, p3 = probs[0].double(), probs[1:1 + V].double(), probs[1 + V:].double().view(V, V, V)
    return [p1, p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)]


def _empirical(ckpt, params, k, n) -> tuple[list[torch.Tensor], LLM]:
    llm = _small_llm(ckpt, k)
    outs = llm.generate([PROMPT] * n, params, use_tqdm=False)
    for o in outs:
        assert o.error is None, o.error
    toks = torch.tensor([o.outputs[0].token_ids[:3] for o in outs])
    return [torch.bincount(toks[:, i], minlength=SMALL_VOCAB).double() for i in range(3)], llm


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculation_with_a_constraint_keeps_the_constrained_distribution(small_ckpt, engine,
                                                                          temperature):
    """k = 2 MTP drafts under the alternating constraint: the marginals of tokens 1..3 match
    the exact constrained distribution of k = 0 (chi-square, p > 1e-3, fixed seed); drafts
    are accepted and rejected (the MTP drafts under the mask as well)."""
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True,
                            structured_outputs=ALTERNATING)
    exact = _exact_constrained(small_ckpt, params)
    counts, llm = _empirical(small_ckpt, params, 2, 1024)
    spec = llm.engine.spec_stats
    assert 0 < spec.num_accepted < spec.num_draft_tokens
    for i, (c, p) in enumerate(zip(counts, exact)):
        assert float(c[p == 0].sum()) == 0, f"token {i + 1}: outside the constraint"
        stat, df, pval = chi2_pvalue(c, p)
        assert pval > 1e-3, f"token {i + 1}: chi2 {stat:.1f} (df {df}), p = {pval:.2g}"


# The mask op ---------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [101, 6144, 248320])
def test_apply_token_bitmask_equals_xgrammars_kernel(vocab):
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(vocab)
    n, words = 5, (vocab + 31) // 32
    logits = torch.randn(n + 2, vocab, generator=g)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, words), dtype=torch.int32, generator=g)
    full = torch.full((n + 2, words), -1, dtype=torch.int32)
    full[1:n + 1] = bitmask
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=vocab)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, torch.arange(1, n + 1))
    assert torch.equal(ours, ref)
    if torch.cuda.is_available():
        dev = logits.cuda()
        apply_token_bitmask(dev, bitmask.cuda(), torch.arange(1, n + 1, device="cuda"))
        assert torch.equal(dev.cpu(), ref)


def test_a_request_waits_for_its_grammar_as_a_scheduler_status(demo, prompt, monkeypatch):
    """Until its grammar is compiled a request waits in the scheduler (WAITING_FOR_GRAMMAR):
    steps run the others without it; once compiled it is admitted with its matcher and its
    output is valid; a compile that fails finishes it with the error."""
    from concurrent.futures import Future

    from hybridrt.request import RequestStatus

    eng = demo.engine
    compiler = eng.structured_outputs
    compiled = compiler.compile(CONSTRAINTS["regex"])
    held: list[Future] = []

    def submit(params):  # the compile's Future, completed by the test
        held.append(Future())
        return held[-1]

    monkeypatch.setattr(compiler, "submit", submit)
    ids = demo.tokenizer.encode(prompt)
    plain = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                              structured_outputs=CONSTRAINTS["regex"]))
    bad = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=8,
                                              structured_outputs=so(regex="[a-")))
    req = eng.get_request(rid)
    for _ in range(3):
        assert eng.step()  # the plain request runs
        assert req.status is RequestStatus.WAITING_FOR_GRAMMAR and not req.output_token_ids
        assert req not in eng.scheduler.waiting and req.grammar is None
    assert eng.has_unfinished_requests()
    held[0].set_result(compiled)
    held[1].set_exception(ValueError("structured_outputs.regex: cannot be compiled"))
    done = eng.step()
    assert eng.get_request(bad) in done and eng.get_request(bad).finish_reason == "error"
    assert req.status is RequestStatus.RUNNING and req.grammar is not None
    while eng.has_unfinished_requests():
        eng.step()
    assert valid("regex", eng.pop_request(rid).text)
    assert "cannot be compiled" in str(eng.pop_request(bad).error)
    assert eng.pop_request(plain).finish_reason == "length"


TAG_TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"]}}}]


def test_structural_tag_runs_on_xgrammar_and_llguidance_names_the_extra(demo_on, prompt):
    """xgrammar's structural tag (here its Qwen3.5 call tag) constrains on xgrammar; on
    llguidance the request fails alone, naming the extra and the variable."""
    from hybridrt.tool_calls import parse_tool_calls, tool_constraint

    tag = tool_constraint(TAG_TOOLS, "required", thinking=False, parallel=False,
                          engine="xgrammar") if demo_on.engine.structured_outputs.engine_name \
        == "xgrammar" else {"type": "structural_tag", "format": {"type": "const_string",
                                                                  "value": "x"}}
    so_ = tag if isinstance(tag, StructuredOutputsParams) else so(structural_tag=tag)
    out = run(demo_on, [prompt], [SamplingParams(temperature=1.0, seed=3, max_tokens=128,
                                                 structured_outputs=so_)])[0]
    if demo_on.engine.structured_outputs.engine_name == "xgrammar":
        calls = parse_tool_calls(out.outputs[0].text, TAG_TOOLS)[1]
        assert out.error is None and [c.name for c in calls] == ["pick"]
        assert calls[0].complete, out.outputs[0].text  # not cut by max_tokens
        assert 0 <= json.loads(calls[0].arguments)["n"] <= 9
    else:
        assert out.outputs[0].finish_reason == "error"
        assert "pip install 'hybridrt[xgrammar]'" in str(out.error)
        assert "HYBRIDRT_GRAMMAR_ENGINE=xgrammar" in str(out.error)
