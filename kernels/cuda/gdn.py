"""Triton kernels for Gated DeltaNet decode and draft verification over the state-slot pool.

``gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots, state_slots_out=None)``
    q, k: [B, L, HK, DK]; v: [B, L, HV, DV]; a, b: [B, L, HV] raw projections; A_log,
    dt_bias: [HV]; ssm_states: [S, HV, DK, DV] fp32 pool, updated in place. Gating in fp32
    in the kernel (``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``), q/k
    l2-normalised (eps 1e-6), q scaled by DK^-0.5, key head h serves value heads
    h*r .. h*r+r-1. Same result as ``hybridrt.kernels.delta_rule.recurrent_gated_delta_rule``.
    Returns o [B, L, HV, DV] in v's dtype.
``conv_update(x, weight, conv_states, state_slots, state_slots_out=None, activation="silu")``
    x: [B, L, C]; weight: [C, K] (2 <= K <= 5); conv_states: [S, K-1, C] time-major (oldest
    first), any float dtype (old rows go through x's dtype, as in the reference). Same
    result as ``hybridrt.kernels.conv.causal_conv1d_update``. Returns y [B, L, C] in x's dtype.

Slots: ``state_slots`` [B] (int32/int64) names each row's initial state. Without
``state_slots_out`` the final state goes back to ``state_slots[b]``; with ``state_slots_out``
[B, L] the state after token t goes to ``state_slots_out[b, t]`` only (speculative
verification; ``state_slots_out[b, 0] == state_slots[b]`` is allowed: the initial state is read
before anything is written). **A slot < 0 marks a padding row** (CUDA-graph padding): nothing is
read or written for it and its output is 0; a negative entry of ``state_slots_out`` skips that
one write. Distinct rows must not share slots (as in the reference).

q, k, v, a, b and x may be strided views (e.g. slices of a packed projection output): any
strides on the batch/token/head dims, last dim contiguous. Everything is shape-driven (no host
sync, no value-dependent allocation), so the ops can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus (beta 1, threshold 20); log1p(e) via log(u) * e / (u - 1)
    # (exact where 1 + e rounds to 1)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    d = u - 1.0
    lp = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _and(mask, cond):
    # mask & cond for a block mask and a scalar condition (a plain `&` with a scalar loses the
    # bool dtype under the Triton interpreter)
    return tl.where(cond, mask, False)


# L is not specialized (Triton compiles other code for L == 1): a decode step, a verification
# and a prompt of L tokens run the same compiled loop body (batch-invariant mode)
@triton.jit(do_not_specialize=["L"])
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, slot_ptr, slot_out_ptr, o_ptr,
    L,
    sq_b, sq_l, sq_h, sk_b, sk_l, sk_h, sv_b, sv_l, sv_h,
    sa_b, sa_l, sa_h, sb_b, sb_l, sb_h, s_alog, s_dtb,
    sso_b, sso_l,
    so_b, so_l, so_h,
    scale,
    HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_OUT: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bi = pid_bh // HV
    hv = pid_bh % HV
    hk = hv // R

    slot = tl.load(slot_ptr + bi).to(tl.int64)
    valid = slot >= 0

    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < DK
    mv = offs_v < DV
    mkv = mk[:, None] & mv[None, :]
    lk = _and(mk, valid)
    lv = _and(mv, valid)
    lkv = _and(mkv, valid)

    st_off = offs_k[:, None] * DV + offs_v[None, :]
    head_off = hv.to(tl.int64) * (DK * DV)
    # the whole initial state block is read before any write (state_slots_out[b, 0] may be
    # state_slots[b])
    S = tl.load(s_ptr + slot * (HV * DK * DV) + head_off + st_off, mask=lkv, other=0.0)

    neg_A = -tl.exp(tl.load(alog_ptr + hv * s_alog).to(tl.float32))
    dt_b = tl.load(dtb_ptr + hv * s_dtb).to(tl.float32)

    for t in range(L):
        q = tl.load(q_ptr + bi * sq_b + t * sq_l + hk * sq_h + offs_k, mask=lk,
                    other=0.0).to(tl.float32)
        kk = tl.load(k_ptr + bi * sk_b + t * sk_l + hk * sk_h + offs_k, mask=lk,
                     other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + bi * sv_b + t * sv_l + hv * sv_h + offs_v, mask=lv,
                     other=0.0).to(tl.float32)
        a = tl.load(a_ptr + bi * sa_b + t * sa_l + hv * sa_h, mask=valid, other=0.0)
        bb = tl.load(b_ptr + bi * sb_b + t * sb_l + hv * sb_h, mask=valid, other=0.0)
        g = neg_A * _softplus(a.to(tl.float32) + dt_b)
        beta = _sigmoid(bb.to(tl.float32))

        q = q * (tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale)
        kk = kk * tl.math.rsqrt(tl.sum(kk * kk, axis=0) + 1e-6)

        S = S * tl.exp(g)
        kv = tl.sum(S * kk[:, None], axis=0)  # [BV]: S^T k
        delta = beta * (vv - kv)
        S = S + kk[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        o = tl.where(valid, o, 0.0)
        tl.store(o_ptr + bi * so_b + t * so_l + hv * so_h + offs_v,
                 o.to(o_ptr.dtype.element_ty), mask=mv)
        if HAS_OUT:
            so = tl.load(slot_out_ptr + bi * sso_b + t * sso_l).to(tl.int64)
            tl.store(s_ptr + so * (HV * DK * DV) + head_off + st_off, S,
                     mask=_and(lkv, so >= 0))

    if not HAS_OUT:
        tl.store(s_ptr + slot * (HV * DK * DV) + head_off + st_off, S, mask=lkv)


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_slots(state_slots, state_slots_out, B, L):
    if state_slots.dim() != 1 or state_slots.shape[0] != B:
        raise ValueError(f"state_slots must be [{B}], got {tuple(state_slots.shape)}")
    if state_slots_out is not None and tuple(state_slots_out.shape) != (B, L):
        raise ValueError(f"state_slots_out must be [{B}, {L}], got {tuple(state_slots_out.shape)}")
    for s in (state_slots, state_slots_out):
        if s is not None and s.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"state slots must be int32 or int64, got {s.dtype}")


def _gdn_config(B: int, HV: int, BK: int, DV: int, fixed: bool = False) -> tuple[int, int]:
    """(BV, num_warps): a [BK, BV] fp32 state block in registers, at most 4096 elements
    (16 KB) per program; narrower blocks at small batch so more SMs stream the state (chosen
    against a sweep of BV and warp counts, docs/performance.md). ``fixed``: the same block
    whatever the batch (batch-invariant mode: the block's shape and warps set the order of
    the sums over DK)."""
    BV = min(triton.next_power_of_2(DV), max(8, 4096 // BK), 32)
    if not fixed and B * HV * triton.cdiv(DV, BV) < 256 and BV > 16 and BK >= 64:
        BV //= 2
    num_warps = 4 if BK * BV >= 2048 else (2 if BK * BV >= 512 else 1)
    return BV, num_warps


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_slots: torch.Tensor,
    state_slots_out: torch.Tensor | None = None,
    fixed_blocks: bool = False,
) -> torch.Tensor:
    """Fused gating + l2norm + gated delta rule for L tokens of B rows, in place on the pool
    (see the module docstring). -> o [B, L, HV, DV] in v's dtype. ``fixed_blocks``: launch
    parameters independent of B (batch-invariant mode); a token's arithmetic is then the same
    whatever B and L, so a prompt of L tokens leaves the state L decode steps leave."""
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, L, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if a.shape != (B, L, HV) or b.shape != (B, L, HV):
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must be [{B}, {L}, {HV}]")
    if A_log.shape != (HV,) or dt_bias.shape != (HV,):
        raise ValueError(f"A_log/dt_bias must be [{HV}]")
    if (ssm_states.dim() != 4 or tuple(ssm_states.shape[1:]) != (HV, DK, DV)
            or ssm_states.dtype != torch.float32 or not ssm_states.is_contiguous()):
        raise ValueError(f"ssm_states must be a contiguous fp32 [S, {HV}, {DK}, {DV}], got "
                         f"{ssm_states.dtype} {tuple(ssm_states.shape)}")
    _check_slots(state_slots, state_slots_out, B, L)
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    o = torch.empty(B, L, HV, DV, dtype=v.dtype, device=v.device)
    if B == 0 or L == 0:
        return o
    BK = triton.next_power_of_2(DK)
    BV, num_warps = _gdn_config(B, HV, BK, DV, fixed_blocks)
    has_out = state_slots_out is not None
    so = state_slots_out if has_out else state_slots
    grid = (triton.cdiv(DV, BV), B * HV)
    _gdn_recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots, so, o,
        L,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        A_log.stride(0), dt_bias.stride(0),
        so.stride(0) if has_out else 0, so.stride(1) if has_out else 0,
        o.stride(0), o.stride(1), o.stride(2),
        DK ** -0.5,
        HV=HV, R=HV // HK, DK=DK, DV=DV, BK=BK, BV=BV, HAS_OUT=has_out,
        num_warps=num_warps,
    )
    return o


@triton.jit
def _hist_row(cs_ptr, x_ptr, offs, mask, r: tl.constexpr, STATE: tl.constexpr):
    # initial state row r (zeros when r >= K-1), through x's dtype as in the reference
    if r < STATE:
        h = tl.load(cs_ptr + offs, mask=mask, other=0.0)
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        h = tl.zeros(offs.shape, dtype=tl.float32)
    return h


@triton.jit
def _window(h0, h1, h2, h3, x_row, sx_l, lc, i, STATE: tl.constexpr):
    # window position i: initial state row i for i < K-1, else token i-(K-1) of x (a select,
    # no reduction: the history rows live in registers, one vector each)
    xi = tl.load(x_row + (i - STATE) * sx_l, mask=_and(lc, i >= STATE), other=0.0)
    h = tl.where(i == 0, h0, tl.where(i == 1, h1, tl.where(i == 2, h2, h3)))
    return tl.where(i >= STATE, xi.to(tl.float32), h)


@triton.jit(do_not_specialize=["L"])
def _conv_update_kernel(
    x_ptr, w_ptr, cs_ptr, slot_ptr, slot_out_ptr, y_ptr,
    L, C,
    sx_b, sx_l, sw_c, sw_k, sso_b, sso_l, sy_b, sy_l,
    K: tl.constexpr, BC: tl.constexpr, HAS_OUT: tl.constexpr, SILU: tl.constexpr,
):
    pid_c = tl.program_id(0)
    bi = tl.program_id(1)
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    valid = slot >= 0

    offs_c = pid_c * BC + tl.arange(0, BC)
    mc = offs_c < C
    lc = _and(mc, valid)
    STATE: tl.constexpr = K - 1
    # the initial window (K-1 <= 4 oldest-first rows) is read in full before any write
    base = cs_ptr + slot * (STATE * C)
    h0 = _hist_row(base, x_ptr, offs_c, lc, 0, STATE)
    h1 = _hist_row(base + C, x_ptr, offs_c, lc, 1, STATE)
    h2 = _hist_row(base + 2 * C, x_ptr, offs_c, lc, 2, STATE)
    h3 = _hist_row(base + 3 * C, x_ptr, offs_c, lc, 3, STATE)
    x_row = x_ptr + bi * sx_b + offs_c

    for t in range(L):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + offs_c * sw_c + j * sw_k, mask=mc, other=0.0).to(tl.float32)
            acc += wj * _window(h0, h1, h2, h3, x_row, sx_l, lc, t + j, STATE)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(valid, acc, 0.0)
        tl.store(y_ptr + bi * sy_b + t * sy_l + offs_c, acc.to(y_ptr.dtype.element_ty), mask=mc)
        if HAS_OUT:
            so = tl.load(slot_out_ptr + bi * sso_b + t * sso_l).to(tl.int64)
            for r in tl.static_range(STATE):
                val = _window(h0, h1, h2, h3, x_row, sx_l, lc, t + 1 + r, STATE)
                tl.store(cs_ptr + so * (STATE * C) + r * C + offs_c,
                         val.to(cs_ptr.dtype.element_ty), mask=_and(lc, so >= 0))

    if not HAS_OUT:
        for r in tl.static_range(STATE):
            val = _window(h0, h1, h2, h3, x_row, sx_l, lc, L + r, STATE)
            tl.store(cs_ptr + slot * (STATE * C) + r * C + offs_c,
                     val.to(cs_ptr.dtype.element_ty), mask=lc)


def _conv_config(B: int, C: int) -> tuple[int, int]:
    """(BC, num_warps): 128 channels on one warp, which was the fastest at every batch size
    (docs/performance.md)."""
    return min(128, triton.next_power_of_2(C)), 1


def conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    state_slots_out: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv for L new tokens per row over slot-indexed time-major states,
    in place (see the module docstring). -> y [B, L, C] in x's dtype."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, L, C], got {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [C, K], got {tuple(weight.shape)}")
    B, L, C = x.shape
    Cw, K = weight.shape
    if Cw != C or not 2 <= K <= 5:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x with {C} channels "
                         "(kernel width 2..5)")
    if (conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (K - 1, C)
            or not conv_states.is_contiguous()):
        raise ValueError(f"conv_states must be a contiguous [S, {K - 1}, {C}], got "
                         f"{tuple(conv_states.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    _check_slots(state_slots, state_slots_out, B, L)
    x = _last_contig(x)
    y = torch.empty(B, L, C, dtype=x.dtype, device=x.device)
    if B == 0 or L == 0:
        return y
    BC, num_warps = _conv_config(B, C)
    has_out = state_slots_out is not None
    so = state_slots_out if has_out else state_slots
    grid = (triton.cdiv(C, BC), B)
    _conv_update_kernel[grid](
        x, weight, conv_states, state_slots, so, y,
        L, C,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        so.stride(0) if has_out else 0, so.stride(1) if has_out else 0,
        y.stride(0), y.stride(1),
        K=K, BC=BC,
        HAS_OUT=has_out, SILU=activation is not None,
        num_warps=num_warps,
    )
    return y
