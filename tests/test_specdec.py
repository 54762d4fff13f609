"""MTP speculative decoding: lossless greedy and sampling, GDN state rollback, KV hygiene,
preemption / abort / stop handling, statistics, and the speculative benchmark.

The tiny checkpoint has random MTP weights, so its own drafts are almost always rejected
(rejection paths). An oracle drafter that replaces the MTP's drafts by the true greedy
continuation (optionally corrupted at one position) drives the full / partial acceptance paths.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import chi2_pvalue, gdn_state_after, record_rounds

from hybridrt.bench.fixtures import tiny_text_config, write_char_tokenizer, write_random_checkpoint
from hybridrt.llm import LLM
from hybridrt.runner import build_batch
from hybridrt.sampler import Sampler, SamplingRow
from hybridrt.sampling_params import SamplingParams
from hybridrt.specdec.stats import SpecStats
from hybridrt.statecache import CacheTensors

MAX_TOKENS = 16
TEXT_CONFIG = tiny_text_config()
VOCAB = TEXT_CONFIG["vocab_size"]
PROMPT_LENS = (1, 2, 7, 17, 40, 70, 100)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tiny_spec"), TEXT_CONFIG, seed=3)
    write_char_tokenizer(d, VOCAB)  # for stop strings; prompts below are token ids
    return d


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def make_llm(ckpt, k=0, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("cache_memory", 32 << 20)
    return LLM(ckpt, dtype="float32", speculative_tokens=k, **kw)


@pytest.fixture(scope="module")
def base_llm(ckpt):
    return make_llm(ckpt)


@pytest.fixture(scope="module")
def reference(base_llm, prompts):
    """Greedy outputs without speculation: {prompt tuple: output token ids}."""
    outs = base_llm.generate(prompts, GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}


@pytest.fixture
def rounds(monkeypatch):
    """Every verify round as (num_drafts, num_accepted)."""
    return record_rounds(monkeypatch)


class OracleProposer:
    """Wraps the engine's MTPProposer (which still runs, so the MTP KV stays exercised) and
    replaces each request's drafts by the true greedy continuation. ``corrupt(k)`` -> the
    draft position to corrupt this round (>= k: none)."""

    def __init__(self, inner, refs: dict[tuple, list[int]], corrupt=None, check=None):
        self.inner = inner
        self.refs = refs
        self.corrupt = corrupt or (lambda k: k)
        self.check = check  # check(request, mtp_drafts) before the drafts are replaced

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, plan, cu_seqlens, hidden, settled):
        proposed = self.inner.propose(plan, cu_seqlens, hidden, settled)
        for drafts in proposed:
            req = drafts.request
            n = len(drafts.token_ids)
            if not n or req.is_finished:
                continue
            if self.check is not None:
                self.check(req, list(drafts.token_ids))
            ref = self.refs[tuple(req.prompt_token_ids)]
            o = req.num_output_tokens
            assert req.output_token_ids == ref[:o], "output diverged from the reference"
            d = list(ref[o:o + n])
            d += [3] * (n - len(d))  # past a stop the reference has no tokens: any will do
            j = self.corrupt(n)
            if j < n:
                d[j] = (d[j] + 1) % VOCAB
            drafts.token_ids = d
            drafts.probs = None
        return proposed


def install_oracle(llm, refs, corrupt=None, check=None) -> OracleProposer:
    oracle = OracleProposer(llm.engine.proposer, refs, corrupt, check)
    llm.engine.proposer = oracle
    return oracle


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# 1. Lossless greedy ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_with_mtp_drafts_equals_no_speculation(ckpt, prompts, reference, rounds, k):
    llm = make_llm(ckpt, k)
    expected = [reference[tuple(p)] for p in prompts]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    for p in prompts:  # batch of one
        (out,) = llm.generate([p], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == reference[tuple(p)]
        assert out.metrics["spec"]["num_rounds"] > 0
    assert rounds and all(d <= k for d, _ in rounds)
    assert any(a < d for d, a in rounds)  # random MTP weights: rejections happened
    assert llm.engine.cache.all_free()


def test_mixed_batch_mixed_k_chunked_prefill(ckpt, prompts, reference, rounds):
    """Per-request k = 0..4 in one batch, with prompt chunks, verifies and decodes sharing
    steps (small token budget)."""
    llm = make_llm(ckpt, 4, max_num_batched_tokens=24)
    eng = llm.engine
    kinds = []
    prepare = eng.runner.build_step_batch

    def spy(plan):
        batch = prepare(plan)
        gdn = eng.runner.model.plan_step(batch).gdn
        kinds.append({"verify" if g.slots_out is not None else "decode" for g in gdn.groups}
                     | ({"chunk"} if gdn.chunked is not None else set()))
        return batch

    eng.runner.build_step_batch = spy
    ids = [eng.add_request(p, GREEDY, speculative_tokens=i % 5) for i, p in enumerate(prompts)]
    while eng.has_unfinished_requests():
        eng.step()
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        out = eng.make_output(eng.pop_request(rid))
        assert out.outputs[0].token_ids == reference[tuple(p)], f"prompt {i} (k={i % 5})"
        assert ("spec" in out.metrics) == (i % 5 > 0)
    assert any({"verify", "chunk"} <= k for k in kinds)
    assert any({"verify", "decode"} <= k for k in kinds)
    assert {d for d, _ in rounds} >= {1, 2, 3, 4}  # token budget can also cut a verify short
    assert eng.cache.all_free()


@pytest.mark.parametrize("k", [3, 7])
def test_bf16_request_alone_equals_no_speculation(ckpt, prompts, rounds, k):
    """bf16 on the CPU backend (its compiled decode and verification steps): a request alone,
    with the MTP's drafts and with drafts that are all accepted (every verification row is
    used), gives the tokens it gets without speculation: up to 8 rows the products compute each
    row as decoding computes it alone (``half_gemv``), and so do the GDN and attention calls."""
    kw = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=1, cache_memory=32 << 20)
    base = LLM(ckpt, **kw)
    ref = {tuple(p): base.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
           for p in prompts}
    for oracle in (False, True):
        llm = LLM(ckpt, speculative_tokens=k, **kw)
        if oracle:
            install_oracle(llm, ref)
        rounds.clear()
        for p in prompts:
            (out,) = llm.generate([p], GREEDY, use_tqdm=False)
            assert out.outputs[0].token_ids == ref[tuple(p)], (oracle, p)
        assert any(d == k for d, _ in rounds)
        if oracle:
            assert all(a == d for d, a in rounds)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_oracle_drafts_fully_accepted(ckpt, prompts, reference, rounds, k):
    llm = make_llm(ckpt, k)
    install_oracle(llm, reference)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [reference[tuple(p)] for p in prompts]
    assert rounds and all(a == d for d, a in rounds)  # every draft accepted
    for o in outs:
        spec = o.metrics["spec"]
        assert spec["mean_acceptance_length"] > k + 0.5, spec
    assert llm.engine.spec_stats.mean_acceptance_length > k + 0.5
    assert llm.engine.cache.all_free()


def test_token_budget_cuts_verification_short(ckpt, prompts, reference, rounds):
    """A 3-token step budget verifies at most 2 of the 4 drafts (the rest are dropped and
    re-drafted); with oracle drafts both are accepted every time."""
    llm = make_llm(ckpt, 4, max_num_batched_tokens=3)
    install_oracle(llm, reference)
    batch = prompts[1:3]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [reference[tuple(p)] for p in batch]
    assert rounds and all(a == d for d, a in rounds)
    assert max(d for d, _ in rounds) == 2
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_oracle_corrupted_at_position_j_partial_acceptance(ckpt, prompts, reference, rounds, j):
    k = 4
    llm = make_llm(ckpt, k)
    install_oracle(llm, reference, corrupt=lambda n: j)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [reference[tuple(p)] for p in prompts]
    assert rounds and all(a == min(j, d) for d, a in rounds), rounds
    per_pos = [sum(o.metrics["spec"]["per_position_acceptance"][i] for o in outs)
               for i in range(k)]
    assert all(x > 0 for x in per_pos[:j]) and all(x == 0 for x in per_pos[j:])
    assert llm.engine.cache.all_free()


PARAM_VARIANTS = {
    "penalties": {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.3},
    "min_tokens_stop_ids": {"min_tokens": 6, "stop_token_ids": None},  # filled per prompt
    "logprobs": {"logprobs": 3},
}


@pytest.mark.parametrize("variant", list(PARAM_VARIANTS))
def test_greedy_params_that_read_the_history(ckpt, base_llm, prompts, reference, variant):
    """Penalties and min_tokens depend on the tokens before each position: every verify row
    must see the drafts before it. Oracle drafts (from the non-speculative output under the
    same params), corrupted at a random position, so rows after accepted drafts are used."""
    batch = prompts[:5]
    kw = dict(PARAM_VARIANTS[variant])
    if "stop_token_ids" in kw:  # stop ids the plain greedy output hits early
        kw["stop_token_ids"] = sorted({reference[tuple(p)][1] for p in batch})
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
    want = base_llm.generate(batch, sp, use_tqdm=False)
    llm = make_llm(ckpt, 3)
    rng = random.Random(3)
    install_oracle(llm, {tuple(p): w.outputs[0].token_ids for p, w in zip(batch, want)},
                   corrupt=lambda n: rng.randint(0, n))
    got = llm.generate(batch, sp, use_tqdm=False)
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.finish_reason, g.stop_reason) == (
            w.token_ids, w.finish_reason, w.stop_reason)
        if w.logprobs is not None:
            assert len(g.logprobs) == len(w.logprobs)
            for lw, lg in zip(w.logprobs, g.logprobs):
                assert lg.keys() == lw.keys()
                assert list(lg.values()) == pytest.approx(list(lw.values()), abs=1e-4)
    if variant == "min_tokens_stop_ids":
        assert any(len(w.outputs[0].token_ids) < MAX_TOKENS for w in want)
    assert llm.engine.cache.all_free()


def test_seeded_sampling_with_speculation_is_batch_independent(ckpt, prompts):
    llm = make_llm(ckpt, 2)
    sp = SamplingParams(temperature=1.0, seed=77, max_tokens=MAX_TOKENS, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (alone,) = llm.generate([prompts[3]], sp, use_tqdm=False)
    mixed = llm.generate([prompts[0], prompts[3], prompts[5]], [other, sp, GREEDY],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert alone.metrics["spec"]["num_rounds"] > 0


# 2. GDN state rollback and stale KV -----------------------------------------------------------
def _poison_stale_kv(eng, req, gen) -> int:
    """Huge random values into every KV entry (target and MTP layers) of ``req`` at positions
    >= num_computed_tokens -> number of positions poisoned.

    Not NaN: the batched decode path of ``paged_attention`` gathers every sequence up to the
    longest context and masks the tail (and padded block-table entries), so a NaN anywhere in
    a gathered block becomes 0 * NaN = NaN even though its weight is exactly 0. Finite garbage
    under a zero weight contributes exactly nothing, and under any non-zero weight it wrecks
    the logits."""
    t = eng.cache.tensors
    bs = eng.cache.block_size
    table = eng.cache.block_table(req.request_id)
    first = req.num_computed_tokens
    pos = torch.arange(first, len(table) * bs)
    if pos.numel() == 0:
        return 0
    flat = torch.tensor(table)[pos // bs] * bs + pos % bs
    for cache in (*t.key_caches, *t.value_caches):
        view = cache.view(-1, *cache.shape[2:])
        view[flat] = 1e4 * torch.randn(view[flat].shape, generator=gen, dtype=view.dtype)
    return pos.numel()


def test_gdn_state_rollback_and_stale_kv_never_read(ckpt, prompts, reference, rounds):
    """After every verify step the request's current GDN state equals the state a plain
    prefill of exactly its computed tokens reaches; KV past the computed tokens (rejected
    drafts, lookahead) is garbage-poisoned after every step and must never reach a logit."""
    k = 3
    llm = make_llm(ckpt, k)
    ref_llm = make_llm(ckpt)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    install_oracle(llm, reference, corrupt=lambda n: rng.randint(0, n))  # a = 0..n
    eng = llm.engine
    orig_logits = llm.model.compute_logits

    def checked_logits(h, fp32=True):
        out = orig_logits(h, fp32)
        assert torch.isfinite(out).all() and out.abs().max() < 1e3, "stale KV reached logits"
        return out

    llm.model.compute_logits = checked_logits
    chosen = prompts[1:6]
    ids = [eng.add_request(p, GREEDY) for p in chosen]
    checked, cursors, poisoned = 0, set(), 0
    while eng.has_unfinished_requests():
        progressed = eng.step()
        for req in progressed:
            if req.is_finished or req.num_computed_tokens != len(req.token_ids) - 1:
                continue
            slot = eng.cache.state_slot(req.request_id, req.slot_cursor)
            conv = eng.cache.tensors.conv_states[:, slot]
            ssm = eng.cache.tensors.ssm_states[:, slot]
            ref_conv, ref_ssm = gdn_state_after(ref_llm, req.token_ids[:req.num_computed_tokens])
            torch.testing.assert_close(conv, ref_conv, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ssm, ref_ssm, atol=1e-4, rtol=1e-4)
            checked += 1
            cursors.add(req.slot_cursor)
        for req in eng.scheduler.running:
            poisoned += _poison_stale_kv(eng, req, gen)
    outs = [eng.make_output(eng.pop_request(rid)) for rid in ids]
    assert token_ids(outs) == [reference[tuple(p)] for p in chosen]
    assert checked > 10 and cursors == set(range(k + 1)), (checked, cursors)
    assert poisoned > 0 and {a for _, a in rounds} == set(range(k + 1))
    assert eng.cache.all_free()


@torch.inference_mode()
def _mtp_drafts_from_scratch(model, token_ids_: list[int], k: int) -> list[int]:
    """Greedy MTP drafts computed from nothing: a fresh cache, one dense target prefill of
    every computed token, one MTP pass over all positions with shifted inputs (t[p+1], h[p]),
    then k - 1 single-token MTP steps on the MTP's own output."""
    cfg = model.config
    n = len(token_ids_)
    bs = 16
    blocks = -(-(n + k) // bs)
    cache = CacheTensors.allocate(cfg, blocks, 2, bs, torch.float32, "cpu",
                                  model.num_attention_caches - len(cfg.full_attention_layers))
    table = [list(range(blocks))]
    h = model(build_batch([token_ids_[:n - 1]], [0], table, bs, [1], ["all"]), cache)
    mb = build_batch([token_ids_[1:]], [0], table, bs, [1], ["last"])
    x = model.mtp_forward(mb.input_ids, h, mb, cache)[-1:]
    drafts = [int(model.compute_logits(x).argmax(-1))]
    for j in range(k - 1):
        mb = build_batch([[drafts[-1]]], [n - 1 + j], table, bs, [1])
        x = model.mtp_forward(mb.input_ids, x, mb, cache)
        drafts.append(int(model.compute_logits(x).argmax(-1)))
    return drafts


def test_mtp_drafts_match_a_from_scratch_computation(ckpt, prompts, reference):
    """After prefill chunks and verify rounds with 0..k accepted drafts, the proposer's MTP KV
    covers exactly the accepted positions: its drafts equal those of a from-scratch MTP run
    over the request's tokens."""
    k = 3
    llm = make_llm(ckpt, k, max_num_batched_tokens=32)
    rng = random.Random(4)
    seen = []

    def check(req, drafts):
        want = _mtp_drafts_from_scratch(llm.model, req.token_ids, len(drafts))
        assert drafts == want, (req.request_id, len(req.token_ids))
        seen.append(len(drafts))

    install_oracle(llm, reference, corrupt=lambda n: rng.randint(0, n), check=check)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [reference[tuple(p)] for p in prompts]
    assert len(seen) > 20 and set(seen) >= {1, 2, 3}


# 3. Lossless rejection sampling ---------------------------------------------------------------
SMALL_VOCAB = 16
SAMPLE_PROMPT = [3, 7, 12, 5, 9, 4]


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    cfg = tiny_text_config(vocab_size=SMALL_VOCAB)
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_v16"), cfg, seed=11)


def _small_llm(small_ckpt, k):
    return LLM(small_ckpt, dtype="float32", speculative_tokens=k, max_model_len=16,
               max_num_seqs=256, max_num_batched_tokens=2048, cache_memory=16 << 20, seed=1234)


_EXACT: dict[tuple, list[torch.Tensor]] = {}


def _exact_marginals(small_ckpt, params: SamplingParams) -> list[torch.Tensor]:
    """Exact distributions of emitted tokens 1, 2, 3 under ``params`` (no speculation): every
    context P, P+a, P+ab is scored once; the full log-softmax of the raw logits comes back as
    logprobs, and the sampler's own temperature / top-k / top-p turn it into probabilities."""
    key = (str(small_ckpt), params.temperature, params.top_k, params.top_p)
    if key in _EXACT:
        return _EXACT[key]
    V = SMALL_VOCAB
    llm = _small_llm(small_ckpt, 0)
    ctx = [SAMPLE_PROMPT] + [SAMPLE_PROMPT + [a] for a in range(V)] + [
        SAMPLE_PROMPT + [a, b] for a in range(V) for b in range(V)]
    score = SamplingParams(temperature=0, max_tokens=1, logprobs=V, ignore_eos=True)
    outs = llm.generate(ctx, score, use_tqdm=False)
    logits = torch.tensor([[o.outputs[0].logprobs[0][t] for t in range(V)] for o in outs])
    sampler = Sampler()
    rows = [SamplingRow(params) for _ in ctx]
    probs = sampler.probs(sampler.processed_logits(logits, rows), rows).double()
    p1, p2, p3 = probs[0], probs[1:1 + V], probs[1 + V:].view(V, V, V)
    m2 = p1 @ p2
    m3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    _EXACT[key] = [p1, m2, m3]
    return _EXACT[key]


def _empirical(small_ckpt, params: SamplingParams, k: int, n: int) -> list[torch.Tensor]:
    llm = _small_llm(small_ckpt, k)
    outs = llm.generate([SAMPLE_PROMPT] * n, params, use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids[:3] for o in outs])
    assert llm.engine.cache.all_free()
    return [torch.bincount(toks[:, i], minlength=SMALL_VOCAB).double() for i in range(3)]


