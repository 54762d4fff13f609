"""Fused decode kernels (hybridrt.kernels.cuda.fused) against their plain-torch compositions.

fp32: tight tolerance. bf16: bit-exact, except that a few elements may be one bf16 ulp off
where the reference's fp32 intermediates cannot be reproduced exactly (the order of the fp32
sum in mean(x^2), fp32 exp / rsqrt implementations; see the module docstring): such a
difference flips a bf16 rounding only rarely (a few elements per million on a GPU), so at
most ``_ALLOWED_OFF`` elements per tensor may differ, and by one ulp only. The residual output of
``rms_norm(..., residual=)`` has no such intermediate and must always be exact.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridrt.kernels.cuda import fused
from hybridrt.kernels.norm import gated_rms_norm as ref_gated_rms_norm
from hybridrt.kernels.norm import rms_norm as ref_rms_norm
from hybridrt.kernels.rope import apply_partial_rope, rope_cos_sin

DTYPES = [torch.float32, torch.bfloat16]


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 bits as integers whose difference counts ulps (across zero too)."""
    b = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def _allowed_off(n: int) -> int:
    return max(2, n // 2000)


def check(out: torch.Tensor, ref: torch.Tensor, exact: bool = False):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.is_contiguous()
    if out.dtype == torch.float32:
        if exact:
            assert torch.equal(out, ref)
        else:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    assert out.dtype == torch.bfloat16
    assert not torch.isnan(out).any() and not torch.isnan(ref).any()
    diff = out != ref
    n_off = int(diff.sum())
    if exact:
        assert n_off == 0, f"{n_off} of {out.numel()} elements differ"
        return
    ulps = (_ordered(out) - _ordered(ref)).abs()
    assert int(ulps.max()) <= 1, f"max {int(ulps.max())} ulps off"
    assert n_off <= _allowed_off(out.numel()), f"{n_off} of {out.numel()} elements 1 ulp off"


def strided_rows(n, d, dtype, device, gap=5, scale=3.0):
    """[n, d] view with row stride d + gap; the gap columns hold NaN (must never be read)."""
    buf = torch.full((n, d + gap), float("nan"), dtype=torch.float32, device=device)
    buf[:, :d] = torch.randn(n, d, device=device) * scale
    buf = buf.to(dtype)
    return buf[:, :d], buf


def zc_weight(d, dtype, device):
    return (torch.randn(d, device=device) * 0.2).to(dtype)


# ---------------------------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", [(1, 48), (7, 12), (3, 1024)])
def test_rms_norm_strided_rows(device, dtype, n, d):
    torch.manual_seed(0)
    x, buf = strided_rows(n, d, dtype, device)
    before = buf.clone()
    w = zc_weight(d, dtype, device)
    y = fused.rms_norm(x, w, 1e-6)
    check(y, ref_rms_norm(x, w, 1e-6))
    assert torch.equal(buf.isnan(), before.isnan())
    assert torch.equal(buf.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_leading_dims_and_fp32_weight(device, dtype):
    torch.manual_seed(1)
    # [T, H, D] view with strided leading dims (q out of a [T, H, 2D] projection)
    qg = (torch.randn(3, 4, 2 * 20, device=device) * 2).to(dtype)
    x = qg[..., :20]
    w = torch.randn(20, device=device) * 0.2  # fp32 weight, as before a dtype cast
    check(fused.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5))
    x4 = (torch.randn(2, 3, 2, 12, device=device)).to(dtype)
    check(fused.rms_norm(x4, w[:12], 1e-6), ref_rms_norm(x4, w[:12], 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", [(1, 48), (5, 12), (2, 1024)])
def test_rms_norm_residual(device, dtype, n, d):
    torch.manual_seed(2)
    x, _ = strided_rows(n, d, dtype, device)
    res = (torch.randn(n, d, device=device) * 4).to(dtype)
    res_before = res.clone()
    w = zc_weight(d, dtype, device)
    y, h = fused.rms_norm(x, w, 1e-6, residual=res)
    h_ref = res + x  # the DecoderLayer's "h = h + mixer(...)"
    check(h, h_ref, exact=True)
    check(y, ref_rms_norm(h_ref, w, 1e-6))
    assert torch.equal(res, res_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_small_values_eps_matters(device, dtype):
    """mean(x^2) of the order of eps: eps must be added where the reference adds it."""
    torch.manual_seed(9)
    x = (torch.randn(3, 48, device=device) * 1e-3).to(dtype)
    w = zc_weight(48, dtype, device)
    check(fused.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
    xg = (torch.randn(2, 2, 12, device=device) * 1e-3).to(dtype)
    z = torch.randn(2, 2, 12, device=device).to(dtype)
    check(fused.gated_rms_norm(xg, z, w[:12] + 1, 1e-6),
          ref_gated_rms_norm(xg, z, w[:12] + 1, 1e-6))


def test_rms_norm_large_values_and_ties(device):
    """bf16 rounding of the residual add on many exact ties (sums of two bf16 values)."""
    torch.manual_seed(3)
    n, d = 4, 64
    x = (torch.randn(n, d, device=device) * 100).bfloat16()
    res = (torch.randn(n, d, device=device) * 100).bfloat16()
    w = zc_weight(d, torch.bfloat16, device)
    y, h = fused.rms_norm(x, w, 1e-6, residual=res)
    check(h, res + x, exact=True)
    check(y, ref_rms_norm(res + x, w, 1e-6))


# ---------------------------------------------------------------------------------------------
# gated_rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hv,dv", [(1, 3, 12), (4, 2, 48), (1, 4, 128)])
def test_gated_rms_norm(device, dtype, n, hv, dv):
    torch.manual_seed(4)
    x = (torch.randn(n, hv, dv, device=device) * 2).to(dtype)
    # z: a strided view into a wider projection, NaN in the gaps
    zbuf = torch.full((n, hv * dv + 7), float("nan"), device=device)
    zbuf[:, 3:3 + hv * dv] = torch.randn(n, hv * dv, device=device) * 3
    zbuf = zbuf.to(dtype)
    z = zbuf[:, 3:3 + hv * dv].view(n, hv, dv)
    assert not z.is_contiguous() or n == 1
    w = (1.0 + torch.randn(dv, device=device) * 0.3).to(dtype)  # plain (not zero-centred)
    check(fused.gated_rms_norm(x, z, w, 1e-6), ref_gated_rms_norm(x, z, w, 1e-6))


def test_gated_rms_norm_fp32_weight_head_strides(device):
    """bf16 activations with an fp32 weight: weight * x.to(bf16) promotes to fp32 (no rounding
    there); x itself a [N, HV, DV] view with a padded head stride."""
    torch.manual_seed(5)
    n, hv, dv = 3, 4, 12
    xbuf = torch.full((n, hv, dv + 4), float("nan"), device=device)
    xbuf[..., :dv] = torch.randn(n, hv, dv, device=device) * 2
    x = xbuf.bfloat16()[..., :dv]
    z = (torch.randn(n, hv, dv, device=device) * 3).bfloat16()
    w = 1.0 + torch.randn(dv, device=device) * 0.3
    check(fused.gated_rms_norm(x, z, w, 1e-6), ref_gated_rms_norm(x, z, w, 1e-6))


# ---------------------------------------------------------------------------------------------
# silu_mul


def ref_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,i", [(1, 20), (6, 48), (1, 3584), (3, 1500)])
def test_silu_mul(device, dtype, n, i):
    torch.manual_seed(6)
    gu, buf = strided_rows(n, 2 * i, dtype, device, gap=3, scale=4.0)
    y = fused.silu_mul(gu)
    check(y, ref_silu_mul(gu))
    assert buf[:, 2 * i:].isnan().all()


def test_silu_mul_leading_dims(device):
    torch.manual_seed(7)
    gu = (torch.randn(2, 3, 2 * 12, device=device) * 4).bfloat16()
    check(fused.silu_mul(gu), ref_silu_mul(gu))


# ---------------------------------------------------------------------------------------------
# qk_norm_rope


def ref_qk_norm_rope(q, k, qw, kw, eps, cos, sin):
    return (apply_partial_rope(ref_rms_norm(q, qw, eps), cos, sin),
            apply_partial_rope(ref_rms_norm(k, kw, eps), cos, sin))


def _qk_inputs(t, h, hkv, d, dtype, device, seed):
    torch.manual_seed(seed)
    # exactly as GatedAttention.forward: q out of a [T, H, 2D] query+gate projection
    qg = (torch.randn(t, h * 2 * d, device=device) * 2).to(dtype)
    q, gate = qg.view(t, h, 2 * d).chunk(2, dim=-1)
    # k: a view into a wider (e.g. merged k|v) projection, NaN elsewhere
    kvbuf = torch.full((t, 2 * hkv * d), float("nan"), device=device)
    kvbuf[:, :hkv * d] = torch.randn(t, hkv * d, device=device) * 2
    k = kvbuf.to(dtype)[:, :hkv * d].view(t, hkv, d)
    qw, kw = zc_weight(d, dtype, device), zc_weight(d, dtype, device)
    return qg, q, gate, k, qw, kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,h,hkv,d,r",
    [(1, 2, 1, 12, 4), (3, 4, 2, 48, 12), (2, 3, 1, 48, 48), (2, 2, 2, 12, 0),
     (1, 8, 2, 256, 64)],
)
def test_qk_norm_rope(device, dtype, t, h, hkv, d, r):
    qg, q, gate, k, qw, kw = _qk_inputs(t, h, hkv, d, dtype, device, seed=8 + d + r)
    qg_before = qg.clone()
    positions = torch.arange(t, device=device) * 37 + 5
    cos, sin = rope_cos_sin(positions, r, 1e7 if r else 1.0, dtype)
    qo, ko = fused.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    qr, kr = ref_qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    assert qo.shape == (t, h, d) and ko.shape == (t, hkv, d)
    check(qo, qr)
    check(ko, kr)
    assert torch.equal(qg, qg_before)  # the gate half (and q) untouched


def test_qk_norm_rope_fp32_cos_promotes(device):
    """bf16 q/k with fp32 cos/sin: the reference's RoPE runs (and returns) in fp32."""
    _, _, q, _, k, qw, kw = (None,) + _qk_inputs(2, 2, 1, 48, torch.bfloat16, device, seed=30)
    cos, sin = rope_cos_sin(torch.tensor([3, 900], device=device), 16, 1e7, torch.float32)
    qo, ko = fused.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    qr, kr = ref_qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    assert qo.dtype == torch.float32
    # the only rounding is the norm's bf16 output: compare that exactly-representable part
    # with a tolerance covering a 1-ulp bf16 flip of the norm
    torch.testing.assert_close(qo, qr, rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(ko, kr, rtol=2 ** -7, atol=1e-6)
    assert (qo != qr).sum() <= _allowed_off(qo.numel())


def test_qk_norm_rope_rejects_odd_rotary_dim(device):
    _, q, _, k, qw, kw = _qk_inputs(1, 2, 1, 12, torch.float32, device, seed=31)
    cos = torch.ones(1, 5, device=device)
    with pytest.raises(ValueError):
        fused.qk_norm_rope(q, k, qw, kw, 1e-6, cos, cos)
