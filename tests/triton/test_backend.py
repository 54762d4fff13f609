"""The CUDA backend end to end against the reference backend, through the real engine.

On a GPU: backend "cuda" (CUDA graphs for decode and verify steps) on the GPU. Under
TRITON_INTERPRET=1 on CPU: backend "triton" (the same kernels, eager). Tiny published-layout
checkpoints with a power-of-two head dim (the Triton attention's requirement; other sizes fall
back to the reference attention) and grouped value heads.
"""

from __future__ import annotations

import pytest
import torch

from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
from hybridrt.testing import tiny_text_config, write_random_checkpoint

ON_GPU = torch.cuda.is_available()

CONFIG = tiny_text_config(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                          num_hidden_layers=8)
PROMPT_LENS = (1, 5, 17, 40, 70)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
BACKEND = "cuda" if ON_GPU else "triton"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny_cuda"), CONFIG, seed=5)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, CONFIG["vocab_size"], (n,), generator=g).tolist()
            for n in PROMPT_LENS]


def run(ckpt, prompts, dtype, backend, k=0, **kw):
    dev = "cuda" if ON_GPU else "cpu"
    llm = LLM(ckpt, dtype=dtype, device=dev, backend=backend, speculative_tokens=k,
              max_model_len=128, max_num_seqs=8, cache_memory=64 << 20, tokenizer=None, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.cache.all_free()
    return [o.outputs[0] for o in outs]


def chosen_logprobs(out) -> torch.Tensor:
    return torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_matches_reference(ckpt, prompts, dtype):
    """Greedy tokens equal to the reference backend's (fp32; bf16 until the first position
    where the reference's top two are within bf16 rounding), logprobs within tolerance."""
    ref = run(ckpt, prompts, dtype, "reference")
    ours = run(ckpt, prompts, dtype, BACKEND)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for i, (r, o) in enumerate(zip(ref, ours)):
        if dtype == "float32":
            assert o.token_ids == r.token_ids, f"prompt {i}"
            n = len(r.token_ids)
        else:
            n = next((j for j, (a, b) in enumerate(zip(r.token_ids, o.token_ids)) if a != b),
                     len(r.token_ids))
            if n < len(r.token_ids):  # only where the reference's choice was a near tie
                lp = r.logprobs[n]
                top = sorted(lp.values(), reverse=True)
                assert top[0] - top[1] < 0.1, f"prompt {i}: diverged at {n} without a near tie"
        err = (chosen_logprobs(o)[:n] - chosen_logprobs(r)[:n]).abs().max().item() if n else 0
        assert err <= tol, f"prompt {i}: logprob error {err:.3g}"


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_is_lossless(ckpt, prompts, k):
    """MTP speculation on this backend: greedy output equal to its own k=0 output (verify
    steps write per-position GDN states and roll back through the slot table)."""
    base = run(ckpt, prompts, "float32", BACKEND)
    spec = run(ckpt, prompts, "float32", BACKEND, k=k)
    for i, (b, s) in enumerate(zip(base, spec)):
        assert s.token_ids == b.token_ids, f"prompt {i}, k={k}"


def test_chunked_prefill_mixed_with_decodes(ckpt, prompts):
    """A small token budget (prompt chunks continuing from a state, mixed with decodes in
    one step): same tokens as with the whole prompts at once."""
    base = run(ckpt, prompts, "float32", BACKEND)
    tight = run(ckpt, prompts, "float32", BACKEND, max_num_batched_tokens=24)
    for i, (b, t) in enumerate(zip(base, tight)):
        assert t.token_ids == b.token_ids, f"prompt {i}"
