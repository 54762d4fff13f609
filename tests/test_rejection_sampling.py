"""Rejection sampling of drafts (``specdec.verify``) keeps the target distribution.

Model-free first, the way vLLM tests its rejection sampler: synthetic target and draft
distributions over a small vocabulary, many verify rounds in one call, and at every position of
a round (the bonus token after k accepted drafts included) the emitted tokens are compared with
the exact target distribution by a chi-square test; so is the number of accepted drafts.

The targets do not depend on the tokens before them (row i is one fixed distribution p_i), so
for a correct rule the token at position j of a round that reaches j is distributed as p_j
exactly, and a round accepts draft i with probability sum_v min(p_i, q_i), independently of the
other positions. Each check passes with probability 1 - 1e-6 for a correct rule (the smallest
p-value over these seeds is 5e-3); a rule that draws the bonus token from row k - 1, resamples
from p or q instead of max(p - q, 0), accepts with min(1, q/p) or counts one draft more or fewer
as accepted gave p-values below 1e-15 in some check of every seed and case.

Then on a real model (the demo checkpoint, whose MTP head drafts well): with top-k sampling
every emitted token, the bonus tokens included, is one of the target's own top-k tokens at its
position, as a plain forward over the finished sequence computes them.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PackedRunner, chi2_pvalue

from hybridrt.sampler import Sampler, SamplingRow
from hybridrt.sampling_params import SamplingParams
from hybridrt.specdec.verify import VerifyItem, verify_drafts

V = 8  # vocabulary
K = 3  # drafts per round; position K is the bonus token
ROUNDS = 4000  # per test: at each position thousands of samples, the bonus about a third
MIN_PVALUE = 1e-6


def _target_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """[K + 1, V] target logits and [K, V] draft logits, the same in every test: drafts are the
    targets plus noise. The generator seed is one for which the distributions have the
    properties ``test_the_cases_can_tell_the_rows_and_rules_apart`` asserts."""
    g = torch.Generator().manual_seed(4)
    target = 1.5 * torch.randn(K + 1, V, generator=g)
    draft = target[:K] + 1.2 * torch.randn(K, V, generator=g)
    return target, draft


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row samples from, written out independently of the sampler:
    temperature, then the top_k largest, then the smallest top set holding top_p."""
    z = logits.double() / params.temperature
    if 0 < params.top_k < z.numel():
        kth = z.topk(params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = p.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
        assert (before - params.top_p).abs().min() > 1e-3, "top_p boundary too close to call"
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order[before < params.top_p]] = True
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p


def _sparse(probs: torch.Tensor, n: int) -> torch.Tensor:
    """Each row kept on its n most likely tokens, renormalised."""
    kth = probs.topk(n, dim=-1).values[:, -1:]
    p = torch.where(probs >= kth, probs, 0.0)
    return p / p.sum(-1, keepdim=True)


_OUTSIDE = torch.arange(V) >= 5  # the tokens a reduced draft vocabulary leaves out

# name: (target sampling params, draft distribution from the draft logits)
CASES = {
    "t1": (SamplingParams(temperature=1.0), lambda d: torch.softmax(d.double(), -1)),
    # the target's filtered rows are 0 where the draft is not: those drafts are always rejected
    "t0.8-topk5-topp0.9": (SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
                           lambda d: torch.softmax(d.double() / 0.8, -1)),
    # the draft is 0 where the target is not: only the residual can emit those tokens
    "t1-sparse-draft": (SamplingParams(temperature=1.0),
                        lambda d: _sparse(torch.softmax(d.double(), -1), 3)),
    # a reduced draft vocabulary: the draft is 0 outside tokens 0..4 in every row, where the
    # target has 15-36% of its mass; only the residual max(p - q, 0) can emit tokens 5..7
    "t1-draft-vocab": (SamplingParams(temperature=1.0),
                       lambda d: torch.softmax(d.double().masked_fill(_OUTSIDE, float("-inf")),
                                               -1)),
}


def _run_rounds(case: str, seed: int):
    """-> (exact target probs [K + 1, V], draft probs [K, V], drafts [ROUNDS, K], results)."""
    params, draft_of = CASES[case]
    target_logits, draft_logits = _target_logits()
    p = torch.stack([_reference_probs(row, params) for row in target_logits])
    q = draft_of(draft_logits)
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i].float(), ROUNDS, replacement=True, generator=g)
                          for i in range(K)], dim=1)
    rows = [SamplingRow(params) for _ in range(K + 1)]
    q32 = q.float()
    items = [VerifyItem(rows, d, q32) for d in drafts.tolist()]
    results = verify_drafts(Sampler(seed=seed), target_logits.repeat(ROUNDS, 1), items)
    return p, q, drafts, results


