"""4-bit weights (kernels/int4.py, csrc/int4_gemm.c) and the 6-bit LM head: the formats (nibble
order, the high bits' plane, codes, round trips), every kernel path bit for bit against the torch
emulation of the format for every tile shape and tail, the 4-bit model against a model holding
the dequantized weights, the compiled decode layers, speculation, stored checkpoints (those
written with the int8 LM head too), the build target switch, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import PackedRunner, assert_rel_close
from typer.testing import CliRunner

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.cli.main import app
from hybridrt.kernels import int4, native, quant
from hybridrt.kernels.backend import CPUBackend, ReferenceBackend
from hybridrt.loader import load_model, save_quantized

ISAS = int4.available_isas()
needs_kernels = pytest.mark.skipif(not ISAS, reason="compiled kernels unavailable")

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py


# The format --------------------------------------------------------------------------------
def test_a_widened_4_bit_weight_is_the_same_weight_in_6_bits():
    """``int4.widened`` (a projection group mixing 4 and 6 bits merges in 6): the same values,
    and every kernel path gives the 4-bit product's bits; ``widen_mixed_groups`` widens only a
    mixed group's 4-bit weights."""
    from types import SimpleNamespace

    from hybridrt.weights import widen_mixed_groups

    w = int4.quantize(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)))
    six = int4.widened(w)
    assert six.bits == 6 and six.shape == w.shape
    assert torch.equal(six.values(), w.values())
    assert torch.equal(six.dequantize(), w.dequantize())
    x = torch.randn(3, 96).bfloat16()
    for isa in ISAS:
        assert torch.equal(int4.linear(x, six, isa), int4.linear(x, w, isa)), isa
    other = int4.quantize(torch.randn(32, 96), bits=6)
    mixed = [SimpleNamespace(qweight=w), SimpleNamespace(qweight=other)]
    plain = [SimpleNamespace(qweight=int4.quantize(torch.randn(16, 96)))] * 2
    model = SimpleNamespace(projection_groups=lambda: [mixed, plain])
    widen_mixed_groups(model)
    assert [m.qweight.bits for m in mixed] == [6, 6] and mixed[1].qweight is other
    assert [m.qweight.bits for m in plain] == [4, 4]


def test_nibbles_sit_where_the_kernels_read_them():
    """pack: byte 4 c + j of qs[p, g, r] holds W[16 p + c, 32 g + 4 r + j] low and
    W[16 p + c, 32 g + 16 + 4 r + j] high; unpack inverts it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 96), generator=g, dtype=torch.uint8)
    qs = int4.pack(q)
    assert qs.shape == (2, 3, 4, 64) and qs.dtype == torch.uint8
    for p, gr, r, c, j in [(0, 0, 0, 0, 0), (1, 2, 3, 15, 3), (0, 1, 2, 7, 1), (1, 0, 1, 9, 2)]:
        b = int(qs[p, gr, r, 4 * c + j])
        assert b & 15 == q[16 * p + c, 32 * gr + 4 * r + j], (p, gr, r, c, j)
        assert b >> 4 == q[16 * p + c, 32 * gr + 16 + 4 * r + j], (p, gr, r, c, j)
    assert torch.equal(int4.unpack(qs), q)


def test_high_bits_sit_where_the_kernels_read_them():
    """6 bits: bits 2 r, 2 r + 1 of byte 4 c + j of hs[p, g, h] hold the high 2 bits of
    q(W[16 p + c, 32 g + 16 h + 4 r + j]), whose low 4 sit in qs as at 4 bits; unpack_high
    inverts it, and an Int6Weight's values() and rows() put both together."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 64, (32, 96), generator=g, dtype=torch.uint8)
    hs = int4.pack_high(q >> 4)
    assert hs.shape == (2, 3, 2, 64) and hs.dtype == torch.uint8
    for p, gr, h, r, c, j in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 3, 15, 3), (0, 1, 0, 2, 7, 1),
                              (1, 0, 1, 1, 9, 2), (0, 2, 1, 0, 4, 3)]:
        b = int(hs[p, gr, h, 4 * c + j])
        assert b >> 2 * r & 3 == q[16 * p + c, 32 * gr + 16 * h + 4 * r + j] >> 4
    assert torch.equal(int4.unpack_high(hs), q >> 4)
    qw = int4.Int6Weight(int4.pack(q & 15), hs, torch.ones(2, 3, 2, 16, dtype=torch.uint8),
                         torch.ones(2, 1, 2, 16, dtype=torch.bfloat16), (32, 96))
    assert torch.equal(qw.values(), q)
    assert torch.equal(qw.rows(torch.tensor([0, 17, 31])), q[[0, 17, 31]].float() - 1)


