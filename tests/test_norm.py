"""kernels/norm.py: RMSNorm, the gated RMSNorm and the L2 norm against their formulas and
transformers'."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from kernel_helpers import generator

from hybridrt.kernels import gated_rms_norm, l2_norm, rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_formula_and_transformers(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    gen = generator(13)
    x = (3 * torch.randn(5, 7, 33, generator=gen)).to(dtype)
    w = 0.1 * torch.randn(33, generator=gen)
    xf = x.float()
    expect = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    got = rms_norm(x, w.to(dtype), 1e-6)
    assert got.dtype == dtype
    assert_rel_close(got.float(), expect.to(dtype).float(), 1e-5 if dtype == torch.float32
                     else 8e-3, "rms_norm")
    hf = Qwen3_5RMSNorm(33, eps=1e-6).to(dtype)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(got, hf(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_rms_norm_matches_formula_and_transformers(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    gen = generator(14)
    x = (2 * torch.randn(6, 3, 9, generator=gen)).to(dtype)
    z = torch.randn(6, 3, 9, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(9, generator=gen)).to(dtype)
    xf = x.float()
    expect = w.float() * xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) \
        * z.float() * torch.sigmoid(z.float())
    got = gated_rms_norm(x, z, w, 1e-6)
    assert got.dtype == dtype
    assert_rel_close(got.float(), expect, 1e-5 if dtype == torch.float32 else 2e-2,
                     "gated_rms_norm")
    hf = Qwen3_5RMSNormGated(9, eps=1e-6).to(dtype)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(got, hf(x, z), rtol=0, atol=0)


def test_l2_norm_matches_formula():
    x = torch.randn(4, 3, 11, generator=generator(15))
    torch.testing.assert_close(l2_norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    assert torch.allclose(l2_norm(x).norm(dim=-1), torch.ones(4, 3), atol=1e-5)
