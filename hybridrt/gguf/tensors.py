"""GGUF tensor types -> hybridrt's weights.

- F32, F16, BF16: torch tensors over the file's memory-mapped pages (no copy until a
  transform or a dtype change needs one).
- Q8_0 is hybridrt's int8 format: 32 int8 values and one fp16 scale per block, symmetric:
  the values and scales move into ``quant.QuantWeight``'s panel layout unchanged, so the
  weight is bit-for-bit the file's (``q8_0_weight``).
- Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS become hybridrt's 4-bit format, Q5_0, Q5_1, Q5_K, Q6_K its
  6-bit one (``int4.Int4Weight`` / ``Int6Weight``): dequantized exactly (``gguf``'s numpy
  dequantizers, llama.cpp's own arithmetic) and quantized again (``requantized``); the error
  this adds is measured per type in docs/gguf.md.
- Any other type is refused, naming the tensor and the type.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridrt.kernels import int4, quant

FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF type -> the hybridrt format it becomes (a weight of a Linear or the embedding)
QUANT_FORMATS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4",
                 "IQ4_NL": "int4", "IQ4_XS": "int4", "Q5_0": "int6", "Q5_1": "int6",
                 "Q5_K": "int6", "Q6_K": "int6"}


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


def q8_0_parts(t, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor [N, K] -> (q [N, K] int8, d [N, K / 32] fp16), views of the file."""
    N, K = shape
    blocks = torch.from_numpy(np.asarray(t.data)).view(N, K // quant.GROUP, 2 + quant.GROUP)
    return blocks[..., 2:].view(torch.int8).reshape(N, K), blocks[..., :2].view(torch.float16)[
        ..., 0]


def q8_0_weight(q: torch.Tensor, d: torch.Tensor) -> quant.QuantWeight:
    """Q8_0's values q [N, K] int8 and scales d [N, K / 32] fp16 as a ``QuantWeight`` (the
    same numbers in the kernels' panel layout)."""
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


def requantized(w: torch.Tensor, fmt: str) -> quant.PackedWeight:
    """Exact values w [N, K] (fp32) in hybridrt's ``fmt`` ("int4" or "int6")."""
    return int4.quantize(w, 6 if fmt == "int6" else 4)
