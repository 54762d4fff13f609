"""Gated delta rule (the GDN recurrence) over per-sequence state slots, plain torch.

Per value head, with state S [DK, DV] kept in fp32, for each token t:
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t
q and k are l2-normalised (eps 1e-6) and q is scaled by DK^-0.5 inside these functions.
Grouped value heads: key head h serves value heads h*r .. h*r+r-1 (r = HV / HK).

``chunk_gated_delta_rule`` (prefill) uses the chunked WY/UT form; ``recurrent_gated_delta_rule``
(decode, draft verification) steps token by token; ``naive_gated_delta_rule`` is the plain loop
that both are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .meta import as_arrays
from .norm import l2_norm


def _prepare(q, k, v, g, beta):
    """-> fp32 q, k, v, g, beta with q/k normalised, scaled and expanded to HV heads."""
    HK, HV = k.shape[-2], v.shape[-2]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    q = l2_norm(q.float()) * q.shape[-1] ** -0.5
    k = l2_norm(k.float())
    if HV != HK:
        q = q.repeat_interleave(HV // HK, dim=-2)
        k = k.repeat_interleave(HV // HK, dim=-2)
    return q, k, v.float(), g.float(), beta.float()


def _check(q, k, v, g, beta, states):
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must match")
    if v.shape[:-2] != q.shape[:-2] or g.shape != v.shape[:-1] or beta.shape != v.shape[:-1]:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}"
        )
    HV, DK, DV = v.shape[-2], q.shape[-1], v.shape[-1]
    if states.dim() != 4 or tuple(states.shape[1:]) != (HV, DK, DV):
        raise ValueError(f"states must be [S, {HV}, {DK}, {DV}], got {tuple(states.shape)}")
    if states.dtype != torch.float32:
        raise ValueError(f"recurrent states must be float32, got {states.dtype}")


def _chunk_one(q, k, v, g, beta, state, chunk_size):
    """G independent sequences of T tokens (G: sequences x heads). q,k: [G, T, DK],
    v: [G, T, DV], g/beta: [G, T] (fp32, prepared); state: [G, DK, DV], updated in place, or
    None for zeros (new prompts: every term that reads the state is skipped) -> (o [G, T, DV],
    final state)."""
    H, T, DK = q.shape
    DV = v.shape[-1]
    C = chunk_size
    pad = (C - T % C) % C
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    q, k, v = (x.reshape(H, N, C, -1) for x in (q, k, v))
    g, beta = g.reshape(H, N, C), beta.reshape(H, N, C)

    gc = g.cumsum(-1)  # log decay from chunk start to position i (inclusive)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # UT transform: (I + strictly_lower(diag(beta) K K^T * decay))^-1
    lower = (k_beta @ k.transpose(-1, -2)) * decay
    lower = lower.masked_fill(~causal.tril(-1), 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    # the inverse itself (C right-hand sides, as fla computes it), then two batched products:
    # cheaper than solving for v's and k's DV + DK columns
    inv = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False,
                                        unitriangular=True)
    u = inv @ (v * beta[..., None])
    w = None
    if state is not None or N > 1:
        w = inv @ (k_beta * gc.exp()[..., None])
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk, diagonal included
    q_decayed = q * gc.exp()[..., None]
    k_to_end = (k * (gc[..., -1:] - gc).exp()[..., None]).transpose(-1, -2)
    chunk_decay = gc[..., -1].exp()  # [H, N]

    o = torch.empty(H, N, C, DV, dtype=q.dtype, device=q.device)
    S = state
    for i in range(N):
        if S is None:  # zero state: v_new = u, no inter-chunk term
            v_new = u[:, i]
            torch.bmm(attn[:, i], v_new, out=o[:, i])
            S = torch.bmm(k_to_end[:, i], v_new)
            continue
        v_new = u[:, i] - w[:, i] @ S
        o[:, i] = torch.baddbmm(attn[:, i] @ v_new, q_decayed[:, i], S)
        S.mul_(chunk_decay[:, i, None, None]).baddbmm_(k_to_end[:, i], v_new)
    return o.reshape(H, N * C, DV)[:, :T], S


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
    seq_lens: list[int] | None = None,
    plan: list[ChunkGroup] | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over a packed batch.

    q, k: [T, HK, DK]; v: [T, HV, DV]; g (log decay, <= 0), beta: [T, HV]; cu_seqlens: [B+1];
    states: [S, HV, DK, DV] fp32 slot pool; state_slots: [B]; has_initial_state: [B] bool.
    Returns o: [T, HV, DV] in v's dtype. Each sequence starts from its slot (or zeros) and its
    final state is written back to that slot; other slots are untouched. ``plan``:
    ``chunk_plan(...)`` of this batch when the caller has it (built from host copies here
    otherwise).
    """
    _check(q, k, v, g, beta, states)
    if plan is None:
        lens = seq_lens if seq_lens is not None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        plan = chunk_plan(lens, state_slots.tolist(), has_initial_state.tolist(), v.device,
                          chunk_size)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    T, H = vf.shape[:2]
    DK, DV = qf.shape[-1], vf.shape[-1]
    zq, zk, zv = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (qf, kf, vf))
    zg, zb = (torch.cat([x, x.new_zeros(1, H)]) for x in (gf, bf))
    out = torch.empty(T + 1, H, DV, dtype=torch.float32, device=v.device)
    for grp in plan:
        G, Tp = grp.slots.numel(), grp.num_chunks * grp.chunk_size
        idx = grp.rows
        # [T+1, H, ...] -> [G*H, Tp, ...]
        qh, kh, vh, gh, bh = (x[idx].transpose(1, 2).reshape(G * H, Tp, *x.shape[2:])
                              for x in (zq, zk, zv, zg, zb))
        s0 = None  # all new prompts: no state to read
        if grp.any_initial:
            s0 = states.index_select(0, grp.slots)
            s0 = torch.where(grp.has_initial_state.view(G, 1, 1, 1), s0, 0.0)  # NaN-safe
            s0 = s0.view(G * H, DK, DV)
        o, s1 = _chunk_one(qh, kh, vh, gh, bh, s0, grp.chunk_size)
        out[idx] = o.view(G, H, Tp, DV).transpose(1, 2)  # padding rows all land on row T
        states.index_copy_(0, grp.slots, s1.view(G, H, DK, DV))
    return out[:T].to(v.dtype)


