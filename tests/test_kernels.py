"""Reference kernels (hybridrt.kernels) against plain loops, each other and transformers.

fla-style: fp32, deliberately odd sizes, readable ids (``B2-T63-HK2-HV4``), relative-error
checks (max-abs error <= tol * max |ref|), and varlen calls compared with per-sequence calls.
State pools are filled with NaN wherever a kernel must not read, and slots no call names are
checked bitwise afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel_close

from hybridrt.kernels import (
    apply_partial_rope,
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    gated_rms_norm,
    l2_norm,
    naive_gated_delta_rule,
    native,
    paged_attention,
    recurrent_gated_delta_rule,
    rms_norm,
    rope_cos_sin,
    varlen_causal_attention,
    write_kv,
)
from hybridrt.kernels.delta_rule import _step_in_place, slot_runs
from hybridrt.kernels.linear import (
    CPU_HALF_GEMM_MIN_ROWS,
    linear,
    linear_fp32,
    pack_weight,
    use_fp32_gemm,
    use_half_gemv,
)

TOL = 1e-5  # fp32, relative to max |ref|


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------
# Gated delta rule
# ------------------------------------------------------------------------------------------


def gdn_inputs(T: int, HK: int, HV: int, DK: int, DV: int, seed: int = 0):
    """Packed [T, ...] inputs with a wide range of decays (g from ~-10 to ~0)."""
    gen = _gen(seed)
    q = torch.randn(T, HK, DK, generator=gen)
    k = torch.randn(T, HK, DK, generator=gen)
    v = torch.randn(T, HV, DV, generator=gen)
    g = F.logsigmoid(2.0 * torch.randn(T, HV, generator=gen) + 1.0)
    beta = torch.rand(T, HV, generator=gen)
    return q, k, v, g, beta


def state_pool(num_slots: int, HV: int, DK: int, DV: int, seed: int = 1) -> torch.Tensor:
    return 0.5 * torch.randn(num_slots, HV, DK, DV, generator=_gen(seed))


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


def _require_native() -> None:
    """Skip where the compiled kernels cannot load (no C compiler, Windows); fail where they
    should have built and did not."""
    if native.load() is not None:
        return
    can_build = native._compiler() is not None and sys.platform != "win32"
    assert not can_build, "a C compiler is here but the native kernels failed to build"
    pytest.skip("native kernels unavailable here (no C compiler)")


@pytest.fixture(params=["native", "torch"])
def decode_impl(request, monkeypatch):
    """Run a test with the compiled decode kernel and with the torch ops it replaces."""
    if request.param == "native":
        _require_native()
        return native.gdn_decode_step
    return None


def test_native_decode_step_equals_torch_ops():
    _require_native()
    B, H = 5, 3
    q, k, v, g, beta = gdn_inputs(B, H, H, DK, DV, seed=18)
    q, k = l2_norm(q) * DK**-0.5, l2_norm(k)
    pool = state_pool(9, H, DK, DV, seed=19)
    slots = [7, 1, 2, 5, 8]
    a, b = pool.clone(), pool.clone()
    o_native = native.gdn_decode_step(a, torch.tensor(slots), q, k, v, g.exp(), beta)
    views = [(slice(i * H, (i + 1) * H), b[s:s + 1].view(H, DK, DV)) for i, s in enumerate(slots)]
    o_torch = _step_in_place(q, k, v, g, beta, views)
    assert_rel_close(o_native, o_torch, 1e-6, "output")
    assert_rel_close(a, b, 1e-6, "states")
    assert torch.equal(a[[0, 3, 4, 6]], pool[[0, 3, 4, 6]])
    with pytest.raises(IndexError, match="out of range"):
        native.gdn_decode_step(a, torch.tensor([9, 1, 2, 5, 8]), q, k, v, g.exp(), beta)


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


# ------------------------------------------------------------------------------------------
# Causal conv1d
# ------------------------------------------------------------------------------------------

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
    gen = _gen(10)
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
    gen = _gen(11)
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
    gen = _gen(12)
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


# ------------------------------------------------------------------------------------------
# Linear
# ------------------------------------------------------------------------------------------


@pytest.fixture(params=["native", "onednn"])
def half_gemm_impl(request):
    """Run a test with the compiled half-weight GEMM and with the fp32 copy it replaces (the
    ``simd`` flag the CPU backend passes: False as with ``HYBRIDRT_NATIVE=0``)."""
    if request.param == "native":
        _require_half_kernels()
    return request.param


def _require_half_kernels() -> None:
    """``_require_native``, then skip on a CPU without AVX2 + FMA + F16C (the half GEMM/GEMV
    build as stubs there); fail where it has them and the kernels say otherwise."""
    _require_native()
    if native.half_gemm_available():
        return
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    assert not all(f in flags for f in ("avx2", "fma", "f16c")), "half GEMM built without SIMD"
    pytest.skip("native half GEMM/GEMV unavailable here (no AVX2/FMA/F16C)")


def _half_operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int):
    """w [N, K] in ``dtype``, x [M, K] fp32, and their fp64 product x w^T."""
    gen = _gen(seed)
    w = torch.randn(N, K, generator=gen).to(dtype)
    x = torch.randn(M, K, generator=gen)
    return w, x, x.double() @ w.double().t()


@pytest.mark.parametrize("rows", [1, CPU_HALF_GEMM_MIN_ROWS, 4, 5, 8, 9, 12, 33],
                         ids=lambda r: f"rows{r}")
def test_linear_half_weights_match_fp32_product(rows, half_gemm_impl):
    """Half-precision weights: native up to 8 rows ``half_gemv`` on the weight, then
    ``half_gemm`` on it (no copy); without them one row runs torch's bf16 GEMV, more rows a
    packed fp32 copy. All equal the fp32 product rounded to bf16 (up to accumulation order:
    1 bf16 ulp)."""
    gen = _gen(30)
    w = (torch.randn(67, 45, generator=gen) / 7).bfloat16()
    x = torch.randn(rows, 45, generator=gen).bfloat16()
    native_ = half_gemm_impl == "native"
    assert use_half_gemv(x, w, native_) == (native_ and rows <= 8)
    assert use_fp32_gemm(x, w, native_) == (rows >= CPU_HALF_GEMM_MIN_ROWS and not native_)
    packed = pack_weight(w) if use_fp32_gemm(x, w, native_) else None
    expect = (x.float() @ w.float().t()).bfloat16().float()
    got = linear(x, w, packed, native_)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 67)
    torch.testing.assert_close(got.float(), expect, rtol=8e-3, atol=1e-6)
    x3 = x.view(1, rows, 45)  # leading dims pass through
    assert torch.equal(linear(x3, w, packed, native_).view(rows, 67), got)


def test_packed_weight_layouts_compute_the_same_product(monkeypatch):
    """oneDNN's packed layout and the plain fp32 fallback (the copies kept where the compiled
    half kernels do not run) and the compiled ``half_gemm`` on the weight: the same product."""
    import importlib

    lin = importlib.import_module("hybridrt.kernels.linear")  # the module, not the function

    gen = _gen(31)
    w = torch.randn(300, 64, generator=gen).bfloat16()
    x = torch.randn(2, 7, 64, generator=gen)
    layouts = {}
    expect = x @ w.float().t()
    if native.half_gemm_available():
        assert_rel_close(linear(x, w).float(), expect, 8e-3, "half_gemm")
    layouts["onednn"] = pack_weight(w)
    assert layouts["onednn"].is_mkldnn == torch.backends.mkldnn.is_available()
    monkeypatch.setattr(lin, "_onednn_available", lambda: False)
    layouts["plain"] = pack_weight(w)
    assert not layouts["plain"].is_mkldnn and layouts["plain"].dtype == torch.float32
    for name, p in layouts.items():
        assert_rel_close(linear_fp32(x, w, p), expect, TOL, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M,N,K", [(1, 16, 8), (2, 17, 9), (5, 33, 300), (7, 48, 257),
                                   (13, 100, 45), (33, 31, 64), (70, 40, 4100), (9, 5, 19)],
                         ids=lambda v: str(v))
def test_native_half_gemm_against_fp64(M, N, K, dtype):
    """Every tile shape (1-6 rows: 7 = 4 + 3, 13 = 5 + 4 + 4, 33 = 6 6 6 5 5 5), a partial last
    panel (N % 16, and N < 8: the second half of a panel empty), K past a 256-input block and K
    off a multiple of 8 (the transposing widen's tail), rows past one 1 MiB block of x (K=4100:
    60 rows a block)."""
    _require_half_kernels()
    w, x, ref = _half_operands(M, N, K, dtype, seed=M * 1000 + N)
    y = native.half_gemm(x, w)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert_rel_close(y.double(), ref, TOL, f"M={M} N={N} K={K}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K", [(1, 8), (7, 45), (34, 300), (64, 1024)], ids=lambda v: str(v))
def test_native_half_gemv_against_fp64(M, N, K, dtype):
    """Every row count, weight-row blocks of 4 and 2 with a tail, K with and without a tail
    past its multiple of 8."""
    _require_half_kernels()
    w, x, ref = _half_operands(M, N, K, dtype, seed=M * 100 + N)
    y = native.half_gemv(x, w)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert_rel_close(y.double(), ref, TOL, f"M={M} N={N} K={K}")


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def test_half_paths_follow_the_cpu():
    """Every half path this CPU can run is built (bf16dot exactly where the CPU has
    AVX512-BF16), the default is the fastest, and HYBRIDRT_HALF_PATH picks or refuses."""
    from hybridrt.env import kernel_options

    _require_half_kernels()
    flags = _cpu_flags()
    paths = native.half_paths()
    assert paths[0] == "fma"
    if flags:
        assert ("bf16dot" in paths) == ("avx512_bf16" in flags and "avx512f" in flags)
    assert native.half_path(kernel_options({}).half_path) == paths[-1]
    assert native.half_path(kernel_options({"HYBRIDRT_HALF_PATH": "fma"}).half_path) == "fma"
    with pytest.raises(ValueError, match="HYBRIDRT_HALF_PATH='vnni': use auto, fma or bf16dot"):
        kernel_options({"HYBRIDRT_HALF_PATH": "vnni"})
    with pytest.raises(ValueError, match="HYBRIDRT_HALF_PATH='vnni': use auto, fma or bf16dot"):
        native.half_path("vnni")
    if "bf16dot" not in paths:
        with pytest.raises(ValueError, match="not built for this CPU"):
            native.half_path(kernel_options({"HYBRIDRT_HALF_PATH": "bf16dot"}).half_path)


_BUILT_HALF_PATHS = native.half_paths()  # (builds the kernels once, at collection)


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.skipif(
    p not in _BUILT_HALF_PATHS, reason=f"half path {p} not built for this CPU"))
    for p in native.HALF_PATHS])
@pytest.mark.parametrize("M,N,K", [(1, 16, 8), (3, 17, 34), (4, 7, 66), (2, 9, 200), (5, 33, 300),
                                   (13, 100, 46), (25, 31, 64), (30, 40, 4100), (9, 5, 18),
                                   (7, 9, 45)],
                         ids=lambda v: str(v))
def test_half_paths_on_bf16_activations(M, N, K, path):
    """bf16 activations times bf16 weights in ``half_gemm`` (and ``half_gemv`` up to 4 rows) on
    each path built here: every tile
    size of either path (up to 12 rows: 25 = 9 8 8, 30 = 10 10 10), a partial last panel (and
    N < 8), K past a 256-input block and off a multiple of 8 pairs, odd K (which bf16dot leaves
    to fma) -> the fp64 product of the same bf16 values."""
    w, x, _ = _half_operands(M, N, K, torch.bfloat16, seed=M * 31 + N)
    x = x.bfloat16()
    ref = x.double() @ w.double().t()
    y = native.half_gemm(x, w, path=path)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert_rel_close(y.double(), ref, TOL, f"{path} M={M} N={N} K={K}")
    if M <= native.HALF_GEMV_MAX_ROWS:  # and the GEMV (bf16dot: 64 inputs a step, tails masked)
        y = native.half_gemv(x, w, path=path)
        assert_rel_close(y.double(), ref, TOL, f"gemv {path}")
        # bf16 outputs: the same sums rounded to nearest even, as .to(bf16) rounds them
        assert torch.equal(native.half_gemv(x, w, path=path, out_dtype=torch.bfloat16),
                           y.to(torch.bfloat16))


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.skipif(
    p not in _BUILT_HALF_PATHS, reason=f"half path {p} not built for this CPU"))
    for p in native.HALF_PATHS])
@pytest.mark.parametrize("K", [100, 1024])
def test_half_gemv_rows_do_not_depend_on_the_rows_beside_them(K, path):
    """Each of up to 8 rows comes out bit for bit as it does alone, on every path (what makes
    a verification of up to 7 drafts reproduce decoding exactly): the row groups of 4 and the
    second pass over each weight row for rows 5-8."""
    w, x, _ = _half_operands(8, 37, K, torch.bfloat16, seed=K)
    x = x.bfloat16()
    alone = torch.cat([native.half_gemv(x[i:i + 1], w, path=path) for i in range(8)])
    for M in range(1, 9):
        for i in range(0, 8 - M + 1, 3):
            assert torch.equal(native.half_gemv(x[i:i + M], w, path=path), alone[i:i + M]), (M, i)


def test_native_half_gemm_rejects_bad_shapes():
    _require_half_kernels()
    w = torch.randn(40, 24).bfloat16()
    with pytest.raises(ValueError, match=r"x must be \[M, 24\]"):
        native.half_gemm(torch.randn(2, 23), w)
    with pytest.raises(ValueError, match="contiguous CPU bf16/fp16"):
        native.half_gemm(torch.randn(2, 24), w.float())
    with pytest.raises(ValueError, match="contiguous CPU bf16/fp16"):
        native.half_gemm(torch.randn(2, 40), w.t())
    assert native.half_gemm(torch.randn(0, 24), w).shape == (0, 40)
    with pytest.raises(ValueError, match=r"x must be \[M <= 8, 24\]"):
        native.half_gemv(torch.randn(9, 24), w)
    with pytest.raises(ValueError, match="contiguous CPU bf16/fp16"):
        native.half_gemv(torch.randn(2, 40), w.t())
    empty = torch.randn(40, 0).bfloat16()
    assert torch.equal(native.half_gemm(torch.randn(2, 0), empty), torch.zeros(2, 40))


# ------------------------------------------------------------------------------------------
# Norms
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_formula_and_transformers(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    gen = _gen(13)
    x = (3 * torch.randn(5, 7, 33, generator=gen)).to(dtype)
    w = 0.1 * torch.randn(33, generator=gen)
    xf = x.float()
    expect = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    got = rms_norm(x, w.to(dtype), 1e-6)
    assert got.dtype == dtype
    assert_rel_close(got.float(), expect.to(dtype).float(), 1e-5 if dtype == torch.float32
                     else 8e-3, "rms_norm")
    hf = Qwen3_5RMSNorm(33, eps=1e-6).to(dtype)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(got, hf(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_rms_norm_matches_formula_and_transformers(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    gen = _gen(14)
    x = (2 * torch.randn(6, 3, 9, generator=gen)).to(dtype)
    z = torch.randn(6, 3, 9, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(9, generator=gen)).to(dtype)
    xf = x.float()
    expect = w.float() * xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) \
        * z.float() * torch.sigmoid(z.float())
    got = gated_rms_norm(x, z, w, 1e-6)
    assert got.dtype == dtype
    assert_rel_close(got.float(), expect, 1e-5 if dtype == torch.float32 else 2e-2,
                     "gated_rms_norm")
    hf = Qwen3_5RMSNormGated(9, eps=1e-6).to(dtype)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(got, hf(x, z), rtol=0, atol=0)


def test_l2_norm_matches_formula():
    x = torch.randn(4, 3, 11, generator=_gen(15))
    torch.testing.assert_close(l2_norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    assert torch.allclose(l2_norm(x).norm(dim=-1), torch.ones(4, 3), atol=1e-5)


# ------------------------------------------------------------------------------------------
# Partial RoPE
# ------------------------------------------------------------------------------------------


def _hf_rotary(text_config):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    cfg = dict(text_config)
    cfg.pop("model_type", None)
    return Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**cfg))


@pytest.mark.parametrize("shape", ["tiny-R6-D12", "0.8B-R64-D256"])
def test_rope_cos_sin_matches_transformers_mrope_for_text(shape):
    """Text-only input: the three M-RoPE rows are equal, so interleaved M-RoPE == 1-D RoPE."""
    from hybridrt.testing import QWEN35_08B_TEXT_CONFIG, tiny_text_config

    text = tiny_text_config() if shape.startswith("tiny") else QWEN35_08B_TEXT_CONFIG
    rope = text["rope_parameters"]
    R = int(text["head_dim"] * rope["partial_rotary_factor"])
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 1000, 4095])
    cos, sin = rope_cos_sin(positions, R, rope["rope_theta"], torch.float32)
    hf_cos, hf_sin = _hf_rotary(text)(torch.zeros(1, dtype=torch.float32), positions[None])
    assert cos.shape == (positions.numel(), R)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("T,H,D,R", [(9, 3, 12, 6), (5, 2, 10, 4), (4, 2, 8, 8)],
                         ids=lambda v: str(v))
def test_partial_rope_matches_transformers_and_passes_through(T, H, D, R):
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    gen = _gen(16)
    q = torch.randn(T, H, D, generator=gen)
    k = torch.randn(T, 1, D, generator=gen)
    positions = torch.arange(T) * 7 + 3
    cos, sin = rope_cos_sin(positions, R, 10000.0, torch.float32)
    q_out, k_out = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
    # dims >= R untouched, bitwise
    assert torch.equal(q_out[..., R:], q[..., R:])
    assert torch.equal(k_out[..., R:], k[..., R:])
    # rotate-half pairs (i, i + R/2) keep their norm; the rotated part really moves
    half = R // 2

    def pair_norm(t):
        return t[..., :half] ** 2 + t[..., half:R] ** 2

    torch.testing.assert_close(pair_norm(q_out), pair_norm(q))
    assert not torch.allclose(q_out[..., :R], q[..., :R])
    # transformers layout: [B, H, T, D] with cos/sin [B, T, R]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos[None], sin[None])
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out, hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_rope_position_zero_is_identity():
    x = torch.randn(1, 2, 12)
    cos, sin = rope_cos_sin(torch.tensor([0]), 6, 1e7, torch.float32)
    assert torch.equal(apply_partial_rope(x, cos, sin), x)


# ------------------------------------------------------------------------------------------
# Paged attention
# ------------------------------------------------------------------------------------------


def dense_reference(q, k, v, ctx, scale):
    """One sequence, plain softmax: q [n, H, D] at positions ctx-n.., k/v [ctx, HKV, D]."""
    n, H, _ = q.shape
    HKV = k.shape[1]
    out = torch.empty_like(q)
    for h in range(H):
        kv = h // (H // HKV)  # consecutive query heads share a kv head
        scores = (q[:, h] @ k[:, kv].t()) * scale  # [n, ctx]
        pos = torch.arange(ctx - n, ctx)
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos[:, None], float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, kv]
    return out


def paged_setup(ctx_q, H=6, HKV=2, D=10, block_size=8, num_blocks=48, seed=17):
    """Random KV for each sequence written into shuffled, non-contiguous blocks.
    ctx_q: [(context length incl. new tokens, new tokens)] per sequence."""
    gen = _gen(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = 5 * torch.randn(num_blocks, block_size, HKV, D, generator=gen)  # garbage
    v_cache = 5 * torch.randn(num_blocks, block_size, HKV, D, generator=gen)
    seqs, tables, qs = [], [], []
    for ctx, _ in ctx_q:
        nb = -(-ctx // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        k = torch.randn(ctx, HKV, D, generator=gen)
        v = torch.randn(ctx, HKV, D, generator=gen)
        pos = torch.arange(ctx)
        slot_mapping = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        seqs.append((k, v))
        tables.append(blocks)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [perm[0]] * (width - len(t)) for t in tables])
    for _ctx, n in ctx_q:
        qs.append(torch.randn(n, H, D, generator=gen))
    query = torch.cat(qs)
    cu = torch.tensor([0] + [n for _, n in ctx_q]).cumsum(0)
    seq_lens = torch.tensor([c for c, _ in ctx_q])
    return query, k_cache, v_cache, cu, seq_lens, block_tables, seqs, D**-0.5


MIXED = [(17, 1), (40, 40), (1, 1), (33, 9), (64, 64), (5, 1), (70, 1)]


def test_paged_attention_mixed_batch_matches_dense_reference():
    query, kc, vc, cu, seq_lens, bt, seqs, scale = paged_setup(MIXED)
    out = paged_attention(query, kc, vc, cu, seq_lens, bt, scale)
    for b, ((ctx, n), (k, v)) in enumerate(zip(MIXED, seqs)):
        s, e = cu[b].item(), cu[b + 1].item()
        ref = dense_reference(query[s:e], k, v, ctx, scale)
        assert_rel_close(out[s:e], ref, TOL, f"seq {b} (ctx {ctx}, q_len {n})")
    # host-side lengths give the same answer
    out2 = paged_attention(query, kc, vc, cu, seq_lens, bt, scale,
                           query_lens=[n for _, n in MIXED], context_lens=[c for c, _ in MIXED])
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_paged_attention_prefill_equals_varlen_causal_attention():
    ctx_q = [(40, 40), (1, 1), (63, 63), (9, 9)]
    query, kc, vc, cu, seq_lens, bt, seqs, scale = paged_setup(ctx_q, seed=18)
    out = paged_attention(query, kc, vc, cu, seq_lens, bt, scale)
    k = torch.cat([k for k, _ in seqs])
    v = torch.cat([v for _, v in seqs])
    dense = varlen_causal_attention(query, k, v, cu, scale)
    assert_rel_close(out, dense, TOL, "paged vs varlen")
    for b, ((ctx, _), (kb, vb)) in enumerate(zip(ctx_q, seqs)):
        s, e = cu[b].item(), cu[b + 1].item()
        assert_rel_close(dense[s:e], dense_reference(query[s:e], kb, vb, ctx, scale), TOL,
                         f"varlen seq {b}")


def test_paged_attention_sequences_never_see_each_others_kv():
    """Rewriting every block a sequence does not own leaves its output bitwise unchanged."""
    query, kc, vc, cu, seq_lens, bt, _, scale = paged_setup(MIXED, seed=19)
    out = paged_attention(query, kc, vc, cu, seq_lens, bt, scale)
    for b, (ctx, _) in enumerate(MIXED):
        owned = bt[b, : -(-ctx // kc.shape[1])].tolist()
        others = [i for i in range(kc.shape[0]) if i not in owned]
        kc2, vc2 = kc.clone(), vc.clone()
        kc2[others] = 1e3 * torch.randn(len(others), *kc.shape[1:])
        vc2[others] = 1e3 * torch.randn(len(others), *vc.shape[1:])
        out2 = paged_attention(query, kc2, vc2, cu, seq_lens, bt, scale)
        s, e = cu[b].item(), cu[b + 1].item()
        assert torch.equal(out2[s:e], out[s:e]), f"sequence {b} read a block it does not own"


def test_varlen_causal_attention_isolates_sequences():
    gen = _gen(20)
    cu = torch.tensor([0, 5, 12, 13])
    q = torch.randn(13, 4, 8, generator=gen)
    k = torch.randn(13, 2, 8, generator=gen)
    v = torch.randn(13, 2, 8, generator=gen)
    out = varlen_causal_attention(q, k, v, cu, 8**-0.5)
    k2, v2 = k.clone(), v.clone()
    k2[5:12] += 10.0
    v2[5:12] -= 10.0
    out2 = varlen_causal_attention(q, k2, v2, cu, 8**-0.5)
    torch.testing.assert_close(out2[:5], out[:5], rtol=0, atol=0)
    torch.testing.assert_close(out2[12:], out[12:], rtol=0, atol=0)
    assert not torch.allclose(out2[5:12], out[5:12])


def test_paged_attention_rejects_bad_gqa():
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(torch.randn(1, 5, 4), torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4),
                        torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([[0]]), 0.5)
