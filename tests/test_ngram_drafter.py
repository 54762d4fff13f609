"""Prompt-lookup (n-gram) speculation (specdec/ngram.py, specdec/proposer.py): the match rule,
lossless greedy and sampling on the MTP's verify and rollback path, a request drafting nothing
beside one drafting k (vLLM #39273), batch-invariant bytes, MTP + n-gram, and the counters.

The tiny checkpoints here have no MTP layer (prompt lookup needs none). Where a test needs
drafts that are accepted, the drafter is replaced by an oracle giving the true greedy
continuation (optionally corrupted at one position)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import chi2_pvalue, gdn_state_after, record_rounds
from helpers import output_bytes as _key

from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.kernels import native
from hybridrt.llm import LLM
from hybridrt.sampler import Sampler, SamplingRow
from hybridrt.sampling_params import SamplingParams
from hybridrt.server.metrics import _METRICS
from hybridrt.specdec.ngram import NgramDrafter, NgramIndex
from hybridrt.specdec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

CFG = tiny_text_config()
VOCAB = CFG["vocab_size"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# The match rule ------------------------------------------------------------------------------
def _brute(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The module's rule, from its definition: the longest n whose suffix occurred earlier,
    its latest occurrence, its continuation (past the end: the drafts themselves)."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        ends = [e for e in range(n, L) if tokens[e - n:e] == tokens[L - n:]]
        if ends:
            seq = list(tokens)
            for j in range(k):
                seq.append(seq[ends[-1] + j])
            return seq[L:]
    return []


def test_match_continues_the_latest_longest_occurrence():
    idx = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # "6 7" ... the longest suffix seen before is "5 6 7" (ends at 3): continues 8 1 6 7 9
    assert idx.lookup(toks, 4) == [8, 1, 6, 7]
    toks2 = [1, 2, 3, 9, 2, 3, 4, 2, 3]
    # suffix "2 3": occurred at ends 3 and 6; the latest (6) continues 4 2 3 ...
    assert NgramIndex(2, 2).lookup(toks2, 3) == [4, 2, 3]
    assert NgramIndex(1, 3).lookup([4, 4], 3) == [4, 4, 4]  # a run continues with its period
    assert NgramIndex(1, 3).lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert NgramIndex(1, 3).lookup([1, 2, 3, 1, 2], 5, extend=False) == [3, 1, 2]
    assert NgramIndex(2, 3).lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence: no drafts
    assert NgramIndex(1, 3).lookup([7], 3) == []
    assert NgramIndex(1, 3).lookup([1, 2, 1], 0) == []


def test_incremental_index_equals_the_rule_from_scratch():
    """Grown token by token (as a request's tokens grow) and looked up at every length, the
    index gives the rule's drafts from scratch, for several n ranges."""
    rng = random.Random(0)
    for min_n, max_n in ((1, 1), (1, 4), (2, 3), (3, 5)):
        for _ in range(20):
            toks = [rng.randrange(4) for _ in range(rng.randint(1, 60))]
            idx = NgramIndex(min_n, max_n)
            for L in range(1, len(toks) + 1):
                k = rng.randint(0, 6)
                assert idx.lookup(toks[:L], k) == _brute(toks[:L], k, min_n, max_n), (
                    toks[:L], k, min_n, max_n)


def test_drafter_keeps_one_index_per_running_request():
    class Req:
        def __init__(self, rid, tokens):
            self.request_id, self.token_ids, self.is_finished = rid, tokens, False

    d = NgramDrafter(1, 2)
    a, b = Req("a", [1, 2, 3, 1, 2]), Req("b", [9, 8, 9])
    assert d.drafts(a, 2) == [3, 1] and d.drafts(b, 2) == [8, 9]
    a.token_ids += [3]
    assert d.drafts(a, 2) == [1, 2]  # the index grew with the tokens: "2 3" ended at 3
    a.token_ids += [4]
    assert d.drafts(a, 2) == []  # "3 4" and "4" unseen
    a.is_finished = True
    d.prune()
    assert set(d._indexes) == {"b"}
    b2 = Req("b", [5, 5])  # a new request reusing an id gets a new index
    assert d.drafts(b2, 2) == [5, 5]
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramDrafter(3, 2)


# The engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ngram"), CFG, seed=3, with_mtp=False)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 9, 20)]
    # repeated spans (matches in the prompt) and plain random ones (maybe none)
    return ([b * 3 + b[:2] for b in base]
            + [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 33, 70)])


