"""GDN prefill (chunked gated delta rule + causal conv) over the state-slot pools, through fla.

``chunk_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_states, state_slots,
has_initial_state, cu_seqlens_cpu=None)``
    Packed varlen batch: q, k [T, HK, DK]; v [T, HV, DV]; a, b [T, HV] raw projections;
    A_log, dt_bias [HV]; cu_seqlens [B+1]; ssm_states [S, HV, DK, DV] fp32 ("K-first");
    state_slots [B]; has_initial_state [B] bool. Same result as
    ``hybridrt.kernels.delta_rule.chunk_gated_delta_rule`` with
    ``g = -exp(A_log) * softplus(a.float() + dt_bias)`` and ``beta = sigmoid(b)`` (both in fp32,
    computed inside fla's kernels). Returns o [T, HV, DV] in v's dtype.
``conv_prefill(x, weight, cu_seqlens, conv_states, state_slots, has_initial_state,
activation="silu", cu_seqlens_cpu=None)``
    x [T, C]; weight [C, K]; conv_states [S, K-1, C] time-major, oldest first. Same result as
    ``hybridrt.kernels.conv.causal_conv1d_varlen``. Returns y [T, C] in x's dtype.

Both: each sequence starts from its slot when ``has_initial_state[b]`` else from zeros (NaN in
an unused slot never leaks in), its final state is written back to its slot, other slots are
untouched. The rows of the pool are gathered into fla's per-sequence ``initial_state``, fla
returns the final states, and those are scattered back (``index_copy_``). Distinct sequences
must have distinct slots; every sequence must have at least one token (a zero-length sequence
gets its initial state, i.e. zeros without ``has_initial_state``, written back to its slot,
where the reference leaves the slot alone).

fla facts this relies on (fla-core 0.6.0):
- ``chunk_gated_delta_rule`` takes ``[1, T, H, K]`` with ``cu_seqlens``, states ``[N, HV, K, V]``
  with ``state_v_first=False`` (our layout), grouped value heads natively (value head i uses
  key head ``i // (HV // HK)``, as ``repeat_interleave``), l2norm eps 1e-6 in kernel, and the
  GDN gate (``use_gate_in_kernel``, fused with the chunk cumsum) and beta sigmoid
  (``use_beta_sigmoid_in_kernel``) in kernel. Everything is passed by keyword.
- ``causal_conv1d`` keeps a ``[N, C, W]`` state (W = K, channel-major, oldest first); its
  forward reads only columns 1..W-1, so ours goes in as ``[0 | state^T]`` and comes back as
  ``final[..., 1:]^T``; for sequences shorter than K-1 its final state keeps the older inputs
  from the initial state, as ours does.
- Without ``cu_seqlens_cpu`` fla builds its chunk index from ``cu_seqlens`` on the device, a
  device->host sync: pass the host copy when there is one. fla caches the chunk index and
  offsets by the *identity* of ``cu_seqlens`` (and ``cu_seqlens_cpu``): never refill a
  ``cu_seqlens`` tensor in place between calls; pass a new tensor. Passing the same tensors to
  ``conv_prefill`` and ``chunk_prefill`` of a layer (both use 64-token chunks) reuses the index.

- fla's chunked kernels call ``tl.dot`` at Triton's default input precision, which for fp32
  operands on a GPU is tf32 (10 mantissa bits): an fp32 model would prefill with ~1e-3
  relative products. For fp32 inputs ``chunk_prefill`` sets ``TRITON_F32_DEFAULT=ieee`` for
  the call only (``precision.fp32_products``: the environment is left as it was), so fp32
  means fp32 products; bf16 is untouched. ``FP32_EXACT`` says whether this Triton has the setting.

Prefill runs eagerly (its launch grid depends on the sequence lengths), not in a CUDA graph.
"""

from __future__ import annotations

import torch
from fla.modules.causal_conv1d import causal_conv1d
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from ..conv import _check_conv
from .precision import fp32_products


def _has_fp32_default() -> bool:
    try:
        from triton import knobs
    except ImportError:  # older Triton: no such setting
        return False
    return hasattr(knobs, "language") and hasattr(knobs.language, "fp32_default")


FP32_EXACT = _has_fp32_default()


def _long(t: torch.Tensor | None) -> torch.Tensor | None:
    # fla wants int64 offsets; keep the caller's tensor (fla caches by identity) when it is one
    return t if t is None or t.dtype == torch.long else t.long()


def chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over a packed batch, states in the slot pool (see module doc).
    -> o [T, HV, DV] in v's dtype."""
    T, HK, DK = q.shape
    HV, DV = v.shape[1:]
    N = state_slots.shape[0]
    if k.shape != q.shape or v.shape[0] != T or a.shape != (T, HV) or b.shape != (T, HV):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if ssm_states.dim() != 4 or tuple(ssm_states.shape[1:]) != (HV, DK, DV):
        raise ValueError(f"ssm_states must be [S, {HV}, {DK}, {DV}], got {tuple(ssm_states.shape)}")
    if ssm_states.dtype != torch.float32:
        raise ValueError(f"recurrent states must be float32, got {ssm_states.dtype}")
    if cu_seqlens.shape != (N + 1,) or has_initial_state.shape != (N,):
        raise ValueError(
            f"cu_seqlens {tuple(cu_seqlens.shape)} / has_initial_state "
            f"{tuple(has_initial_state.shape)} do not match {N} state slots"
        )

    h0 = ssm_states.index_select(0, state_slots)  # [N, HV, DK, DV], a fresh copy
    h0.masked_fill_(~has_initial_state.view(N, 1, 1, 1), 0.0)  # NaN-safe zeros
    with fp32_products(q.dtype):
        o, ht = chunk_gated_delta_rule(
            q=q.unsqueeze(0),
            k=k.unsqueeze(0),
            v=v.unsqueeze(0),
            g=a.unsqueeze(0),
            beta=b.unsqueeze(0),
            scale=DK**-0.5,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True,
            state_v_first=False,
            cu_seqlens=_long(cu_seqlens),
            cu_seqlens_cpu=_long(cu_seqlens_cpu),
        )
    ssm_states.index_copy_(0, state_slots, ht)
    return o[0].to(v.dtype)


def conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over a packed batch, states in the slot pool (see module doc).
    -> y [T, C] in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got {tuple(x.shape)}")
    _check_conv(x, weight, conv_states)
    C, K = weight.shape
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    N = state_slots.shape[0]
    if cu_seqlens.shape != (N + 1,) or has_initial_state.shape != (N,):
        raise ValueError(
            f"cu_seqlens {tuple(cu_seqlens.shape)} / has_initial_state "
            f"{tuple(has_initial_state.shape)} do not match {N} state slots"
        )

    prev = conv_states.index_select(0, state_slots)  # [N, K-1, C]
    h0 = x.new_zeros(N, C, K)  # fla's [N, C, W]; column 0 (input -K) is never read
    h0[:, :, 1:] = prev.transpose(1, 2)
    h0.masked_fill_(~has_initial_state.view(N, 1, 1), 0.0)  # NaN-safe zeros
    y, ht = causal_conv1d(
        x=x.unsqueeze(0),
        weight=weight,
        bias=None,
        initial_state=h0,
        output_final_state=True,
        activation=activation,
        backend="triton",
        cu_seqlens=_long(cu_seqlens),
        cu_seqlens_cpu=_long(cu_seqlens_cpu),
    )
    conv_states.index_copy_(0, state_slots, ht[:, :, 1:].transpose(1, 2).to(conv_states.dtype))
    return y[0]
