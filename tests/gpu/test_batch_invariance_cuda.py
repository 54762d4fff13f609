"""Batch-invariant mode on the CUDA backend (issue 27, docs/batch_invariance.md): each
invariant kernel row by row, then the engine: requests run alone against random batch
compositions around them, their token ids and logprob bytes compared. On a GPU: backend
"cuda" (CUDA graphs for decode and verify steps); under TRITON_INTERPRET=1 on CPU: backend
"triton", the same kernels eager (the only place this mode has run so far)."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from helpers import output_bytes as _key
from helpers import preempt_at

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.config import ModelConfig
from hybridrt.kernels.cuda import attention as attn_k
from hybridrt.kernels.cuda import gdn as gdn_k
from hybridrt.kernels.cuda.backend import CudaBackend
from hybridrt.kernels.cuda.matmul import matmul_rows
from hybridrt.kernels.options import KernelOptions
from hybridrt.runner import build_batch

ON_GPU = torch.cuda.is_available()
BACKEND = "cuda" if ON_GPU else "triton"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


# Kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, K", [(150, 200), (70, 37)])
def test_matmul_rows_every_row_as_alone(device, dtype, N, K):
    """matmul_rows over 1 to 70 rows (one and two M tiles, K tails): each row the bits it
    gets alone, in the input dtype and as the fp32 accumulator (a bf16 output hides most
    changes of the sums' order); near the fp64 product."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).to(dtype).to(device)
    x = torch.randn(70, K, generator=g).to(dtype).to(device)
    ref = x.double() @ w.double().T
    for out in (dtype, torch.float32):
        alone = torch.cat([matmul_rows(x[i:i + 1], w, out) for i in range(70)])
        for m in (2, 9, 64, 70):
            assert torch.equal(_bits(matmul_rows(x[:m], w, out)), _bits(alone[:m])), (m, out)
        # rows in another order (a row at another place in its tile) and as a strided view
        perm = torch.randperm(70, generator=g).to(device)
        assert torch.equal(_bits(matmul_rows(x[perm], w, out)), _bits(alone[perm]))
        wide = torch.cat([x, x], dim=1)[:, :K]
        assert torch.equal(_bits(matmul_rows(wide, w, out)), _bits(alone))
        tol = 2 ** -7 if out == torch.bfloat16 else 1e-5
        assert torch.allclose(alone.double(), ref, rtol=tol, atol=tol * K ** 0.5)


def test_errors(device):
    w = torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match="x has 15 columns, the weight 16"):
        matmul_rows(torch.randn(2, 15, device=device), w)
    with pytest.raises(ValueError, match="no invariant product for torch.int8"):
        matmul_rows(torch.randn(2, 16, device=device), w.to(torch.int8))
    # a head dim the Triton attention does not take: refused, not the torch fallback
    cfg = ModelConfig.from_dict(tiny_text_config(head_dim=24))
    with pytest.raises(ValueError, match="power-of-two head dim >= 16, got 24"):
        CudaBackend(cfg, device, graphs=False, options=KernelOptions(batch_invariant=True))
    CudaBackend(cfg, device, graphs=False)  # the default mode falls back


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_prompt_as_decode_steps(device, dtype):
    """The recurrent kernels with fixed blocks: a 13-token prompt in one call (L = 13) beside
    another sequence leaves the state bytes and gives the outputs that 13 single-token steps
    of it alone give (the batch-invariant mode's prompt path)."""
    g = torch.Generator().manual_seed(7)
    HK, HV, D, C, K = 1, 2, 16, 64, 4
    L = 13

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    x, a, b = rnd(2, L, C), rnd(2, L, HV), rnd(2, L, HV)
    w = rnd(C, K)
    A_log = torch.randn(HV, generator=g).to(device)
    dt_bias = torch.randn(HV, generator=g).to(device)
    conv0 = rnd(3, K - 1, C)
    ssm0 = torch.randn(3, HV, D, D, generator=g).to(device)

    def step(x, a, b, conv, ssm, slots):
        n, t = x.shape[:2]
        m = gdn_k.conv_update(x, w, conv, slots)
        q, k, v = m.view(n, t, C).split([HK * D, HK * D, HV * D], dim=-1)
        return m, gdn_k.gdn_recurrent(q.reshape(n, t, HK, D), k.reshape(n, t, HK, D),
                                      v.reshape(n, t, HV, D), a, b, A_log, dt_bias, ssm, slots,
                                      fixed_blocks=True)

    conv, ssm = conv0.clone(), ssm0.clone()
    slots = torch.tensor([2, 0], device=device)
    m_all, o_all = step(x, a, b, conv, ssm, slots)
    conv1, ssm1 = conv0.clone(), ssm0.clone()
    one = torch.tensor([2], device=device)
    for t in range(L):
        m1, o1 = step(x[:1, t:t + 1], a[:1, t:t + 1], b[:1, t:t + 1], conv1, ssm1, one)
        assert torch.equal(_bits(m1[0, 0]), _bits(m_all[0, t])), t
        assert torch.equal(_bits(o1[0, 0]), _bits(o_all[0, t])), t
    assert torch.equal(_bits(ssm1[2]), _bits(ssm[2])) and torch.equal(_bits(conv1[2]),
                                                                         _bits(conv[2]))


