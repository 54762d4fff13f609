"""Batch-invariant mode (issue 27, docs/batch_invariance.md): a request's token ids and logprobs
are the same bytes whatever runs beside it, however the scheduler chunks its prompt, after
preemption, on any thread count, and for greedy requests with MTP speculation on or off.

The kernels first (each row of the invariant products bit for bit its value alone), then the
engine: requests run alone against many random batch compositions around them, on CPU in bf16
(both half-weight paths), fp32, int8 and int4 (each of their paths this machine has), with the
fused layers' vector loops at each width; then the same harness in the default mode, which must find
a difference (or the harness could not fail)."""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import output_bytes as _key
from helpers import preempt_at

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import (
    QWEN35_08B_TEXT_CONFIG,
    tiny_text_config,
    write_random_checkpoint,
)
from hybridrt.kernels import int4, native, quant
from hybridrt.kernels.rope import RopeTable, rope_cos_sin

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

HALF_PATHS = native.half_paths()
needs_kernels = pytest.mark.skipif(not HALF_PATHS, reason="compiled CPU kernels unavailable")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


# Kernels ------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("path", HALF_PATHS)
@pytest.mark.parametrize("N, K", [(100, 64), (77, 200), (1000, 1030), (30, 7), (130, 2100),
                                  (50, 3100)])
def test_gemv_rows_every_row_as_alone(path, N, K):
    """native.gemv_rows over 9 to 70 rows: each row the bits half_gemv gives it alone (1 row),
    in bf16 and fp32 outputs, weights of several panels and K tails, K in blocks (past 1024:
    the sums carried from block to block); near the fp64 product."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(70, K, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    for out in (torch.bfloat16, torch.float32):
        alone = torch.cat([native.half_gemv(x[i:i + 1], w, path, out) for i in range(70)])
        for m in (9, 16, 17, 70):
            y = native.gemv_rows(x[:m], w, path, out)
            assert torch.equal(_bits(y), _bits(alone[:m])), (m, out)
        tol = 1e-2 if out == torch.bfloat16 else 1e-5
        assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * K ** 0.5)


@needs_kernels
def test_f32_gemm_rows_every_row_as_alone():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(300, 77, generator=g), torch.randn(40, 77, generator=g)
    y = native.f32_gemm_rows(x, w)
    assert torch.equal(y, torch.cat([native.f32_gemm_rows(x[i:i + 1], w) for i in range(40)]))
    assert torch.allclose(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="f32_gemm_rows: x"):
        native.f32_gemm_rows(x, w.bfloat16())


@pytest.mark.parametrize("isa", quant.available_isas() or ["none"])
def test_int8_rows_every_row_as_alone(isa):
    """The int8 products are row-invariant at every row count (up to 8 rows one tile, more in
    tiles of 4 by 2 panels): 40 rows against each row alone, bf16 and fp32 activations."""
    if isa == "none":
        pytest.skip("compiled CPU kernels unavailable")
    g = torch.Generator().manual_seed(2)
    qw = quant.quantize(torch.randn(200, 96, generator=g).bfloat16())
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(40, 96, generator=g).to(dtype)
        y = quant.linear(x, qw, isa)
        alone = torch.cat([quant.linear(x[i:i + 1], qw, isa) for i in range(40)])
        assert torch.equal(_bits(y), _bits(alone))


@pytest.mark.parametrize("isa", int4.available_isas() or ["none"])
def test_int4_rows_every_row_as_alone(isa):
    """The 4-bit products likewise (the GEMV's tiles up to 8 rows, the GEMM's of 4 rows by 2
    panels beyond, x quantized by the threads past 2^16 activations), and the 6-bit LM head's:
    40 and 70 rows against each row alone, bf16 and fp32 activations, 2 threads."""
    if isa == "none":
        pytest.skip("compiled CPU kernels unavailable")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 1000, generator=g).bfloat16()
    torch.set_num_threads(2)
    try:
        for qw, dtype in ((int4.quantize(w, b), d) for b in (4, 6)
                          for d in (torch.bfloat16, torch.float32)):
            x = torch.randn(70, 1000, generator=g).to(dtype)
            alone = torch.cat([int4.linear(x[i:i + 1], qw, isa) for i in range(70)])
            for m in (40, 70):
                assert torch.equal(_bits(int4.linear(x[:m], qw, isa)), _bits(alone[:m])), m
    finally:
        torch.set_num_threads(1)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [37, 45])
def test_silu_mul_by_column(dtype, n):
    """native.silu_mul: each element's result fixed by its column (one row alone, or among
    others, the same bits), within one bf16 rounding (or 1e-6) of the torch ops; 16-lane,
    8-lane and scalar columns (45 = 16 + 16 + 8 + 5 on AVX-512 builds, 8 x 5 + 5 on AVX2)."""
    g = torch.Generator().manual_seed(3)
    both = (3 * torch.randn(33, 2 * n, generator=g)).to(dtype)
    gate, up = both[:, :n], both[:, n:]
    y = native.silu_mul(gate, up)
    alone = torch.cat([native.silu_mul(gate[i:i + 1], up[i:i + 1]) for i in range(33)])
    assert torch.equal(_bits(y), _bits(alone))
    ref = (F.silu(gate.float()).to(dtype).float() * up.float())
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(y.float(), ref, rtol=tol, atol=tol)


def test_rope_table_by_position():
    """RopeTable: a position's cos and sin the same bits in any step (alone, in a long prompt,
    across the table's growth), within a bf16 rounding of rope_cos_sin."""
    table = RopeTable(12, 10000.0)
    pos = torch.arange(1200)
    cos, sin = table(pos, torch.bfloat16)
    for p in (0, 5, 511, 512, 1199):
        c1, s1 = RopeTable(12, 10000.0)(torch.tensor([p]), torch.bfloat16)
        assert torch.equal(_bits(c1[0]), _bits(cos[p])) and torch.equal(_bits(s1[0]), _bits(sin[p]))
    rc, rs = rope_cos_sin(pos, 12, 10000.0, torch.float32)
    assert torch.allclose(cos.float(), rc, atol=2 ** -8) and torch.allclose(sin.float(), rs,
                                                                            atol=2 ** -8)