@dataclass(slots=True)
class ChunkGroup:
    """Sequences of one ``chunk_gated_delta_rule`` call that run as one batch: the same chunk
    size and chunk count. ``rows`` [G, N * C]: each one's packed token rows, padded with row
    T (a zero row: g = 0, beta = 0, k = 0 leave the state unchanged)."""

    chunk_size: int
    num_chunks: int
    rows: torch.Tensor
    slots: torch.Tensor  # [G]
    has_initial_state: torch.Tensor  # [G] bool
    any_initial: bool


def chunk_plan(lens: list[int], state_slots: list[int], has_initial_state: list[bool],
               arrays, chunk_size: int = 64) -> list[ChunkGroup]:
    """Group the sequences of a packed batch (host lists, one entry per sequence) for
    ``chunk_gated_delta_rule``: built once per step and shared by every GDN layer.
    ``arrays``: the step's arrays (kernels/meta.py), or a device (new arrays there)."""
    arr = as_arrays(arrays)
    groups: dict[tuple[int, int], list[int]] = {}
    for b, n in enumerate(lens):
        if n:
            C = min(chunk_size, max(16, 1 << (n - 1).bit_length()))  # short prompts: C < 64
            groups.setdefault((C, -(-n // C)), []).append(b)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    T = starts[-1]
    plan = []
    for (C, N), bs in groups.items():
        rows = [[starts[b] + t if t < lens[b] else T for t in range(N * C)] for b in bs]
        init = [bool(has_initial_state[b]) for b in bs]
        plan.append(ChunkGroup(
            C, N, arr.tensor(arr.put(rows)), arr.tensor(arr.put([state_slots[b] for b in bs])),
            arr.tensor(arr.put(init, np.bool_)), any(init),
        ))
    return plan


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots in batch order -> [(batch start, first slot, count)].
    ``[5, 6, 7, 2, 3]`` -> ``[(0, 5, 3), (3, 2, 2)]``."""
    runs: list[tuple[int, int, int]] = []
    for b, s in enumerate(slots):
        if runs and s == runs[-1][1] + runs[-1][2]:
            b0, s0, n = runs[-1]
            runs[-1] = (b0, s0, n + 1)
        else:
            runs.append((b, s, 1))
    return runs


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    state_slots_out: torch.Tensor | None = None,
    runs: list[tuple[int, int, int]] | None = None,
    step=None,
) -> torch.Tensor:
    """Token-by-token gated delta rule for L tokens of each of B sequences (decode: L = 1).

    q, k: [B, L, HK, DK]; v: [B, L, HV, DV]; g, beta: [B, L, HV]; states: [S, HV, DK, DV]
    fp32; state_slots: [B] initial states (always read: a new sequence's slot must be zeroed).
    Without ``state_slots_out`` the final state goes back to ``state_slots``; with it, [B, L],
    the state after token t is written to ``state_slots_out[b, t]`` (draft verification keeps
    every intermediate state so it can continue from the last accepted one without recompute).
    ``runs``: ``slot_runs(state_slots)`` when the caller has it (computed here otherwise).
    ``step``: a kernel for one token per sequence, updating ``pool[slots]`` in place
    (``step(pool, slots, q, k, v, decay, beta) -> o [B, H, DV]`` or None to fall back); the
    CPU backend passes its compiled one. Default: the torch ops.
    Returns o: [B, L, HV, DV] in v's dtype.

    Decode (L = 1, no ``state_slots_out``) updates the states in place in the pool, with no
    gather or scatter copies: the state pool is the largest thing a decode step touches (1 MB
    per slot and layer at the 0.8B shape). A ``step`` kernel indexes the slots itself; the
    torch ops work on one slice of the pool per run of consecutive slots.
    Verification gathers its B states once and writes each token's copies.
    """
    _check(q, k, v, g, beta, states)
    B, L = v.shape[:2]
    if state_slots_out is not None and tuple(state_slots_out.shape) != (B, L):
        raise ValueError(f"state_slots_out must be [{B}, {L}], got {tuple(state_slots_out.shape)}")
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    H, DK, DV = states.shape[1:]
    if L == 1 and state_slots_out is None:
        def views():  # for the torch fallback only
            r = runs if runs is not None else slot_runs(state_slots.tolist())
            return [(slice(b0 * H, (b0 + n) * H), states[s0:s0 + n].view(n * H, DK, DV))
                    for b0, s0, n in r]
        o = _step(qf[:, 0], kf[:, 0], vf[:, 0], gf[:, 0], bf[:, 0], states, state_slots, views,
                  step)
        return o.unsqueeze(1).to(v.dtype)
    S = states.index_select(0, state_slots)  # [B, H, DK, DV], updated in place below
    own = torch.arange(B, device=S.device)
    whole = [(slice(0, B * H), S.view(B * H, DK, DV))]
    out = torch.empty(B, L, H, DV, dtype=torch.float32, device=v.device)
    for t in range(L):
        out[:, t] = _step(qf[:, t], kf[:, t], vf[:, t], gf[:, t], bf[:, t], S, own,
                          lambda: whole, step)
        if state_slots_out is not None:
            states.index_copy_(0, state_slots_out[:, t], S.view(B, H, DK, DV))
    if state_slots_out is None:
        states.index_copy_(0, state_slots, S.view(B, H, DK, DV))
    return out.to(v.dtype)


def _step(q, k, v, g, beta, pool, slots, views, step=None):
    """One token per sequence from ``pool[slots]``, updated in place: ``step`` when given and
    it runs here, else the torch ops over ``views()``, views of the same states (made only
    then)."""
    o = None if step is None else step(pool, slots, q, k, v, g.exp(), beta)
    return o if o is not None else _step_in_place(q, k, v, g, beta, views())


def _step_in_place(q, k, v, g, beta, views):
    """One token per sequence. q, k: [B, H, DK]; v: [B, H, DV]; g, beta: [B, H] (prepared
    fp32); ``views``: (rows of the B*H (sequence, head) pairs, their states [rows, DK, DV])
    covering all B*H, updated in place. With S the old state and d = exp(g):
        S' = d S + k delta^T,  delta = beta (v - d S^T k),  o = S'^T q = d S^T q + (q.k) delta
    so one batched product [k; q]^T S reads each state once before the update. -> o [B, H, DV]"""
    B, H, DK = q.shape
    DV = v.shape[-1]
    kq = torch.stack((k, q), dim=2).view(B * H, 2, DK)
    proj = torch.empty(B * H, 2, DV, dtype=torch.float32, device=q.device)
    for rows, S in views:
        torch.bmm(kq[rows], S, out=proj[rows])
    decay = g.exp().reshape(B * H, 1)
    proj.mul_(decay.unsqueeze(-1))  # [d S^T k, d S^T q]
    delta = (v.reshape(B * H, DV) - proj[:, 0]) * beta.reshape(B * H, 1)
    o = torch.addcmul(proj[:, 1], (q * k).sum(-1).reshape(B * H, 1), delta)
    k_col = k.reshape(B * H, DK, 1)
    delta_row = delta.view(B * H, 1, DV)
    for rows, S in views:
        S.mul_(decay[rows].view(-1, 1, 1))
        S.baddbmm_(k_col[rows], delta_row[rows])
    return o.view(B, H, DV)


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one sequence, plain loop. q, k: [T, HK, DK]; v: [T, HV, DV]; g, beta: [T, HV];
    initial_state: [HV, DK, DV] or None -> (o [T, HV, DV] fp32, final state fp32)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    T, H, DK = qf.shape
    S = (
        torch.zeros(H, DK, vf.shape[-1])
        if initial_state is None
        else initial_state.float().clone()
    )
    out = torch.empty(T, H, vf.shape[-1])
    for t in range(T):
        for h in range(H):
            S[h] = gf[t, h].exp() * S[h]
            S[h] = S[h] + torch.outer(kf[t, h], bf[t, h] * (vf[t, h] - S[h].t() @ kf[t, h]))
            out[t, h] = S[h].t() @ qf[t, h]
    return out, S
