"""The int8 KV cache (kernels/kvquant.py): its rows round-trip within half a step, write_kv /
paged_attention and csrc/attn_decode.c write the same bytes and read them as fp32 attention on
the dequantized values does, the decode step program and the batch-invariant mode keep their
bits with it, greedy tokens follow bf16 KV, bad values are refused, and the sizing counts its
bytes."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import output_bytes
from kernel_helpers import generator

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import (
    QWEN35_08B_TEXT_CONFIG,
    tiny_text_config,
    write_random_checkpoint,
)
from hybridrt.config import ModelConfig
from hybridrt.engine_args import EngineArgs
from hybridrt.kernels import kvquant, native, paged_attention, write_kv
from hybridrt.statecache import plan_cache
from hybridrt.statecache.tensors import CacheTensors

needs_kernels = pytest.mark.skipif(native.load() is None, reason="needs the compiled kernels")


def _dequant(packed: torch.Tensor, D: int) -> torch.Tensor:
    """The format written out by hand: codes times the scale of their group of 32."""
    codes = packed[..., :D].float()
    scales = packed[..., D:].contiguous().view(torch.float32)
    return codes * scales.repeat_interleave(D // scales.shape[-1], dim=-1)


@pytest.mark.parametrize("D", [64, 256, 24])
def test_round_trip_within_half_a_step(D):
    x = torch.randn(50, 3, D, generator=generator(1)) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row: codes and scales 0
    packed = kvquant.quantize(x)
    assert packed.shape == (50, 3, kvquant.packed_width(D)) and packed.dtype == torch.int8
    back = kvquant.dequantize(packed, D)
    assert torch.equal(back, _dequant(packed, D))
    G = kvquant.group(D)
    step = x.reshape(50, 3, D // G, G).abs().amax(-1, keepdim=True) / 127
    err = (back - x).reshape(50, 3, D // G, G).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    assert torch.equal(back[7, 1], torch.zeros(D))


def _paged(ctx_q, H=4, HKV=2, D=64, bs=8, nb=40, seed=3):
    gen = generator(seed)
    perm = torch.randperm(nb, generator=gen).tolist()
    W = kvquant.packed_width(D)
    kc = torch.randint(-127, 127, (nb, bs, HKV, W), generator=gen, dtype=torch.int8)
    vc = torch.randint(-127, 127, (nb, bs, HKV, W), generator=gen, dtype=torch.int8)
    tables, seqs = [], []
    for ctx, _ in ctx_q:
        blocks = [perm.pop() for _ in range(-(-ctx // bs))]
        k, v = torch.randn(ctx, HKV, D, generator=gen), torch.randn(ctx, HKV, D, generator=gen)
        pos = torch.arange(ctx)
        write_kv(k, v, kc, vc, torch.tensor(blocks)[pos // bs] * bs + pos % bs)
        seqs.append((k, v))
        tables.append(blocks)
    width = max(map(len, tables))
    tables = torch.tensor([t + [perm[0]] * (width - len(t)) for t in tables])
    q = torch.randn(sum(n for _, n in ctx_q), H, D, generator=gen)
    cu = torch.tensor([0] + [n for _, n in ctx_q]).cumsum(0)
    return q, kc, vc, cu, torch.tensor([c for c, _ in ctx_q]), tables, seqs, D ** -0.5


def test_paged_attention_is_fp32_attention_on_the_dequantized_values():
    """int8 caches give the bits of fp32 caches holding the dequantized values (the same fp32
    SDPA), and those are within fp32 rounding of a plain softmax over them."""
    ctx_q = [(17, 1), (40, 40), (33, 9), (5, 1), (70, 1)]
    q, kc, vc, cu, lens, tables, seqs, scale = _paged(ctx_q)
    D = q.shape[-1]
    out = paged_attention(q, kc, vc, cu, lens, tables, scale)
    kf, vf = _dequant(kc, D), _dequant(vc, D)
    assert torch.equal(out, paged_attention(q, kf, vf, cu, lens, tables, scale))
    row = 0
    for (ctx, n), (k, v) in zip(ctx_q, seqs):
        kd, vd = _dequant(kvquant.quantize(k), D), _dequant(kvquant.quantize(v), D)
        for h in range(q.shape[1]):
            s = q[row:row + n, h] @ kd[:, h // 2].t() * scale
            pos = torch.arange(ctx - n, ctx)
            s = s.masked_fill(torch.arange(ctx)[None, :] > pos[:, None], float("-inf"))
            ref = s.softmax(-1) @ vd[:, h // 2]
            torch.testing.assert_close(out[row:row + n, h], ref, rtol=0, atol=1e-5)
        row += n


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@needs_kernels
@pytest.mark.parametrize("simd", [0, 1, 2])
@pytest.mark.parametrize("L", [1, 3])
def test_attn_decode_reads_and_writes_the_format(simd, L):
    """csrc/attn_decode.c, fp32 activations, identity RoPE: the new tokens' v rows are
    kvquant.quantize's bytes (k's within a code: the norm's sums come in another order), and
    the output is softmax attention over the dequantized rows (by hand) times the gate, within
    1e-5."""
    gen = generator(5)
    B, H, HKV, D, bs, eps = 3, 4, 2, 64, 8, 1e-6
    W = kvquant.packed_width(D)
    ctx = [20, 9, 41]
    kc = kvquant.quantize(torch.randn(24, bs, HKV, D, generator=gen) * 2)
    vc = kvquant.quantize(torch.randn(24, bs, HKV, D, generator=gen) * 3)
    perm = torch.randperm(24, generator=gen).tolist()
    tables = torch.tensor([[perm.pop() for _ in range(6)] for _ in range(B)])
    pos = torch.tensor([c - L + t for c in ctx for t in range(L)])
    rows = torch.arange(B).repeat_interleave(L)
    slots = tables[rows, pos // bs] * bs + pos % bs
    qg = torch.randn(B * L, H * 2 * D, generator=gen)
    k, v = torch.randn(B * L, HKV * D, generator=gen), torch.randn(B * L, HKV * D, generator=gen)
    qw, kw = 0.1 * torch.randn(D, generator=gen), 0.1 * torch.randn(D, generator=gen)
    cos, sin = torch.ones(B * L, 16), torch.zeros(B * L, 16)
    out = native.attn_decode(qg, k, v, qw, kw, eps, cos, sin, kc, vc, slots, tables,
                             torch.tensor(ctx), D ** -0.5, L, H, HKV, D, simd)
    flat_k, flat_v = kc.view(-1, HKV, W), vc.view(-1, HKV, W)
    assert torch.equal(flat_v[slots], kvquant.quantize(v.view(-1, HKV, D)))
    # k through the kernel's norm (its own order of sums): within a code of torch's
    want_k = kvquant.quantize(_rms(k.view(-1, HKV, D), kw, eps))
    assert (flat_k[slots, :, :D].int() - want_k[..., :D].int()).abs().max() <= 1
    torch.testing.assert_close(kvquant.dequantize(flat_k[slots], D),
                               kvquant.dequantize(want_k, D), rtol=0, atol=0.05)
    qv = qg.view(B * L, H, 2, D)
    for r in range(B * L):
        b, n = r // L, ctx[r // L] - L + r % L + 1
        p = torch.arange(n)
        sl = tables[b, p // bs] * bs + p % bs
        kd, vd = _dequant(flat_k[sl], D), _dequant(flat_v[sl], D)
        for h in range(H):
            q = _rms(qv[r, h, 0], qw, eps)
            o = (q @ kd[:, h // 2].t() * D ** -0.5).softmax(-1) @ vd[:, h // 2]
            ref = o * torch.sigmoid(qv[r, h, 1])
            torch.testing.assert_close(out[r].view(H, D)[h], ref, rtol=0, atol=1e-5)


CONFIG = dict(vocab_size=131, linear_num_key_heads=4, linear_num_value_heads=16,
              linear_key_head_dim=8, head_dim=32, intermediate_size=96)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("kv8"), tiny_text_config(**CONFIG),
                                   seed=3, dtype=torch.bfloat16)


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 131) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def _llm(ckpt, kv, **kw):
    kw.setdefault("max_model_len", 160)
    kw.setdefault("cache_memory", 16 << 20)
    return LLM(ckpt, dtype="bfloat16", tokenizer=None, kv_cache_dtype=kv, threads=1, **kw)


@needs_kernels
def test_greedy_tokens_follow_bf16_kv(ckpt):
    """The same greedy tokens as bf16 KV for most of each answer (agreement measured: the
    tokens before the first difference, over all prompts)."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(8)
    runs = {kv: [o.outputs[0].token_ids for o in _llm(ckpt, kv).generate(
        prompts, sp, use_tqdm=False)] for kv in ("bf16", "int8")}
    agree = 0
    for a, b in zip(runs["bf16"], runs["int8"]):
        agree += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    rate = agree / (24 * len(prompts))
    print(f"greedy agreement, int8 against bf16 KV: {rate:.3f}")
    assert rate >= 0.75


