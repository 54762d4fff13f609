"""Partial rotary position embedding (RoPE on the first ``rotary_dim`` dims of each head).

For text-only input Qwen3.5's interleaved M-RoPE has three identical position rows and
reduces exactly to plain 1-D RoPE, which is what is implemented here (image rows:
hybridrt.vision.positions). ``scaling`` (hybridrt.config.RopeScaling) is YaRN, the context
extension Qwen3.5's model card gives (factor 4 over 262,144 positions), as transformers
computes it: frequencies blended between the original and the interpolated ones, cos and
sin scaled by an attention factor.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def inv_freq(rotary_dim: int, theta: float, scaling=None,
             device=None) -> torch.Tensor:
    """The rotary frequencies [rotary_dim / 2] in fp32: theta^(-2i/R), with YaRN blended
    between them and their interpolation by ``factor`` over the dims between the
    ``beta_fast`` and ``beta_slow`` rotation counts."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    if scaling is None:
        return 1.0 / (theta ** exps)
    pos_freqs = theta ** exps
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)

    def dim_of(rotations: float) -> float:  # the dim that turns ``rotations`` times
        return (rotary_dim * math.log(scaling.original_max_position_embeddings
                                      / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: interpolated (slow dims)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
    scaling=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int -> (cos, sin), each [T, rotary_dim] in ``dtype``.

    Frequencies are computed in fp32 and rounded to ``dtype`` afterwards, as the reference does.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq(
        rotary_dim, theta, scaling, positions.device)[None, :]
    return cos_sin(freqs, dtype, scaling)


def cos_sin(freqs: torch.Tensor, dtype: torch.dtype, scaling=None):
    """Rotation angles [..., R/2] (fp32) -> (cos, sin) [..., R] in ``dtype``: rotate-half's
    two halves, scaled by YaRN's attention factor where ``scaling`` is given."""
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling is not None:
        scale = scaling.cos_sin_scale()
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


class _ByPosition:
    """cos and sin [positions, rotary_dim] per (dtype, device), computed for whole blocks of
    positions as a step first reaches them (``_rows``) and looked up after."""

    BLOCK = 512  # positions added at a time
    DOUBLE = False  # grow to at least twice the rows held (fewer copies of the table)

    def __init__(self, rotary_dim: int, theta: float, scaling=None):
        self.key = (rotary_dim, theta, scaling)
        self.tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _rows(self, start: int, end: int, dtype: torch.dtype, device) -> tuple:
        """(cos, sin) of positions [start, end), multiples of BLOCK."""
        raise NotImplementedError

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        key = (dtype, positions.device)
        cos, sin = self.tables.get(key, (None, None))
        have = 0 if cos is None else cos.shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > have:
            end = -(-need // self.BLOCK) * self.BLOCK
            if self.DOUBLE:
                end = max(end, 2 * have)
            c, s = self._rows(have, end, dtype, positions.device)
            cos = c if cos is None else torch.cat([cos, c])
            sin = s if sin is None else torch.cat([sin, s])
            self.tables[key] = (cos, sin)
        return cos.index_select(0, positions), sin.index_select(0, positions)


class RopeRows(_ByPosition):
    """``rope_cos_sin``'s own rows, computed for blocks of positions once and looked up after:
    a step's RoPE in one index per table instead of some six torch ops (slow in a decode step,
    the weights' stream having evicted their code and data). A block is 256 positions, 16384
    values: under torch's parallel grain, so one thread's vectorized cos and sin cover it whole,
    as they do a step's [T, R] rows for any T (R a multiple of 32: whole vector pairs): the same
    bits as ``rope_cos_sin`` (tests/test_rope.py), except where torch splits a long prompt's
    rows among more threads than two and a share ends in a scalar tail (the table's values are
    then the vectorized ones, the same in every step). The table at least doubles as it grows:
    a long decode copies it rarely."""

    BLOCK = 256
    DOUBLE = True

    def _rows(self, start, end, dtype, device):
        rotary_dim, theta, scaling = self.key
        blocks = [rope_cos_sin(torch.arange(b, b + self.BLOCK, device=device), rotary_dim, theta,
                               dtype, scaling)
                  for b in range(start, end, self.BLOCK)]
        return torch.cat([c for c, _ in blocks]), torch.cat([s for _, s in blocks])


class RopeTable(_ByPosition):
    """cos and sin by absolute position, each entry computed once and looked up after: the
    batch-invariant mode's RoPE (docs/batch_invariance.md). ``rope_cos_sin`` computes them per
    step with torch's vectorized cos/sin, whose scalar tail (and thread split) falls on
    different positions as the step's length changes; here each angle is the fp32 product
    ``rope_cos_sin`` forms, its cos and sin taken by the C library in fp64 and rounded, so a
    position's values do not depend on the step it is in."""

    def __init__(self, rotary_dim: int, theta: float, scaling=None):
        super().__init__(rotary_dim, theta, scaling)
        if scaling is None:
            half = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
            self.inv_freq = np.array([1.0 / theta ** float(e) for e in half], dtype=np.float32)
        else:
            self.inv_freq = inv_freq(rotary_dim, theta, scaling).numpy()
        self.scale = 1.0 if scaling is None else scaling.cos_sin_scale()

    def _rows(self, start, end, dtype, device):
        freqs = np.arange(start, end, dtype=np.float32)[:, None] * self.inv_freq[None, :]
        flat = freqs.astype(np.float64).ravel().tolist()
        new = [torch.tensor([f(a) for a in flat], dtype=torch.float64).view(freqs.shape)
               for f in (math.cos, math.sin)]
        if self.scale != 1.0:
            new = [t.float() * self.scale for t in new]
        return tuple(torch.cat([t, t], dim=-1).float().to(dtype).to(device) for t in new)


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
