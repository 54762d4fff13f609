"""GGUF block layouts decoded into groups of 32 inputs, the unit of hybridrt's formats, in whole-
tensor torch ops over the file's mapped bytes (no loop per block or row; ``gguf.quants``'
dequantizers' arithmetic, split where they multiply):

- ``int8_groups``: Q8_0, IQ4_NL, IQ4_XS -> signed values q [N, G, 32] int8 and one scale d
  [N, G] fp16 per group, W = d q. Exact for Q8_0 (q is a view of the file's bytes) and
  IQ4_NL (the nonlinear codebook's entries are the int8 values); IQ4_XS's group scale d (ls
  - 32) is rounded once to fp16 (relative error below 2^-11 on the scale; the values stay).
- ``nibble_groups``: Q4_0, Q4_1, Q4_K -> the 4-bit values as nib [N, G, 16] uint8 (byte k of
  a group: value k in its low nibble, value k + 16 in its high one, Q4_0's own byte order and
  hybridrt's), a step >= 0 and a minimum per group (fp32), W = step q - minimum: Q4_0 (d,
  8 d), Q4_1 (d, -m), Q4_K (d sc, dmin m); a group with a negative step counts its values
  from the top instead (every nibble XOR 15).
- ``six_bit_groups``: Q6_K -> 6-bit values q [N, G, 32] uint8, a step >= 0 and a minimum per
  group. Q6_K has a signed 8-bit scale s per 16 values (the sign of the superblock's d moved
  into them): a group takes the scale of its half
  with the larger |s| (W = d |s| (q' - o), o = 32 for s >= 0, q' = q; o = 31 and q' = 63 - q
  for s < 0), which holds that half exactly; the other half is rounded once onto that grid,
  q' = o + round(s' (q - 32) / |s|) (an integer ratio: the same in any arithmetic).
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
QK_K = 256
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_LOW = np.array(0x0F0F0F0F, dtype=np.uint32).view(np.int32).item()  # low nibble of each byte
_HIGH = np.array(0xF0F0F0F0, dtype=np.uint32).view(np.int32).item()


def _blocks(t, shape: tuple[int, int], block_bytes: int, block_size: int) -> torch.Tensor:
    """The tensor's bytes as [N, blocks a row, block_bytes] uint8 over the file's pages."""
    N, K = shape
    return torch.from_numpy(t.data.reshape(N, -1)).view(N, K // block_size, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 2] (little-endian fp16) -> [...] fp32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _int32(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 4 n] -> [..., n] int32 (copied only where not aligned)."""
    if b.storage_offset() % 4 or any(st % 4 for st in b.stride()[:-1]):
        b = b.contiguous()
    return b.view(torch.int32)


def _split_pairs(x: torch.Tensor) -> torch.Tensor:
    """32 bytes [..., 32] holding values k (low nibble) and k + 32 (high) of 64 -> the two
    groups of 32 in nibble order [..., 2, 16] (byte k: value k low, k + 16 high)."""
    a, b = _int32(x[..., :16]), _int32(x[..., 16:])  # [..., 4] each
    lo = (a & _LOW) | ((b << 4) & _HIGH)
    hi = ((a >> 4) & _LOW) | (b & _HIGH)
    return torch.stack([lo, hi], -2).view(torch.uint8)


def _nibble_values(nib: torch.Tensor) -> torch.Tensor:
    """nib [..., 16] -> the 32 values [..., 32] uint8 (low nibbles first, ggml's order)."""
    return torch.cat([nib & 15, nib >> 4], -1)


