"""Adaptive speculation (specdec/adaptive.py): the choice of k from acceptance and step cost,
each request's k from its own acceptance only, and outputs unchanged (greedy: k = 0's tokens)
for every method."""

from __future__ import annotations

import pytest
import torch

from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
from hybridrt.specdec.adaptive import (
    Acceptance,
    Candidate,
    CostModel,
    MeasuredCosts,
    choose_ks,
    expected_gain,
)

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

CFG = tiny_text_config()
VOCAB = CFG["vocab_size"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
CPU = CostModel()


def _cand(alpha, cap=4, ctx=100, mtp=False):
    return Candidate(cap, ctx, [alpha] * cap, [mtp] * cap)


# The choice ---------------------------------------------------------------------------------
def test_expected_gain():
    assert expected_gain([0.5, 0.5, 0.5], 2) == pytest.approx(0.75)
    assert expected_gain([1.0, 0.0, 1.0], 3) == 1.0
    assert expected_gain([0.9], 0) == 0.0


def test_k_rises_with_acceptance_at_batch_one():
    ks = [choose_ks([_cand(a, mtp=True)], 1, CPU)[0] for a in (0.05, 0.2, 0.5, 0.8, 0.95)]
    assert ks[0] == 0 and ks[-1] == 4
    assert ks == sorted(ks), ks


def test_k_falls_to_zero_where_it_cannot_pay():
    """Compute-bound batches (a verified row costs a decode row's arithmetic and gives less
    than a token), a deep context at middling acceptance, and low acceptance: no drafts."""
    for B in (8, 32):
        assert choose_ks([_cand(0.95)] * B, B, CPU) == [0] * B
    assert choose_ks([_cand(0.5, mtp=True, ctx=100)], 1, CPU) != [0]
    assert choose_ks([_cand(0.25, mtp=True, ctx=16384)], 1, CPU) == [0]
    assert choose_ks([_cand(0.1, mtp=True)], 1, CPU) == [0]


def test_choice_is_per_request_and_beats_every_fixed_k():
    """A batch of mixed acceptance: the good request drafts, the bad one does not, and the
    choice's ratio of tokens to cost is at least every fixed k's (the model's own optimum)."""
    gpu = CostModel.for_device("cuda")
    cands = [_cand(0.9), _cand(0.01), _cand(0.6, ctx=8000), _cand(0.3)]
    ks = choose_ks(cands, 4, gpu)
    assert ks[0] == 4 and ks[1] == 0, ks

    def ratio(ks):
        tokens = 4 + sum(expected_gain(c.alphas, k) for c, k in zip(cands, ks))
        ctx = sum((1 + k) * c.context_len for c, k in zip(cands, ks))
        return tokens / gpu.step(4 + sum(ks), ctx, any(ks))

    assert all(ratio(ks) >= ratio([k] * 4) - 1e-12 for k in range(5))


@pytest.mark.parametrize("cost", [
    CPU,
    CostModel(row=0.02, compute_row=0.0, verify=0.09, verify_row=0.01, ctx_row=0.0,
              draft_pass=0.1),
    # 16k deep, as measured there: a verify step's line starts below a plain step's and rises
    # steeply (a fixed cost below zero), drafts dear
    CostModel(row=0.01, compute_row=0.0, verify=-0.06, verify_row=0.14, ctx_row=0.0,
              draft_pass=0.3),
])
def test_the_choice_is_the_best_k_of_all(cost):
    """Against every choice tried by brute force (batch 1 to 3, mixed acceptance): the
    choice's expected tokens per unit of cost are the highest. With a fixed verify cost below
    zero a request whose drafts pay only with it counted drafts (the per-request step alone
    does not see it)."""
    import itertools

    def ratio(cands, ks):
        tokens = len(cands) + sum(expected_gain(c.alphas, k) for c, k in zip(cands, ks))
        ctx = sum((1 + k) * c.context_len for c, k in zip(cands, ks))
        passes = sum(sum(c.mtp[:k]) for c, k in zip(cands, ks))
        return tokens / (cost.step(len(cands) + sum(ks), ctx, any(ks))
                         + cost.draft_pass * passes)

    alphas = [0.05, 0.3, 0.45, 0.5, 0.6, 0.8, 0.95]
    for batch in ([a] for a in alphas):
        cands = [_cand(a, cap=4, ctx=0, mtp=True) for a in batch]
        got = choose_ks(cands, 1, cost)
        want = max(ratio(cands, [k]) for k in range(5))
        assert ratio(cands, got) == pytest.approx(want, rel=1e-12), (batch, got)
    for batch in itertools.product(alphas[::2], repeat=2):
        cands = [_cand(a, cap=3, ctx=0, mtp=True) for a in batch]
        got = choose_ks(cands, 2, cost)
        want = max(ratio(cands, list(ks)) for ks in itertools.product(range(4), repeat=2))
        assert ratio(cands, got) == pytest.approx(want, rel=1e-9), (batch, got)


def test_acceptance_estimate_follows_and_forgets():
    acc = Acceptance()
    assert acc.alpha("ngram") == 0.5
    for _ in range(30):
        acc.observe("ngram", True)
        acc.observe("mtp", False)
    assert acc.alpha("ngram") > 0.9 and acc.alpha("mtp") < 0.1
    low = acc.alpha("mtp")
    for _ in range(10):
        acc.idle()
    assert low < acc.alpha("mtp") < 0.5  # a request drafting nothing tries again later


def _measured(plain=(0.050, 0.001), verify=(0.070, 0.003), draft=0.020, rows=range(1, 9)):
    """MeasuredCosts fed batch-1 steps whose seconds are the lines ``a + b * rows`` given: a
    plain step of ``rows`` sequences, a verify step of one sequence and ``rows - 1`` drafts
    (with a pause among them, which must not count), and drafts of ``draft`` seconds each."""
    m = MeasuredCosts(CPU)
    for r in list(rows) * 3:
        m.observe_step(r, 0, plain[0] + plain[1] * r)
        if r > 1:
            m.observe_step(1, r - 1, verify[0] + verify[1] * r)
    m.observe_step(4, 0, 30.0)  # the engine idle between two calls
    for n in (1, 2, 4):
        m.observe_drafts(n, n * draft)
    return m


def test_measured_costs_fit_the_engines_own_step_times():
    """The fitted model in units of the one-row plain step (51 ms here): sequences 1/51 each,
    a verify step 22 ms over the plain step + 3 ms a draft row, a draft 20 ms; the pause is
    ignored."""
    got = _measured().model()
    assert got.row == pytest.approx(1 / 51, rel=3e-2)  # the pulls move it a little
    assert got.verify == pytest.approx(22 / 51, rel=2e-2)
    assert got.draft_row == pytest.approx(3 / 51, rel=2e-2)
    assert got.draft_pass == pytest.approx(20 / 51, rel=1e-2)
    assert got.step(5, 0, True, 4) * 0.051 == pytest.approx(0.070 + 0.003 * 5, rel=1e-2)
    # one batch size only: the slope is the prior's (scaled), the level the measured one
    flat = MeasuredCosts(CPU)
    for _ in range(10):
        flat.observe_step(4, 0, 0.054)
    assert flat.model().row == pytest.approx(CPU.row, rel=0.05)
    assert MeasuredCosts(CPU).model() == CPU  # nothing measured yet: the prior


def test_k_follows_the_measured_costs():
    """Where drafts cost what the prior says, acceptance 0.6 drafts at batch 1; where the
    measured draft costs 40% of a step (a full-vocabulary head), it does not; where a verify
    step costs what a plain one does and drafts are free, it drafts even at 0.3."""
    cand = [_cand(0.6, mtp=True)]
    assert choose_ks(cand, 1, CPU)[0] > 0
    dear = _measured(draft=0.020).model()
    assert choose_ks(cand, 1, dear) == [0]
    cheap = _measured(verify=(0.050, 0.001), draft=0.0001).model()
    assert choose_ks([_cand(0.3, mtp=True)], 1, cheap)[0] > 0


def test_the_choice_tries_a_few_drafts_before_it_gives_up():
    """The choice's estimate is optimistic by BONUS / sqrt(events + PRIOR): a request whose first
    draft was rejected still drafts where drafts cost about a third of a step (a full
    vocabulary head), and one whose drafts keep being rejected stops."""
    dear = CostModel(draft_pass=0.35, verify=0.05)
    acc = Acceptance()
    picks = []
    for _ in range(6):
        c = Candidate(4, 100, [acc.optimistic("mtp")] * 4, [True] * 4)
        picks.append(choose_ks([c], 1, dear)[0])
        acc.observe("mtp", False)
    assert picks[0] > 0 and picks[1] > 0 and picks[-1] == 0, picks
    assert acc.optimistic("mtp") > acc.alpha("mtp")


def test_a_round_drafts_deeper_only_as_its_drafts_are_accepted():
    """A request tries one MTP draft a round until its drafts are accepted: ``earned`` (one more
    than its decayed accepted drafts) caps its round's MTP drafts, so finding out where drafts
    are rejected costs one draft a round, and a request whose drafts are accepted goes deeper
    round by round; a prompt-lookup prefix is not capped (one MTP draft may extend it)."""
    from types import SimpleNamespace

    from hybridrt.specdec.proposer import SpecProposer
    from hybridrt.specdec.stats import SpecStats

    prop = SpecProposer(256, mtp=SimpleNamespace(probe_head=None, draft_head=None),
                        adaptive=True, cost=CostModel(draft_pass=0.01, verify=0.01))
    plan = SimpleNamespace(seqs=[None])

    def request():
        return SimpleNamespace(spec_stats=SpecStats(4), token_ids=list(range(50)))

    right, wrong, ks_right, ks_wrong = request(), request(), [], []
    for _ in range(5):
        for req, ks, accepted in ((right, ks_right, True), (wrong, ks_wrong, False)):
            (k,), _ = prop._choose(plan, [req], [4], [[]])
            ks.append(k)
            req.spec_stats.proposed(k, 0)
            if k:
                req.spec_stats.record(k, k if accepted else 0)
    assert ks_right == [1, 2, 3, 4, 4], ks_right
    assert max(ks_wrong) == 1, ks_wrong
    assert prop._choose(plan, [request()], [4], [[7, 8]]) == ([3], set())
    acc = Acceptance()
    for ok in (True, True, False):
        acc.observe("mtp", ok)
    assert acc.earned("mtp") == 2 and acc.earned("ngram") == 1  # 1.95 * 0.95 accepted


def test_a_deep_context_is_charged_once():
    """Steps 16k tokens deep, batch 1: a plain step 70 ms, a verify step of 2-5 rows 76, 86,
    97, 107 ms (their attention included), a draft 23 ms. The choice is the k that the measured
    seconds themselves say gives the most tokens a second; charging the context's attention
    again on top of the lines (the prior's ctx_row) would make it draft nothing."""
    m = MeasuredCosts(CPU)
    verify = {2: 0.076, 3: 0.086, 4: 0.097, 5: 0.107}
    for _ in range(6):
        m.observe_step(1, 0, 0.070)
        for rows, secs in verify.items():
            m.observe_step(1, rows - 1, secs)
    m.observe_drafts(1, 0.023)
    cost = m.model()
    for alpha in (0.5, 0.8):
        def rate(k, alpha=alpha):
            return ((1 + expected_gain([alpha] * k, k))
                    / (verify[k + 1] + 0.023 * k if k else 0.070))
        best = max(range(5), key=rate)
        assert best > 0
        assert choose_ks([Candidate(4, 16384, [alpha] * 4, [True] * 4)], 1, cost) == [best]


def test_a_slow_first_verify_step_is_a_pause_and_three_in_a_row_are_not():
    """Batch 1, plain steps of 50 ms: a first verify step of 400 ms (a busy machine; 8 plain
    steps, where the prior's shape says 1.13) is not counted, and the one after it prices
    verification; counted, it priced every draft out (no verify step then came to correct it).
    Verify steps that slow three times in a row are the cost: the third is counted."""
    prior = CostModel(row=0.02, compute_row=0.0, verify=0.11, draft_pass=0.3, probe_pass=0.1)
    m = MeasuredCosts(prior)
    for _ in range(30):
        m.observe_step(1, 0, 0.050)
    m.observe_step(1, 1, 0.400)
    assert m.largest == (1, 0) and m.weights[True] == 0
    m.observe_step(1, 1, 0.051)
    assert m.model().verify < 0.1
    assert choose_ks([Candidate(1, 0, [0.5], [True], probe=True)], 1, m.model()) == [1]
    m = MeasuredCosts(prior)
    for _ in range(30):
        m.observe_step(1, 0, 0.050)
    for _ in range(3):
        m.observe_step(1, 1, 0.400)
    assert m.weights[True] == 1 and m.model().verify > 2


@pytest.mark.parametrize("fixed_k_steps", [False, True])
def test_a_deep_batch_prices_a_draft_row_apart_from_a_sequence(fixed_k_steps):
    """Batch 32, 16k deep (a trace of the engine): a plain step of 1 sequence 47 ms, of 32
    sequences 650 ms (each one's attention over 16k tokens), a draft 28 ms. Before a verify
    step is seen, one of 32 sequences and 1 draft costs the plain step, a draft row at a
    sequence's cost and the prior's verify cost (scaled to the steps seen), so no request
    drafts at acceptance 0.6; once such steps are seen (705 ms), that is what they cost.
    With fixed k = 1 requests in the same engine (verify steps of 32 sequences and 32 drafts,
    1260 ms) the same holds: a draft row is priced from the drafts' own steps, not as a 33rd
    sequence on a line through 64-row steps (such a line put the 33-row step at a third of a
    plain one, and requests drafted: docs/speculation.md)."""
    m = MeasuredCosts(CPU)
    for _ in range(4):
        m.observe_step(1, 0, 0.047)
        for _ in range(8):
            m.observe_step(32, 0, 0.650)
        if fixed_k_steps:
            m.observe_step(32, 32, 1.260)
    m.observe_drafts(1, 0.028)
    slope = (0.650 - 0.047) / 31
    for verified in (False, True):
        cost = m.model()
        unit = m.predict(1)
        assert cost.step(32) * unit == pytest.approx(0.650, rel=1e-3)
        one = cost.step(33, 0, True, 1) * unit
        if verified:
            assert one == pytest.approx(0.705, rel=1e-2)
        elif not fixed_k_steps:  # a draft row at a sequence's cost, the prior's verify cost
            want = 0.650 + slope + CPU.verify * m._unit()
            assert one == pytest.approx(want, rel=1e-2)
        else:  # the fixed-k steps' 610 ms over the plain step for their 32 draft rows
            assert 0.650 + 0.610 / 32 < one < 0.705
            assert cost.step(64, 0, True, 32) * unit == pytest.approx(1.260, rel=1e-2)
        cands = [Candidate(1, 16384, [0.6], [True])] * 32
        assert choose_ks(cands, 32, cost) == [0] * 32
        for _ in range(6):
            m.observe_step(32, 1, 0.705)


def test_a_pass_of_many_rows_is_not_timed_as_drafts():
    """A request's first draft runs its prompt's rows through the MTP layer in the same pass
    (and a lazy request's waiting rows): that pass's time is not what a draft costs, so it is
    not observed; a verify step's few rows are. A probe round's pass (the probe head's, a
    fraction of the full head's bytes) is timed as a probe's, not as a draft's; a pass of both
    kinds as neither."""
    from types import SimpleNamespace

    from hybridrt.specdec.mtp import Drafts
    from hybridrt.specdec.proposer import PASS_ROWS, SpecProposer
    from hybridrt.specdec.stats import SpecStats

    class StubMTP:
        pass_rows = 0
        first_pass = False
        draft_head = probe_head = None

        def propose(self, plan, row_starts, hidden, settled, wanted, probes=frozenset()):
            self.pass_rows = sum(settled)
            return [Drafts(r, [5] * k, None, k=k) for r, (k, _) in wanted.items()]

    class Req(SimpleNamespace):
        __hash__ = object.__hash__

    prop = SpecProposer(256, mtp=StubMTP(), adaptive=True, measure=True,
                        cost=CostModel(draft_pass=0.01, verify=0.01))
    req = Req(spec_k=4, is_finished=False, finish_reason=None, num_output_tokens=0,
                          spec_stats=SpecStats(4), token_ids=list(range(80)),
                          params=SimpleNamespace(max_tokens=None))
    plan = SimpleNamespace(kind="prefill", seqs=[SimpleNamespace(
        request=req, sample=True, num_drafts=0, num_new_tokens=70)])
    assert prop.propose(plan, [0], None, [70])[0].k > 0
    assert prop.measured.drafts == 0  # 70 rows for one drafting request
    prop.propose(plan, [0], None, [PASS_ROWS])
    assert prop.measured.drafts > 0
    before = prop.measured.drafts
    prop.mtp.first_pass = True  # a kind of pass run for the first time: not timed either
    assert prop.propose(plan, [0], None, [1])[0].k > 0
    assert prop.measured.drafts == before
    prop.mtp.first_pass = False  # a probe round (the probe head's draft): a probe's price
    prop.mtp.probe_head = object()
    assert prop.propose(plan, [0], None, [1])[0].k == 1
    assert prop.measured.drafts == before and prop.measured.probes > 0
    # a pass of probes and full drafts together: neither's price
    deep = Req(**{**vars(req), "spec_stats": SpecStats(4)})
    deep.spec_stats.acceptance.accepted["mtp"] = 5.0
    plan.seqs.append(SimpleNamespace(request=deep, sample=True, num_drafts=0, num_new_tokens=1))
    probes = prop.measured.probes
    assert [d.k for d in prop.propose(plan, [0, 1], None, [1, 1])] == [1, 4]
    assert prop.measured.drafts == before and prop.measured.probes == probes


def test_a_step_after_a_prefill_is_not_timed(monkeypatch):
    """The step after one that computed prompt tokens holds its sequences' first decode, which
    costs more whatever it verifies (80 ms against 69 at batch 1): a fresh engine's few verify
    steps come there, and timed they priced verification at +0.8 decode steps, after which no
    request drafted. Neither it nor the prefill is observed; the steps after are."""
    from types import SimpleNamespace

    from hybridrt.specdec.ngram import NgramDrafter
    from hybridrt.specdec.proposer import SpecProposer
    from hybridrt.specdec.stats import SpecStats

    class Req(SimpleNamespace):
        __hash__ = object.__hash__

    import itertools

    import hybridrt.specdec.proposer as proposer_module

    # a clock that moves 1 ms a reading: every step takes the same time, so none is a pause
    ticks = itertools.count()
    monkeypatch.setattr(proposer_module.time, "perf_counter", lambda: next(ticks) / 1000)
    prop = SpecProposer(256, ngram=NgramDrafter(1, 2), adaptive=True, measure=True)
    req = Req(spec_k=2, is_finished=False, finish_reason=None, num_output_tokens=0,
              spec_stats=SpecStats(2), token_ids=[5, 6, 5, 6, 5], prompt_token_ids=[5, 6],
              params=SimpleNamespace(max_tokens=None), request_id="r")

    def step(kind, drafts):
        plan = SimpleNamespace(kind=kind, seqs=[SimpleNamespace(
            request=req, sample=True, num_drafts=drafts, num_new_tokens=1 + drafts)])
        prop.propose(plan, [0], None, [1])

    weights = lambda: dict(prop.measured.weights)  # noqa: E731
    step("prefill", 0)
    step("verify", 1)  # the first decode after the prompt: not timed
    assert weights() == {False: 0.0, True: 0.0}
    step("verify", 1)
    assert weights() == {False: 0.0, True: 1.0}
    step("decode", 0)
    assert weights() == {False: 1.0, True: 0.97}  # each step weighs 0.97 of the next
    assert prop.measured.largest == (1, 1)  # a verify step: 1 sequence, 1 draft (2 rows)


def test_first_pass_marks_each_kind_of_mtp_pass_once(ckpt):
    """``MTPProposer.first_pass``: set by the propose that runs a kind of pass (KV only, or
    drafting) for the first time, whose kernels set themselves up then (a first draft measured
    0.77 decode steps against 0.37: priced so, drafting stopped before a warm draft corrected
    it), and by no other."""
    llm = _llm(ckpt, 2, enable_prefix_caching=True)  # fixed k: the MTP drafts every step
    mtp = llm.engine.proposer
    inner, seen = mtp.model.mtp_forward, []

    def forward(*a, kv_only=False, **kw):
        seen.append(kv_only)
        return inner(*a, kv_only=kv_only, **kw)

    mtp.model.mtp_forward = forward
    outer, log = mtp.propose, []

    def propose(*a, **kw):
        seen.clear()
        out = outer(*a, **kw)
        log.append((set(seen), mtp.first_pass))
        return out

    mtp.propose = propose
    llm.generate(_prompts()[:3], GREEDY, use_tqdm=False)
    ran, firsts = set(), 0
    for kinds, first in log:
        assert first == bool(kinds - ran), (kinds, ran)
        ran |= kinds
        firsts += first
    assert ran == {True, False} and firsts in (1, 2)


# The engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("adaptive"), CFG, seed=3)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 9)]
    return ([b * 3 + b[:2] for b in base]
            + [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 33, 70)])


