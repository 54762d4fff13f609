"""Simulated acceptance for ``hybridrt bench spec`` (its module docstring): the MTP's drafts
replaced by the target's own greedy continuation with probability alpha, at the MTP's real
cost, whichever proposer the engine runs (fixed-k MTP, or a ``SpecProposer``'s MTP: adaptive
k and MTP + n-gram, whose lookup drafts stay as they are)."""

from __future__ import annotations

import contextlib
import random

from hybridrt.specdec.mtp import MTPProposer


def mtp_of(proposer):
    """The engine proposer's MTP layer drafter (None: it has none)."""
    return proposer if isinstance(proposer, MTPProposer) or proposer is None else proposer.mtp


class SimulatedDrafts:
    """A ``draft_filter`` (``specdec.mtp``): draft j of a request becomes the reference
    continuation's token at that position with probability ``alpha``, else a token that
    differs from it. ``refs``: prompt ids -> prompt + a greedy output. Where the request has
    left its reference (or run past its end) the MTP's own token stays; ``coverage`` is the
    fraction of drafts that had a reference token.

    Each request draws from its own stream, seeded by ``seed`` and its prompt: its draws do
    not depend on how many drafts the requests before it made, and a benchmark's repeats pass
    other seeds. ``probe_factor``: a draft through the MTP's probe head (adaptive k's one-draft
    rounds) is right with ``probe_factor`` alpha: the probe head drafts from fewer tokens, and
    on real weights misses some of the full head's right drafts.
    (With one stream seeded alike in every run, each run replayed the same draws:
    a row that drafts a dozen times a run, adaptive k at a low alpha, saw the same dozen in
    every repeat, whose first two are over 0.75 for seed 0: it accepted none at alpha 0.2 and
    37% at 0.5.)"""

    def __init__(self, refs: dict[tuple, list[int]], alpha: float, vocab_size: int,
                 seed: int = 0, probe_factor: float = 1.0):
        self.refs, self.alpha, self.vocab_size, self.seed = refs, alpha, vocab_size, seed
        self.probe_factor = probe_factor
        self.drafter: MTPProposer | None = None  # the MTP drafting (set by ``drafts_through``)
        self.streams: dict[tuple, random.Random] = {}
        self.num_drafts = self.num_known = self.num_right = 0

    def __call__(self, req, j: int, token: int) -> int:
        prompt = tuple(req.prompt_token_ids)
        ref = self.refs.get(prompt)
        n = len(req.token_ids)
        self.num_drafts += 1
        if ref is None or n + j >= len(ref) or ref[:n] != req.token_ids:
            return token
        self.num_known += 1
        rng = self.streams.get(prompt)
        if rng is None:  # int hashes are not salted: the same stream in every process
            rng = self.streams[prompt] = random.Random(hash((self.seed, prompt)))
        right = ref[n + j]
        d = self.drafter
        probe = d is not None and d.probe_head is not None and d.drafting_head is d.probe_head
        if rng.random() < self.alpha * (self.probe_factor if probe else 1.0):
            self.num_right += 1
            return right
        return (right + 1) % self.vocab_size

    @property
    def coverage(self) -> float | None:
        return self.num_known / self.num_drafts if self.num_drafts else None


def sequences(outs) -> dict[tuple, list[int]]:
    return {tuple(o.prompt_token_ids): o.prompt_token_ids + o.outputs[0].token_ids
            for o in outs}


def reference_run(llm, prompts, params, b: int, k: int, k0_refs) -> dict[tuple, list[int]]:
    """The greedy continuations a k-draft run produces, for simulated acceptance: an untimed
    run at k whose drafts are all wrong. In half precision a verify step's numerics differ
    from a 1-token step's, so near-tied greedy choices can differ from k = 0's; every step of
    this run verifies k + 1 rows per request as the simulated runs do, so theirs match it."""
    outs = []
    with drafts_through(llm, SimulatedDrafts(k0_refs, 0.0, llm.config.vocab_size)):
        for i in range(0, len(prompts), b):
            outs += llm.generate(prompts[i:i + b], params, use_tqdm=False,
                                 speculative_tokens=k)
    return sequences(outs)


@contextlib.contextmanager
def drafts_through(llm, draft_filter: SimulatedDrafts | None):
    """For the ``with`` block, the engine's MTP drafter replaced by one whose drafts pass
    through ``draft_filter`` (``specdec.mtp``'s extension point), with the same model, cache,
    sampler, draft head and settings (``keep_kv``, ``lazy``: adaptive k's steps without drafts
    run no MTP pass, simulated or not); nothing changes when it is None or the engine has no
    MTP."""
    engine = llm.engine
    own = mtp_of(engine.proposer)
    if draft_filter is None or own is None:
        yield
        return
    filtered = MTPProposer(own.model, own.cache, own.sampler, own.max_model_len, own.device,
                           draft_filter=draft_filter, keep_kv=own.keep_kv, lazy=own.lazy)
    filtered.draft_head, filtered.probe_head = own.draft_head, own.probe_head
    draft_filter.drafter = filtered
    outer = engine.proposer
    if outer is own:
        engine.proposer = filtered
    else:
        outer.mtp = filtered
    try:
        yield
    finally:
        if outer is own:
            engine.proposer = own
        else:
            outer.mtp = own