def _llm(ckpt, k=0, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("cache_memory", 32 << 20)
    if k:
        kw.setdefault("speculative_method", "ngram")
    return LLM(ckpt, dtype="float32", speculative_tokens=k, **kw)


@pytest.fixture(scope="module")
def reference(ckpt):
    outs = _llm(ckpt).generate(_prompts(), GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(_prompts(), outs)}


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k, lookup", [(1, (1, 1)), (3, (2, 4)), (5, (1, 3))])
def test_greedy_with_ngram_drafts_equals_no_speculation(ckpt, reference, k, lookup):
    """Every prompt batched, chunked prefill, n-gram drafts on a checkpoint without an MTP
    layer: k = 0's tokens; drafts were verified, some accepted, and some steps drafted none."""
    llm = _llm(ckpt, k, prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1],
               max_num_batched_tokens=32)
    assert llm.model.mtp is None
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert _ids(outs) == [reference[tuple(p)] for p in _prompts()]
    spec = llm.engine.spec_stats
    assert spec.drafts_by_source["ngram"] == spec.num_draft_tokens > 0
    assert spec.drafts_by_source["mtp"] == 0
    assert spec.accepted_by_source["ngram"] == spec.num_accepted > 0
    assert spec.k_chosen[0] > 0  # steps whose lookup found nothing
    assert llm.engine.cache.all_free()


def _oracle(reference, plan):
    """A drafts(req, k) giving the reference continuation; ``plan(req, n_out, drafts)`` ->
    the drafts to give (a corruption, fewer, none)."""
    def drafts(req, k):
        ref = reference[tuple(req.prompt_token_ids)]
        o = req.num_output_tokens
        assert req.output_token_ids == ref[:o], "output diverged from the reference"
        d = list(ref[o:o + k])
        return plan(req, o, d + [3] * (k - len(d)))
    return drafts


