"""Shared test helpers: build tiny models, run ours over packed batches, run the reference.

``PackedRunner`` is the smallest possible "engine": sequence i owns a contiguous run of KV
blocks (or a block list the test gives) and GDN state slot ``slot_base + i``; each ``step``
packs the given token pieces into one ForwardBatch, runs the model and returns the logits of
every token of every piece. Unused cache memory is filled with garbage (NaN state slots, random
KV) so that a sequence reading anything it does not own shows up as a wrong or NaN logit.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from hybridrt.bench.fixtures import hf_reference_model, random_state_dict
from hybridrt.config import ModelConfig
from hybridrt.forward_batch import ForwardBatch
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.runner import build_batch
from hybridrt.statecache import CacheTensors


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (fp32)."""
    ours, ref = ours.float(), ref.float()
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """fla-style check: max-abs error <= tol * max |ref|, and no NaN anywhere."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite values in ours"
    err = rel_err(ours, ref)
    assert err <= tol, f"{what}: max-abs error {err:.3g} x max|ref| > {tol:g}"


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson chi-square of counts vs probs; cells expected < 5 are pooled. -> (stat, df, p)
    with p = Q(df/2, stat/2), the regularised upper incomplete gamma function."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs[exp == 0].sum() == 0, "a token with probability 0 was emitted"
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                      torch.tensor(stat / 2.0, dtype=torch.float64)))
    return stat, df, p


def build_model(
    text_config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
    with_mtp: bool = False,
) -> tuple[Qwen35ForCausalLM, ModelConfig, dict[str, torch.Tensor]]:
    """Our model with random weights (built on meta, loaded with assign=True)."""
    config = ModelConfig.from_dict(text_config)
    sd = random_state_dict(config, seed=seed, dtype=dtype, with_mtp=with_mtp)
    with torch.device("meta"):
        net = Qwen35ForCausalLM(config, with_mtp=with_mtp)
    net.load_state_dict(sd, assign=True, strict=True)
    return net.eval().requires_grad_(False), config, sd


def mixed_batches(device: str = "cpu"):
    """Step 1: three prompts (the second the first chunk of a longer one); step 2: a decode,
    that prompt's next chunk and a verification of 3 drafts (per-token verify slots); step 3:
    decodes only; step 4: verifications of 2 drafts only (the CPU backend's loop, the CUDA
    backend's uniform steps). Block size 8, state slots 1-3 (verify slots up to 11)."""
    tables = [[0], [1, 2, 4], [3, 5]]
    first = build_batch([list(range(3, 8)), list(range(10, 21)), list(range(4, 9))], [0, 0, 0],
                        tables, 8, [1, 2, 3], ["all", "all", "all"], device=device)
    second = build_batch([[7], list(range(30, 36)), [9, 10, 11, 12]], [5, 11, 5],
                         tables, 8, [1, 2, 3], ["all", "all", "all"],
                         verify_slots=[None, None, [4, 5, 6, 3]], device=device)
    third = build_batch([[3], [4], [5]], [6, 17, 9], tables, 8, [1, 2, 3],
                        ["all", "all", "all"], device=device)
    fourth = build_batch([[6, 7, 8], [9, 10, 11], [12, 13, 14]], [7, 18, 10],
                         [[0, 6], [1, 2, 4], [3, 5]], 8, [1, 2, 3], ["all", "all", "all"],
                         verify_slots=[[4, 5, 6], [7, 8, 9], [10, 11, 3]], device=device)
    return first, second, third, fourth


def run_mixed_steps(make_backend: Callable, text_config: dict[str, Any], dtype: torch.dtype,
                    device: str = "cpu"):
    """The ``mixed_batches`` steps through a model with random weights (seed 4) on the backend
    ``make_backend(config)``, attached to a cache of 8 blocks of 8 tokens and 12 state slots
    as the engine attaches it. -> (hidden states per step, the cache, per step whether the
    backend's own ``forward`` ran it)."""
    net, config, _ = build_model(text_config, seed=4, dtype=dtype)
    net = net.to(device)
    be = make_backend(config)
    net.set_backend(be)
    cache = CacheTensors.allocate(config, 8, 12, 8, dtype, device=device)
    be.attach(SimpleNamespace(tensors=cache, slots_per_request=1, sizing=SimpleNamespace(
        max_model_len=64, max_num_seqs=3)))
    whole_step = be.forward
    looped = []

    def recorded(*args):
        out = whole_step(*args)
        looped.append(out is not None)
        return out

    be.forward = recorded
    hidden = []
    with torch.inference_mode():
        for batch in mixed_batches(device):
            hidden.append(net(batch, cache))
    return hidden, cache, looped


def build_pair(text_config: dict[str, Any], seed: int = 0):
    """(our fp32 model, transformers' fp32 reference with the same weights, config)."""
    net, config, sd = build_model(text_config, seed=seed)
    return net, hf_reference_model(text_config, sd, torch.float32), config


class PackedRunner:
    """Runs ``net`` step by step over a packed batch of ``num_seqs`` sequences.

    Sequence i owns KV blocks ``blocks[i]`` (default: the contiguous run ``[i*M, (i+1)*M)``)
    and state slot ``slot_base + i``; slots below ``slot_base`` and the spare block at the end
    belong to nobody.
    """

    def __init__(
        self,
        net: Qwen35ForCausalLM,
        num_seqs: int,
        max_len: int,
        block_size: int = 16,
        slot_base: int = 1,
        blocks: Sequence[Sequence[int]] | None = None,
        garbage: bool = True,
        seed: int = 1234,
    ):
        self.net = net
        self.config = net.config
        self.block_size = block_size
        per_seq = math.ceil(max_len / block_size)
        if blocks is None:
            blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
        self.blocks = [list(b) for b in blocks]
        num_blocks = max(max(b) for b in self.blocks) + 2  # one spare block nobody owns
        self.slots = [slot_base + i for i in range(num_seqs)]
        extra = len(net.mtp.layers) if net.mtp is not None else 0
        self.cache = CacheTensors.allocate(
            self.config, num_blocks=num_blocks, num_slots=slot_base + num_seqs + 1,
            block_size=block_size, dtype=net.dtype, num_extra_attention_layers=extra,
        )
        if garbage:
            gen = torch.Generator().manual_seed(seed)
            for t in [*self.cache.key_caches, *self.cache.value_caches]:
                t.copy_(torch.randn(t.shape, generator=gen) * 3)
            self.cache.conv_states.fill_(float("nan"))
            self.cache.ssm_states.fill_(float("nan"))
        self.num_computed = [0] * num_seqs

    def make_batch(self, pieces: Sequence[tuple[int, torch.Tensor]],
                   last_only: bool = False) -> ForwardBatch:
        """pieces: (sequence index, new token ids [n]) in batch order -> ForwardBatch whose
        ``logits_indices`` select every token (or only each piece's last token)."""
        ids, pos, slot_map, seq_lens, lens, slots, init = [], [], [], [], [], [], []
        bs = self.block_size
        for i, toks in pieces:
            n, start = toks.numel(), self.num_computed[i]
            p = torch.arange(start, start + n)
            blk = torch.tensor(self.blocks[i])
            if start + n > len(self.blocks[i]) * bs:
                raise ValueError(f"sequence {i} outgrows its {len(self.blocks[i])} blocks")
            ids.append(toks.reshape(-1))
            pos.append(p)
            slot_map.append(blk[p // bs] * bs + p % bs)
            seq_lens.append(start + n)
            lens.append(n)
            slots.append(self.slots[i])
            init.append(start > 0)
        width = max(len(self.blocks[i]) for i, _ in pieces)
        spare = self.cache.num_blocks - 1
        tables = torch.tensor([self.blocks[i] + [spare] * (width - len(self.blocks[i]))
                               for i, _ in pieces])
        cu = torch.tensor([0, *lens]).cumsum(0)
        return ForwardBatch(
            input_ids=torch.cat(ids),
            positions=torch.cat(pos),
            cu_seqlens=cu,
            seq_lens=torch.tensor(seq_lens),
            slot_mapping=torch.cat(slot_map),
            block_tables=tables,
            state_slots=torch.tensor(slots),
            has_initial_state=torch.tensor(init),
            logits_indices=cu[1:] - 1 if last_only else torch.arange(int(cu[-1])),
        )

    @torch.no_grad()
    def step(self, pieces: Sequence[tuple[int, torch.Tensor]],
             last_only: bool = False) -> list[torch.Tensor]:
        """Run one step -> logits [n_i, vocab] (fp32) of each piece, in the given order
        (``last_only``: [1, vocab], the piece's last token)."""
        batch = self.make_batch(pieces, last_only)
        hidden = self.net(batch, self.cache)
        logits = self.net.compute_logits(hidden[batch.logits_indices])
        for i, toks in pieces:
            self.num_computed[i] += toks.numel()
        return list(logits.split([1] * len(pieces) if last_only else batch.query_lens))


def run_packed(
    net: Qwen35ForCausalLM,
    prompts: Sequence[torch.Tensor],
    decode_tokens: Sequence[torch.Tensor] = (),
    block_size: int = 16,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill all prompts in one packed step, then decode one token per sequence per step
    (teacher-forced: ``decode_tokens[i]`` is the token list fed to sequence i).

    -> (prefill logits [T_i, V] per sequence, decode logits [steps_i, V] per sequence).
    """
    steps = max((len(d) for d in decode_tokens), default=0)
    max_len = max(p.numel() + (len(decode_tokens[i]) if decode_tokens else 0)
                  for i, p in enumerate(prompts))
    runner = PackedRunner(net, len(prompts), max_len, block_size=block_size)
    prefill = runner.step(list(enumerate(prompts)))
    decode: list[list[torch.Tensor]] = [[] for _ in prompts]
    for s in range(steps):
        pieces = [(i, d[s].view(1)) for i, d in enumerate(decode_tokens) if s < len(d)]
        for (i, _), lg in zip(pieces, runner.step(pieces)):
            decode[i].append(lg[0])
    return prefill, [torch.stack(d) if d else torch.empty(0) for d in decode]


@torch.no_grad()
def hf_prefill_decode(ref, prompt: torch.Tensor, steps: int):
    """The reference: prefill ``prompt`` then ``steps`` greedy decode steps with its own cache.

    -> (prefill logits [T, V], greedy tokens fed at each decode step [steps],
        decode logits [steps, V]), all fp32.
    """
    out = ref(prompt[None], use_cache=True)
    cache = out.cache
    prefill = out.logits[0].float()
    tok = prefill[-1].argmax()
    fed, logits = [], []
    for _ in range(steps):
        fed.append(tok)
        out = ref(tok.view(1, 1), cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0, -1].float())
        tok = logits[-1].argmax()
    dec = torch.stack(logits) if logits else torch.empty(0)
    return prefill, torch.stack(fed) if fed else torch.empty(0, dtype=torch.long), dec


def hf_reference_sharing_weights(text_config: dict[str, Any], state_dict: dict[str, torch.Tensor]):
    """transformers' Qwen3_5ForCausalLM built on meta and given ``state_dict``'s tensors with
    ``assign=True`` (no copy, no random init): for full-size shapes where a second copy of the
    weights and transformers' fp32 init would cost GBs and minutes. Inference only: the two
    models share storage."""
    import copy

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = copy.deepcopy(text_config)
    cfg.pop("model_type", None)
    hf_cfg = Qwen3_5TextConfig(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(hf_cfg)
    sd = {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
    if hf_cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"reference model load: missing {missing}, unexpected {unexpected}")
    rotary = model.model.rotary_emb  # non-persistent buffers: recompute off meta
    inv_freq, _ = rotary.compute_default_rope_parameters(hf_cfg)
    rotary.inv_freq, rotary.original_inv_freq = inv_freq, inv_freq.clone()
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"reference model still has meta tensors: {leftover}")
    return model.eval().requires_grad_(False)


def preempt_at(llm, rng, steps: set[int]) -> None:
    """Preempt a random running request of ``llm``'s engine before each of these engine steps
    (as the scheduler does when the cache runs out; the request recomputes from its tokens)."""
    from hybridrt.scheduler import StepPlan

    sched, schedule, count = llm.engine.scheduler, llm.engine.scheduler.schedule, [0]

    def preempting():
        count[0] += 1
        if count[0] not in steps or not sched.running:
            return schedule()
        first = StepPlan()
        sched._preempt(rng.choice(sched.running), first)
        sched.under_pressure = False  # admit again at once: more compositions
        plan = schedule()
        plan.preempted[:0] = first.preempted
        return plan

    sched.schedule = preempting


def output_bytes(out) -> tuple:
    """A request's token ids and the bytes of its sampled tokens' logprobs (and the top ones):
    what the batch-invariance tests compare."""
    c = out.outputs[0]
    lps = b"".join(struct.pack("<f", v) for d in c.logprobs for _, v in sorted(d.items()))
    return tuple(c.token_ids), lps


def gdn_state_after(ref_llm, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, ssm) GDN state after prefilling ``ids`` without speculation on ``ref_llm``."""
    from hybridrt.sampling_params import SamplingParams

    eng = ref_llm.engine
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=2))
    eng.step()
    req = eng.requests[rid]
    assert req.num_computed_tokens == len(ids)
    slot = eng.cache.state_slot(rid, req.slot_cursor)
    t = eng.cache.tensors
    state = t.conv_states[:, slot].clone(), t.ssm_states[:, slot].clone()
    eng.abort_request(rid)
    eng.pop_request(rid)
    return state


def record_rounds(monkeypatch) -> list[tuple[int, int]]:
    """Every verify round from now on as (num_drafts, num_accepted)."""
    from hybridrt.specdec.stats import SpecStats

    log: list[tuple[int, int]] = []
    orig = SpecStats.record

    def record(self, num_drafts, num_accepted):
        log.append((num_drafts, num_accepted))
        orig(self, num_drafts, num_accepted)

    monkeypatch.setattr(SpecStats, "record", record)
    return log