def _llm(ckpt, k=0, **kw):
    return LLM(ckpt, dtype="float32", speculative_tokens=k, max_model_len=256, max_num_seqs=8,
               cache_memory=32 << 20, **kw)


@pytest.fixture(scope="module")
def reference(ckpt):
    outs = _llm(ckpt).generate(_prompts(), GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(_prompts(), outs)}


@pytest.mark.parametrize("method", ["ngram", "mtp", "mtp+ngram"])
def test_adaptive_greedy_equals_no_speculation(ckpt, reference, method):
    llm = _llm(ckpt, 4, speculative_method=method, speculative_adaptive=True,
               prompt_lookup_min=1, max_num_batched_tokens=32)
    # the prior's costs: the choices then do not depend on the machine's load (measured, a
    # loaded machine's step times could stop all drafting, and the test would check nothing)
    llm.engine.proposer.measured = None
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in _prompts()]
    spec = llm.engine.spec_stats
    assert spec.num_draft_tokens > 0 and spec.k_chosen[0] > 0  # drafted, and chose 0 too
    assert llm.engine.cache.all_free()


def test_each_request_k_follows_its_own_acceptance(ckpt):
    """Two requests side by side: A's drafts are always right, B's always wrong. A's k stays
    at its maximum; B's falls to 0 after its first rounds, probing with a draft or two now and
    then (a row costs little beside A's verification). Reading the other's acceptance (or the
    batch's) breaks one of the two."""
    k = 4
    llm = _llm(ckpt, k, speculative_method="ngram", speculative_adaptive=True)
    prompts = _prompts()
    a_prompt, b_prompt = prompts[2], prompts[4]
    ref = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in _llm(ckpt).generate(
        [a_prompt, b_prompt], SamplingParams(temperature=0, max_tokens=150, ignore_eos=True),
        use_tqdm=False)}

    def drafts(req, cap):
        r = ref[tuple(req.prompt_token_ids)]
        o = req.num_output_tokens
        d = (r[o:o + cap] + [3] * cap)[:cap]
        return d if req.prompt_token_ids == a_prompt else [(t + 1) % VOCAB for t in d]

    llm.engine.proposer.ngram.drafts = drafts
    llm.engine.proposer.measured = None  # the prior's costs: this test is about acceptance
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (150, 60)]
    a, b = llm.generate([a_prompt, b_prompt], params, use_tqdm=False)
    assert a.outputs[0].token_ids == ref[tuple(a_prompt)]
    assert b.outputs[0].token_ids == ref[tuple(b_prompt)][:60]
    ka, kb = a.metrics["spec"]["k_chosen"], b.metrics["spec"]["k_chosen"]
    assert ka[k] >= 0.8 * sum(ka), ka
    # its first rounds optimistic (the prior's 1/2 fades over a few rejections), then fewer
    assert kb[0] >= 0.3 * sum(kb) and kb[3] + kb[4] <= 6, kb
    assert b.metrics["spec"]["mean_k_chosen"] < 1.0
    assert a.metrics["spec"]["acceptance_rate"] == 1.0
    assert b.metrics["spec"]["num_accepted"] == 0