def test_zero_draft_request_beside_k_draft_request_keeps_its_gdn_state(ckpt, reference):
    """vLLM #39273 (a request whose proposer returns no drafts, in a step where another
    verifies k, ran on a stale GDN state): request B drafts nothing on most steps, and on the
    others (every third) drafts the true continuation (all accepted: its state moves to
    slot k); A
    drafts k every step, corrupted at a random position. After every step B's current state
    slot holds exactly the state a plain prefill of its computed tokens reaches, and both
    give k = 0's tokens."""
    k = 3
    prompts = _prompts()
    a_prompt, b_prompt = prompts[3], prompts[5]
    llm, ref_llm = _llm(ckpt, k), _llm(ckpt)
    rng = random.Random(1)
    b_calls = []

    def plan(req, n_out, d):
        if req.prompt_token_ids == a_prompt:
            j = rng.randrange(k + 1)
            return d[:j] + [(t + 1) % VOCAB for t in d[j:j + 1]] + d[j + 1:]
        b_calls.append(n_out)
        return d if len(b_calls) % 3 == 1 else []

    llm.engine.proposer.ngram.drafts = _oracle(reference, plan)
    eng = llm.engine
    mixed = []  # steps where A verified and B, off its first slot, verified nothing
    execute = eng.runner.execute

    def watched(plan_, after=None):
        seqs = {tuple(s.request.prompt_token_ids): s for s in plan_.seqs}
        a, b = seqs.get(tuple(a_prompt)), seqs.get(tuple(b_prompt))
        if a and b and a.num_drafts == k and b.num_drafts == 0 and b.sample:
            mixed.append(b.request.slot_cursor)
        return execute(plan_, after)

    eng.runner.execute = watched
    ids = [eng.add_request(p, GREEDY) for p in (a_prompt, b_prompt)]
    checked = 0
    while eng.has_unfinished_requests():
        for req in eng.step():
            if (req.prompt_token_ids == b_prompt and not req.is_finished
                    and req.num_computed_tokens == len(req.token_ids) - 1):
                slot = eng.cache.state_slot(req.request_id, req.slot_cursor)
                conv, ssm = gdn_state_after(ref_llm, req.token_ids[:req.num_computed_tokens])
                torch.testing.assert_close(eng.cache.tensors.conv_states[:, slot], conv,
                                           atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(eng.cache.tensors.ssm_states[:, slot], ssm,
                                           atol=1e-5, rtol=1e-5)
                checked += 1
    outs = [eng.make_output(eng.pop_request(rid)) for rid in ids]
    assert _ids(outs) == [reference[tuple(a_prompt)], reference[tuple(b_prompt)]]
    assert checked >= 8
    assert len(mixed) >= 5 and k in mixed, mixed  # zero-draft steps of B from slot k
    assert eng.cache.all_free()


def test_mtp_plus_ngram_greedy_equals_no_speculation(tmp_path, reference):
    """mtp+ngram on a checkpoint with an MTP layer (the same weights otherwise): a lookup
    match is extended by the MTP, no match drafts from the MTP alone; k = 0's tokens, drafts
    of both sources counted."""
    with_mtp = write_random_checkpoint(tmp_path / "mtp", CFG, seed=3)
    llm = _llm(with_mtp, 4, speculative_method="mtp+ngram", max_num_batched_tokens=32)
    seen = []
    mtp_draft = llm.engine.proposer.mtp._draft

    def draft(reqs, h, plans, head):
        seen.extend((k, len(p)) for k, p in plans)
        return mtp_draft(reqs, h, plans, head)

    llm.engine.proposer.mtp._draft = draft
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert _ids(outs) == [reference[tuple(p)] for p in _prompts()]
    spec = llm.engine.spec_stats
    assert spec.drafts_by_source["ngram"] > 0 and spec.drafts_by_source["mtp"] > 0
    assert any(0 < n < k for k, n in seen), "no lookup match was extended by the MTP"
    assert any(n == 0 for _, n in seen)
    assert spec.num_draft_tokens == sum(spec.drafts_by_source.values())


def test_ngram_needs_no_mtp_and_mtp_does(ckpt):
    with pytest.raises(ValueError, match="speculative_method='ngram'"):
        _llm(ckpt, 2, speculative_method="mtp")
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        _llm(ckpt, 2, speculative_method="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_max must be"):
        _llm(ckpt, 2, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="draft_vocab_size is for MTP drafts"):
        _llm(ckpt, 2, draft_vocab_size=8)


def test_prefix_cache_is_shared_between_k0_and_ngram_requests(ckpt):
    """Without an MTP layer a speculating request's blocks hold the same KV as a plain one's:
    the prefix cache serves one to the other."""
    llm = _llm(ckpt, 2)
    p = _prompts()[6]
    llm.generate([p], GREEDY, use_tqdm=False, speculative_tokens=0)
    assert llm.engine.cached_tokens(p, speculative_tokens=2) >= 64


# Sampling -----------------------------------------------------------------------------------
SMALL_VOCAB = 16
SAMPLE_PROMPT = [3, 7, 12, 5, 9, 4, 7]


@pytest.fixture(scope="module")
def small_ckpts(tmp_path_factory):
    """Vocabulary 16: without an MTP layer (for ngram) and with one (mtp+ngram)."""
    cfg = tiny_text_config(vocab_size=SMALL_VOCAB)
    return {m: write_random_checkpoint(tmp_path_factory.mktemp("ngram_v16"), cfg, seed=11,
                                       with_mtp=m != "ngram") for m in ("ngram", "mtp+ngram")}


@pytest.fixture(scope="module")
def small_ckpt(small_ckpts):
    return small_ckpts["ngram"]


def _small_llm(small_ckpt, k, method="ngram"):
    return LLM(small_ckpt, dtype="float32", speculative_tokens=k, speculative_method=method,
               prompt_lookup_min=1, prompt_lookup_max=2, max_model_len=16, max_num_seqs=256,
               max_num_batched_tokens=2048, cache_memory=16 << 20, seed=1234)


def _exact_marginals(small_ckpt, params: SamplingParams) -> list[torch.Tensor]:
    """Exact distributions of emitted tokens 1, 2, 3 (no speculation), from the full
    logprobs of every context P, P+a, P+ab."""
    V = SMALL_VOCAB
    ctx = [SAMPLE_PROMPT] + [SAMPLE_PROMPT + [a] for a in range(V)] + [
        SAMPLE_PROMPT + [a, b] for a in range(V) for b in range(V)]
    score = SamplingParams(temperature=0, max_tokens=1, logprobs=V, ignore_eos=True)
    outs = _small_llm(small_ckpt, 0).generate(ctx, score, use_tqdm=False)
    logits = torch.tensor([[o.outputs[0].logprobs[0][t] for t in range(V)] for o in outs])
    sampler = Sampler()
    rows = [SamplingRow(params) for _ in ctx]
    probs = sampler.probs(sampler.processed_logits(logits, rows), rows).double()
    p1, p2, p3 = probs[0], probs[1:1 + V], probs[1 + V:].view(V, V, V)
    return [p1, p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)]