def int8_groups(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0, IQ4_NL, IQ4_XS -> (q [N, G, 32] int8, d [N, G] fp16)."""
    N, K = shape
    kind = t.tensor_type.name
    codebook = torch.tensor(IQ4_VALUES, dtype=torch.int8)
    if kind == "Q8_0":
        b = _blocks(t, shape, 34, GROUP)
        return b[..., 2:].view(torch.int8), b[..., :2].contiguous().view(torch.float16)[..., 0]
    if kind == "IQ4_NL":
        b = _blocks(t, shape, 18, GROUP)
        q = codebook[_nibble_values(b[..., 2:]).long()]
        return q, b[..., :2].contiguous().view(torch.float16)[..., 0]
    if kind != "IQ4_XS":
        raise ValueError(f"int8_groups: {kind} is not an int8 layout")
    b = _blocks(t, shape, 136, QK_K)  # d, scales_h (2), scales_l (4), qs (128)
    d = _f16(b[..., :2])
    sh = b[..., 2:4].to(torch.int32)
    sh = sh[..., 0] | sh[..., 1] << 8  # [N, S]
    lo = b[..., 4:8, None] >> torch.tensor([0, 4], dtype=torch.uint8)  # byte j: groups 2j, 2j+1
    sl = (lo & 15).reshape(N, -1, 8).to(torch.int32)
    hi = (sh[..., None] >> (2 * torch.arange(8, dtype=torch.int32))) & 3
    ls = (sl | hi << 4) - 32
    d = (d[..., None] * ls.float()).half().view(N, -1)  # the one rounding
    q = codebook[_nibble_values(b[..., 8:].reshape(N, -1, 16)).long()]
    return q, d


def nibble_groups(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0, Q4_1, Q4_K -> (nib [N, G, 16] uint8, step >= 0, minimum [N, G] fp32)."""
    N, K = shape
    kind = t.tensor_type.name
    if kind == "Q4_0":
        b = _blocks(t, shape, 18, GROUP)
        step = _f16(b[..., :2])
        nib, minimum = b[..., 2:], 8 * step
    elif kind == "Q4_1":
        b = _blocks(t, shape, 20, GROUP)
        step = _f16(b[..., :2])
        nib, minimum = b[..., 4:], -_f16(b[..., 2:4])
    elif kind == "Q4_K":
        from gguf.quants import Q4_K

        b = _blocks(t, shape, 144, QK_K)  # d, dmin, scales (12), qs (128)
        d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
        sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).numpy())
        step = d[..., None] * torch.from_numpy(sc).view(N, -1, 8).float()
        minimum = dmin[..., None] * torch.from_numpy(m).view(N, -1, 8).float()
        nib = _split_pairs(b[..., 16:].reshape(N, -1, 4, 32))  # [N, S, 4, 2, 16]
        step, minimum = step.view(N, -1), minimum.view(N, -1)
    else:
        raise ValueError(f"nibble_groups: {kind} is not a 4-bit layout")
    nib = nib.reshape(N, K // GROUP, 16)
    # a negative step (Q4_0's d takes the sign of the group's largest value): the same values
    # as step' = -step, q' = 15 - q, minimum' = minimum - 15 step
    flip = step < 0
    if flip.any():
        nib = torch.where(flip[..., None], nib ^ 0xFF, nib)
        minimum = torch.where(flip, minimum - 15 * step, minimum)
    return nib, step.abs(), minimum


def six_bit_groups(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K -> (q [N, G, 32] uint8 in [0, 63], step >= 0, minimum [N, G] fp32)."""
    N, K = shape
    if t.tensor_type.name != "Q6_K":
        raise ValueError(f"six_bit_groups: {t.tensor_type.name} is not Q6_K")
    b = _blocks(t, shape, 210, QK_K)  # ql (128), qh (64), scales (16), d
    S = K // QK_K
    # per half of 128 values: ql's 64 bytes give groups 0, 1 (low nibbles), 2, 3 (high)
    low = _split_pairs(b[..., :128].reshape(N, S, 2, 2, 32)).transpose(-2, -3)
    low = _nibble_values(low.reshape(N, S * 8, 16))  # [N, G, 32]
    qh = b[..., 128:192].reshape(N, S, 2, 1, 32)
    high = qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1) & 3
    q = (low | high.reshape(N, S * 8, 32) << 4).view(N, -1, 2, 16)  # halves of 16
    d = _f16(b[..., 208:210])  # [N, S]; its sign goes into the scales: d >= 0 below
    s = b[..., 192:208].contiguous().view(torch.int8).view(N, S, 8, 2).to(torch.int16)
    s = torch.where((d < 0)[..., None, None], -s, s).view(N, -1, 2)
    d = d.abs()
    big = (s[..., 1].abs() > s[..., 0].abs()).long()  # the half whose scale the group takes
    s_big = s.gather(-1, big[..., None])[..., 0]
    scale = s_big.abs().clamp_(min=1)
    offset = torch.where(s_big < 0, 31, 32).to(torch.int16)
    v = (q.to(torch.int16) - 32) * s[..., None]  # in units of d
    qq = (v.float() / scale[..., None, None].float()).round_().to(torch.int16)
    q = (qq + offset[..., None, None]).clamp_(0, 63).to(torch.uint8).view(N, -1, GROUP)
    step = d.repeat_interleave(8, dim=1) * s_big.abs().float()
    return q, step, offset.float() * step