def test_fixed_k_stays_the_default(ckpt):
    """Without speculative_adaptive a request drafts its k every step MTP drafts (k_chosen
    has no other entry)."""
    llm = _llm(ckpt, 3)
    (out,) = llm.generate([_prompts()[3]], GREEDY, use_tqdm=False)
    kc = out.metrics["spec"]["k_chosen"]
    assert sum(kc[:3]) <= 2 and kc[3] > 0, kc  # only max_tokens' end cuts it


# Lazy MTP rows ------------------------------------------------------------------------------
def _scheduled_run(ckpt, lazy: bool, prompts, caching: bool):
    """Adaptive MTP whose k follows a fixed schedule of the position (2 every 7th, else 0):
    -> (each drafting step's (prompt, position, drafts), the MTP passes run, the outputs)."""
    llm = _llm(ckpt, 2, speculative_adaptive=True, enable_prefix_caching=caching)
    prop = llm.engine.proposer
    prop.mtp.lazy = lazy
    prop._choose = lambda plan, reqs, caps, prefixes: ([
        min(cap, 2 if len(r.token_ids) % 7 == 0 else 0) for r, cap in zip(reqs, caps)], set())
    seen, passes = [], []
    propose, forward = prop.propose, llm.model.mtp_forward

    def spy_propose(plan, *a):
        out = propose(plan, *a)
        seen.extend((tuple(d.request.prompt_token_ids), len(d.request.token_ids),
                     tuple(d.token_ids)) for d in out if d.token_ids)
        return out

    def spy_forward(ids, *a, **k):
        passes.append(len(ids))
        return forward(ids, *a, **k)

    prop.propose, llm.model.mtp_forward = spy_propose, spy_forward
    outs = []
    for p in prompts:  # one after another: a later prompt may resume from an earlier one
        outs += llm.generate([p], GREEDY, use_tqdm=False)
    return seen, passes, outs