def _sampled(small_ckpt, params, n, method="ngram"):
    llm = _small_llm(small_ckpt, 2 if method == "ngram" else 3, method)
    outs = llm.generate([SAMPLE_PROMPT] * n, params, use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids[:3] for o in outs])
    assert llm.engine.cache.all_free()
    assert all(n > 0 for src, n in llm.engine.spec_stats.drafts_by_source.items()
               if src in method)
    return [torch.bincount(toks[:, i], minlength=SMALL_VOCAB).double() for i in range(3)]


@pytest.mark.parametrize("method", ["ngram", "mtp+ngram"])
def test_point_mass_rejection_sampling_keeps_target_distribution(small_ckpts, monkeypatch,
                                                                 method):
    """Tokens 1..3 sampled at temperature 1 with up to 2 n-gram drafts a step (the prompt
    has many 1- and 2-gram matches), or mtp+ngram with k = 3 (a match's point masses then
    the MTP's sampled drafts): each marginal matches the exact target marginal (chi-square,
    p > 1e-3, fixed seed), with drafts accepted, rejected at position 0 and at position 1."""
    rounds = record_rounds(monkeypatch)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    exact = _exact_marginals(small_ckpts[method], params)
    counts = _sampled(small_ckpts[method], params, 2048, method)
    full = {a for d, a in rounds if d >= 2}
    assert {0, 1, 2} <= full, full
    for i, (c, p) in enumerate(zip(counts, exact)):
        stat, df, pval = chi2_pvalue(c, p)
        assert pval > 1e-3, f"token {i + 1}: chi2 {stat:.1f} (df {df}), p = {pval:.2g}"


def test_point_mass_taken_as_no_mass_is_detected(small_ckpt, monkeypatch):
    """The same check fails when the point mass is dropped (q = 0 at the draft: every draft
    the target can emit is accepted, and a rejection may emit the draft again)."""
    from hybridrt.specdec import verify

    orig = verify._rejection_sample

    def wrong(sampler, p, it):
        if it.draft_probs is None:
            it = verify.VerifyItem(it.rows, it.drafts, torch.zeros(len(it.drafts), p.shape[1]))
        return orig(sampler, p, it)

    monkeypatch.setattr(verify, "_rejection_sample", wrong)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    exact = _exact_marginals(small_ckpt, params)
    counts = _sampled(small_ckpt, params, 1024)
    worst = min(chi2_pvalue(counts[i], exact[i])[2] for i in (1, 2))
    assert worst < 1e-6, f"p = {worst:.2g}: the bias went unnoticed"


# Batch invariance ---------------------------------------------------------------------------
@pytest.mark.skipif(not native.half_paths(), reason="compiled CPU kernels unavailable")
def test_batch_invariant_ngram_bytes_equal_k0_alone(ckpt):
    """batch_invariant=True, bf16: with n-gram drafts (greedy and seeded sampling) beside
    other requests, each target's token ids and logprob bytes are its k = 0 bytes alone."""
    llm = LLM(ckpt, dtype="bfloat16", batch_invariant=True, speculative_tokens=3,
              speculative_method="ngram", prompt_lookup_min=1, max_model_len=160,
              cache_memory=64 << 20, max_num_seqs=6)
    prompts = _prompts()
    targets = [(prompts[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                           logprobs=1)),
               (prompts[4], SamplingParams(temperature=0.8, seed=7, max_tokens=24,
                                           ignore_eos=True, logprobs=2))]
    alone = [_key(llm.generate([p], [sp], use_tqdm=False, speculative_tokens=0)[0])
             for p, sp in targets]
    others = [(p, SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True))
              for p in prompts[1:4] + prompts[5:]]
    items = others[:2] + targets[:1] + others[2:] + targets[1:]
    outs = llm.generate([p for p, _ in items], [sp for _, sp in items], use_tqdm=False)
    got = [_key(outs[items.index(t)]) for t in targets]
    assert got == alone
    assert llm.engine.spec_stats.num_accepted > 0


