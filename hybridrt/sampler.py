"""Batched token sampling with vLLM semantics, shaped for reuse by speculative decoding.

One call works on N rows of fp32 logits ``[N, V]``; each row carries its own
``SamplingParams`` and token history (``SamplingRow``). The pipeline, in vLLM's order
(step, the rows it applies to, what it does):

0. grammar (rows with ``grammar``, structured outputs): tokens the grammar does not allow
   next -> -inf (``apply_token_bitmask``).
1. penalties (all rows): repetition (prompt + output; logit > 0 divided, else multiplied),
   then frequency (count in output) and presence (seen in output) subtracted.
2. min_tokens (rows with fewer outputs than min_tokens, without a grammar: a grammar decides
   where its output may end): eos ids and stop_token_ids -> -inf.
3. logprobs (rows asking for them): log_softmax taken here: after penalties and the
   min_tokens mask, before temperature and filtering.
4. temperature (random rows): logits / temperature.
5. top-k, top-p, min-p (random rows): filtered tokens -> -inf; the top-1 always stays.
6. pick: greedy rows: argmax; random rows: inverse CDF of softmax at one uniform draw.

Random draws: a seeded request owns a generator (``make_generator``) kept across steps and
used for nothing else, so its tokens do not depend on what else is in the batch; unseeded
rows share one generator (the sampler's, or torch's global one). Each random row consumes
exactly one uniform per token; greedy rows consume none. ``Sampler(positional=True)``
(batch-invariant mode): a seeded row's uniform is instead a function of its seed and the
position of the token (``positional_uniform``), the same whether the token is sampled, drafted
or verified, so that the tokens depend on nothing but the seed and the logits: not on
preemption (which drops pending drafts), nor on how many drafts a step verifies
(specdec/verify.py's coupled verification).

For rejection sampling, ``processed_logits`` + ``probs`` give the target/draft distributions and
``uniform`` / ``sample_from_probs`` draw from the same per-row generators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from hybridrt.kernels import native
from hybridrt.kernels.meta import to_device
from hybridrt.sampling_params import SamplingParams

__all__ = [
    "RowLogprobs",
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "apply_token_bitmask",
    "make_generator",
]


_MASK = (1 << 64) - 1


def positional_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position): splitmix64 of their mix, its
    top 24 bits (an fp32 in [0, 1) exactly, as torch.rand's are)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 40) / float(1 << 24)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded with ``params.seed``, or None for unseeded requests.

    Create it once per request and keep it for the request's lifetime.
    """
    if params.seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed % (1 << 64))
    return generator


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch: whose settings and which tokens came before it."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # structured outputs: the request's RequestGrammar (hybridrt.structured_outputs), whose
    # ``fill_mask`` gives the tokens allowed after output_token_ids
    grammar: object | None = None