@pytest.mark.parametrize("caching", [False, True])
def test_steps_without_drafts_run_no_mtp_pass_and_drafts_stay_the_same(ckpt, reference, caching):
    """With adaptive k, a step where a request drafts nothing runs no MTP pass: its rows wait
    and run with the next drafting step (or at its end), writing the same MTP KV, so every
    draft is the one an MTP pass per step gives (dropping the waiting rows, or running them
    at the wrong positions, changes the drafts). With prefix caching a later request resumes
    from the first one's blocks, their MTP KV complete."""
    p = _prompts()[4]
    prompts = [p, p + reference[tuple(p)][:20]]
    eager, eager_passes, eager_outs = _scheduled_run(ckpt, False, prompts, caching)
    lazy, lazy_passes, lazy_outs = _scheduled_run(ckpt, True, prompts, caching)
    assert [o.outputs[0].token_ids for o in lazy_outs] == [
        o.outputs[0].token_ids for o in eager_outs]
    assert len(eager) >= 8 and lazy == eager
    # a drafting step runs up to three passes (the waiting rows' KV, its last row, its second
    # draft, which reads the first); besides, rows run where a checkpoint is saved (prefix
    # caching: a prompt's last token, its end)
    assert len(lazy_passes) <= 3 * len(lazy) + 4 * len(prompts), lazy_passes
    assert len(eager_passes) - len(lazy_passes) >= 40, (eager_passes, lazy_passes)
    # the same rows in fewer passes; without prefix caching rows still waiting at a request's
    # end are not needed and never run
    assert (sum(lazy_passes) == sum(eager_passes) if caching
            else sum(eager_passes) - 8 < sum(lazy_passes) < sum(eager_passes))
    if caching:  # the second prompt resumes from the first's checkpoint before its last token
        assert lazy_outs[1].metrics["num_cached_tokens"] == eager_outs[1].metrics[
            "num_cached_tokens"] == len(p) - 1