# Counters -----------------------------------------------------------------------------------
def test_per_request_and_metrics_counters_by_source(ckpt):
    llm = _llm(ckpt, 3)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    total = SpecStats(3)
    for o in outs:
        s = o.metrics["spec"]
        assert s["drafts_by_source"]["ngram"] == s["num_draft_tokens"]
        assert s["accepted_by_source"]["ngram"] == s["num_accepted"]
        assert sum(s["k_chosen"]) >= s["num_rounds"]
        assert s["mean_k_chosen"] == pytest.approx(
            sum(j * n for j, n in enumerate(s["k_chosen"])) / sum(s["k_chosen"]))
    total.merge(llm.engine.spec_stats)
    read = {name: fn for name, _, _, fn in _METRICS}
    g = total.counters()
    assert read["spec_ngram_draft_tokens_total"]({}, g) == total.drafts_by_source["ngram"] > 0
    assert read["spec_ngram_accepted_tokens_total"]({}, g) == total.accepted_by_source["ngram"]
    assert read["spec_mtp_draft_tokens_total"]({}, g) == 0
    assert read["spec_mtp_accepted_tokens_total"]({}, g) == 0
    assert read["spec_k_chosen_total"]({}, g) == sum(j * n for j, n in enumerate(total.k_chosen))
    assert read["spec_drafting_decisions_total"]({}, g) == sum(total.k_chosen) > 0


# Benchmark ----------------------------------------------------------------------------------
def test_specbench_runs_prompt_lookup_on_the_copy_workload(ckpt, capsys):
    """``hybridrt bench spec --speculative-method ngram --workload copy`` stays runnable: every
    k gives k = 0's tokens, drafts come from prompt lookup, the table says so; simulated
    acceptance (which replaces MTP drafts) is refused without an MTP."""
    from hybridrt.bench.spec import run_spec_bench

    report = run_spec_bench(str(ckpt), ks=(0, 2), batch_sizes=(1, 2), threads=1, quick=True,
                            engine={"speculative_method": "ngram", "speculative_adaptive": True,
                                    "prompt_lookup_min": 1}, workload="copy")
    assert report["speculative_method"] == "ngram" and report["workload"] == "copy"
    rows = [r for r in report["rows"] if r["k"]]
    assert all(r["identical_to_k0"] for r in report["rows"])
    assert sum(r["drafts_by_source"]["ngram"] for r in rows) > 0
    assert all(r["drafts_by_source"]["mtp"] == 0 for r in rows)
    assert all(0 <= r["mean_k_chosen"] <= 2 for r in rows)
    assert [(r["batch_size"], r["k"], r["adaptive"]) for r in rows] == [
        (1, 2, False), (1, 2, True), (2, 2, False), (2, 2, True)]  # fixed k, then adaptive
    assert "drafts from ngram; k <=N rows: k adaptive up to N" in capsys.readouterr().out
    with pytest.raises(ValueError, match="simulated acceptance replaces the MTP's drafts"):
        run_spec_bench(str(ckpt), ks=(0, 2), batch_sizes=(1,), threads=1, quick=True,
                       engine={"speculative_method": "ngram"}, simulate_acceptance=(0.5,),
                       verbose=False)


def test_demo_model_greedy_equal_with_every_drafter():
    """The embedded demo model (bf16, chat prompts, one of them asking for its code back):
    prompt lookup, MTP + lookup and adaptive k all give k = 0's tokens."""
    from hybridrt.llm import default_model

    sp = SamplingParams(temperature=0, max_tokens=48)
    kw = dict(max_model_len=512, cache_memory=16 << 20, max_num_seqs=4)
    base = LLM(default_model(), **kw)
    prompts = [base.apply_chat_template([{"role": "user", "content": c}]) for c in (
        "Repeat exactly: def add(a, b):\n    return a + b\n\ndef add(a, b):",
        "What does json.dumps do?", "Explain a list comprehension.")]
    want = _ids(base.generate(prompts, sp, use_tqdm=False))
    for method, adaptive in (("ngram", False), ("mtp+ngram", False), ("ngram", True)):
        llm = LLM(default_model(), speculative_tokens=3, speculative_method=method,
                  speculative_adaptive=adaptive, prompt_lookup_min=1, **kw)
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want, (method, adaptive)
        assert llm.engine.spec_stats.drafts_by_source["ngram"] > 0