@needs_kernels
def test_step_program_keeps_the_loops_bits(ckpt, monkeypatch):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    keys = []
    for program in ("1", "0"):
        monkeypatch.setenv("HYBRIDRT_STEP_PROGRAM", program)
        llm = _llm(ckpt, "int8", max_num_seqs=3, speculative_tokens=2)
        be = llm.engine.runner.model.backend
        assert be.fast is not None
        keys.append([[output_bytes(o) for o in llm.generate(_prompts(3), sp, use_tqdm=False,
                                                            speculative_tokens=k)]
                     for k in (0, 2)])
        if program == "1":
            assert any(p is not None for p in be.programs.values())
    assert keys[0] == keys[1]


@needs_kernels
def test_batch_invariant_mode_keeps_its_bits(ckpt):
    """A target's tokens and logprob bytes alone equal those among neighbours, chunked."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    target = _prompts(1, seed=9)[0]
    alone = _llm(ckpt, "int8", batch_invariant=True, max_num_batched_tokens=128).generate(
        [target], sp, use_tqdm=False)[0]
    crowd = _llm(ckpt, "int8", batch_invariant=True, max_num_batched_tokens=13,
                 max_num_seqs=4).generate([*_prompts(3, seed=4), target], sp, use_tqdm=False)
    assert output_bytes(crowd[-1]) == output_bytes(alone)


@pytest.mark.parametrize("bad", ["fp8", "int4", "INT8", None, 8])
def test_bad_kv_cache_dtype_is_refused(bad):
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be one of auto, bf16, int8, "
                                         r"got "):
        EngineArgs(kv_cache_dtype=bad)


def test_int8_kv_is_refused_off_the_cpu():
    with pytest.raises(ValueError, match="CPU backends only"):
        EngineArgs(kv_cache_dtype="int8", backend="triton")


def test_sizing_counts_int8_bytes_at_262144_tokens():
    """0.8B shape: 6 attention layers (and the MTP layer's), 2 KV heads of 256: a token's KV is
    2 x 7 x 2 x 256 x 2 = 14336 bytes in bf16, 2 x 7 x 2 x (256 + 8 x 4) = 8064 in int8."""
    cfg = ModelConfig.from_dict(QWEN35_08B_TEXT_CONFIG)
    bf = CacheTensors.bytes_per_block(cfg, 16, torch.bfloat16, 1)
    i8 = CacheTensors.bytes_per_block(cfg, 16, torch.int8, 1)
    assert (bf, i8) == (16 * 14336, 16 * 8064)
    budget = 4 << 30
    sizes = {dt: plan_cache(cfg, 262144, 4, 16, torch.bfloat16, memory_bytes=budget,
                            num_extra_attention_layers=1, kv_dtype=dt)
             for dt in (torch.bfloat16, torch.int8)}
    slot = CacheTensors.bytes_per_slot(cfg, torch.bfloat16, 16, 1)
    assert sizes[torch.bfloat16].num_blocks == (budget - 5 * slot) // bf == 18293
    assert sizes[torch.int8].num_blocks == min(
        (budget - 5 * CacheTensors.bytes_per_slot(cfg, torch.bfloat16, 16, 1, torch.int8))
        // i8, 4 * 262144 // 16)
    assert sizes[torch.int8].max_tokens > 1.7 * sizes[torch.bfloat16].max_tokens
    t = CacheTensors.allocate(cfg, 2, 2, 16, torch.bfloat16, kv_dtype=torch.int8)
    assert t.key_caches[0].shape == (2, 16, 2, 288) and t.key_tails[0].dtype == torch.int8


def test_context_capacity_at_262144_tokens():
    """0.8B shape with its MTP layer: the budget of one 262144-token request in bf16 KV holds
    exactly that; int8 KV holds 14336 / 8064 times as many tokens in it (whole blocks), and 4
    requests share it evenly."""
    from hybridrt.statecache.capacity import capacity_lines, context_capacity

    cfg = ModelConfig.from_dict(QWEN35_08B_TEXT_CONFIG)
    kw = dict(num_extra_attention_layers=1)
    slot_bf = CacheTensors.bytes_per_slot(cfg, torch.bfloat16, 16, 1)
    slot_i8 = CacheTensors.bytes_per_slot(cfg, torch.bfloat16, 16, 1, torch.int8)
    budget = 262144 * 14336 + 2 * slot_bf
    assert context_capacity(cfg, budget, torch.bfloat16, **kw) == 262144
    assert context_capacity(cfg, budget - 1, torch.bfloat16, **kw) == 262144 - 16
    i8 = context_capacity(cfg, budget, torch.int8, **kw)
    assert i8 == (budget - 2 * slot_i8) // (16 * 8064) * 16 == 466048
    assert context_capacity(cfg, budget, torch.int8, 4, **kw) == (
        (budget - 5 * slot_i8) // (16 * 8064) // 4 * 16)
    assert context_capacity(cfg, slot_bf, torch.bfloat16, **kw) == 0
    lines = capacity_lines(cfg, budget, (1, 4), **kw)
    assert "bf16 KV (14336 bytes/token)" in lines[0] and "1 request(s): 262144" in lines[0]
    assert "int8 KV (8064 bytes/token)" in lines[1] and "1 request(s): 466048" in lines[1]
    sizing = plan_cache(cfg, 262144, 1, 16, torch.bfloat16, memory_bytes=budget, **kw)
    assert sizing.context_tokens(1) == 262144


@needs_kernels
def test_prefix_cache_hit_gives_the_cold_bits(ckpt):
    """A hit copies int8 blocks and tails with their scales: a conversation's next turn (its
    prefix from the checkpoint at the last turn's end, a block's tail included) gives the cold
    run's tokens and logprob bytes. In batch-invariant mode, where a hit is promised the cold
    bytes (docs/batch_invariance.md; the default mode's prompt attention splits its work by
    the chunk's length)."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    first = _prompts(1, seed=11)[0][:53]
    llm = _llm(ckpt, "int8", checkpoint_interval=0, cache_memory=1 << 20, batch_invariant=True)
    answer = llm.generate([first], sp, use_tqdm=False)[0].outputs[0].token_ids
    second = first + list(answer) + [9, 10]
    for other in _prompts(4, seed=12):  # other requests' KV into the blocks freed
        llm.generate([other], sp, use_tqdm=False)
    warm = output_bytes(llm.generate([second], sp, use_tqdm=False)[0])
    assert llm.engine.stats["num_cached_tokens"] >= 53  # a hit past the first turn's blocks
    cold = _llm(ckpt, "int8", enable_prefix_caching=False, batch_invariant=True).generate(
        [second], sp, use_tqdm=False)[0]
    assert warm == output_bytes(cold)


@needs_kernels
def test_disk_tier_restart_gives_the_unrestarted_bits(ckpt, tmp_path):
    """int8 rows (codes and scales) to the prefix cache's disk tier and back: turns 3-4 on a
    restarted engine, resumed from the disk, give the unrestarted engine's bits."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    turns = _prompts(4, seed=21)

    def converse(llm, todo, history=()):
        history, outs = list(history), []
        for t in todo:
            (out,) = llm.generate([history + t], sp, use_tqdm=False)
            outs.append(output_bytes(out))
            history = history + t + list(out.outputs[0].token_ids)
        return history, outs

    kw = dict(batch_invariant=True, max_model_len=512, cache_memory=8 << 20)
    _, want = converse(_llm(ckpt, "int8", **kw), turns)
    history, first = converse(_llm(ckpt, "int8", prefix_cache_dir=str(tmp_path), **kw),
                              turns[:2])
    second = _llm(ckpt, "int8", prefix_cache_dir=str(tmp_path), **kw)
    _, later = converse(second, turns[2:], history)
    assert second.engine.cache.prefix.stats["disk_hit_tokens"] >= len(history) - 1
    assert first + later == want


@needs_kernels
@pytest.mark.parametrize("setting", [("bfloat16", None), ("float32", None)])
def test_batch_invariance_compositions_with_int8_kv(setting, monkeypatch, tmp_path):
    """test_batch_invariance's random compositions (neighbours, chunk sizes, threads, k,
    preemptions) with int8 KV: every target's bytes equal its run alone."""
    import functools

    import test_batch_invariance as inv

    monkeypatch.setattr(inv, "LLM", functools.partial(LLM, kv_cache_dtype="int8"))
    model = write_random_checkpoint(tmp_path, inv.CFG, seed=1)
    ref = inv._alone(model, setting)
    assert ref[0] == ref[2]
    mismatches, preemptions = inv._compositions(model, setting, ref)
    assert mismatches == [] and preemptions >= 4