def test_constants_keep_finding_out_cheap_and_drafting_where_it_pays():
    """On drawn acceptance at the 0.8B shape's costs (a full-vocabulary MTP head: a draft
    about 0.38 of a step), 48-token requests: adaptive k loses at most 2.5% to k = 0 where
    drafts do not pay (alpha 0.2) and at most 5% to the best fixed k where they do (0.8)."""
    from hybridrt.bench.adaptive_sim import fixed, run

    cost = CostModel(row=0.02, compute_row=0.0, verify=0.07, draft_pass=0.38)
    low = run(lambda n: 0.2, 48, 200, cost) / fixed(0.2, cost)[0]
    high = run(lambda n: 0.8, 48, 200, cost) / max(fixed(0.8, cost))
    assert low >= 0.975 and high >= 0.95, (low, high)


def test_probes_make_finding_out_cheaper():
    """``adaptive_sim`` with probes (a round of one draft through the probe head, priced at its
    0.10 of a step measured on the 0.8B shape, against the full head's 0.37). At the costs
    measured at batch 1 (a verify step of 2 rows about a plain one's) a probe round pays at
    alpha 0.2: adaptive k gains over 10% where without probes it loses 3%, and at alpha 0.8
    it beats the best fixed k by over 15%. At the prior's verify cost (0.11) one draft pays at no
    alpha under about 0.25 even through the probe head: at alpha 0.2 adaptive k stays within
    2.5% of k = 0, with probes or without."""
    from hybridrt.bench.adaptive_sim import fixed, run

    measured = CostModel(row=0.02, compute_row=0.0, verify=-0.05, draft_pass=0.37)
    low = [run(lambda n: 0.2, 48, 400, measured, probe=p) / fixed(0.2, measured)[0]
           for p in (None, 0.10)]
    assert low[0] < 0.975 and low[1] > 1.10, low
    high = run(lambda n: 0.8, 48, 400, measured, probe=0.10) / max(fixed(0.8, measured))
    assert high > 1.15, high
    prior = CostModel(row=0.02, compute_row=0.0, verify=0.11, draft_pass=0.37)
    low = [run(lambda n: 0.2, 48, 400, prior, probe=p) / fixed(0.2, prior)[0]
           for p in (None, 0.10)]
    assert min(low) >= 0.975, low


