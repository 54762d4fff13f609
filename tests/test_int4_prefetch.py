"""kernels/int4_prefetch.py: the one-row 4-bit / 6-bit products' prefetch, the non-temporal hint
or L2, chosen at run time. Either way the same bits (each path, both formats, the AVX2 one-row
pass and the AVX-512 tile); "auto" keeps the mode that ran faster on the first large one-row
product and measures nothing else."""

from __future__ import annotations

import pytest
import torch

from hybridrt.env import kernel_options
from hybridrt.kernels import int4, int4_prefetch, native
from hybridrt.kernels.backend.cpu import CPUBackend

ISAS = int4.available_isas()
needs_kernels = pytest.mark.skipif(native.load() is None, reason="compiled kernels unavailable")


@pytest.fixture(autouse=True)
def _restore():
    yield
    int4_prefetch.configure("auto")


@needs_kernels
@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("isa", ISAS)
def test_both_prefetches_give_the_emulations_bits(isa, bits):
    g = torch.Generator().manual_seed(bits)
    for N, K in ((70, 1024), (17, 45), (33, 290)):
        qw = int4.quantize(torch.randn(N, K, generator=g), bits)
        x = torch.randn(1, K, generator=g)
        want = int4.emulate(x, qw)
        for mode in ("nta", "l2"):
            int4_prefetch.configure(mode)
            assert int4_prefetch.chosen() == mode
            assert torch.equal(int4.gemm(x, qw, isa), want), (mode, N, K)
            assert torch.equal(int4.linear(x.bfloat16(), qw, isa).float(),
                               int4.emulate(x.bfloat16().float(), qw).bfloat16().float())


class _Clock:
    """perf_counter for int4_prefetch: each timed call takes ``cost[mode]`` seconds of the mode
    set last."""

    def __init__(self, cost):
        self.cost, self.now, self.mode, self.calls = cost, 0.0, None, []

    def set(self, mode):
        self.mode = mode

    def perf_counter(self):
        self.now += self.cost[self.mode] / 2  # read twice around each call
        return self.now


@pytest.mark.parametrize("faster", ["nta", "l2"])
def test_auto_keeps_the_faster_mode(monkeypatch, faster):
    clock = _Clock({"nta": 1.0 if faster == "nta" else 3.0, "l2": 1.0 if faster == "l2" else 3.0})
    monkeypatch.setattr(int4_prefetch, "_set", clock.set)
    monkeypatch.setattr(int4_prefetch, "time", clock)
    int4_prefetch.configure("auto")
    ran = []
    big = int4_prefetch.CALIBRATE_BYTES
    int4_prefetch.before_product(lambda: ran.append(1), big - 1, 1)  # too small: nothing
    int4_prefetch.before_product(lambda: ran.append(1), big, 2)  # two rows: nothing
    assert not ran and int4_prefetch.chosen() is None
    int4_prefetch.before_product(lambda: ran.append(1), big, 1)
    assert len(ran) == 2 * int4_prefetch.ROUNDS
    assert int4_prefetch.chosen() == faster and clock.mode == faster
    assert int4_prefetch.times[faster] < int4_prefetch.times[{"nta": "l2", "l2": "nta"}[faster]]
    int4_prefetch.before_product(lambda: ran.append(1), big, 1)  # chosen: measured once only
    assert len(ran) == 2 * int4_prefetch.ROUNDS


@needs_kernels
def test_the_environment_sets_the_mode():
    CPUBackend(None, options=kernel_options({"HYBRIDRT_INT4_PREFETCH": "L2"}))
    assert int4_prefetch.chosen() == "l2"
    CPUBackend(None, options=kernel_options({}))
    assert int4_prefetch.chosen() is None  # auto: not measured yet
    with pytest.raises(ValueError, match="HYBRIDRT_INT4_PREFETCH='far'"):
        kernel_options({"HYBRIDRT_INT4_PREFETCH": "far"})
    with pytest.raises(ValueError, match="int4 one-row prefetch: choose one of auto, nta, l2"):
        int4_prefetch.configure("far")
