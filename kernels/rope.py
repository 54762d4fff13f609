"""Partial rotary position embedding (RoPE on the first ``rotary_dim`` dims of each head).

For text-only input Qwen3.5's interleaved M-RoPE has three identical position rows and
reduces exactly to plain 1-D RoPE, which is what is implemented here.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int -> (cos, sin), each [T, rotary_dim] in ``dtype``.

    Frequencies are computed in fp32 and rounded to ``dtype`` afterwards, as the reference does.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                  / rotary_dim)
    )
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x: [T, H, D], cos/sin: [T, R] with R <= D -> [T, H, D].

    Rotates dims [0, R) in rotate-half pairs (i, i + R/2); dims [R, D) pass through.
    """
    r = cos.shape[-1]
    if r > x.shape[-1] or r % 2:
        raise ValueError(f"rotary dim {r} must be even and <= head dim {x.shape[-1]}")
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([x_rot, x_pass], dim=-1)
