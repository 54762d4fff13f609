"""kernels/linear.py: y = x W^T for half-precision weights on each CPU path (compiled GEMV /
GEMM on the weight, the packed fp32 copy, torch) against the fp32 product."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from kernel_helpers import TOL, generator, require_half_kernels

from hybridrt.kernels import native
from hybridrt.kernels.linear import (
    CPU_HALF_GEMM_MIN_ROWS,
    linear,
    linear_fp32,
    pack_weight,
    use_fp32_gemm,
    use_half_gemv,
)


@pytest.fixture(params=["native", "onednn"])
def half_gemm_impl(request):
    """Run a test with the compiled half-weight GEMM and with the fp32 copy it replaces (the
    ``simd`` flag the CPU backend passes: False as with ``HYBRIDRT_NATIVE=0``)."""
    if request.param == "native":
        require_half_kernels()
    return request.param


@pytest.mark.parametrize("rows", [1, CPU_HALF_GEMM_MIN_ROWS, 4, 5, 8, 9, 12, 33],
                         ids=lambda r: f"rows{r}")
def test_linear_half_weights_match_fp32_product(rows, half_gemm_impl):
    """Half-precision weights: native up to 8 rows ``half_gemv`` on the weight, then
    ``half_gemm`` on it (no copy); without them one row runs torch's bf16 GEMV, more rows a
    packed fp32 copy. All equal the fp32 product rounded to bf16 (up to accumulation order:
    1 bf16 ulp)."""
    gen = generator(30)
    w = (torch.randn(67, 45, generator=gen) / 7).bfloat16()
    x = torch.randn(rows, 45, generator=gen).bfloat16()
    native_ = half_gemm_impl == "native"
    assert use_half_gemv(x, w, native_) == (native_ and rows <= 8)
    assert use_fp32_gemm(x, w, native_) == (rows >= CPU_HALF_GEMM_MIN_ROWS and not native_)
    packed = pack_weight(w) if use_fp32_gemm(x, w, native_) else None
    expect = (x.float() @ w.float().t()).bfloat16().float()
    got = linear(x, w, packed, native_)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 67)
    torch.testing.assert_close(got.float(), expect, rtol=8e-3, atol=1e-6)
    x3 = x.view(1, rows, 45)  # leading dims pass through
    assert torch.equal(linear(x3, w, packed, native_).view(rows, 67), got)


@pytest.mark.parametrize("path", native.half_paths())
def test_linear_many_rows_take_the_kernel_that_wins(path):
    """From 9 rows on, bf16 x bf16 on the bf16 dot-product path takes ``gemv_rows`` (the GEMV's
    tiles over panels) at any row count: every row's bits are what the GEMV gives that row alone
    (batch-invariant without the batch-invariant mode). The fma path takes ``gemm_lanes`` where
    the rows fill its vectors (``LANES_WHERE``, by this build's width: 8 rows a vector with
    AVX2, 16 with AVX-512), else ``gemv_rows`` up to ``ROWS_KERNEL_MAX_ROWS["fma"]`` rows, then
    ``half_gemm``; on ``gemm_lanes`` every row's bits are what it gives that row alone."""
    import importlib

    lin = importlib.import_module("hybridrt.kernels.linear")
    gen = generator(32)
    w = (torch.randn(70, 1100, generator=gen) / 30).bfloat16()
    x = torch.randn(80, 1100, generator=gen).bfloat16()
    width = native.lanes_width()
    paths = {"bf16dot": {9: "rows", 12: "rows", 32: "rows", 33: "rows", 80: "rows"},
             # measured choices (docs/performance.md)
             "fma": {8: {9: "rows", 11: "rows", 12: "lanes", 17: "rows", 18: "lanes",
                         32: "lanes", 33: "lanes", 80: "lanes"},
                     16: {9: "rows", 16: "rows", 31: "rows", 32: "lanes", 33: "gemm",
                          41: "gemm", 42: "lanes", 48: "lanes", 80: "lanes"}}[width]}[path]
    alone = torch.cat([native.half_gemv(x[i:i + 1], w, path, torch.bfloat16) for i in range(80)])
    lanes_alone = torch.cat([native.gemm_lanes(x[i:i + 1], w, torch.bfloat16) for i in range(80)])
    for rows, expect in paths.items():
        assert lin._half_cpu_path(x[:rows], w, True, path) == expect, rows
        got = linear(x[:rows], w, None, True, path)
        if expect in ("rows", "lanes"):
            same = alone if expect == "rows" else lanes_alone
            assert torch.equal(got.view(torch.int16), same[:rows].view(torch.int16)), rows
        torch.testing.assert_close(got.float(), alone[:rows].float(), rtol=8e-3, atol=1e-3)
        if expect == "lanes":  # fp32 x too, through the same kernel
            got = linear(x[:rows].float(), w, None, True, path)
            assert torch.equal(got, native.gemm_lanes(x[:rows].float(), w)), rows
    fp32_33 = lin._half_cpu_path(x[:33].float(), w, True, "bf16dot")  # fp32 x: fma's choice
    assert fp32_33 == ("lanes" if width == 8 else "gemm")


def test_packed_weight_layouts_compute_the_same_product(monkeypatch):
    """oneDNN's packed layout and the plain fp32 fallback (the copies kept where the compiled
    half kernels do not run) and the compiled ``half_gemm`` on the weight: the same product."""
    import importlib

    lin = importlib.import_module("hybridrt.kernels.linear")  # the module, not the function

    gen = generator(31)
    w = torch.randn(300, 64, generator=gen).bfloat16()
    x = torch.randn(2, 7, 64, generator=gen)
    layouts = {}
    expect = x @ w.float().t()
    if native.half_gemm_available():
        assert_rel_close(linear(x, w).float(), expect, 8e-3, "half_gemm")
    layouts["onednn"] = pack_weight(w)
    assert layouts["onednn"].is_mkldnn == torch.backends.mkldnn.is_available()
    monkeypatch.setattr(lin, "_onednn_available", lambda: False)
    layouts["plain"] = pack_weight(w)
    assert not layouts["plain"].is_mkldnn and layouts["plain"].dtype == torch.float32
    for name, p in layouts.items():
        assert_rel_close(linear_fp32(x, w, p), expect, TOL, name)
