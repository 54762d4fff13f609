"""The MTP proposer: the checkpoint's multi-token-prediction layer drafts k tokens.

After every target step the MTP layer runs over the positions the target just settled (a
prompt chunk, or the last token plus the accepted drafts), with inputs shifted by one
(``t[p+1]``, target hidden ``h[p]``), so that its own paged KV (same block tables and slots as
the target's, its own cache tensor) covers every position. The output at the last position
gives the first draft; drafts 2..k reuse the layer on its own output, one position further each.
Only a drafting request's last row needs the layer's output: its earlier rows (the accepted
drafts, a prompt, rows that waited) and the rows of requests that do not draft have their KV
written in a pass of their own (``mtp_forward(kv_only=True)``: the K/V products, no attention
over the context, no MLP), before the pass that drafts.

With a draft vocabulary (``draft_vocab``: token ids, see ``specdec.draft_vocab``) the drafts'
logits are computed over those ids only, from a copy of the LM head's rows made once (int8
where the CPU backend has int8 products, ``DraftHead``); every other token gets -inf, so the
draft distribution is zero there. Verification is unchanged. Greedy rows take the argmax of
the draft vocabulary's logits directly (``_greedy``), without the full-vocabulary tensor.

``propose(..., wanted=...)`` (``specdec.proposer.SpecProposer``): per drafting request the
number of drafts and a prefix of them fixed beforehand (a prompt-lookup match): the MTP passes
run through the prefix (the LM head skipped there) and draft the rest, extending the match; a
sampled request's prefix positions get a point-mass draft distribution.

The one extension point, ``draft_filter`` (a constructor argument, None in the engine):
``draft_filter(request, j, token) -> token`` replaces draft j of a request after the MTP picked
it; the MTP passes still run, and the next one reads the returned token. Meant for greedy
requests (a sampled request's draft probabilities stay the MTP's). ``hybridrt bench spec
--simulate-acceptance`` (``hybridrt.bench.spec``) builds a proposer with one to control the
acceptance while every draft pass keeps its real cost.

Lazy rows (``lazy``, which ``SpecProposer`` sets): a request that drafts nothing this step
(adaptive k chose 0, or prompt lookup gave all its drafts) does not run the MTP layer; its
settled rows wait in ``Request.mtp_pending`` (first position, target hidden rows) and run in
one pass, with its next step's rows, when it drafts again, when a checkpoint of its state is
saved, when it finishes (prefix caching: its blocks keep their MTP KV) or once ``LAZY_ROWS``
wait. The KV written is the same rows' at the same positions; the prefix cache indexes a
request's blocks only before ``Request.mtp_written`` meanwhile. A k = 0 step then costs what a
step without speculation costs. ``pass_rows``: the input rows of the last ``propose``'s MTP
pass (adaptive k does not time a pass of many rows as its drafts' cost); ``first_pass``: that
``propose`` ran a kind of pass (KV only, or drafting) for the first time, whose kernels set
themselves up then (backend records, packed weights: a 1-row KV pass took 12 ms where later
ones take 2-3, a first draft 0.77 decode steps against 0.37), so adaptive k does not time it
either: priced so, drafting can stop before a warm draft corrects it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrt.kernels import quant
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.request import Request
from hybridrt.runner import build_batch
from hybridrt.sampler import Sampler, argmax_rows, plain_greedy
from hybridrt.statecache import HybridCacheManager
from hybridrt.step_plan import StepPlan
from hybridrt.vision.mtp import mtp_vision

LAZY_ROWS = 256  # most MTP input rows a request keeps waiting (``lazy``)


def draft_cap(req, max_model_len: int) -> int:
    """A request's k (``spec_k``), capped so that verification stays inside max_model_len
    and max_tokens."""
    k = min(req.spec_k, max_model_len - len(req.token_ids))
    if req.params.max_tokens is not None:
        k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
    return max(k, 0)


@dataclass(slots=True)
class Drafts:
    """A request's next drafts, as the proposer picked them; the engine's update step hands
    them to the request (the proposer writes no request field). ``probs`` None: greedy, or
    every draft a point mass (prompt lookup); the first ``num_ngram`` drafts came from prompt
    lookup, the rest from the MTP; ``k``: the drafts asked for (None: ``len(token_ids)``)."""

    request: object  # hybridrt.request.Request
    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), V] they were sampled from
    num_ngram: int = 0
    k: int | None = None


class MTPProposer:
    def __init__(self, model: Qwen35ForCausalLM, cache: HybridCacheManager, sampler: Sampler,
                 max_model_len: int, device: torch.device | str = "cpu",
                 draft_vocab: list[int] | None = None,
                 draft_filter: Callable[[Request, int, int], int] | None = None,
                 keep_kv: bool = False, lazy: bool = False):
        if model.mtp is None:
            raise ValueError("speculative decoding needs the checkpoint's mtp.* weights")
        if len(model.mtp.layers) != 1:
            raise ValueError(
                f"MTP speculation supports one MTP layer; this checkpoint has "
                f"{len(model.mtp.layers)}"
            )
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.draft_head = None if draft_vocab is None else DraftHead(model, draft_vocab)
        # adaptive k's probes (``propose(probes=...)``, specdec.adaptive): a cheap head that a
        # round of one draft drafts through
        self.probe_head: DraftHead | None = None
        self.drafting_head: DraftHead | None = None  # the head ``_draft`` drafts through now
        self.draft_filter = draft_filter  # (the module's docstring)
        self.keep_kv = keep_kv  # prefix caching: see ``propose``
        self.lazy = lazy  # (the module's docstring)
        self.pass_rows = 0  # input rows of the last propose's MTP pass
        # the last propose ran a kind of pass (KV only, drafting) for the first time: its
        # kernels' one-time set-up is in its time (``first_pass``, the module's docstring)
        self.first_pass = False
        self._ran: set[bool] = set()

    def num_drafts_for(self, req) -> int:
        return draft_cap(req, self.max_model_len)

    def draft_bytes(self, head: DraftHead | None = None) -> int:
        """Bytes of weights one draft pass reads: the MTP layer's and the LM head it drafts
        through (``head``, else the draft vocabulary's copy, else the model's head)."""
        head = head if head is not None else self.draft_head
        if head is not None:
            head = head.weight  # a PackedWeight or a tensor: both know their bytes
        else:
            m = self.model.lm_head
            head = quant.kernel_weight(m if m is not None else self.model.model.embed_tokens)
        return self.model.bytes_read(mtp=True) + head.nbytes

    @torch.inference_mode()
    def propose(self, plan: StepPlan, row_starts: list[int], hidden: torch.Tensor,
                settled: list[int], wanted: dict | None = None,
                probes: set | frozenset = frozenset()) -> list[Drafts]:
        """``row_starts[b]``: the first row of plan.seqs[b] in ``hidden``; ``settled[b]``:
        positions of plan.seqs[b] the target settled this step (its accepted inputs)
        -> the drafts of every unfinished request that sampled and may draft. ``wanted``:
        {request: (k, prefix)} of the requests that draft (the others' MTP KV is written
        only); None: every request that may draft, ``num_drafts_for`` of them, no prefix.
        ``probes``: requests of ``wanted`` whose one draft goes through ``probe_head``.

        With ``keep_kv`` (prefix caching) the MTP layer's KV is written for the settled positions
        of requests that just finished too (their cached blocks hold it). A request admitted
        from a cache hit (``mtp_carry``: the target's hidden state before its first position)
        has the position before its first one rewritten as well: the cached KV there was
        computed with another request's next token."""
        kv, full = _Pass(), _Pass()  # rows whose KV only is written; each drafter's last row
        for b, s in enumerate(plan.seqs):
            req = s.request
            if req.spec_k == 0 or req.is_finished or settled[b] == 0:
                continue
            done = req.finish_reason is not None  # finished in this step's update
            if done and not self.keep_kv:
                continue
            n = settled[b]
            if done:  # a stop inside an accepted run: no next token past it
                n = min(n, len(req.token_ids) - 1 - s.start)
                if n <= 0 and req.mtp_pending is None:
                    continue
                n = max(n, 0)
            first, rows = s.start, hidden[row_starts[b]:row_starts[b] + n]
            if req.mtp_carry is not None and s.start > 0:
                first, rows = s.start - 1, torch.cat([req.mtp_carry[None].to(rows.dtype), rows])
            waiting: list[torch.Tensor] = []
            if req.mtp_pending is not None:  # rows that waited (lazy): they run first
                first, waiting = req.mtp_pending
                req.mtp_pending = None
            if wanted is None:
                drafting = (not done and (s.sample or s.num_drafts > 0)
                            and self.num_drafts_for(req) > 0)
            else:
                drafting = not done and req in wanted
            if (self.lazy and not drafting and not done and not s.checkpoints
                    and sum(map(len, waiting)) + len(rows) < LAZY_ROWS):
                # each step's rows kept apart (no copy of the earlier ones), not a view of
                # the step's hidden states
                req.mtp_pending = (first, [*waiting, rows.clone()])
                continue
            if waiting:
                rows = torch.cat([*(w.to(rows.dtype) for w in waiting), rows])
            toks = req.token_ids[first + 1:s.start + 1 + n]
            cut = len(toks) - 1 if drafting else len(toks)  # rows that need their KV only
            table = self.cache.block_table(req.request_id)
            if cut > 0:
                kv.add(toks[:cut], first, table, rows[:cut], req)
            if drafting:
                full.add(toks[cut:], first + cut, table, rows[cut:], req)
        self.pass_rows = kv.rows + full.rows
        kinds = {kind for kind, p in ((True, kv), (False, full)) if p.rows}
        self.first_pass = bool(kinds - self._ran)
        self._ran |= kinds
        if kv.rows:  # the MTP layer's KV of rows no draft is read from: no attention, no MLP
            mb, h = kv.batch(self)
            self.model.mtp_forward(mb.input_ids, h.to(hidden.device), mb, self.cache.tensors,
                                   kv_only=True)
        if not full.rows:
            return []
        mb, h = full.batch(self)
        out = self.model.mtp_forward(mb.input_ids, h.to(hidden.device), mb, self.cache.tensors)
        reqs = full.owners
        plans = ([(self.num_drafts_for(r), []) for r in reqs] if wanted is None
                 else [wanted[r] for r in reqs])
        h = out[mb.logits_indices]
        if self.probe_head is None or not probes.intersection(reqs):
            return self._draft(reqs, h, plans, self.draft_head)
        got = {}
        for head in (self.draft_head, self.probe_head):
            idx = [i for i, r in enumerate(reqs) if (r in probes) == (head is self.probe_head)]
            if idx:
                for d in self._draft([reqs[i] for i in idx],
                                     h[torch.tensor(idx, device=h.device)],
                                     [plans[i] for i in idx], head):
                    got[d.request] = d
        return [got[r] for r in reqs]

    def _logits(self, h: torch.Tensor, head: DraftHead | None) -> torch.Tensor:
        """The drafts' fp32 logits [n, vocab]: the full LM head (``head`` None), or a draft
        vocabulary's rows with -inf elsewhere."""
        if head is None:
            return self.model.compute_logits(h)
        small = self.model.backend.linear(h, head.weight).float()
        full = small.new_full((small.shape[0], self.model.config.vocab_size), float("-inf"))
        return full.index_copy_(1, head.token_ids, small)

    def _greedy(self, h: torch.Tensor, head: DraftHead | None) -> torch.Tensor:
        """The argmax of ``_logits(h, head)`` per row (rows that are greedy and nothing else),
        without the full-vocabulary tensor: over the draft vocabulary's logits, a tie going to
        the lowest token id as the full argmax takes it."""
        if head is None:
            return argmax_rows(self.model.compute_logits(h, fp32=False))
        small = self.model.backend.linear(h, head.weight)
        best = argmax_rows(small)
        ids = head.token_ids[best]
        top = small.gather(1, best[:, None])
        for r in (small == top).sum(dim=1).gt(1).nonzero().flatten().tolist():  # ties
            ids[r] = head.token_ids[small[r] == top[r]].min()
        return ids

    def _draft(self, reqs: list, h: torch.Tensor, plans: list[tuple[int, list[int]]],
               head: DraftHead | None) -> list[Drafts]:
        """``plans[i]``: (drafts of reqs[i], the prefix of them fixed beforehand); ``head``:
        the head they draft through (None: the model's)."""
        self.drafting_head = head
        budget = [k for k, _ in plans]
        fixed = [list(prefix[:k]) for k, prefix in plans]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        V = self.model.config.vocab_size
        for j in range(max(budget)):
            free = [n for n, i in enumerate(active) if j >= len(fixed[i])]
            picked = self._pick(reqs, drafts, probs, [active[n] for n in free],
                                h if len(free) == len(active) else
                                h[torch.tensor(free, device=h.device)], head) if free else []
            it = iter(picked)
            for i in active:
                if j < len(fixed[i]):  # a fixed draft: a point mass
                    tok = fixed[i][j]
                    if not reqs[i].params.greedy:
                        probs[i].append(torch.zeros(V, device=h.device).index_fill_(
                            0, torch.tensor([tok], device=h.device), 1.0))
                else:
                    tok = next(it)
                    if self.draft_filter is not None:
                        tok = self.draft_filter(reqs[i], j, tok)
                drafts[i].append(tok)
            keep = [n for n, i in enumerate(active) if budget[i] > j + 1]
            if not keep:
                break
            active = [active[n] for n in keep]
            sel = torch.tensor(keep, device=h.device)
            mb = build_batch(
                [[drafts[i][-1]] for i in active],
                [len(reqs[i].token_ids) - 1 + j for i in active],
                [self.cache.block_table(reqs[i].request_id) for i in active],
                self.cache.block_size, None, None, device=self.device,
            )
            mb.vision = _vision([reqs[i] for i in active],
                                [len(reqs[i].token_ids) - 1 + j for i in active], mb)
            h = self.model.mtp_forward(mb.input_ids, h[sel], mb, self.cache.tensors)
        return [Drafts(r, drafts[i], torch.stack(probs[i]) if probs[i] else None,
                       num_ngram=len(fixed[i]), k=budget[i])
                for i, r in enumerate(reqs)]

    def _pick(self, reqs: list, drafts: list[list[int]], probs: list[list[torch.Tensor]],
              idx: list[int], h: torch.Tensor, head: DraftHead | None) -> list[int]:
        """The MTP's next draft of reqs[i] for each i in ``idx`` from its hidden row in ``h``
        (a sampled request's draft distribution appended to ``probs[i]``)."""
        rows = [reqs[i].sampling_row(drafts[i]) for i in idx]
        if plain_greedy(rows):
            return self._greedy(h, head).tolist()
        prepared = self.sampler.processed_logits(self._logits(h, head), rows)
        picked = prepared.argmax(dim=-1)
        rand = [n for n, r in enumerate(rows) if not r.params.greedy]
        if rand:
            sel = torch.tensor(rand, device=prepared.device)
            p = self.sampler.probs(prepared[sel], [rows[n] for n in rand])
            picked[sel] = self.sampler.sample_from_probs(p, [rows[n] for n in rand])
            for m, n in enumerate(rand):
                probs[idx[n]].append(p[m])
        return picked.tolist()


class _Pass:
    """One MTP pass's sequences: tokens, first positions, block tables, the target's hidden
    rows and their requests."""

    def __init__(self):
        self.tokens, self.starts, self.tables, self.parts, self.owners = [], [], [], [], []
        self.rows = 0

    def add(self, tokens: list[int], start: int, table, rows: torch.Tensor, req) -> None:
        self.tokens.append(tokens)
        self.starts.append(start)
        self.tables.append(table)
        self.parts.append(rows)
        self.owners.append(req)
        self.rows += len(tokens)

    def batch(self, proposer: MTPProposer):
        mb = build_batch(self.tokens, self.starts, self.tables, proposer.cache.block_size, None,
                         None, device=proposer.device)
        mb.vision = _vision(self.owners, self.starts, mb)
        return mb, self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


def _vision(reqs: list, starts: list[int], mb):
    """The images' part of an MTP batch (``hybridrt.vision.mtp``), or None."""
    return mtp_vision(reqs, starts, mb) if any(r.vision is not None for r in reqs) else None


class DraftHead:
    """The LM head's rows for the draft vocabulary: ``weight`` [N, hidden], a copy gathered
    once from the head (the tied embedding when there is no lm_head), and ``token_ids`` [N].

    Where the model's backend has compiled int8 products (the CPU backend), the copy is kept in
    int8 (``kernels.quant``, one scale per 32 inputs) whatever the model's own format: a draft
    pass reads it whole, so this halves its bytes against bf16, and a draft only decides what
    verification checks, never what is emitted. ``quantize``: False keeps the model's dtype,
    True asks for int8 where it can run."""

    def __init__(self, model: Qwen35ForCausalLM, token_ids: list[int],
                 quantize: bool | None = None):
        head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        qweight = getattr(head, "qweight", None)  # a quantized head: its rows dequantized
        device = (qweight if qweight is not None else head.weight).device
        self.token_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        if qweight is not None:
            rows = qweight.rows(self.token_ids, model.dtype).contiguous()
        else:
            rows = head.weight.detach()[self.token_ids].contiguous()
        can = device.type == "cpu" and getattr(model.backend, "int8_isa", None) is not None
        self.weight = quant.quantize(rows) if (can and quantize is not False) else rows