def test_attention_rows_as_decode(device):
    """paged_attention_varlen with one token a tile (the mode's attention): a prompt of 40
    tokens beside a decode and a 3-token verification gives each token the bytes the same
    call gives it decoded alone at its position (its sequence cut there)."""
    g = torch.Generator().manual_seed(3)
    H, HKV, D, BS = 4, 2, 16, 8
    dtype = torch.bfloat16
    kc = torch.randn(24, BS, HKV, D, generator=g).to(dtype).to(device)
    vc = torch.randn(24, BS, HKV, D, generator=g).to(dtype).to(device)
    tables = torch.arange(24, device=device).view(3, 8)
    lens = [40, 1, 3]
    ctx = [40, 29, 50]
    q = torch.randn(sum(lens), H, D, generator=g).to(dtype).to(device)
    cu = torch.tensor([0, 40, 41, 44], device=device)
    seq_lens = torch.tensor(ctx, device=device)
    ts, tq = attn_k.varlen_tiles(lens, range(3), 1)
    out = attn_k.paged_attention_varlen(q, kc, vc, tables, seq_lens, cu,
                                        torch.tensor(ts, device=device),
                                        torch.tensor(tq, device=device), D ** -0.5, 1)
    one = torch.zeros(1, dtype=torch.long, device=device)
    for row, (b, t) in enumerate(zip(ts, tq)):
        pos = ctx[b] - lens[b] + t
        o = attn_k.paged_attention_varlen(
            q[row:row + 1], kc, vc, tables[b:b + 1], torch.tensor([pos + 1], device=device),
            torch.tensor([0, 1], device=device), one, one, D ** -0.5, 1)
        assert torch.equal(_bits(o[0]), _bits(out[row])), (b, t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_attention_rows_as_decode(device, dtype):
    """The backend's attention in this mode, as the engine calls it: a step of decodes with
    contexts of 40 to 310 tokens (long enough for the default's split of the keys), a step of
    3-token verifications, and a step with a continued prompt chunk, a fresh prompt and a
    decode: every row the bytes of its token decoded alone at its position (fp32: a bf16
    output hides most changes of the sums' order)."""
    H, HKV, D, BS = 4, 2, 16, 8
    cfg = ModelConfig.from_dict(tiny_text_config(num_attention_heads=H, num_key_value_heads=HKV,
                                                 head_dim=D))
    be = CudaBackend(cfg, device, graphs=False, options=KernelOptions(batch_invariant=True))
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(200, BS, HKV, D, generator=g).to(dtype).to(device)
    vc = torch.randn(200, BS, HKV, D, generator=g).to(dtype).to(device)
    tables = [list(range(i * 40, i * 40 + 40)) for i in range(4)]

    def attend(tokens, starts, seqs, slots=None):
        batch = build_batch(tokens, starts, [tables[b] for b in seqs], BS,
                            list(range(len(seqs))), device=device)
        meta = be.plan_step(batch)
        T = batch.num_tokens
        q, k, v = (torch.randn(T, n, D, generator=g).to(dtype).to(device) for n in (H, HKV, HKV))
        return q, k, v, be.attention(meta, batch, q, k, v, kc, vc, D ** -0.5), batch

    def alone(b, pos, q, k, v):
        batch = build_batch([[1]], [pos], [tables[b]], BS, [0], device=device)
        return be.attention(be.plan_step(batch), batch, q[None], k[None], v[None], kc, vc,
                            D ** -0.5)[0]

    steps = [([[1]] * 4, [299, 150, 310, 40], [0, 1, 2, 3]),
             ([[1, 2, 3]] * 3, [200, 97, 305], [0, 1, 2]),
             ([[1] * 20, [1] * 12, [1]], [280, 0, 64], [1, 2, 3])]
    for tokens, starts, seqs in steps:
        q, k, v, out, batch = attend(tokens, starts, seqs)
        row = 0
        for b, n, s0 in zip(seqs, map(len, tokens), starts):
            for t in range(n):
                o = alone(b, s0 + t, q[row], k[row], v[row])
                assert torch.equal(_bits(o), _bits(out[row])), (starts, b, t)
                row += 1


# The engine ---------------------------------------------------------------------------------
# Small (every token costs under the interpreter) but with each layer kind, GQA, grouped value
# heads and the MTP layer; products wide enough that cuBLAS / torch sum a row differently by M.
CFG = tiny_text_config(hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=300,
                       num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1,
                       linear_num_value_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, num_hidden_layers=2,
                       layer_types=["linear_attention", "full_attention"])
VOCAB = 300
TARGETS = [  # (prompt length, params): greedy with logprobs, seeded sampling
    (30, dict(temperature=0, max_tokens=6, logprobs=2)),
    (17, dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, logprobs=1)),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("inv_cuda"), CFG, seed=1)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _llm(ckpt, invariant=True, **kw):
    return LLM(ckpt, dtype=kw.pop("dtype", "bfloat16"), device="cuda" if ON_GPU else "cpu",
               backend=BACKEND, batch_invariant=invariant, speculative_tokens=2,
               max_model_len=128, cache_memory=32 << 20, tokenizer=None, **kw)