@dataclass(slots=True)
class RowLogprobs:
    """Logprobs of one row: the sampled token, its rank (1 = most likely) and the top-N."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64, on the logits' device
    logprobs: list[RowLogprobs | None] | None = None  # None when no row asked for them


class Sampler:
    """Stateless apart from the shared generator for unseeded rows.

    ``seed``: seeds that shared generator (one per device); None uses torch's global RNG.
    """

    def __init__(self, seed: int | None = None, positional: bool = False) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self.positional = positional

    # Public pipeline ------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Pick one token per row; ``logits`` ``[N, V]`` is not modified."""
        if plain_greedy(rows):  # the argmax of the logits as they are
            _check_logits(logits, rows)
            return SamplerOutput(token_ids=argmax_rows(logits))
        penalised = self._penalise(logits, rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logprobs = None
        if wanted:
            index = _tensor(wanted, logits.device)
            logprobs = torch.log_softmax(penalised[index], dim=-1)
        processed = self._filter(penalised, rows)
        token_ids = argmax_rows(processed)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            index = _tensor(random_rows, logits.device)
            probs = torch.softmax(processed[index], dim=-1)
            u = self.uniform([rows[i] for i in random_rows], 1, logits.device)
            token_ids[index] = _inverse_cdf(probs, u[:, 0])
        out = SamplerOutput(token_ids=token_ids)
        if logprobs is not None:
            out.logprobs = _gather_logprobs(logprobs, token_ids, rows, wanted)
        return out

    def logprobs(self, logits: torch.Tensor, rows: list[SamplingRow],
                 token_ids: torch.Tensor) -> list[RowLogprobs | None] | None:
        """Logprobs of given tokens (e.g. accepted drafts), computed as ``sample`` does."""
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return None
        index = _tensor(wanted, logits.device)
        lp = torch.log_softmax(self._penalise(logits[index], [rows[i] for i in wanted]), dim=-1)
        return _gather_logprobs(lp, token_ids, rows, wanted)

    def processed_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Processed logits ``[N, V]`` fp32 (a new tensor; ``logits`` is left alone).

        Every row gets penalties and the min_tokens mask; random rows are then divided by
        their temperature and top-k / top-p / min-p filtered (filtered tokens are -inf).
        Greedy rows are not scaled or filtered.
        """
        return self._filter(self._penalise(logits, rows), rows)

    def probs(self, processed: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Probabilities ``[N, V]`` of ``processed_logits``' output: softmax, or for greedy rows a
        one-hot of the argmax (the distribution greedy decoding actually samples from)."""
        _check_logits(processed, rows)
        probs = torch.softmax(processed, dim=-1)
        greedy = _greedy_mask(rows, processed.device)
        if bool(greedy.any()):
            one_hot = torch.zeros_like(probs)
            one_hot.scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
            probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
        return probs

    def uniform(
        self, rows: list[SamplingRow], num: int, device: torch.device | str
    ) -> torch.Tensor:
        """``[len(rows), num]`` uniforms in [0, 1): seeded rows from their own generator, the
        others from the shared one, so a seeded row's draws never depend on the batch. With
        ``positional``: a seeded row's j-th uniform is ``positional_uniform`` of the token
        ``j`` places after the row's next one."""
        device = torch.device(device)
        out = torch.empty(len(rows), num, dtype=torch.float32)
        shared = [i for i, row in enumerate(rows) if row.generator is None]
        for i, row in enumerate(rows):
            if row.generator is not None and self.positional:
                pos = len(row.prompt_token_ids) + len(row.output_token_ids)
                out[i] = torch.tensor([positional_uniform(row.params.seed, pos + j)
                                       for j in range(num)])
            elif row.generator is not None:
                out[i] = torch.rand(num, generator=row.generator, device=row.generator.device).cpu()
        if shared:
            generator = self._shared_generator(device)
            drawn = torch.rand(len(shared), num, generator=generator, device=device)
            out = to_device(out, device)
            out[_tensor(shared, device)] = drawn
            return out
        return to_device(out, device)

    def sample_from_probs(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row from ``probs`` ``[N, V]`` (need not be normalised, e.g. the
        residual max(p - q, 0) of rejection sampling), one uniform per row."""
        _check_logits(probs, rows)
        u = self.uniform(rows, 1, probs.device)
        return _inverse_cdf(probs, u[:, 0])

    # Steps ----------------------------------------------------------------------------------
    def _penalise(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        _check_logits(logits, rows)
        logits = logits.to(torch.float32, copy=True)
        num_rows, vocab = logits.shape
        device = logits.device

        guided = [i for i, r in enumerate(rows) if r.grammar is not None]
        if guided:
            bitmask = torch.empty(len(guided), (vocab + 31) // 32, dtype=torch.int32)
            for j, i in enumerate(guided):
                rows[i].grammar.fill_mask(bitmask, j, rows[i].output_token_ids)
            apply_token_bitmask(logits, to_device(bitmask, device), _tensor(guided, device))

        rep = [r.params.repetition_penalty != 1.0 for r in rows]
        additive = [
            r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows
        ]
        if any(rep) or any(additive):
            output_counts = _bin_counts(
                [r.output_token_ids if a or b else [] for r, a, b in zip(rows, rep, additive)],
                vocab, device,
            )
            if any(rep):
                seen = _bin_counts(
                    [r.prompt_token_ids if a else [] for r, a in zip(rows, rep)], vocab, device
                ) > 0
                seen |= output_counts > 0
                penalty = _tensor([r.params.repetition_penalty for r in rows], device,
                                  torch.float32).unsqueeze(1).expand(num_rows, vocab)
                penalty = torch.where(seen, penalty, torch.ones_like(penalty))
                logits = torch.where(logits > 0, logits / penalty, logits * penalty)
            if any(additive):
                freq = _tensor([r.params.frequency_penalty for r in rows], device, torch.float32)
                presence = _tensor([r.params.presence_penalty for r in rows], device, torch.float32)
                logits -= freq.unsqueeze(1) * output_counts
                logits -= presence.unsqueeze(1) * (output_counts > 0)

        masked_rows, masked_ids = [], []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) < r.params.min_tokens and r.grammar is None:
                ids = {t for t in chain(r.eos_token_ids, r.params.stop_token_ids) if t < vocab}
                masked_rows.extend([i] * len(ids))
                masked_ids.extend(ids)
        if masked_ids:
            logits[_tensor(masked_rows, device),
                   _tensor(masked_ids, device)] = float("-inf")
        return logits

    def _filter(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, then top-k, top-p, min-p on the random rows, in place."""
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return logits
        device = logits.device
        vocab = logits.shape[1]
        params = [rows[i].params for i in random_rows]
        if any(p.temperature != 1.0 for p in params):
            temperature = _tensor([p.temperature for p in params], device, torch.float32)
            index = _tensor(random_rows, device)
            logits[index] = logits[index] / temperature.unsqueeze(1)

        filtered = [(i, p) for i, p in zip(random_rows, params)
                    if 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0]
        if not filtered:
            return logits
        index = _tensor([i for i, _ in filtered], device)
        top_k = _tensor([p.top_k if 0 < p.top_k < vocab else vocab for _, p in filtered], device)
        top_p = _tensor([p.top_p for _, p in filtered], device, torch.float32)
        min_p = _tensor([p.min_p for _, p in filtered], device, torch.float32)

        # Ascending sort: the most likely token is the last column and is never removed.
        # A stable sort makes tie-breaking depend on the row alone, not on the batch.
        sorted_logits, order = logits[index].sort(dim=-1, stable=True)
        position = torch.arange(vocab, device=device)
        remove = position.unsqueeze(0) < (vocab - top_k).unsqueeze(1)
        sorted_logits.masked_fill_(remove, float("-inf"))

        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = (cumulative <= (1.0 - top_p).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        remove[:, -1] = False
        sorted_logits.masked_fill_(remove, float("-inf"))

        probs = sorted_logits.softmax(dim=-1)
        remove = probs < (min_p.unsqueeze(1) * probs[:, -1:])
        remove[:, -1] = False
        sorted_logits.masked_fill_(remove, float("-inf"))

        logits[index] = sorted_logits.scatter(1, order, sorted_logits)
        return logits

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        if device not in self._shared:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed % (1 << 64))
            self._shared[device] = generator
        return self._shared[device]


# Helpers -------------------------------------------------------------------------------------
_BITS = {}  # device -> [256, 8] fp32: 0 where bit j of byte b is set, else -inf


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor) -> None:
    """``logits[rows[j], t] = -inf`` where bit ``t % 32`` of ``bitmask[j, t // 32]`` is 0, in
    place. ``bitmask``: int32 ``[len(rows), ceil(V / 32)]`` on the logits' device (xgrammar's
    layout). Plain torch ops, the same on CPU and CUDA: each byte of the mask looks up its
    8 additive values (0 or -inf) in a 256-row table, one gather for the whole row; on CPU
    that costs a tenth of a bool mask's ``masked_fill`` (docs/structured_outputs.md)."""
    table = _BITS.get(bitmask.device)
    if table is None:
        byte = torch.arange(256, device=bitmask.device).unsqueeze(1)
        bit = torch.arange(8, device=bitmask.device)
        table = _BITS[bitmask.device] = torch.where(
            (byte >> bit) & 1 == 1, 0.0, float("-inf")).to(torch.float32)
    n, vocab = bitmask.shape[0], logits.shape[1]
    add = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table)
    logits.index_add_(0, rows, add.view(n, -1)[:, :vocab])