# The engine ---------------------------------------------------------------------------------
# wide enough that a product's sums, a norm's or the attention's change with the row count
CFG = tiny_text_config(hidden_size=256, intermediate_size=512, head_dim=32, vocab_size=300,
                       linear_key_head_dim=32, linear_value_head_dim=32)
VOCAB = 300
TARGETS = [  # (prompt length, params): greedy, seeded sampling, greedy with a penalty
    (45, dict(temperature=0, max_tokens=14, logprobs=2)),
    (23, dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=14, logprobs=1)),
    (70, dict(temperature=0, max_tokens=10, logprobs=0, repetition_penalty=1.2)),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("inv"), CFG, seed=1)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _llm(ckpt, setting, invariant=True, threads=1, **kw):
    dtype, quantization = setting
    kw.setdefault("max_model_len", 160)
    kw.setdefault("cache_memory", 64 << 20)
    return LLM(ckpt, dtype=dtype, quantization=quantization, batch_invariant=invariant,
               threads=threads, speculative_tokens=2, **kw)


def _targets():
    rng = random.Random(0)
    return [(_prompt(rng, n), SamplingParams(ignore_eos=True, **p)) for n, p in TARGETS]


def _alone(ckpt, setting, invariant=True) -> dict[int, list]:
    """Each target run alone, the whole prompt in one step, at k = 0 and k = 2."""
    llm = _llm(ckpt, setting, invariant, max_num_batched_tokens=128)
    return {k: [_key(llm.generate([p], [sp], use_tqdm=False, speculative_tokens=k)[0])
                for p, sp in _targets()] for k in (0, 2)}


def _compositions(ckpt, setting, ref, invariant=True, n=4, seed=0):
    """Run the targets among random neighbours n times, each time with a random step budget
    (chunk sizes), batch size, thread count, k, order and preemption points -> (mismatches
    [(composition, target, what, ...)], preemptions seen)."""
    rng = random.Random(seed)
    mismatches, preemptions = [], 0
    for c in range(n):
        k = rng.choice([0, 2])
        kw = dict(max_num_batched_tokens=rng.choice([5, 16, 33, 64, 128]),
                  max_num_seqs=rng.choice([3, 5, 8]))
        llm = _llm(ckpt, setting, invariant, threads=rng.choice([1, 2]), **kw)
        preempt_at(llm, rng, set(rng.sample(range(1, 40), 3)))
        items = [(i, p, sp) for i, (p, sp) in enumerate(_targets())]
        for _ in range(rng.randint(0, 6)):
            sp = rng.choice([
                dict(temperature=0), dict(temperature=1.0),
                dict(temperature=0.7, seed=rng.randrange(100), logprobs=3)])
            items.append((None, _prompt(rng, rng.randint(1, 80)),
                          SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True, **sp)))
        rng.shuffle(items)
        before = llm.engine.stats["num_preemptions"]
        outs = llm.generate([p for _, p, _ in items], [sp for _, _, sp in items],
                            use_tqdm=False, speculative_tokens=k)
        preemptions += llm.engine.stats["num_preemptions"] - before
        torch.set_num_threads(1)
        for (i, _, _), out in zip(items, outs):
            if i is None:
                continue
            # k = 2 must give k = 0's bytes, greedy or seeded (coupled verification)
            want = ref[0][i]
            got = _key(out)
            if got != want:
                what = "tokens" if got[0] != want[0] else "logprobs"
                mismatches.append((c, i, what, kw, k))
    return mismatches, preemptions


SETTINGS = [  # (dtype, quantization), the kernel paths forced through the environment
    pytest.param(("bfloat16", None), {"HYBRIDRT_HALF_PATH": "bf16dot"}, id="bf16-bf16dot",
                 marks=pytest.mark.skipif("bf16dot" not in HALF_PATHS, reason="no AVX512-BF16")),
    pytest.param(("bfloat16", None), {"HYBRIDRT_HALF_PATH": "fma", "HYBRIDRT_FUSED_SIMD": "avx2"},
                 id="bf16-fma-avx2"),
    pytest.param(("float32", None), {"HYBRIDRT_FUSED_SIMD": "0"}, id="fp32-plain"),
    pytest.param(("float32", None), {}, id="fp32"),
    pytest.param(("bfloat16", "int8"), {"HYBRIDRT_INT8_ISA": "vnni"}, id="int8-vnni",
                 marks=pytest.mark.skipif("vnni" not in quant.available_isas(),
                                          reason="no AVX-512 VNNI")),
    pytest.param(("bfloat16", "int8"), {"HYBRIDRT_INT8_ISA": "avx2",
                                        "HYBRIDRT_FUSED_SIMD": "avx2"}, id="int8-avx2",
                 marks=pytest.mark.skipif("avx2" not in quant.available_isas(),
                                          reason="no AVX2 int8 path")),
    pytest.param(("bfloat16", "int4"), {"HYBRIDRT_INT4_ISA": "vnni"}, id="int4-vnni",
                 marks=pytest.mark.skipif("vnni" not in int4.available_isas(),
                                          reason="no AVX-512 VNNI")),
    pytest.param(("bfloat16", "int4"), {"HYBRIDRT_INT4_ISA": "avxvnni"}, id="int4-avxvnni",
                 marks=pytest.mark.skipif("avxvnni" not in int4.available_isas(),
                                          reason="no 256-bit VNNI")),
    pytest.param(("bfloat16", "int4"), {"HYBRIDRT_INT4_ISA": "avx2", "HYBRIDRT_INT8_ISA": "avx2",
                                        "HYBRIDRT_FUSED_SIMD": "avx2"}, id="int4-avx2",
                 marks=pytest.mark.skipif("avx2" not in int4.available_isas(),
                                          reason="no AVX2 int4 path")),
]


