"""y = x W^T, with a CPU path for half-precision weights.

CPUs without native bf16/fp16 matrix instructions (e.g. AVX2-only) run half-precision GEMMs at
roughly GEMV speed per row, several times slower than fp32 from a few rows on (figures in
docs/performance.md). So products are computed in fp32 and rounded back to the input's dtype,
which is what a half GEMM with fp32 accumulation returns, by the first of these that applies:

- where the compiled kernels run (``csrc/half_gemm.c``), on the weight as the model holds it:
  up to ``native.HALF_GEMV_MAX_ROWS`` (8) rows ``half_gemv``, each element read and widened once
  (decode at small batch, draft verification), each row's result independent of the rows
  beside it; from 9 rows on, on the ``fma`` path, ``native.gemm_lanes`` (outer products with
  the rows along the vector lanes) where the rows fill its lanes well enough (``LANES_WHERE``);
  otherwise the GEMV's tiles over L2-sized panels of the weight (``native.gemv_rows``, the
  batch-invariant product) where they beat ``half_gemm``: bf16 x bf16 on the bf16 dot-product
  path at any row count, the ``fma`` path up to ``ROWS_KERNEL_MAX_ROWS["fma"]`` rows; past that
  ``half_gemm``, which widens blocks of the weight into L1 once and runs register tiles over
  them;
- without them, from ``CPU_HALF_GEMM_MIN_ROWS`` rows on: an fp32 copy of the weight made once
  by ``pack_weight`` (the caller keeps it), in oneDNN's blocked layout when PyTorch has oneDNN
  (``_reorder_linear_weight``, the op behind PyTorch's own CPU inference freezing), else plain;
- otherwise (one row without the compiled kernels) torch's bf16 GEMV.

``hybridrt bench gemm`` times each path per weight at the 0.8B shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native

CPU_HALF_GEMM_MIN_ROWS = 2
# the most rows for which the GEMV's tiles over panels (gemv_rows) beat half_gemm, by path
# (None: any); `hybridrt bench gemm` and docs/performance.md
ROWS_KERNEL_MAX_ROWS = {"bf16dot": None, "fma": 32}
# the fma path takes native.gemm_lanes (rows along the vector lanes) where, by its vector width
# (8 rows a vector on AVX2 builds, 16 on AVX-512), there are at least so many rows and they fill
# at least this share of the lanes it computes (measured: docs/performance.md)
LANES_WHERE = {8: (12, 0.75), 16: (32, 0.875)}
CPU_FP32_WXT_MIN_ROWS = 12  # fp32 weights: W x^T instead of F.linear from this many rows
HALF = (torch.bfloat16, torch.float16)
_PACK_HINT_ROWS = 32  # oneDNN picks its blocking for this many rows; any count works


def _half_cpu_path(x: torch.Tensor, weight: torch.Tensor,
                   simd: bool | None = None, half_path: str | None = None) -> str | None:
    """Which CPU half-weight path ``linear`` takes: "gemv" / "rows" / "gemm" (the compiled
    kernels on the weight as it is), "packed" (``pack_weight``'s fp32 copy, from
    ``CPU_HALF_GEMM_MIN_ROWS`` rows on, where the compiled kernels do not run) or None
    (torch)."""
    if x.device.type != "cpu" or weight.dtype not in HALF or weight.dim() != 2:
        return None
    k = weight.shape[1]
    if simd is None:
        simd = native.half_gemm_available()
    if simd and weight.is_contiguous() and x.numel():
        rows = x.numel() // k if k else 0
        if rows <= native.HALF_GEMV_MAX_ROWS:
            return "gemv"
        path = half_path or native.half_path()
        if path == "bf16dot" and not (x.dtype == weight.dtype == torch.bfloat16):
            path = "fma"  # what half_gemm / gemv_rows run for other operands
        if path == "fma" and _lanes_win(rows):
            return "lanes"
        most = ROWS_KERNEL_MAX_ROWS.get(path, 0)
        return "rows" if most is None or rows <= most else "gemm"
    return "packed" if x.numel() >= CPU_HALF_GEMM_MIN_ROWS * k else None


def _lanes_win(rows: int) -> bool:
    least, fill = LANES_WHERE.get(native.lanes_width(), (None, 1.0))
    return least is not None and rows >= least and rows >= fill * native.lanes_padded_rows(rows)


def use_half_gemv(x: torch.Tensor, weight: torch.Tensor, simd: bool | None = None) -> bool:
    """Few rows times half weights on a CPU where the compiled kernels run: ``native.half_gemv``
    on the weight as it is (no copy)."""
    return _half_cpu_path(x, weight, simd) == "gemv"


def use_fp32_gemm(x: torch.Tensor, weight: torch.Tensor, simd: bool | None = None) -> bool:
    """Whether ``linear`` multiplies ``pack_weight(weight)``, an fp32 copy (so the caller should
    keep it): half weights on a CPU where the compiled kernels do not run, from
    ``CPU_HALF_GEMM_MIN_ROWS`` rows on."""
    return _half_cpu_path(x, weight, simd) == "packed"


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 copy of ``weight`` [out, in] that ``linear``'s CPU batched path multiplies where
    the compiled half kernels do not run, in the fastest layout PyTorch has (oneDNN's blocked
    one, else plain)."""
    w = weight.detach().float().contiguous()
    if w.device.type == "cpu" and _onednn_available():
        try:
            return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)
        except RuntimeError:  # a build whose oneDNN rejects the shape: plain fp32
            pass
    return w


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None,
           simd: bool | None = None, half_path: str | None = None) -> torch.Tensor:
    """x: [..., in], weight: [out, in] -> [..., out] in x's dtype. ``packed``: the
    ``pack_weight(weight)`` copy for the CPU batched path (made on the fly when not given).
    ``simd``: whether the compiled half kernels run here, as the CPU backend decided at
    start-up (asked of ``native`` on every call when not given); ``half_path``: theirs for
    bf16 x bf16 (``native.half_path``; the fastest built when not given)."""
    path = _half_cpu_path(x, weight, simd, half_path)
    if path == "lanes":  # bf16 x: rounded to bf16 by the kernel
        out = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        y = native.gemm_lanes(x.reshape(-1, x.shape[-1]), weight, out)
        return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    if path in ("gemv", "rows") and x.dtype == torch.bfloat16:  # rounded to bf16 by the kernel
        gemv = native.half_gemv if path == "gemv" else native.gemv_rows
        y = gemv(x.reshape(-1, x.shape[-1]), weight, half_path, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])
    if path in ("gemv", "rows", "gemm"):
        gemm = {"gemv": native.half_gemv, "rows": native.gemv_rows, "gemm": native.half_gemm}[path]
        y = gemm(x.reshape(-1, x.shape[-1]), weight, half_path)
        return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    if path == "packed":
        return linear_fp32(x, weight, packed).to(x.dtype)
    if x.device.type == "cpu" and x.numel() >= CPU_FP32_WXT_MIN_ROWS * weight.shape[1]:
        return _cpu_gemm(x, weight)
    return F.linear(x, weight)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T computed and returned in fp32 (CPU batched path; ``packed`` as in ``linear``)."""
    w = packed if packed is not None else pack_weight(weight)
    return _cpu_gemm(x.float(), w)


def _cpu_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T. Plain weights as W x^T, which for a few dozen rows of fp32 with the weight streamed
    from memory ran faster than F.linear (docs/performance.md)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, x2.t()).t().contiguous()
    return y.view(*x.shape[:-1], weight.shape[0])