@pytest.mark.skipif(native.load() is None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 6])
def test_rows_compiled_equal_the_torch_rows(bits, dtype, monkeypatch):
    """The embedding lookup's rows by csrc/int4_quant.c equal the torch form's and
    dequantize()'s bit for bit (odd N, K past the last whole group), in any shape of ids;
    an id outside [0, N) is an IndexError, also inside the last panel's padding."""
    g = torch.Generator().manual_seed(4)
    qw = int4.quantize(torch.randn(77, 300, generator=g) * 0.05, bits)
    ids = torch.tensor([[0, 76, 15], [16, 33, 5]])
    fast = qw.rows(ids, dtype)
    assert torch.equal(fast, qw.dequantize(dtype)[ids])
    with monkeypatch.context() as m:
        m.setattr(native, "_lib", None)
        slow = qw.rows(ids, dtype)
    assert fast.shape == slow.shape == (2, 3, 300) and torch.equal(fast, slow)
    for bad in (77, 79, -1):
        with pytest.raises(IndexError, match=r"ids must be in \[0, 77\)"):
            qw.rows(torch.tensor([3, bad]), dtype)


@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("shape", [(1, 32), (16, 64), (17, 40), (50, 300), (33, 7), (3, 520)],
                         ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_quantize_round_trip(shape, bits):
    """Every weight comes back as the nearest point of its group's grid dw * q - mw, q in
    [0, 15] (6 bits: [0, 63]; within half a step inside the grid, its end outside: the search
    may clip); dw and mw are the codes times their superblock's D and M; an all-zero group
    gives zeros; rows() agrees with dequantize()."""
    N, K = shape
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(shape, generator=g) * torch.rand(N, 1, generator=g) * 3
    w[:, :min(32, K)] += torch.rand(N, 1, generator=g) * 2  # a group above zero: the min clamps
    w[0, :min(32, K)] = 0
    qw = int4.quantize(w.bfloat16(), bits)
    assert type(qw) is (int4.Int6Weight if bits == 6 else int4.Int4Weight)
    deq = qw.dequantize()
    assert deq.shape == w.shape
    qs_shape, *hs_shape, codes_shape, scales_shape = int4.packed_shapes(shape, bits)
    assert qw.qs.shape == qs_shape and qw.qs.dtype == torch.uint8
    if bits == 6:
        assert qw.hs.shape == hs_shape[0] == qs_shape[:2] + (2, 64) and qw.hs.dtype == torch.uint8
    assert qw.codes.shape == codes_shape and qw.codes.dtype == torch.uint8
    assert qw.scales.shape == scales_shape and qw.scales.dtype == torch.bfloat16
    G = codes_shape[1]
    dw, mw = (t[:N, :, None] for t in qw.steps())
    D = qw.scales.float()[:, :, 0].permute(0, 2, 1).reshape(-1, scales_shape[1])[:N]
    codes = qw.codes.float()[:, :, 0].permute(0, 2, 1).reshape(-1, G)[:N]
    assert torch.equal(dw[..., 0], D.repeat_interleave(8, dim=1)[:, :G] * codes)
    wp = F.pad(w.bfloat16().float(), (0, G * 32 - K)).view(N, G, 32)
    dp = F.pad(deq, (0, G * 32 - K)).view(N, G, 32)
    valid = (torch.arange(G * 32) < K).view(1, G, 32).expand(N, G, 32)
    lo, hi = (-mw).expand_as(wp), (int4.QMAX[bits] * dw - mw).expand_as(wp)
    inside, below, above = (wp >= lo) & (wp <= hi) & valid, (wp < lo) & valid, (wp > hi) & valid
    assert ((dp - wp).abs() <= dw / 2 * (1 + 1e-5) + 1e-7)[inside].all()
    assert torch.equal(dp[below], lo[below]) and torch.equal(dp[above], hi[above])
    assert inside.sum() > 0.8 * valid.sum(), inside.sum() / valid.sum()
    assert deq[0, :min(32, K)].abs().max() == 0
    ids = torch.tensor([[N - 1, 0], [N // 2, N - 1]])
    assert torch.equal(qw.rows(ids), deq[ids])
    assert qw.values().max() <= int4.QMAX[bits]
    before = w.clone()
    assert torch.equal(int4.quantize(w, bits).qs, int4.quantize(w.double(), bits).qs)
    assert torch.equal(w, before)  # the input is left as it was


@pytest.mark.skipif(native.load() is None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("shape", [(17, 45), (50, 300), (33, 1000), (40, 2048)],
                         ids=lambda s: f"N{s[0]}-K{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 6])
def test_compiled_quantizer_is_the_reference(shape, dtype, bits):
    """csrc/int4_quant.c gives quantize_reference's bytes (the same search and roundings, in C),
    4 and 6 bits, for tails of rows, groups and superblocks, all-zero, all-positive and -0.0
    groups."""
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=g) * 0.02 * torch.rand(shape[0], 1, generator=g)
    w[0, :32] = 0
    w[1, :32] = w[1, :32].abs()
    w[2, :32] = -0.0
    w = w.to(dtype)
    a, b = int4.quantize(w, bits), int4.quantize_reference(w, bits)
    assert type(a) is type(b) and len(a.tensors()) == len(b.tensors()) == 1 + bits // 2
    for name, x, y in zip(a.names, a.tensors(), b.tensors()):
        assert torch.equal(x, y), name


def test_the_search_beats_the_min_max_grid():
    """The quantizer's search (weighted least squares over 5 grids) against the plain min/max
    grid it starts from: a lower error on Gaussian weights (about 10% here)."""
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2))
    searched = (int4.quantize(w).dequantize() - w).norm()
    steps = int4._SEARCH_STEPS
    try:
        int4._SEARCH_STEPS = -1  # no grid past the min/max one
        plain = (int4.quantize_reference(w).dequantize() - w).norm()
    finally:
        int4._SEARCH_STEPS = steps
    assert searched < 0.95 * plain, (searched, plain)


def test_quantization_error_is_that_of_4_bits():
    """Gaussian weights: about 8% relative error (16 levels over a group's range), far below
    what a wrong scale or minimum would give."""
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    err = ((int4.quantize(w).dequantize() - w).norm() / w.norm()).item()
    assert 0.06 < err < 0.09, err


def test_quantization_error_is_that_of_6_bits():
    """6 bits: 4x finer steps, about a quarter of 4 bits' error (1.7%), the search as useful;
    the values use all 64 levels."""
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    qw = int4.quantize(w, 6)
    err = ((qw.dequantize() - w).norm() / w.norm()).item()
    assert 0.014 < err < 0.019, err
    assert torch.equal(qw.values().unique(), torch.arange(64, dtype=torch.uint8))
    steps = int4._SEARCH_STEPS
    try:
        int4._SEARCH_STEPS = -1
        plain = ((int4.quantize(w, 6).dequantize() - w).norm() / w.norm()).item()
    finally:
        int4._SEARCH_STEPS = steps
    assert err < 0.95 * plain, (err, plain)


def test_quantize_rejects_what_the_format_cannot_hold():
    for bad in (torch.ones(4, 32, dtype=torch.int32), torch.ones(32), torch.ones(0, 32),
                torch.ones(4, 0)):
        with pytest.raises(ValueError, match="expected a non-empty float matrix"):
            int4.quantize(bad)
    for v in (float("inf"), float("nan")):
        w = torch.ones(4, 32)
        w[2, 5] = v
        with pytest.raises(ValueError, match="inf or NaN"):
            int4.quantize(w)
    with pytest.raises(ValueError, match="bits must be 4 or 6, got 5"):
        int4.quantize(torch.ones(4, 32), 5)


def test_concat_stacks_panels_and_refuses_what_it_cannot_stack():
    """Merged projections: 4-bit weights of whole panels stacked into one whose product is each
    one's product side by side, each input a view into it; a weight of a partial panel, another
    K or another kind (int8) is refused."""
    g = torch.Generator().manual_seed(4)
    ws = [torch.randn(n, 300, generator=g) for n in (32, 16, 48)]
    qws = [int4.quantize(w) for w in ws]
    merged, parts = quant.concat(qws)
    assert isinstance(merged, int4.Int4Weight) and merged.shape == (96, 300)
    assert torch.equal(merged.dequantize(), torch.cat([q.dequantize() for q in qws]))
    for p, q in zip(parts, qws):
        assert p.shape == q.shape and torch.equal(p.dequantize(), q.dequantize())
        assert p.qs.untyped_storage().data_ptr() == merged.qs.untyped_storage().data_ptr()
    for bad in ([qws[0], int4.quantize(torch.randn(20, 300))],
                [qws[0], int4.quantize(torch.randn(16, 299))],
                [qws[0], quant.quantize(torch.randn(16, 300))]):
        with pytest.raises(ValueError, match="same kind, the same K and whole panels"):
            quant.concat(bad)


# Kernels -----------------------------------------------------------------------------------
# rows: 1-8 (the GEMV, one tile), 9-13 (GEMM tiles of 4 and each tail), 33, 70 (at K = 1024
# past 2^16 activations: x quantized by the threads, not before them); columns: below, at
# and past one and two panels and an AVX2 half panel; inputs: one group, a tail inside a
# group, several groups, a superblock and a remainder, many superblocks
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 33, 70]
COLS = [1, 7, 9, 15, 16, 17, 33, 48, 70]
INPUTS = [32, 45, 96, 290, 1024]


@needs_kernels
@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K", INPUTS, ids=lambda k: f"K{k}")
def test_kernel_matches_the_emulation_bit_for_bit(isa, K, bits):
    """Each path, 4 and 6 bits, every (rows, columns) shape: bit for bit the format's math done
    in torch (``int4.emulate``), and near plain dequantize-then-matmul (within what quantizing
    the activations costs)."""
    g = torch.Generator().manual_seed(K)
    for N in COLS:
        w = torch.randn(N, K, generator=g)
        qw = int4.quantize(w, bits)
        deq = qw.dequantize()
        for M in ROWS:
            x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
            y = int4.gemm(x, qw, isa)
            what = f"{isa} {bits} bits M{M} N{N} K{K}"
            assert torch.equal(y, int4.emulate(x, qw)), what
            ref = x @ deq.T
            assert ((y - ref).norm() / ref.norm()).item() < 2e-2, what


@needs_kernels
@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_rows_do_not_depend_on_the_batch(isa, bits):
    """A row's output is bit-identical whether it runs alone, in the GEMV with up to 7 others
    or in any GEMM tile (what makes speculative verification reproduce plain decoding)."""
    g = torch.Generator().manual_seed(1)
    qw = int4.quantize(torch.randn(50, 300, generator=g), bits)
    x = torch.randn(23, 300, generator=g)
    whole = int4.gemm(x, qw, isa)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 12):
        for i in range(0, 23, m):
            assert torch.equal(int4.gemm(x[i:i + m], qw, isa), whole[i:i + m]), (m, i)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K", [45, 96], ids=lambda k: f"K{k}")
def test_bf16_activations_in_one_call(isa, K, bits):
    """bf16 x [M, K] in one call (the decode loop's products): bit for bit the fp32 path's
    result rounded to bf16, the padding of K to a multiple of 32 included."""
    g = torch.Generator().manual_seed(K)
    qw = int4.quantize(torch.randn(37, K, generator=g), bits)
    for M in (1, 3, 6, 9):
        x = (torch.randn(M, K, generator=g) * 0.05).bfloat16()  # |x| < 1: padding shows
        y = int4.linear(x, qw, isa)
        assert y.dtype == torch.bfloat16 and y.shape == (M, 37)
        assert torch.equal(y, int4.gemm(x.float(), qw, isa).to(torch.bfloat16)), M
        y3 = int4.linear(x.view(1, M, K), qw, isa)
        assert torch.equal(y3.view(M, 37), y)


@needs_kernels
def test_kernel_bad_input():
    qw = int4.quantize(torch.randn(20, 45))
    with pytest.raises(ValueError, match=r"x must be \[M, 45\]"):
        int4.gemm(torch.randn(3, 44), qw, ISAS[-1])
    with pytest.raises(ValueError, match="out_dtype must be"):
        int4.gemm(torch.randn(3, 45), qw, ISAS[-1], torch.float16)
    with pytest.raises(RuntimeError, match="kernel path 'sse9' unavailable"):
        int4.gemm(torch.randn(3, 45), qw, "sse9")
    with pytest.raises(ValueError, match=r"x must be \[M, 45\]"):  # the decode loop's path
        int4.linear(torch.randn(3, 44).bfloat16(), qw, ISAS[-1])
    y = int4.gemm(torch.randn(0, 45), qw, ISAS[-1])
    assert y.shape == (0, 20)
    assert int4.linear(torch.randn(0, 45).bfloat16(), qw, ISAS[-1]).shape == (0, 20)
    q6 = int4.quantize(torch.randn(20, 45), 6)
    y = torch.zeros(1, 20)
    assert native.load().int6_gemm(torch.ones(1, 45).data_ptr(), 0, q6.qs.data_ptr(), None,
                                   q6.codes.data_ptr(), q6.scales.data_ptr(), y.data_ptr(), 0, 1,
                                   20, 45, 64, 1, 1) == -1  # no high plane: refused
    assert not y.any()


@needs_kernels
def test_isa_switch():
    """HYBRIDRT_INT4_ISA (else HYBRIDRT_INT8_ISA) -> the 4-bit path the backend takes."""
    from hybridrt.env import kernel_options

    assert CPUBackend(None, options=kernel_options({"HYBRIDRT_INT4_ISA": "ref"})).int4_isa == "ref"
    assert CPUBackend(None, options=kernel_options({"HYBRIDRT_INT8_ISA": "avx2"})).int4_isa == (
        "avx2" if "avx2" in ISAS else None)
    with pytest.raises(ValueError, match="HYBRIDRT_INT4_ISA='sse9': choose one of ref"):
        kernel_options({"HYBRIDRT_INT4_ISA": "sse9"})
    with pytest.raises(ValueError, match="HYBRIDRT_INT4_ISA='sse9': choose one of ref"):
        int4.select_isa("sse9")
    assert int4.select_isa(kernel_options({}).int4_isa) == ISAS[-1]
    assert int4.select_isa(None, native=False) is None


# The 4-bit model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny model whose inputs (48, 24, 88, 96) are mostly not multiples of 32, bf16."""
    cfg = tiny_text_config(vocab_size=131)
    return write_random_checkpoint(tmp_path_factory.mktemp("int4"), cfg, seed=5,
                                   dtype=torch.bfloat16)


PROMPTS = [torch.tensor([5, 9, 2, 77, 31, 8, 100]), torch.tensor([40, 41, 3])]


def _logits(net, prompts):
    runner = PackedRunner(net, len(prompts), 40, block_size=8)
    first = runner.step(list(enumerate(prompts)))
    nxt = [(i, torch.tensor([3 + i])) for i in range(len(prompts))]
    return torch.cat([*first, *runner.step(nxt)])


def _dequantized_model(ckpt):
    """The checkpoint in fp32 with every weight replaced by its dequantized values as int4
    quantizes it (4 bits, the embedding in 6), on the reference backend."""
    net, config, _ = load_model(ckpt, torch.float32)
    names = quant.quantized_names(net)
    for name, p in net.named_parameters():
        if name in names:
            p.copy_(int4.quantize(p.bfloat16(), 6 if int4.six_bit(name) else 4).dequantize())
    net.set_backend(ReferenceBackend(config))
    return net


class _EmulatedBackend(ReferenceBackend):
    """The reference backend with the kernels' math (``int4.emulate``, ``quant.emulate``) for
    quantized weights."""

    def linear(self, x, w):
        emulate = {int4.Int4Weight: int4.emulate, int4.Int6Weight: int4.emulate,
                   quant.QuantWeight: quant.emulate}.get(type(w))
        if emulate is None:
            return super().linear(x, w)
        return emulate(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1).to(x.dtype)


def test_int4_model_matches_dequantized_reference(ckpt):
    """On the reference backend the int4 model computes exactly what a model holding the
    dequantized weights does; on the CPU backend what the kernels' math done in torch gives.
    (How far quantizing the activations moves it is measured on the trained model below: this
    tiny random model's recurrent layers amplify any difference from step to step.)"""
    ref = _logits(_dequantized_model(ckpt), PROMPTS)
    net, config, _ = load_model(ckpt, torch.float32, quantization="int4")
    net.set_backend(ReferenceBackend(config))
    assert torch.equal(_logits(net, PROMPTS), ref)
    net.set_backend(_EmulatedBackend(config))
    emulated = _logits(net, PROMPTS)
    net.set_backend(CPUBackend(config))
    ours = _logits(net, PROMPTS)
    assert_rel_close(ours, emulated, 1e-4, "int4 CPU backend vs emulated kernels")


def test_int4_demo_model_near_its_dequantized_weights():
    """The demo model (trained) in int4 on the CPU backend against the same 4-bit weights
    dequantized, activations unquantized (the reference backend): the logits within 2% of
    their largest, the same greedy tokens."""
    from hybridrt.llm import default_model

    net, config, _ = load_model(default_model(), torch.float32, quantization="int4")
    prompts = [torch.tensor([5, 9, 2, 77, 31, 8, 100, 300, 1000, 20]), torch.tensor([40, 41, 3])]
    net.set_backend(ReferenceBackend(config))
    ref = _logits(net, prompts)
    net.set_backend(CPUBackend(config))
    ours = _logits(net, prompts)
    assert_rel_close(ours, ref, 2e-2, "int4 demo model vs its dequantized weights")
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_which_weights_are_4_bit_and_the_memory(ckpt, tmp_path):
    """Every linear weight (MTP included) in 4 bits, the tied embedding / LM head (or an untied
    LM head and the embedding) in 6; 4-bit weights take about 0.29x of bf16's bytes, 6-bit
    0.41x, plus this tiny model's padding; the bytes a decoded token reads count the 6-bit
    head's high plane."""
    from hybridrt.bench import ceilings

    net, _, _ = load_model(ckpt, torch.bfloat16, quantization="int4", with_mtp=True)
    full, _, _ = load_model(ckpt, torch.bfloat16, with_mtp=True)
    names = quant.quantized_names(full)
    assert {n for n, _ in net.named_parameters()}.isdisjoint(names)
    assert isinstance(net.model.embed_tokens, quant.QuantEmbedding)
    head = net.model.embed_tokens.qweight
    assert type(head) is int4.Int6Weight and head.shape == (131, 48)
    assert head.nbytes == 9 * 2 * (256 + 128 + 32) + 9 * 64  # 9 panels, 2 groups, 1 superblock
    fours = {n: m for n, m in net.named_modules()
             if type(getattr(m, "qweight", None)) is int4.Int4Weight}
    assert len(fours) == len(names) - 1 and any(n.startswith("mtp.") for n in fours)
    assert quant.quantization_of(net) == "int4" and net.dtype == torch.bfloat16
    bf16 = sum(p.numel() * 2 for n, p in full.named_parameters()
               if n in names and not int4.six_bit(n))
    four = sum(m.qweight.nbytes for m in fours.values())
    assert 0.29 < four / bf16 < 0.5, four / bf16
    big = int4.quantize(torch.randn(1024, 1024))
    assert big.nbytes == 1024 * 1024 * 4.625 / 8
    assert int4.quantize(torch.randn(1024, 1024), 6).nbytes == 1024 * 1024 * 6.625 / 8
    layers = sum(m.qweight.nbytes for n, m in fours.items() if not n.startswith("mtp."))
    rest = sum(p.numel() * p.element_size() for n, p in net.named_parameters()
               if not n.startswith("mtp."))
    assert ceilings.weight_bytes_per_token(net) == layers + head.nbytes + rest
    cfg = tiny_text_config(vocab_size=131, tie_word_embeddings=False)
    path = write_random_checkpoint(tmp_path, cfg, seed=6, dtype=torch.bfloat16)
    untied, config, _ = load_model(path, torch.float32, quantization="int4")
    assert type(untied.lm_head.qweight) is int4.Int6Weight
    assert type(untied.model.embed_tokens.qweight) is int4.Int6Weight


PANEL_CONFIG = dict(vocab_size=131, linear_num_key_heads=4, linear_num_value_heads=16,
                    linear_key_head_dim=8, head_dim=16, intermediate_size=96)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_compiled_decode_layers_and_merged_projections(tmp_path, quantization):
    """A model whose projections are whole panels of 16 rows: each layer's in-projections and
    gate/up merge into one quantized weight, decode and verification steps run the CPU
    backend's own loop (the compiled layers), and the greedy tokens equal those of the same
    model run layer by layer (the loop switched off), with and without MTP drafts. (int8 too:
    with an embedding width that is not a multiple of 32 its looked-up rows were a strided
    view, which the loop's compiled norm read as contiguous.)"""
    kind = {"int4": int4.Int4Weight, "int8": quant.QuantWeight}[quantization]
    d = write_random_checkpoint(tmp_path / "m", tiny_text_config(**PANEL_CONFIG), seed=3)
    prompts = [[3, 4, 5], list(range(7, 30)), [9, 1]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for loop in (True, False):
        llm = LLM(d, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=3,
                  cache_memory=8 << 20, quantization=quantization, speculative_tokens=2)
        be = llm.engine.runner.model.backend
        layers = len(llm.model.model.layers)
        merged = [w for w, _ in be.groups.values()]
        assert len(merged) >= 2 * layers
        assert all(isinstance(w, kind) for w in merged)
        assert be.fast is not None and len(be.fast) == layers
        if not loop:
            be.fast = None
        ran = []
        whole = be.forward
        be.forward = lambda *a, whole=whole, ran=ran: ran.append(whole(*a)) or ran[-1]
        for k in (0, 2):
            outs.append([o.outputs[0].token_ids for o in llm.generate(
                prompts, sp, use_tqdm=False, speculative_tokens=k)])
        assert any(r is not None for r in ran) == loop
    assert outs[0] == outs[1] == outs[2] == outs[3]


def test_speculative_decoding_is_lossless_with_int4():
    """Greedy with MTP drafts (k = 1..3) reproduces the int4 model's own k=0 tokens exactly
    (verification runs 2-4 rows through the 4-bit GEMV); the demo model's MTP head, in 4
    bits too, still gets drafts accepted."""
    llm = LLM(quantization="int4", speculative_tokens=3, max_model_len=256, max_num_seqs=4,
              cache_memory=64 << 20)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What does json.dumps do?", "What is a hash table?",
                         "How does binary search work?")]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False,
                                                          speculative_tokens=0)]
    for k in (1, 3):
        outs = llm.generate(prompts, sp, use_tqdm=False, speculative_tokens=k)
        assert [o.outputs[0].token_ids for o in outs] == base, k
        assert sum(o.metrics["spec"]["num_accepted"] for o in outs) > 0