def _tensor(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype)`` on ``device``; on CUDA without waiting for the work
    queued on the device (kernels/meta.py's ``to_device``)."""
    t = torch.tensor(values, dtype=dtype)
    return t if t.device == device else to_device(t, device)


def _check_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(rows):
        raise ValueError(f"logits have {logits.shape[0]} rows but {len(rows)} SamplingRows given")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")


def _greedy_mask(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    return _tensor([r.params.greedy for r in rows], device, torch.bool)


def _bin_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[N, vocab]`` fp32 count of each token id in each row's list (one flat scatter_add)."""
    num_rows = len(token_ids)
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    lengths = _tensor([len(t) for t in token_ids], device)
    flat = _tensor(list(chain.from_iterable(token_ids)), device, torch.long)
    if flat.numel():
        if int(flat.min()) < 0 or int(flat.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) for penalties")
        row = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
        counts.scatter_add_(0, row * vocab + flat, torch.ones_like(flat, dtype=torch.float32))
    return counts.view(num_rows, vocab)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]; only tokens with probability > 0 can be
    hit. fp64 cumulative sums keep large vocabularies exact enough."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1)
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total rounding up to total would run past the end: fall back to the last live token.
    last_live = torch.where(probs > 0, torch.arange(probs.shape[1], device=probs.device), -1)
    return torch.minimum(token, last_live.max(dim=-1).values)


def _gather_logprobs(
    lp: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow], wanted: list[int]
) -> list[RowLogprobs | None]:
    """``lp``: log_softmax of the penalised logits of the ``wanted`` rows, ``[len(wanted), V]``."""
    sampled = token_ids[_tensor(wanted, lp.device)]
    sampled_lp = lp.gather(1, sampled.unsqueeze(1))
    rank = (lp > sampled_lp).sum(dim=-1) + 1
    num_top = min(max(rows[i].params.logprobs for i in wanted), lp.shape[1])
    nth = lp.topk(num_top, dim=-1).values  # values only: their order among ties is topk's own
    sampled_l, sampled_lp_l, rank_l = sampled.tolist(), sampled_lp[:, 0].tolist(), rank.tolist()
    out: list[RowLogprobs | None] = [None] * len(rows)
    for j, i in enumerate(wanted):
        n = min(rows[i].params.logprobs, lp.shape[1])
        out[i] = RowLogprobs(
            token_id=sampled_l[j], logprob=sampled_lp_l[j], rank=rank_l[j],
            top=_top(lp[j], nth[j, n - 1])[:n] if n else [],
        )
    return out


