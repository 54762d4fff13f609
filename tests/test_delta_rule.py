"""kernels/delta_rule.py: the gated delta rule's naive, chunked and recurrent forms against
each other and the documented recurrence, packed (varlen) against per-sequence calls, in place
over state slots, with the compiled decode step and with the torch ops it replaces.

fla-style: fp32, deliberately odd sizes, readable ids (``B2-T63-HK2-HV4``), relative-error
checks (max-abs error <= tol * max |ref|). State pools are filled with NaN wherever a kernel
must not read, and slots no call names are checked bitwise afterwards.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from kernel_helpers import TOL, gdn_inputs, require_native, state_pool

from hybridrt.kernels import (
    chunk_gated_delta_rule,
    naive_gated_delta_rule,
    native,
    recurrent_gated_delta_rule,
)
from hybridrt.kernels.delta_rule import slot_runs

GDN_CASES = [
    pytest.param(B, T, HK, HV, init, id=f"B{B}-T{T}-HK{HK}-HV{HV}-{'init' if init else 'zero'}")
    for T in (1, 63, 64, 65, 130)
    for HK, HV in ((2, 4), (3, 3))
    for init in (False, True)
    for B in (2,)
]


DK, DV = 15, 9  # odd head sizes


@pytest.mark.parametrize("B,T,HK,HV,init", GDN_CASES)
def test_chunk_and_recurrent_match_naive(B, T, HK, HV, init):
    q, k, v, g, beta = gdn_inputs(B * T, HK, HV, DK, DV)
    pool = state_pool(5, HV, DK, DV)
    slots = torch.tensor([3, 1])[:B]
    chunk_pool = pool.clone()
    if not init:
        chunk_pool[slots] = float("nan")  # a fresh sequence must not read its slot
    cu = torch.arange(B + 1) * T
    o_chunk = chunk_gated_delta_rule(q, k, v, g, beta, cu, chunk_pool, slots,
                                     torch.full((B,), init))
    rec_pool = pool.clone()
    if not init:
        rec_pool[slots] = 0.0  # the recurrent kernel always reads: new sequences get zeros
    o_rec = recurrent_gated_delta_rule(
        q.view(B, T, HK, DK), k.view(B, T, HK, DK), v.view(B, T, HV, DV), g.view(B, T, HV),
        beta.view(B, T, HV), rec_pool, slots,
    ).reshape(B * T, HV, DV)

    for b in range(B):
        sl = slice(b * T, (b + 1) * T)
        s0 = pool[slots[b]] if init else None
        o_ref, s_ref = naive_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s0)
        assert_rel_close(o_chunk[sl], o_ref, TOL, f"chunk output seq {b}")
        assert_rel_close(o_rec[sl], o_ref, TOL, f"recurrent output seq {b}")
        assert_rel_close(chunk_pool[slots[b]], s_ref, TOL, f"chunk final state seq {b}")
        assert_rel_close(rec_pool[slots[b]], s_ref, TOL, f"recurrent final state seq {b}")
    untouched = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert torch.equal(chunk_pool[untouched], pool[untouched])
    assert torch.equal(rec_pool[untouched], pool[untouched])


def test_naive_delta_rule_is_the_documented_recurrence():
    """Guard the oracle itself: one token with zero state gives S = beta * k v^T (k l2-normed),
    o = S^T q * DK^-0.5 (q l2-normed); a second token decays S by exp(g) first."""
    q, k, v, g, beta = gdn_inputs(2, 1, 1, 4, 3, seed=5)
    o, S = naive_gated_delta_rule(q, k, v, g, beta)
    kn, qn = k / k.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True) * 4**-0.5
    S1 = beta[0, 0] * torch.outer(kn[0, 0], v[0, 0])
    torch.testing.assert_close(o[0, 0], S1.t() @ qn[0, 0], rtol=1e-5, atol=1e-6)
    S2 = g[1, 0].exp() * S1
    S2 = S2 + torch.outer(kn[1, 0], beta[1, 0] * (v[1, 0] - S2.t() @ kn[1, 0]))
    torch.testing.assert_close(S[0], S2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o[1, 0], S2.t() @ qn[1, 0], rtol=1e-5, atol=1e-6)


def test_grouped_value_heads_share_consecutive_key_heads():
    """HV = r*HK: key head h serves value heads h*r .. h*r+r-1 (repeat_interleave), i.e. the
    same as an HK == HV call with q and k repeated that way."""
    T, HK, r = 65, 2, 3
    q, k, v, g, beta = gdn_inputs(T, HK, HK * r, DK, DV, seed=21)
    q_rep, k_rep = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    o_naive, s_naive = naive_gated_delta_rule(q, k, v, g, beta)
    o_flat, s_flat = naive_gated_delta_rule(q_rep, k_rep, v, g, beta)
    assert_rel_close(o_naive, o_flat, TOL, "naive grouped vs repeated")
    assert_rel_close(s_naive, s_flat, TOL, "naive grouped state")
    pool = torch.zeros(1, HK * r, DK, DV)
    o_chunk = chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, T]), pool,
                                     torch.tensor([0]), torch.tensor([False]))
    assert_rel_close(o_chunk, o_flat, TOL, "chunk grouped vs repeated")
    o_rec = recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                       torch.zeros(1, HK * r, DK, DV), torch.tensor([0]))
    assert_rel_close(o_rec[0], o_flat, TOL, "recurrent grouped vs repeated")


@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"C{c}")
def test_chunk_varlen_packed_equals_per_sequence(chunk_size):
    HK, HV = 2, 4
    lens = [1, 63, 64, 65, 130, 2]
    slots = torch.tensor([5, 0, 7, 2, 3, 9])
    init = torch.tensor([True, False, True, True, False, True])
    T = sum(lens)
    q, k, v, g, beta = gdn_inputs(T, HK, HV, DK, DV, seed=3)
    pool = state_pool(11, HV, DK, DV, seed=4)
    packed = pool.clone()
    packed[slots[~init]] = float("nan")
    cu = torch.tensor([0, *lens]).cumsum(0)
    o = chunk_gated_delta_rule(q, k, v, g, beta, cu, packed, slots, init, chunk_size=chunk_size)

    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = pool.clone()
        o_one = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                       torch.tensor([0, e - s]), one, slots[b:b + 1],
                                       init[b:b + 1], chunk_size=chunk_size)
        assert_rel_close(o[s:e], o_one, TOL, f"seq {b} packed vs alone")
        assert_rel_close(packed[slots[b]], one[slots[b]], TOL, f"seq {b} final state")
        o_ref, s_ref = naive_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                              pool[slots[b]] if init[b] else None)
        assert_rel_close(o[s:e], o_ref, TOL, f"seq {b} vs naive")
        assert_rel_close(packed[slots[b]], s_ref, TOL, f"seq {b} state vs naive")
    untouched = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.equal(packed[untouched], pool[untouched])


def test_recurrent_packed_equals_per_sequence():
    B, L, HK, HV = 3, 5, 1, 3
    q, k, v, g, beta = gdn_inputs(B * L, HK, HV, DK, DV, seed=6)
    q, k, v = q.view(B, L, HK, DK), k.view(B, L, HK, DK), v.view(B, L, HV, DV)
    g, beta = g.view(B, L, HV), beta.view(B, L, HV)
    pool = state_pool(8, HV, DK, DV, seed=7)
    slots = torch.tensor([6, 2, 4])
    packed = pool.clone()
    o = recurrent_gated_delta_rule(q, k, v, g, beta, packed, slots)
    for b in range(B):
        one = pool.clone()
        o_one = recurrent_gated_delta_rule(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1],
                                           beta[b:b + 1], one, slots[b:b + 1])
        assert_rel_close(o[b], o_one[0], TOL, f"seq {b}")
        assert_rel_close(packed[slots[b]], one[slots[b]], TOL, f"seq {b} state")
    untouched = [i for i in range(8) if i not in slots.tolist()]
    assert torch.equal(packed[untouched], pool[untouched])


def test_slot_runs():
    assert slot_runs([5, 6, 7, 2, 3, 9]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]
    assert slot_runs([4, 3]) == [(0, 4, 1), (1, 3, 1)]
    assert slot_runs([]) == []


@pytest.fixture(params=["native", "torch"])
def decode_impl(request, monkeypatch):
    """Run a test with the compiled decode kernel and with the torch ops it replaces."""
    if request.param == "native":
        require_native()
        return native.gdn_decode_step
    return None


@pytest.mark.parametrize("slots", [[5, 6, 7, 2, 3, 9], [1, 2, 3, 4, 5, 6], [9, 7, 5, 3, 1, 8]],
                         ids=["three-runs", "one-run", "no-run"])
def test_recurrent_decode_in_place_over_slot_runs(slots, decode_impl):
    """Decode (L=1) updates the pool in place, one slice per run of consecutive slots: every
    sequence matches the naive loop from its own state, other slots stay bit-identical."""
    B, HK, HV = len(slots), 2, 4
    q, k, v, g, beta = gdn_inputs(B, HK, HV, DK, DV, seed=16)
    pool = state_pool(11, HV, DK, DV, seed=17)
    got = pool.clone()
    o = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                   beta[:, None], got, torch.tensor(slots), step=decode_impl)
    given = pool.clone()
    o_given = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                         beta[:, None], given, torch.tensor(slots),
                                         runs=slot_runs(slots), step=decode_impl)
    assert torch.equal(o, o_given) and torch.equal(got, given)
    for b, slot in enumerate(slots):
        o_ref, s_ref = naive_gated_delta_rule(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1],
                                              beta[b:b + 1], pool[slot])
        assert_rel_close(o[b, 0], o_ref[0], TOL, f"seq {b} output")
        assert_rel_close(got[slot], s_ref, TOL, f"seq {b} state")
    untouched = [i for i in range(11) if i not in slots]
    assert torch.equal(got[untouched], pool[untouched])


def test_recurrent_state_slots_out_matches_stepping(decode_impl):
    """Verify mode: the state after token t goes to state_slots_out[b, t]; the input slots are
    only read (unless also named as an output), everything else is untouched."""
    B, L, HK, HV = 2, 4, 2, 4
    q, k, v, g, beta = gdn_inputs(B * L, HK, HV, DK, DV, seed=8)
    q, k, v = q.view(B, L, HK, DK), k.view(B, L, HK, DK), v.view(B, L, HV, DV)
    g, beta = g.view(B, L, HV), beta.view(B, L, HV)
    pool = state_pool(14, HV, DK, DV, seed=9)
    slots = torch.tensor([1, 2])
    # sequence 0 writes its last state back into its own input slot
    out_slots = torch.tensor([[3, 4, 5, 1], [6, 7, 8, 9]])
    got = pool.clone()
    o = recurrent_gated_delta_rule(q, k, v, g, beta, got, slots, state_slots_out=out_slots,
                                   step=decode_impl)

    step_pool = pool.clone()
    for t in range(L):
        o_t = recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                         g[:, t:t + 1], beta[:, t:t + 1], step_pool, slots)
        assert_rel_close(o[:, t], o_t[:, 0], TOL, f"output token {t}")
        for b in range(B):
            assert_rel_close(got[out_slots[b, t]], step_pool[slots[b]], TOL,
                             f"state after token {t} of seq {b}")
    named = set(out_slots.flatten().tolist())
    untouched = [i for i in range(14) if i not in named]
    assert 2 in untouched  # seq 1's input slot: read only
    assert torch.equal(got[untouched], pool[untouched])


def test_delta_rule_rejects_bad_shapes():
    q, k, v, g, beta = gdn_inputs(4, 2, 3, DK, DV)  # 3 value heads over 2 key heads
    pool = state_pool(2, 3, DK, DV)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 4]), pool,
                               torch.tensor([0]), torch.tensor([False]))
    q, k, v, g, beta = gdn_inputs(4, 2, 4, DK, DV)
    with pytest.raises(ValueError, match="float32"):
        chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 4]),
                               state_pool(2, 4, DK, DV).bfloat16(), torch.tensor([0]),
                               torch.tensor([False]))
