"""Triton GDN decode/verify (kernels/cuda/gdn.py) against the plain-torch references."""

import pytest
import torch
import torch.nn.functional as F

from hybridrt.kernels.conv import causal_conv1d_update
from hybridrt.kernels.cuda.gdn import conv_update, gdn_recurrent
from hybridrt.kernels.delta_rule import recurrent_gated_delta_rule


def _gdn_inputs(B, L, HK, HV, DK, DV, dtype, device, seed=0, param_dtype=torch.float32):
    """q, k, v as slices of one packed [B*L, conv_dim] projection output (as the model has
    them), a/b as slices of another packed tensor: all non-contiguous views."""
    gen = torch.Generator().manual_seed(seed)
    key, val = HK * DK, HV * DV
    packed = torch.randn(B * L, 2 * key + val + 3, generator=gen).to(dtype).to(device)
    q = packed[:, :key].view(B, L, HK, DK)
    k = packed[:, key:2 * key].view(B, L, HK, DK)
    v = packed[:, 2 * key:2 * key + val].view(B, L, HV, DV)
    ab = torch.randn(B * L, 2 * HV + 1, generator=gen) * 2
    ab[0, 0] = 30.0  # softplus above its threshold (20)
    ab[-1, 1] = -25.0  # softplus of a very negative input
    ab = ab.to(dtype).to(device)
    a = ab[:, :HV].view(B, L, HV)
    b = ab[:, HV + 1:].view(B, L, HV)
    A_log = (torch.randn(HV, generator=gen) * 0.5).to(param_dtype).to(device)
    dt_bias = torch.randn(HV, generator=gen).to(param_dtype).to(device)
    assert not q.is_contiguous() and not v.is_contiguous() and not a.is_contiguous()
    return q, k, v, a, b, A_log, dt_bias


GUARD = 7.0


def _pool(S, shape, device, dtype=torch.float32, seed=1, nan_slots=()):
    """A contiguous [S, *shape] pool inside a buffer with one guard slot either side (filled
    with GUARD): writes for slot -1 or past the last slot land there. Slots not written must
    come back bit-identical: random values (a spill into a neighbouring slot changes them) or
    NaN (slots named only as outputs: NaN left anywhere means an element was not written)."""
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(S + 2, *shape, generator=gen) * 0.5).to(dtype)
    buf[0] = buf[-1] = GUARD
    for s in nan_slots:
        buf[s + 1] = float("nan")
    buf = buf.to(device)
    return buf[1:S + 1], buf


def _check_guards(buf):
    assert (buf[0] == GUARD).all() and (buf[-1] == GUARD).all(), "write outside the pool"


def _real_rows(state_slots):
    return torch.tensor([i for i, s in enumerate(state_slots.tolist()) if s >= 0],
                        dtype=torch.long, device=state_slots.device)


def _ref_slots_out(slots_out, S):
    """The references cannot skip a write: aim out-slots < 0 at a scratch slot S."""
    return None if slots_out is None else torch.where(slots_out < 0, S, slots_out).long()


