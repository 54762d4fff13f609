"""What a backend reads of one mixer layer: its small weights and its sizes, as tensors and
ints (no model modules). The model builds one record per layer (``hybridrt/model.py``,
``GatedAttention.spec`` / ``GatedDeltaNet.spec``) and passes it with the projections' outputs;
the projections themselves stay with the model (``Linear``, merged at bind time).

A record holds the layer's parameters themselves (not copies or views), so it follows a
``.to()`` of the model; the model builds it anew after a ``load_state_dict(assign=True)``.
Records compare by identity: a backend may key per-layer caches on one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False, slots=True)
class AttentionLayer:
    """A gated full-attention layer: q/k RMSNorm weights [D] and eps, head counts and size,
    and the key/value cache pair it owns."""

    q_norm_weight: torch.Tensor
    k_norm_weight: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cache_index: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass(eq=False, slots=True)
class GDNLayer:
    """A Gated DeltaNet layer: the depthwise conv's weight [C, 1, K], A_log and dt_bias [HV],
    the gated output norm's weight [DV] and eps, head counts and sizes, and the row of the
    conv / recurrent state pools it owns."""

    conv1d_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int
    state_index: int

    @property
    def conv_weight(self) -> torch.Tensor:
        """The conv taps [C, K] (a view)."""
        return self.conv1d_weight[:, 0, :]

    @property
    def kernel_size(self) -> int:
        return self.conv1d_weight.shape[-1]

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    def split(self, mixed: torch.Tensor):
        """[n, conv_dim] conv output -> q, k [n, HK, DK], v [n, HV, DV] (views)."""
        n = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )
