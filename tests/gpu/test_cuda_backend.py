"""The CUDA backend end to end against the reference backend, through the real engine.

On a GPU: backend "cuda" (CUDA graphs for decode and verify steps) on the GPU. Under
TRITON_INTERPRET=1 on CPU: backend "triton" (the same kernels, eager). Tiny published-layout
checkpoints with a power-of-two head dim (the Triton attention's requirement; other sizes fall
back to the reference attention) and grouped value heads.
"""

from __future__ import annotations

import contextlib

import fla_interpret
import pytest
import torch
from helpers import assert_rel_close, run_mixed_steps
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.kernels.backend import ReferenceBackend
from hybridrt.kernels.cuda.backend import CudaBackend, UniformAttention, VarlenAttention
from hybridrt.kernels.cuda.prefill import FP32_EXACT
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams

ON_GPU = torch.cuda.is_available()
# fla's fp32 products in tf32 (on a GPU, or emulated by the interpreter) unless chunk_prefill
# can keep them in fp32 (kernels/cuda/prefill.py)
TF32 = (ON_GPU or fla_interpret.TF32) and not FP32_EXACT

# Two layers of each kind (each with its own KV cache or state slots): the steps and kernels
# are the same for every layer, and under the interpreter every layer's prompt chunks cost.
CONFIG = tiny_text_config(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                          num_hidden_layers=4,
                          layer_types=["linear_attention", "full_attention"] * 2)
# The bf16 test's bound is the reference's own bf16 drift, which grows with depth: its model
# keeps eight layers.
CONFIG_BF16 = tiny_text_config(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                               num_hidden_layers=8)
PROMPT_LENS = (1, 5, 17, 40, 70)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
BACKEND = "cuda" if ON_GPU else "triton"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_cuda"), CONFIG, seed=5)


@pytest.fixture(scope="module")
def ckpt_bf16(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_cuda8"), CONFIG_BF16, seed=5)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, CONFIG["vocab_size"], (n,), generator=g).tolist()
            for n in PROMPT_LENS]


def run(ckpt, prompts, dtype, backend, k=0, params=GREEDY, **kw):
    dev = "cuda" if ON_GPU else "cpu"
    llm = LLM(ckpt, dtype=dtype, device=dev, backend=backend, speculative_tokens=k,
              max_model_len=128, max_num_seqs=8, cache_memory=64 << 20, tokenizer=None, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.cache.all_free()
    return [o.outputs[0] for o in outs]


def chosen_logprobs(out) -> torch.Tensor:
    return torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])


_RUNS: dict = {}


def cached_run(ckpt, prompts, dtype, backend):
    key = (str(ckpt), dtype, backend)
    if key not in _RUNS:
        _RUNS[key] = run(ckpt, prompts, dtype, backend)
    return _RUNS[key]


def _agree(a, b) -> int:
    """Length of the common prefix of two outputs' tokens."""
    return next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                len(a.token_ids))


def _lp_err(a, b, n) -> float:
    return (chosen_logprobs(a)[:n] - chosen_logprobs(b)[:n]).abs().max().item() if n else 0.0


def test_backend_matches_reference_fp32(ckpt, prompts):
    """fp32: every greedy token equal to the reference backend's, chosen-token logprobs within
    1e-4. fla's chunked kernel multiplies fp32 in tf32 on a GPU (~1e-3 relative) unless
    told otherwise, which chunk_prefill does where Triton allows (FP32_EXACT); without that the
    bf16 rule below applies, with fp32's own tolerances. ``HYBRIDRT_INTERPRET_TF32=1``
    emulates the GPU's tf32 on CPU."""
    ref = cached_run(ckpt, prompts, "float32", "reference")
    ours = cached_run(ckpt, prompts, "float32", BACKEND)
    for i, (r, o) in enumerate(zip(ref, ours)):
        n = _agree(r, o)
        if not TF32:
            assert n == len(r.token_ids), f"prompt {i}: diverged at {n}"
            assert _lp_err(o, r, n) <= 1e-4, f"prompt {i}"
        else:
            _check_drift(i, r, o, n, bound=2e-2)


def test_backend_matches_reference_bf16(ckpt_bf16, prompts):
    """bf16, bounded by the reference backend's own bf16 rounding drift. Teacher-forced (a
    random tiny model's greedy runs in bf16 part ways after a few tokens whatever computes
    them): the prompts extended by 0, 3 and 7 tokens of the fp32 reference's output are
    prefilled by both bf16 backends and by the fp32 reference, one new token each. At every
    position our logprob of the fp32 choice stays within twice the largest error the
    reference's own bf16 run shows there, and our token equals the fp32 one unless the fp32
    top two were closer than that."""
    ref = cached_run(ckpt_bf16, prompts, "float32", "reference")
    seqs = [p + r.token_ids[:j] for p, r in zip(prompts, ref) for j in (0, 3, 7)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=3)
    ref32, ref16, ours = (run(ckpt_bf16, seqs, dt, be, params=one) for dt, be in (
        ("float32", "reference"), ("bfloat16", "reference"), ("bfloat16", BACKEND)))

    def err(out, want):
        tok = want.token_ids[0]
        lp = out.logprobs[0]
        return abs(lp[tok] - want.logprobs[0][tok]) if tok in lp else float("inf")

    drift = max(err(r16, r32) for r16, r32 in zip(ref16, ref32))
    assert drift > 0, "the reference's bf16 run equals its fp32 one: no bound to test against"
    for i, (r, o) in enumerate(zip(ref32, ours)):
        assert err(o, r) <= 2 * drift, f"sequence {i}: logprob error {err(o, r):.3g}"
        if o.token_ids != r.token_ids:
            top = sorted(r.logprobs[0].values(), reverse=True)
            margin = top[0] - top[1]
            assert margin <= 2 * drift, f"sequence {i}: other token at fp32 margin {margin:.3g}"


def _check_drift(i, r, o, n, bound):
    assert _lp_err(o, r, n) <= bound, f"prompt {i}: logprob error {_lp_err(o, r, n):.3g}"
    if n < len(r.token_ids):  # only where the reference's choice was a near tie
        top = sorted(r.logprobs[n].values(), reverse=True)
        assert top[0] - top[1] <= bound, (
            f"prompt {i}: diverged at {n}, reference margin {top[0] - top[1]:.3g} > {bound:.3g}")


@pytest.mark.parametrize("k", [3])
def test_speculation_is_lossless(ckpt, prompts, k):
    """MTP speculation on this backend: greedy output equal to its own k=0 output (verify
    steps write per-position GDN states and roll back through the slot table)."""
    base = cached_run(ckpt, prompts, "float32", BACKEND)
    spec = run(ckpt, prompts, "float32", BACKEND, k=k)
    for i, (b, s) in enumerate(zip(base, spec)):
        assert s.token_ids == b.token_ids, f"prompt {i}, k={k}"


def test_prefix_cache_checkpoint_inside_a_prompt_chunk(ckpt, prompts):
    """Prefix caching on this backend, with MTP speculation: the checkpoint at 24, inside the
    first prompt's one chunk, is written by the fla prefill path run in two rounds; a prompt
    sharing its first 30 tokens resumes there (the MTP KV before it rewritten from the
    checkpoint's hidden state) and gives the tokens this backend gives it cold."""
    dev = "cuda" if ON_GPU else "cpu"
    kw = dict(dtype="float32", device=dev, backend=BACKEND, max_model_len=128, max_num_seqs=8,
              cache_memory=64 << 20, tokenizer=None, speculative_tokens=3)
    llm = LLM(ckpt, checkpoint_interval=24, **kw)
    a, b = prompts[4], prompts[4][:30] + prompts[3][:20]
    llm.generate([a], GREEDY, use_tqdm=False)
    assert llm.engine.cached_tokens(b) == 24
    (out,) = llm.generate([b], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 24
    llm.engine.cache.check()
    (want,) = LLM(ckpt, enable_prefix_caching=False, **kw).generate([b], GREEDY, use_tqdm=False)
    o, w = out.outputs[0], want.outputs[0]
    n = _agree(w, o)
    if not TF32:
        assert n == len(w.token_ids) and _lp_err(o, w, n) <= 1e-4
    else:
        _check_drift(0, w, o, n, bound=2e-2)


def test_chunked_prefill_mixed_with_decodes(ckpt, prompts):
    """A small token budget (prompt chunks continuing from a state, mixed with decodes in
    one step): same tokens as with the whole prompts at once."""
    base = cached_run(ckpt, prompts, "float32", BACKEND)
    tight = run(ckpt, prompts, "float32", BACKEND, max_num_batched_tokens=24)
    for i, (b, t) in enumerate(zip(base, tight)):
        assert t.token_ids == b.token_ids, f"prompt {i}"


def test_async_scheduling_same_tokens(ckpt, prompts):
    """Decode steps launched before the previous step's tokens reach the host (async
    scheduling: on by default on CUDA, where the sampled tokens feed the next step on the
    device) give the synchronous engine's tokens on this backend, stop tokens seen one step
    late included (without logprobs, which keep a step synchronous)."""
    ref = cached_run(ckpt, prompts, "float32", BACKEND)  # logprobs: never chained
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             stop_token_ids=[r.token_ids[3]] if i % 2 else [])
              for i, r in enumerate(ref)]
    llm = LLM(ckpt, dtype="float32", device="cuda" if ON_GPU else "cpu", backend=BACKEND,
              max_model_len=128, max_num_seqs=8, cache_memory=64 << 20, tokenizer=None,
              async_scheduling=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats["num_chained_steps"] > 0 and llm.engine.cache.all_free()
    for i, (o, r) in enumerate(zip(outs, ref)):
        n = r.token_ids.index(r.token_ids[3]) + 1 if i % 2 else MAX_TOKENS
        assert o.outputs[0].token_ids == r.token_ids[:n], f"prompt {i}"


@pytest.mark.parametrize("heads", [(4, 2, 2, 4), (3, 1, 4, 4)], ids=["gqa2-grouped", "gqa3-equal"])
def test_backend_steps_match_reference(device, heads):
    """Whole model steps on this backend against the reference backend: fresh prompts (SDPA),
    a decode + a continued chunk + a verification of 3 drafts in one step (the varlen paged
    attention and fla's chunked kernels beside the recurrent one), decodes only and
    verifications only (the uniform kernels; CUDA graphs on a GPU): hidden states, conv and
    recurrent states of every slot, KV caches. fp32: with random weights bf16 rounding alone
    moves these tiny models' hidden states by tens of percent (the end-to-end bf16 test bounds
    it by the reference's own drift instead)."""
    H, HKV, HK, HV = heads
    dtype = torch.float32
    cfg = tiny_text_config(num_attention_heads=H, num_key_value_heads=HKV, head_dim=16,
                           linear_num_key_heads=HK, linear_num_value_heads=HV,
                           linear_key_head_dim=16, linear_value_head_dim=16)
    plans = []

    def cuda_backend(config):
        be = CudaBackend(config, device, graphs=ON_GPU)
        plan_step = be.plan_step

        def recorded(batch):
            meta = plan_step(batch)
            plans.append(meta.attention)
            return meta

        be.plan_step = recorded
        return be

    h_ref, c_ref, _ = run_mixed_steps(lambda c: ReferenceBackend(c, device), cfg, dtype, device)
    # on CPU, the fresh prompts' SDPA must take the flash kernel (the CUDA one takes no fp32)
    with contextlib.nullcontext() if ON_GPU else sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        h_our, c_our, graphed = run_mixed_steps(cuda_backend, cfg, dtype, device)
    assert [type(p) for p in plans] == [VarlenAttention, VarlenAttention, UniformAttention,
                                        UniformAttention]
    assert len(plans[0].fresh) == 3 and plans[0].tile_seq is None  # every prompt by SDPA
    assert not plans[1].fresh and plans[1].tile_seq.numel() == 3  # one tile a sequence
    assert graphed == [False, False, ON_GPU, ON_GPU]
    tol = 1e-4  # fla's chunked algorithm differs from the reference's by ~1e-5
    for i, (a, b) in enumerate(zip(h_our, h_ref)):
        assert_rel_close(a.cpu(), b.cpu(), tol, f"step {i} hidden")
    assert_rel_close(c_our.ssm_states.cpu(), c_ref.ssm_states.cpu(), tol, "recurrent states")
    assert_rel_close(c_our.conv_states.cpu(), c_ref.conv_states.cpu(), tol, "conv states")
    for name in ("key_caches", "value_caches"):
        for i, (a, b) in enumerate(zip(getattr(c_our, name), getattr(c_ref, name))):
            assert_rel_close(a.cpu(), b.cpu(), tol, f"{name} {i}")
