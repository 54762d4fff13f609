"""``matmul_rows(x, w)``: x W^T whose every row is computed by the same instructions whatever
the number of rows: the batch-invariant mode's product (docs/batch_invariance.md).

cuBLAS (``F.linear``) picks its kernel, tile and split of K by the shape, M included, so a
row's sums change with the rows beside it. Here one kernel with one tile configuration, fixed
by the weight's shape and dtype alone: a program owns a [BLOCK_M, BLOCK_N] tile of the output
and walks K in BLOCK_K steps from 0 in order, accumulating in fp32 (``tl.dot``); no split of
K, no atomics, no autotuning. ``M`` is not specialized by Triton (``do_not_specialize``: M == 1
and M % 16 == 0 would otherwise compile other code), so the same compiled kernel serves a
decode of one row and a prompt of 512. A row's result depends only on that row.

x: [..., K] (the weight's dtype, or fp32); w: [N, K] bf16 / fp16 / fp32 -> [..., N] in x's
dtype (or ``out_dtype``: fp32 shows the accumulator itself, the tests' view). fp32 operands
multiply in fp32 (``ieee``, not tf32). Under the Triton interpreter (CPU tensors) half
operands are widened to fp32 first (exact), which is what a GPU's half MMA with fp32
accumulation computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# one tile configuration for every call (a GPU may want others per weight shape; any fixed
# choice keeps the rows invariant, a choice by M would not)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["M"])
def _matmul_rows_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K,
    sx_m, sw_n, sy_m,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mm = offs_m < M
    mn = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * sx_m
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * sw_n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        mk = kk < K
        a = tl.load(x_rows + kk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * sy_m + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def matmul_rows(x: torch.Tensor, w: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T, each row's arithmetic fixed by (N, K, dtypes) alone (see the module docstring).
    x: [..., K]; w: [N, K] -> [..., N] in ``out_dtype`` (default: x's)."""
    if w.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(w.shape)}")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {K}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"batch_invariant: no invariant product for {w.dtype} weights")
    if x.dtype not in (w.dtype, torch.float32):
        raise ValueError(f"x is {x.dtype}, the weight {w.dtype}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        fp32 = w.dtype == torch.float32 or x.dtype == torch.float32
        upcast = x.device.type == "cpu" or (fp32 and w.dtype != torch.float32)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _matmul_rows_kernel[grid](
            x2, w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
            BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
            DOT_PREC="ieee" if fp32 or upcast else None, UPCAST=upcast,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return y.view(*x.shape[:-1], N)
