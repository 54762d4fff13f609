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
- Q5_0, Q5_1, Q5_K, Q6_K become its 6-bit format, dequantized exactly (``gguf``'s numpy
  dequantizers, llama.cpp's own arithmetic) and quantized again (``requantized``).
- Any other type is refused, naming the tensor and the type.

The error each mapping adds against ``gguf``'s dequantization is measured per type in
docs/gguf.md (tests/test_gguf_quant.py holds it).
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


def int8_weight(q: torch.Tensor, d: torch.Tensor) -> quant.QuantWeight:
    """Values q [N, K] int8 in [-127, 127] and scales d [N, K / 32] fp16 as a ``QuantWeight``
    (the same numbers in the kernels' panel layout)."""
    N, K = q.shape
    qs_shape, scales_shape = quant.packed_shapes((N, K))
    P, G = scales_shape[:2]
    rows = P * quant.PANEL
    qp = torch.zeros(rows, G * quant.GROUP, dtype=torch.int8)
    qp[:N, :K] = q
    dp = torch.zeros(rows, G, dtype=torch.float16)
    dp[:N] = d
    qs = qp.view(P, quant.PANEL, G, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    scales = dp.view(P, quant.PANEL, G).transpose(1, 2).contiguous()
    return quant.QuantWeight(qs, scales, (N, K))


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


def int4_weight(q: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> int4.Int4Weight:
    """4-bit values q [N, K] (in [0, 15]) with a step and a minimum >= 0 per group of 32
    ([N, K / 32] fp32; W = step q - minimum) as an ``Int4Weight``: q unchanged, step and
    minimum as 8-bit codes of bf16 superblock scales (``_superblock_scale``)."""
    N, K = q.shape
    qs_shape, codes_shape, scales_shape = int4.packed_shapes((N, K))
    P, G = codes_shape[:2]
    S = scales_shape[1]
    rows = P * int4.PANEL
    qp = torch.zeros(rows, G * int4.GROUP, dtype=torch.uint8)
    qp[:N, :K] = q
    sp, mp = (torch.zeros(rows, G) for _ in range(2))
    sp[:N], mp[:N] = step, minimum
    D, M = _superblock_scale(sp, S), _superblock_scale(mp, S)
    sc, mc = _codes(sp, D), _codes(mp, M)
    codes = torch.stack([sc, mc], 1).to(torch.uint8).view(P, int4.PANEL, 2, G)
    scales = torch.stack([D, M], 1).bfloat16().view(P, int4.PANEL, 2, S)
    return int4.Int4Weight(int4.pack(qp), codes.permute(0, 3, 2, 1).contiguous(),
                           scales.permute(0, 3, 2, 1).contiguous(), (N, K))


def requantized(w: torch.Tensor, fmt: str) -> quant.PackedWeight:
    """Exact values w [N, K] (fp32) in hybridrt's ``fmt`` ("int4" or "int6")."""
    return int4.quantize(w, 6 if fmt == "int6" else 4)
