"""y = x W^T, with a CPU path for half-precision weights.

CPUs without native bf16/fp16 matrix instructions (e.g. AVX2-only) run half-precision GEMMs at
roughly GEMV speed per row: measured on this project's 2-core AVX2 machine (3584x1024 bf16,
2 threads), 0.4 ms per row and 12.3 ms for 32 rows, against 2.6 ms for the same 32 rows in
fp32. From ``CPU_HALF_GEMM_MIN_ROWS`` rows on, the product is computed in fp32 with an fp32
copy of the weight (``weight_f32``, which the caller keeps: converting 0.8B parameters costs
about half a second per step) and rounded back; single rows (decode at batch 1) stay in half
precision, where reading half the bytes wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_HALF_GEMM_MIN_ROWS = 12
HALF = (torch.bfloat16, torch.float16)


def use_fp32_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.dtype in HALF
            and x.numel() >= CPU_HALF_GEMM_MIN_ROWS * weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor,
           weight_f32: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in], weight: [out, in] -> [..., out] in x's dtype. ``weight_f32``: an fp32
    copy of ``weight`` for the CPU batched path (made on the fly when not given)."""
    if use_fp32_gemm(x, weight):
        w = weight_f32 if weight_f32 is not None else weight.float()
        return _cpu_gemm(x.float(), w).to(x.dtype)
    if x.device.type == "cpu" and x.numel() >= CPU_HALF_GEMM_MIN_ROWS * weight.shape[1]:
        return _cpu_gemm(x, weight)
    return F.linear(x, weight)


def _cpu_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as W x^T: with weights streamed from memory, measured 1.8x faster than
    F.linear for 32 rows of fp32 on the AVX2 machine (97 vs 54 GFLOP/s, 3584x1024)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, x2.t()).t().contiguous()
    return y.view(*x.shape[:-1], weight.shape[0])
