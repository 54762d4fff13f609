"""Helpers shared by the kernel tests (test_delta_rule.py, test_native.py, test_linear.py, ...)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridrt.kernels import native

TOL = 1e-5  # fp32, relative to max |ref|


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gdn_inputs(T: int, HK: int, HV: int, DK: int, DV: int, seed: int = 0):
    """Packed [T, ...] inputs with a wide range of decays (g from ~-10 to ~0)."""
    gen = generator(seed)
    q = torch.randn(T, HK, DK, generator=gen)
    k = torch.randn(T, HK, DK, generator=gen)
    v = torch.randn(T, HV, DV, generator=gen)
    g = F.logsigmoid(2.0 * torch.randn(T, HV, generator=gen) + 1.0)
    beta = torch.rand(T, HV, generator=gen)
    return q, k, v, g, beta


def state_pool(num_slots: int, HV: int, DK: int, DV: int, seed: int = 1) -> torch.Tensor:
    return 0.5 * torch.randn(num_slots, HV, DK, DV, generator=generator(seed))


def require_native() -> None:
    """Skip where the compiled kernels cannot load (no C compiler, Windows); fail where they
    should have built and did not."""
    if native.load() is not None:
        return
    can_build = native._compiler() is not None and sys.platform != "win32"
    assert not can_build, "a C compiler is here but the native kernels failed to build"
    pytest.skip("native kernels unavailable here (no C compiler)")


def require_half_kernels() -> None:
    """``require_native``, then skip on a CPU without AVX2 + FMA + F16C (the half GEMM/GEMV
    build as stubs there); fail where it has them and the kernels say otherwise."""
    require_native()
    if native.half_gemm_available():
        return
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    assert not all(f in flags for f in ("avx2", "fma", "f16c")), "half GEMM built without SIMD"
    pytest.skip("native half GEMM/GEMV unavailable here (no AVX2/FMA/F16C)")
