"""The engine's drafter for every speculative method but fixed-k MTP (which is ``MTPProposer``
alone): which requests draft after a step, how many drafts, and from which source.

| method | drafts |
| --- | --- |
| ``mtp`` | the MTP layer (``specdec.mtp``) |
| ``ngram`` | prompt lookup (``specdec.ngram``): as many as the match gives, up to k, maybe none |
| ``mtp+ngram`` | prompt lookup's match (up to the context's end) extended to k by the MTP |

(``mtp+ngram`` without a match: the MTP alone.)

k is ``speculative_tokens`` (the request's ``spec_k``) capped by the context and
``max_tokens``; with ``adaptive`` it is chosen per request each step (``specdec.adaptive``),
spec_k being its maximum. The drafts go to the requests through the update step
(``Drafts``); a request that drafts nothing verifies nothing and its next step is a plain
decode from its current state slot (the same verify and rollback path either way).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from hybridrt.step_plan import StepPlan

from .adaptive import Candidate, CostModel, MeasuredCosts, choose_ks
from .methods import uses_mtp
from .mtp import DraftHead, Drafts, MTPProposer, draft_cap
from .ngram import NgramDrafter

PASS_ROWS = 8  # MTP input rows per drafting request past which a pass is not timed as drafts


def build_proposer(args, model, cache, sampler, draft_vocab: list[int] | None = None,
                   probe_vocab: list[int] | None = None):
    """The engine's proposer for ``args`` (resolved ``EngineArgs``): None without
    speculation, ``MTPProposer`` for fixed-k MTP, else a ``SpecProposer``; ``probe_vocab``:
    the ids of adaptive k's probe head (``specdec.draft_vocab.draft_vocabs``)."""
    if args.speculative_tokens == 0:
        return None
    sources = args.speculative_method.split("+")
    mtp = None
    if uses_mtp(args.speculative_method):
        fixed = sources == ["mtp"] and not args.speculative_adaptive
        mtp = MTPProposer(model, cache, sampler, args.max_model_len, args.device,
                          draft_vocab=draft_vocab, keep_kv=cache.prefix_caching,
                          lazy=not fixed)
        if fixed:
            return mtp
        if probe_vocab is not None and draft_vocab is None:
            mtp.probe_head = DraftHead(model, probe_vocab)
    ngram = (NgramDrafter(args.prompt_lookup_min, args.prompt_lookup_max, extend=mtp is None)
             if "ngram" in sources else None)
    cost = CostModel.for_device(args.device)
    if mtp is not None:  # a draft pass's prior: its bytes against a decode step's (batch 1
        # reads its weights: the full head's pass is several times the reduced one's)
        cost = replace(cost, draft_pass=mtp.draft_bytes() / model.bytes_read())
        if mtp.probe_head is not None:
            cost = replace(cost, probe_pass=mtp.draft_bytes(mtp.probe_head) / model.bytes_read())
    return SpecProposer(args.max_model_len, mtp, ngram, args.speculative_adaptive, cost,
                        measure=args.speculative_adaptive and not args.batch_invariant)


class SpecProposer:
    def __init__(self, max_model_len: int, mtp: MTPProposer | None = None,
                 ngram: NgramDrafter | None = None, adaptive: bool = False,
                 cost: CostModel | None = None, measure: bool = False):
        if mtp is None and ngram is None:
            raise ValueError("a speculative proposer needs the MTP layer or prompt lookup")
        self.max_model_len = max_model_len
        self.mtp = mtp
        self.ngram = ngram
        self.adaptive = adaptive
        self.cost = cost or CostModel()
        # adaptive k from the engine's own step times (specdec.adaptive.MeasuredCosts)
        self.measured = MeasuredCosts(self.cost) if measure else None
        self._drafted_at: float | None = None  # when the last drafting ended
        # the last step computed prompt tokens: the next one holds its sequences' first decode,
        # which costs more whatever it verifies (docs/speculation.md), and is not timed
        self._after_prefill = False

    def num_drafts_for(self, req) -> int:
        return draft_cap(req, self.max_model_len)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, row_starts: list[int], hidden: torch.Tensor,
                settled: list[int]) -> list[Drafts]:
        """As ``MTPProposer.propose``: the next drafts of the requests that sampled."""
        start = time.perf_counter()
        if (self.measured is not None and self._drafted_at is not None
                and plan.kind != "prefill" and not self._after_prefill):
            self.measured.observe_step(len(plan.seqs), sum(s.num_drafts for s in plan.seqs),
                                       start - self._drafted_at)
        reqs, caps, prefixes = [], [], []
        for b, s in enumerate(plan.seqs):
            req = s.request
            if (req.spec_k == 0 or req.is_finished or req.finish_reason is not None
                    or settled[b] == 0 or not (s.sample or s.num_drafts > 0)):
                continue
            cap = self.num_drafts_for(req)
            if cap == 0:
                continue
            reqs.append(req)
            caps.append(cap)
            prefixes.append(self.ngram.drafts(req, cap) if self.ngram is not None else [])
        if self.ngram is not None:
            self.ngram.prune()
        ks, probes = self._choose(plan, reqs, caps, prefixes)
        wanted = {r: (k, p[:k]) for r, k, p in zip(reqs, ks, prefixes) if k > len(p)}
        out = {}
        if self.mtp is not None:
            t = time.perf_counter()
            out = {d.request: d for d in self.mtp.propose(plan, row_starts, hidden, settled,
                                                          wanted, probes)}
            if (self.measured is not None and not self.mtp.first_pass
                    and self.mtp.pass_rows <= PASS_ROWS * len(out)):
                # a pass of one head's drafts only: probes, or full drafts
                if probes and len(probes) == len(out):
                    self.measured.observe_probes(len(probes), time.perf_counter() - t)
                elif not probes:
                    self.measured.observe_drafts(
                        sum(len(d.token_ids) - d.num_ngram for d in out.values()),
                        time.perf_counter() - t)
        self._drafted_at = time.perf_counter()
        self._after_prefill = plan.kind == "prefill"
        return [out[r] if r in out else Drafts(r, p[:k], None, num_ngram=min(k, len(p)), k=k)
                for r, k, p in zip(reqs, ks, prefixes)]

    def _choose(self, plan: StepPlan, reqs: list, caps: list[int],
                prefixes: list[list[int]]) -> tuple[list[int], set]:
        """k per drafting request: fixed (the cap; prompt lookup alone: what its match gives)
        or adaptive; and the requests whose round goes through the MTP's probe head (adaptive
        k, where there is one and the MTP has no reduced head already:
        ``Candidate.probe_round``)."""
        limits = [cap if self.mtp is not None else len(p) for cap, p in zip(caps, prefixes)]
        if not self.adaptive:
            return limits, set()
        probe = (self.mtp is not None and self.mtp.probe_head is not None
                 and self.mtp.draft_head is None)
        cands = []
        for req, limit, p in zip(reqs, limits, prefixes):
            acc = req.spec_stats.acceptance
            limit = min(limit, len(p) + acc.earned("mtp"))
            mtp = [j >= len(p) for j in range(limit)]
            alphas = [acc.optimistic("mtp" if m else "ngram") for m in mtp]
            cands.append(Candidate(limit, len(req.token_ids), alphas, mtp, probe))
        cost = self.cost if self.measured is None else self.measured.model()
        ks = choose_ks(cands, len(plan.seqs), cost)
        return ks, {r for r, c, k in zip(reqs, cands, ks) if c.probe_round(k)}