def test_chi2_pvalue_matches_known_critical_values():
    # chi-square 0.999 quantiles: df 5 -> 20.515, df 15 -> 37.697
    for df, crit in ((5, 20.515), (15, 37.697)):
        p = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                          torch.tensor(crit / 2.0, dtype=torch.float64)))
        assert p == pytest.approx(1e-3, rel=1e-3)


SAMPLING_CASES = {  # name: (params, samples, verify outcomes that must occur)
    "t1": (SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), 2048, {0, 1, 2}),
    "t0.8-topk6-topp0.9": (SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_tokens=4,
                                          ignore_eos=True), 1024, {0, 1}),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_rejection_sampling_keeps_target_distribution(small_ckpt, rounds, case):
    """Samples of tokens 1..3 with k=2 MTP drafts: token 2 is verify position 0, token 3
    is verify position 1 (when d1 was accepted) or the next round; each marginal must match
    the exact target marginal (chi-square, p > 1e-3 with a fixed seed)."""
    params, n, outcomes = SAMPLING_CASES[case]
    exact = _exact_marginals(small_ckpt, params)
    counts = _empirical(small_ckpt, params, 2, n)
    full = [a for d, a in rounds if d == 2]
    # a = 0: rejected at position 0; a = 1: rejected at position 1; a = 2: all accepted
    assert outcomes <= set(full), sorted((a, full.count(a)) for a in set(full))
    for i, (c, p) in enumerate(zip(counts, exact)):
        stat, df, pval = chi2_pvalue(c, p)
        assert pval > 1e-3, f"token {i + 1}: chi2 {stat:.1f} (df {df}), p = {pval:.2g}"


