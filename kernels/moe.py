"""Sparse mixture-of-experts on a backend's products: the block (``sparse_moe``), the router's
choice (``route``) and the routed experts' SwiGLU over the tokens grouped by expert
(``routed_experts``).

Each chosen expert's weights are read once per step, by one product over the rows of every
token that chose it (the backend's ``linear``: its few-row GEMV for a decode, its GEMM for
more rows; bf16, int8 or 4-bit weights alike); the experts nobody chose are not read. Each
token's expert outputs are summed in ascending expert order, as transformers' eager experts
sum them, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kernels/backend imports this module
    from .backend.layers import MoeRecord


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]): the
    softmax in fp32, ``torch.topk`` of it (its order, and its choice among equal
    probabilities), the k weights renormalised to sum to 1 in fp32 and only then rounded to
    the logits' dtype, as transformers' ``Qwen3_5MoeTopKRouter``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   experts: Sequence[tuple[object, object]], backend) -> torch.Tensor:
    """x [T, H], the router's ``weights`` and ``ids`` [T, k], ``experts[e]`` expert e's
    (gate|up weight [2I, H], down weight [H, I]) as ``backend.linear`` takes them ->
    sum over each token's k experts of weight * down(silu(gate x) * up x), [T, H] in x's
    dtype. Tokens are grouped by expert (a stable sort of the flattened ids): one gate|up
    and one down product per chosen expert."""
    k = ids.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
    w = weights.reshape(-1, 1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in zip(chosen.tolist(), counts.tolist()):
        picks = order[start:start + n]  # positions in the flattened [T * k] choices
        start += n
        rows = picks // k  # the tokens that chose expert e, ascending
        gate_up, down = experts[e]
        gate, up = backend.linear(x.index_select(0, rows), gate_up).chunk(2, dim=-1)
        y = backend.linear(backend.silu_mul(gate, up), down)
        out.index_add_(0, rows, y * w.index_select(0, picks))
    return out


def sparse_moe(x: torch.Tensor, rec: MoeRecord, backend) -> torch.Tensor:
    """The MoE block on x [T, H]: the routed experts' weighted sum plus the shared expert
    scaled by sigmoid(shared_expert_gate(x)), every product on ``backend``. The model's
    block and the CPU backend's decode loop both run this (the step programs the same
    operations, kernels/moe_step.py)."""
    weights, ids = route(backend.linear(x, rec.router), rec.top_k)
    routed = routed_experts(x, weights, ids, rec.experts, backend)
    gate, up = backend.project(x, rec.shared_in)
    shared = backend.linear(backend.silu_mul(gate, up), rec.shared_out)
    return routed + torch.sigmoid(backend.linear(x, rec.shared_gate)) * shared