def _ref_gdn(q, k, v, a, b, A_log, dt_bias, states, slots, slots_out):
    """Reference over the non-padding rows (padding rows get 0); ``states`` has one scratch
    slot at the end for skipped writes."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    rows = _real_rows(slots)
    B, L, HV, DV = v.shape
    o = torch.zeros(B, L, HV, DV, dtype=torch.float32, device=v.device)
    if len(rows):
        out = _ref_slots_out(slots_out, states.shape[0] - 1)
        o[rows] = recurrent_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], states, slots[rows].long(),
            None if out is None else out[rows]).float()
    return o


def _run_gdn(B, L, HK, HV, DK, DV, dtype, device, slots, slots_out, S, nan_slots,
             param_dtype=torch.float32, seed=0):
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(B, L, HK, HV, DK, DV, dtype, device, seed,
                                                param_dtype)
    pool, buf = _pool(S, (HV, DK, DV), device, nan_slots=nan_slots)
    ref_pool = torch.cat([pool, torch.zeros_like(pool[:1])])  # + scratch slot
    o_ref = _ref_gdn(q, k, v, a, b, A_log, dt_bias, ref_pool, slots, slots_out)
    o = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, pool, slots, slots_out)
    assert o.shape == (B, L, HV, DV) and o.dtype == v.dtype
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o.float(), o_ref, **tol)
    # written slots match the reference; every other slot (NaN or random) is unchanged
    torch.testing.assert_close(pool, ref_pool[:S], rtol=1e-5, atol=2e-5, equal_nan=True)
    _check_guards(buf)
    written = set(slots.tolist()) if slots_out is None else set(slots_out.flatten().tolist())
    for s in nan_slots:
        if s not in written:
            assert torch.isnan(pool[s]).all()
    for r, s in enumerate(slots.tolist()):
        if s < 0:
            assert (o[r] == 0).all()
    return o, pool


def _verify_layout(L, device, dtype=torch.int64):
    """Slots for 3 rows verifying L tokens. Row 0 continues in its own slot
    (state_slots_out[0, 0] == state_slots[0]); row 1 writes fresh (NaN) slots and skips the
    write after token 0 (out-slot -1) when L > 1; row 2 is padding whose out-slots name real NaN
    slots that must stay NaN. Named slots are odd: the even ones hold random values that must
    stay unchanged (a write spilling past a slot changes its neighbour); slot 0 is NaN."""
    odd = iter(range(1, 1000, 2))
    s0, s1 = next(odd), next(odd)
    out0 = [s0] + [next(odd) for _ in range(L - 1)]
    out1 = [next(odd) for _ in range(L)]
    if L > 1:
        out1[0] = -1
    out2 = [next(odd) for _ in range(L)]
    S = max(out2) + 2
    nan = [0] + out0[1:] + [s for s in out1 if s >= 0] + out2
    slots = torch.tensor([s0, s1, -1], dtype=dtype, device=device)
    out = torch.tensor([out0, out1, out2], dtype=dtype, device=device)
    return slots, out, S, nan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_gdn_decode_grouped(device, dtype, slot_dtype):
    # HK=2, HV=4, odd DK/DV; row 2 is padding (slot -1: the guard before the pool stays);
    # slots 0 and 3 NaN, 2, 5, 7 (neighbours of the written ones) random, all unchanged
    slots = torch.tensor([4, 1, -1, 6], dtype=slot_dtype, device=device)
    _run_gdn(4, 1, 2, 4, 10, 6, dtype, device, slots, None, S=8, nan_slots=(0, 3))


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_gdn_verify_grouped(device, L):
    slots, out, S, nan = _verify_layout(L, device)
    _run_gdn(3, L, 2, 4, 10, 6, torch.float32, device, slots, out, S=S, nan_slots=nan)


def test_gdn_verify_bf16_param_dtypes(device):
    # bf16 q/k/v/a/b and bf16 A_log/dt_bias, int32 slots
    slots, out, S, nan = _verify_layout(3, device, torch.int32)
    _run_gdn(3, 3, 2, 4, 10, 6, torch.bfloat16, device, slots, out, S=S, nan_slots=nan,
             param_dtype=torch.bfloat16, seed=3)


def test_gdn_equal_heads_decode(device):
    slots = torch.tensor([0, 4, 2], device=device)
    _run_gdn(3, 1, 3, 3, 10, 6, torch.float32, device, slots, None, S=6, nan_slots=(3,), seed=5)


def test_gdn_128_heads(device):
    # 0.8B-like head size (DK = DV = 128), 2 heads: decode, and a 2-token verify
    slots = torch.tensor([2, -1, 0], device=device)
    _run_gdn(3, 1, 2, 2, 128, 128, torch.float32, device, slots, None, S=4, nan_slots=(3,),
             seed=7)
    slots, out, S, nan = _verify_layout(2, device)
    _run_gdn(3, 2, 2, 2, 128, 128, torch.float32, device, slots, out, S=S, nan_slots=nan,
             seed=8)


def test_gdn_128_bf16(device):
    slots = torch.tensor([1], device=device)
    out = torch.tensor([[1, 3, 5]], device=device)
    _run_gdn(1, 3, 2, 2, 128, 128, torch.bfloat16, device, slots, out, S=7, nan_slots=(0, 3, 5),
             seed=9)


def test_gdn_rollback_chain(device):
    """Verify 3 tokens into slots [0, 1, 2], then continue from slot 1 (2 accepted): equals
    running the 2 accepted tokens one by one in place."""
    B, L, HK, HV, DK, DV = 1, 3, 1, 2, 8, 4
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(B, L, HK, HV, DK, DV, torch.float32, device, 11)
    pool, _ = _pool(4, (HV, DK, DV), device)
    seq = pool.clone()
    gdn_recurrent(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([0], device=device),
                  torch.tensor([[0, 1, 2]], device=device))
    one = torch.tensor([0], device=device)
    for t in range(2):
        sl = slice(t, t + 1)
        gdn_recurrent(q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl], A_log, dt_bias, seq, one)
    torch.testing.assert_close(pool[1], seq[0], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# conv_update


def _run_conv(B, L, C, K, dtype, device, slots, slots_out, S, nan_slots, activation="silu",
              seed=0, state_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(B, L, C + 5, generator=gen).to(dtype).to(device)
    x = big[..., 2:2 + C]  # strided view, last dim contiguous
    assert not x.is_contiguous()
    weight = (torch.randn(C, K, generator=gen) * 0.5).to(dtype).to(device)
    pool, buf = _pool(S, (K - 1, C), device, dtype=state_dtype or dtype, seed=seed + 1,
                      nan_slots=nan_slots)
    ref_pool = torch.cat([pool, torch.zeros_like(pool[:1])])  # + scratch slot
    rows = _real_rows(slots)
    y_ref = torch.zeros(B, L, C, dtype=dtype, device=device)
    if len(rows):
        out = _ref_slots_out(slots_out, S)
        y_ref[rows] = causal_conv1d_update(
            x[rows], weight, ref_pool, slots[rows].long(), activation=activation,
            state_slots_out=None if out is None else out[rows])
    y = conv_update(x, weight, pool, slots, slots_out, activation=activation)
    assert y.shape == (B, L, C) and y.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    # the states are copies of inputs: bit-exact, NaN and random untouched slots unchanged
    # (except a cast state -> x dtype -> state dtype: the interpreter rounds bf16 towards zero)
    exact = state_dtype in (None, dtype) or torch.cuda.is_available()
    torch.testing.assert_close(pool, ref_pool[:S], rtol=0 if exact else 1e-2,
                               atol=0 if exact else 1e-2, equal_nan=True)
    _check_guards(buf)
    for r, s in enumerate(slots.tolist()):
        if s < 0:
            assert (y[r] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_decode(device, dtype, activation):
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device=device)
    _run_conv(3, 1, 20, 4, dtype, device, slots, None, S=6, nan_slots=(2, 5),
              activation=activation)


@pytest.mark.parametrize("L", [1, 2, 3, 4, 5])
def test_conv_verify(device, L):
    # L=5 > K-1: the state after the last tokens holds tokens only
    slots, out, S, nan = _verify_layout(L, device)
    _run_conv(3, L, 20, 4, torch.float32, device, slots, out, S=S, nan_slots=nan)


@pytest.mark.parametrize("K", [2, 3, 5])
def test_conv_other_widths(device, K):
    slots, out, S, nan = _verify_layout(2, device)
    _run_conv(3, 2, 20, K, torch.float32, device, slots, out, S=S, nan_slots=nan, seed=K)
    slots = torch.tensor([3, 1], device=device)
    _run_conv(2, 3, 20, K, torch.float32, device, slots, None, S=5, nan_slots=(0,), seed=K)


def test_conv_bf16_verify_wide(device):
    # more channels than one block
    slots, out, S, nan = _verify_layout(3, device)
    _run_conv(3, 3, 300, 4, torch.bfloat16, device, slots, out, S=S, nan_slots=nan)


def test_conv_state_dtype_differs(device):
    # fp32 states with bf16 x: the old rows go through x's dtype, as in the reference
    slots = torch.tensor([1, 3], device=device)
    _run_conv(2, 1, 20, 4, torch.bfloat16, device, slots, None, S=5, nan_slots=(0,),
              state_dtype=torch.float32)


def test_conv_rejects_unsupported_width(device):
    x = torch.zeros(1, 1, 4, device=device)
    with pytest.raises(ValueError):
        conv_update(x, torch.zeros(4, 6, device=device), torch.zeros(2, 5, 4, device=device),
                    torch.zeros(1, dtype=torch.long, device=device))
