"""GGUF block layouts decoded into groups of 32 inputs, the unit of hybridrt's formats, without
losing a bit (the arithmetic of ``gguf.quants``' dequantizers, split where they multiply):

- ``int8_groups``: Q8_0, IQ4_NL, IQ4_XS -> signed values q [N, K] int8 and one scale d [N,
  K / 32] per group, W = d q. Exact for Q8_0 and IQ4_NL (the nonlinear codebook's entries
  are the int8 values); IQ4_XS's group scale d * (ls - 32) is rounded once to fp16 (relative
  error below 2^-11 on the scale; the values stay exact).
- ``nibble_groups``: Q4_0, Q4_1, Q4_K -> unsigned values q [N, K] in [0, 15] and a step >= 0
  and a minimum per group (fp32), W = step q - minimum: Q4_0 (d, 8 d), Q4_1 (d, -m), Q4_K
  (d sc, dmin m); a group with a negative step counts its values from the top instead.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
QK_K = 256
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _blocks(t, shape: tuple[int, int], block_bytes: int, block_size: int) -> np.ndarray:
    N, K = shape
    return np.asarray(t.data).reshape(N * (K // block_size), block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[:, 0]


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """Bytes [n, chunks * half] -> values [n, chunks * 2 * half]: in each chunk of ``half``
    bytes the low nibbles come first, then the high ones (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(n, -1)


def int8_groups(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0, IQ4_NL, IQ4_XS -> (q [N, K] int8, d [N, K / 32] fp16)."""
    N, K = shape
    kind = t.tensor_type.name
    if kind == "Q8_0":
        b = _blocks(t, shape, 34, 32)
        q, d = b[:, 2:].view(np.int8), _f16(b[:, :2])
    elif kind == "IQ4_NL":
        b = _blocks(t, shape, 18, 32)
        q = np.array(IQ4_VALUES, dtype=np.int8)[_nibbles(b[:, 2:], 16)]
        d = _f16(b[:, :2])
    elif kind == "IQ4_XS":
        b = _blocks(t, shape, 136, QK_K)
        d = _f16(b[:, :2]).astype(np.float32)
        sh = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)  # [n, 1]
        lo = b[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # byte j: groups 2j, 2j + 1
        sl = (lo & np.uint8(15)).reshape(-1, 8)
        hi = (sh >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)
        ls = (sl | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
        d = (d[:, None] * ls.astype(np.float32)).astype(np.float16)  # the one rounding
        q = np.array(IQ4_VALUES, dtype=np.int8)[_nibbles(b[:, 8:], 16)]
    else:
        raise ValueError(f"int8_groups: {kind} is not an int8 layout")
    return (torch.from_numpy(np.ascontiguousarray(q)).view(N, K),
            torch.from_numpy(np.ascontiguousarray(d)).view(N, K // GROUP))


def nibble_groups(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0, Q4_1, Q4_K -> (q [N, K] uint8 in [0, 15], step >= 0, minimum [N, K / 32]
    fp32)."""
    from gguf.quants import Q4_K

    N, K = shape
    kind = t.tensor_type.name
    if kind == "Q4_0":
        b = _blocks(t, shape, 18, 32)
        step = _f16(b[:, :2]).astype(np.float32)
        q, minimum = _nibbles(b[:, 2:], 16), 8 * step
    elif kind == "Q4_1":
        b = _blocks(t, shape, 20, 32)
        step = _f16(b[:, :2]).astype(np.float32)
        q, minimum = _nibbles(b[:, 4:], 16), -_f16(b[:, 2:4]).astype(np.float32)
    elif kind == "Q4_K":
        b = _blocks(t, shape, 144, QK_K)
        d, dmin = _f16(b[:, :2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        step = d[:, None] * sc.astype(np.float32)
        minimum = dmin[:, None] * m.astype(np.float32)
        q = _nibbles(b[:, 16:], 32)
    else:
        raise ValueError(f"nibble_groups: {kind} is not a 4-bit layout")
    q = torch.from_numpy(np.ascontiguousarray(q)).view(N, K // GROUP, GROUP)
    step = torch.from_numpy(np.ascontiguousarray(step)).view(N, K // GROUP)
    minimum = torch.from_numpy(np.ascontiguousarray(minimum)).view(N, K // GROUP)
    # a negative step (Q4_0's d takes the sign of the group's largest value): the same values
    # as step' = -step, q' = 15 - q, minimum' = minimum - 15 step
    flip = step < 0
    q = torch.where(flip[..., None], 15 - q, q).view(N, K)
    return q, step.abs(), torch.where(flip, minimum - 15 * step, minimum)