def _mtp_and_step_bytes(net) -> tuple[int, int]:
    """The MTP layer's parameter bytes, and a decode step's (every other parameter)."""
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    return (size(net.mtp.parameters()),
            size(p for n, p in net.named_parameters() if not n.startswith("mtp.")))


@pytest.mark.parametrize("vocab", [None, 64])
def test_a_draft_pass_is_priced_at_its_bytes(ckpt, vocab):
    """Before any draft is timed, a draft pass costs its weights' bytes over a decode step's:
    the MTP layer and the head it drafts through (the model's, or the draft vocabulary's
    copy) against every decoder weight and the head, each counted once."""
    llm = _llm(ckpt, 2, speculative_adaptive=True, draft_vocab_size=vocab)
    net = llm.model
    mtp, step = _mtp_and_step_bytes(net)
    assert net.lm_head is None  # tied: the embedding is the head, read once a step
    head = net.model.embed_tokens.weight
    if vocab is None:
        want = (mtp + head.numel() * head.element_size()) / step
    else:
        w = llm.engine.proposer.mtp.draft_head.weight
        assert w.nbytes < head.numel() * head.element_size() * vocab / VOCAB  # int8 rows
        want = (mtp + w.nbytes) / step
    assert llm.engine.proposer.cost.draft_pass == pytest.approx(want)
    assert llm.engine.proposer.measured.drafts == 0  # the prior, not a timing