def _targets():
    rng = random.Random(0)
    return [(_prompt(rng, n), SamplingParams(ignore_eos=True, **p)) for n, p in TARGETS]


def _alone(ckpt, invariant=True, dtype="bfloat16") -> list:
    """The targets alone, each prompt in one step, k = 0."""
    llm = _llm(ckpt, invariant, dtype=dtype, max_num_batched_tokens=64)
    return [_key(llm.generate([p], [sp], use_tqdm=False)[0]) for p, sp in _targets()]


def _compositions(ckpt, ref, invariant=True, n=2, seed=0, dtype="bfloat16"):
    """The targets among 1 to 3 random neighbours, n times, each with a random step budget,
    batch size, k and a preemption -> mismatches against ``ref``."""
    rng = random.Random(seed)
    mismatches, preemptions = [], 0
    for c in range(n):
        k = (0, 2)[c % 2]
        kw = dict(max_num_batched_tokens=rng.choice([5, 11, 16, 33]),
                  max_num_seqs=rng.choice([3, 5]))
        llm = _llm(ckpt, invariant, dtype=dtype, **kw)
        preempt_at(llm, rng, {rng.randrange(3, 12)})
        items = [(i, p, sp) for i, (p, sp) in enumerate(_targets())]
        for _ in range(rng.randint(1, 3)):
            sp = rng.choice([dict(temperature=0), dict(temperature=0.7, seed=rng.randrange(99))])
            items.append((None, _prompt(rng, rng.randint(1, 25)),
                          SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True, **sp)))
        rng.shuffle(items)
        before = llm.engine.stats["num_preemptions"]
        outs = llm.generate([p for _, p, _ in items], [sp for _, _, sp in items],
                            use_tqdm=False, speculative_tokens=k)
        preemptions += llm.engine.stats["num_preemptions"] - before
        for (i, _, _), out in zip(items, outs):
            if i is not None and _key(out) != ref[i]:
                got = _key(out)
                mismatches.append((c, i, "tokens" if got[0] != ref[i][0] else "logprobs", kw, k))
    return mismatches, preemptions


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_outputs_do_not_depend_on_the_batch(ckpt, dtype):
    """The targets alone against 2 random compositions (neighbours prompting and decoding,
    step budgets of 5 to 33 tokens, 3 or 5 sequences, k = 0 and 2, a preemption): every
    target's token ids and logprob bytes equal its run alone at k = 0. fp32: the mode computes
    the model, the greedy target's tokens those of the reference backend (plain torch) and its
    logprobs within 1e-4 of them."""
    ref = _alone(ckpt, dtype=dtype)
    if dtype == "float32":
        p, sp = _targets()[0]
        want = LLM(ckpt, dtype=dtype, backend="reference", max_model_len=128,
                   cache_memory=32 << 20, tokenizer=None).generate([p], sp, use_tqdm=False)[0]
        got = want.outputs[0]
        assert got.token_ids == list(ref[0][0])
        mine = struct.unpack(f"<{len(ref[0][1]) // 4}f", ref[0][1])
        theirs = [v for d in got.logprobs for _, v in sorted(d.items())]
        assert len(mine) == len(theirs)
        assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-4
    mismatches, preemptions = _compositions(ckpt, ref, dtype=dtype, seed=1 if dtype == "float32"
                                            else 0)
    assert mismatches == []
    assert preemptions >= 1


