"""GGUF tensor types -> hybridrt's weights.

- F32, F16, BF16: torch tensors over the file's memory-mapped pages (no copy until a
  transform or a dtype change needs one).
- Q8_0 is hybridrt's int8 format: 32 int8 values and one fp16 scale per block, symmetric:
  the values and scales move into ``quant.QuantWeight``'s panel layout unchanged, so the
  weight is bit-for-bit the file's (``int8_weight``). IQ4_NL (a 16-entry int8 codebook, an
  fp16 scale per 32) lands there exactly too, IQ4_XS with its group scales rounded once to
  fp16 (``blocks.int8_groups``).
- Q4_0, Q4_1, Q4_K keep their 4-bit values in hybridrt's 4-bit format (``int4_weight``):
  only the groups' steps and minimums are rounded to its 8-bit codes of bf16 superblock
  scales.
- Q6_K becomes its 6-bit format (``int6_weight``): per group of 32 the grid of its half with
  the larger scale, the other half rounded once onto it (``blocks.six_bit_groups``).
- Q5_0, Q5_1, Q5_K become the 6-bit format too, dequantized exactly (``gguf``'s numpy
  dequantizers, llama.cpp's own arithmetic) and quantized again (``requantized``).
- Any other type is refused, naming the tensor and the type.

Where the compiled kernels load, ``repack`` does Q8_0, Q4_0, Q4_1, Q4_K and Q6_K in one pass
of C to the same bytes. The error each mapping adds against ``gguf``'s dequantization is
measured per type in docs/gguf.md (``hybridrt bench gguf-error``; tests/test_gguf_quant.py
holds it).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridrt.kernels import int4, quant

FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF type -> the hybridrt format it becomes (a weight of a Linear or the embedding)
QUANT_FORMATS = {"Q8_0": "int8", "IQ4_NL": "int8", "IQ4_XS": "int8", "Q4_0": "int4",
                 "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int6", "Q5_1": "int6",
                 "Q5_K": "int6", "Q6_K": "int6"}
NIBBLE_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # their 4-bit values kept (``int4_weight``)


def type_name(t) -> str:
    return t.tensor_type.name


def supported(t) -> bool:
    return type_name(t) in FLOAT_TYPES or type_name(t) in QUANT_FORMATS


def float_tensor(t, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor over the file's pages, in torch order ``shape``."""
    data = np.asarray(t.data)
    if type_name(t) == "BF16":
        return torch.from_numpy(data.view(np.uint8)).view(torch.bfloat16).view(shape)
    return torch.from_numpy(data).view(shape)


def dequantized(t, shape: tuple[int, ...]) -> torch.Tensor:
    """Any supported tensor's values as fp32 [shape]: ``gguf``'s dequantization for quantized
    types (llama.cpp's reference arithmetic)."""
    if type_name(t) in FLOAT_TYPES:
        return float_tensor(t, shape).float()
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(np.asarray(t.data), t.tensor_type)).view(shape)