# Probes -------------------------------------------------------------------------------------
def test_a_probe_is_priced_at_its_bytes(ckpt):
    """Before a probe is timed, a probe round's pass costs the MTP layer's and the probe head's
    bytes over a decode step's (as a draft pass costs its head's); without a probe head there
    is no probe price."""
    from hybridrt.specdec.proposer import build_proposer

    llm = _llm(ckpt, 2, speculative_adaptive=True)
    eng = llm.engine
    assert eng.proposer.cost.probe_pass is None
    prop = build_proposer(eng.engine_config, llm.model, eng.cache, eng.sampler,
                          probe_vocab=[3, 5, 7])
    mtp = prop.mtp
    assert mtp.probe_head is not None and mtp.draft_head is None
    size, step = _mtp_and_step_bytes(llm.model)
    want = (size + mtp.probe_head.weight.nbytes) / step
    assert prop.cost.probe_pass == pytest.approx(want)
    assert prop.measured.model().probe_pass == pytest.approx(want)
    assert prop.cost.probe_pass < prop.cost.draft_pass


def test_a_probe_round_is_one_mtp_draft_priced_at_the_probe_head():
    """``Candidate.probe_round``, the rule the proposer and ``adaptive_sim`` share: a round of
    one MTP draft of a request with a probe head; not a deeper round, not one whose draft is
    prompt lookup's. The choice prices it at ``probe_pass``: at batch 1, alpha 0.2, a verify
    step of 2 rows costing a plain one's, one draft through the full head (0.37) loses and
    through the probe head (0.10) gains; without a probe head, or without a probe price, the
    round is a full draft's."""
    cand = Candidate(2, 0, [0.2, 0.2], [True, True], probe=True)
    assert cand.probe_round(1) and not cand.probe_round(2) and not cand.probe_round(0)
    assert not Candidate(2, 0, [0.9, 0.2], [False, True], probe=True).probe_round(1)
    assert not Candidate(2, 0, [0.2, 0.2], [True, True]).probe_round(1)
    cost = CostModel(row=0.02, compute_row=0.0, verify=-0.03, draft_pass=0.37, draft_row=0.02,
                     probe_pass=0.10)
    assert cand.pass_cost(1, cost) == 0.10 and cand.pass_cost(2, cost) == pytest.approx(0.74)
    assert choose_ks([cand], 1, cost) == [1]
    assert choose_ks([Candidate(2, 0, [0.2, 0.2], [True, True])], 1, cost) == [0]
    assert choose_ks([cand], 1, CostModel(row=0.02, compute_row=0.0, verify=-0.03,
                                          draft_pass=0.37, draft_row=0.02)) == [0]
    # in a batch: each request's probe round priced apart
    two = [cand, Candidate(2, 0, [0.2, 0.2], [True, True])]
    assert choose_ks(two, 2, cost) == [1, 0]


