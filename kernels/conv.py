"""Causal depthwise conv1d over time with per-sequence state held in state slots.

State layout: ``conv_states[slot]`` is ``[K-1, C]``, the last K-1 inputs, oldest first. Time
runs along the outer axis so that a decode step shifts whole rows of C channels; with the
channel-major ``[C, K-1]`` layout every update is a strided copy of (K-1)-element rows, many
times slower (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .meta import as_arrays


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    seq_lens: list[int] | None = None,
    plan: ConvPlan | None = None,
) -> torch.Tensor:
    """Causal conv over a packed batch of sequences (prefill / chunked prefill).

    x: [T, C] packed inputs; weight: [C, K]; cu_seqlens: [B+1]; conv_states: [S, K-1, C];
    state_slots: [B] rows of ``conv_states`` owned by each sequence; has_initial_state: [B]
    bool (False: start from zeros). Returns [T, C]. The last K-1 inputs of each sequence
    (including older state when the sequence is shorter than K-1) are written back to its slot;
    slots not named are untouched. ``plan``: ``conv_plan(lens, K, arrays)`` when the caller has
    it (one per step, shared by every layer).
    """
    _check_conv(x, weight, conv_states)
    C, K = weight.shape
    if plan is None:
        lens = seq_lens if seq_lens is not None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        plan = conv_plan(lens, K, x.device)
    lens = plan.lens
    B = len(lens)
    prev = conv_states.index_select(0, state_slots).to(x.dtype)  # [B, K-1, C]
    prev = torch.where(has_initial_state.view(B, 1, 1), prev, 0.0)  # NaN-safe zeros
    # every sequence's window (K-1 history rows, then its tokens) back to back: one pass of K
    # multiply-adds over all windows computes every output row (and some unused ones between)
    pieces, start = [], 0
    for b, n in enumerate(lens):
        pieces += [prev[b], x[start:start + n]]
        start += n
    windows = torch.cat(pieces).float()  # [T + B(K-1), C]
    taps = weight.float().t().contiguous()  # [K, C]
    M = windows.shape[0] - (K - 1)
    y = windows[0:M] * taps[0]
    for j in range(1, K):
        y.addcmul_(windows[j:j + M], taps[j])
    out = y[plan.out_rows]
    new_state = windows[plan.state_rows]
    conv_states.index_copy_(0, state_slots, new_state.to(conv_states.dtype))
    return _act(out, activation).to(x.dtype)


@dataclass(slots=True)
class ConvPlan:
    """Row indices for ``causal_conv1d_varlen`` over one batch's sequence lengths."""

    lens: list[int]
    out_rows: torch.Tensor  # [T] window row of each packed token's output
    state_rows: torch.Tensor  # [B, K-1] window rows that become each sequence's new state


def conv_plan(lens: list[int], K: int, arrays) -> ConvPlan:
    """``arrays``: the step's arrays (kernels/meta.py), or a device (new arrays there)."""
    # every sequence's window is its K-1 history rows, then its tokens, back to back: output
    # row r of the K passes belongs to the token at window row r + K-1, so packed token i of
    # sequence b is row i + b (K-1); a window's last K-1 rows are the new state
    out_rows, state_rows, end = [], [], 0
    for n in lens:
        out_rows.extend(range(end, end + n))
        end += n + K - 1
        state_rows.append(list(range(end - (K - 1), end)))
    arr = as_arrays(arrays)
    rows = arr.tensor(arr.put(state_rows)).view(len(lens), K - 1)
    return ConvPlan(lens, arr.tensor(arr.put(out_rows)), rows)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
    state_slots_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Conv for L new tokens per sequence (decode L=1, or L=k+1 draft verification).

    x: [B, L, C]; weight: [C, K]; conv_states: [S, K-1, C]; state_slots: [B] initial states.
    Without ``state_slots_out`` the state after the last token is written to ``state_slots``.
    With ``state_slots_out`` [B, L], the state after token t is written to slot
    ``state_slots_out[b, t]`` (used to roll back to any accepted draft position).
    Returns [B, L, C].
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, L, C], got {tuple(x.shape)}")
    _check_conv(x, weight, conv_states)
    B, L, C = x.shape
    K = weight.shape[1]
    prev = conv_states.index_select(0, state_slots).to(x.dtype)  # [B, K-1, C]
    window = torch.cat([prev, x], dim=1)  # [B, K-1+L, C]
    taps = weight.float().t().contiguous()  # [K, C], fp32 math
    y = window[:, 0:L].float() * taps[0]
    for j in range(1, K):  # K multiply-adds over [B, L, C] rows
        y.addcmul_(window[:, j:j + L], taps[j])
    if state_slots_out is None:
        conv_states.index_copy_(0, state_slots, window[:, L:].to(conv_states.dtype))
    else:
        if tuple(state_slots_out.shape) != (B, L):
            raise ValueError(
                f"state_slots_out must be [{B}, {L}], got {tuple(state_slots_out.shape)}"
            )
        after = torch.stack([window[:, t + 1:t + K] for t in range(L)], dim=1)  # [B, L, K-1, C]
        conv_states.index_copy_(0, state_slots_out.reshape(-1),
                                after.reshape(B * L, K - 1, C).to(conv_states.dtype))
    return _act(y, activation).to(x.dtype)


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}")


def _check_conv(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [C, K], got {tuple(weight.shape)}")
    C, K = weight.shape
    if x.shape[-1] != C:
        raise ValueError(f"x has {x.shape[-1]} channels, weight has {C}")
    if conv_states.dim() != 3 or conv_states.shape[1:] != (K - 1, C):
        raise ValueError(f"conv_states must be [S, {K - 1}, {C}], got {tuple(conv_states.shape)}")
