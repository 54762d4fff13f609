"""Small fused kernels for the decode step: one launch each instead of a chain of torch ops.

Every kernel computes in fp32 and rounds to the model dtype exactly where the plain-torch
reference (``hybridrt.kernels.norm`` / ``hybridrt.kernels.rope`` / the model's MLP) rounds, so
in bf16 the outputs match the reference bit for bit except where the reference's own fp32
intermediates cannot be reproduced exactly (see "Exactness" below).

- ``rms_norm(x, w, eps)``: zero-centred RMSNorm; with ``residual=`` it also adds the residual
  first (``h = residual + x`` rounded to x's dtype) and returns ``(rms_norm(h), h)``.
- ``gated_rms_norm(x, z, w, eps)``: the GDN output norm ``w * rmsnorm(x) * silu(z)``.
- ``silu_mul(gate_up)``: ``silu(gate) * up`` of a merged ``[N, 2I]`` gate|up projection.
- ``qk_norm_rope(q, k, qw, kw, eps, cos, sin)``: per-head q/k RMSNorm + partial rotate-half
  RoPE for q and k together, one launch.

One program per row (per (token, head) for the per-head ops; ``silu_mul`` also splits long rows
into column blocks). No host syncs and no value-dependent allocation: CUDA-graph capturable.

Rounding to bf16 is done by hand (integer round-to-nearest-even on the fp32 bits) rather than
with ``.to(tl.bfloat16)``: Triton's interpreter truncates on that conversion, the GPU rounds,
and the hand-rolled version is the same on both (the final store then converts an exactly
representable value).

Exactness. Three things in the reference are not reproducible bit for bit from Triton: (1) the
order of the fp32 sum in ``mean(x^2)`` (torch's reduction tree vs ``tl.sum``), (2) fp32 ``exp``
(Triton's GPU ``tl.exp`` is ``ex2.approx``; torch uses an accurate ``expf``), (3) on the GPU,
``rsqrt`` approximations may differ by an ulp. These change fp32 intermediates by an ulp or so,
which flips a bf16 rounding only rarely (docs/performance.md has the counts); the tests
therefore
allow a few elements off by one bf16 ulp and require everything else to be equal. Everything
else (the residual add, the rounding points, the multiply order, no FMA contraction on the
GPU) is replicated exactly; the residual output is always bit-exact. The mean uses a division
by D on CPU (torch CPU: ``sum().div_(D)``) and a multiply by fp32 ``1/D`` on CUDA (torch CUDA's
``MeanOps``); division in silu uses ``div_rn`` (correctly rounded), as torch's does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# dtype codes passed to the kernels as constexprs
_F32, _BF16, _F16 = 0, 1, 2
_CODES = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}


def _code(dtype: torch.dtype) -> int:
    try:
        return _CODES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype} (float32, bfloat16, float16 only)") from None


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def _launch_opts(t: torch.Tensor) -> dict:
    # No FMA contraction: the reference rounds every fp32 product before adding it.
    # (Ignored by the interpreter, which never fuses.)
    return {"enable_fp_fusion": False} if t.is_cuda else {}


def _rows3(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` ([..., D], last dim contiguous) as [A, B, D] with arbitrary A/B strides."""
    if t.dim() == 0:
        raise ValueError("expected at least one dimension")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-2], t.shape[-1])


# ---------------------------------------------------------------------------------------------
# shared device helpers