def test_a_probe_is_priced_at_its_measured_time():
    """``MeasuredCosts.observe_probes``: a probe's pass in units of the fitted one-row step,
    the prior's until one is timed; a model without a probe price keeps none."""
    m = MeasuredCosts(CostModel(draft_pass=0.3, probe_pass=0.2))
    for _ in range(5):
        m.observe_step(1, 0, 0.050)
    assert m.model().probe_pass == 0.2
    m.observe_probes(1, 0.006)
    m.observe_probes(1, 0.006)
    got = m.model()
    assert got.probe_pass == pytest.approx(0.006 / m.predict(1), rel=1e-6)
    assert got.draft_pass == 0.3
    m = MeasuredCosts(CostModel(draft_pass=0.3))
    m.observe_step(1, 0, 0.050)
    m.observe_probes(1, 0.006)
    assert m.model().probe_pass is None


@pytest.mark.parametrize("right", [False, True])
def test_a_round_of_one_draft_drafts_through_the_probe_head(ckpt, reference, right):
    """Adaptive k with a probe head (``MTPProposer.probe_head``: a 248k vocabulary gets one of
    its ``PROBE_VOCAB`` most frequent ids; this tiny one is given one of a single id, X): a
    round of one draft drafts it through the probe head (X), a deeper round through the full
    head (the MTP's argmax). Drafts always wrong (X never in the output): no draft is accepted,
    every round is one draft, every draft X. Drafts made right (a filter after the head, as
    ``bench spec --simulate-acceptance`` does): accepted drafts earn deeper rounds, whose
    drafts are the full head's. The output is k = 0's either way."""
    from hybridrt.specdec.mtp import DraftHead

    llm = _llm(ckpt, 3, speculative_adaptive=True)
    prop = llm.engine.proposer
    prompts = _prompts()[2:5]
    used = {t for p in prompts for t in reference[tuple(p)]}
    x = min(set(range(3, VOCAB)) - used)
    prop.mtp.probe_head = DraftHead(llm.model, [x])
    prop.measured = None  # the prior's costs, drafts cheap: this test is about the heads
    prop.cost = CostModel(draft_pass=0.01, verify=0.01)
    rounds, seen = {}, []  # request -> (k, probe) of the round being drafted; the drafts
    propose = prop.mtp.propose

    def traced(plan, row_starts, hidden, settled, wanted=None, probes=frozenset()):
        rounds.clear()
        rounds.update({r: (k, r in probes) for r, (k, _) in (wanted or {}).items()})
        return propose(plan, row_starts, hidden, settled, wanted, probes)

    def draft_filter(req, j, tok):
        assert (prop.mtp.drafting_head is prop.mtp.probe_head) == rounds[req][1]
        seen.append((*rounds[req], tok))
        out = reference[tuple(req.prompt_token_ids)]
        o = req.num_output_tokens + j
        return out[o] if right and o < len(out) else tok

    prop.mtp.propose = traced
    prop.mtp.draft_filter = draft_filter
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    assert seen and all(probe == (k == 1) for k, probe, _ in seen), seen
    assert all(tok == x for k, _, tok in seen if k == 1), seen
    deep = [tok for k, _, tok in seen if k > 1]
    if right:
        assert deep and all(tok != x for tok in deep), seen
    else:
        assert not deep
