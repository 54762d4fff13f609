"""RMS norms used by Qwen3.5, computed in fp32.

``rms_norm``: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` (weights stored zero-centred).
``gated_rms_norm``: the GDN output norm, ``w * rmsnorm(x) * silu(z)`` with a plain weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """x, z: [..., D] (per head), weight: [D] -> [..., D] in x's dtype.

    The rounding order follows the reference: normalise in fp32, round to x's dtype, scale by
    the weight, then multiply by silu(z) in fp32.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., D] -> x / sqrt(sum(x^2) + eps) along the last dim (same dtype as x)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
