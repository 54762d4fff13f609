"""The int8 KV cache format (``kv_cache_dtype="int8"``), q8_0-like: each (token, KV head) row of
D values is stored as D int8 codes followed by one fp32 scale per group of ``group(D)`` values
(32 where D allows it, else the whole row), all in one int8 tensor whose last dimension is
``packed_width(D)``. A value is ``code * scale``; a group's scale is its absolute maximum / 127
and a code ``round(x / scale)`` (ties to even), 0 for an all-zero group. csrc/attn_decode.c
reads and writes the same layout with the same arithmetic (the same codes and scales).
"""

from __future__ import annotations

import torch

GROUP = 32
_NAMES = {"bf16": torch.bfloat16, "int8": torch.int8}


def group(D: int) -> int:
    """Values per scale for a head of D values."""
    return GROUP if D % GROUP == 0 else D


def packed_width(D: int) -> int:
    """int8 elements a (token, head) row takes: D codes, then D / group(D) fp32 scales."""
    return D + 4 * (D // group(D))


def resolve(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for ``kv_cache_dtype=name`` (auto: the model's)."""
    if name != "auto" and name not in _NAMES:  # EngineArgs checked it: a caller's mistake
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_NAMES)}, got "
                         f"{name!r}")
    return model_dtype if name == "auto" else _NAMES[name]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] values -> [..., packed_width(D)] int8 rows (codes, then the scales' bytes)."""
    D = x.shape[-1]
    g = group(D)
    xg = x.float().reshape(*x.shape[:-1], D // g, g)
    scale = xg.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xg / safe).clamp_(-127, 127).to(torch.int8)
    scale_bytes = scale.reshape(*x.shape[:-1], D // g).contiguous().view(torch.int8)
    return torch.cat([codes.reshape(*x.shape[:-1], D), scale_bytes], dim=-1)


def dequantize(packed: torch.Tensor, D: int) -> torch.Tensor:
    """[..., packed_width(D)] int8 rows -> [..., D] fp32 values."""
    g = group(D)
    codes = packed[..., :D].float().reshape(*packed.shape[:-1], D // g, g)
    scale = packed[..., D:].contiguous().view(torch.float32)[..., None]
    return (codes * scale).reshape(*packed.shape[:-1], D)