def _acceptance_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact P(a = j), j = 0..K: draft i is accepted with probability sum_v min(p_i, q_i)."""
    alpha = torch.minimum(p[:K], q).sum(-1)
    reach = torch.cat([torch.ones(1, dtype=alpha.dtype), alpha.cumprod(0)])
    return torch.cat([reach[:K] * (1 - alpha), reach[K:]])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_every_position_and_the_bonus_token_follow_the_target(case, seed):
    p, q, drafts, results = _run_rounds(case, seed)
    counts = torch.zeros(K + 1, V, dtype=torch.float64)
    accepted = torch.zeros(K + 1, dtype=torch.float64)
    for d, (emitted, a) in zip(drafts.tolist(), results):
        assert 0 <= a <= K and len(emitted) == a + 1 and emitted[:a] == d[:a], (d, emitted, a)
        accepted[a] += 1
        for j, tok in enumerate(emitted):
            counts[j, tok] += 1
    assert (counts[p == 0] == 0).all(), "a token the target excludes was emitted"
    stat, df, pval = chi2_pvalue(accepted, _acceptance_probs(p, q))
    assert pval > MIN_PVALUE, f"accepted-draft counts {accepted.tolist()}: chi2 {stat:.1f} " \
                              f"(df {df}), p = {pval:.2g}"
    assert accepted[K] > ROUNDS / 10  # the bonus position is well sampled
    for j in range(K + 1):
        stat, df, pval = chi2_pvalue(counts[j], p[j])
        what = "bonus token" if j == K else f"position {j}"
        assert pval > MIN_PVALUE, f"{what}: chi2 {stat:.1f} (df {df}), p = {pval:.2g}"


def test_the_cases_can_tell_the_rows_and_rules_apart():
    """What makes the checks above sensitive: each draft differs from its target, the bonus row
    from the row before it, and the residual max(p - q, 0) from both p and q."""
    for case in CASES:
        params, draft_of = CASES[case]
        target_logits, draft_logits = _target_logits()
        p = torch.stack([_reference_probs(row, params) for row in target_logits])
        q = draft_of(draft_logits)
        tv = 0.5 * (p[:K] - q).abs().sum(-1)
        assert ((tv > 0.2) & (tv < 0.5)).all(), (case, tv)
        assert 0.5 * (p[K] - p[K - 1]).abs().sum() > 0.3, case
        residual = (p[:K] - q).clamp(min=0)
        residual = residual / residual.sum(-1, keepdim=True)
        assert (0.5 * (residual - p[:K]).abs().sum(-1) > 0.2).all(), case


# On a real model ------------------------------------------------------------------------------
TOP_K = 3


DRAFT_VOCAB = 1500  # the demo's first 1500 ids: the reduced draft head's vocabulary


@pytest.fixture(scope="module", params=[None, DRAFT_VOCAB], ids=["full-head", "draft-vocab"])
def demo_spec_llm(request):
    from hybridrt import LLM

    return LLM(dtype="float32", speculative_tokens=K, max_model_len=256, max_num_seqs=8,
               cache_memory=64 << 20, draft_vocab_size=request.param)


def test_top_k_sampling_with_drafts_emits_only_the_targets_top_k(demo_spec_llm, monkeypatch):
    from hybridrt.bench.spec import DEFAULT_QUESTIONS
    from hybridrt.specdec import verify as engine_verify

    llm = demo_spec_llm
    bonus: list[tuple[tuple[int, ...], int]] = []  # (prompt, output index) of bonus tokens
    drafted: set[int] = set()

    def spy(sampler, logits, items):
        drafted.update(t for it in items for t in it.drafts)
        results = verify_drafts(sampler, logits, items)
        for it, (_, a) in zip(items, results):
            if a == len(it.drafts):
                row = it.rows[0]
                bonus.append((tuple(row.prompt_token_ids), len(row.output_token_ids) + a))
        return results

    monkeypatch.setattr(engine_verify, "verify_drafts", spy)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in DEFAULT_QUESTIONS]
    sp = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=40, seed=3, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    checked_bonus = 0
    for o in outs:
        prompt, out = o.prompt_token_ids, o.outputs[0].token_ids
        seq = torch.tensor(prompt + out)
        (logits,) = PackedRunner(llm.model, 1, len(seq), garbage=False).step([(0, seq)])
        rows = logits[len(prompt) - 1:-1]  # row i predicts output token i
        kth = rows.topk(TOP_K, dim=-1).values[:, -1]
        picked = rows.gather(1, torch.tensor(out)[:, None])[:, 0]
        outside = (picked < kth - 1e-4).nonzero().view(-1).tolist()
        assert not outside, f"output tokens {outside} are not in the target's top-{TOP_K}"
        checked_bonus += sum(1 for pr, i in bonus if pr == tuple(prompt) and i < len(out))
    assert checked_bonus >= 10, f"only {checked_bonus} bonus tokens were emitted"
    if llm.draft_vocab_source is not None:  # drafts from the reduced vocabulary only, while
        assert max(drafted) < DRAFT_VOCAB  # the target emitted tokens outside it
        assert any(t >= DRAFT_VOCAB for o in outs for t in o.outputs[0].token_ids)
