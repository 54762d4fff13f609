"""What a backend reads of the model: records of tensors and ints, never its modules.

- ``AttentionLayer`` / ``GDNLayer``: one mixer layer's small weights and sizes. The model builds
  one per layer (``hybridrt/model.py``, ``GatedAttention.spec`` / ``GatedDeltaNet.spec``) and
  passes it with the projections' outputs.
- ``DecoderLayerRecord`` / ``ModelRecord``: the whole decoder as a backend's own decode loop
  runs it (norms, the weights each product reads, the mixer's record), handed to ``bind``
  once (``Qwen35ForCausalLM.record``), after the weights were laid out.

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


@dataclass(eq=False, slots=True)
class MoeRecord:
    """A sparse MoE block (``hybridrt/moe_block.py``): the router's weight [E, H] and the
    shared expert's gate [1, H] (the model's dtype), ``top_k``, per expert its (gate|up
    [2I, H], down [H, I]) weights, the shared expert's (gate, up) weights (a merged group)
    and its down weight, as ``quant.kernel_weight`` gives them."""

    router: torch.Tensor
    shared_gate: torch.Tensor
    top_k: int
    experts: list
    shared_in: tuple
    shared_out: object

    @property
    def intermediate(self) -> int:
        """An expert's FFN width (``moe_intermediate_size``)."""
        return self.experts[0][1].shape[1]


@dataclass(eq=False, slots=True)
class DecoderLayerRecord:
    """One decoder layer: its mixer's record (``mixer_layer``), the input and post-mixer
    RMSNorm weights [D] and their eps, and the weights its products read
    (``quant.kernel_weight`` of each projection, in output order): ``mixer_in`` q|k|v
    (attention) or qkv|z|b|a (GDN), ``mixer_out`` o_proj / out_proj, ``mlp_in`` gate|up,
    ``mlp_out`` down_proj; ``sparse_mlp``: the MLP is a sparse MoE block
    (``hybridrt/moe_block.py``, ``mlp_in`` empty and ``mlp_out`` None; ``moe`` its record)."""

    mixer_layer: AttentionLayer | GDNLayer
    input_norm_weight: torch.Tensor
    post_norm_weight: torch.Tensor
    eps: float
    mixer_in: tuple
    mixer_out: object
    mlp_in: tuple
    mlp_out: object
    sparse_mlp: bool = False
    moe: MoeRecord | None = None


@dataclass(eq=False, slots=True)
class ModelRecord:
    """The decoder's layers in order and the final RMSNorm's weight [D] and eps; its dtype is
    the activations' (that of the final norm's weight)."""

    decoder: list[DecoderLayerRecord]
    norm_weight: torch.Tensor
    norm_eps: float

    @property
    def dtype(self) -> torch.dtype:
        return self.norm_weight.dtype