def test_int4_runs_on_the_cpu_only(ckpt):
    with pytest.raises(ValueError, match="CPU backends only"):
        LLM(ckpt, quantization="int4", backend="triton")


def test_cli_generate_with_int4():
    res = CliRunner().invoke(app, ["generate", "-p", "What does json.dumps do?", "--chat",
                                   "--quantization", "int4", "--temperature", "0",
                                   "--max-tokens", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["token_ids"]) == 4


# Stored int4 checkpoints (hybridrt quantize --quantization int4) ---------------------------
@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "int4"
    info = save_quantized(ckpt, out, "int4")
    assert info["path"] == str(out) and (out / "model.safetensors").stat().st_size == info["bytes"]
    return out


def test_saved_int4_checkpoint_holds_the_load_time_quantization(ckpt, saved):
    """Every 4-bit and int8 weight and every other tensor as loading the source with
    quantization="int4" gives them, whatever quantization is asked."""
    fresh, _, _ = load_model(ckpt, torch.bfloat16, quantization="int4", with_mtp=True)
    stored, _, _ = load_model(saved, torch.bfloat16, quantization="int8", with_mtp=True)
    q_fresh = {n: m.qweight for n, m in fresh.named_modules()
               if isinstance(getattr(m, "qweight", None), quant.PackedWeight)}
    q_stored = {n: m.qweight for n, m in stored.named_modules()
                if isinstance(getattr(m, "qweight", None), quant.PackedWeight)}
    assert q_fresh.keys() == q_stored.keys() and "mtp.fc" in q_stored
    for n, qw in q_fresh.items():
        assert type(q_stored[n]) is type(qw) and q_stored[n].shape == qw.shape, n
        assert all(torch.equal(a, b) for a, b in zip(q_stored[n].tensors(), qw.tensors())), n
    sd_fresh, sd_stored = fresh.state_dict(), stored.state_dict()
    assert sd_fresh.keys() == sd_stored.keys()
    assert all(torch.equal(sd_fresh[k], sd_stored[k]) for k in sd_fresh)


def test_saved_int4_checkpoint_generates_what_load_time_int4_does(ckpt, saved):
    prompts = [{"prompt_token_ids": [5, 9, 2, 77, 31]}, {"prompt_token_ids": [40, 41, 3]}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for llm in (LLM(ckpt, quantization="int4", cache_memory=16 << 20),
                LLM(saved, cache_memory=16 << 20)):
        assert llm.quantization == "int4"
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_another_quantization_of_a_stored_int4_checkpoint_is_refused(saved):
    """int8 asked of a checkpoint stored in int4 is refused, never ignored; int4 or nothing
    loads it as it is."""
    with pytest.raises(ValueError, match=r"quantization='int8': the checkpoint at .* is stored "
                                         r"in int4 and is not quantized again"):
        LLM(saved, quantization="int8", cache_memory=16 << 20)
    assert LLM(saved, quantization="int4", cache_memory=16 << 20).quantization == "int4"
    res = CliRunner().invoke(app, ["generate", str(saved), "-p", "x", "--quantization", "int8",
                                   "--max-tokens", "2", "--no-progress"])
    assert res.exit_code == 1 and "stored in int4" in res.output, res.output


def test_saved_int4_checkpoint_errors(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    from hybridrt.loader import QUANT_METADATA, CheckpointError

    tensors = load_file(str(saved / "model.safetensors"))
    meta = {"format": "pt", QUANT_METADATA: "int4"}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((saved / "config.json").read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    cases = [
        ({k: v for k, v in tensors.items() if k != f"{name}.codes"}, meta,
         rf"missing tensor: {name}\.codes"),
        ({**tensors, f"{name}.scales": tensors[f"{name}.scales"].half()}, meta,
         r"\(qs, codes, scales\) must be torch.uint8, torch.uint8, torch.bfloat16, found "
         r"torch.uint8, torch.uint8, torch.float16"),
        ({**tensors, f"{name}.codes": tensors[f"{name}.codes"][:1]}, meta,
         rf"{name}\.codes: expected"),
        (tensors, {"format": "pt", QUANT_METADATA: "int8"},  # 4-bit tensors read as int8
         rf"shape mismatch: {name}\.qs: expected \[3, 3, 8, 16, 4\], found \[3, 3, 4, 64\]"
         rf"(.|\n)*unexpected tensor: {name}\.codes"),
    ]
    for t, md, match in cases:
        save_file(t, str(bad / "model.safetensors"), metadata=md)
        with pytest.raises(CheckpointError, match=match):
            load_model(bad)


def test_int4_checkpoint_with_the_int8_head_still_loads(ckpt, saved, tmp_path):
    """An int4 checkpoint stored before the LM head took 6 bits (its embedding's .qs and .scales
    in int8, no .hs or .codes) loads with that int8 head and computes what the int4 model with
    its head swapped for the int8 one does; a 6-bit head missing its high plane is an error."""
    from safetensors.torch import load_file, save_file

    from hybridrt.loader import QUANT_METADATA, CheckpointError

    tensors = load_file(str(saved / "model.safetensors"))
    emb = "model.embed_tokens.weight"
    source, _, _ = load_model(ckpt, torch.bfloat16)
    int8 = quant.quantize(source.model.embed_tokens.weight)
    old = {k: v for k, v in tensors.items() if not k.startswith(emb + ".")}
    old.update({f"{emb}.qs": int8.qs, f"{emb}.scales": int8.scales})
    for d, t in (("old", old), ("bad", {k: v for k, v in tensors.items() if k != f"{emb}.hs"})):
        (tmp_path / d).mkdir()
        for f in saved.iterdir():
            if f.suffix != ".safetensors":
                (tmp_path / d / f.name).write_bytes(f.read_bytes())
        save_file(t, str(tmp_path / d / "model.safetensors"),
                  metadata={"format": "pt", QUANT_METADATA: "int4"})
    net, config, _ = load_model(tmp_path / "old", torch.float32)
    head = net.model.embed_tokens.qweight
    assert type(head) is quant.QuantWeight
    assert torch.equal(head.qs, int8.qs) and torch.equal(head.scales, int8.scales)
    assert type(net.model.layers[0].mlp.down_proj.qweight) is int4.Int4Weight
    ref, _, _ = load_model(ckpt, torch.float32, quantization="int4")
    ref.model.embed_tokens.qweight = int8
    for m in (net, ref):
        m.set_backend(CPUBackend(config))
    assert torch.equal(_logits(net, PROMPTS), _logits(ref, PROMPTS))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(tmp_path / "old", cache_memory=16 << 20)
    assert llm.quantization == "int4"
    assert len(llm.generate([{"prompt_token_ids": [5, 9, 2]}], sp,
                            use_tqdm=False)[0].outputs[0].token_ids) == 6
    with pytest.raises(CheckpointError,
                       match=rf"missing tensor: {emb}\.hs \(expected \[9, 2, 2, 64\]\)"):
        load_model(tmp_path / "bad")


def test_cli_quantize_int4(ckpt, tmp_path):
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(ckpt), str(out), "--quantization", "int4"])
    assert res.exit_code == 0, res.output
    assert res.stderr.startswith(f"wrote {out}: ")
    assert LLM(out, cache_memory=16 << 20).quantization == "int4"
    res = CliRunner().invoke(app, ["quantize", str(ckpt), str(tmp_path / "x"),
                                   "--quantization", "int3"])
    assert res.exit_code == 2 and not (tmp_path / "x").exists()
    assert res.stderr.strip() == ("error: --quantization: unknown quantization 'int3'; choose "
                                  "int8 or int4 (or none)")


# The build target ----------------------------------------------------------------------------
def test_one_build_per_process():
    """A process runs the kernels of one build: asking for another target is an error."""
    if native.load() is None:
        pytest.skip("compiled kernels unavailable")
    with pytest.raises(RuntimeError, match="loaded for -march=native in this process"):
        native.load(march="haswell")
    assert native.load(march="native") is native.load()


_MARCH_PROBE = """
import sys
import torch
from hybridrt import LLM, SamplingParams
from hybridrt.kernels import int4, native, quant
llm = LLM(sys.argv[1], quantization="int4", tokenizer=None, cache_memory=16 << 20)
sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
(out,) = llm.generate([[5, 9, 2]], sp, use_tqdm=False)
g = torch.Generator().manual_seed(0)
qw = int4.quantize(torch.randn(40, 300, generator=g))
x = torch.randn(5, 300, generator=g)
ok = all(torch.equal(int4.gemm(x, qw, i), int4.emulate(x, qw)) for i in int4.available_isas())
print(native._march, int4.available_isas(), quant.available_isas(),
      llm.engine.runner.model.backend.int4_isa, ok, len(out.outputs[0].token_ids))
"""


@pytest.mark.skipif(native.load() is None or not sys.platform.startswith("linux"),
                    reason="compiled kernels unavailable")
def test_march_switch_builds_for_another_level(ckpt, tmp_path):
    """HYBRIDRT_MARCH=haswell builds the kernels for AVX2 (its own file in the cache, the key
    holds the target) before the model is quantized at load: no AVX-512 paths in it, the
    backend on the AVX2 path, its 4-bit paths still equal to the emulation."""
    environ = {**os.environ, "HYBRIDRT_MARCH": "haswell", "HYBRIDRT_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _MARCH_PROBE, str(ckpt)], env=environ,
                         capture_output=True, text=True, timeout=600, check=True).stdout.split()
    assert out == ["haswell", "['ref',", "'avx2']", "['ref',", "'avx2']", "avx2", "True", "3"], out
    assert len(list(tmp_path.glob("hybridrt-cpu-*.so"))) == 1