def test_biased_acceptance_rule_is_detected(small_ckpt, monkeypatch):
    """The same check fails when every draft is accepted (emits the draft distribution)."""
    from hybridrt.specdec import verify

    params = SAMPLING_CASES["t1"][0]
    exact = _exact_marginals(small_ckpt, params)
    monkeypatch.setattr(verify, "acceptance_probability", lambda p, q: torch.ones_like(p))
    counts = _empirical(small_ckpt, params, 2, 512)
    for i in (1, 2):
        stat, df, pval = chi2_pvalue(counts[i], exact[i])
        assert pval < 1e-6, f"token {i + 1}: chi2 {stat:.1f} (df {df}) did not flag the bias"


# 4. Preemption, abort, stops, errors ----------------------------------------------------------
def _budget(llm, num_blocks, num_slots):
    cfg, dtype = llm.config, llm.dtype
    extra = llm.model.num_attention_caches - len(cfg.full_attention_layers)
    return (num_blocks * CacheTensors.bytes_per_block(cfg, 16, dtype, extra)
            + num_slots * CacheTensors.bytes_per_slot(cfg, dtype, 16, extra))


@pytest.mark.parametrize("oracle", [False, True], ids=["mtp", "oracle"])
def test_preemption_during_speculation(ckpt, prompts, reference, oracle):
    k = 2
    probe = make_llm(ckpt, k, max_model_len=96)
    # ceil((96 + k) / 16) = 7 blocks: one max-length request fits, the batch does not.
    budget = _budget(probe, num_blocks=7, num_slots=2 + 8 * (1 + k))  # + null, session slot
    llm = make_llm(ckpt, k, max_model_len=96, cache_memory=budget, max_num_batched_tokens=16)
    assert llm.cache_sizing.num_blocks == 7
    llm.engine.scheduler.admission_control = False  # admission control would avoid them all
    checked = []
    if oracle:  # also: after recompute the MTP KV is right again (drafts as from scratch)
        rng = random.Random(1)

        def check(req, drafts):
            want = _mtp_drafts_from_scratch(llm.model, req.token_ids, len(drafts))
            assert drafts == want
            checked.append(req.metrics.num_preemptions)

        install_oracle(llm, reference, corrupt=lambda n: rng.randint(0, n), check=check)
    batch = [p for p in prompts if len(p) + MAX_TOKENS < 96]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [reference[tuple(p)] for p in batch]
    assert llm.engine.stats["num_preemptions"] > 0
    assert not oracle or max(checked) > 0  # drafts checked after a preemption
    cache = llm.engine.cache
    assert cache.all_free() and not cache.owners()


