"""kernels/native.py: the compiled CPU kernels called directly: the GDN decode step against
the torch ops it replaces, the half-precision GEMM / GEMV against fp64 products on every path
this CPU builds, and their shape checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_rel_close
from kernel_helpers import (
    TOL,
    gdn_inputs,
    generator,
    require_half_kernels,
    require_native,
    state_pool,
)

from hybridrt.kernels import l2_norm, native
from hybridrt.kernels.delta_rule import _step_in_place

DK, DV = 15, 9  # odd head sizes


def test_native_decode_step_equals_torch_ops():
    require_native()
    B, H = 5, 3
    q, k, v, g, beta = gdn_inputs(B, H, H, DK, DV, seed=18)
    q, k = l2_norm(q) * DK**-0.5, l2_norm(k)
    pool = state_pool(9, H, DK, DV, seed=19)
    slots = [7, 1, 2, 5, 8]
    a, b = pool.clone(), pool.clone()
    o_native = native.gdn_decode_step(a, torch.tensor(slots), q, k, v, g.exp(), beta)
    views = [(slice(i * H, (i + 1) * H), b[s:s + 1].view(H, DK, DV)) for i, s in enumerate(slots)]
    o_torch = _step_in_place(q, k, v, g, beta, views)
    assert_rel_close(o_native, o_torch, 1e-6, "output")
    assert_rel_close(a, b, 1e-6, "states")
    assert torch.equal(a[[0, 3, 4, 6]], pool[[0, 3, 4, 6]])
    with pytest.raises(IndexError, match="out of range"):
        native.gdn_decode_step(a, torch.tensor([9, 1, 2, 5, 8]), q, k, v, g.exp(), beta)


def _half_operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int):
    """w [N, K] in ``dtype``, x [M, K] fp32, and their fp64 product x w^T."""
    gen = generator(seed)
    w = torch.randn(N, K, generator=gen).to(dtype)
    x = torch.randn(M, K, generator=gen)
    return w, x, x.double() @ w.double().t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M,N,K", [(1, 16, 8), (2, 17, 9), (5, 33, 300), (7, 48, 257),
                                   (13, 100, 45), (33, 31, 64), (70, 40, 4100), (9, 5, 19)],
                         ids=lambda v: str(v))
def test_native_half_gemm_against_fp64(M, N, K, dtype):
    """Every tile shape (1-6 rows: 7 = 4 + 3, 13 = 5 + 4 + 4, 33 = 6 6 6 5 5 5), a partial last
    panel (N % 16, and N < 8: the second half of a panel empty), K past a 256-input block and K
    off a multiple of 8 (the transposing widen's tail), rows past one 1 MiB block of x (K=4100:
    60 rows a block)."""
    require_half_kernels()
    w, x, ref = _half_operands(M, N, K, dtype, seed=M * 1000 + N)
    y = native.half_gemm(x, w)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert_rel_close(y.double(), ref, TOL, f"M={M} N={N} K={K}")


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def test_half_paths_follow_the_cpu():
    """Every half path this CPU can run is built (bf16dot exactly where the CPU has
    AVX512-BF16), the default is the fastest, and HYBRIDRT_HALF_PATH picks or refuses."""
    from hybridrt.env import kernel_options

    require_half_kernels()
    flags = _cpu_flags()
    paths = native.half_paths()
    assert paths[0] == "fma"
    if flags:
        assert ("bf16dot" in paths) == ("avx512_bf16" in flags and "avx512f" in flags)
    assert native.half_path(kernel_options({}).half_path) == paths[-1]
    assert native.half_path(kernel_options({"HYBRIDRT_HALF_PATH": "fma"}).half_path) == "fma"
    with pytest.raises(ValueError, match="HYBRIDRT_HALF_PATH='vnni': use auto, fma or bf16dot"):
        kernel_options({"HYBRIDRT_HALF_PATH": "vnni"})
    with pytest.raises(ValueError, match="HYBRIDRT_HALF_PATH='vnni': use auto, fma or bf16dot"):
        native.half_path("vnni")
    if "bf16dot" not in paths:
        with pytest.raises(ValueError, match="not built for this CPU"):
            native.half_path(kernel_options({"HYBRIDRT_HALF_PATH": "bf16dot"}).half_path)


_BUILT_HALF_PATHS = native.half_paths()  # (builds the kernels once, at collection)


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.skipif(
    p not in _BUILT_HALF_PATHS, reason=f"half path {p} not built for this CPU"))
    for p in native.HALF_PATHS])
@pytest.mark.parametrize("M,N,K", [(1, 16, 8), (3, 17, 34), (4, 7, 66), (2, 9, 200), (5, 33, 300),
                                   (13, 100, 46), (25, 31, 64), (30, 40, 4100), (9, 5, 18),
                                   (7, 9, 45)],
                         ids=lambda v: str(v))
def test_half_paths_on_bf16_activations(M, N, K, path):
    """bf16 activations times bf16 weights in ``half_gemm`` (and ``half_gemv`` up to 8 rows) on
    each path built here: every tile
    size of either path (up to 12 rows: 25 = 9 8 8, 30 = 10 10 10), a partial last panel (and
    N < 8), K past a 256-input block and off a multiple of 8 pairs, odd K (which bf16dot leaves
    to fma) -> the fp64 product of the same bf16 values."""
    w, x, _ = _half_operands(M, N, K, torch.bfloat16, seed=M * 31 + N)
    x = x.bfloat16()
    ref = x.double() @ w.double().t()
    y = native.half_gemm(x, w, path=path)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert_rel_close(y.double(), ref, TOL, f"{path} M={M} N={N} K={K}")
    if M <= native.HALF_GEMV_MAX_ROWS:  # and the GEMV (bf16dot: 32 inputs a step, tails masked)
        y = native.half_gemv(x, w, path=path)
        assert_rel_close(y.double(), ref, TOL, f"gemv {path}")
        # bf16 outputs: the same sums rounded to nearest even, as .to(bf16) rounds them
        assert torch.equal(native.half_gemv(x, w, path=path, out_dtype=torch.bfloat16),
                           y.to(torch.bfloat16))


# The GEMV's paths: (path, weight dtype); x is bf16 on bf16dot (its operands), fp32 on fma.
_GEMV_PATHS = [pytest.param(p, d, id=f"{p}-{str(d)[6:]}", marks=pytest.mark.skipif(
    p not in _BUILT_HALF_PATHS, reason=f"half path {p} not built for this CPU"))
    for p, d in (("fma", torch.bfloat16), ("fma", torch.float16), ("bf16dot", torch.bfloat16))]
# K: below, at and past each path's step (fma 8 inputs, bf16dot 32) and long; N: below every
# tile's width of weight rows (1, 3) and 37, which leaves 1 to 5 weight rows past the last tile
# of every width (2-8) that some row count uses
_GEMV_K = [1, 7, 8, 9, 31, 32, 33, 100, 1031]
_GEMV_N = [1, 3, 37]


def _gemv_x(path: str, x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16() if path == "bf16dot" else x


@pytest.mark.parametrize("path,dtype", _GEMV_PATHS)
def test_half_gemv_every_row_count_against_fp64(path, dtype):
    """1 to 8 rows, each tail of the step and of the weight-row tiles, on each path built here
    -> the fp64 product of the same values; bf16 outputs are those sums rounded to nearest
    even."""
    for K in _GEMV_K:
        for N in _GEMV_N:
            w, x8, _ = _half_operands(8, N, K, dtype, seed=K * 7 + N)
            x8 = _gemv_x(path, x8)
            for M in range(1, 9):
                x = x8[:M]
                y = native.half_gemv(x, w, path=path)
                assert y.dtype == torch.float32 and y.shape == (M, N)
                ref = x.double() @ w.double().t()
                assert_rel_close(y.double(), ref, TOL, f"{path} M={M} N={N} K={K}")
                assert torch.equal(native.half_gemv(x, w, path=path, out_dtype=torch.bfloat16),
                                   y.to(torch.bfloat16)), (M, N, K)


@pytest.mark.parametrize("path,dtype", _GEMV_PATHS)
def test_half_gemv_rows_do_not_depend_on_the_rows_beside_them(path, dtype):
    """Each of up to 8 rows comes out bit for bit as it does alone, at every position among 1 to
    8 rows, on every path (what makes a verification of up to 7 drafts reproduce decoding
    exactly, and what the batch-invariant mode builds on): every tile width of weight rows and
    the weight rows past the last tile, K with and without a tail."""
    for K in (9, 33, 1031):
        w, x, _ = _half_operands(8, 37, K, dtype, seed=K)
        x = _gemv_x(path, x)
        alone = torch.cat([native.half_gemv(x[i:i + 1], w, path=path) for i in range(8)])
        alone_bf16 = torch.cat([native.half_gemv(x[i:i + 1], w, path=path,
                                                 out_dtype=torch.bfloat16) for i in range(8)])
        for M in range(1, 9):
            for i in range(0, 8 - M + 1):
                assert torch.equal(native.half_gemv(x[i:i + M], w, path=path),
                                   alone[i:i + M]), (K, M, i)
                assert torch.equal(native.half_gemv(x[i:i + M], w, path=path,
                                                    out_dtype=torch.bfloat16),
                                   alone_bf16[i:i + M]), (K, M, i)


def test_native_half_gemm_rejects_bad_shapes():
    require_half_kernels()
    w = torch.randn(40, 24).bfloat16()
    with pytest.raises(ValueError, match=r"x must be \[M, 24\]"):
        native.half_gemm(torch.randn(2, 23), w)
    with pytest.raises(ValueError, match="contiguous CPU bf16/fp16"):
        native.half_gemm(torch.randn(2, 24), w.float())
    with pytest.raises(ValueError, match="contiguous CPU bf16/fp16"):
        native.half_gemm(torch.randn(2, 40), w.t())
    assert native.half_gemm(torch.randn(0, 24), w).shape == (0, 40)
    with pytest.raises(ValueError, match=r"x must be \[M <= 8, 24\]"):
        native.half_gemv(torch.randn(9, 24), w)
    with pytest.raises(ValueError, match="contiguous CPU bf16/fp16"):
        native.half_gemv(torch.randn(2, 40), w.t())
    empty = torch.randn(40, 0).bfloat16()
    assert torch.equal(native.half_gemm(torch.randn(2, 0), empty), torch.zeros(2, 40))


# gemm_lanes: rows along the vector lanes (8 per vector on AVX2 builds, 16 on AVX-512), groups
# of two vectors, the last group one vector where its rows fit; weight panels of 24 rows in
# tiles of 6/12 (AVX2) or 12/24 (AVX-512) weight rows; inputs in blocks of 64, summed per 512.
_LANES_M = [1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 47, 48, 49, 70]


def _nan_after(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` at the start of a buffer whose elements after it are NaN."""
    buf = torch.full((t.numel() + 64,), float("nan"), dtype=t.dtype)
    buf[:t.numel()] = t.reshape(-1)
    return buf[:t.numel()].view(t.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("N,K", [(1, 8), (5, 19), (23, 64), (25, 65), (37, 511), (50, 1100),
                                 (24, 1)], ids=lambda v: str(v))
def test_gemm_lanes_against_fp64(N, K, dtype):
    """Every group shape of rows (one vector, two, and a last group of either; rows past M),
    weight rows past the last panel and past a tile's width, K off a block of 64 and past the
    512-input blocks, fp32 and bf16 x -> the fp64 product of the same values; bf16 outputs are
    the fp32 sums rounded to nearest even."""
    require_half_kernels()
    w, x70, _ = _half_operands(70, N, K, dtype, seed=N * 7 + K)
    w = _nan_after(w)  # a read past the last row or input shows as NaN
    for xdt in (torch.float32, torch.bfloat16):
        for M in _LANES_M:
            x = _nan_after(x70[:M].to(xdt))
            y = native.gemm_lanes(x, w)
            assert y.dtype == torch.float32 and y.shape == (M, N)
            ref = x.double() @ w.double().t()
            assert_rel_close(y.double(), ref, TOL, f"M={M} N={N} K={K} x {xdt}")
            assert torch.equal(native.gemm_lanes(x, w, torch.bfloat16), y.to(torch.bfloat16)), M


def test_gemm_lanes_rows_do_not_depend_on_the_rows_beside_them():
    """A row's sums are one chain of FMAs per block of inputs whichever group, vector and lane
    it lands in: every row of 70 bit for bit what it gives alone, and at every M."""
    require_half_kernels()
    w, x, _ = _half_operands(70, 53, 1100, torch.bfloat16, seed=5)
    alone = torch.cat([native.gemm_lanes(x[i:i + 1], w) for i in range(70)])
    for M in _LANES_M:
        for start in (0, 70 - M):
            assert torch.equal(native.gemm_lanes(x[start:start + M], w),
                               alone[start:start + M]), (M, start)


def test_gemm_lanes_rejects_bad_shapes():
    require_half_kernels()
    w = torch.randn(40, 24).bfloat16()
    with pytest.raises(ValueError, match=r"gemm_lanes: x must be \[M, 24\]"):
        native.gemm_lanes(torch.randn(2, 23), w)
    with pytest.raises(ValueError, match="gemm_lanes: weight must be a contiguous CPU bf16/fp16"):
        native.gemm_lanes(torch.randn(2, 40), w.t())
    with pytest.raises(ValueError, match="gemm_lanes: out_dtype must be float32 or bfloat16"):
        native.gemm_lanes(torch.randn(2, 24), w, torch.float16)
    assert native.gemm_lanes(torch.randn(0, 24), w).shape == (0, 40)
    assert torch.equal(native.gemm_lanes(torch.randn(3, 0), torch.randn(5, 0).bfloat16()),
                       torch.zeros(3, 5))


_LANES_PROBE = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from hybridrt.kernels import native
native.load(None, "haswell")
import test_native as t
for dtype in (torch.bfloat16, torch.float16):
    for N, K in ((5, 19), (25, 65), (37, 511), (50, 1100)):
        t.test_gemm_lanes_against_fp64(N, K, dtype)
t.test_gemm_lanes_rows_do_not_depend_on_the_rows_beside_them()
import test_batch_invariance as b
for dtype in (torch.bfloat16, torch.float32):
    for n in (37, 45):
        b.test_silu_mul_by_column(dtype, n)
print(native._march, native._lib.half_gemm_lanes_width())
"""


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= _cpu_flags() or native.load() is None,
                    reason="no AVX2 + FMA + F16C here, or no compiled kernels")
def test_gemm_lanes_on_the_avx2_build():
    """The AVX2 build's gemm_lanes (8 rows a vector, 16-register tiles) and silu_mul (8 lanes)
    through the same checks as the native build's (on an AVX-512 CPU the tests run in this
    process take the 16-lane kernels)."""
    out = subprocess.run([sys.executable, "-c", _LANES_PROBE, str(Path(__file__).parent)],
                         env={**os.environ, "HYBRIDRT_MARCH": "haswell"}, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["haswell", "8"], out.stdout
