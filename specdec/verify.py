"""Draft verification: greedy matching and lossless rejection sampling.

Each verifying request brings k drafts and the target's logits at its k + 1 positions
(``[last token, d1..dk]`` were fed, so row i scores the token after d_i). Greedy requests accept
while d_{i+1} equals the target argmax; the target's own choice follows the accepted run.
Random requests accept d_{i+1} with probability min(1, p(d)/q(d)); on the first rejection a
token is drawn from normalize(max(p - q, 0)); if all k are accepted a bonus token is drawn from
the target at the last position. The emitted tokens are then distributed exactly as the target.
A random request without draft probabilities drafted point masses (prompt lookup, q = 1 at
the draft): d is accepted with probability p(d), and a rejection samples p with d removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrt.sampler import Sampler, SamplingRow, argmax_rows, plain_greedy


@dataclass(slots=True)
class VerifyItem:
    rows: list[SamplingRow]  # k + 1 rows: position i's row sees the drafts before it
    drafts: list[int]
    draft_probs: torch.Tensor | None  # [k, V] the drafts were sampled from (None: greedy,
    # or point masses)


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) for the draft tokens (q > 0 for any token that was actually drafted)."""
    return torch.where(q_draft > 0, (p_draft / q_draft).clamp(max=1.0), (p_draft > 0).float())


def verify_drafts(sampler: Sampler, logits: torch.Tensor, items: list[VerifyItem]
                  ) -> list[tuple[list[int], int]]:
    """logits: [sum(k_i + 1), V] target rows, item after item -> per item (emitted tokens,
    number of drafts accepted); emitted = accepted drafts + one target token."""
    rows = [r for it in items for r in it.rows]
    if plain_greedy(rows):  # the argmax of the logits as they are
        argmax = argmax_rows(logits).tolist()
        prepared = probs = None
    else:
        prepared = sampler.processed_logits(logits, rows)
        random_items = [i for i, it in enumerate(items) if not it.rows[0].params.greedy]
        probs = sampler.probs(prepared, rows) if random_items else None
        argmax = None
    out: list[tuple[list[int], int]] = []
    r = 0
    for it in items:
        k = len(it.drafts)
        if sampler.positional and it.rows[0].generator is not None:
            out.append(_coupled(sampler, probs[r:r + k + 1], it))
        elif it.rows[0].params.greedy:
            target = (argmax[r:r + k + 1] if argmax is not None
                      else prepared[r:r + k + 1].argmax(dim=-1).tolist())
            a = 0
            while a < k and it.drafts[a] == target[a]:
                a += 1
            out.append((it.drafts[:a] + [target[a]], a))
        else:
            out.append(_rejection_sample(sampler, probs[r:r + k + 1], it))
        r += k + 1
    return out


def _coupled(sampler: Sampler, p: torch.Tensor, it: VerifyItem) -> tuple[list[int], int]:
    """Seeded rows of a positional sampler (batch-invariant mode): each position's token is
    the one its own uniform picks from the target distribution, what sampling it without
    drafts gives, and a draft is accepted where it is that token (lossless: the emitted tokens
    are the target's samples; the MTP drafts with the same uniforms, so a close draft
    distribution picks the same tokens)."""
    x = sampler.sample_from_probs(p, it.rows).tolist()
    a = 0
    while a < len(it.drafts) and it.drafts[a] == x[a]:
        a += 1
    return it.drafts[:a] + [x[a]], a


def _rejection_sample(sampler: Sampler, p: torch.Tensor, it: VerifyItem) -> tuple[list[int], int]:
    k = len(it.drafts)
    d = torch.tensor(it.drafts, device=p.device)
    idx = torch.arange(k, device=p.device)
    if it.draft_probs is None:  # point masses at the drafts
        q = torch.zeros_like(p[:k]).index_put_((idx, d), torch.ones(k, device=p.device))
    else:
        q = it.draft_probs[:k].to(p.device)
    accept = sampler.uniform(it.rows[:1], k, p.device)[0] < acceptance_probability(p[idx, d],
                                                                                   q[idx, d])
    rejected = (~accept).nonzero()
    a = int(rejected[0]) if rejected.numel() else k
    if a < k:
        residual = (p[a] - q[a]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q there: any draw from p is exact
            residual = p[a]
        x = sampler.sample_from_probs(residual[None], [it.rows[a]])
    else:
        x = sampler.sample_from_probs(p[k][None], [it.rows[k]])
    return it.drafts[:a] + [int(x[0])], a


@dataclass(slots=True)
class Settled:
    """What verifying one request's drafts settled; the engine's update step applies it to the
    request (this module writes no request field).

    The GDN state after the last accepted draft is already in the request's state slot number
    ``num_accepted`` (verification wrote one per position), so rolling back the rejected
    drafts is the choice of that slot alone (``slot_cursor``); attention KV needs no rollback
    (stale positions are overwritten later)."""

    token_ids: list[int]  # emitted: the accepted drafts, then one target token
    logprobs: list | None  # per emitted token, when the request asks for them
    num_drafts: int
    num_accepted: int

    @property
    def slot_cursor(self) -> int:
        """The request's state slot holding its GDN state from now on."""
        return self.num_accepted

    @property
    def num_computed_drafts(self) -> int:
        """The drafts that count as computed (their KV and GDN state stay)."""
        return self.num_accepted


def verify_requests(sampler: Sampler, logits: torch.Tensor, entries) -> list[Settled]:
    """One engine step's verifications. ``entries``: (request, k drafts verified, row of its
    first logits row in ``logits``); its k + 1 rows follow. -> per entry what it settled."""
    items, idx = [], []
    for req, k, r0 in entries:
        d = req.draft_token_ids[:k]
        items.append(VerifyItem([req.sampling_row(d[:i]) for i in range(k + 1)], d,
                                req.draft_probs))
        idx.extend(range(r0, r0 + k + 1))
    whole = idx == list(range(logits.shape[0]))  # every row verifies: no copy
    vlogits = logits if whole else logits[torch.tensor(idx, device=logits.device)]
    out, off = [], 0
    for it, (toks, a) in zip(items, verify_drafts(sampler, vlogits, items)):
        lp = None
        if it.rows[0].params.logprobs is not None:
            lp = sampler.logprobs(vlogits[off:off + a + 1], it.rows[:a + 1],
                                  torch.tensor(toks, device=logits.device))
        out.append(Settled(toks, lp, len(it.drafts), a))
        off += len(it.rows)
    return out