@triton.jit
def _round(x, DT: tl.constexpr):
    """fp32 -> fp32 holding x rounded (to nearest even) to dtype code DT."""
    if DT == 1:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        y = r.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, y)
    elif DT == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rstd(x, D, eps, inv_d, MUL_MEAN: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of a masked (zero-padded) fp32 row."""
    ss = tl.sum(x * x, axis=0)
    if MUL_MEAN:  # noqa: SIM108 (a constexpr branch in a Triton kernel)
        ms = ss * inv_d
    else:
        ms = ss / D
    return tl.math.rsqrt(ms + eps)


@triton.jit
def _silu(x):
    """x / (1 + exp(-x)) in fp32, as torch computes silu."""
    return tl.math.div_rn(x, 1.0 + tl.exp(-x))


# ---------------------------------------------------------------------------------------------
# rms_norm (+ residual add)


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr,
    B, sx0, sx1, sr0, sr1, D, eps, inv_d,
    DT: tl.constexpr, HAS_RES: tl.constexpr, MUL_MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i0 = row // B
    i1 = row % B
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + i0 * sr0 + i1 * sr1 + offs, mask=mask, other=0.0).to(tl.float32)
        x = _round(r + x, DT)
        tl.store(ro_ptr + row * D + offs, x, mask=mask)
    rstd = _rstd(x, D, eps, inv_d, MUL_MEAN)
    w = 1.0 + tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round((x * rstd) * w, DT)
    tl.store(y_ptr + row * D + offs, y, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
    residual: torch.Tensor | None = None,
):
    """Zero-centred RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim.

    x: [..., D] (last dim contiguous; leading dims may be strided), weight: [D].
    Without ``residual``: returns y (contiguous, x's shape and dtype), equal to
    ``hybridrt.kernels.norm.rms_norm(x, weight, eps)``.
    With ``residual`` (x's shape): ``h = (residual + x)`` rounded to x's dtype, returns
    ``(rms_norm(h), h)``, both contiguous.
    """
    D = x.shape[-1]
    dt = _code(x.dtype)
    x3 = _rows3(x)
    A, B = x3.shape[0], x3.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.contiguous()
    if w.numel() != D:
        raise ValueError(f"weight has {w.numel()} elements, expected {D}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        r3 = _rows3(residual)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        sr0, sr1 = r3.stride(0), r3.stride(1)
    else:
        r3, h, sr0, sr1 = x3, y, 0, 0
    n = A * B
    if n:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(n,)](
            x3, r3, w, y, h, B, x3.stride(0), x3.stride(1), sr0, sr1, D, float(eps),
            1.0 / D, DT=dt, HAS_RES=residual is not None, MUL_MEAN=x.is_cuda, BLOCK=block,
            num_warps=_warps(block), **_launch_opts(x),
        )
    return y if residual is None else (y, h)


# ---------------------------------------------------------------------------------------------
# gated_rms_norm (GDN output norm)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr,
    B, sx0, sx1, sz0, sz1, D, eps, inv_d,
    DT: tl.constexpr, ROUND_WX: tl.constexpr, MUL_MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i0 = row // B
    i1 = row % B
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = _rstd(x, D, eps, inv_d, MUL_MEAN)
    xn = _round(x * rstd, DT)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wx = w * xn
    if ROUND_WX:  # weight * x.to(dtype) stays in x's dtype (same-dtype weight)
        wx = _round(wx, DT)
    z = tl.load(z_ptr + i0 * sz0 + i1 * sz1 + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round(wx * _silu(z), DT)
    tl.store(y_ptr + row * D + offs, y, mask=mask)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """``hybridrt.kernels.norm.gated_rms_norm``: ``(w * rmsnorm(x).to(dt)) * silu(z.float())``.

    x, z: [..., HV, DV] (same shape; last dim contiguous, other dims may be strided, e.g. z a
    view into a merged projection), weight: [DV] -> contiguous [..., HV, DV] in x's dtype.
    Rounding: the normalised x is rounded to x's dtype; ``weight * that`` is rounded to
    ``promote_types(weight.dtype, x.dtype)`` (x's dtype for a same-dtype weight, no rounding
    for an fp32 weight); the product with silu(z) (fp32) is rounded to x's dtype.
    """
    if z.shape != x.shape:
        raise ValueError(f"z shape {tuple(z.shape)} != x {tuple(x.shape)}")
    D = x.shape[-1]
    dt = _code(x.dtype)
    promoted = torch.promote_types(weight.dtype, x.dtype)
    if promoted not in (x.dtype, torch.float32):
        raise TypeError(f"unsupported weight dtype {weight.dtype} for x {x.dtype}")
    x3, z3 = _rows3(x), _rows3(z)
    A, B = x3.shape[0], x3.shape[1]
    w = weight.contiguous()
    if w.numel() != D:
        raise ValueError(f"weight has {w.numel()} elements, expected {D}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = A * B
    if n:
        block = triton.next_power_of_2(D)
        _gated_rms_norm_kernel[(n,)](
            x3, z3, w, y, B, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), D,
            float(eps), 1.0 / D, DT=dt, ROUND_WX=promoted == x.dtype, MUL_MEAN=x.is_cuda,
            BLOCK=block, num_warps=_warps(block), **_launch_opts(x),
        )
    return y


# ---------------------------------------------------------------------------------------------
# silu_mul (SwiGLU of a merged gate|up projection)


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, n_inner, s0, DT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inner
    base = gu_ptr + row * s0
    g = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + n_inner + offs, mask=mask, other=0.0).to(tl.float32)
    s = _round(_silu(g), DT)  # F.silu(gate) returns the model dtype
    y = _round(s * u, DT)
    tl.store(y_ptr + row * n_inner + offs, y, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] (gate first, up second; last dim contiguous, rows may be strided)
    -> ``F.silu(gate) * up``: contiguous [..., I] in gate_up's dtype, with its roundings."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"last dim {two_i} is not even")
    n_inner = two_i // 2
    dt = _code(gate_up.dtype)
    g2 = gate_up if gate_up.dim() == 2 else gate_up.reshape(-1, two_i)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    N = g2.shape[0]
    y = torch.empty(*gate_up.shape[:-1], n_inner, dtype=gate_up.dtype, device=gate_up.device)
    if N and n_inner:
        block = min(triton.next_power_of_2(n_inner), 1024)
        _silu_mul_kernel[(N, triton.cdiv(n_inner, block))](
            g2, y, n_inner, g2.stride(0), DT=dt, BLOCK=block, num_warps=_warps(block),
            **_launch_opts(gate_up),
        )
    return y


# ---------------------------------------------------------------------------------------------
# qk_norm_rope (GatedAttention: q_norm / k_norm + partial RoPE, q and k in one launch)


@triton.jit
def _norm_rope_row(
    x_ptr, w_ptr, o_ptr, c_ptr, s_ptr, D, R, eps, inv_d,
    DT: tl.constexpr, OT: tl.constexpr, MUL_MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = _rstd(x, D, eps, inv_d, MUL_MEAN)
    w = 1.0 + tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xn = _round((x * rstd) * w, DT)  # the norm's output, in x's dtype
    # rotate_half partner of dim i < R: i + R/2 (negated) for i < R/2, i - R/2 otherwise;
    # recomputed from x (same rstd, same rounding) rather than shuffled between lanes
    half = R // 2
    rot = offs < R
    lo = offs < half
    partner = tl.where(lo, offs + half, offs - half)
    xp = tl.load(x_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    wp = 1.0 + tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    xnp = _round((xp * rstd) * wp, DT)
    rh = tl.where(lo, -xnp, xnp)
    c = tl.load(c_ptr + offs, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offs, mask=rot, other=0.0).to(tl.float32)
    # x_rot * cos + rotate_half(x_rot) * sin in the (promoted) RoPE dtype
    xr = _round(_round(xn * c, OT) + _round(rh * s, OT), OT)
    out = tl.where(rot, xr, xn)
    tl.store(o_ptr + offs, out, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, c_ptr, s_ptr,
    H, HKV, sq0, sq1, sk0, sk1, sc0, ss0, D, R, eps, inv_d,
    DT: tl.constexpr, OT: tl.constexpr, MUL_MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nh = H + HKV
    t = pid // nh
    h = pid % nh
    c_row = c_ptr + t * sc0
    s_row = s_ptr + t * ss0
    if h < H:
        _norm_rope_row(q_ptr + t * sq0 + h * sq1, qw_ptr, qo_ptr + (t * H + h) * D, c_row, s_row,
                       D, R, eps, inv_d, DT, OT, MUL_MEAN, BLOCK)
    else:
        hk = h - H
        _norm_rope_row(k_ptr + t * sk0 + hk * sk1, kw_ptr, ko_ptr + (t * HKV + hk) * D, c_row,
                       s_row, D, R, eps, inv_d, DT, OT, MUL_MEAN, BLOCK)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_partial_rope(rms_norm(q, q_weight, eps), cos, sin)`` and the same for k.

    q: [T, H, D], k: [T, HKV, D] (views with a contiguous last dim, e.g. q sliced out of a
    [T, H, 2D] query+gate projection), q_weight/k_weight: [D] (zero-centred), cos/sin: [T, R]
    (R even, <= D). Returns contiguous (q_out [T, H, D], k_out [T, HKV, D]) in the dtype the
    reference returns (``promote_types(q.dtype, cos.dtype)``; the model dtype in the model).
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError("q and k must be [T, heads, D]")
    T, H, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"q dtype {q.dtype} != k dtype {k.dtype}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError("cos and sin must have the same shape and dtype")
    R = cos.shape[-1]
    if R > D or R % 2:
        raise ValueError(f"rotary dim {R} must be even and <= head dim {D}")
    if cos.dim() != 2 or cos.shape[0] != T:
        raise ValueError(f"cos/sin must be [T={T}, R], got {tuple(cos.shape)}")
    HKV = k.shape[1]
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    dt, ot = _code(q.dtype), _code(out_dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    qw, kw = q_weight.contiguous(), k_weight.contiguous()
    if qw.numel() != D or kw.numel() != D:
        raise ValueError(f"q/k norm weights must have {D} elements")
    q_out = torch.empty(T, H, D, dtype=out_dtype, device=q.device)
    k_out = torch.empty(T, HKV, D, dtype=out_dtype, device=q.device)
    n = T * (H + HKV)
    if n:
        block = triton.next_power_of_2(D)
        _qk_norm_rope_kernel[(n,)](
            q, k, qw, kw, q_out, k_out, cos, sin, H, HKV, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), D, R, float(eps), 1.0 / D,
            DT=dt, OT=ot, MUL_MEAN=q.is_cuda, BLOCK=block, num_warps=_warps(block),
            **_launch_opts(q),
        )
    return q_out, k_out
