"""``Backend``: what every kernel backend offers the model and the runner. ``ReferenceBackend``
(plain torch), ``CPUBackend`` (compiled kernels, the reference's steps held, not inherited) and
``CudaBackend`` (Triton) each implement it; the model calls these and nothing else, and hands
a backend records and tensors (``layers.py``), never its modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .layers import AttentionLayer, GDNLayer, ModelRecord
from .plan import StepMeta


@runtime_checkable
class Backend(Protocol):
    """One backend. Bound once (``bind``: the model's record and its merged projection
    groups, after the weights were laid out as ``merges_projections`` / ``huge_pages`` ask),
    attached once to the engine's cache (``attach``), then per step: ``plan_step``, the layers'
    calls, and the whole-step paths where the backend has one (None: the model runs its
    layers)."""

    name: str
    merges_projections: bool  # wants the model's projection groups merged (bind's groups)
    huge_pages: bool  # wants the streamed weights in transparent-huge-page memory

    def bind(self, record: ModelRecord, groups: dict) -> None: ...

    def attach(self, cache) -> None: ...

    def plan_step(self, batch) -> StepMeta: ...

    # products and elementwise ops
    def linear(self, x: torch.Tensor, w) -> torch.Tensor: ...

    def project(self, x: torch.Tensor, weights) -> list[torch.Tensor]: ...

    def logits(self, hidden: torch.Tensor, head, fp32: bool = True) -> torch.Tensor: ...

    def rope(self, positions: torch.Tensor, rotary_dim: int, theta: float,
             dtype: torch.dtype, scaling=None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rms_norm(self, x, weight, eps, residual=None): ...

    def silu_mul(self, gate, up): ...

    # mixers
    def gated_attention(self, meta: StepMeta, batch, layer: AttentionLayer, qg, k, v, key_cache,
                        value_cache, cos, sin) -> torch.Tensor: ...

    def gdn(self, meta: StepMeta, layer: GDNLayer, mixed, z, a, b, conv_states,
            ssm_states) -> torch.Tensor: ...

    # whole steps
    def graph_step(self, batch, cache,
                   eager: Callable[..., torch.Tensor]) -> torch.Tensor | None: ...

    def forward(self, batch, cache, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor | None: ...