def _panels(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [N, ...] zero-padded to ``rows`` rows (x itself when it has them)."""
    if x.shape[0] == rows:
        return x
    out = x.new_zeros((rows, *x.shape[1:]))
    out[:x.shape[0]] = x
    return out


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """Per-row words x [16 P, G, n] (int32: 4 bytes of a row) -> the kernels' panel order [P,
    G, n, 16]: the words of 16 rows side by side, one copy."""
    rows, G, n = x.shape
    return x.view(rows // quant.PANEL, quant.PANEL, G, n).permute(0, 2, 3, 1).contiguous()


def int8_weight(q: torch.Tensor, d: torch.Tensor) -> quant.QuantWeight:
    """Values q [N, G, 32] int8 in [-127, 127] and scales d [N, G] fp16 as a ``QuantWeight``
    (the same numbers in the kernels' panel layout)."""
    N, G = d.shape
    rows = -(-N // quant.PANEL) * quant.PANEL
    qs = _panels(q, rows).view(rows // quant.PANEL, quant.PANEL, G, 8, 4)
    scales = _panels(d, rows).view(rows // quant.PANEL, quant.PANEL, G)
    return quant.QuantWeight(qs.permute(0, 2, 3, 1, 4).contiguous(),
                             scales.transpose(1, 2).contiguous(), (N, G * quant.GROUP))


def _superblock_scale(v: torch.Tensor, S: int) -> torch.Tensor:
    """Per superblock of 8 groups the bf16 scale whose 8-bit codes reach max(v): max / 255
    rounded to bf16, one bf16 step up where rounding went below -> [rows, S] fp32."""
    rows, G = v.shape
    vmax = torch.nn.functional.pad(v, (0, S * int4.SUPER - G)).view(rows, S, int4.SUPER)
    vmax = vmax.amax(-1)
    scale = (vmax / int4.CODES).bfloat16()
    low = scale.float() * int4.CODES < vmax
    scale[low] = (scale[low].view(torch.int16) + 1).view(torch.bfloat16)
    return scale.float()


def _codes(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    per_group = scale.repeat_interleave(int4.SUPER, dim=1)[:, :v.shape[1]]
    c = torch.where(per_group > 0, v / per_group, 0).round_().clamp_(0, int4.CODES)
    return torch.where((v > 0) & (c == 0), 1, c)


def _steps(step: torch.Tensor, minimum: torch.Tensor, rows: int):
    """Steps and minimums >= 0 per group ([N, G] fp32) -> (codes [P, G, 2, 16] uint8, scales
    [P, S, 2, 16] bf16): 8-bit codes of bf16 superblock scales (``_superblock_scale``)."""
    G = step.shape[1]
    S = -(-G // int4.SUPER)
    P = rows // int4.PANEL
    sp, mp = _panels(step + 0.0, rows), _panels(minimum + 0.0, rows)  # no -0.0
    D, M = _superblock_scale(sp, S), _superblock_scale(mp, S)
    sc, mc = _codes(sp, D), _codes(mp, M)
    codes = torch.stack([sc, mc], 1).to(torch.uint8).view(P, int4.PANEL, 2, G)
    scales = torch.stack([D, M], 1).bfloat16().view(P, int4.PANEL, 2, S)
    return codes.permute(0, 3, 2, 1).contiguous(), scales.permute(0, 3, 2, 1).contiguous()


def int4_weight(nib: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> int4.Int4Weight:
    """4-bit values nib [N, G, 16] (byte k: value k of the group in its low nibble, value k +
    16 in its high one) with a step and a minimum >= 0 per group ([N, G] fp32; W = step q -
    minimum) as an ``Int4Weight``: the values unchanged, step and minimum as 8-bit codes of
    bf16 superblock scales (``_steps``)."""
    N, G = step.shape
    rows = -(-N // int4.PANEL) * int4.PANEL
    qs = _interleave(_panels(nib, rows).view(torch.int32))  # [P, G, 4, 16] words
    codes, scales = _steps(step, minimum, rows)
    return int4.Int4Weight(qs.view(torch.uint8).view(int4.packed_shapes((N, G * 32))[0]),
                           codes, scales, (N, G * int4.GROUP))


def int6_weight(q: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> int4.Int6Weight:
    """6-bit values q [N, G, 32] (in [0, 63]) with a step and a minimum >= 0 per group as an
    ``Int6Weight``: the low 4 bits as ``int4_weight`` lays them, the high 2 in its plane."""
    N, G = step.shape
    rows = -(-N // int4.PANEL) * int4.PANEL
    q = _panels(q, rows)
    low = q & 15
    nib = low[..., :16] | low[..., 16:] << 4
    h = (q >> 4).view(rows, G, 2, 4, 4)  # value 16 h + 4 r + j -> bits 2 r of byte (h, j)
    hb = h[:, :, :, 0] | h[:, :, :, 1] << 2 | h[:, :, :, 2] << 4 | h[:, :, :, 3] << 6
    qs = _interleave(nib.view(torch.int32)).view(torch.uint8)
    hs = _interleave(hb.reshape(rows, G, 8).view(torch.int32)).view(torch.uint8)
    codes, scales = _steps(step, minimum, rows)
    shapes = int4.packed_shapes((N, G * int4.GROUP), 6)
    return int4.Int6Weight(qs.view(shapes[0]), hs.view(shapes[1]), codes, scales,
                           (N, G * int4.GROUP))


def requantized(w: torch.Tensor, fmt: str) -> quant.PackedWeight:
    """Exact values w [N, K] (fp32) in hybridrt's ``fmt`` ("int4" or "int6")."""
    return int4.quantize(w, 6 if fmt == "int6" else 4)