def test_abort_mid_draft_frees_everything(ckpt, prompts, reference):
    llm = make_llm(ckpt, 3)
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    aborted = None
    while eng.has_unfinished_requests():
        eng.step()
        if aborted is None:
            drafting = [r for r in eng.scheduler.running if r.draft_token_ids]
            if drafting and eng.stats["num_steps"] >= 3:
                aborted = drafting[len(drafting) // 2]
                eng.abort_request(aborted.request_id)
                assert not aborted.draft_token_ids and aborted.draft_probs is None
                assert aborted.request_id not in eng.cache.owners()
    assert aborted is not None
    for rid, p in zip(ids, prompts):
        out = eng.make_output(eng.pop_request(rid))
        if rid == aborted.request_id:
            assert out.outputs[0].finish_reason == "abort"
            assert out.outputs[0].token_ids == reference[tuple(p)][:len(out.outputs[0].token_ids)]
        else:
            assert out.outputs[0].token_ids == reference[tuple(p)]
            assert out.outputs[0].finish_reason == "length"
    assert eng.cache.all_free()


def _first_mid_run_token(ref: list[int], k: int) -> int:
    """Index i of a token whose first occurrence in ``ref`` is i, lying strictly inside a
    fully accepted run (runs cover indices 1..k+1, k+2..2k+2, ...)."""
    for i in range(2, len(ref)):
        if ref.index(ref[i]) == i and (i - 1) % (k + 1) != k and ref[i] > 2:
            return i
    raise AssertionError("no suitable stop token")


def test_stops_inside_an_accepted_run(ckpt, base_llm, prompts, reference, rounds):
    k = 4
    llm = make_llm(ckpt, k)
    install_oracle(llm, reference)
    p = prompts[2]
    ref = reference[tuple(p)]
    i = _first_mid_run_token(ref, k)
    tok = llm.tokenizer
    cases = {
        "stop_token_ids": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                         stop_token_ids=[ref[i]]),
        "max_tokens": SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True),
        "stop_string": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      stop=[tok.decode(ref[i:i + 1])]),
        "stop_string_included": SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True, include_stop_str_in_output=True,
                                               stop=[tok.decode(ref[i - 1:i + 1])]),
    }
    for name, sp in cases.items():
        (want,) = base_llm.generate([p], sp, use_tqdm=False)
        rounds.clear()
        (got,) = llm.generate([p], sp, use_tqdm=False)
        w, g = want.outputs[0], got.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids, w.text, w.finish_reason, w.stop_reason), name
        assert len(g.token_ids) <= i + 1, name
        if name != "max_tokens":
            assert w.finish_reason == "stop", name
            # the round that emitted the stop had more accepted drafts than it could use
            assert rounds[-1][1] + 1 > len(g.token_ids) - (1 + sum(a + 1 for _, a in rounds[:-1]))
    assert llm.engine.cache.all_free()