def test_default_mode_differs(ckpt):
    """The same harness without the mode finds a difference (cuBLAS / torch's product by M,
    fla's chunks, SDPA for fresh prompts): the harness can fail."""
    ref = _alone(ckpt, invariant=False)
    mismatches, _ = _compositions(ckpt, ref, invariant=False, n=1)
    assert mismatches


def test_prefix_cache_hit_as_cold(ckpt):
    """A target resuming from a prefix another request left in the cache (32 of its 44
    tokens: KV blocks and the GDN checkpoint at 32; at a step budget of 24 the checkpoint at
    16 falls inside a prompt chunk, which runs in two rounds), with k = 2, gives the bytes of
    its cold run alone."""
    rng = random.Random(3)
    base = _prompt(rng, 36)
    target = base + _prompt(rng, 8)
    other = base + _prompt(rng, 4)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    cold = _key(_llm(ckpt, enable_prefix_caching=False, max_num_batched_tokens=64)
                .generate([target], sp, use_tqdm=False)[0])
    llm = _llm(ckpt, checkpoint_interval=16, max_num_batched_tokens=24)
    llm.generate([other], SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = llm.generate([target], sp, use_tqdm=False, speculative_tokens=2)
    assert out.metrics["num_cached_tokens"] == 32
    assert _key(out) == cold


def test_async_scheduling_as_alone(ckpt):
    """Async scheduling (CUDA's default: a decode step launched while the previous step's
    tokens are still on the device) in this mode: greedy and seeded targets without logprobs
    (logprobs keep a step synchronous) among neighbours, with chained steps, give the token ids
    of their synchronous runs alone."""
    rng = random.Random(5)
    targets = [(_prompt(rng, 9), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
               (_prompt(rng, 4), SamplingParams(temperature=0.8, seed=7, max_tokens=10,
                                                ignore_eos=True))]
    alone = _llm(ckpt, async_scheduling=False, max_num_batched_tokens=64)
    ref = [alone.generate([p], [sp], use_tqdm=False, speculative_tokens=0)[0]
           .outputs[0].token_ids for p, sp in targets]
    llm = _llm(ckpt, async_scheduling=True, max_num_batched_tokens=11, max_num_seqs=4)
    others = [(_prompt(rng, rng.randint(2, 20)),
               SamplingParams(temperature=0, max_tokens=rng.randint(2, 8), ignore_eos=True))
              for _ in range(2)]
    items = targets + others
    outs = llm.generate([p for p, _ in items], [sp for _, sp in items], use_tqdm=False,
                        speculative_tokens=0)  # verification steps are not chained
    assert llm.engine.stats["num_chained_steps"] > 0
    assert [o.outputs[0].token_ids for o in outs[:2]] == ref