@needs_kernels
@pytest.mark.parametrize("setting, env", SETTINGS)
def test_outputs_do_not_depend_on_the_batch(ckpt, setting, env, monkeypatch):
    """The targets alone (one prompt chunk, k = 0) against 4 random compositions: neighbours
    (prompts, greedy / random / seeded), step budgets of 5 to 128 tokens, 3 to 8 sequences,
    1 or 2 threads, k = 0 or 2, preemptions at random steps: every target's token ids and
    logprob bytes equal its run alone at k = 0 (greedy and seeded)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ref = _alone(ckpt, setting)
    assert ref[0] == ref[2]  # k = 2 as k = 0, the seeded target included
    mismatches, preemptions = _compositions(ckpt, setting, ref)
    assert mismatches == []
    assert preemptions >= 4  # recomputes among them


@needs_kernels
def test_default_mode_differs(ckpt):
    """The same harness without the mode finds differences (bf16: the GEMM's blocking and the
    attention and GDN prompt forms depend on the batch): the harness can fail."""
    setting = ("bfloat16", None)
    ref = _alone(ckpt, setting, invariant=False)
    mismatches, _ = _compositions(ckpt, setting, ref, invariant=False, n=4)
    assert mismatches


# Greedy speculation at the 0.8B shape -------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt_08b(tmp_path_factory):
    """The 0.8B widths and vocabulary, 4 layers (3 GDN, 1 attention) and the MTP layer, random
    bf16 weights: the numerics of the published shape at a sixth of its depth."""
    cfg = dict(QWEN35_08B_TEXT_CONFIG, num_hidden_layers=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
    directory = tmp_path_factory.mktemp("inv08b")
    yield write_random_checkpoint(directory, cfg, seed=0, dtype=torch.bfloat16)
    shutil.rmtree(directory, ignore_errors=True)  # ~1 GB: gone before the next module starts


@needs_kernels
def test_greedy_k3_equals_k0_at_08b_shape(ckpt_08b):
    """bf16, 0.8B shape, random weights, 4 requests side by side: greedy with 3 MTP drafts a
    step gives k = 0's token ids and logprob bytes (verification rows computed as decode
    rows). The default mode is not held to it (the case issue 27 starts from): its products
    may round a verify step's rows apart from a decode step's. (It differed here until steps
    mixing verification and decode rows ran the compiled attention, 09caaa1; those steps fell
    to the reference's, and now give the same bytes on this machine's kernels.)"""
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 240000) for _ in range(n)] for n in (40, 9, 77, 20)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    llm = LLM(ckpt_08b, dtype="bfloat16", speculative_tokens=3, max_model_len=128,
              max_num_seqs=4, cache_memory=256 << 20, batch_invariant=True)
    keys = {k: [_key(o) for o in llm.generate(prompts, sp, use_tqdm=False, speculative_tokens=k)]
            for k in (0, 3)}
    assert keys[3] == keys[0]


# Bad input ----------------------------------------------------------------------------------
def test_batch_invariant_errors(ckpt):
    with pytest.raises(ValueError, match="batch_invariant must be True or False, got 1"):
        LLM(ckpt, batch_invariant=1)
    with pytest.raises(ValueError, match="batch_invariant=True runs on the cpu and cuda "
                       "backends, not the reference one"):
        LLM(ckpt, batch_invariant=True, backend="reference")


# Prefix-cache hits ---------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("setting", [("bfloat16", None), ("float32", None), ("bfloat16", "int8"),
                                     ("bfloat16", "int4")], ids=["bf16", "fp32", "int8", "int4"])
def test_prefix_cache_hit_as_cold(ckpt, setting):
    """Two targets resuming from a prefix another request left in the cache (a hit of 48
    tokens, checkpoints every 16) or the first target wrote (64, or 70 where the two part: a
    branch point found as they were queued together) give their cold run's bytes, at step
    budgets of 128 and 16 and k = 0 and 2: the KV and GDN states a hit reads were computed
    position by position, as a cold run computes them."""
    rng = random.Random(0)
    base = _prompt(rng, 70)
    targets = [base + _prompt(rng, 9), base + _prompt(rng, 30)]
    other = base[:50] + _prompt(rng, 20)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True,
                             logprobs=1)]
    cold = None
    for k in (0, 2):
        for budget in (128, 16):
            fresh = dict(max_num_batched_tokens=budget, checkpoint_interval=16)
            llm = _llm(ckpt, setting, **fresh)
            alone = [_key(llm.generate([t], [sp], use_tqdm=False, speculative_tokens=k)[0])
                     for t, sp in zip(targets, params)]
            cold = cold or alone
            assert alone == cold
            llm = _llm(ckpt, setting, **fresh)
            llm.generate([other], params[:1], use_tqdm=False, speculative_tokens=k)
            outs = llm.generate(targets, params, use_tqdm=False, speculative_tokens=k)
            hits = [o.metrics["num_cached_tokens"] for o in outs]
            assert hits[0] == 48 and hits[1] in (64, 70)  # 70: the branch point had a slot
            assert [_key(o) for o in outs] == cold


def test_cli_flag():
    """--batch-invariant on generate: the demo model's seeded sample of a prompt alone is the
    one it gets beside another prompt; with --device cuda the flag is accepted (the CUDA
    backend has the mode: tests/gpu/test_batch_invariance_cuda.py), the device checked as
    without it."""
    import json

    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    def run(*args):
        return CliRunner().invoke(app, ["generate", "--batch-invariant", "--max-tokens", "6",
                                        "--seed", "3", "--threads", "1", *args])

    alone = run("-p", "def read(path):")
    both = run("-p", "import os", "-p", "def read(path):")
    assert alone.exit_code == 0 and both.exit_code == 0, alone.output + both.output
    lines = [[json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
             for r in (alone, both)]
    assert lines[0][0]["token_ids"] == lines[1][1]["token_ids"]
    if not torch.cuda.is_available():
        res = run("--device", "cuda", "-p", "x")
        assert res.exit_code != 0 and "--device cuda: CUDA is not available" in res.output


# Coupled verification is lossless ----------------------------------------------------------
@pytest.mark.parametrize("case", ["t1", "t0.8-topk5-topp0.9"])
def test_coupled_verification_follows_the_target(case):
    """Seeded rows of a positional sampler (batch-invariant mode) verify drafts by coupling:
    over 4000 rounds (a seed each) the token emitted at every position, the bonus one included,
    follows the exact target distribution (chi-square, as test_rejection_sampling.py checks the
    rejection sampler), accepted drafts are the emitted prefix, and each round emits what the
    same seed samples without drafts."""
    from helpers import chi2_pvalue
    from test_rejection_sampling import (
        CASES,
        MIN_PVALUE,
        ROUNDS,
        K,
        V,
        _reference_probs,
        _target_logits,
    )

    from hybridrt.sampler import Sampler, SamplingRow, make_generator
    from hybridrt.specdec.verify import VerifyItem, verify_drafts

    params, draft_of = CASES[case]
    target_logits, draft_logits = _target_logits()
    p = torch.stack([_reference_probs(row, params) for row in target_logits])
    q = draft_of(draft_logits).float()
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[i], ROUNDS, replacement=True, generator=g)
                          for i in range(K)], dim=1).tolist()
    items, plain = [], []
    for r in range(ROUNDS):
        sp = dataclasses.replace(params, seed=r)
        rows = [SamplingRow(sp, [1, 2], [3] * j, make_generator(sp)) for j in range(K + 1)]
        items.append(VerifyItem(rows, drafts[r], q))
        plain.append(rows)
    sampler = Sampler(positional=True)
    results = verify_drafts(sampler, target_logits.repeat(ROUNDS, 1), items)
    counts = torch.zeros(K + 1, V, dtype=torch.float64)
    for r, (emitted, a) in enumerate(results):
        assert emitted[:a] == drafts[r][:a] and (a == K or emitted[a] != drafts[r][a])
        for j, tok in enumerate(emitted):
            counts[j, tok] += 1
        if r < 50:  # without drafts: the same tokens, position by position
            alone = [int(sampler.sample(target_logits[j][None], [plain[r][j]]).token_ids[0])
                     for j in range(a + 1)]
            assert alone == emitted
    assert (counts[p == 0] == 0).all()
    for j in range(K + 1):
        stat, df, pval = chi2_pvalue(counts[j], p[j])
        assert pval > MIN_PVALUE, f"position {j}: chi2 {stat:.1f} (df {df}), p = {pval:.2g}"


@needs_kernels
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-4), ("bfloat16", 0.15)])
def test_as_accurate_as_the_default_mode(ckpt, dtype, tol):
    """The mode computes the model: four prompts' greedy tokens equal the reference backend's
    (plain torch) and their top-5 logprobs within tol of it, as the default CPU path's are
    (fp32: 5e-5 measured; bf16: 0.05-0.06), except where the reference's two best tokens are
    within tol of each other: there either may come first (on the fma path one prompt's do,
    the default mode's choice the same as the mode's), and the sequences part there."""
    rng = random.Random(0)
    prompts = [_prompt(rng, n) for n in (45, 23, 70, 5)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    ref, inv, default = (LLM(ckpt, dtype=dtype, max_model_len=160, cache_memory=64 << 20,
                             max_num_batched_tokens=32, **kw).generate(prompts, sp,
                                                                       use_tqdm=False)
                         for kw in (dict(backend="reference"), dict(batch_invariant=True), {}))
    parted = 0
    for a, b, c in zip(ref, inv, default):
        a, b = a.outputs[0], b.outputs[0]
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            assert all(abs(la[t] - lb[t]) < tol for t in la if t in lb)
            if ta != tb:  # a near tie in the reference, and the default mode's choice too
                assert tb in la and la[ta] - la[tb] < tol, (ta, tb, la)
                assert c.outputs[0].token_ids == b.token_ids
                parted += 1
                break
    assert parted <= 1