def test_max_model_len_inside_an_accepted_run(ckpt, prompts, reference):
    k = 4
    p = prompts[-1]  # 100 tokens
    llm = make_llm(ckpt, k, max_model_len=len(p) + 8)
    install_oracle(llm, reference)
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    (out,) = llm.generate([p], sp, use_tqdm=False)
    assert out.outputs[0].token_ids == reference[tuple(p)][:8]
    assert out.outputs[0].finish_reason == "length"
    assert llm.engine.cache.all_free()


def test_checkpoint_without_mtp_is_refused(tmp_path, prompts):
    d = write_random_checkpoint(tmp_path / "nomtp", TEXT_CONFIG, seed=3, with_mtp=False)
    with pytest.raises(ValueError, match="MTP"):
        make_llm(d, 2)
    llm = make_llm(d, 0)  # without speculation the same checkpoint works
    (out,) = llm.generate([prompts[2]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == MAX_TOKENS


def test_per_call_speculative_tokens(ckpt, prompts, reference):
    llm = make_llm(ckpt, 2)
    batch = prompts[1:4]
    for bad in (3, -1, True, 1.5):  # a bad argument of the call fails the call
        with pytest.raises(ValueError, match="speculative_tokens"):
            llm.generate(batch, GREEDY, use_tqdm=False, speculative_tokens=bad)
    assert llm.engine.cache.all_free() and not llm.engine.has_unfinished_requests()
    for k in (0, 1):
        outs = llm.generate(batch, GREEDY, use_tqdm=False, speculative_tokens=k)
        assert token_ids(outs) == [reference[tuple(p)] for p in batch]
        for o in outs:
            assert ("spec" in o.metrics) == (k > 0)
            if k:
                assert o.metrics["spec"]["k"] == k
                assert o.metrics["spec"]["num_draft_tokens"] <= o.metrics["spec"]["num_rounds"]


# 5. Statistics --------------------------------------------------------------------------------
def test_spec_stats_are_consistent(ckpt, prompts, reference, rounds):
    k = 3
    llm = make_llm(ckpt, k)
    rng = random.Random(2)
    install_oracle(llm, reference, corrupt=lambda n: rng.randint(0, n))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == [reference[tuple(p)] for p in prompts]
    total = SpecStats(k)
    for o in outs:
        s = o.metrics["spec"]
        n, acc = s["num_rounds"], s["num_accepted"]
        assert s["k"] == k and n > 0
        assert s["mean_acceptance_length"] == pytest.approx(1 + acc / n)
        assert s["acceptance_rate"] == pytest.approx(acc / s["num_draft_tokens"])
        pp = s["per_position_acceptance"]
        assert len(pp) == k and all(x >= y for x, y in itertools.pairwise(pp))
        assert sum(x * n for x in pp) == pytest.approx(acc)
        assert acc <= s["num_draft_tokens"] <= k * n
        # every token is the prefill's, a verify round's (accepted + 1), or a plain decode
        # (only once one token is left and no draft fits)
        extra = o.metrics["num_generated_tokens"] - (1 + n + acc)
        assert extra in (0, 1)
        total.num_rounds += n
        total.num_accepted += acc
        total.num_draft_tokens += s["num_draft_tokens"]
    assert total.num_rounds == len(rounds) and total.num_accepted == sum(a for _, a in rounds)
    assert total.num_draft_tokens == sum(d for d, _ in rounds)
    eng = llm.engine.spec_stats.as_dict()
    assert (eng["num_rounds"], eng["num_accepted"], eng["num_draft_tokens"]) == (
        total.num_rounds, total.num_accepted, total.num_draft_tokens)
    # per position i: rounds that accepted at least i + 1 drafts
    want = [sum(a > i for _, a in rounds) / len(rounds) for i in range(k)]
    assert eng["per_position_acceptance"] == pytest.approx(want)
    assert 1 < eng["mean_acceptance_length"] < k + 1


# Benchmark ------------------------------------------------------------------------------------
def test_specbench_reports_what_it_ran(ckpt, tmp_path, capsys, monkeypatch):
    import json

    from hybridrt.bench.spec import run_spec_bench
    from hybridrt.specdec import verify as engine_verify

    out = tmp_path / "spec.json"
    report = run_spec_bench(str(ckpt), ks=(0, 1, 2), batch_sizes=(1, 4), threads=1,
                            json_path=out, quick=True, verbose=True)
    assert json.loads(out.read_text()) == report
    table = capsys.readouterr().out
    assert "tok/s" in table and "per-position acceptance" in table
    assert (report["ks"], report["batch_sizes"], report["num_prompts"], report["max_tokens"]) == (
        [0, 1, 2], [1, 4], 4, 8)  # --quick: 4 prompts, 8 new tokens
    rows = {(r["batch_size"], r["k"]): r for r in report["rows"]}
    assert list(rows) == [(b, k) for b in (1, 4) for k in (0, 1, 2)]
    for (b, k), r in rows.items():
        base = rows[(b, 0)]
        assert r["num_requests"] == 4
        assert r["generated_tokens"] == base["generated_tokens"] <= 4 * 8
        assert r["tok_s"] == pytest.approx(r["generated_tokens"] / r["seconds"])
        assert r["speedup"] == pytest.approx(r["tok_s"] / base["tok_s"])
        assert r["identical_to_k0"] is True  # greedy: speculation is lossless
        if k == 0:
            assert r["mean_acceptance_length"] is None and r["per_position_acceptance"] == []
        else:
            assert r["num_rounds"] > 0 and len(r["per_position_acceptance"]) == k
            # per position i: the rounds that accepted more than i drafts
            assert r["mean_acceptance_length"] == pytest.approx(
                1 + sum(r["per_position_acceptance"]))

    # a lossy verifier (every draft accepted) makes the outputs differ from k = 0's
    def accept_all(sampler, logits, items):
        return [(it.drafts + [it.drafts[-1]], len(it.drafts)) for it in items]

    monkeypatch.setattr(engine_verify, "verify_drafts", accept_all)
    lossy = run_spec_bench(str(ckpt), ks=(0, 2), batch_sizes=(1,), threads=1, quick=True,
                           verbose=False)
    assert [r["identical_to_k0"] for r in lossy["rows"]] == [True, False]


def test_specbench_resumes_every_run_from_the_cached_context(ckpt):
    """``--context``: each timed run resumes from the cached context, one prefill step per
    request (its prompt after the context), k = 0 and drafting runs alike. Their blocks hash
    apart (the MTP's KV), so the cache holds the context twice; sized for one max-length
    request it evicted one for the other and every run prefilled the whole context again."""
    from hybridrt.bench.spec import run_spec_bench

    report = run_spec_bench(str(ckpt), ks=(0, 1), batch_sizes=(1,), threads=1, quick=True,
                            verbose=False, context=2500)  # twice over max_model_len / 2
    assert [r["k"] for r in report["rows"]] == [0, 1]
    for r in report["rows"]:
        assert r["step_costs"]["prefill_count"] == r["num_requests"] == 4, r["step_costs"]
        assert r["identical_to_k0"] is True


def test_specbench_pairs_each_alphas_rows_with_a_k0_run(ckpt):
    """With adaptive k a k = 0 run comes before each simulated alpha's rows, and a row's
    speedup is the median of its runs' tok/s over the k = 0 run just before each (the k = 0
    row's tok/s the median of all of them)."""
    import statistics

    from hybridrt.bench.spec import run_spec_bench

    report = run_spec_bench(str(ckpt), ks=(0, 1), batch_sizes=(1,), threads=1, quick=True,
                            verbose=False, repeats=2, simulate_acceptance=(0.2, 0.8),
                            engine={"speculative_adaptive": True})
    rows = report["rows"]
    assert [(r["k"], r["simulated_alpha"], r["adaptive"]) for r in rows] == [
        (0, None, False), (1, 0.2, False), (1, 0.2, True), (1, 0.8, False), (1, 0.8, True)]
    k0 = rows[0]["tok_s_runs"]
    assert len(k0) == 4 and rows[0]["tok_s"] == pytest.approx(statistics.median(k0))
    for j, alpha in enumerate((0.2, 0.8)):  # repeat r's k = 0 run before alpha j: k0[2 r + j]
        for r in (r for r in rows if r["simulated_alpha"] == alpha):
            assert len(r["tok_s_runs"]) == 2
            assert r["speedup"] == pytest.approx(statistics.median(
                [t / k0[2 * i + j] for i, t in enumerate(r["tok_s_runs"])]))


def test_simulated_drafts_keep_adaptive_k_lazy(ckpt, prompts, monkeypatch):
    """The simulated-acceptance drafter (bench/spec_sim.py) keeps the engine's settings: with
    adaptive k at alpha 0 (nothing accepted, so k falls to 0) the steps without drafts run no
    MTP pass, as without simulation; a drafter rebuilt without ``lazy`` ran one every step
    (25 passes here for 1 drafting step)."""
    from hybridrt.bench.spec_sim import SimulatedDrafts, drafts_through, sequences

    llm = LLM(ckpt, dtype="float32", speculative_tokens=2, speculative_adaptive=True,
              max_model_len=128, max_num_seqs=4, cache_memory=32 << 20)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    refs = sequences(llm.generate(prompts[:1], sp, use_tqdm=False, speculative_tokens=0))
    passes = []
    forward = llm.model.mtp_forward
    monkeypatch.setattr(llm.model, "mtp_forward", lambda *a, **kw: passes.append(1) or
                        forward(*a, **kw))
    with drafts_through(llm, SimulatedDrafts(refs, 0.0, llm.config.vocab_size)):
        out = llm.generate(prompts[:1], sp, use_tqdm=False)
    drafting = sum(out[0].metrics["spec"]["k_chosen"][1:])
    assert drafting < 6 and len(passes) <= drafting + 2, (drafting, len(passes))


def test_verification_gets_fp32_logits_in_a_bf16_model(ckpt, prompts, monkeypatch):
    """Plain greedy steps may sample the LM head's bf16 logits (test_engine.py); a step that
    verifies drafts gets fp32 whatever its rows, as the rejection sampler computes in it."""
    import hybridrt.sampled_tokens as chain

    seen = []
    verify = chain.verify_requests

    def spy(sampler, logits, entries):
        seen.append(logits.dtype)
        return verify(sampler, logits, entries)

    monkeypatch.setattr(chain, "verify_requests", spy)
    llm = LLM(ckpt, dtype="bfloat16", speculative_tokens=2, max_model_len=128, max_num_seqs=4,
              cache_memory=32 << 20)
    hot = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=1)
    llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    llm.generate(prompts[2:4], hot, use_tqdm=False)
    assert seen and set(seen) == {torch.float32}