def _top(row: torch.Tensor, least: torch.Tensor) -> list[tuple[int, float]]:
    """The (token, logprob) pairs of ``row`` from its largest down to ``least``, equal values
    by token id: the same list whatever rows are sampled beside it (topk's order among equal
    values follows the batch's shape)."""
    ids = (row >= least).nonzero().squeeze(1)  # ascending ids
    vals = row[ids]
    order = torch.sort(vals, descending=True, stable=True).indices
    return list(zip(ids[order].tolist(), vals[order].tolist()))


def plain_greedy(rows: list[SamplingRow]) -> bool:
    """Whether ``sample`` gives every row the argmax of its logits unchanged (``_plain_greedy``;
    the logits may then come in the LM head's own dtype)."""
    return all(_plain_greedy(r) for r in rows)


def _plain_greedy(row: SamplingRow) -> bool:
    """Whether ``sample`` gives ``row`` the argmax of its logits unchanged: greedy, no logprobs,
    grammar, penalties or min_tokens mask (fp32 holds every bf16 value, so the argmax is the
    same in the logits' own dtype)."""
    p = row.params
    return (p.greedy and p.logprobs is None and row.grammar is None
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and len(row.output_token_ids) >= p.min_tokens)


def argmax_rows(x: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """``x.argmax(-1)`` for a 2-D tensor, same result (first maximum; NaN counts as maximal):
    the per-block maxima pick each row's first block holding its maximum, then one argmax over
    that block. ATen's CPU argmax does not vectorise and ``amax`` does, so the two passes cost
    less than one argmax over a wide logits tensor (docs/performance.md)."""
    fast = native.argmax_rows(x)
    if fast is not None:
        return fast
    n, V = x.shape
    full = V // block * block
    if x.device.type != "cpu" or full == 0 or not x.is_contiguous():
        return x.argmax(-1)
    blocks = x[:, :full].view(n, V // block, block)
    peaks = blocks.amax(-1)  # [n, V/block]
    if full < V:
        peaks = torch.cat([peaks, x[:, full:].amax(-1, keepdim=True)], dim=1)
    b = peaks.argmax(-1)  # first block whose max is the row max
    rows = torch.arange(n, device=x.device)
    starts = b * block
    width = torch.where(b * block + block <= V, block, V - starts)
    # gather each row's chosen block (the tail block may be shorter: pad with -inf)
    idx = starts[:, None] + torch.arange(block, device=x.device)
    inside = torch.arange(block, device=x.device)[None, :] < width[:, None]
    vals = x[rows[:, None], idx.clamp(max=V - 1)].masked_fill(~inside, float("-inf"))
    return starts + vals.argmax(-1)
