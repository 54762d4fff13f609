"""kernels/conv.py: the causal depthwise conv1d, packed prompts and token steps, against a
plain reference, continuing from and writing state slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel_close
from kernel_helpers import TOL, generator

from hybridrt.kernels import causal_conv1d_update, causal_conv1d_varlen

C = 37  # odd channel count


def conv_ref(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None,
             activation: str | None = "silu"):
    """Plain F.conv1d: one sequence x [n, C] continuing from prev [K-1, C] (None: zeros)
    -> (y [n, C], state [K-1, C] = last K-1 inputs incl. older state)."""
    Cc, K = weight.shape
    if prev is not None:
        prev = prev.t()
    if prev is None:  # zero history == left zero padding (transformers' causal_conv1d_fn)
        y = F.conv1d(x.t()[None], weight[:, None, :], padding=K - 1, groups=Cc)[0, :, :x.shape[0]]
        prev = torch.zeros(Cc, K - 1)
    else:
        y = F.conv1d(torch.cat([prev, x.t()], 1)[None], weight[:, None, :], groups=Cc)[0]
    state = torch.cat([prev, x.t()], 1)[:, -(K - 1):]
    if activation == "silu":
        y = F.silu(y)
    return y.t(), state.t()


@pytest.mark.parametrize("K", [2, 4], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("activation", ["silu", None], ids=lambda a: f"act-{a}")
def test_conv_varlen_matches_reference_and_token_steps(K, activation):
    gen = generator(10)
    lens = [1, 2, 3, 7, 20, 1]
    init = torch.tensor([True, True, False, True, False, False])
    slots = torch.tensor([4, 0, 6, 2, 7, 1])
    x = torch.randn(sum(lens), C, generator=gen)
    w = torch.randn(C, K, generator=gen) / K**0.5
    pool = torch.randn(9, K - 1, C, generator=gen)
    got = pool.clone()
    got[slots[~init]] = float("nan")
    cu = torch.tensor([0, *lens]).cumsum(0)
    y = causal_conv1d_varlen(x, w, cu, got, slots, init, activation=activation)

    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        prev = pool[slots[b]] if init[b] else None
        y_ref, st_ref = conv_ref(x[s:e], w, prev, activation)
        assert_rel_close(y[s:e], y_ref, TOL, f"seq {b} output")
        assert_rel_close(got[slots[b]], st_ref, TOL, f"seq {b} state")
        # token by token through the decode kernel
        steps = pool.clone()
        if not init[b]:
            steps[slots[b]] = 0.0
        for t in range(s, e):
            y_t = causal_conv1d_update(x[t].view(1, 1, C), w, steps, slots[b:b + 1],
                                       activation=activation)
            assert_rel_close(y_t[0, 0], y[t], TOL, f"seq {b} token {t - s} (update)")
        assert_rel_close(steps[slots[b]], got[slots[b]], TOL, f"seq {b} state (update)")
    untouched = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(got[untouched], pool[untouched])


def test_conv_short_pieces_continue_from_state():
    """A sequence fed in pieces shorter than K-1 (chunked prefill, then decode) equals one pass."""
    K = 4
    gen = generator(11)
    pieces = [2, 1, 1, 5, 2, 1]
    x = torch.randn(sum(pieces), C, generator=gen)
    w = torch.randn(C, K, generator=gen) / 2
    pool = torch.full((3, K - 1, C), float("nan"))
    slot = torch.tensor([1])
    outs, start = [], 0
    for i, n in enumerate(pieces):
        outs.append(causal_conv1d_varlen(x[start:start + n], w, torch.tensor([0, n]), pool, slot,
                                         torch.tensor([i > 0])))
        start += n
    y_ref, st_ref = conv_ref(x, w, None)
    assert_rel_close(torch.cat(outs), y_ref, TOL, "pieces vs one pass")
    assert_rel_close(pool[1], st_ref, TOL, "final state")
    assert torch.isnan(pool[[0, 2]]).all()


def test_conv_update_state_slots_out_matches_stepping():
    B, L, K = 3, 3, 4
    gen = generator(12)
    x = torch.randn(B, L, C, generator=gen)
    w = torch.randn(C, K, generator=gen) / 2
    pool = torch.randn(13, K - 1, C, generator=gen)
    slots = torch.tensor([0, 5, 9])
    out_slots = torch.tensor([[1, 2, 0], [6, 7, 8], [10, 11, 12]])
    got = pool.clone()
    y = causal_conv1d_update(x, w, got, slots, state_slots_out=out_slots)
    steps = pool.clone()
    for t in range(L):
        y_t = causal_conv1d_update(x[:, t:t + 1], w, steps, slots)
        assert_rel_close(y[:, t], y_t[:, 0], TOL, f"token {t}")
        for b in range(B):
            assert_rel_close(got[out_slots[b, t]], steps[slots[b]], TOL, f"state t={t} b={b}")
    named = set(out_slots.flatten().tolist())
    untouched = [i for i in range(13) if i not in named]
    assert 5 in untouched and 9 in untouched
    assert torch.equal(got[untouched], pool[untouched])


def test_conv_rejects_bad_shapes():
    w = torch.randn(C, 4)
    with pytest.raises(ValueError, match="conv_states"):
        causal_conv1d_update(torch.randn(1, 1, C), w, torch.zeros(2, C, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="channels"):
        causal_conv1d_update(torch.randn(1, 1, C + 1), w, torch.zeros(2, 3, C), torch.tensor([0]))
